"""``POST /v1/chat/completions``: a conversation in the K3 chat format; the think channel streams as
``reasoning_content``, the tools channel becomes OpenAI ``tool_calls``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from k3.serve.engine import Output
from k3.serve.formats import chat_format
from k3.serve.handler import Reply, Route
from k3.serve.jobs import Jobs, error_of
from k3.serve.protocol import APIError, ChatBody, extend_logprobs, sse

__all__ = ["ChatCompletions"]


class ChatCompletions(Route):
    """The chat route (OpenAI's ``chat.completion`` objects)."""

    async def __call__(self, request: Request) -> dict | StreamingResponse:
        s = self.serving
        body = await s.body(request, ChatBody)
        mode = body.mode_or(s.default_mode)
        s.check_chars(sum(map(_content_chars, body.messages)), "messages")
        s.check_choices(body.n)
        tools = None if body.tool_choice == "none" else body.tools
        fmt = chat_format(self.tokenizer)
        try:
            prompt = await run_in_threadpool(fmt.render, body.messages, self.tokenizer, mode, tools)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        run = s.submit([(prompt, params, fmt.AssistantParser(self.tokenizer, mode)) for params in
                        body.sampling(s.max_tokens(requested, len(prompt)), fmt.stop_ids(self.tokenizer), top)])
        reply = _Reply(s.model_name, body, mode, self.tokenizer.decode, len(prompt), fmt.parse_tool_calls)
        if body.stream:
            return StreamingResponse(reply.stream(run), media_type="text/event-stream")
        return await reply.whole(run, request)


def _content_chars(message: Any) -> int:
    """Characters of a message's text content (what is certainly encoded as text; for the cheap bound)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


class _Reply(Reply):
    """Builds one request's response from its jobs' outputs."""

    OBJECT, PREFIX = "chat.completion.chunk", "chatcmpl"

    def __init__(self, model_name: str, body: ChatBody, mode: str, decode: Callable[[list[int]], str],
                 prompt_tokens: int, parse_tool_calls: Callable[[str], list[dict] | None]) -> None:
        super().__init__(model_name, body, body.n, prompt_tokens)
        self.mode, self.decode, self.parse_tool_calls = mode, decode, parse_tool_calls
        self.tool_text = [""] * body.n  # the tools channel per choice, streamed

    def _tool_calls(self, tool_text: str, finish_reason: str | None) -> tuple[list[dict] | None, str | None]:
        """The tools channel parsed to OpenAI tool calls (finish reason "tool_calls"), or None (kept as content)."""
        calls = self.parse_tool_calls(tool_text) if tool_text else None
        return (calls, "tool_calls") if calls else (None, finish_reason)

    def logprobs(self, output: Output) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": [_logprob(self.decode, t.token_id, t.logprob, t.top) for t in output.logprobs]}

    def opening(self) -> list[str]:
        return [sse(self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}])) for i in range(self.body.n)]

    def events(self, index: int, output: Output) -> list[str]:
        events = []
        for channel, text in output.deltas:
            if channel == "tools":  # sent as tool calls once complete
                self.tool_text[index] += text
            else:
                key = "reasoning_content" if channel == "reasoning" else "content"
                events.append(sse(self.chunk([{"index": index, "delta": {key: text}, "logprobs": None,
                                               "finish_reason": None}])))
        if self.body.logprobs and output.logprobs:
            events.append(sse(self.chunk([{"index": index, "delta": {}, "logprobs": self.logprobs(output),
                                           "finish_reason": None}])))
        if output.finish_reason is not None:
            calls, reason = self._tool_calls(self.tool_text[index], output.finish_reason)
            delta = ({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls
                     else {"content": self.tool_text[index]} if self.tool_text[index] else {})
            events.append(sse(self.chunk([{"index": index, "delta": delta, "logprobs": None,
                                           "finish_reason": reason}])))
        return events

    async def whole(self, run: Jobs, request: Request) -> dict:
        n = self.body.n
        parts = [{"reasoning": "", "content": "", "tools": ""} for _ in range(n)]
        finish: list[str | None] = [None] * n
        lps: list[dict[str, list]] = [{} for _ in range(n)]
        async for i, output in run.outputs(request):
            if (err := error_of(output)) is not None:
                raise err
            self.completion_tokens[i] = output.completion_tokens
            for channel, text in output.deltas:
                parts[i][channel] += text
            finish[i] = output.finish_reason
            extend_logprobs(lps[i], self.logprobs(output))
        choices = []
        for i, p in enumerate(parts):
            calls, reason = self._tool_calls(p["tools"], finish[i])
            message = {"role": "assistant", "content": p["content"] + (p["tools"] if calls is None else ""),
                       "reasoning_content": p["reasoning"] if self.mode == "thinking" else None, "tool_calls": calls}
            choices.append({"index": i, "message": message, "logprobs": lps[i] if self.body.logprobs else None,
                            "finish_reason": reason})
        return self.chunk(choices, self.usage(), "chat.completion")


def _logprob(decode: Callable[[list[int]], str], token: int, logprob: float,
             top: tuple[tuple[int, float], ...]) -> dict:
    def entry(t: int, lp: float) -> dict:
        text = decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
