"""Sampling from a `K3ForCausalLM` with its explicit causal state: greedy, temperature, min-p, top-k, top-p."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState


def check_sampling(temperature: float, top_p: float, top_k: int, min_p: float = 0.0) -> None:
    """Refuse (ValueError) settings no distribution follows from: a temperature that is not a finite number >= 0 (NaN
    too), ``top_p`` outside (0, 1], a negative ``top_k``, ``min_p`` outside [0, 1]."""
    if not 0 <= temperature < math.inf or not 0 < top_p <= 1 or top_k < 0 or not 0 <= min_p <= 1:
        raise ValueError(f"sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1; got "
                         f"{temperature}, {top_p}, {top_k}, {min_p}")


def sampling_logits(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0) -> Tensor:
    """The fp64 logits ``[B, V]`` whose softmax a sample at ``temperature > 0`` is drawn from: scaled relative to
    each row's maximum, then ``min_p``, ``top_k`` and ``top_p`` set to -inf. Shared by `sample_next` and the
    speculative decoder's `k3.serve.engine.speculative.probabilities` (SPEC §8), so the two cannot disagree."""
    check_sampling(temperature, top_p, top_k, min_p)
    if temperature == 0:
        raise ValueError("sampling_logits: temperature 0 is greedy (the argmax), not a distribution")
    # Scale in fp64 relative to each row's maximum: every value is <= 0 and the maximum is exactly 0, so any
    # temperature down to the smallest positive double gives finite probabilities (a tiny temperature
    # becomes greedy, ties shared); dividing fp32 logits by such a temperature would overflow to inf/NaN.
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / float(temperature)
    if min_p:  # log p_i - log p_max = logits_i (the maximum is 0)
        logits = logits.masked_fill(logits < math.log(min_p), float("-inf"))
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_next(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None, min_p: float = 0.0) -> Tensor:
    """Next token ids ``[B]`` from logits ``[B, V]``; ``temperature == 0`` is greedy (argmax). ``min_p`` drops
    tokens whose probability (after temperature) is below ``min_p`` times the most likely one's."""
    check_sampling(temperature, top_p, top_k, min_p)
    if temperature == 0:
        return logits.argmax(-1)
    probs = sampling_logits(logits, temperature, top_p, top_k, min_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def stream(model: K3ForCausalLM, prompt: list[int], max_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
           stop_ids: tuple[int, ...] = (), step: Callable | None = None) -> Iterator[int]:
    """Yield up to ``max_tokens`` sampled token ids after ``prompt`` (a stop id ends the stream, unyielded), and
    none past the model's context (`room`: a prompt that fills it is a ValueError). ``step(input_ids, state) ->
    (last-position logits [1, V], state)`` runs the prefill and the decode steps (default: the model;
    `k3.model.compiled.CompiledModel` compiles them); no step runs after the last token."""
    max_tokens = min(max_tokens, room(model, prompt))
    check_sampling(temperature, top_p, top_k)
    if step is None:
        def step(input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
            logits, state = model(input_ids, state=state)
            return logits[:, -1], state
    generator = None if seed is None else torch.Generator(device=model.device).manual_seed(seed)
    logits, state = step(torch.tensor([prompt], device=model.device), model.new_state(1))
    for left in range(max_tokens - 1, -1, -1):
        token = sample_next(logits, temperature, top_p, top_k, generator)
        if int(token) in stop_ids:
            return
        yield int(token)
        if left:
            logits, state = step(token.view(1, 1), state)


def room(model: K3ForCausalLM, prompt: list[int]) -> int:
    """How many tokens fit after ``prompt`` in the model's context; a ValueError where none does (or the prompt is
    empty)."""
    if not prompt:
        raise ValueError("prompt: at least one token is needed")
    context = model.config.context_length
    if len(prompt) >= context:
        raise ValueError(f"prompt: {len(prompt)} tokens leave no room in the model's context of {context}")
    return context - len(prompt)
