"""The HTTP API's wire protocol: OpenAI error bodies, strictly typed request bodies, SSE and usage helpers.

Request bodies are parsed from the raw bytes by pydantic in strict mode (``model_validate_json``): a wrong
JSON type is a 400 naming the field, never coerced (``"stream": "yes"``, ``"temperature": false``, booleans
as token ids); malformed JSON, invalid UTF-8, lone surrogates and nesting deeper than the parser's limit
are 400s too. Extensions beyond OpenAI's fields (as in vLLM): ``top_k``, ``stop_token_ids``, and for chat
``mode`` ("thinking" | "instruct") or ``chat_template_kwargs: {"thinking": bool}``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from k3.serve.engine import ContextLengthExceeded, SamplingParams
from k3.serve.guard import error_body

__all__ = ["MESSAGE_SCHEMA", "APIError", "ChatBody", "CompletionBody", "extend_logprobs", "invalid", "parse_body",
           "request_body", "schemas", "sse", "usage"]

T = TypeVar("T")
NonEmpty = Annotated[T, Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = NonEmpty[list[Annotated[int, Field(ge=0)]]]
#: Seeds are 64-bit: any integer in [-2^63, 2^64 - 1]; choice i samples with ``(seed + i) mod 2^64``.
Seed = Annotated[int, Field(ge=-2**63, le=2**64 - 1)]


class APIError(Exception):
    """An error answered with OpenAI's error body (and optional response headers, e.g. ``Retry-After``)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def invalid(err: ValueError) -> APIError:
    """A ValueError whose message starts with ``field:`` → 400 naming that field."""
    if isinstance(err, ContextLengthExceeded):
        return APIError(400, str(err), param="max_tokens", code="context_length_exceeded")
    head = str(err).split(":", 1)[0]
    return APIError(400, str(err), param=head if head.replace("_", "").replace(".", "").isalnum() else None)


# ---------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    # strict: no coercion between JSON types; other OpenAI fields are accepted when left at their defaults
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage chunk (and every chunk carries ``usage``)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> None:
        """Reject OpenAI features this server does not implement, rather than silently ignoring them."""
        extra = self.model_extra or {}
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", None),
                              ("echo", False), ("best_of", 1), ("suffix", None), ("response_format", None)):
            value = extra.get(name, neutral)
            if value not in (neutral, None) and not (name == "response_format" and value == {"type": "text"}):
                raise APIError(400, f"{name}: not supported by this server (got {value!r})", param=name)

    def sampling(self, max_tokens: int, stop_ids: tuple[int, ...], logprobs: int | None) -> list[SamplingParams]:
        """One `SamplingParams` per choice; choice i samples with ``seed + i`` (mod 2^64)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return [SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, seed=None if self.seed is None else (self.seed + i) % 2**64,
                               stop=stop, stop_token_ids=stop_ids + tuple(self.stop_token_ids), logprobs=logprobs)
                for i in range(self.n)]


class CompletionBody(_Sampling):
    prompt: Text | NonEmpty[list[Text]] | TokenIds | NonEmpty[list[TokenIds]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class ChatTemplateKwargs(_Body):
    thinking: StrictBool | None = None


class ChatBody(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None  # forced tool calls are not implemented
    mode: Literal["thinking", "instruct"] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    def mode_or(self, default: str) -> str:
        """The chat mode: ``chat_template_kwargs.thinking``, else ``mode``, else the server's default."""
        thinking = self.chat_template_kwargs.thinking if self.chat_template_kwargs else None
        if thinking is not None:
            return "thinking" if thinking else "instruct"
        return self.mode or default


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Validate a raw JSON body; every failure is a 400 naming the top-level field (or the JSON error)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        errors = err.errors()
        if errors[0]["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {errors[0]['msg']}") from None
        first = max(errors, key=lambda e: len(e["loc"]))  # of a union's failed members, the one that got furthest
        loc = [str(x) for x in first["loc"] if not _union_tag(x)]
        param = loc[0] if loc else None
        text = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{'.'.join(loc)}: {text}" if loc else text, param=param) from None


def _union_tag(part: int | str) -> bool:
    """pydantic's name of a union member in an error location (``str``, ``list[int]``), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part
                                      or part.startswith(("constrained-", "function-", "literal")))


# ---------------------------------------------------------------------- OpenAPI
def schemas(*models: type[BaseModel]) -> dict[str, dict]:
    """JSON schemas of the request bodies for ``components.schemas`` (nested models hoisted)."""
    out: dict[str, dict] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


#: A chat message as `k3.serve.chat.render` accepts it (documentation; the renderer validates).
MESSAGE_SCHEMA = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]},
        "reasoning_content": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` declaring a route's JSON body (the route parses it itself, off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


# ---------------------------------------------------------------------- responses
def sse(data: dict | str, event: str | None = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extend_logprobs(merged: dict[str, list], part: dict[str, list] | None) -> None:
    """Append a logprobs part to the merged one (each list extended)."""
    for key, value in (part or {}).items():
        merged.setdefault(key, []).extend(value)
