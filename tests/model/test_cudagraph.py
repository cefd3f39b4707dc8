"""Decode steps replayed from recorded graphs (`k3.model.cudagraph`, issue 39 item 2).

On the CPU the recording is emulated: `eager_capture` runs the step once and its "replay" runs it again on the same
input buffers and writes the results into the same output tensors — what a CUDA graph replay does — so every part of
`GraphedDecode` but the CUDA capture itself is checked here: the MLA windows (length as data, attention masked at
it), the copies in and out, continuing a graph's storage, and recording anew when the rows change or the capacity is
reached. On CUDA (a lent GPU machine) the same checks run on real CUDA graphs through `CompiledModel`."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest
import torch

from k3.config import preset
from k3.model.compiled import CompiledModel
from k3.model.compiled_step import CompiledStep
from k3.model.cudagraph import GraphedDecode, mla_length
from k3.model.lm import K3ForCausalLM
from k3.model.precompiled import forward_step
from k3.model.sequence.mla import MLACache
from k3.model.state import DecoderState


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if is_dataclass(value):
        return [t for f in fields(value) for t in _tensors(getattr(value, f.name))]
    return []


def eager_capture(run):
    """The CPU's stand-in for a CUDA graph: replaying reruns ``run`` on the same buffers, into the same outputs."""
    outputs = run()

    def replay() -> None:
        for mine, fresh in zip(_tensors(outputs), _tensors(run()), strict=True):
            if mine.data_ptr() != fresh.data_ptr():
                mine.copy_(fresh)
    return outputs, replay


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(preset("tiny")).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # well-separated greedy choices
    return m


def prompts(model, lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in lengths]


@torch.inference_mode()
def prefilled(model, ids):
    _, state = model(ids, state=model.new_state(1))
    return state


@torch.inference_mode()
def greedy(model, state, first, steps, step):
    """``steps`` greedy tokens from ``state`` whose next input is ``first`` [B, 1], each step through ``step``;
    returns the tokens [B, steps] and the logits of every step."""
    token, out, logits_seen = first, [], []
    for _ in range(steps):
        logits, state = step(token, state)
        logits_seen.append(logits)
        token = logits.argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, 1), logits_seen, state


def test_windowed_decode_equals_the_model_across_padding_rows_and_capacity(model):
    """Three rows of unequal lengths (left padding), 500 steps (past the first storage's capacity, 512 positions):
    the same greedy tokens as the model's own decoding, logits within fp32 reassociation."""
    rows = [prefilled(model, p) for p in prompts(model, [7, 20, 3])]
    state = DecoderState.stack(rows)
    first = torch.tensor([[1], [2], [3]])
    graphs = GraphedDecode(capture=eager_capture)
    want, want_logits, _ = greedy(model, state, first, 500, lambda i, s: forward_step(model, i, s))
    got, got_logits, after = greedy(model, state, first, 500,
                                    lambda i, s: graphs(i, s, lambda ids, st: forward_step(model, ids, st)))
    assert torch.equal(got, want)
    assert max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits)) < 1e-4
    assert graphs.captures == 2 and graphs.replays == 500
    assert mla_length(after) == 520 and after.position == state.position + 500


def test_a_state_that_does_not_continue_the_graph_records_a_new_one(model):
    """A second continuation of one state, and a batch whose rows changed, each record anew on new storage; the
    states handed out before keep their entries (a cache's entries never change)."""
    graphs = GraphedDecode(capture=eager_capture)
    step = lambda i, s: graphs(i, s, lambda ids, st: forward_step(model, ids, st))  # noqa: E731
    state = DecoderState.stack([prefilled(model, p) for p in prompts(model, [9, 4])])
    tokens, _, mid = greedy(model, state, torch.tensor([[5], [6]]), 6, step)
    kept = [layer.latent.clone() for layer in mid.layers if isinstance(layer, MLACache)]
    a, _, _ = greedy(model, mid, tokens[:, -1:], 5, step)
    b, _, _ = greedy(model, mid, tokens[:, -1:], 5, step)  # mid again: the graph's storage has moved past it
    assert graphs.captures == 2 and torch.equal(a, b)
    assert all(torch.equal(layer.latent, k) for layer, k in
               zip([x for x in mid.layers if isinstance(x, MLACache)], kept))
    row = mid.select(slice(1, 2))  # one row of the batch: a new shape and new storage
    c, _, _ = greedy(model, row, tokens[1:, -1:], 5, step)
    assert graphs.captures == 3 and torch.equal(c, a[1:])


def test_a_window_masks_the_positions_past_its_end(model):
    """Entries past a window's end never reach the output, whatever they hold (finite garbage: a rejected draft's)."""
    state = DecoderState.stack([prefilled(model, p) for p in prompts(model, [12, 5])])
    graphs = GraphedDecode(capture=eager_capture)
    step = lambda i, s: graphs(i, s, lambda ids, st: forward_step(model, ids, st))  # noqa: E731
    logits, _ = step(torch.tensor([[3], [4]]), state)
    graph = next(iter(graphs.graphs.values()))
    for store in filter(None, graph.stores):
        store.latent[:, 14:].normal_(0, 100)
        store.shared_key[:, 14:].normal_(0, 100)
    again, _ = graph.step(torch.tensor([[3], [4]]), state)
    assert torch.allclose(again, logits, atol=1e-5)


def test_the_compiled_windowed_step_equals_the_eager_step(model):
    """The traced function of a windowed decode step (inductor on the CPU; CUDA records it): same greedy tokens,
    one compilation for two capacities."""
    step = CompiledStep(model)
    step.graphed = GraphedDecode(capture=eager_capture)
    state = DecoderState.stack([prefilled(model, p) for p in prompts(model, [6, 11])])
    first = torch.tensor([[1], [2]])
    want, _, _ = greedy(model, state, first, 510, lambda i, s: forward_step(model, i, s))
    got, _, _ = greedy(model, state, first, 510, step)
    assert torch.equal(got, want)
    assert step.graphed.captures == 2 and step.compilations == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a lent GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager_decode(model, dtype):
    """`CompiledModel` on CUDA decodes on CUDA graphs: the eager model's greedy tokens (fp32: equal; bf16: mostly,
    against its own eager run), batch 1 and a padded batch of 3."""
    cuda = K3ForCausalLM(model.config).eval()
    cuda.load_state_dict(model.state_dict())
    cuda = cuda.to("cuda", dtype)
    compiled = CompiledModel(cuda, batches=(1, 4), sizes=(1,), tuned=False)
    for lengths in ([9], [7, 20, 3]):
        with torch.inference_mode():
            rows = [cuda(p.cuda(), state=cuda.new_state(1))[1] for p in prompts(model, lengths)]
        state = rows[0] if len(rows) == 1 else DecoderState.stack(rows)
        first = torch.arange(1, len(rows) + 1, device="cuda")[:, None]
        want, _, _ = greedy(cuda, state, first, 40, lambda i, s: forward_step(cuda, i, s))
        got, _, _ = greedy(cuda, state, first, 40, compiled.decode_rows)
        if dtype == torch.float32:
            assert torch.equal(got, want), lengths
        else:  # fused bf16 kernels round differently: a near-tie may flip, and the texts part there
            assert (got == want).float().mean() >= 0.8, lengths
    graphed = compiled.decode_step.graphed
    assert graphed.replays >= 2 * 38 and graphed.captures <= 4
