"""``POST /v1/chat/completions``: a conversation in the model's chat format (`k3.chat`); the think channel
streams as ``reasoning_content`` (or, with ``separate_reasoning: false`` / ``k3 serve --reasoning-in-content``, into
``content`` as ``<think>…</think>``), the tools channel becomes OpenAI ``tool_calls`` (sent when the choice ends) —
or, when it does not parse, the chat format's fallback: its raw text at the end of ``content``, no ``tool_calls``, the
finish reason left as it was (`k3.chat.native`, `k3.chat.xtml`).

Structured output is constrained decoding (`k3.serve.engine.structured`): ``response_format`` ``json_object`` /
``json_schema`` (and vLLM's ``guided_json``) constrain the answer; a forced tool call (``tool_choice:
"required"`` or a named function) constrains the answer to the call as JSON — the named function's arguments,
or vLLM's ``[{"name", "parameters"}, …]`` for ``required`` — which is returned as ``tool_calls``. A request
that asks for structure and does not choose a mode is answered in instruct mode (no reasoning first).

A conversation's images are decoded while it is rendered, in the thread pool, by at most the server's number of
decoding slots at once (`Serving.decoding`); the log-probability entries a request asks for (``prompt_logprobs``
and generated tokens, over its choices) are bounded before it is queued.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from k3.serve.engine import Output
from k3.chat import Parser, chat_format, shared_head
from k3.chat.messages import parse_json
from k3.serve.api.serving import Reply, Route, json_response, logprob_entries, offload
from k3.serve.api.jobs import Jobs, error_of
from k3.serve.api.protocol import APIError, ChatBody, NamedToolChoice, extend_logprobs, sse, vllm_prompt_logprobs

__all__ = ["ChatCompletions"]


class ChatCompletions(Route):
    """The chat route (OpenAI's ``chat.completion`` objects)."""

    async def __call__(self, request: Request) -> Response | StreamingResponse:
        s = self.serving
        body = await s.body(request, ChatBody)
        if not body.skip_special_tokens:
            raise APIError(400, "skip_special_tokens: false is not supported for chat (the chat format's markers "
                                "are parsed, not returned)", param="skip_special_tokens")
        schema, forced = await run_in_threadpool(_answer_schema, body)
        structured = schema is not None or body.response_format is not None and body.response_format.type != "text"
        mode = body.explicit_mode() or ("instruct" if structured else s.default_mode)
        s.check_messages(body.messages)
        s.check_choices(body.n)
        fmt = chat_format(self.tokenizer)
        tool_choice = body.tool_choice if isinstance(body.tool_choice, str) else "required" if forced else "auto"
        response_format = body.response_format.model_dump(by_alias=True) if body.response_format else None
        images = s.image_parts() if fmt.IMAGES else None
        media = {} if images is None else {"media": images}
        try:
            async with s.decoding(body.messages if images is not None else None):
                prompt = await run_in_threadpool(lambda: fmt.render(body.messages, self.tokenizer, mode, body.tools,
                                                                    tool_choice=tool_choice,
                                                                    response_format=response_format, **media))
            head = 0 if images is not None and images.inputs else await run_in_threadpool(
                shared_head, fmt, body.messages, prompt, self.tokenizer, mode, body.tools)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        rendered, prompt = len(prompt), body.truncate(prompt)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = s.max_tokens(requested, len(prompt))
        top = (body.top_logprobs or 0) if body.logprobs else None
        s.check_logprobs({"prompt_logprobs": logprob_entries(len(prompt), body.prompt_logprobs) * body.n,
                          "logprobs": logprob_entries(max_tokens, top) * body.n})
        stop_ids = fmt.stop_ids(self.tokenizer)
        grammar = forced or ("guided_json" if body.guided_json is not None else "response_format")
        constraint = await s.constraint(schema, stop_ids, grammar) if structured else None
        try:  # the engine checks that the prompt holds the images' slots
            choices = body.sampling(max_tokens, stop_ids, top, self.tokenizer.vocab_size, constraint)
            parsers = [fmt.AssistantParser(self.tokenizer, mode) for _ in choices]
            run = s.submit([(prompt, params, parser) for params, parser in zip(choices, parsers)],
                images=images.inputs if images is not None and images.inputs else None, marks=(head,) if head else ())
        except APIError as err:
            if err.param != "prompt" or len(prompt) == rendered:
                raise
            raise APIError(400, f"truncate_prompt_tokens: truncation would cut into an image's slots ({err.message})",
                           param="truncate_prompt_tokens") from err
        separate = body.separate_reasoning if body.separate_reasoning is not None else s.separate_reasoning
        reply = _Reply(s.model_name, body, mode, self.tokenizer.decode, len(prompt), parsers, separate, forced)
        reply.grammar = grammar if structured else None
        if body.stream:
            return StreamingResponse(reply.stream(run), media_type="text/event-stream")
        return await reply.whole(run, request)


def _answer_schema(body: ChatBody) -> tuple[dict | None, str | None]:
    """The JSON schema the answer is constrained to (None: any object, or no constraint), and the request field
    forcing a tool call (``"tool_choice"``) if one does."""
    if isinstance(body.tool_choice, NamedToolChoice):
        tool = next(t["function"] for t in body.tools if (t.get("function") or {}).get("name") ==
                    body.tool_choice.function.name)
        return tool.get("parameters") or {"type": "object"}, "tool_choice"
    if body.tool_choice == "required":
        functions = [t["function"] for t in body.tools
                     if isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)]
        if not functions:
            raise APIError(400, "tools: no function to call", param="tools")
        # each function's parameters under $defs, its references rebased there: they resolve as in the function alone
        defs = {f"tool{k}": _rebased(f.get("parameters") or {"type": "object"}, f"#/$defs/tool{k}")
                for k, f in enumerate(functions)}
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"], "properties": {
            "name": {"const": f["name"]}, "parameters": {"$ref": f"#/$defs/tool{k}"}}} for k, f in enumerate(functions)]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
        return (array | {"maxItems": 1} if not body.parallel_tool_calls else array), "tool_choice"
    if body.guided_json is not None:
        return body.guided_json, None
    f = body.response_format
    return (f.json_schema.schema_ if f is not None and f.type == "json_schema" else None), None


def _rebased(schema: Any, base: str) -> Any:
    """A copy of ``schema`` whose local references (``#…``) point into ``base``, where the copy will live; values
    (``const``, ``enum``, ``default``, ``examples``) are copied as they are."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                and isinstance(value, dict):  # names (which may be "enum"), then schemas
            out[key] = {name: _rebased(v, base) for name, v in value.items()}
        else:
            out[key] = value if key in ("const", "enum", "default", "examples") else _rebased(value, base)
    return out



class _Reply(Reply):
    """Builds one request's response from its jobs' outputs."""

    OBJECT, PREFIX = "chat.completion.chunk", "chatcmpl"

    def __init__(self, model_name: str, body: ChatBody, mode: str, decode: Callable[[list[int]], str],
                 prompt_tokens: int, parsers: list[Parser], separate: bool, forced: str | None) -> None:
        super().__init__(model_name, body, body.n, prompt_tokens)
        self.mode, self.decode, self.parsers = mode, decode, parsers
        self.separate, self.forced = separate, forced
        self.tool_text = [""] * body.n  # the tools channel per choice (a forced call: the answer), sent at the end
        self.thinking = [False] * body.n  # inside an inline <think> block (separate_reasoning false)

    def _tool_calls(self, index: int, finish_reason: str | None) -> tuple[list[dict] | None, str | None]:
        """Choice ``index``'s tools channel as OpenAI tool calls (finish reason "tool_calls"; parsed from the ids by
        its parser, or a forced call's JSON answer), or None (its text is kept as content)."""
        tool_text = self.tool_text[index]
        calls = (self._forced_calls(tool_text) if self.forced else self.parsers[index].tool_calls()) \
            if tool_text else None
        if calls and not self.body.parallel_tool_calls:
            calls = calls[:1]
        return (calls, "tool_calls") if calls else (None, finish_reason)

    def _forced_calls(self, text: str) -> list[dict] | None:
        """A forced call's JSON answer as OpenAI tool calls (None if it did not complete)."""
        try:
            value = parse_json(text)
        except ValueError:
            return None
        if isinstance(self.body.tool_choice, NamedToolChoice):
            items = [{"name": self.body.tool_choice.function.name, "parameters": value}]
        else:
            items = value
        return [{"id": f"call_{k}", "type": "function", "function": {
            "name": item["name"], "arguments": json.dumps(item["parameters"], ensure_ascii=False)}}
            for k, item in enumerate(items)]

    def _route(self, index: int, channel: str, text: str) -> list[tuple[str, str]]:
        """Where a channel delta goes: ``(key, text)`` for the delta (tool text is kept for the end)."""
        if channel == "tools" or (self.forced and channel == "content"):
            self.tool_text[index] += text
            return []
        if self.separate or self.mode != "thinking":
            return [("reasoning_content" if channel == "reasoning" else "content", text)]
        opened = self.thinking[index]
        self.thinking[index] = channel == "reasoning"
        if channel == "reasoning":
            return [("content", text if opened else "<think>" + text)]
        return [("content", ("</think>" if opened else "") + text)]

    def _close(self, index: int) -> list[tuple[str, str]]:
        """Close an inline ``<think>`` block still open when the choice ends."""
        if self.thinking[index]:
            self.thinking[index] = False
            return [("content", "</think>")]
        return []

    def logprobs(self, output: Output) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": [_logprob(self.decode, t.token_id, t.logprob, t.top) for t in output.logprobs]}

    def opening(self) -> list[str]:
        return [sse(self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}])) for i in range(self.body.n)]

    def events(self, index: int, output: Output) -> list[str]:
        events = []
        routed = [d for channel, text in output.deltas for d in self._route(index, channel, text)]
        if output.finish_reason is not None:
            routed += self._close(index)
        for key, text in routed:
            events.append(sse(self.chunk([{"index": index, "delta": {key: text}, "logprobs": None,
                                           "finish_reason": None}])))
        if self.body.logprobs and output.logprobs:
            events.append(sse(self.chunk([{"index": index, "delta": {}, "logprobs": self.logprobs(output),
                                           "finish_reason": None}])))
        if output.finish_reason is not None:
            calls, reason = self._tool_calls(index, output.finish_reason)
            delta = ({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls
                     else {"content": self.tool_text[index]} if self.tool_text[index] else {})
            events.append(sse(self.chunk([{"index": index, "delta": delta, "logprobs": None,
                                           "finish_reason": reason}])))
        return events

    async def whole(self, run: Jobs, request: Request) -> Response:
        n = self.body.n
        parts = [{"reasoning_content": "", "content": ""} for _ in range(n)]
        finish: list[str | None] = [None] * n
        lps: list[dict[str, list]] = [{} for _ in range(n)]
        prompt_logprobs = None  # the first choice's (each choice scores the same prompt)

        def add(i: int, output: Output) -> None:
            nonlocal prompt_logprobs
            routed = [d for channel, text in output.deltas for d in self._route(i, channel, text)]
            for key, text in routed + (self._close(i) if output.finish_reason is not None else []):
                parts[i][key] += text
            finish[i] = output.finish_reason
            extend_logprobs(lps[i], self.logprobs(output))
            if output.prompt_logprobs is not None and prompt_logprobs is None:
                prompt_logprobs = vllm_prompt_logprobs(output.prompt_logprobs, self.decode, self.body.prompt_logprobs)

        async for i, output in run.outputs(request):
            if (err := error_of(output, self.grammar)) is not None:
                raise err
            self.record(i, output)
            await offload(self.heavy(i, output), add, i, output)
        choices = []
        for i, p in enumerate(parts):
            calls, reason = self._tool_calls(i, finish[i])
            message = {"role": "assistant", "content": p["content"] + (self.tool_text[i] if calls is None else ""),
                       "reasoning_content": p["reasoning_content"] if self.mode == "thinking" and self.separate
                       else None, "tool_calls": calls}
            choices.append({"index": i, "message": message, "logprobs": lps[i] if self.body.logprobs else None,
                            "finish_reason": reason})
        out = self.chunk(choices, self.usage(), "chat.completion")
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs
        return await json_response(out)


def _logprob(decode: Callable[[list[int]], str], token: int, logprob: float,
             top: tuple[tuple[int, float], ...]) -> dict:
    def entry(t: int, lp: float) -> dict:
        text = decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
