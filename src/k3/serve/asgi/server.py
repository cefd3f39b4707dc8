"""Running the API with uvicorn: slow-client timeouts, connection slots and graceful shutdown.

uvicorn's h11 protocol closes idle keep-alive connections but never times out a connection that is
still sending its request head, so a client trickling header bytes holds a connection forever.
`GuardedH11Protocol` closes a connection whose request head is not complete ``header_timeout`` seconds
after it opened (or after its previous response finished). Body reading is bounded by `Guard`.
Each connection takes one of the server's `Slots` when it opens (``max_connections``, at most
``max_connections_per_client`` per peer address); one that gets none is answered by `refusing`, which
still serves ``/health`` (uvicorn's own limit would answer it a plain-text 503).

On SIGTERM (or SIGINT) `Server` stops admitting — the `Guard` answers 503, uvicorn stops listening and
closes idle connections — lets running requests finish for up to ``drain_timeout`` seconds, then
cancels what is left (a stream still running gets an ``event: error`` and ``data: [DONE]`` first, from
the `Guard`), and returns normally so the caller can stop the engine and exit 0.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import FrameType

import uvicorn
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

from k3.serve.asgi.admission import Slots, refusing
from k3.serve.asgi.guard import Guard, Limits

__all__ = ["GuardedH11Protocol", "Server", "BackgroundServer"]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a timeout for receiving a request head and a connection slot (see the
    module docstring)."""

    header_timeout: float = 10.0
    slots: Slots  # the server's, set by `_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()
        self._peer = self.client[0] if self.client else None
        why = self.slots.take(self._peer)
        self._has_slot = why is None
        if why is not None:
            self.app = refusing(self.app, why, self.slots)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete and self._head_timer is not None:
            self._head_timer.cancel()  # a request head arrived
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        if self._has_slot:
            self._has_slot = False
            self.slots.give_back(self._peer)
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()


def _protocol(limits: Limits) -> type[GuardedH11Protocol]:
    """The protocol class of one server: its header timeout and its own slots."""
    slots = Slots(limits.max_connections, limits.max_connections_per_client)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": limits.header_timeout,
                                                               "slots": slots})


class Server(uvicorn.Server):
    """A uvicorn server for the API app (wrapped in its `Guard`) that drains on SIGTERM / SIGINT."""

    def __init__(self, app: Guard | CORSMiddleware, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "warning") -> None:
        self.guard: Guard = app if isinstance(app, Guard) else app.app  # `create_app` may wrap it in CORS
        limits: Limits = self.guard.limits
        super().__init__(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, http=_protocol(limits),
            timeout_keep_alive=limits.keep_alive_timeout, timeout_graceful_shutdown=limits.drain_timeout,
            lifespan="off"))
        self.socket: socket.socket | None = None

    def listen(self) -> int:
        """Bind the listening socket now, before `run` serves on it, and return its port (with ``port`` 0, the free
        one the system chose, so that it can be printed)."""
        self.socket = self.config.bind_socket()
        self.socket.listen(self.config.backlog)  # a client that connects at once waits in the backlog until served
        return self.socket.getsockname()[1]

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's ``serve`` (and so ``run``), on the socket `listen` bound if it was called."""
        await super().serve(sockets=sockets or ([self.socket] if self.socket is not None else None))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.guard.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # drained: return normally instead of re-raising the signal


class BackgroundServer:
    """Serve a guarded app on a background thread (tests, benchmarks); port 0 picks a free port."""

    def __init__(self, app: Guard | CORSMiddleware, host: str = "127.0.0.1", port: int = 0) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        self.server = Server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
