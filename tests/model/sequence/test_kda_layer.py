"""k3.model.sequence.kda: the KDA layer against an explicit per-token reference (SPEC §1)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.sizing.params import kda_layer_parameters
from k3.config import preset
from k3.model.sequence.kda import KDALayer, ShortConv


def config(gate="bounded", output_gate_rank=0, chunk=16):
    c = preset("tiny")
    c.kda = dataclasses.replace(c.kda, gate=gate, output_gate_rank=output_gate_rank, chunk_size=chunk)
    return c


def layer_fp64(cfg, seed=0):
    torch.manual_seed(seed)
    layer = KDALayer(cfg).double()
    with torch.no_grad():  # larger random weights than the init so every term matters
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return layer


def reference(layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
    """Eq. 1–6 token by token with explicit loops (fp64)."""
    B, T, _ = x.shape
    H, K, V = layer.num_heads, layer.head_dim, layer.value_dim
    pre = torch.cat([x @ layer.q_proj.weight.T, x @ layer.k_proj.weight.T, x @ layer.v_proj.weight.T], -1)
    w = layer.conv.weight  # [C, width]
    width = w.shape[1]
    conv = torch.zeros_like(pre)
    for t in range(T):
        for j in range(width):
            src = t - (width - 1) + j
            if src >= 0:
                conv[:, t] += w[:, j] * pre[:, src]
    conv = conv * torch.sigmoid(conv)
    q, k, v = conv.split([H * K, H * K, H * V], -1)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    z = (x @ layer.f_a_proj.weight.T @ layer.f_b_proj.weight.T).view(B, T, H, K) + layer.dt_bias.view(H, K)
    a = layer.A_log.exp().view(H, 1)
    if layer.gate == "bounded":
        g = layer.g_min * torch.sigmoid(a * z)
    else:
        g = -a * torch.log1p(torch.exp(z))
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    S = torch.zeros(B, H, K, V, dtype=x.dtype)
    o = torch.zeros(B, T, H, V, dtype=x.dtype)
    for t in range(T):
        for b in range(B):
            for h in range(H):
                s = torch.diag(g[b, t, h].exp()) @ S[b, h]
                kk = k[b, t, h].unsqueeze(1)
                erase = torch.eye(K, dtype=x.dtype) - beta[b, t, h] * kk @ kk.T
                s = erase @ s + beta[b, t, h] * kk @ v[b, t, h][None]
                S[b, h] = s
                o[b, t, h] = s.T @ q[b, t, h] / math.sqrt(K)
    if hasattr(layer, "g_proj"):
        gate = x @ layer.g_proj.weight.T
    else:
        gate = x @ layer.g_a_proj.weight.T @ layer.g_b_proj.weight.T
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.o_norm.weight
    o = o * torch.sigmoid(gate.view(B, T, H, V))
    return o.reshape(B, T, H * V) @ layer.o_proj.weight.T


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("output_gate_rank", [0, 8], ids=["full-rank gate", "low-rank gate"])
def test_layer_equals_explicit_reference(gate, output_gate_rank):
    layer = layer_fp64(config(gate, output_gate_rank))
    x = torch.randn(2, 21, 64, dtype=torch.float64)
    y, none = layer(x, None)
    assert none is None
    torch.testing.assert_close(y, reference(layer, x), atol=1e-10, rtol=1e-10)


@settings(max_examples=15, deadline=None)
@given(T=st.integers(2, 40), data=st.data(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_streaming_equals_one_call(T, data, dtype):
    """Token by token, and any split of the sequence, give the same output and state as one call."""
    layer = layer_fp64(config()).to(dtype)
    x = torch.randn(2, T, 64, dtype=dtype)
    tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)
    y, s = layer(x, layer.new_state(2))
    split = data.draw(st.integers(1, T - 1), label="split")
    y1, s1 = layer(x[:, :split], layer.new_state(2))
    y2, s2 = layer(x[:, split:], s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, **tol)
    steps, state = [], layer.new_state(2)
    for t in range(T):
        y_t, state = layer(x[:, t : t + 1], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps, 1), y, **tol)
    for final in (s2, state):
        torch.testing.assert_close(final.conv, s.conv, **tol)
        torch.testing.assert_close(final.recurrent, s.recurrent, **tol)


def test_state_is_not_modified_in_place():
    layer = KDALayer(config())
    state = layer.new_state(1)
    before = (state.conv.clone(), state.recurrent.clone())
    layer(torch.randn(1, 5, 64), state)
    assert torch.equal(state.conv, before[0]) and torch.equal(state.recurrent, before[1])


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("decay", ["channel", "head"])
def test_parameter_count_matches_the_config(name, decay):
    c = preset(name)
    c.kda = dataclasses.replace(c.kda, decay=decay)
    assert sum(p.numel() for p in KDALayer(c).parameters()) == kda_layer_parameters(c)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_a_decay_per_head_is_a_channel_decay_equal_on_the_heads_channels(gate):
    """``kda.decay = "head"`` (Gated DeltaNet's scalar gate, issue 38): the same layer as a per-channel one whose
    decay projection rows and dt_bias repeat each head's value on its d_k channels."""
    per_head = dataclasses.replace(config(gate), kda=dataclasses.replace(config(gate).kda, decay="head"))
    head = layer_fp64(per_head)
    channel = layer_fp64(config(gate), seed=1)
    K = channel.head_dim
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name in ("f_b_proj.weight", "dt_bias"):
                p.normal_(0, 0.5)
                channel.get_parameter(name).copy_(p.repeat_interleave(K, dim=0))
            else:
                channel.get_parameter(name).copy_(p)
    assert head.f_b_proj.weight.shape[0] == head.num_heads
    x = torch.randn(2, 21, 64, dtype=torch.float64)
    torch.testing.assert_close(head(x, None)[0], channel(x, None)[0], rtol=1e-12, atol=1e-12)
    g = head.decay(head.projections(x).decay)
    assert torch.equal(g, g[..., :1].expand_as(g))  # one decay per head
    with pytest.raises(ValueError, match="kda.decay"):
        dataclasses.replace(config(), kda=dataclasses.replace(config().kda, decay="token")).validate()


def test_paper_size_on_meta():
    c = preset("paper")
    with torch.device("meta"):
        layer = KDALayer(c)
    assert sum(p.numel() for p in layer.parameters()) == kda_layer_parameters(c)


def gate_config(name: str, gate: str = "bounded"):
    """The preset's KDA gate dims; "paper-gate" is the paper's 96 heads × 128 channels and decay rank 128 on a
    64-wide input (the gate's init does not depend on the width)."""
    c = preset("tiny" if name == "paper-gate" else name)
    if name == "paper-gate":
        paper = preset("paper").kda
        c.kda = dataclasses.replace(c.kda, num_heads=paper.num_heads, head_dim=paper.head_dim,
                                    value_head_dim=16, decay_rank=paper.decay_rank)
    c.kda = dataclasses.replace(c.kda, gate=gate)
    return c


def gate_logits(layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
    """The bounded gate's sigmoid logit ``e^A·(x W_f1 W_f2 + dt_bias)`` [B, T, H, K], written out (fp64)."""
    H, K = layer.num_heads, layer.head_dim
    x = x.double()
    z = (x @ layer.f_a_proj.weight.double().T @ layer.f_b_proj.weight.double().T).view(*x.shape[:2], H, K)
    return layer.A_log.double().exp().view(H, 1) * (z + layer.dt_bias.double().view(H, K))


@pytest.mark.parametrize("name", ["tiny", "small", "paper-gate"])
def test_bounded_gate_init_keeps_every_channel_live(name):
    """At init every channel's ``|∂α/∂logit| = α·|g_min|·σ(1 − σ)`` is far above 1e-6 (fla's softplus init reused
    for this gate left 56–88 % of channels below 1e-6), and every logit is below 0: retention above the middle of
    the gate's range, as Kimi Linear's gate starts."""
    torch.manual_seed(0)
    c = gate_config(name)
    layer = KDALayer(c)
    x = torch.randn(2, 16, c.hidden_size)
    logit = gate_logits(layer, x).detach()
    s = torch.sigmoid(logit)
    alpha = torch.exp(-5.0 * s)
    slope = (alpha * 5.0 * s * (1 - s))  # |∂α/∂logit| with g_min = −5
    assert (slope > 1e-4).all(), f"{(slope <= 1e-4).double().mean():.1%} of channels have a dead gate"
    assert (logit < 0).all()
    # The same gradient reaches dt_bias through the layer's own gate (∂logit/∂dt_bias = e^A = 1 at init).
    layer.decay(layer.f_a_proj(x)).exp().sum().backward()
    expected = -slope.sum((0, 1)).flatten()
    torch.testing.assert_close(layer.dt_bias.grad.double(), expected, rtol=1e-4, atol=0)


def initial_decays(gate: str, seeds: range, **kda) -> torch.Tensor:
    """Fresh layers' log-decays at z = 0 (fp64), one per decay parameter, a layer per seed."""
    c = gate_config("paper-gate", gate=gate)
    c.kda = dataclasses.replace(c.kda, **kda)
    decays = []
    for seed in seeds:
        torch.manual_seed(seed)
        layer = KDALayer(c).double()
        g = layer.decay(torch.zeros(1, 1, layer.f_a_proj.out_features, dtype=torch.float64))
        decays.append(g[..., :layer.decay_width].flatten().detach())
    return torch.cat(decays)


@pytest.mark.parametrize("decay", ["channel", "head"])
def test_bounded_gate_starts_at_kimi_linears_initial_decays(decay):
    """At z = 0 the bounded gate's decays are distributed as the softplus gate's under fla's init (g = −A·dt,
    A ~ U[1, 16] per head, dt ~ logU[1e-3, 0.1]; `test_softplus_gate_keeps_fla_init`): the quantiles of log|g| of
    layers made from different seeds agree (96 heads a layer: 8 layers of one decay per head), and every decay lies in
    [−16·0.1, −1e-3]; ``A_log = 0``."""
    seeds = 1 if decay == "channel" else 8
    bounded = initial_decays("bounded", range(seeds), decay=decay)
    softplus = initial_decays("softplus", range(seeds, 2 * seeds), decay=decay)
    assert (bounded >= -1.6 * (1 + 1e-6)).all() and (bounded <= -1e-3 * (1 - 1e-6)).all()
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    torch.testing.assert_close(bounded.abs().log().quantile(q), softplus.abs().log().quantile(q), atol=0.25, rtol=0)
    layer = KDALayer(gate_config("paper-gate"))
    torch.testing.assert_close(layer.A_log, torch.zeros_like(layer.A_log))  # unit log-scale e^A = 1


def test_a_floor_above_the_initial_decays_keeps_the_gate_inside_its_range():
    """With g_min = −0.5 (above −A·dt's −1.6) the largest initial decays stop at g_min·(1 − ε), not at the floor."""
    g = initial_decays("bounded", range(1), g_min=-0.5)
    assert (g > -0.5).all() and (g.min() + 0.5).abs() < 1e-3 and (g <= -1e-3 * (1 - 1e-6)).all()


def test_softplus_gate_keeps_fla_init():
    """Kimi Linear's gate keeps fla's init: A ∈ [1, 16], dt_bias = softplus⁻¹(dt) with dt ∈ [1e-3, 0.1]."""
    torch.manual_seed(0)
    layer = KDALayer(gate_config("paper-gate", gate="softplus"))
    A, dt = layer.A_log.detach().exp(), torch.nn.functional.softplus(layer.dt_bias.detach().double())
    assert (A >= 1 - 1e-5).all() and (A <= 16 + 1e-4).all()
    assert (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 0.1 * (1 + 1e-5)).all()
    assert dt.log().median().item() == pytest.approx(math.log(1e-2), abs=0.1)  # log-uniform: median √(1e-3·0.1)


@pytest.mark.parametrize("T", [1, 3, 64, 65, 130])
def test_short_conv_paths_equal_an_explicit_loop(T):
    """The windowed-dot path (T ≤ 64) and the convolution path (longer) are the same causal depthwise conv."""
    torch.manual_seed(T)
    conv = ShortConv(6, 4).double()
    torch.nn.init.normal_(conv.weight)
    x, window = torch.randn(2, T, 6, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    y, new_window = conv(x, window)
    full = torch.cat([window, x], 1)
    ref = torch.stack([sum(full[:, t + j] * conv.weight[:, j] for j in range(4)) for t in range(T)], 1)
    torch.testing.assert_close(y, torch.nn.functional.silu(ref), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(new_window, full[:, -3:])
