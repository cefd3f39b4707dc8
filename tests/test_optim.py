"""k3.train.optim: Newton–Schulz, Per-Head Muon, parameter routing, schedule and MLA QK-clip (SPEC §7, §9)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from k3 import K3ForCausalLM
from k3.config import AttnResConfig, K3Config, preset
from k3.model.sequence.kda import KDALayer
from k3.model.sequence.mla import GatedMLA, MLACache
from k3.model.width import Experts, Router
from k3.train.optim import (
    Muon,
    OptimConfig,
    build_optimizers,
    lr_lambda,
    merge_heads,
    newton_schulz,
    qk_clip_mla,
    schedulers,
    split_heads,
)

# Observed band of NS singular values (5 steps): once a normalised σ exceeds ~3.4445⁻⁵ ≈ 0.002 the quintic
# p(σ) = 3.4445σ − 4.7750σ³ + 2.0315σ⁵ carries it into [0.6818, 1.1344], an interval p maps into itself and
# oscillates inside (p(1) ≈ 0.70, so 1 is not a fixed point); transients peak at max p on [0, 1] ≈ 1.2024.
NS_BAND = (0.68, 1.21)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def polar(M: torch.Tensor) -> torch.Tensor:
    """Exact polar factor U Vᵀ via SVD (the seed's reference)."""
    u, _, vt = torch.linalg.svd(M, full_matrices=False)
    return u @ vt


def conditioned(*shape: int, seed: int, cond: float = 20.0) -> torch.Tensor:
    """A random matrix (batch) with singular values spread over [1/cond, 1]."""
    *batch, m, n = shape
    k = min(m, n)
    g = gen(seed)
    u = torch.linalg.qr(torch.randn(*batch, m, k, generator=g)).Q
    v = torch.linalg.qr(torch.randn(*batch, n, k, generator=g)).Q
    s = torch.exp(torch.empty(*batch, k).uniform_(-math.log(cond), 0.0, generator=g))
    return (u * s[..., None, :]) @ v.mT


# ---------------------------------------------------------------------- Newton–Schulz
@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (3, 48, 16), (2, 3, 8, 24), (16, 16), (64, 64)])
def test_newton_schulz_singular_values_in_band(shape):
    # Square Gaussian matrices can have σ_min/‖G‖_F below 3.4445⁻⁵, which 5 steps cannot lift; the square
    # cases therefore use a bounded condition number. Rectangular Gaussian matrices are well conditioned.
    G = conditioned(*shape, seed=0) if shape[-1] == shape[-2] else torch.randn(*shape, generator=gen(0))
    out = newton_schulz(G)
    assert out.shape == G.shape and out.dtype == G.dtype
    sv = torch.linalg.svdvals(out)
    assert NS_BAND[0] < sv.min() and sv.max() < NS_BAND[1]
    # NS only reshapes singular values, O = U f(S) Vᵀ, so ⟨O, U Vᵀ⟩ / min(m, n) is the mean of O's σ.
    P = polar(G)
    torch.testing.assert_close((out * P).sum((-2, -1)) / min(shape[-2:]), sv.mean(-1), atol=1e-4, rtol=0)


def test_newton_schulz_orthogonal_input_is_scaled_orthogonal():
    Q = torch.linalg.qr(torch.randn(24, 24, generator=gen(1), dtype=torch.float64)).Q
    out = newton_schulz(Q)
    c = (out * Q).sum() / (Q * Q).sum()  # all σ equal → out = f(σ)·Q
    assert NS_BAND[0] < c < NS_BAND[1]
    torch.testing.assert_close(out, c * Q, atol=1e-10, rtol=0)


def test_newton_schulz_zero_batch_transpose_dtype():
    Z = torch.zeros(2, 5, 7)
    assert torch.equal(newton_schulz(Z), Z)
    G = torch.randn(4, 12, 20, generator=gen(2))
    batched = newton_schulz(G)
    torch.testing.assert_close(batched, torch.stack([newton_schulz(g) for g in G]), atol=1e-6, rtol=0)
    assert torch.equal(newton_schulz(G.mT), batched.mT)  # tall inputs run transposed: the same iteration
    assert newton_schulz(G.bfloat16()).dtype == torch.bfloat16
    assert newton_schulz(G.double()).dtype == torch.float64
    with pytest.raises(ValueError, match="newton_schulz"):
        newton_schulz(torch.ones(3))


# ---------------------------------------------------------------------- head split / merge
@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), heads=st.integers(1, 5), dh=st.integers(1, 6),
       d_in=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_split_merge_round_trip_is_exact(lead, heads, dh, d_in, seed):
    W = torch.randn(*lead, heads * dh, d_in, generator=gen(seed))
    blocks = split_heads(W, heads)
    assert blocks.shape == (*lead, heads, dh, d_in)
    for h in range(heads):
        assert torch.equal(blocks[..., h, :, :], W[..., h * dh:(h + 1) * dh, :])
    assert torch.equal(merge_heads(blocks), W)


def test_split_heads_rejects_bad_shapes():
    with pytest.raises(ValueError, match="split_heads"):
        split_heads(torch.ones(10, 3), 4)
    with pytest.raises(ValueError, match="merge_heads"):
        merge_heads(torch.ones(4, 3))


def test_per_head_polar_differs_from_whole_matrix_seed_example():
    # The seed's example: exact polar factors of a 4×3 momentum, whole vs two heads of 2 rows.
    M = torch.randn(4, 3, generator=gen(3), dtype=torch.float64)
    whole, per_head = polar(M), merge_heads(polar(split_heads(M, 2)))
    assert not torch.allclose(whole, per_head)
    for head in split_heads(per_head, 2):
        torch.testing.assert_close(head @ head.T, torch.eye(2, dtype=torch.float64), atol=1e-12, rtol=0)


def test_per_head_newton_schulz_tracks_each_heads_polar_factor():
    # Heads with unequal gradient scales (the report's motivation): whole-matrix NS starves the weak heads.
    H, dh, d_in = 4, 8, 16
    scales = torch.tensor([1.0, 10.0, 0.1, 3.0], dtype=torch.float64)
    M = merge_heads(split_heads(torch.randn(H * dh, d_in, generator=gen(4), dtype=torch.float64), H)
                    * scales[:, None, None])
    target = polar(split_heads(M, H))
    per_head = split_heads(merge_heads(newton_schulz(split_heads(M, H))), H)
    whole = split_heads(newton_schulz(M), H)
    err_head = (per_head - target).flatten(1).norm(dim=1)
    err_whole = (whole - target).flatten(1).norm(dim=1)
    assert (err_head < err_whole).all()
    sv = torch.linalg.svdvals(per_head)
    assert NS_BAND[0] < sv.min() and sv.max() < NS_BAND[1]
    assert torch.linalg.svdvals(whole[2]).max() < 0.1  # the weak head barely moves when coupled


# ---------------------------------------------------------------------- Muon
def rms_scale(m: int, n: int) -> float:
    return 0.2 * math.sqrt(max(m, n))


def muon_step(p: torch.nn.Parameter, grad: torch.Tensor, opt: Muon) -> None:
    p.grad = grad.clone()
    opt.step()


def test_muon_plain_update_and_weight_decay():
    lr = 0.05
    p = torch.nn.Parameter(torch.randn(12, 20, generator=gen(5)))
    g = torch.randn(12, 20, generator=gen(6))
    before = p.detach().clone()
    muon_step(p, g, Muon([p], lr=lr, momentum=0.0, weight_decay=0.0))
    torch.testing.assert_close(p.detach(), before - lr * rms_scale(12, 20) * newton_schulz(g), atol=1e-6, rtol=0)

    # Decoupled decay: a zero gradient orthogonalises to zero, leaving exactly p·(1 − lr·wd).
    q = torch.nn.Parameter(before.clone())
    muon_step(q, torch.zeros_like(g), Muon([q], lr=lr, momentum=0.9, weight_decay=0.1))
    assert torch.equal(q.detach(), before * (1 - lr * 0.1))
    r = torch.nn.Parameter(before.clone())
    muon_step(r, g, Muon([r], lr=lr, momentum=0.0, weight_decay=0.1))
    torch.testing.assert_close(r.detach(), before * (1 - lr * 0.1) - lr * rms_scale(12, 20) * newton_schulz(g),
                               atol=1e-6, rtol=0)


def test_muon_update_rms_matches_adamw_scale():
    p = torch.nn.Parameter(torch.zeros(64, 256))
    muon_step(p, torch.randn(64, 256, generator=gen(7)), Muon([p], lr=1.0, momentum=0.0, weight_decay=0.0))
    rms = p.detach().pow(2).mean().sqrt()
    assert 0.2 * NS_BAND[0] < rms < 0.2 * NS_BAND[1]


def test_muon_nesterov_momentum_matches_reference():
    lr, mu, wd = 0.02, 0.95, 0.1
    p = torch.nn.Parameter(torch.randn(10, 6, generator=gen(8), dtype=torch.float64))
    opt = Muon([p], lr=lr, momentum=mu, weight_decay=wd)
    ref, buf = p.detach().clone(), torch.zeros_like(p)
    for step in range(3):
        g = torch.randn(10, 6, generator=gen(100 + step), dtype=torch.float64)
        buf = mu * buf + g
        ref = ref * (1 - lr * wd) - lr * rms_scale(10, 6) * newton_schulz(g + mu * buf)
        muon_step(p, g, opt)
        torch.testing.assert_close(p.detach(), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, atol=1e-12, rtol=0)


def test_per_head_muon_scales_each_block_by_its_own_shape():
    H, dh, d_in, lr = 4, 8, 16, 0.1
    p = torch.nn.Parameter(torch.zeros(H * dh, d_in, dtype=torch.float64))
    g = torch.randn(H * dh, d_in, generator=gen(9), dtype=torch.float64)
    muon_step(p, g, Muon([p], lr=lr, momentum=0.0, weight_decay=0.0, num_heads=H))
    blocks = newton_schulz(split_heads(g, H)) * rms_scale(dh, d_in)
    torch.testing.assert_close(p.detach(), -lr * merge_heads(blocks), atol=1e-12, rtol=0)
    whole = -lr * rms_scale(H * dh, d_in) * newton_schulz(g)
    assert not torch.allclose(p.detach(), whole, atol=1e-3)


@pytest.mark.parametrize("num_heads", [None, 2])
def test_muon_stacked_3d_is_a_batch_of_matrices(num_heads):
    E, m, n = 3, 8, 5
    stacked = torch.nn.Parameter(torch.randn(E, m, n, generator=gen(10), dtype=torch.float64))
    slices = [torch.nn.Parameter(s.clone()) for s in stacked.detach()]
    opt = Muon([stacked], lr=0.1, num_heads=num_heads)
    ref = Muon(slices, lr=0.1, num_heads=num_heads)
    for step in range(2):
        g = torch.randn(E, m, n, generator=gen(200 + step), dtype=torch.float64)
        muon_step(stacked, g, opt)
        for s, gs in zip(slices, g):
            s.grad = gs.clone()
        ref.step()
    torch.testing.assert_close(stacked.detach(), torch.stack([s.detach() for s in slices]), atol=1e-12, rtol=0)


def test_muon_state_dict_round_trip_reproduces_next_step():
    p = torch.nn.Parameter(torch.randn(2, 12, 8, generator=gen(11)))
    q = torch.nn.Parameter(torch.randn(16, 8, generator=gen(12)))
    groups = lambda a, b: [dict(params=[a]), dict(params=[b], num_heads=4, lr=0.01)]
    opt = Muon(groups(p, q), lr=0.03)
    grads = [(torch.randn(2, 12, 8, generator=gen(300 + i)), torch.randn(16, 8, generator=gen(400 + i)))
             for i in range(2)]
    p.grad, q.grad = grads[0]
    opt.step()
    p2, q2 = torch.nn.Parameter(p.detach().clone()), torch.nn.Parameter(q.detach().clone())
    opt2 = Muon(groups(p2, q2), lr=0.5)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.param_groups[1]["num_heads"] == 4 and opt2.param_groups[0]["lr"] == 0.03
    for a, b, opt_ in ((p, q, opt), (p2, q2, opt2)):
        a.grad, b.grad = (g.clone() for g in grads[1])
        opt_.step()
    assert torch.equal(p, p2) and torch.equal(q, q2)


def test_muon_rejects_invalid_parameters():
    with pytest.raises(ValueError, match="2-D or stacked 3-D"):
        Muon([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    with pytest.raises(ValueError, match="num_heads=3"):
        Muon([torch.nn.Parameter(torch.ones(4, 2))], lr=0.1, num_heads=3)
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.nn.Parameter(torch.ones(4, 2))], lr=0.1, momentum=1.0)
    opt = Muon([torch.nn.Parameter(torch.ones(4, 2))], lr=0.1)
    with pytest.raises(ValueError, match="ns_steps"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.ones(4, 2))], ns_steps=0))
    assert len(opt.param_groups) == 1  # a rejected group is not kept


# ---------------------------------------------------------------------- build_optimizers
def kimi_linear_like() -> K3Config:
    """Plain residual, direct query projection, softplus gate, low-rank KDA gate, plain SwiGLU MoE."""
    c = preset("tiny")
    c.attn_res = AttnResConfig(enabled=False)
    c.kda = dataclasses.replace(c.kda, gate="softplus", output_gate_rank=8, num_heads=4)
    c.mla = dataclasses.replace(c.mla, q_lora_rank=None, output_gate=False, num_heads=3)
    c.moe = dataclasses.replace(c.moe, activation="swiglu", latent_dim=None)
    c.vision = dataclasses.replace(c.vision, enabled=False)
    c.mx = dataclasses.replace(c.mx, enabled=False)
    return c.validate()


CONFIGS = {"tiny": lambda: preset("tiny"), "kimi-linear-like": kimi_linear_like}


def group_of(optimizers) -> dict[int, dict]:
    """id(param) → its group (with the optimizer class under "kind"); asserts no parameter appears twice."""
    where: dict[int, dict] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                assert id(p) not in where, "a parameter is in two groups"
                where[id(p)] = dict(group, kind=type(opt).__name__)
    return where


@pytest.mark.parametrize("name", list(CONFIGS))
def test_build_optimizers_classifies_every_parameter_once(name):
    config = CONFIGS[name]()
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    optim = OptimConfig()
    optimizers = build_optimizers(model, config, optim)
    assert [type(o).__name__ for o in optimizers] == ["Muon", "AdamW"]
    where = group_of(optimizers)
    assert set(where) == {id(p) for p in model.parameters()}

    def check(p, kind, group, num_heads=None):
        g = where[id(p)]
        assert (g["kind"], g["name"]) == (kind, group), (p.shape, g["name"])
        if kind == "Muon":
            assert g["num_heads"] == num_heads and g["lr"] == optim.lr and g["momentum"] == optim.momentum

    per_head_ids = set()
    for module in model.modules():
        if isinstance(module, KDALayer):
            for proj in (module.q_proj, module.k_proj, module.v_proj):
                check(proj.weight, "Muon", "muon_kda_heads", config.kda.num_heads)
                per_head_ids.add(id(proj.weight))
            check(module.conv.weight, "AdamW", "adamw_decay")
        elif isinstance(module, GatedMLA):
            query = module.q_proj if config.mla.q_lora_rank is None else module.q_b_proj
            for proj in (query, module.kv_b_proj):
                check(proj.weight, "Muon", "muon_mla_heads", config.mla.num_heads)
                per_head_ids.add(id(proj.weight))
            check(module.kv_a_proj.weight, "Muon", "muon")
        elif isinstance(module, Router):
            check(module.weight, "AdamW", "adamw_decay")
        elif isinstance(module, Experts):
            check(module.gate_up, "Muon", "muon")
            check(module.down, "Muon", "muon")
        elif isinstance(module, torch.nn.Linear) and module is not model.lm_head:
            if id(module.weight) not in per_head_ids:
                check(module.weight, "Muon", "muon")
    check(model.embed_tokens.weight, "AdamW", "adamw_decay")
    check(model.lm_head.weight, "AdamW", "adamw_decay")
    for p in model.parameters():
        if p.dim() == 1:
            check(p, "AdamW", "adamw_no_decay")
    adam = optimizers[1]
    assert {g["name"]: g["weight_decay"] for g in adam.param_groups} == {"adamw_decay": 0.1, "adamw_no_decay": 0.0}
    assert adam.defaults["betas"] == (0.9, 0.95) and adam.defaults["lr"] == optim.adam_lr


def test_build_optimizers_ablations_and_frozen_parameters():
    config = preset("tiny")
    model = K3ForCausalLM(config)
    everything = {id(p) for p in model.parameters()}

    adamw = build_optimizers(model, config, OptimConfig(optimizer="adamw"))
    assert [type(o).__name__ for o in adamw] == ["AdamW"]
    where = group_of(adamw)
    assert set(where) == everything
    assert all((where[id(p)]["weight_decay"] > 0) == (p.dim() >= 2) for p in model.parameters())

    plain = group_of(build_optimizers(model, config, OptimConfig(per_head=False)))
    assert set(plain) == everything
    assert all(g.get("num_heads") is None for g in plain.values())
    kda = next(m for m in model.modules() if isinstance(m, KDALayer))
    assert plain[id(kda.q_proj.weight)]["name"] == "muon"

    model.embed_tokens.weight.requires_grad_(False)
    frozen = group_of(build_optimizers(model, config, OptimConfig()))
    assert set(frozen) == everything - {id(model.embed_tokens.weight)}


def test_optim_config_round_trips_and_validates():
    c = OptimConfig(lr=1e-2, qk_clip=50.0, optimizer="adamw", per_head=False, betas=(0.8, 0.9))
    assert OptimConfig(**dataclasses.asdict(c)) == c
    assert OptimConfig(**json.loads(json.dumps(dataclasses.asdict(c)))) == c  # betas list → tuple
    with pytest.raises(ValueError, match="optimizer"):
        OptimConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="qk_clip"):
        OptimConfig(qk_clip=0.0)


def test_muon_training_lowers_the_loss_on_a_fixed_batch():
    config = preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=gen(13))
    optimizers = build_optimizers(model, config, OptimConfig(lr=2e-2, adam_lr=1e-2))

    def loss_fn() -> torch.Tensor:
        logits, _ = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    losses = []
    for _ in range(4):
        loss = loss_fn()
        losses.append(loss.item())
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
    assert loss_fn().item() < losses[0] - 0.5, losses


# ---------------------------------------------------------------------- schedule
def test_lr_lambda_warmup_then_cosine():
    total, lo = 1000, 0.1
    f = lambda s: lr_lambda(s, total, 0.01, lo)
    assert f(0) == pytest.approx(0.1)  # warmup over round(0.01·1000) = 10 steps: (step + 1) / 10
    assert f(4) == pytest.approx(0.5)
    assert f(9) == 1.0 and f(10) == 1.0  # end of warmup
    assert f(10 + 495) == pytest.approx((1 + lo) / 2)  # middle of the cosine
    assert f(total) == pytest.approx(lo) and f(total + 50) == pytest.approx(lo)
    warm, decay = [f(s) for s in range(10)], [f(s) for s in range(10, total + 1)]
    assert all(a < b for a, b in zip(warm, warm[1:]))
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_lambda(0, 50, 0.0, 0.0) == 1.0  # at least one warmup step, which already reaches 1
    with pytest.raises(ValueError, match="total_steps"):
        lr_lambda(0, 0, 0.01, 0.1)


def test_schedulers_drive_every_optimizer():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    b = torch.nn.Parameter(torch.zeros(4))
    opts = [Muon([p], lr=0.02), torch.optim.AdamW([b], lr=0.001)]
    optim = OptimConfig(warmup_frac=0.1, min_lr_ratio=0.2)
    scheds = schedulers(opts, 20, optim)
    seen = []
    for _ in range(20):
        seen.append([o.param_groups[0]["lr"] for o in opts])
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
    for step, (muon_lr, adam_lr) in enumerate(seen):
        factor = lr_lambda(step, 20, 0.1, 0.2)
        assert muon_lr == pytest.approx(0.02 * factor) and adam_lr == pytest.approx(0.001 * factor)


# ---------------------------------------------------------------------- QK-clip (MLA)
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
    split_heads(q, 3).mul_(torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)[:, None, None])
    return m


def logits_max(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    m.record_max_logits, m.max_logits = True, None
    m(x)
    out, m.record_max_logits, m.max_logits = m.max_logits, False, None
    return out


def head_outputs(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Per-head attention outputs [B, T, H, v] before the gate and o_proj."""
    q, c_kv, k_s = m._project(x)
    return m._attend_full(q, MLACache(c_kv, k_s))


def test_record_max_logits_matches_explicit_scores_and_accumulates():
    m = sharp_mla(32)
    x1 = torch.randn(2, 7, 64, generator=gen(14), dtype=torch.float64)
    x2 = 3 * torch.randn(1, 5, 64, generator=gen(15), dtype=torch.float64)
    y_off, _ = m(x1)
    assert m.max_logits is None
    m.record_max_logits = True
    y_on, _ = m(x1)
    assert torch.equal(y_on, y_off)  # observing does not change the output
    first = m.max_logits.clone()
    q, c_kv, k_s = m._project(x1)
    kc = c_kv[:, None] @ m._up_weights()[0].transpose(-1, -2)  # [B, H, T, nope]
    k = torch.cat([kc, k_s[:, None].expand(-1, 3, -1, -1)], -1)
    scores = (q @ k.transpose(-1, -2) * m.scale).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), -torch.inf)
    torch.testing.assert_close(first, scores.amax((0, 2, 3)), atol=1e-12, rtol=0)
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
    q_old, q_new = split_heads(weights[q_name], 3), split_heads(dict(m.named_parameters())[q_name], 3)
    kv_old, kv_new = split_heads(weights["kv_b_proj.weight"], 3), split_heads(m.kv_b_proj.weight, 3)
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
