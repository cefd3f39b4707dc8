"""From sampled tokens to what a caller sees (SPEC §8): detokenizing, stop strings, finishing.

Generated ids go through the request's `Processor` (text, or the chat channels). Stop strings are matched on the
visible channels with a hold-back, so a stop string is never streamed: text that may start one is withheld until it
cannot. A request finishes with "stop" (a stop id or string, or the end of its grammar's value: the grammar's end
ends the answer even under ``ignore_eos`` or ``min_tokens``), "length" (``max_tokens``, or the context is full),
"error" (``Output.invalid`` when the request's own grammar failed: `GrammarError`) or "abort". `Outputs.emit` turns
one `Sampled` into the `Output`s of its tokens, in order (a stop ends a verified run inside it); the last carries the
finish reason. Prompt log-probabilities are sent once, with the first output after the prompt was read.
"""

from __future__ import annotations

from torch import Tensor

from k3.serve.engine.request import Output, Request
from k3.serve.engine.sampler import Sampled
from k3.serve.engine.sampling import TokenLogprob
from k3.serve.engine.structured import GrammarError

__all__ = ["STOP_CHANNELS", "Outputs"]

#: Channels on which stop strings are matched (plain completions, and the chat response).
STOP_CHANNELS = ("text", "content")

Deltas = list[tuple[str, str]]


class Outputs:
    """Outputs of requests served with a context of ``max_model_len`` tokens."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def emit(self, sampled: Sampled) -> list[Output]:
        """The outputs of one request's pass; a failure here (a processor's, say) ends that request alone."""
        request = sampled.request
        if sampled.error is not None:
            return [self.finish(request, "error", error=sampled.error)]
        if request.prompt_logprobs is not None:
            request.prompt_logprobs += sampled.prompt_logprobs
        if not sampled.tokens:
            done = request.prefilled == len(request.prompt) and request.params.max_tokens == 0
            return [self.finish(request, "length")] if done else []
        outputs: list[Output] = []
        # a verified run advanced the state past all its tokens: token i was sampled where plain decoding's state
        # stood, ``first + i`` positions in (the context limit is checked there, not at the run's end)
        first = request.state.position - len(sampled.tokens) + 1
        try:
            for i, (token, logprobs) in enumerate(zip(sampled.tokens, sampled.logprobs)):
                outputs.append(self._token(request, token, logprobs, first + i))
                if outputs[-1].finish_reason is not None:
                    break
        except Exception as err:
            outputs.append(self.finish(request, "error", error=err))
        return outputs

    def finish(self, request: Request, reason: str, deltas: Deltas | None = None, token: int | None = None,
               info: list[TokenLogprob] | None = None, error: Exception | None = None) -> Output:
        """The request's last output (withheld text included unless a stop string cut it or it was aborted)."""
        deltas = list(deltas or [])
        if request.held and reason not in ("stop", "abort"):
            deltas.append(request.held)
        request.held = None
        message = None if error is None else f"{type(error).__name__}: {error}"
        output = self._output(request, deltas, token, info or [], reason, message)
        output.invalid = isinstance(error, GrammarError)
        return output

    def _token(self, request: Request, token: int, logprobs: Tensor, position: int) -> Output:
        """One emitted token, sampled with ``position`` tokens consumed (the context is full at ``max_model_len``)."""
        p = request.params
        request.cumulative_logprob += float(logprobs[token])
        info = []
        if p.logprobs is not None:
            top = logprobs.topk(p.logprobs) if p.logprobs else None
            alternatives = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist()))
            info = [TokenLogprob(token, float(logprobs[token]), alternatives)]
        request.output_ids.append(token)
        stopped = token in p.stop_token_ids
        deltas = request.processor.flush() if stopped else request.processor.feed(token)
        if not stopped and request.constraint is not None and request.constraint.done():
            stopped, deltas = True, deltas + request.processor.flush()  # the value is complete: the answer ends
        deltas, stopped = self._match_stops(request, deltas, stopped)
        if stopped:
            return self.finish(request, "stop", deltas, token, info)
        if len(request.output_ids) >= p.max_tokens or position + 1 >= self.max_model_len:
            more, _ = self._match_stops(request, request.processor.flush(), False)
            return self.finish(request, "length", deltas + more, token, info)
        request.pending = token
        return self._output(request, deltas, token, info, None)

    @staticmethod
    def _match_stops(request: Request, deltas: Deltas, stopped: bool) -> tuple[Deltas, bool]:
        """Pass deltas through the stop-string filter; True once a stop string matched (text cut before it)."""
        stops = request.params.stop
        out: Deltas = []
        for channel, text in deltas:
            if request.held and request.held[0] != channel:
                out.append(request.held)
                request.held = None
            if not stops or channel not in STOP_CHANNELS:
                out.append((channel, text))
                continue
            text = (request.held[1] if request.held else "") + text
            request.held = None
            hits = [(i, -len(s)) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
            if hits:
                at, length = min(hits)  # the first stop string in the text (the longest if several start there)
                out.append((channel, text[:at - length if request.params.include_stop_str_in_output else at]))
                return [d for d in out if d[1]], True
            keep = min(len(text), max(map(len, stops)) - 1)
            out.append((channel, text[:len(text) - keep]))
            if keep:
                request.held = (channel, text[len(text) - keep:])
        if stopped and request.held:
            out.append(request.held)
            request.held = None
        return [d for d in out if d[1]], stopped

    @staticmethod
    def _output(request: Request, deltas: Deltas, token: int | None, info: list[TokenLogprob],
                reason: str | None, error: str | None = None) -> Output:
        scored, request.prompt_logprobs = request.prompt_logprobs, None  # sent once
        if scored is not None and request.prefilled < len(request.prompt) and reason is None:
            request.prompt_logprobs, scored = scored, None  # not complete yet
        return Output(request.id, deltas, [] if token is None else [token], info, len(request.prompt),
                      len(request.output_ids), reason, error, scored, request.cumulative_logprob, request.cached)
