"""``POST /v1/completions``: text or token-id prompts (one or several), ``n`` choices each, streamed or not.

``echo`` puts the prompt before each choice's text and, with ``logprobs``, the prompt tokens' log-probabilities
before the generated ones (the first prompt token's is ``null``), as OpenAI's legacy completions and vLLM return
them — what lm-eval's loglikelihood tasks read; ``max_tokens: 0`` with ``echo`` only scores the prompt.
``best_of`` generates that many choices per prompt and returns the ``n`` with the highest cumulative
log-probability. vLLM's ``prompt_logprobs`` come per choice. The log-probability entries a request asks for
(echoed prompt, ``prompt_logprobs`` and generated tokens, over every choice) are bounded before it is queued.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from k3.serve.engine import Output, TextProcessor
from k3.serve.engine.sampling import TokenLogprob
from k3.serve.api.serving import Reply, Route, json_response, logprob_entries, offload
from k3.serve.api.jobs import Jobs, error_of
from k3.serve.api.protocol import APIError, CompletionBody, extend_logprobs, sse, vllm_prompt_logprobs

__all__ = ["Completions"]


class Completions(Route):
    """The completions route (OpenAI's ``text_completion`` objects)."""

    async def __call__(self, request: Request) -> Response | StreamingResponse:
        s = self.serving
        body = await s.body(request, CompletionBody)
        texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        for text in texts:
            s.check_chars(len(text), "prompt")
        per_prompt = body.best_of or body.n
        s.check_choices((1 if isinstance(body.prompt, str) or _is_ids(body.prompt) else len(body.prompt)) * per_prompt)
        prompts = [body.truncate(p) for p in await run_in_threadpool(_prompts, body.prompt, s.encode_prompt)]
        constraint = await s.constraint(body.guided_json, (self.tokenizer.eos_id,), "guided_json") \
            if body.guided_json is not None else None
        top, lengths = body.logprobs, [s.max_tokens(body.max_tokens, len(prompt)) for prompt in prompts]
        prompt_tokens = sum(map(len, prompts))
        s.check_logprobs({"echo": logprob_entries(prompt_tokens, top if body.echo else None) * per_prompt,
                          "prompt_logprobs": logprob_entries(prompt_tokens, body.prompt_logprobs) * per_prompt,
                          "logprobs": logprob_entries(sum(lengths), top) * per_prompt})
        jobs = [(prompt, params, TextProcessor(self.tokenizer, body.skip_special_tokens))
                for prompt, length in zip(prompts, lengths)
                for params in body.sampling(length, (self.tokenizer.eos_id,), top, self.tokenizer.vocab_size,
                                            constraint, per_prompt)]
        if body.echo and top is not None:  # the prompt's log-probabilities come with the echoed prompt
            jobs = [(prompt, replace(params, prompt_logprobs=max(top, params.prompt_logprobs or 0)), processor)
                    for prompt, params, processor in jobs]
        run = s.submit(jobs)
        reply = _Reply(s.model_name, body, self.tokenizer.decode, prompts, per_prompt)
        reply.grammar = "guided_json" if constraint is not None else None
        if body.stream:
            return StreamingResponse(reply.stream(run), media_type="text/event-stream")
        return await reply.whole(run, request)


class _Reply(Reply):
    """Builds one request's response from its jobs' outputs (job ``j`` is choice ``j % per_prompt`` of prompt
    ``j // per_prompt``)."""

    OBJECT, PREFIX = "text_completion", "cmpl"

    def __init__(self, model_name: str, body: CompletionBody, decode: Callable[[list[int]], str],
                 prompts: list[list[int]], per_prompt: int) -> None:
        super().__init__(model_name, body, len(prompts) * per_prompt, sum(map(len, prompts)))
        self.decode, self.prompts, self.per_prompt = decode, prompts, per_prompt
        self.sent = [0] * len(self.completion_tokens)  # characters streamed per choice
        self.echoed = [False] * len(self.completion_tokens)

    def _prompt(self, job: int) -> list[int]:
        return self.prompts[job // self.per_prompt]

    def _entries(self, tokens: list[int], scored: list[TokenLogprob | None], offset: int) -> dict:
        """Legacy logprobs of ``tokens`` (``scored[i]`` None: no log-probability, e.g. the first prompt token)."""
        texts = [self.decode([t]) for t in tokens]
        offsets = list(itertools.accumulate(map(len, texts), initial=offset))[:-1]  # where each token's text starts
        return {"tokens": texts, "token_logprobs": [None if t is None else t.logprob for t in scored],
                "top_logprobs": [None if t is None else {self.decode([i]): lp for i, lp in t.top[:self.body.logprobs]}
                                 for t in scored],
                "text_offset": offsets}

    def _parts(self, job: int, output: Output, offset: int) -> tuple[str, dict | None]:
        """The text and legacy logprobs of one output; with echo the first output starts with the prompt."""
        text = "".join(t for _, t in output.deltas)
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._entries([t.token_id for t in output.logprobs], output.logprobs, offset)
        if self.body.echo and not self.echoed[job]:
            self.echoed[job] = True
            prompt = self._prompt(job)
            echoed = self.decode(prompt)
            if logprobs is not None:
                scored = output.prompt_logprobs or [None] * len(prompt)
                head = self._entries(prompt, scored, offset)
                logprobs = {key: head[key] + [o + len(echoed) for o in logprobs[key]] if key == "text_offset"
                            else head[key] + logprobs[key] for key in head}
            text = echoed + text
        return text, logprobs

    def heavy(self, index: int, output: Output) -> bool:
        return super().heavy(index, output) or (self.body.echo and not self.echoed[index])

    def events(self, index: int, output: Output) -> list[str]:
        text, logprobs = self._parts(index, output, self.sent[index])
        self.sent[index] += len(text)
        if not (text or output.finish_reason or logprobs):
            return []
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": output.finish_reason}
        if output.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(output.prompt_logprobs, self.decode,
                                                             self.body.prompt_logprobs)
        return [sse(self.chunk([choice]))]

    async def whole(self, run: Jobs, request: Request) -> Response:
        jobs = len(self.completion_tokens)
        texts, finish, lps = [""] * jobs, [None] * jobs, [{} for _ in range(jobs)]
        scores, prompt_lps = [0.0] * jobs, [None] * jobs

        def add(i: int, output: Output) -> None:
            text, logprobs = self._parts(i, output, len(texts[i]))
            extend_logprobs(lps[i], logprobs)
            texts[i] += text
            finish[i], scores[i] = output.finish_reason, output.cumulative_logprob
            if output.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
                prompt_lps[i] = vllm_prompt_logprobs(output.prompt_logprobs, self.decode, self.body.prompt_logprobs)

        async for i, output in run.outputs(request):
            if (err := error_of(output, self.grammar)) is not None:
                raise err
            self.record(i, output)
            await offload(self.heavy(i, output), add, i, output)
        choices = []
        for p in range(len(self.prompts)):  # per prompt, the n best of best_of by cumulative log-probability
            best = sorted(range(p * self.per_prompt, (p + 1) * self.per_prompt), key=lambda j: -scores[j])
            for j in sorted(best[: self.body.n]):
                choice = {"index": len(choices), "text": texts[j],
                          "logprobs": lps[j] if self.body.logprobs is not None else None, "finish_reason": finish[j]}
                if self.body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_lps[j]
                choices.append(choice)
        return await json_response(self.chunk(choices, self.usage()))


def _is_ids(prompt: str | list) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, int) for p in prompt)


def _prompts(prompt: str | list, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The completions ``prompt`` field (text, token ids, or a list of either) as token-id lists."""
    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif _is_ids(prompt):
        prompts = [list(prompt)]
    else:
        prompts = [encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if not prompts or not all(prompts):
        raise APIError(400, "prompt: must be non-empty (an empty text encodes to no tokens)", param="prompt")
    return prompts
