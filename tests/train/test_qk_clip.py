"""k3.train.optim's QK-clip for MLA heads (Kimi K2's MuonClip, kept in K3's recipe; SPEC §7)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from k3 import K3ForCausalLM
from k3.config import preset
from k3.model.sequence.mla import GatedMLA, MLACache
from k3.train.optim import OptimConfig, qk_clip_mla


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sharp_mla(q_lora_rank: int | None, seed: int = 0) -> GatedMLA:
    """A 3-head fp64 GatedMLA with large weights so heads have distinct, large logits."""
    c = preset("tiny")
    c.mla = dataclasses.replace(c.mla, num_heads=3, q_lora_rank=q_lora_rank)
    m = GatedMLA(c).double().requires_grad_(False)
    g = gen(seed)
    for p in m.parameters():
        if p.dim() == 2:
            p.normal_(0.0, 2.0 * p.shape[1] ** -0.5, generator=g)
    # Make head logits unequal: scale each head's query rows.
    q = (m.q_proj if q_lora_rank is None else m.q_b_proj).weight
    q.view(3, -1, q.shape[1]).mul_(torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)[:, None, None])
    return m


def logits_max(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    m.record_max_logits, m.max_logits = True, None
    m(x)
    out, m.record_max_logits, m.max_logits = m.max_logits, False, None
    return out


def head_outputs(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Per-head attention outputs [B, T, H, v] before the gate and o_proj."""
    q, c_kv, k_s, _ = m._project(x)
    return m._attend_full(q, MLACache(c_kv, k_s))


@pytest.mark.parametrize("block", [512, 3], ids=["one block", "query blocks of 3"])
def test_record_max_logits_matches_explicit_scores_and_accumulates(block, monkeypatch):
    monkeypatch.setattr("k3.model.sequence.mla.RECORD_BLOCK", block)
    m = sharp_mla(32)
    x1 = torch.randn(2, 7, 64, generator=gen(14), dtype=torch.float64)
    x2 = 3 * torch.randn(1, 5, 64, generator=gen(15), dtype=torch.float64)
    y_off, _ = m(x1)
    assert m.max_logits is None
    m.record_max_logits = True
    y_on, _ = m(x1)
    assert torch.equal(y_on, y_off)  # observing does not change the output
    first = m.max_logits.clone()
    torch.testing.assert_close(first, explicit_logits(m, x1).amax((0, 2, 3)), atol=1e-12, rtol=0)
    m(x2)
    accumulated = m.max_logits.clone()
    second = logits_max(m, x2)
    assert torch.equal(accumulated, torch.maximum(first, second))
    assert not torch.equal(first, second)


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_qk_clip_mla_bounds_clipped_heads_and_leaves_the_rest(q_lora_rank):
    m = sharp_mla(q_lora_rank)
    x = torch.randn(2, 9, 64, generator=gen(16), dtype=torch.float64)
    before = logits_max(m, x)
    order = before.argsort()
    assert before[order[1]] < before[order[2]] - 1e-3
    tau = float((before[order[0]] + before[order[1]]) / 2)  # clips two heads, leaves the smallest
    clipped = before > tau
    weights = {n: p.clone() for n, p in m.named_parameters()}
    outputs = head_outputs(m, x)

    gamma = qk_clip_mla(m, before, tau)
    torch.testing.assert_close(gamma, torch.where(clipped, tau / before, torch.ones_like(before)))
    after = logits_max(m, x)
    assert (after[clipped] <= tau + 1e-5).all()
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), atol=1e-9, rtol=0)
    assert torch.equal(after[~clipped], before[~clipped])

    nope, shared, v = m.nope_dim, m.shared_dim, m.v_dim
    q_name = "q_proj.weight" if q_lora_rank is None else "q_b_proj.weight"
    q_new = dict(m.named_parameters())[q_name]
    q_old, q_new = weights[q_name].view(3, nope + shared, -1), q_new.view(3, nope + shared, -1)
    kv_old, kv_new = weights["kv_b_proj.weight"].view(3, nope + v, -1), m.kv_b_proj.weight.view(3, nope + v, -1)
    for h in range(3):
        if not clipped[h]:
            assert torch.equal(q_new[h], q_old[h]) and torch.equal(kv_new[h], kv_old[h])
            continue
        root = gamma[h].sqrt()
        torch.testing.assert_close(q_new[h, :nope], q_old[h, :nope] * root)  # content query: √γ
        torch.testing.assert_close(q_new[h, nope:], q_old[h, nope:] * gamma[h])  # shared-key query: γ
        torch.testing.assert_close(kv_new[h, :nope], kv_old[h, :nope] * root)  # W_uk: √γ
        assert torch.equal(kv_new[h, nope:], kv_old[h, nope:])  # W_uv untouched
    assert q_new.shape[1] == nope + shared and kv_new.shape[1] == nope + v
    for name, p in m.named_parameters():
        if name not in (q_name, "kv_b_proj.weight"):
            assert torch.equal(p, weights[name]), name  # kv_a_proj (shared key), norms, gate, o_proj
    new_outputs = head_outputs(m, x)
    assert torch.equal(new_outputs[:, :, ~clipped], outputs[:, :, ~clipped])
    assert not torch.allclose(new_outputs[:, :, clipped], outputs[:, :, clipped])


def explicit_logits(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Eq. 7's causal pre-softmax logits ``q_h·k_h·(nope + shared)^-1/2`` [B, H, T, T] written out (−inf above
    the diagonal), with ``q_h = [c_q W_qc_h ; c_q W_qs_h]`` and ``k_h = [c_kv W_uk_h ; x W_ks]``."""
    B, T, _ = x.shape
    H, nope, shared, v, r = m.num_heads, m.nope_dim, m.shared_dim, m.v_dim, m.kv_lora_rank

    def rms(z, norm):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight

    c_q = rms(x @ m.q_a_proj.weight.T, m.q_a_norm)
    q = (c_q @ m.q_b_proj.weight.T).view(B, T, H, nope + shared)
    kv_a = x @ m.kv_a_proj.weight.T
    c_kv, k_s = rms(kv_a[..., :r], m.kv_a_norm), kv_a[..., r:]
    w_uk = m.kv_b_proj.weight.view(H, nope + v, r)[:, :nope]
    k = torch.cat([torch.einsum("btr,hnr->bthn", c_kv, w_uk), k_s[:, :, None].expand(B, T, H, shared)], -1)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(nope + shared)
    return scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)


def test_qk_clip_worked_example_head_at_twice_tau_ends_at_tau():
    """τ = 100 (the default): head 0 with max logit 2τ is scaled by γ = 1/2 — √γ on its content query and
    W_uk, γ on its shared-key query — and its max logit becomes exactly τ; heads at τ/2 and 0.9τ and the
    shared key are untouched (Kimi K2's MuonClip)."""
    tau = OptimConfig().qk_clip
    m = sharp_mla(32, seed=1)
    x = torch.randn(2, 9, 64, generator=gen(24), dtype=torch.float64)
    q = m.q_b_proj.weight.view(3, -1, m.q_b_proj.weight.shape[1])
    start = explicit_logits(m, x).amax((0, 2, 3))
    assert (start > 0).all()
    q.mul_((torch.tensor([2.0, 0.5, 0.9], dtype=torch.float64) * tau / start)[:, None, None])
    before = explicit_logits(m, x)
    torch.testing.assert_close(before.amax((0, 2, 3)), torch.tensor([200.0, 50.0, 90.0], dtype=torch.float64))
    weights = {n: p.clone() for n, p in m.named_parameters()}

    gamma = qk_clip_mla(m, before.amax((0, 2, 3)), tau)
    after = explicit_logits(m, x)
    torch.testing.assert_close(gamma, torch.tensor([0.5, 1.0, 1.0], dtype=torch.float64), atol=1e-15, rtol=0)
    assert after[:, 0].max().item() == pytest.approx(100.0, abs=1e-9)
    torch.testing.assert_close(after[:, 0], before[:, 0] / 2)  # every logit of the clipped head scales by γ
    assert torch.equal(after[:, 1:], before[:, 1:])
    nope = m.nope_dim
    exact = dict(atol=0, rtol=1e-15)
    qb_old, qb_new = weights["q_b_proj.weight"].view(3, nope + m.shared_dim, -1), q
    torch.testing.assert_close(qb_new[0, :nope], qb_old[0, :nope] * math.sqrt(0.5), **exact)
    torch.testing.assert_close(qb_new[0, nope:], qb_old[0, nope:] * 0.5, **exact)
    kv_old = weights["kv_b_proj.weight"].view(3, nope + m.v_dim, -1)
    kv_new = m.kv_b_proj.weight.view(3, nope + m.v_dim, -1)
    torch.testing.assert_close(kv_new[0, :nope], kv_old[0, :nope] * math.sqrt(0.5), **exact)
    assert torch.equal(kv_new[0, nope:], kv_old[0, nope:])  # W_uv: values are not clipped
    assert torch.equal(kv_new[1:], kv_old[1:]) and torch.equal(qb_new[1:], qb_old[1:])
    assert torch.equal(m.kv_a_proj.weight, weights["kv_a_proj.weight"])  # shared key (and latent) untouched


def test_qk_clip_mla_no_op_and_validation():
    m = sharp_mla(32)
    weights = [p.clone() for p in m.parameters()]
    gamma = qk_clip_mla(m, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), 10.0)
    assert torch.equal(gamma, torch.ones(3, dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(weights, m.parameters()))
    with pytest.raises(ValueError, match="num_heads=3"):
        qk_clip_mla(m, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="threshold"):
        qk_clip_mla(m, torch.ones(3), 0.0)


def test_record_max_logits_through_the_model():
    config = preset("tiny")
    model = K3ForCausalLM(config)
    mlas = [m for m in model.modules() if isinstance(m, GatedMLA)]
    for m in mlas:
        m.record_max_logits = True
    model(torch.randint(0, config.vocab_size, (2, 8), generator=gen(17)))
    assert mlas and all(m.max_logits.shape == (config.mla.num_heads,) and not m.max_logits.requires_grad
                        for m in mlas)
