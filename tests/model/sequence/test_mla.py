"""k3.model.sequence.mla: Gated MLA (NoPE) against an explicit-loop fp64 Eq. 7, decode paths, cache (SPEC §2)."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from functools import cache
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.sizing.params import mla_layer_parameters
from k3.config import preset
from k3.model.sequence import mla
from k3.model.sequence.mla import ABSORBED_TOKENS, GatedMLA, MLACache
from peers import transformers_kimi_linear

F32 = dict(atol=1e-5, rtol=1e-5)
F64 = dict(atol=1e-10, rtol=1e-10)
TINY = preset("tiny")


def config(q_lora_rank=32, output_gate=True, **mla):
    """The tiny preset with its MLA sub-config modified."""
    return dataclasses.replace(TINY, mla=dataclasses.replace(TINY.mla, q_lora_rank=q_lora_rank,
                                                             output_gate=output_gate, **mla))


# (q_lora_rank, output_gate) × layouts; "odd" has v_head_dim ≠ qk_nope_head_dim and 3 heads.
VARIANTS = {
    "latent-q-gated": config(),
    "direct-q-gated": config(q_lora_rank=None),
    "latent-q-ungated": config(output_gate=False),
    "direct-q-ungated": config(q_lora_rank=None, output_gate=False),
    "odd": config(q_lora_rank=12, num_heads=3, kv_lora_rank=20, qk_nope_head_dim=10, qk_shared_head_dim=6,
                  v_head_dim=7),
}


@cache
def module(name="latent-q-gated", dtype=torch.float64, seed=0) -> GatedMLA:
    """A module with weights ~ N(0, 1.5²/fan_in) (sharp, non-uniform attention) and random norm gains."""
    gen = torch.Generator().manual_seed(seed)
    m = GatedMLA(VARIANTS[name]).to(torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.5 * p.shape[1] ** -0.5, generator=gen)
            else:
                p.uniform_(0.5, 1.5, generator=gen)
    return m.to(dtype).requires_grad_(False)


def inputs(B=2, T=9, d=64, dtype=torch.float64, seed=1):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def reference(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Eq. 7 by explicit loops in fp64: per sequence, per query position, per head."""
    W = {name: p.detach().double() for name, p in m.named_parameters()}
    H, n, s, dv, r = m.num_heads, m.nope_dim, m.shared_dim, m.v_dim, m.kv_lora_rank
    eps = m.kv_a_norm.eps

    def rms(v, gain):
        return v / torch.sqrt(v.pow(2).mean() + eps) * gain

    x = x.double()
    B, T, d = x.shape
    y = torch.zeros(B, T, d, dtype=torch.float64)
    w_b = W["kv_b_proj.weight"].view(H, n + dv, r)  # per head: [W_uk_h (n rows) ; W_uv_h (dv rows)]
    for b in range(B):
        q, c_kv, k_s = [], [], []
        for t in range(T):
            if m.q_lora_rank is None:
                q_t = W["q_proj.weight"] @ x[b, t]
            else:
                q_t = W["q_b_proj.weight"] @ rms(W["q_a_proj.weight"] @ x[b, t], W["q_a_norm.weight"])
            q.append(q_t.view(H, n + s))  # per head: [content (n) ; shared-key part (s)]
            a = W["kv_a_proj.weight"] @ x[b, t]
            c_kv.append(rms(a[:r], W["kv_a_norm.weight"]))
            k_s.append(a[r:])
        for i in range(T):
            heads = []
            for h in range(H):
                keys = [torch.cat([w_b[h, :n] @ c_kv[j], k_s[j]]) for j in range(i + 1)]
                values = [w_b[h, n:] @ c_kv[j] for j in range(i + 1)]
                scores = torch.stack([q[i][h] @ k for k in keys]) / math.sqrt(n + s)
                p = torch.exp(scores - scores.max())
                p = p / p.sum()
                o = sum(p_j * v_j for p_j, v_j in zip(p, values))
                if m.g_proj is not None:
                    o = o * torch.sigmoid(W["g_proj.weight"] @ x[b, i]).view(H, dv)[h]
                heads.append(o)
            y[b, i] = W["o_proj.weight"] @ torch.cat(heads)
    return y


def assert_cache_close(a: MLACache, b: MLACache, tol):
    torch.testing.assert_close(a.latent, b.latent, **tol)
    torch.testing.assert_close(a.shared_key, b.shared_key, **tol)


# ---------------------------------------------------------------------- Eq. 7
@pytest.mark.parametrize("name", VARIANTS)
def test_forward_equals_explicit_reference(name):
    m = module(name)
    x = inputs(T=7)
    y, state = m(x, None)
    assert state is None and y.shape == x.shape and y.dtype == torch.float64
    torch.testing.assert_close(y, reference(m, x), **F64)
    y_abs, _ = m(x, None, path="absorbed")
    torch.testing.assert_close(y_abs, reference(m, x), **F64)
    y32, _ = module(name, torch.float32)(x.float(), None)
    torch.testing.assert_close(y32.double(), y, **F32)


def test_matches_transformers_kimi_linear_attention():
    """Ungated, direct-query MLA is Kimi Linear's attention: same weights, same output."""
    modeling = transformers_kimi_linear()
    m = module("direct-q-ungated")
    peer_config = modeling.KimiLinearConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=TINY.rms_norm_eps)
    peer_config._attn_implementation = "eager"
    peer = modeling.KimiLinearAttention(peer_config, layer_idx=0).double()
    with torch.no_grad():
        for ours, theirs in [("q_proj", "q_proj"), ("kv_a_proj", "kv_a_proj_with_mqa"),
                             ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"), ("o_proj", "o_proj")]:
            getattr(peer, theirs).weight.copy_(getattr(m, ours).weight)
    x = inputs(T=9)
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    mask = torch.zeros(9, 9, dtype=torch.float64).masked_fill(future, float("-inf"))[None, None]
    y_peer, _ = peer(x, attention_mask=mask)
    # the peer's eager softmax runs in fp32 even for fp64 inputs
    torch.testing.assert_close(m(x, None)[0], y_peer, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------- absorbed decode == full
@pytest.mark.parametrize("name", ["latent-q-gated", "direct-q-ungated", "odd"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)])
@pytest.mark.parametrize("L0,T", [(0, 1), (6, 1), (0, 4), (6, 3)])
def test_absorbed_equals_full(name, dtype, tol, L0, T):
    m = module(name, dtype)
    x = inputs(T=L0 + T, dtype=dtype)
    state = m(x[:, :L0], m.new_state(2))[1] if L0 else m.new_state(2)
    y_full, c_full = m(x[:, L0:], state, path="full")
    y_abs, c_abs = m(x[:, L0:], state, path="absorbed")
    torch.testing.assert_close(y_abs, y_full, **tol)
    assert c_full.length == c_abs.length == L0 + T
    assert torch.equal(c_full.latent, c_abs.latent) and torch.equal(c_full.shared_key, c_abs.shared_key)
    # the two attention methods on the same queries and cache
    q, c_kv, k_s, _ = m._project(x[:, L0:])
    kv = state.append(c_kv, k_s)
    torch.testing.assert_close(m._attend_absorbed(q, kv), m._attend_full(q, kv), **tol)


@pytest.mark.parametrize("name", ["latent-q-gated", "odd"])
def test_compiled_absorbed_reductions_equal_full_in_fp64(name):
    """Traced by dynamo, `_attend_absorbed` takes its compiled form (the products over the cache as reductions,
    `k3.model.compiled`); in fp64 it gives the full path's output (backend "eager": the traced form, no codegen)."""
    m = module(name)
    x = inputs(T=7)
    q, c_kv, k_s, _ = m._project(x[:, 6:])
    kv = m(x[:, :6], m.new_state(2))[1].append(c_kv, k_s)
    traced = torch.compile(m._attend_absorbed, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    torch.testing.assert_close(traced(q, kv), m._attend_full(q, kv), **F64)


def test_default_path_is_absorbed_exactly_for_short_blocks_over_a_cache():
    """Decode and verification (T ≤ ABSORBED_TOKENS after cached positions) attend in latent space; training,
    longer prefill chunks and a prompt's first block reconstruct keys and values (the first block then gives a
    stateless forward's logits bit for bit)."""
    m = module()
    x = inputs(T=40)
    state = m(x[:, :4], m.new_state(2))[1]
    with mock.patch.object(m, "_attend_full", side_effect=AssertionError("full path used")):
        m(x[:, 4:5], state)  # decode
        m(x[:, 4:9], state)  # a verification of γ + 1 = 5 tokens
        m(x[:, 4:4 + ABSORBED_TOKENS], state)
    with mock.patch.object(m, "_attend_absorbed", side_effect=AssertionError("absorbed path used")):
        m(x[:, 4:5], None)  # training
        m(x[:, 4:5 + ABSORBED_TOKENS], state)  # a prefill chunk
        m(x, m.new_state(2))  # prefill
        short = m(x[:, :5], m.new_state(2))[0]  # a short prompt's first block
    assert torch.equal(short, m(x[:, :5], None)[0])


def test_absorbed_weights_are_views_of_kv_b_proj():
    m = module()
    w_uk, w_uv = m._up_weights()
    base = m.kv_b_proj.weight
    assert w_uk.shape == (m.num_heads, m.nope_dim, m.kv_lora_rank)
    assert w_uv.shape == (m.num_heads, m.v_dim, m.kv_lora_rank)
    assert w_uk._base is base and w_uv._base is base
    assert torch.equal(w_uv[1, 0], base[1 * (m.nope_dim + m.v_dim) + m.nope_dim])


# ---------------------------------------------------------------------- streaming
@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)])
@pytest.mark.parametrize("a", [1, 4, 10])
def test_prefill_then_decode_equals_one_call(dtype, tol, a):
    m = module("latent-q-gated", dtype)
    x = inputs(T=11, dtype=dtype)
    y_one, c_one = m(x, m.new_state(2))
    torch.testing.assert_close(y_one, m(x, None)[0], **tol)
    ys, state = [], m.new_state(2)
    y, state = m(x[:, :a], state)
    ys.append(y)
    for t in range(a, 11):
        y, state = m(x[:, t : t + 1], state)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, dim=1), y_one, **tol)
    assert_cache_close(state, c_one, tol)
    if dtype == torch.float64:
        torch.testing.assert_close(y_one, reference(m, x), **F64)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(VARIANTS)), T=st.integers(1, 12), data=st.data())
def test_any_chunking_equals_one_call(name, T, data):
    m = module(name)
    x = inputs(B=2, T=T, seed=T)
    cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), max_size=T - 1)) if T > 1 else [])
    y_one, c_one = m(x, m.new_state(2))
    ys, state = [], m.new_state(2)
    for lo, hi in zip([0, *cuts], [*cuts, T]):
        y, state = m(x[:, lo:hi], state)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, dim=1), y_one, **F64)
    assert_cache_close(state, c_one, F64)


def test_passed_in_state_is_untouched():
    m = module()
    x = inputs(T=6)
    state = m(x[:, :4], m.new_state(2))[1]
    before = (state.latent.clone(), state.shared_key.clone())
    for chunk in (x[:, 4:5], x[:, 4:]):
        _, new = m(chunk, state)
        assert new is not state and new.length == 4 + chunk.shape[1]
    assert state.length == 4
    assert torch.equal(state.latent, before[0]) and torch.equal(state.shared_key, before[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.latent = before[0]


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(1, 3)), min_size=1, max_size=14),
       slack=st.integers(1, 4))
def test_appends_in_place_never_change_a_cache_any_continuation_sees(steps, slack):
    """Continue any earlier cache (a second continuation of one state, as prefix caching and speculation do) with
    new entries: every cache keeps exactly the entries appended along its own history, whether `append` wrote in
    place into shared storage or moved to new storage (a small `SLACK` makes the storage fill and move often)."""
    gen = torch.Generator().manual_seed(len(steps))
    caches = [MLACache(torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 2, generator=gen))]
    expected = [(caches[0].latent.clone(), caches[0].shared_key.clone())]
    with mock.patch.object(mla, "SLACK", slack), torch.no_grad():
        for pick, tokens in steps:
            i = pick % len(caches)
            latent, key = torch.randn(2, tokens, 5, generator=gen), torch.randn(2, tokens, 2, generator=gen)
            caches.append(caches[i].append(latent, key))
            expected.append((torch.cat([expected[i][0], latent], 1), torch.cat([expected[i][1], key], 1)))
    for made, (latent, key) in zip(caches, expected, strict=True):
        assert torch.equal(made.latent, latent) and torch.equal(made.shared_key, key)


def test_decoding_appends_in_place_and_falls_back_where_it_must():
    """A decode chain writes into one storage; a cache of inference tensors continued outside inference mode, or
    with grad mode on, gets new tensors (an in-place write there would raise, or break a backward that saved a view
    of the cache)."""
    m = module()
    x = inputs(T=6)
    with torch.inference_mode():
        state = m(x[:, :4], m.new_state(2))[1]
        one = m(x[:, 4:5], state)[1]
        two = m(x[:, 5:6], one)[1]
    assert one.storage is state.storage is two.storage and two.latent.data_ptr() == state.latent.data_ptr()
    with torch.no_grad():  # `one` is no longer its storage's longest view, and holds inference tensors
        again = m(x[:, 5:6], one)[1]
    assert again.storage is not state.storage and torch.equal(again.latent, two.latent)
    w = m.q_a_proj.weight  # only the queries train: the cache's entries need no gradient, the backward reads them
    w.requires_grad_(True)
    try:
        y, after = m(x[:, 4:5], m(x[:, :4], m.new_state(2))[1])
        m(x[:, 5:6], after)  # continuing `after` must not write into the storage its attention's backward reads
        y.sum().backward()
        assert after.storage is None and w.grad is not None
    finally:
        w.requires_grad_(False)
        w.grad = None


def test_bf16_close_to_fp64():
    m64, m16 = module(), module(dtype=torch.bfloat16)
    x = inputs(T=8)
    ref = m64(x, None)[0]
    y_full = m16(x.bfloat16(), None)[0]
    ys, state = [], m16(x[:, :5].bfloat16(), m16.new_state(2))[1]
    for t in range(5, 8):  # absorbed decode
        y, state = m16(x[:, t : t + 1].bfloat16(), state)
        ys.append(y)
    for y, r in ((y_full, ref), (torch.cat(ys, dim=1), ref[:, 5:])):
        assert y.dtype == torch.bfloat16
        assert (y.double() - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt() < 2e-2


# ---------------------------------------------------------------------- cache size, NoPE, causality
def test_cache_holds_latent_plus_shared_key_only():
    paper = preset("paper").mla
    assert paper.cache_scalars_per_token() == 576
    assert paper.expanded_scalars_per_token() == 30_720
    assert Fraction(paper.expanded_scalars_per_token(), paper.cache_scalars_per_token()) == Fraction(160, 3)
    m = module()
    B, T = 2, 7
    state = m(inputs(B=B, T=T), m.new_state(B))[1]
    assert [f.name for f in dataclasses.fields(MLACache)] == ["latent", "shared_key"]
    assert state.latent.shape == (B, T, 32) and state.shared_key.shape == (B, T, 8)
    per_token = (state.latent.numel() + state.shared_key.numel()) // (B * T)
    assert per_token == TINY.mla.cache_scalars_per_token() == 40
    empty = m.new_state(3)
    assert empty.length == 0 and empty.latent.shape == (3, 0, 32) and empty.latent.dtype == torch.float64


def test_nope_shared_key_is_position_independent():
    m = module()
    x = inputs(B=1, T=8)
    x[:, 6] = x[:, 2]  # the same token at two absolute positions
    state = m(x, m.new_state(1))[1]
    assert torch.equal(state.latent[:, 6], state.latent[:, 2])
    assert torch.equal(state.shared_key[:, 6], state.shared_key[:, 2])
    w_ks = m.kv_a_proj.weight[m.kv_lora_rank :]
    torch.testing.assert_close(state.shared_key, x @ w_ks.T, **F64)  # x W_ks, never rotated
    # no position anywhere: reordering the context leaves the last token's output unchanged
    perm = torch.tensor([4, 0, 6, 2, 5, 1, 3, 7])
    torch.testing.assert_close(m(x[:, perm], None)[0][:, -1], m(x, None)[0][:, -1], **F64)


@pytest.mark.parametrize("name", ["latent-q-gated", "direct-q-ungated"])
@pytest.mark.parametrize("P", [1, 4, 8])
def test_causality(name, P):
    m = module(name)
    x = inputs(T=9)
    x2 = x.clone()
    x2[:, P:] = inputs(T=9 - P, seed=7)
    assert torch.equal(m(x, None)[0][:, :P], m(x2, None)[0][:, :P])
    torch.testing.assert_close(m(x, None, path="absorbed")[0][:, :P], m(x2, None, path="absorbed")[0][:, :P],
                               atol=1e-14, rtol=0)


# ---------------------------------------------------------------------- parameters and init
@pytest.mark.parametrize("name", ["tiny", "small", "paper"])
def test_parameter_count_matches_config_formula(name):
    c = preset(name)
    with torch.device("meta"):
        m = GatedMLA(c)
    assert sum(p.numel() for p in m.parameters()) == mla_layer_parameters(c)


@pytest.mark.parametrize("name", VARIANTS)
def test_parameter_names_and_count_per_variant(name):
    c = VARIANTS[name]
    with torch.device("meta"):
        m = GatedMLA(c)
    names = {n for n, _ in m.named_parameters()}
    query = {"q_proj.weight"} if c.mla.q_lora_rank is None else {"q_a_proj.weight", "q_a_norm.weight",
                                                                  "q_b_proj.weight"}
    gate = {"g_proj.weight"} if c.mla.output_gate else set()
    assert names == query | gate | {"kv_a_proj.weight", "kv_a_norm.weight", "kv_b_proj.weight", "o_proj.weight"}
    assert sum(p.numel() for p in m.parameters()) == mla_layer_parameters(c)
    assert all(not isinstance(mod, torch.nn.Linear) or mod.bias is None for mod in m.modules())


def test_init():
    torch.manual_seed(0)
    m = GatedMLA(preset("small"))
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p))
        else:
            assert abs(p.std().item() - preset("small").initializer_range) < 2e-3, name
            assert abs(p.mean().item()) < 2e-3, name
    assert m.scale == (64 + 32) ** -0.5


# ---------------------------------------------------------------------- bad input
def test_bad_inputs_raise_value_error_naming_the_argument():
    m = module()
    x = inputs(B=2, T=3)
    state = m(x, m.new_state(2))[1]
    bad_x = [x[0], x[..., :32], x.long(), torch.zeros(2, 0, 64, dtype=torch.float64), x.tolist()]
    for arg in bad_x:
        with pytest.raises(ValueError, match=r"^x: "):
            m(arg, None)
    bad_state = [
        m.new_state(3),
        MLACache(state.latent[..., :16], state.shared_key),
        MLACache(state.latent, state.shared_key[..., :4]),
        MLACache(state.latent, state.shared_key[:, :2]),
        MLACache(state.latent.float(), state.shared_key.float()),
        (state.latent, state.shared_key),
    ]
    for arg in bad_state:
        with pytest.raises(ValueError, match=r"^state: "):
            m(x, arg)
    with pytest.raises(ValueError, match=r"^path: "):
        m(x, None, path="flash")
    with pytest.raises(ValueError, match=r"^batch_size: "):
        m.new_state(0)


# ---------------------------------------------------------------------- gradients
def test_gradcheck():
    m = module()
    x = inputs(B=1, T=3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: m(x, None)[0], (x,))
    assert torch.autograd.gradcheck(lambda x: m(x, None, path="absorbed")[0], (x,))
    state = m(inputs(B=1, T=3, seed=5), m.new_state(1))[1]
    x1 = inputs(B=1, T=1, seed=6).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: m(x, state)[0], (x1,))


@pytest.mark.parametrize("path", ["full", "absorbed"])
def test_every_parameter_gets_a_gradient(path):
    m = module("latent-q-gated", torch.float32)
    m.requires_grad_(True)
    try:
        m(inputs(T=5, dtype=torch.float32), None, path=path)[0].square().sum().backward()
        for name, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    finally:
        m.zero_grad(set_to_none=True)
        m.requires_grad_(False)
