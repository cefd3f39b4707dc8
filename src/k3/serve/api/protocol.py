"""The HTTP API's wire protocol: OpenAI error bodies, strictly typed request bodies, SSE and usage helpers.

Request bodies are parsed from the raw bytes by pydantic in strict mode (``model_validate_json``): a wrong
JSON type is a 400 naming the field, never coerced (``"stream": "yes"``, ``"temperature": false``, booleans
as token ids); malformed JSON, invalid UTF-8, lone surrogates and nesting deeper than the parser's limit
are 400s too. Every field is honoured or refused: unknown fields and the OpenAI / vLLM fields this server does
not implement (`NOT_IMPLEMENTED`) are 400s naming them, never silently ignored. Extensions beyond OpenAI's
fields (as in vLLM): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``truncate_prompt_tokens``,
``prompt_logprobs``, ``guided_json``; for chat ``mode`` ("thinking" | "instruct") or
``chat_template_kwargs: {"thinking": bool}``, and SGLang's ``separate_reasoning``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from k3.serve.engine import ContextLengthExceeded, SamplingParams
from k3.serve.asgi.guard import error_body
from k3.serve.api.encoding import dumps

__all__ = ["MESSAGE_SCHEMA", "NOT_IMPLEMENTED", "TOOL_SCHEMA", "APIError", "ChatBody", "CompletionBody",
           "NamedToolChoice", "StrictBody", "check_tools", "extend_logprobs", "invalid", "parse_body", "request_body",
           "schemas", "sse", "usage", "vllm_prompt_logprobs"]

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
#: Request fields of OpenAI's and vLLM's APIs this server does not implement: refused with a 400 naming them
#: (so a client learns its setting had no effect). Any other unknown field is refused as unknown.
NOT_IMPLEMENTED = frozenset({
    "suffix", "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "logits_processors",
    "spaces_between_special_tokens", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority",
    "kv_transfer_params", "vllm_xargs", "return_tokens_as_token_ids", "return_token_ids", "add_special_tokens",
    "audio", "modalities", "prediction", "function_call", "functions", "web_search_options", "reasoning_effort",
    "verbosity", "service_tier", "store", "metadata", "prompt_cache_key", "safety_identifier", "documents",
    "chat_template", "continue_final_message", "add_generation_prompt", "mm_processor_kwargs", "echo", "best_of",
})


class StrictBody(BaseModel):
    # strict: no coercion between JSON types; unknown fields are collected and refused by `unsupported`
    model_config = ConfigDict(strict=True, extra="allow")

    def unsupported(self) -> None:
        """Refuse every field this server does not implement, rather than silently ignoring it."""
        for name in self.model_extra or {}:
            if name in NOT_IMPLEMENTED:
                raise APIError(400, f"{name}: not supported by this server", param=name)
            raise APIError(400, f"{name}: unknown request field", param=name)


class StreamOptions(StrictBody):
    include_usage: bool = False


class _Sampling(StrictBody):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    guided_json: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the operator's records; no effect on generation
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's: prefixes are shared only within a salt

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage chunk (and every chunk carries ``usage``)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> None:
        super().unsupported()
        if self.guided_json is not None and getattr(self, "response_format", None) is not None:
            raise APIError(400, "guided_json: give either guided_json or response_format", param="guided_json")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed with stream: true", param="stream_options")

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs; keys must be token ids (as OpenAI's are)."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key!r}",
                               param="logit_bias")
            out.append((int(key), value))
        return tuple(out)

    def truncate(self, prompt: list[int]) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (vLLM), or all of it."""
        return prompt[-self.truncate_prompt_tokens:] if self.truncate_prompt_tokens else prompt

    def sampling(self, max_tokens: int, stop_ids: tuple[int, ...], logprobs: int | None, vocab_size: int,
                 constraint: Callable[[], Any] | None = None, choices: int | None = None) -> list[SamplingParams]:
        """One `SamplingParams` per choice (``choices``, default ``n``); choice i samples with ``seed + i``
        (mod 2^64). ``stop_ids`` are the format's end ids (dropped with ``ignore_eos``)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        ends = () if self.ignore_eos else stop_ids
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens: {self.min_tokens} is more than max_tokens={max_tokens}",
                           param="min_tokens")
        return [SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=None if self.seed is None else (self.seed + i) % 2**64, stop=stop, stop_token_ids=ends + tuple(
                self.stop_token_ids), include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self.bias(vocab_size), min_tokens=self.min_tokens, constraint=constraint,
            cache_salt=self.cache_salt)
            for i in range(self.n if choices is None else choices)]


class CompletionBody(_Sampling):
    prompt: Text | NonEmpty[list[Text]] | TokenIds | NonEmpty[list[TokenIds]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=16)] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of: must be >= n={self.n}, got {self.best_of}", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise APIError(400, "best_of: cannot be combined with stream (the best choices are known at the end)",
                           param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 is only meaningful with echo (scoring the prompt)", param="max_tokens")


class ChatTemplateKwargs(StrictBody):
    thinking: StrictBool | None = None


class JSONSchemaFormat(StrictBody):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class ChatBody(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    mode: Literal["thinking", "instruct"] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    separate_reasoning: bool | None = None  # SGLang's: False puts the reasoning into content as <think>…</think>

    def unsupported(self) -> None:
        super().unsupported()
        check_tools(self.tools)
        f = self.response_format
        if f is not None and f.type == "json_schema" and (f.json_schema is None or f.json_schema.schema_ is None):
            raise APIError(400, "response_format.json_schema: a json_schema with a 'schema' is required",
                           param="response_format")
        if self.tool_choice not in (None, "auto", "none") and not self.tools:
            raise APIError(400, "tool_choice: forcing a tool call needs 'tools'", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                (t.get("function") or {}).get("name") for t in self.tools or [] if isinstance(t, dict)}:
            raise APIError(400, f"tool_choice: no tool named {self.tool_choice.function.name!r} in 'tools'",
                           param="tool_choice")

    def explicit_mode(self) -> str | None:
        """The mode the request chose: ``chat_template_kwargs.thinking``, else ``mode``, else None."""
        thinking = self.chat_template_kwargs.thinking if self.chat_template_kwargs else None
        if thinking is not None:
            return "thinking" if thinking else "instruct"
        return self.mode


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """OpenAI's tool definitions, typed: ``{"type": "function", "function": {"name": str, "description": str,
    "parameters": object, "strict": bool}}`` (the last three optional); anything else is a 400 naming ``tools``."""
    for j, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{j}]: expected {{'type': 'function', 'function': {{...}}}}", param="tools")
        for key, kind, name in (("name", str, "a string"), ("description", str, "a string"),
                                ("parameters", dict, "a JSON schema object"), ("strict", bool, "a boolean")):
            value = fn.get(key)
            if not isinstance(value, kind) and (value is not None or key == "name"):
                raise APIError(400, f"tools[{j}].function.{key}: expected {name}, got {type(value).__name__}",
                               param="tools")


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


#: A chat message as `k3.chat.native.render` accepts it (documentation; the renderer validates).
MESSAGE_SCHEMA = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]},
        "name": {"type": "string"},
        "reasoning_content": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}
#: An OpenAI tool definition as `check_tools` accepts it (documentation).
TOOL_SCHEMA = {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": "boolean"}}}},
}


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` declaring a route's JSON body (the route parses it itself, off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


# ---------------------------------------------------------------------- responses
def sse(data: dict | str, event: str | None = None) -> str:
    """One Server-Sent Event (JSON encoded in pieces: `k3.serve.api.encoding`)."""
    text = data if isinstance(data, str) else dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts prompt tokens reused from the cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def vllm_prompt_logprobs(scored: list[Any], decode: Callable[[list[int]], str], top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` from the engine's `TokenLogprob` list: per prompt token None (the first) or
    ``{id: {logprob, rank, decoded_token}}`` holding the prompt token and the ``top`` most likely alternatives (the
    engine may have scored more, for ``echo``)."""
    out: list[dict | None] = []
    for t in scored:
        if t is None:
            out.append(None)
            continue
        entry = {str(i): {"logprob": lp, "rank": r, "decoded_token": decode([i])}
                 for r, (i, lp) in enumerate(t.top[:top], 1)}
        entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": t.rank, "decoded_token": decode([t.token_id])})
        out.append(entry)
    return out


def extend_logprobs(merged: dict[str, list], part: dict[str, list] | None) -> None:
    """Append a logprobs part to the merged one (each list extended)."""
    for key, value in (part or {}).items():
        merged.setdefault(key, []).extend(value)
