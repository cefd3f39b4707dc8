"""Token log-probabilities of sampled sequences under a policy (SPEC §7): what RL's ratio, MOPD's token reward
and every held-out likelihood read.

A *sequence* is ``ids`` (prompt, then response) with a ``trained`` flag per id: the ids the policy sampled (response
tokens), as opposed to prompt and environment tokens (tool results), which only feed context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from k3.model.lm import K3ForCausalLM


def pad_sequences(sequences: Sequence[tuple[Sequence[int], Sequence[bool]]], pad_id: int = 0
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ``(inputs [B, L-1], targets [B, L-1], mask [B, L-1])`` of next-token prediction, ``mask`` True
    where the target is a trained id (padding is never trained; the model is causal, so it never reads it)."""
    if not sequences:
        raise ValueError("no sequences")
    for i, (ids, trained) in enumerate(sequences):
        if len(ids) != len(trained) or len(ids) < 2:
            raise ValueError(f"sequence {i}: expected at least 2 ids and one trained flag per id, got {len(ids)} "
                             f"ids and {len(trained)} flags")
        if trained[0]:
            raise ValueError(f"sequence {i}: the first id has no context and cannot be trained")
    length = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.bool)
    for b, (row, trained) in enumerate(sequences):
        ids[b, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[b, : len(row)] = torch.tensor(list(trained), dtype=torch.bool)
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def token_logprobs(model: K3ForCausalLM, inputs: Tensor, targets: Tensor, vocab: int | None = None) -> Tensor:
    """``log π(targets[b, t] | inputs[b, :t+1])`` ``[B, L]`` in float32, differentiable. With ``vocab`` (the
    tokenizer's size), ids the tokenizer cannot produce are excluded from the softmax, as the engine samples."""
    logits, _ = model(inputs)
    logits = logits.float()
    if vocab is not None and vocab < logits.shape[-1]:
        logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= vocab, float("-inf"))
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sequence_logprobs(model: K3ForCausalLM, sequences: Sequence[tuple[Sequence[int], Sequence[bool]]],
                      vocab: int | None = None, batch_size: int = 16) -> list[list[float]]:
    """Each sequence's log-probabilities of its trained ids, in order (no gradient; teachers and evaluation)."""
    out: list[list[float]] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start: start + batch_size]
            inputs, targets, mask = pad_sequences(chunk)
            values = token_logprobs(model, inputs, targets, vocab)
            out.extend(values[b][mask[b]].tolist() for b in range(len(chunk)))
    finally:
        model.train(was_training)
    return out
