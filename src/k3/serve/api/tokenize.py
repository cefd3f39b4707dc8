"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (issue 12).

lm-eval's ``local-completions`` probes ``/tokenizer_info`` and ``/tokenize`` and then tokenizes through the
server, so it runs without a local copy of the tokenizer. ``/tokenize`` takes a ``prompt`` (encoded exactly as
``/v1/completions`` encodes one, `Serving.encode_prompt`: special-token literals become their ids, as Hugging Face
tokenizers and vLLM do; ``add_special_tokens`` prepends bos) or chat ``messages`` (rendered with the generation
prompt in the chat format, ``mode`` as in chat requests) and returns ``{"count", "max_model_len", "tokens"[,
"token_strs"]}``; ``/detokenize`` turns ``tokens`` back into ``{"prompt"}``. Bodies are strict like every other
request: unknown fields are 400s.

The work is bounded before it starts and done off the event loop: a prompt or conversation whose text cannot fit
the context is refused by the cheap bound of `Serving.check_chars`, more ``tokens`` than the context holds are a
400 naming ``tokens``, and encoding, decoding and the answer's JSON run in the thread pool.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from k3.chat import chat_format
from k3.serve.api.serving import Route, json_response
from k3.serve.api.protocol import APIError, StrictBody, check_tools

__all__ = ["DetokenizeBody", "Detokenize", "TokenizeBody", "Tokenize", "tokenizer_info"]


class TokenizeBody(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    mode: Literal["thinking", "instruct"] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def unsupported(self) -> None:
        super().unsupported()
        check_tools(self.tools)


class DetokenizeBody(StrictBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class Tokenize(Route):
    async def __call__(self, request: Request) -> Response:
        body = await self.serving.body(request, TokenizeBody)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of 'prompt' or 'messages'", param="prompt")
        tok = self.tokenizer
        if body.prompt is not None:
            self.serving.check_chars(len(body.prompt), "prompt")
            ids = await run_in_threadpool(self.serving.encode_prompt, body.prompt)
            ids = [tok.bos_id] + ids if body.add_special_tokens else ids
        else:
            self.serving.check_messages(body.messages)
            fmt, mode = chat_format(tok), body.mode or self.serving.default_mode
            try:
                ids = await run_in_threadpool(fmt.render, body.messages, tok, mode, body.tools,
                                              body.add_generation_prompt)
            except ValueError as err:
                raise APIError(400, str(err), param="messages") from err
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.serving.engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await run_in_threadpool(lambda: [tok.decode([t]) for t in ids])
        return await json_response(out)


class Detokenize(Route):
    async def __call__(self, request: Request) -> Response:
        body = await self.serving.body(request, DetokenizeBody)
        limit = self.serving.engine.max_model_len
        if len(body.tokens) > limit:
            raise APIError(400, f"tokens: {len(body.tokens):,} token ids; this server detokenizes at most its context "
                                f"length, {limit:,}", param="tokens")
        try:
            return await json_response({"prompt": await run_in_threadpool(self.tokenizer.decode, body.tokens)})
        except ValueError as err:
            raise APIError(400, f"tokens: {err}", param="tokens") from err


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict:
    """What vLLM's ``/tokenizer_info`` reports that a remote client needs: special tokens and sizes."""
    literal = {i: name for name, i in tokenizer.special_ids.items()}
    return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
            "model_max_length": max_model_len, "bos_token": literal.get(tokenizer.bos_id),
            "eos_token": literal.get(tokenizer.eos_id), "pad_token": literal.get(tokenizer.pad_id),
            "chat_format": getattr(tokenizer, "chat_format", "k3")}
