"""k3.ops.kda: the chunkwise form, the affine summaries and the gates against the fp64 recurrence (SPEC §1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.ops import kda
from peers import fla_gates, fla_naive, transformers_kimi_linear

F32 = dict(atol=1e-5, rtol=1e-5)
F64 = dict(atol=1e-10, rtol=1e-10)
BF16_REL_RMS = 1e-2  # bf16 inputs: outputs are rounded to bf16 (2^-8), accumulation stays fp32


def make(B=2, T=33, H=2, K=16, V=8, dtype=torch.float64, seed=0, g_low=-5.0, g_high=0.0, beta=None):
    """Random KDA inputs: unit-norm-ish q/k (as the layer's L2 norm makes them), g uniform in (g_low, g_high]."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = kda.l2norm(r(B, T, H, K)), kda.l2norm(r(B, T, H, K))
    v = r(B, T, H, V)
    g = g_high + (g_low - g_high) * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    b = torch.rand(B, T, H, generator=gen, dtype=torch.float64) if beta is None else torch.full((B, T, H), beta)
    return [x.to(dtype) for x in (q, k, v, g, b)]


def state(B=2, H=2, K=16, V=8, dtype=torch.float64, seed=1):
    return torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def rel_rms(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


# ---------------------------------------------------------------------- chunked == recurrent
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, chunk, with_state):
    q, k, v, g, b = make(T=T, seed=T * 7 + chunk)
    S0 = state() if with_state else None
    o_ref, s_ref = kda.recurrent(q, k, v, g, b, initial_state=S0)  # fp64 gold
    o64, s64 = kda.chunked(q, k, v, g, b, initial_state=S0, chunk_size=chunk)
    torch.testing.assert_close(o64, o_ref, **F64)
    torch.testing.assert_close(s64, s_ref, **F64)
    f32 = [x.float() for x in (q, k, v, g, b)]
    o32, s32 = kda.chunked(*f32, initial_state=None if S0 is None else S0.float(), chunk_size=chunk)
    assert o32.dtype == s32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o_ref, **F32)
    torch.testing.assert_close(s32.double(), s_ref, **F32)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), T=st.sampled_from([1, 15, 16, 17, 63, 64, 65, 200]), H=st.integers(1, 3),
       K=st.sampled_from([4, 8, 16, 32]), V=st.sampled_from([1, 8, 24]), chunk=st.sampled_from([16, 32, 64]),
       with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_chunked_equals_recurrent_random_shapes(B, T, H, K, V, chunk, with_state, seed):
    q, k, v, g, b = make(B, T, H, K, V, seed=seed)
    S0 = state(B, H, K, V, seed=seed + 1) if with_state else None
    o_ref, s_ref = kda.recurrent(q, k, v, g, b, initial_state=S0)
    o, s = kda.chunked(q, k, v, g, b, initial_state=S0, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(s, s_ref, **F64)
    o32, s32 = kda.chunked(*(x.float() for x in (q, k, v, g, b)),
                           initial_state=None if S0 is None else S0.float(), chunk_size=chunk)
    torch.testing.assert_close(o32.double(), o_ref, **F32)
    torch.testing.assert_close(s32.double(), s_ref, **F32)


@pytest.mark.parametrize("T", [17, 64, 200])
def test_bf16_inputs_within_relative_rms(T):
    q, k, v, g, b = make(T=T, seed=T, dtype=torch.bfloat16)
    o_ref, s_ref = kda.recurrent(*(x.double() for x in (q, k, v, g, b)))
    o, s = kda.chunked(q, k, v, g, b)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_rms(o, o_ref) < BF16_REL_RMS
    assert rel_rms(s, s_ref) < 1e-5  # the state is accumulated and returned in fp32


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, F64), (torch.float32, F32)])
def test_steps_equal_the_recurrence(with_state, dtype, tol):
    """The fused decode step, applied token by token (`steps`), equals Eq. 1 as written (`recurrent`)."""
    q, k, v, g, b = make(T=20, seed=3)
    S0 = state(seed=4) if with_state else None
    o_ref, s_ref = kda.recurrent(q, k, v, g, b, initial_state=S0)
    S = None if S0 is None else S0.to(dtype)
    before = None if S is None else S.clone()
    o, S = kda.steps(*(x.to(dtype) for x in (q, k, v, g, b)), S)
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(S.double(), s_ref, **tol)
    if S0 is not None:
        assert torch.equal(S0.to(dtype), before)  # the caller's state is not written


@pytest.mark.parametrize("T", [0, 1, 5, 17])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, F64), (torch.float32, F32)])
def test_the_state_after_a_run_equals_the_recurrences(T, dtype, tol):
    """The state alone after a run (`state_after`, the accepted prefix's replay) equals Eq. 1 as written
    (`recurrent`), and leaves the caller's state as it was."""
    q, k, v, g, b = make(T=T, seed=5)
    S0 = state(seed=6)
    _, s_ref = kda.recurrent(q, k, v, g, b, initial_state=S0)
    before = S0.to(dtype)
    S = kda.state_after(*(x.to(dtype) for x in (k, v, g, b)), before)
    assert S.dtype == dtype and S.shape == S0.shape
    torch.testing.assert_close(S.double(), s_ref, **tol)
    assert torch.equal(before, S0.to(dtype))


def test_empty_sequence_returns_the_state():
    q, k, v, g, b = make(T=0)
    S0 = state()
    for fn in (kda.recurrent, kda.chunked):
        o, s = fn(q, k, v, g, b, initial_state=S0)
        assert o.shape == (2, 0, 2, 8)
        torch.testing.assert_close(s, S0)


# ---------------------------------------------------------------------- chunk splitting, causality
@settings(max_examples=30, deadline=None)
@given(T=st.integers(2, 150), data=st.data(), chunk=st.sampled_from([16, 32, 64]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_split_anywhere_carrying_state(T, data, chunk, dtype):
    split = data.draw(st.integers(0, T), label="split")
    q, k, v, g, b = make(T=T, seed=T + split, dtype=dtype)
    S0 = state(dtype=dtype)
    o, s = kda.chunked(q, k, v, g, b, initial_state=S0, chunk_size=chunk)
    head = kda.chunked(*(x[:, :split] for x in (q, k, v, g, b)), initial_state=S0, chunk_size=chunk)
    tail = kda.chunked(*(x[:, split:] for x in (q, k, v, g, b)), initial_state=head[1], chunk_size=chunk)
    tol = F64 if dtype == torch.float64 else F32
    torch.testing.assert_close(torch.cat([head[0], tail[0]], 1), o, **tol)
    torch.testing.assert_close(tail[1], s, **tol)


@pytest.mark.parametrize("fn", [kda.chunked, kda.recurrent], ids=["chunked", "recurrent"])
@pytest.mark.parametrize("P", [1, 16, 40, 63, 64, 100])
@pytest.mark.parametrize("regime", [(-5.0, 0.0), (-12.0, -6.0)], ids=["bounded", "unbounded"])
def test_causality_bit_exact(fn, P, regime):
    """Changing anything at positions >= P leaves every output before P bit-for-bit unchanged."""
    q, k, v, g, b = make(T=128, dtype=torch.float32, g_low=regime[0], g_high=regime[1])
    q2, k2, v2, g2, b2 = make(T=128, dtype=torch.float32, seed=99, g_low=regime[0], g_high=regime[1])
    mixed = [torch.cat([x[:, :P], y[:, P:]], 1) for x, y in zip((q, k, v, g, b), (q2, k2, v2, g2, b2))]
    o = fn(q, k, v, g, b, initial_state=state(dtype=torch.float32))[0]
    o_mixed = fn(*mixed, initial_state=state(dtype=torch.float32))[0]
    assert torch.equal(o[:, :P], o_mixed[:, :P])
    assert not torch.equal(o[:, P:], o_mixed[:, P:])


# ---------------------------------------------------------------------- extremes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g_value", [-5.0, -1e-7, 0.0], ids=["saturated", "near-zero", "zero"])
def test_extreme_decay_stays_finite(dtype, g_value):
    q, k, v, g, b = make(T=200, H=2, K=32, V=32)
    g = torch.full_like(g, g_value)
    args = [x.to(dtype).requires_grad_() for x in (q, k, v, g, b)]
    o, s = kda.chunked(*args, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    (o.float().square().sum() + s.square().sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in args)
    o_ref, s_ref = kda.recurrent(*(x.detach().double() for x in args))
    limit = 1e-5 if dtype == torch.float32 else BF16_REL_RMS
    assert rel_rms(o, o_ref) < limit and rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_near_collinear_keys_with_beta_one(dtype):
    B, T, H, K, V = 1, 130, 2, 16, 16
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1, 1, H, K, generator=gen, dtype=torch.float64)
    k = kda.l2norm(base + 1e-4 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64))
    q, _, v, g, _ = make(B, T, H, K, V, seed=4, g_low=-0.01)
    b = torch.full((B, T, H), 0.9999, dtype=torch.float64)
    o_ref, s_ref = kda.recurrent(q, k, v, g, b)
    o, s = kda.chunked(*(x.to(dtype) for x in (q, k, v, g, b)))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    tol = F64 if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(s.double(), s_ref, **tol)


def test_unbounded_softplus_decays_take_the_masked_path():
    """Kimi Linear's gate can go far below -5: the diagonal tiles then mask before exponentiating."""
    q, k, v, g, b = make(T=100, g_low=-60.0, g_high=-0.5, dtype=torch.float32)
    o_ref, s_ref = kda.recurrent(*(x.double() for x in (q, k, v, g, b)))
    o, s = kda.chunked(q, k, v, g, b)
    torch.testing.assert_close(o.double(), o_ref, **F32)
    torch.testing.assert_close(s.double(), s_ref, **F32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("g_range", [(-5.0, 0.0), (-5.0, -4.9), (-60.0, -0.5)],
                         ids=["bounded", "saturated", "unbounded"])
def test_strong_decays_leave_no_subnormal_chunk_terms(dtype, g_range):
    """Strongly decayed chunks must not fill the products' operands with subnormals (slow on CPUs):
    factors below e^-L are flushed to 0, and the outputs still equal the fp64 recurrence."""
    q, k, v, g, b = make(B=1, T=256, H=2, K=32, V=16, seed=8, g_low=g_range[0], g_high=g_range[1], dtype=dtype)
    chunks = [kda._to_chunks(x, 64, dtype).flatten(0, 1) for x in (q, k, v, g, b)]
    terms = kda._chunk_terms(*chunks[:4], chunks[4][..., 0], float(g.min()))
    tiny = torch.finfo(dtype).tiny
    for name, t in terms.items():
        assert not ((t != 0) & (t.abs() < tiny)).any(), f"{name} holds subnormal entries"
    total = chunks[3].sum(1)  # each chunk's whole log-decay: its factor is flushed exactly below -L
    torch.testing.assert_close(terms["decay"] == 0, total < -kda._FLUSH_EXPONENT[dtype])
    S0 = state(1, 2, 32, 16, dtype=dtype)
    o_ref, s_ref = kda.recurrent(*(x.double() for x in (q, k, v, g, b)), initial_state=S0.double())
    o, s = kda.chunked(q, k, v, g, b, initial_state=S0)
    tol = F32 if dtype == torch.float32 else F64
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(s.double(), s_ref, **tol)


@settings(max_examples=30, deadline=None)
@given(C=st.sampled_from([16, 32, 64, 128]), scale=st.floats(0.01, 2.0), seed=st.integers(0, 2**16))
def test_tiled_unit_lower_inverse_equals_the_dense_inverse(C, scale, seed):
    A = scale * torch.randn(3, C, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) / C**0.5
    expected = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.tril(-1))
    torch.testing.assert_close(kda._unit_lower_inverse(A + A.triu()), expected, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------- gradients
@pytest.mark.parametrize("g_range", [(-4.0, -0.1), (-60.0, -45.0)], ids=["bounded", "masked"])
def test_gradcheck_chunked_fp64(g_range):
    q, k, v, g, b = make(B=1, T=20, H=2, K=4, V=3, seed=5, g_low=g_range[0], g_high=g_range[1])
    S0 = state(1, 2, 4, 3)
    args = [x.requires_grad_() for x in (q, k, v, g, b, S0)]

    def f(q, k, v, g, b, S0):
        return kda.chunked(q, k, v, g, b, initial_state=S0, chunk_size=16)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


def test_fp32_gradients_match_recurrent():
    q, k, v, g, b = make(T=70, seed=6)
    S0 = state()
    ref = [x.clone().requires_grad_() for x in (q, k, v, g, b, S0)]
    out = [x.float().requires_grad_() for x in (q, k, v, g, b, S0)]
    weight = torch.randn(2, 70, 2, 8, dtype=torch.float64)
    o, s = kda.recurrent(*ref[:5], initial_state=ref[5])
    ((o * weight).sum() + s.sum()).backward()
    o, s = kda.chunked(*out[:5], initial_state=out[5])
    ((o * weight.float()).sum() + s.sum()).backward()
    for x, y in zip(out, ref):
        torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- affine segment summaries
def test_summary_maps_any_state_like_running_the_segment():
    q, k, v, g, b = make(T=90, seed=7)
    M, U = kda.segment_summary(k, g, b, v)
    assert M.shape == (2, 2, 16, 16) and U.shape == (2, 2, 16, 8)
    for seed in range(3):
        S = state(seed=seed)
        _, s_ref = kda.recurrent(q, k, v, g, b, initial_state=S)
        torch.testing.assert_close(M @ S + U, s_ref, **F64)


def test_summaries_compose_associatively_but_not_commutatively():
    q, k, v, g, b = make(T=120, seed=8)
    cuts = [(0, 30), (30, 77), (77, 120)]
    a, b_, c = (kda.segment_summary(*(x[:, i:j] for x in (k, g, b, v)), chunk_size=16) for i, j in cuts)
    left = kda.compose(kda.compose(a, b_), c)
    right = kda.compose(a, kda.compose(b_, c))
    whole = kda.segment_summary(k, g, b, v)
    for x, y, z in zip(left, right, whole):
        torch.testing.assert_close(x, y, **F64)
        torch.testing.assert_close(x, z, **F64)
    swapped = kda.compose(b_, a)
    assert not torch.allclose(kda.compose(a, b_)[1], swapped[1], atol=1e-3)


# ---------------------------------------------------------------------- gates, norm, worked values
def test_worked_scalar_update():
    """Scalar state 6, α=.8, v=10, β=.5 (unit key) → 7.4 (SPEC §1)."""
    one = torch.ones(1, 1, 1, dtype=torch.float64)
    S = torch.full((1, 1, 1, 1), 6.0, dtype=torch.float64)
    o, s = kda.step(one, one, 10 * one, math.log(0.8) * one, 0.5 * one[..., 0], S, scale=1.0)
    assert s.item() == pytest.approx(7.4, abs=1e-12) and o.item() == pytest.approx(7.4, abs=1e-12)


@pytest.mark.parametrize("fn", [kda.recurrent, kda.chunked], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("values, expected", [((2.0, 10.0), 5.25), ((10.0, 2.0), 2.25)])
def test_worked_order_example(fn, values, expected):
    """From 0 with α = β = .5: writing 2 then 10 gives 5.25, 10 then 2 gives 2.25 — order matters."""
    ones = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    v = torch.tensor(values, dtype=torch.float64).view(1, 2, 1, 1)
    o, s = fn(ones, ones, v, math.log(0.5) * ones, 0.5 * ones[..., 0], scale=1.0)
    assert s.item() == pytest.approx(expected, abs=1e-12)
    assert o[0, -1].item() == pytest.approx(expected, abs=1e-12)


def test_bounded_retention_worked_value_and_range():
    H, K = 3, 4
    zero = torch.zeros(H, K, dtype=torch.float64)
    g = kda.bounded_decay(zero, torch.zeros(H), torch.zeros(H * K))
    assert torch.allclose(g, torch.full_like(g, -2.5))
    assert math.exp(-2.5) == pytest.approx(0.0821, abs=5e-5)
    # Strictly inside (e^-5, 1) until sigmoid itself rounds to 0 or 1: |logit| <= 30 in fp64, <= 12 in fp32.
    for dtype, reach in ((torch.float64, 30.0), (torch.float32, 12.0)):
        z = torch.linspace(-reach + 1, reach - 1, 2001, dtype=dtype).view(-1, 1, 1).expand(-1, H, K)
        alpha = kda.bounded_decay(z, torch.zeros(H), torch.rand(H * K) * 2 - 1).exp()
        assert alpha.dtype == dtype
        assert (alpha > math.exp(-5)).all() and (alpha < 1).all()


def test_softplus_decay_formula():
    z, A_log, dt = torch.randn(5, 3, 4), torch.randn(3), torch.randn(12)
    expected = -A_log.exp().view(3, 1) * torch.nn.functional.softplus(z + dt.view(3, 4))
    torch.testing.assert_close(kda.softplus_decay(z, A_log, dt), expected)
    assert (kda.softplus_decay(z, A_log, dt) <= 0).all()


def test_l2norm_regularised():
    x = torch.randn(7, 16, dtype=torch.float64)
    y = kda.l2norm(x)
    torch.testing.assert_close(y, x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    assert (y.norm(dim=-1) < 1).all()
    assert torch.equal(kda.l2norm(torch.zeros(3, 8)), torch.zeros(3, 8))


# ---------------------------------------------------------------------- bad input
def test_bad_input_to_the_state_after_a_run_names_the_argument():
    _, k, v, g, b = make(T=5, dtype=torch.float32)
    S = state(dtype=torch.float32)
    cases = {"k": (k.long(), v, g, b, S), "v": (k, v[:, :4], g, b, S), "g": (k, v, g[:, :, :1], b, S),
             "beta": (k, v, g, b[..., None], S), "initial_state": (k, v, g, b, S[..., :3])}
    for name, args in cases.items():
        with pytest.raises(ValueError, match=f"^{name}:"):
            kda.state_after(*args)
    with pytest.raises(ValueError, match="^k: expected 4 dims"):
        kda.state_after(k[:, 0], v, g, b, S)


@pytest.mark.parametrize("fn", [kda.recurrent, kda.chunked], ids=["recurrent", "chunked"])
def test_bad_input_names_the_argument(fn):
    q, k, v, g, b = make(T=5, dtype=torch.float32)
    cases = {
        "k": (q, k[..., :3], v, g, b),
        "v": (q, k, v[:, :4], g, b),
        "g": (q, k, v, g[:, :, :1], b),
        "beta": (q, k, v, g, b[..., None]),
        "q": (q.long(), k, v, g, b),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError, match=f"^{name}:"):
            fn(*args)
    with pytest.raises(ValueError, match="^initial_state:"):
        fn(q, k, v, g, b, initial_state=torch.zeros(2, 2, 16, 9))


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("-inf")])
def test_chunked_rejects_invalid_decay(bad):
    q, k, v, g, b = make(T=5, dtype=torch.float32)
    g[0, 2, 1, 3] = bad
    with pytest.raises(ValueError, match="^g:"):
        kda.chunked(q, k, v, g, b)


@pytest.mark.parametrize("chunk", [0, 8, 24, 64.0])
def test_chunk_size_must_be_multiple_of_16(chunk):
    with pytest.raises(ValueError, match="^chunk_size:"):
        kda.chunked(*make(T=5, dtype=torch.float32), chunk_size=chunk)


def test_gate_shape_errors():
    with pytest.raises(ValueError, match="^A_log:"):
        kda.bounded_decay(torch.zeros(2, 3, 4), torch.zeros(4), torch.zeros(12))
    with pytest.raises(ValueError, match="^dt_bias:"):
        kda.softplus_decay(torch.zeros(2, 3, 4), torch.zeros(3), torch.zeros(13))
    with pytest.raises(ValueError, match="^g_min:"):
        kda.bounded_decay(torch.zeros(2, 3, 4), torch.zeros(3), None, g_min=1.0)


# ---------------------------------------------------------------------- peers as oracles
@pytest.mark.parametrize("T", [64, 128])
def test_matches_fla_naive_reference(T):
    fla = fla_naive()
    q, k, v, g, b = make(T=T, seed=T, dtype=torch.float32)
    S0 = state(dtype=torch.float32)
    o, s = kda.chunked(q, k, v, g, b, initial_state=S0)
    for peer in (fla.naive_recurrent_kda, fla.naive_chunk_kda):
        o_p, s_p = peer(q, k, v, g, b, initial_state=S0.clone(), output_final_state=True)
        torch.testing.assert_close(o, o_p, **F32)
        torch.testing.assert_close(s, s_p, **F32)


@pytest.mark.parametrize("T", [1, 50, 130])
def test_matches_transformers_kimi_linear_torch_paths(T):
    tf = transformers_kimi_linear()
    q, k, v, g, b = make(T=T, seed=T, dtype=torch.float32)
    S0 = state(dtype=torch.float32)
    o, s = kda.chunked(q, k, v, g, b, initial_state=S0)
    o_c, s_c = tf.chunk_kimi_delta_attention(q, k, v, g, b, initial_state=S0.clone(), output_final_state=True)
    o_r, s_r = tf.recurrent_kimi_delta_attention(q, k, v, g, b, initial_state=S0.clone(), output_final_state=True)
    for o_p, s_p in ((o_c, s_c), (o_r, s_r)):
        torch.testing.assert_close(o, o_p, **F32)
        torch.testing.assert_close(s, s_p, **F32)
    # transformers normalises q/k in its kernels when asked: same as applying our l2norm first.
    raw_q, raw_k = 3 * torch.randn_like(q), 3 * torch.randn_like(k)
    o_n, _ = tf.chunk_kimi_delta_attention(raw_q, raw_k, v, g, b, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(kda.chunked(kda.l2norm(raw_q), kda.l2norm(raw_k), v, g, b)[0], o_n, **F32)


def test_gates_match_fla():
    gates = fla_gates()
    z, A_log, dt = torch.randn(2, 7, 3, 4), torch.randn(3), torch.randn(12)
    torch.testing.assert_close(kda.softplus_decay(z, A_log, dt), gates.naive_kda_gate(z, A_log, dt))
    torch.testing.assert_close(kda.bounded_decay(z, A_log, dt, g_min=-5.0),
                               gates.naive_kda_lowerbound_gate(z, A_log, dt, lower_bound=-5.0))


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_chunked_under_autocast_matches_fp32(dtype, tolerance):
    """Training under autocast (bf16 by default on CUDA) makes the chunk products half precision; the flush threshold
    must know those dtypes (before: a KeyError on the first bf16 product) and the result stay near fp32's."""
    torch.manual_seed(0)
    B, T, H, K = 1, 128, 2, 32
    q, k = (F.normalize(torch.randn(B, T, H, K), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, K, requires_grad=True)
    g, beta = -F.softplus(torch.randn(B, T, H, K)) * 0.1, torch.sigmoid(torch.randn(B, T, H))
    reference = kda.recurrent(q.double(), k.double(), v.double(), g.double(), beta.double())[0]
    with torch.autocast("cpu", dtype=dtype):
        out = kda.chunked(q, k, v, g, beta)[0]
    out.float().sum().backward()
    assert torch.isfinite(v.grad).all()
    assert (out.double() - reference).abs().max() <= tolerance * reference.abs().max()
