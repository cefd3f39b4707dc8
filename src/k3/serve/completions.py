"""``POST /v1/completions``: text or token-id prompts (one or several), ``n`` choices each, streamed or not."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from k3.serve.engine import Output
from k3.serve.handler import Reply, Route
from k3.serve.jobs import Jobs, error_of
from k3.serve.protocol import APIError, CompletionBody, extend_logprobs, sse

__all__ = ["Completions"]


class Completions(Route):
    """The completions route (OpenAI's ``text_completion`` objects)."""

    async def __call__(self, request: Request) -> dict | StreamingResponse:
        s = self.serving
        body = await s.body(request, CompletionBody)
        texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        for text in texts:
            s.check_chars(len(text), "prompt")
        s.check_choices((1 if isinstance(body.prompt, str) or _is_ids(body.prompt) else len(body.prompt)) * body.n)
        prompts = await run_in_threadpool(_prompts, body.prompt, self.tokenizer.encode)
        jobs = [(prompt, params, None) for prompt in prompts
                for params in body.sampling(s.max_tokens(body.max_tokens, len(prompt)), (self.tokenizer.eos_id,),
                                            body.logprobs)]
        run = s.submit(jobs)
        reply = _Reply(s.model_name, body, self.tokenizer.decode, len(jobs), sum(map(len, prompts)))
        if body.stream:
            return StreamingResponse(reply.stream(run), media_type="text/event-stream")
        return await reply.whole(run, request)


class _Reply(Reply):
    """Builds one request's response from its jobs' outputs."""

    OBJECT, PREFIX = "text_completion", "cmpl"

    def __init__(self, model_name: str, body: CompletionBody, decode: Callable[[list[int]], str], choices: int,
                 prompt_tokens: int) -> None:
        super().__init__(model_name, body, choices, prompt_tokens)
        self.decode = decode
        self.sent = [0] * choices  # characters streamed per choice

    def logprobs(self, output: Output, offset: int) -> dict | None:
        """The output's token log-probabilities; ``offset`` is where its text starts in the choice's text."""
        if self.body.logprobs is None:
            return None
        return {"tokens": [self.decode([t.token_id]) for t in output.logprobs],
                "token_logprobs": [t.logprob for t in output.logprobs],
                "top_logprobs": [{self.decode([i]): lp for i, lp in t.top} for t in output.logprobs],
                "text_offset": [offset] * len(output.logprobs)}

    def events(self, index: int, output: Output) -> list[str]:
        text = "".join(t for _, t in output.deltas)
        offset, self.sent[index] = self.sent[index], self.sent[index] + len(text)
        if not (text or output.finish_reason or self.body.logprobs is not None):
            return []
        return [sse(self.chunk([{"index": index, "text": text, "logprobs": self.logprobs(output, offset),
                                 "finish_reason": output.finish_reason}]))]

    async def whole(self, run: Jobs, request: Request) -> dict:
        n = len(self.completion_tokens)
        texts, finish, lps = [""] * n, [None] * n, [{} for _ in range(n)]
        async for i, output in run.outputs(request):
            if (err := error_of(output)) is not None:
                raise err
            self.completion_tokens[i] = output.completion_tokens
            extend_logprobs(lps[i], self.logprobs(output, len(texts[i])))
            texts[i] += "".join(t for _, t in output.deltas)
            finish[i] = output.finish_reason
        choices = [{"index": i, "text": texts[i], "logprobs": lps[i] if self.body.logprobs is not None else None,
                    "finish_reason": finish[i]} for i in range(n)]
        return self.chunk(choices, self.usage())


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
