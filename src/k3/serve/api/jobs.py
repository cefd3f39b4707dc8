"""The engine requests behind one HTTP request, bridged from the engine's thread to the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request

from k3.tokenization.image import VisualInput
from k3.serve.engine import Engine, Output, Processor, QueueFull, SamplingParams
from k3.serve.api.metrics import Timer
from k3.serve.api.protocol import APIError, invalid

__all__ = ["Jobs", "error_of"]


class Jobs:
    """The choices of one HTTP request, queued as one engine group (they take turns with other requests'
    groups for admission); outputs arrive as ``(choice index, Output)``. All are queued or none: an invalid
    job is a 400, a full queue a 429 with ``Retry-After``."""

    def __init__(self, engine: Engine, jobs: list[tuple[list[int], SamplingParams, Processor | None]],
                 group: str, timeout: float | None, timer: Timer | None = None,
                 images: list[VisualInput] | None = None, marks: tuple[int, ...] = ()) -> None:
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        loop = asyncio.get_running_loop()

        def callback(i: int):
            def deliver(output: Output) -> None:
                if timer is not None:
                    timer.observe(i, output)
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, output))
            return deliver

        try:
            self.ids = engine.add_requests([(prompt, params, processor, callback(i))
                                            for i, (prompt, params, processor) in enumerate(jobs)], group=group,
                                           images=images, marks=marks)
        except QueueFull as err:
            raise APIError(429, str(err), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(err.retry_after)}) from err
        except ValueError as err:
            raise invalid(err) from err
        self.open = len(jobs)

    async def outputs(self, request: Request | None = None) -> AsyncIterator[tuple[int, Output]]:
        """Outputs until every job finished; with ``request``, a client found disconnected (checked every
        half second) ends it, cancelling the jobs. Past the deadline the jobs are cancelled and a 408 raised."""
        checked = time.monotonic()
        try:
            while self.open:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise APIError(408, f"the request did not finish within the server's request timeout of "
                                        f"{self.timeout:g} s; ask for fewer tokens", type="timeout",
                                   code="request_timeout")
                try:
                    i, output = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except TimeoutError:
                    output = None
                if request is not None and time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if output is not None:
                    self.open -= output.finish_reason is not None
                    yield i, output
        finally:
            self.close()

    def close(self) -> None:
        for request_id in self.ids:
            self.engine.abort(request_id, wait=False)


def error_of(output: Output, grammar: str | None = None) -> APIError | None:
    """The API error of a request that ended with an error or was cancelled by the server; a failure of the
    request's own grammar is a 400 naming the field that gave it (``grammar``)."""
    if output.finish_reason == "error" and output.invalid:
        return APIError(400, f"{grammar}: generation stopped: {output.error}", param=grammar)
    if output.finish_reason == "error":
        return APIError(500, f"generation failed: {output.error}", type="server_error")
    if output.finish_reason == "abort":
        return APIError(503, "the request was cancelled by the server", type="server_error")
    return None
