"""k3.train.optim: Newton–Schulz, Per-Head Muon, parameter routing and schedule (SPEC §7, §9); QK-clip is in
test_qk_clip.py."""

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
from k3.model.sequence.mla import GatedMLA
from k3.model.width import Experts, Router
from k3.train.optim import (
    Muon,
    OptimConfig,
    build_optimizers,
    lr_lambda,
    merge_heads,
    newton_schulz,
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


def spectral_ns(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Independent reference for 5 quintic Newton–Schulz steps, through the SVD (fp64).

    ``X ← aX + b(XXᵀ)X + c(XXᵀ)²X`` acts on each singular value alone, so after Frobenius normalisation
    NS(G) = U·p∘…∘p(σ / (‖G‖_F + eps))·Vᵀ with p(s) = a·s + b·s³ + c·s⁵ and KellerJordan/Muon's
    (a, b, c) = (3.4445, −4.7750, 2.0315).
    """
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / (torch.linalg.matrix_norm(G.double())[..., None] + eps)
    for _ in range(steps):
        s = 3.4445 * s - 4.7750 * s**3 + 2.0315 * s**5
    return (U * s[..., None, :]) @ Vh


def test_spectral_reference_is_an_approximate_polar_factor():
    """The reference itself: same singular vectors as the SVD polar factor, singular values in the NS band."""
    G = torch.randn(12, 20, generator=gen(20), dtype=torch.float64)
    out = spectral_ns(G)
    sv = torch.linalg.svdvals(out)
    assert NS_BAND[0] < sv.min() and sv.max() < NS_BAND[1]
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    core = U.T @ out @ Vh.T  # diagonal: the same singular vectors as the polar factor U Vᵀ
    torch.testing.assert_close(core, torch.diag(torch.diagonal(core)), atol=1e-12, rtol=0)


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
    whole, per_head = polar(M), torch.cat([polar(M[:2]), polar(M[2:])])
    assert not torch.allclose(whole, per_head)
    for head in (per_head[:2], per_head[2:]):
        torch.testing.assert_close(head @ head.T, torch.eye(2, dtype=torch.float64), atol=1e-12, rtol=0)


def test_per_head_newton_schulz_tracks_each_heads_polar_factor():
    # Heads with unequal gradient scales (the report's motivation): whole-matrix NS starves the weak heads.
    H, dh, d_in = 4, 8, 16
    scales = torch.tensor([1.0, 10.0, 0.1, 3.0], dtype=torch.float64)
    M = (torch.randn(H, dh, d_in, generator=gen(4), dtype=torch.float64) * scales[:, None, None]).reshape(H * dh, d_in)
    target = polar(M.view(H, dh, d_in))
    per_head = newton_schulz(M.view(H, dh, d_in))
    whole = newton_schulz(M).view(H, dh, d_in)
    err_head = (per_head - target).flatten(1).norm(dim=1)
    err_whole = (whole - target).flatten(1).norm(dim=1)
    assert (err_head < err_whole).all()
    sv = torch.linalg.svdvals(per_head)
    assert NS_BAND[0] < sv.min() and sv.max() < NS_BAND[1]
    assert torch.linalg.svdvals(whole[2]).max() < 0.1  # the weak head barely moves when coupled


# ---------------------------------------------------------------------- Muon
def muon_step(p: torch.nn.Parameter, grad: torch.Tensor, opt: Muon) -> None:
    p.grad = grad.clone()
    opt.step()


def test_muon_plain_update_and_weight_decay():
    lr = 0.05
    p = torch.nn.Parameter(torch.randn(12, 20, generator=gen(5), dtype=torch.float64))
    g = torch.randn(12, 20, generator=gen(6), dtype=torch.float64)
    before = p.detach().clone()
    muon_step(p, g, Muon([p], lr=lr, momentum=0.0, weight_decay=0.0))
    step = lr * 0.2 * math.sqrt(20) * spectral_ns(g)  # Moonlight's RMS matching 0.2·√max(12, 20)
    torch.testing.assert_close(p.detach(), before - step, atol=1e-12, rtol=0)

    # Decoupled decay: a zero gradient orthogonalises to zero, leaving exactly p·(1 − lr·wd).
    q = torch.nn.Parameter(before.clone())
    muon_step(q, torch.zeros_like(g), Muon([q], lr=lr, momentum=0.9, weight_decay=0.1))
    assert torch.equal(q.detach(), before * (1 - lr * 0.1))
    r = torch.nn.Parameter(before.clone())
    muon_step(r, g, Muon([r], lr=lr, momentum=0.0, weight_decay=0.1))
    torch.testing.assert_close(r.detach(), before * (1 - lr * 0.1) - step, atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (32, 32)])
def test_muon_matches_torch_optim_muon_with_rms_matching(shape):
    """torch.optim.Muon with ``adjust_lr_fn="match_rms_adamw"`` is our Muon: the same quintic NS (5 steps, eps
    1e-7, Frobenius pre-normalisation), lr·0.2·√max(A, B), decoupled decay and Nesterov. Its momentum is an
    EMA, (1 − μ) times our sum, which the normalisation cancels; its NS runs in bf16, hence the 2 % tolerance."""
    p0 = torch.randn(*shape, generator=gen(21))
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = Muon([ours], lr=0.05, momentum=0.95, weight_decay=0.1)
    oracle = torch.optim.Muon([theirs], lr=0.05, momentum=0.95, weight_decay=0.1, nesterov=True,
                              adjust_lr_fn="match_rms_adamw")
    for step in range(4):
        g = torch.randn(*shape, generator=gen(500 + step))
        muon_step(ours, g, opt)
        muon_step(theirs, g, oracle)
    moved, expected = ours.detach() - p0, theirs.detach() - p0
    assert (moved - expected).norm() < 0.02 * expected.norm()


def test_muon_update_rms_matches_adamw_scale():
    p = torch.nn.Parameter(torch.zeros(64, 256))
    muon_step(p, torch.randn(64, 256, generator=gen(7)), Muon([p], lr=1.0, momentum=0.0, weight_decay=0.0))
    rms = p.detach().pow(2).mean().sqrt()
    assert 0.2 * NS_BAND[0] < rms < 0.2 * NS_BAND[1]


def test_muon_nesterov_momentum_matches_reference():
    """buf ← μ·buf + g; direction g + μ·buf; p ← p·(1 − lr·wd) − lr·0.2·√max(10, 6)·NS(direction)."""
    lr, mu, wd = 0.02, 0.95, 0.1
    p = torch.nn.Parameter(torch.randn(10, 6, generator=gen(8), dtype=torch.float64))
    opt = Muon([p], lr=lr, momentum=mu, weight_decay=wd)
    ref, buf = p.detach().clone(), torch.zeros(10, 6, dtype=torch.float64)
    for step in range(3):
        g = torch.randn(10, 6, generator=gen(100 + step), dtype=torch.float64)
        buf = mu * buf + g
        ref = ref * (1 - lr * wd) - lr * 0.2 * math.sqrt(10) * spectral_ns(g + mu * buf)
        muon_step(p, g, opt)
        torch.testing.assert_close(p.detach(), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, atol=1e-12, rtol=0)


def test_per_head_muon_scales_each_block_by_its_own_shape():
    H, dh, d_in, lr = 4, 8, 16, 0.1
    p = torch.nn.Parameter(torch.zeros(H * dh, d_in, dtype=torch.float64))
    g = torch.randn(H * dh, d_in, generator=gen(9), dtype=torch.float64)
    muon_step(p, g, Muon([p], lr=lr, momentum=0.0, weight_decay=0.0, num_heads=H))
    for h in range(H):
        rows = slice(h * dh, (h + 1) * dh)
        expected = -lr * 0.2 * math.sqrt(16) * spectral_ns(g[rows])  # 0.2·√max(dh = 8, d_in = 16)
        torch.testing.assert_close(p.detach()[rows], expected, atol=1e-12, rtol=0)
    whole = -lr * 0.2 * math.sqrt(32) * spectral_ns(g)
    assert not torch.allclose(p.detach(), whole, atol=1e-3)


def test_head_split_orthogonalises_each_part_of_each_head():
    """num_heads=2, head_split=(3, 5): rows [0:3], [3:8], [8:11], [11:16] are four separate matrices."""
    lr, d_in = 0.1, 6
    p = torch.nn.Parameter(torch.zeros(16, d_in, dtype=torch.float64))
    g = torch.randn(16, d_in, generator=gen(22), dtype=torch.float64)
    muon_step(p, g, Muon([p], lr=lr, momentum=0.0, weight_decay=0.0, num_heads=2, head_split=(3, 5)))
    for start, stop in ((0, 3), (3, 8), (8, 11), (11, 16)):
        rows = slice(start, stop)
        expected = -lr * 0.2 * math.sqrt(max(stop - start, d_in)) * spectral_ns(g[rows])
        torch.testing.assert_close(p.detach()[rows], expected, atol=1e-12, rtol=0)


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
    for lr in (float("inf"), float("nan"), -0.1):  # an infinite step would train one step of NaNs
        with pytest.raises(ValueError, match="lr must be finite and >= 0"):
            Muon([torch.nn.Parameter(torch.ones(4, 2))], lr=lr)
    with pytest.raises(ValueError, match="weight_decay must be finite and >= 0"):
        Muon([torch.nn.Parameter(torch.ones(4, 2))], lr=0.1, weight_decay=float("inf"))
    with pytest.raises(ValueError, match="head_split"):
        Muon([torch.nn.Parameter(torch.ones(8, 2))], lr=0.1, num_heads=2, head_split=(1, 2))
    with pytest.raises(ValueError, match="head_split"):
        Muon([torch.nn.Parameter(torch.ones(8, 2))], lr=0.1, head_split=(4, 4))
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

    def check(p, kind, group, num_heads=None, head_split=None):
        g = where[id(p)]
        assert (g["kind"], g["name"]) == (kind, group), (p.shape, g["name"])
        if kind == "Muon":
            assert (g["num_heads"], g["head_split"]) == (num_heads, head_split)
            assert g["lr"] == optim.lr and g["momentum"] == optim.momentum

    per_head_ids = set()
    m = config.mla
    for module in model.modules():
        if isinstance(module, KDALayer):
            for proj in (module.q_proj, module.k_proj, module.v_proj):
                check(proj.weight, "Muon", "muon_kda_heads", config.kda.num_heads)
                per_head_ids.add(id(proj.weight))
            check(module.conv.weight, "AdamW", "adamw_decay")
        elif isinstance(module, GatedMLA):
            query = module.q_proj if m.q_lora_rank is None else module.q_b_proj
            check(query.weight, "Muon", "muon_mla_q_heads", m.num_heads)
            check(module.kv_b_proj.weight, "Muon", "muon_mla_kv_heads", m.num_heads,
                  (m.qk_nope_head_dim, m.v_head_dim))
            per_head_ids.update((id(query.weight), id(module.kv_b_proj.weight)))
            check(module.kv_a_proj.weight, "Muon", "muon")
        elif isinstance(module, Router):
            check(module.weight, "Muon", "muon")  # a hidden matrix: AdamW is for embeddings, head and gains
        elif isinstance(module, Experts):
            check(module.gate_up, "Muon", "muon_experts_gate_up", 1, (module.hidden, module.hidden))
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
    assert {g["name"] for g in plain.values() if g["kind"] == "Muon"} == {"muon", "muon_experts_gate_up"}
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
        OptimConfig(qk_clip=-1.0)
    for name, value in (("lr", float("inf")), ("adam_lr", float("nan")), ("weight_decay", -0.1), ("eps", "1e-8"),
                        ("lr", True)):  # AdamW alone takes an infinite rate and trains a step of NaNs
        with pytest.raises(ValueError, match=f"{name}: expected a finite number >= 0"):
            OptimConfig(**{name: value})
    with pytest.raises(ValueError, match="momentum"):
        OptimConfig(momentum=float("nan"))


def test_qk_clip_is_on_by_default_with_k2s_threshold():
    """K3 keeps K2's QK-clip (seeds/001, paper §3.3–3.4); τ = 100 as in Kimi K2. 0 or None turns it off."""
    assert OptimConfig().qk_clip == 100.0
    assert OptimConfig(qk_clip=0).qk_clip is None and OptimConfig(qk_clip=None).qk_clip is None
    off = OptimConfig(qk_clip=0.0)
    assert OptimConfig(**json.loads(json.dumps(dataclasses.asdict(off)))) == off


def hand_blocks(model: torch.nn.Module, config: K3Config) -> dict[int, list[slice]]:
    """id(Muon parameter) → its separately orthogonalised row ranges, sliced by hand from the paper's layout
    (SPEC §2, §7); a parameter not listed is one whole matrix."""
    blocks: dict[int, list[slice]] = {}
    m = config.mla
    q_rows, nope, v = m.qk_nope_head_dim + m.qk_shared_head_dim, m.qk_nope_head_dim, m.v_head_dim
    for module in model.modules():
        if isinstance(module, KDALayer):
            dh = config.kda.head_dim
            for proj in (module.q_proj, module.k_proj, module.v_proj):
                blocks[id(proj.weight)] = [slice(h * dh, (h + 1) * dh) for h in range(config.kda.num_heads)]
        elif isinstance(module, GatedMLA):
            query = module.q_proj if m.q_lora_rank is None else module.q_b_proj
            blocks[id(query.weight)] = [slice(h * q_rows, (h + 1) * q_rows) for h in range(m.num_heads)]
            kv = []
            for h in range(m.num_heads):
                start = h * (nope + v)
                kv += [slice(start, start + nope), slice(start + nope, start + nope + v)]  # W_uk_h, W_uv_h
            blocks[id(module.kv_b_proj.weight)] = kv
        elif isinstance(module, Experts):
            hidden = module.gate_up.shape[1] // 2
            blocks[id(module.gate_up)] = [slice(0, hidden), slice(hidden, 2 * hidden)]  # W_gate, W_up per expert
    return blocks


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_muon_update_equals_hand_sliced_blocks(name):
    """One step (μ = 0, no decay) of every Muon parameter: each hand-sliced block is replaced by
    −lr·0.2·√max(rows, cols)·NS(its gradient block), NS from the SVD reference. MLA keys and values of a
    head are separate blocks; the router is one whole matrix."""
    config = CONFIGS[name]()
    torch.manual_seed(0)
    model = K3ForCausalLM(config).double()
    lr = 0.1
    muon = build_optimizers(model, config, OptimConfig(lr=lr, momentum=0.0, weight_decay=0.0))[0]
    params = [p for group in muon.param_groups for p in group["params"]]
    routers = [mod.weight for mod in model.modules() if isinstance(mod, Router)]
    assert routers and all(any(r is p for p in params) for r in routers)
    g = gen(23)
    before = {id(p): p.detach().clone() for p in params}
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    muon.step()
    blocks = hand_blocks(model, config)
    for p in params:
        moved = p.detach() - before[id(p)]
        for rows in blocks.get(id(p), [slice(0, p.shape[-2])]):
            block = p.grad[..., rows, :]
            scale = 0.2 * math.sqrt(max(block.shape[-2:]))
            expected = -lr * scale * spectral_ns(block).to(p.dtype)
            assert torch.allclose(moved[..., rows, :], expected, atol=1e-10, rtol=0), (list(p.shape), rows)


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
