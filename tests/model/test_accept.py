"""`DecoderState.accept` after a speculative run (SPEC §8, issue 36): the accepted state keeps the MLA caches'
in-place storage, so the next decode step appends without copying the cache, and its results equal sequential
decoding of the accepted tokens."""

from __future__ import annotations

import pytest
import torch

import serving
from k3.model.sequence.mla import MLACache
from k3.model.state import DecoderState


@pytest.mark.parametrize("keep", [1, 3, 5])
def test_accept_keeps_the_in_place_storage_and_the_next_step_equals_sequential_decoding(keep):
    model = serving.model()
    prompt, run = serving.prompts()[3][:20], serving.prompts()[4][:5]
    with torch.inference_mode():
        _, state = model(torch.tensor([prompt]), state=model.new_state(1))
        [(_, verified)] = model.forward_groups([(torch.tensor([run]), state)], full=[True], replay=[True])
        accepted = verified.accept(keep)
        mla = [i for i, layer in enumerate(accepted.layers) if isinstance(layer, MLACache)]
        assert mla and all(accepted.layers[i].storage is verified.layers[i].storage is not None for i in mla)
        token = torch.tensor([[7]])
        logits, after = model(token, state=accepted)
        for i in mla:  # appended into the same storage: no copy of the cache
            assert after.layers[i].latent.data_ptr() == verified.layers[i].latent.data_ptr()
        ref_logits, ref = model(torch.tensor([prompt + run[:keep] + [7]]), state=model.new_state(1))
    assert after.position == ref.position == len(prompt) + keep + 1
    torch.testing.assert_close(logits[:, -1], ref_logits[:, -1], atol=1e-4, rtol=0)
    for i in mla:
        torch.testing.assert_close(after.layers[i].latent, ref.layers[i].latent, atol=1e-5, rtol=0)


def test_the_storage_goes_to_the_accepted_state_only_when_the_run_is_its_longest_view():
    """A run whose storage another, longer cache already extended is truncated into a copy (no cache sees a
    position change)."""
    model = serving.model()
    prompt, run = serving.prompts()[3][:20], serving.prompts()[4][:4]
    with torch.inference_mode():
        _, state = model(torch.tensor([prompt]), state=model.new_state(1))
        [(_, verified)] = model.forward_groups([(torch.tensor([run]), state)], full=[True], replay=[True])
        _, longer = model(torch.tensor([[5]]), state=verified.accept(len(run)))  # extends the storage in place
        kept = [layer.latent.clone() for layer in longer.layers if isinstance(layer, MLACache)]
        accepted = verified.accept(2)
        _, fork = model(torch.tensor([[9]]), state=accepted)
    mla = [layer for layer in longer.layers if isinstance(layer, MLACache)]
    assert all(torch.equal(layer.latent, k) for layer, k in zip(mla, kept, strict=True))
    assert all(f.storage is not m.storage for f, m in zip(
        [layer for layer in fork.layers if isinstance(layer, MLACache)], mla, strict=True))


@pytest.mark.parametrize("n", [1, 15, 16, 33, 59])
def test_a_prefix_of_a_prefill_piece_equals_prefilling_only_that_prefix(n):
    """`DecoderState.prefix` (a prefix-cache cut inside a prefill piece, issue 36): the state after the first n tokens
    of a 60-token piece equals the state of a prefill that stopped there, layer by layer (fp64), and the piece's
    own state is left as it was."""
    model = serving.model().double()
    text = serving.prompts()[5]
    prompt, piece = text[:20], text[20:80]
    chunk = model.config.kda.chunk_size
    with torch.inference_mode():
        _, state = model(torch.tensor([prompt]), state=model.new_state(1))
        [(_, after)] = model.forward_groups([(torch.tensor([piece]), state)], replay=[True])
        kept = after.apply(torch.clone)
        got = after.prefix(n, chunk)
        _, want = model(torch.tensor([piece[:n]]), state=state)
    assert got.position == want.position == len(prompt) + n and got.replay is None
    for g, w in zip(got.layers, want.layers, strict=True):
        for name in vars(w):
            if not name.startswith("_"):
                torch.testing.assert_close(getattr(g, name), getattr(w, name), rtol=0, atol=1e-10)
    torch.testing.assert_close(got.depth, want.depth, rtol=0, atol=1e-10)
    for a, b in zip(after.tensors().values(), kept.tensors().values(), strict=True):
        assert torch.equal(a, b)


def test_prefix_refuses_what_accept_refuses():
    model = serving.model()
    with torch.inference_mode():
        _, state = model(torch.tensor([serving.prompts()[3][:10]]), state=model.new_state(1))
        [(_, after)] = model.forward_groups([(torch.tensor([serving.prompts()[4][:4]]), state)], replay=[True])
    with pytest.raises(ValueError, match="prefix: n must be in"):
        after.prefix(5, 64)
    with pytest.raises(ValueError, match="prefix: needs a batch-1"):
        state.prefix(1, 64)


@pytest.mark.parametrize("ns", [[1, 5, 3], [5, 5, 5], [2, 1, 1], [5, 4, 5]])
def test_accepting_each_row_of_a_stacked_verification_equals_reading_its_kept_tokens_alone(ns):
    """`DecoderState.accept_rows` (one recurrence for every row's KDA replay): rows at different positions (a padded
    stack), each keeping its own prefix of the run — whole runs included — equal the row verified alone and then
    `accept`-ed, layer by layer in fp64, and the next step from each continues as from that state."""
    model = serving.model().double()
    text = serving.prompts()[5]
    prompts, runs = [text[:20], text[30:41], text[50:77]], [text[80:85], text[90:95], text[100:105]]
    with torch.inference_mode():
        states = [model(torch.tensor([p]), state=model.new_state(1))[1] for p in prompts]
        stacked = DecoderState.stack(states)
        [(_, verified)] = model.forward_groups([(torch.tensor(runs), stacked)], full=[True], replay=[True])
        got = verified.accept_rows(ns)
        for state, run, n, row in zip(states, runs, ns, got, strict=True):
            _, want = model(torch.tensor([run[:n]]), state=state)  # only the kept tokens, read alone
            assert row.position == want.position == state.position + n and row.replay is None and row.padding is None
            for g, w in zip(row.layers, want.layers, strict=True):
                for name in vars(w):
                    if not name.startswith("_"):
                        torch.testing.assert_close(getattr(g, name), getattr(w, name), rtol=0, atol=1e-10)
            torch.testing.assert_close(row.depth, want.depth, rtol=0, atol=1e-10)
            next_got, _ = model(torch.tensor([[7]]), state=row)
            next_want, _ = model(torch.tensor([[7]]), state=want)
            torch.testing.assert_close(next_got, next_want, rtol=0, atol=1e-10)


def test_accept_rows_refuses_a_count_outside_the_run_or_a_missing_row():
    model = serving.model()
    with torch.inference_mode():
        states = [model(torch.tensor([p[:10]]), state=model.new_state(1))[1] for p in serving.prompts()[3:5]]
        [(_, after)] = model.forward_groups([(torch.tensor([[1, 2, 3]] * 2), DecoderState.stack(states))],
                                            full=[True], replay=[True])
    with pytest.raises(ValueError, match=r"each count must be in \[1, 3\]"):
        after.accept_rows([1, 4])
    with pytest.raises(ValueError, match="one count per row"):
        after.accept_rows([1])
    with pytest.raises(ValueError, match="one count per row"):
        states[0].accept_rows([1])
