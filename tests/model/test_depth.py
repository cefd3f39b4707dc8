"""k3.model.depth: Block AttnRes retrieval and block bookkeeping (SPEC §3, Eq. 8–10)."""

from __future__ import annotations

import pytest
import torch

from k3.model.depth import BlockAttnRes, Residual, retrieve
from k3.model.norm import rms_norm

EPS = 1e-6


def attnres(query, values):
    return retrieve(query, values, [rms_norm(v, None, EPS) for v in values])


def explicit_retrieve(w: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """SPEC §3 written out: ``Σ_i softmax_i(w · RMSNorm(b_i)) · b_i`` over the stacked sources, keys normalised
    with unit gain (``b / sqrt(mean(b²) + eps)``), values raw."""
    b = torch.stack(sources)  # [S, ..., d]
    keys = b / torch.sqrt(b.pow(2).mean(-1, keepdim=True) + EPS)
    weights = torch.softmax((keys * w).sum(-1), dim=0)  # [S, ...]
    return (weights.unsqueeze(-1) * b).sum(0)


def test_worked_value():
    """b0 = [1, 0], b1 = [0, 2], w = [1, 0] → weights ≈ [.8044, .1956], output [.80443, .39114]."""
    b0, b1, w = (torch.tensor(x, dtype=torch.float64) for x in ([1.0, 0.0], [0.0, 2.0], [1.0, 0.0]))
    out = attnres(w, [b0, b1])
    assert out.tolist() == pytest.approx([0.80443, 0.39114], abs=5e-6)
    # Normalising the values as well, or not normalising the keys, gives something else.
    normed = [rms_norm(b, None, EPS) for b in (b0, b1)]
    normalised_values = retrieve(w, normed, normed)
    raw_keys = retrieve(w, [b0, b1], [b0, b1])
    for wrong in (normalised_values, raw_keys):
        assert not torch.allclose(wrong, out, atol=1e-3)


def test_zero_query_is_uniform_average():
    values = [torch.randn(3, 5, 8, dtype=torch.float64) for _ in range(4)]
    out = attnres(torch.zeros(8, dtype=torch.float64), values)
    torch.testing.assert_close(out, sum(values) / 4)


def test_explicit_reference_reproduces_the_worked_value():
    b0, b1, w = (torch.tensor(x, dtype=torch.float64) for x in ([1.0, 0.0], [0.0, 2.0], [1.0, 0.0]))
    assert explicit_retrieve(w, [b0, b1]).tolist() == pytest.approx([0.80443, 0.39114], abs=5e-6)


def test_block_state_after_93_layers_has_nine_sources():
    d = 4
    state = BlockAttnRes.start(torch.zeros(1, 1, d), block_size=12, eps=EPS)
    for layer in range(93):
        a, f = torch.full((1, 1, d), float(layer)), torch.full((1, 1, d), 1000.0 * layer)
        state = state.commit(a, f)
        assert 0 <= state.count < 12
    assert len(state.sources) == 8 and state.partial is not None and state.count == 9
    assert state.stacked().shape == (9, 1, 1, d)  # embedding + 7 complete blocks + 1 partial
    # Each completed block holds exactly its 12 layers' outputs; the partial holds the last 9, once.
    per_layer = [1001.0 * layer for layer in range(93)]
    for b in range(7):
        assert state.sources[1 + b][0, 0, 0].item() == sum(per_layer[12 * b:12 * (b + 1)])
    assert state.partial[0, 0, 0].item() == sum(per_layer[84:])
    total = sum(s[0, 0, 0].item() for s in state.sources[1:]) + state.partial[0, 0, 0].item()
    assert total == sum(per_layer)  # no layer is counted in two sources


def test_retrieve_after_includes_the_mixer_output_in_the_partial():
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    state = BlockAttnRes.start(x, block_size=4, eps=EPS)
    a, f = torch.randn_like(x), torch.randn_like(x)
    q = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(state.retrieve_after(a, q), explicit_retrieve(q, [x, a]))
    state = state.commit(a, f)
    a2 = torch.randn_like(x)
    torch.testing.assert_close(state.retrieve_after(a2, q), explicit_retrieve(q, [x, a + f + a2]))
    torch.testing.assert_close(state.retrieve(q), explicit_retrieve(q, [x, a + f]))


def test_block_boundary_moves_the_partial_to_a_source():
    x = torch.randn(1, 2, 4)
    state = BlockAttnRes.start(x, block_size=2, eps=EPS)
    a, f = torch.randn_like(x), torch.randn_like(x)
    state = state.commit(a, f).commit(a, f)
    assert state.partial is None and state.count == 0 and len(state.sources) == 2
    torch.testing.assert_close(state.sources[1], 2 * (a + f))


def test_residual_is_the_plain_stream():
    x, a, f = (torch.randn(2, 3, 4) for _ in range(3))
    r = Residual.start(x)
    torch.testing.assert_close(r.retrieve_after(a, None), x + a)
    torch.testing.assert_close(r.commit(a, f).retrieve(None), x + a + f)
