"""k3.model.width: SiTU, the sigmoid top-k router, expert dispatch and Stable LatentMoE (SPEC §4, §9)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from k3.config import K3Config, SiTUConfig, preset
from k3.sizing.params import moe_layer_parameters
from k3.model.width import GLU, Experts, LatentMoE, Router, build_ffn, situ, soft_cap, top_k_first, top_k_sorted
from peers import transformers_kimi_linear

CAPS = SiTUConfig()  # gate cap 4, up cap 25


# ---------------------------------------------------------------------- independent references
def ref_act(gate: torch.Tensor, up: torch.Tensor, activation: str, caps: SiTUConfig = CAPS) -> torch.Tensor:
    if activation == "situ":
        g, u = caps.gate_cap, caps.up_cap
        return g * torch.tanh(gate / g) * torch.sigmoid(gate) * u * torch.tanh(up / u)
    return gate * torch.sigmoid(gate) * up


def ref_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str) -> torch.Tensor:
    """One expert on one token vector: rows :F of gate_up are the gate, F: the up projection."""
    f = down.shape[1]
    return down @ ref_act(gate_up[:f] @ x, gate_up[f:] @ x, activation)


def ref_dispatch(experts: Experts, x, weights, indices) -> torch.Tensor:
    """Per-token loop: for each token, for each of its k experts, that expert's weight slices."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            y = ref_expert(x[t], experts.gate_up[e], experts.down[e], experts.activation)
            out[t] += weights[t, j].to(x.dtype) * y
    return out


def ref_glu(glu: GLU, x: torch.Tensor) -> torch.Tensor:
    h = ref_act(x @ glu.gate_proj.weight.T, x @ glu.up_proj.weight.T, glu.activation)
    return h @ glu.down_proj.weight.T


def ref_route(router: Router, x: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Per token: the k experts with the largest s + b (lower index on ties) and the raw scores s."""
    s = torch.sigmoid(x @ router.weight.to(x.dtype).T)
    b = s + router.balance_bias.to(x.dtype)
    n = s.shape[1]
    routes = [sorted(range(n), key=lambda j: (-float(b[t, j]), j))[: router.k] for t in range(x.shape[0])]
    return routes, s


def ref_moe(m: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """shared(x) + latent_up(RMSNorm(α Σ_route p_j E_j(latent_down x))), token by token (α before the latent
    norm, as the release applies routed_scaling_factor; without a latent: shared(x) + α Σ p_j E_j(x))."""
    routes, s = ref_route(m.router, x)
    out = []
    for t, route in enumerate(routes):
        p = s[t, route] / s[t, route].sum()
        h = x[t] if m.latent_down is None else m.latent_down.weight @ x[t]
        acc = m.routed_scaling_factor * sum(p[i] * ref_expert(h, m.experts.gate_up[e], m.experts.down[e],
                                                               m.experts.activation) for i, e in enumerate(route))
        if m.latent_up is not None:
            normed = acc / torch.sqrt(acc.pow(2).mean() + m.latent_norm.eps) * m.latent_norm.weight
            acc = m.latent_up.weight @ normed
        y = acc
        if m.shared is not None:
            y = y + ref_glu(m.shared, x[t])
        out.append(y)
    return torch.stack(out)


def tiny(latent: bool = True, shared: int = 1, activation: str = "situ", scale: float = 1.0) -> K3Config:
    c = preset("tiny")
    c.moe.latent_dim = 32 if latent else None
    c.moe.num_shared_experts = shared
    c.moe.activation = activation
    c.moe.routed_scaling_factor = scale
    return c


def randomise_(m: nn.Module, std: float, seed: int) -> nn.Module:
    """Large random weights (so the soft caps engage) and a random balancing bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
        for name, b in m.named_buffers():
            if name.endswith("balance_bias"):
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.1)
    return m


# ---------------------------------------------------------------------- SiTU (Eq. 11–13)
def test_situ_worked_values():
    assert soft_cap(torch.tensor(2.0, dtype=torch.float64), 4.0).item() == pytest.approx(1.848469, abs=1e-6)
    v = situ(torch.tensor(2.0, dtype=torch.float64), torch.tensor(6.0, dtype=torch.float64), 4.0, 25.0)
    assert v.item() == pytest.approx(9.585417, abs=1e-6)


def test_situ_is_bounded_by_the_cap_product_and_approaches_it():
    big = torch.tensor([-math.inf, -1e30, -1e4, -50.0, -3.0, 0.0, 3.0, 50.0, 1e4, 1e30, math.inf])
    g, u = torch.meshgrid(big, big, indexing="ij")
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        v = situ(g.to(dtype), u.to(dtype), 4.0, 25.0).float()
        assert torch.isfinite(v).all()
        assert v.abs().max() <= 100.0
    assert situ(torch.tensor(1e4), torch.tensor(1e4), 4.0, 25.0).item() == pytest.approx(100.0, rel=1e-6)
    assert situ(torch.tensor(1e4), torch.tensor(-1e4), 4.0, 25.0).item() == pytest.approx(-100.0, rel=1e-6)
    r = torch.randn(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e3
    assert situ(r, r.flip(0), 4.0, 25.0).abs().max() <= 100.0


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False), st.floats(allow_nan=False),
       st.floats(0.1, 50.0), st.floats(0.1, 50.0))
def test_situ_bound_holds_for_any_input_and_caps(g, u, gate_cap, up_cap):
    v = situ(torch.tensor(g, dtype=torch.float64), torch.tensor(u, dtype=torch.float64), gate_cap, up_cap)
    assert math.isfinite(v.item()) and abs(v.item()) <= gate_cap * up_cap


def test_situ_sigmoid_sees_the_uncapped_gate():
    g, u = torch.tensor(8.0, dtype=torch.float64), torch.tensor(6.0, dtype=torch.float64)
    wrong = soft_cap(g, 4.0) * torch.sigmoid(soft_cap(g, 4.0)) * soft_cap(u, 25.0)
    right = situ(g, u, 4.0, 25.0)
    assert right.item() == pytest.approx(4 * math.tanh(2) / (1 + math.exp(-8)) * 25 * math.tanh(6 / 25), rel=1e-12)
    assert abs(right.item() - wrong.item()) > 0.05


# ---------------------------------------------------------------------- GLU
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_glu_matches_reference_and_shared_experts_concatenate(activation):
    torch.manual_seed(0)
    a, b = (randomise_(GLU(8, 6, activation, CAPS).double(), 0.7, s) for s in (1, 2))
    both = GLU(8, 12, activation, CAPS).double()
    with torch.no_grad():  # two experts of hidden 6 == one GLU of hidden 12
        both.gate_proj.weight.copy_(torch.cat([a.gate_proj.weight, b.gate_proj.weight]))
        both.up_proj.weight.copy_(torch.cat([a.up_proj.weight, b.up_proj.weight]))
        both.down_proj.weight.copy_(torch.cat([a.down_proj.weight, b.down_proj.weight], dim=1))
    x = torch.randn(5, 8, dtype=torch.float64) * 3
    torch.testing.assert_close(a(x), ref_glu(a, x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both(x), a(x) + b(x), rtol=1e-12, atol=1e-12)


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation"):
        GLU(4, 4, "gelu", CAPS)
    with pytest.raises(ValueError, match="activation"):
        Experts(2, 4, 4, "relu", CAPS)


# ---------------------------------------------------------------------- router (SPEC §4)
def router_for_scores(scores: list[float], k: int) -> tuple[Router, torch.Tensor]:
    """A router with W = I and one token x = logit(scores), so sigmoid(x W^T) = scores."""
    n = len(scores)
    r = Router(n, n, k)
    with torch.no_grad():
        r.weight.copy_(torch.eye(n))
    s = torch.tensor([scores], dtype=torch.float64)
    return r, torch.log(s / (1 - s)).float()


def test_routing_worked_example():
    r, x = router_for_scores([0.8, 0.7, 0.6, 0.2], k=2)
    with torch.no_grad():
        r.balance_bias[2] = 0.3  # "expert 3" (1-based)
    w, idx, s = r(x)
    assert idx.tolist() == [[2, 0]]  # route {3, 1} 1-based, by biased score .9, .8
    torch.testing.assert_close(w, torch.tensor([[3 / 7, 4 / 7]]))
    torch.testing.assert_close(s, torch.tensor([[0.8, 0.7, 0.6, 0.2]]))
    assert w.dtype == s.dtype == torch.float32 and idx.dtype == torch.int64
    with torch.no_grad():
        r.balance_bias.zero_()
    w, idx, _ = r(x)
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[8 / 15, 7 / 15]]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.data())
def test_bias_changes_the_route_never_the_weight_formula(n, data):
    k = data.draw(st.integers(1, n))
    scores = data.draw(st.lists(st.floats(0.01, 0.99), min_size=n, max_size=n))
    bias = data.draw(st.lists(st.floats(-1.0, 1.0), min_size=n, max_size=n))
    r, x = router_for_scores(scores, k)
    with torch.no_grad():
        r.balance_bias.copy_(torch.tensor(bias))
    w, idx, s = r(x)
    chosen = idx[0].tolist()
    assert len(set(chosen)) == k
    biased = (s + r.balance_bias)[0]
    rest = [j for j in range(n) if j not in chosen]
    if rest:
        assert biased[chosen].min() >= biased[rest].max()
    torch.testing.assert_close(w[0], s[0, chosen] / s[0, chosen].sum())


def test_ties_go_to_the_lower_expert_index():
    r = Router(4, 16, 5)
    with torch.no_grad():
        r.weight.zero_()  # every score is exactly 0.5
    w, idx, _ = r(torch.randn(7, 4))
    assert idx.tolist() == [[0, 1, 2, 3, 4]] * 7
    torch.testing.assert_close(w, torch.full((7, 5), 0.2))
    with torch.no_grad():
        r.balance_bias[[3, 9, 12]] = 0.25  # a three-way tie at the top, then the unbiased tie
    _, idx, _ = r(torch.randn(2, 4))
    assert idx.tolist() == [[3, 9, 12, 0, 1]] * 2


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 12), st.data())
def test_compiled_top_k_chooses_what_the_stable_sort_chooses_ties_included(n, data):
    """`top_k_first` (k argmax passes, what a compiled router runs) picks exactly the stable descending sort's
    first k — the reference is the explicit (value, index) order — with values from a small set, so ties abound."""
    k = data.draw(st.integers(1, n))
    rows = data.draw(st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, -3.0]), min_size=n, max_size=n),
                              min_size=1, max_size=4))
    values = torch.tensor(rows, dtype=torch.float64)
    expected = [sorted(range(n), key=lambda j: (-row[j], j))[:k] for row in rows]
    assert top_k_first(values, k).tolist() == expected == top_k_sorted(values, k).tolist()


def test_router_statistics():
    r = Router(8, 6, 3)
    x = torch.randn(11, 8)
    _, idx, s = r(x)
    assert r.last_scores.shape == (11, 6) and not r.last_scores.requires_grad
    torch.testing.assert_close(r.last_scores, s.detach())
    assert r.last_load.dtype == torch.int64 and r.last_load.shape == (6,)
    assert int(r.last_load.sum()) == 11 * 3
    assert r.last_load.tolist() == torch.bincount(idx.flatten(), minlength=6).tolist()


def test_router_stays_fp32_under_half_precision_casts():
    m = LatentMoE(tiny()).to(torch.bfloat16)
    assert m.router.weight.dtype == m.router.balance_bias.dtype == torch.float32
    assert m.experts.gate_up.dtype == m.latent_down.weight.dtype == torch.bfloat16
    y = m(torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    w, _, s = m.router(torch.randn(4, 64, dtype=torch.bfloat16))
    assert w.dtype == s.dtype == torch.float32
    assert m.double().router.weight.dtype == torch.float64  # never *below* fp32
    assert "router.balance_bias" in m.state_dict()


# ---------------------------------------------------------------------- dispatch (SPEC §9)
def check_dispatch(n, e, k, w, f, activation, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ex = Experts(e, w, f, activation, CAPS).to(dtype)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g, dtype=dtype) * 0.5)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g, dtype=dtype) * 0.5)
    x = torch.randn(n, w, generator=g, dtype=dtype) * 2
    indices = torch.rand(n, e, generator=g).argsort(-1)[:, :k]
    weights = torch.rand(n, k, generator=g, dtype=torch.float32)
    if dtype == torch.float64:
        weights = weights.double()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    ref = ref_dispatch(ex, x, weights, indices)
    torch.testing.assert_close(ex(x, weights, indices), ref, rtol=tol, atol=tol)
    # every dispatch path, whichever forward picks for this shape: sorted by expert, dense, and the compiled
    # decode's gathered weights (`k3.model.compiled`)
    torch.testing.assert_close(ex._dense(x, weights, indices), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(ex._gathered(x, weights, indices), ref, rtol=tol, atol=tol)
    sorted_only = Experts.DENSE_LIMIT
    try:
        Experts.DENSE_LIMIT = 0
        torch.testing.assert_close(ex(x, weights, indices), ref, rtol=tol, atol=tol)
    finally:
        Experts.DENSE_LIMIT = sorted_only


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("n,e,k,w,f", [
    (1, 1, 1, 3, 2),      # one expert
    (2, 9, 2, 4, 5),      # at least five experts get no token
    (7, 5, 5, 6, 3),      # k == E: every token visits every expert
    (13, 6, 3, 8, 7),
])
def test_dispatch_equals_per_token_loop(n, e, k, w, f, activation, dtype):
    check_dispatch(n, e, k, w, f, activation, dtype, seed=n * 100 + e)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 12), st.integers(1, 10), st.integers(1, 6), st.integers(1, 6),
       st.sampled_from(["situ", "swiglu"]), st.sampled_from([torch.float32, torch.float64]), st.data())
def test_dispatch_equals_per_token_loop_random_shapes(n, e, w, f, activation, dtype, data):
    k = data.draw(st.integers(1, e))
    check_dispatch(n, e, k, w, f, activation, dtype, seed=data.draw(st.integers(0, 2**31)))


def test_dispatch_of_an_empty_batch():
    ex = Experts(4, 6, 5, "situ", CAPS)
    y = ex(torch.zeros(0, 6), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert y.shape == (0, 6)


# ---------------------------------------------------------------------- LatentMoE (SPEC §4, Eq. 19)
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("latent,shared,scale", [
    (True, 1, 1.0),
    (True, 2, 2.446),
    (True, 0, 1.0),
    (False, 1, 2.446),
    (False, 0, 1.0),
])
def test_latent_moe_equals_reference_composition(latent, shared, scale, activation):
    m = randomise_(LatentMoE(tiny(latent, shared, activation, scale)).double(), 0.3, seed=3)
    assert (m.shared is None) == (shared == 0)
    assert (m.latent_down is None) == (m.latent_norm is None) == (m.latent_up is None) == (not latent)
    assert m.experts.gate_up.shape[-1] == (32 if latent else 64)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        y, ref = m(x), ref_moe(m, x.reshape(-1, 64))
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(-1, 64), ref, rtol=1e-10, atol=1e-10)


def test_plain_moe_matches_transformers_kimi_linear():
    """latent_dim = None, SwiGLU: weights copy 1:1 from transformers' KimiLinearMoE (n_group = 1)."""
    tkl = transformers_kimi_linear()
    hf = tkl.KimiLinearConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                              n_shared_experts=1, routed_scaling_factor=2.446, hidden_act="silu",
                              n_group=1, topk_group=1)
    peer = tkl.KimiLinearMoE(hf)
    randomise_(peer, 0.4, seed=5)
    with torch.no_grad():
        peer.gate.e_score_correction_bias.copy_(torch.randn(6) * 0.1)
    c = preset("tiny")
    c.hidden_size = 16
    c.moe = dataclasses.replace(c.moe, num_experts=6, num_experts_per_token=2, num_shared_experts=1, expert_hidden=8,
                                shared_hidden=8, latent_dim=None, activation="swiglu", routed_scaling_factor=2.446)
    m = LatentMoE(c)
    state = {
        "router.weight": peer.gate.weight,
        "router.balance_bias": peer.gate.e_score_correction_bias,
        "experts.gate_up": peer.experts.gate_up_proj,
        "experts.down": peer.experts.down_proj,
        "shared.gate_proj.weight": peer.shared_experts.gate_proj.weight,
        "shared.up_proj.weight": peer.shared_experts.up_proj.weight,
        "shared.down_proj.weight": peer.shared_experts.down_proj.weight,
    }
    m.load_state_dict(state, strict=True)
    x = torch.randn(3, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(m(x), peer(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- parameter counts (config.py)
@pytest.mark.parametrize("cfg", [
    preset("tiny"), preset("small"), tiny(latent=False), tiny(shared=0), tiny(shared=2), tiny(False, 0),
], ids=["tiny", "small", "tiny-plain", "tiny-no-shared", "tiny-two-shared", "tiny-plain-no-shared"])
def test_parameter_counts_match_the_config_formulas(cfg):
    m = LatentMoE(cfg)
    assert sum(p.numel() for p in m.parameters()) == moe_layer_parameters(cfg)[0]
    assert "router.balance_bias" in dict(m.named_buffers())
    assert "router.balance_bias" not in dict(m.named_parameters())
    d, h = cfg.hidden_size, cfg.moe.dense_hidden
    assert sum(p.numel() for p in GLU(d, h, cfg.moe.activation, cfg.situ).parameters()) == 3 * d * h


def test_paper_layer_builds_on_meta_with_the_published_count():
    cfg = preset("paper")
    with torch.device("meta"):
        m = LatentMoE(cfg)
        dense = build_ffn(cfg, 0)
    assert m.experts.gate_up.is_meta and m.experts.gate_up.shape == (896, 2 * 3072, 3584)
    assert m.router.weight.dtype == torch.float32
    assert sum(p.numel() for p in m.parameters()) == moe_layer_parameters(cfg)[0]
    assert sum(p.numel() for p in dense.parameters()) == 3 * 7168 * 33792  # the release's width


def test_default_init():
    cfg = preset("small")
    torch.manual_seed(0)
    m = LatentMoE(cfg)
    for name, p in m.named_parameters():
        if name == "latent_norm.weight":
            assert (p == 1).all()
        else:
            assert abs(p.std().item() - cfg.initializer_range) < 0.1 * cfg.initializer_range, name
    assert (m.router.balance_bias == 0).all()


# ---------------------------------------------------------------------- gradients
def test_gradients_reach_used_experts_router_and_latents():
    torch.manual_seed(0)
    m = LatentMoE(preset("tiny"))
    x = torch.randn(16, 64)
    (m(x) * torch.randn(16, 64)).sum().backward()
    load = m.router.last_load
    for e in range(m.experts.gate_up.shape[0]):
        used = bool(load[e] > 0)
        assert bool(m.experts.gate_up.grad[e].abs().sum() > 0) == used
        assert bool(m.experts.down.grad[e].abs().sum() > 0) == used
    for name in ("router.weight", "latent_down.weight", "latent_up.weight", "latent_norm.weight",
                 "shared.gate_proj.weight", "shared.up_proj.weight", "shared.down_proj.weight"):
        assert m.get_parameter(name).grad.abs().sum() > 0, name
    assert m.router.balance_bias.grad is None


def test_gradcheck_wrt_input_fp64():
    c = preset("tiny")
    c.hidden_size = 8
    c.moe = dataclasses.replace(c.moe, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                                expert_hidden=6, shared_hidden=6, latent_dim=4, routed_scaling_factor=1.5)
    m = randomise_(LatentMoE(c).double(), 0.6, seed=7)
    g = torch.Generator().manual_seed(8)
    for _ in range(100):  # routing is piecewise constant: keep the k-th / (k+1)-th margin wide
        x = torch.randn(3, 8, generator=g, dtype=torch.float64)
        _, _, s = m.router(x)
        top = (s + m.router.balance_bias).sort(-1, descending=True).values
        if (top[:, 1] - top[:, 2]).min() > 1e-2:
            break
    else:
        pytest.fail("no input with wide routing margins")
    assert torch.autograd.gradcheck(m, (x.requires_grad_(),), eps=1e-6, atol=1e-8)


# ---------------------------------------------------------------------- build_ffn
def test_build_ffn_follows_the_ffn_schedule():
    cfg = preset("tiny")
    dense, moe = build_ffn(cfg, 0), build_ffn(cfg, 1)
    assert type(dense) is GLU and dense.gate_proj.weight.shape == (cfg.moe.dense_hidden, cfg.hidden_size)
    assert type(moe) is LatentMoE
    x = torch.randn(2, 3, cfg.hidden_size)
    assert dense(x).shape == moe(x).shape == x.shape
