"""From a pass's logits to each request's tokens (SPEC §8): sampling, grammar masks and draft verification.

`Sampler.sample` turns a `Forward` into one `Sampled` per request in it, in order: prefill pieces (the prompt's
log-probabilities where asked for, and the first token once the prompt is read), verified speculative runs, decode
rows. Sampling is per request (`k3.serve.engine.sampling`: penalties, bias, ``min_tokens``, the grammar, then
greedy or a seeded sample), so a request's tokens do not depend on its batch neighbours. A request's grammar applies
once its output reaches the answer (channel "text" or "content"), so a thinking model reasons freely first.
Logits past the tokenizer's vocabulary (a padded vocabulary) are never chosen; non-finite logits, or any error
while sampling one request, end that request alone (`Sampled.error`).

`verify` is the lossless rule of speculative decoding (`k3.serve.engine.speculative`) applied to the target's
*processed* distributions at ``[pending, d_1 … d_γ]`` (exactly as plain sampling would use them): the accepted
drafts, then the corrected or bonus token, and the target state after ``pending`` and the accepted drafts
(``state.accept(n + 1)``, a KDA replay from the recorded inputs; in a pass, every speculating request's at once
with `DecoderState.accept_rows`). Greedy requests without penalties or biases take the argmax of the raw logits,
and accept while it agrees with the drafts, so their tokens are exactly those of plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3.model.state import DecoderState
from k3.serve.engine.drafting import Draft
from k3.serve.engine.request import Request
from k3.serve.engine.runner import Forward
from k3.serve.engine.sampling import TokenLogprob, choose, process, score_prompt
from k3.serve.engine.speculative import probabilities, verify, verify_greedy

__all__ = ["Sampled", "Sampler"]

#: Channels whose text a request's grammar constrains (plain completions, and the chat answer).
ANSWER_CHANNELS = ("text", "content")


@dataclass
class Sampled:
    """What a pass gave one request: the state it continues from, the prompt tokens it ``read``, the ``tokens`` to
    emit in order (none while the prompt is being read, several for a verified run) with each token's
    log-probabilities over the vocabulary, the prompt tokens' log-probabilities it scored; or the ``error`` that
    ends the request. ``verified`` = (pending, drafted, features) for a speculative run."""

    request: Request
    state: DecoderState | None = None
    read: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Tensor] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    verified: tuple[int, int, Tensor | None] | None = None
    error: Exception | None = None


def _finite_rows(logits: Tensor) -> list[bool]:
    """Whether each row of ``logits`` ``[N, V]`` is free of NaN and infinities; a row whose sum is finite is, so the
    element-wise test runs only when some sum is not."""
    if bool(logits.sum(-1).isfinite().all()):
        return [True] * logits.shape[0]
    return torch.isfinite(logits).all(-1).tolist()


class Sampler:
    """Samples for one tokenizer's vocabulary (``vocab_size`` ids; the model's may be larger)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def sample(self, forward: Forward) -> list[Sampled]:
        out = [self._piece(request, piece, logits, state) for request, piece, logits, state in forward.pieces]
        out += self._verified(forward) if forward.verifying else []
        if forward.decoding:
            out += [Sampled(request, state, tokens=s.tokens, logprobs=s.logprobs, error=s.error) for request, state, s
                    in zip(forward.decoding, forward.states, self.rows(forward.decoding, forward.logits))]
        return out

    def rows(self, requests: list[Request], logits: Tensor) -> list[Sampled]:
        """Each request's next token from its row of ``logits`` ``[B, V]``."""
        logits = self._allowed(logits)
        finite = _finite_rows(logits[:, : self.vocab_size])
        logprobs = logits.log_softmax(-1)
        greedy = logits.argmax(-1).tolist()
        out = []
        for b, request in enumerate(requests):
            try:
                if not finite[b]:
                    raise FloatingPointError("the model produced non-finite logits for this request")
                out.append(Sampled(request, tokens=[self._choose(request, logits[b], greedy[b])],
                                   logprobs=[logprobs[b]]))
            except Exception as err:
                out.append(Sampled(request, error=err))
        return out

    def _allowed(self, logits: Tensor) -> Tensor:
        """``logits`` ``[N, V]`` in float32 with the ids past the tokenizer's vocabulary (a padded vocabulary: ids the
        tokenizer cannot decode) at −inf, so they are never chosen."""
        logits = logits.float()
        if logits.shape[-1] > self.vocab_size:
            logits[:, self.vocab_size:] = float("-inf")
        return logits

    def verify(self, request: Request, logits: Tensor, state: DecoderState,
               draft: Draft) -> tuple[list[int], DecoderState, list[Tensor]]:
        """From the target's logits ``[γ+1, V]`` at ``[pending, d_1 … d_γ]``: the tokens to emit, the target state
        after ``pending`` and the accepted drafts, and each emitted token's raw log-probabilities (`judge`, then
        ``state.accept``)."""
        tokens, logprobs = self.judge(request, logits, draft)
        return tokens, state.accept(len(tokens)), logprobs

    def judge(self, request: Request, logits: Tensor, draft: Draft) -> tuple[list[int], list[Tensor]]:
        """`verify`'s rule: the tokens to emit (the accepted drafts, then the corrected or bonus token: the state
        consumes ``pending`` and the accepted drafts, as many tokens) and each one's raw log-probabilities."""
        params, prompt, output = request.params, request.prompt, request.output_ids
        logits = self._allowed(logits)
        # a non-finite row j is reached only when d_1 … d_j are all accepted (plain sampling would then raise there
        # too): verify those drafts with a stand-in for row j, and fail only if the run reaches it
        finite = _finite_rows(logits[:, : self.vocab_size])
        bad = finite.index(False) if False in finite else None
        drafted = draft.tokens if bad is None else draft.tokens[:bad]
        if bad is not None:
            logits = logits[:bad + 1].clone()
            logits[bad, : self.vocab_size] = 0.0
        if params.temperature == 0 and not params.processed:  # `process` would change nothing: the raw argmax
            n, token = verify_greedy(logits[:len(drafted) + 1].argmax(-1).tolist(), drafted)
        else:
            rows = [process(logits[i], params, prompt, output + drafted[:i]) for i in range(len(drafted) + 1)]
            if params.temperature == 0:
                n, token = verify_greedy([int(r.argmax()) for r in rows], drafted)
            else:
                q = draft.distributions(logits.shape[-1], logits.device)[:len(drafted)]
                n, token = verify(torch.stack([probabilities(r, params) for r in rows]), q, drafted, request.generator)
        if n == bad:
            raise FloatingPointError("the model produced non-finite logits for this request")
        return draft.tokens[:n] + [token], list(logits[:n + 1].log_softmax(-1).unbind())

    def _piece(self, request: Request, piece: list[int], logits: Tensor, state: DecoderState) -> Sampled:
        """A prefill piece: its prompt log-probabilities, and the first token when it completes the prompt."""
        try:
            scored = [] if request.prompt_logprobs is None else \
                score_prompt(request.prompt, logits, request.prefilled, request.params.prompt_logprobs)
        except Exception as err:
            return Sampled(request, error=err)
        done = request.prefilled + len(piece) == len(request.prompt)
        if not done or request.params.max_tokens == 0:  # max_tokens 0: only the prompt's log-probabilities
            return Sampled(request, state, len(piece), prompt_logprobs=scored)
        first = self.rows([request], logits[-1:])[0]
        return Sampled(request, state, len(piece), first.tokens, first.logprobs, scored, error=first.error)

    def _verified(self, forward: Forward) -> list[Sampled]:
        """Each speculating request's verified run (`judge`), then every row's state at once
        (`DecoderState.accept_rows`); a request whose run fails to verify ends alone."""
        judged: list[tuple[list[int], list[Tensor]] | Exception] = []
        for request, draft, logits, _ in forward.verifying:
            try:
                judged.append(self.judge(request, logits, draft))
            except Exception as err:
                judged.append(err)
        try:
            states = forward.verified.accept_rows([1 if isinstance(j, Exception) else len(j[0]) for j in judged])
        except Exception as err:  # the rows' shared replay failed: every row of it ends
            states, judged = [None] * len(judged), [err] * len(judged)
        out = []
        for (request, draft, _, features), result, state in zip(forward.verifying, judged, states, strict=True):
            if isinstance(result, Exception):
                out.append(Sampled(request, error=result))
            else:
                out.append(Sampled(request, state, tokens=result[0], logprobs=result[1],
                                   verified=(request.pending, len(draft.tokens), features)))
        return out

    @staticmethod
    def _choose(request: Request, row: Tensor, greedy: int) -> int:
        """The request's next token (its grammar applies once its output reaches the answer)."""
        p = request.params
        constraint = request.constraint if request.processor.channel in ANSWER_CHANNELS else None
        if constraint is None and not p.processed and p.temperature == 0:
            return greedy
        token = choose(process(row, p, request.prompt, request.output_ids, constraint), p, request.generator)
        if constraint is not None:
            constraint.accept(token)
        return token
