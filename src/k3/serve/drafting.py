"""Speculative decoding in the engine (issue 14; SPEC §8): draft γ tokens, verify them in one target pass, replay.

Per step, each speculating request's `Drafter` proposes γ tokens with the distributions ``q`` it sampled them
from; the engine feeds ``[pending, d_1 … d_γ]`` as one batch-1 group of `K3ForCausalLM.forward_groups` (with every
position's logits and a `Replay`), next to the other requests' decode rows and prefill chunks. `verify_run` then
applies the lossless rule (`k3.serve.speculative.verify`) to the target's *processed* distributions (penalties,
temperature, top-k / top-p / min-p, exactly as plain sampling would use them), emits the accepted tokens and the
corrected or bonus token one by one (stop strings, stop ids and ``max_tokens`` can end the run inside it), and
advances the target state to the accepted prefix with ``state.accept(n + 1)`` — a KDA replay from the recorded
inputs, not a snapshot per drafted position. Greedy requests accept while the target's argmax agrees, so their
tokens are exactly those of plain decoding.

`ModelDrafter` drafts with a small independent K3 model (classic speculative decoding); its per-request draft
states are immutable values, so rolling the draft back to the accepted prefix is choosing one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState
from k3.serve.sampling import SamplingParams, process
from k3.serve.speculative import probabilities, verify, verify_greedy

__all__ = ["Draft", "Drafter", "ModelDrafter", "verify_run"]


@dataclass
class Draft:
    """γ proposed tokens and the draft distributions ``q`` [γ, V] they were sampled from."""

    tokens: list[int]
    q: Tensor


class Drafter(Protocol):
    """Proposes tokens for one request at a time; keyed by the engine's request id."""

    def propose(self, request_id: str, history: list[int], pending: int, params: SamplingParams, prompt: list[int],
                output: list[int], generator: torch.Generator | None, gamma: int) -> Draft: ...

    def accept(self, request_id: str, accepted: int) -> None:
        """The target kept ``pending`` and the first ``accepted`` drafted tokens of the last proposal."""

    def end(self, request_id: str) -> None:
        """The request finished or was aborted."""


class ModelDrafter:
    """Drafts with an independent small `K3ForCausalLM` sharing the target's vocabulary."""

    def __init__(self, model: K3ForCausalLM) -> None:
        self.model = model.eval()
        self._states: dict[str, DecoderState] = {}  # per request: consumed everything before its pending token
        self._proposed: dict[str, tuple[list[DecoderState], list[int]]] = {}  # the last proposal: states, tokens

    @torch.inference_mode()
    def propose(self, request_id: str, history: list[int], pending: int, params: SamplingParams, prompt: list[int],
                output: list[int], generator: torch.Generator | None, gamma: int) -> Draft:
        state = self._states.get(request_id)
        if state is None:  # first proposal: read everything before the pending token
            state = self.model.new_state(1)
            if history:
                _, state = self.model(torch.tensor([history]), state=state)
            self._states[request_id] = state
        tokens, qs, states, token = [], [], [], pending
        for _ in range(gamma):
            logits, state = self.model(torch.tensor([[token]]), state=state)
            states.append(state)
            q = probabilities(process(logits[0, -1].float(), params, prompt, output + tokens), params)
            token = int(q.argmax()) if params.temperature == 0 else int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            qs.append(q)
        self._proposed[request_id] = (states, tokens)  # states[i]: after pending, d_1 … d_i
        return Draft(tokens, torch.stack(qs))

    @torch.inference_mode()
    def accept(self, request_id: str, accepted: int) -> None:
        states, tokens = self._proposed.pop(request_id)
        if accepted < len(states):
            self._states[request_id] = states[accepted]
        else:  # every draft was kept: the draft has not read its own last token yet
            _, self._states[request_id] = self.model(torch.tensor([[tokens[-1]]]), state=states[-1])

    def end(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._proposed.pop(request_id, None)


def verify_run(logits: Tensor, state: DecoderState, draft: Draft, params: SamplingParams, prompt: list[int],
               output: list[int], generator: torch.Generator | None) -> tuple[list[int], DecoderState, list[Tensor]]:
    """From the target's logits ``[γ+1, V]`` at ``[pending, d_1 … d_γ]``: the tokens to emit (the accepted drafts,
    then the corrected or bonus token), the target state after ``pending`` and the accepted drafts, and each
    emitted token's raw log-probabilities (what logprobs report)."""
    logits = logits.float()
    gamma = len(draft.tokens)
    rows = [process(logits[i], params, prompt, output + draft.tokens[:i]) for i in range(gamma + 1)]
    if params.temperature == 0:
        n, token = verify_greedy([int(r.argmax()) for r in rows], draft.tokens)
    else:
        n, token = verify(torch.stack([probabilities(r, params) for r in rows]), draft.q, draft.tokens, generator)
    raw = logits.log_softmax(-1)
    return draft.tokens[:n] + [token], state.accept(n + 1), [raw[i] for i in range(n + 1)]


def draft_length(gamma: int, remaining_tokens: int, room: int) -> int:
    """γ for one step: no more drafts than tokens the request may still emit (one is the bonus) or the context
    holds."""
    return max(0, min(gamma, remaining_tokens - 1, room - 1))


def eligible(params: SamplingParams) -> bool:
    """Whether a request may speculate: not under a grammar (its matcher would have to roll back)."""
    return params.constraint is None

