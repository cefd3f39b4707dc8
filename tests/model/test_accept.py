"""`DecoderState.accept` after a speculative run (SPEC §8, issue 36): the accepted state keeps the MLA caches'
in-place storage, so the next decode step appends without copying the cache, and its results equal sequential
decoding of the accepted tokens."""

from __future__ import annotations

import pytest
import torch

import serving
from k3.model.sequence.mla import MLACache


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
