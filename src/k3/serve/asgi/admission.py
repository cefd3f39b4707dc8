"""Connection slots: how many connections the server serves at once, in all and per client address.

A connection takes a slot when it opens, if one is free: ``max_connections`` in all, ``max_connections_per_client``
for one peer address (so one client cannot take every slot). A connection that gets none is still read: its
``/health`` requests are answered (a load balancer's check never waits behind a full server) and every other
request gets a JSON error — 429 when its client holds all of its own slots, 503 when the server is full — with
``Retry-After`` and ``Connection: close``. A slot is given back when its connection closes; slow clients are cut
by the header and body timeouts (`k3.serve.asgi.server`, `k3.serve.asgi.guard`).
"""

from __future__ import annotations

from collections import Counter

from k3.serve.asgi.guard import ASGIApp, Receive, Scope, Send, error_body, send_json

__all__ = ["HEALTH_PATH", "Slots", "refusing"]

HEALTH_PATH = "/health"
CLIENT, SERVER = "client", "server"  # why a connection got no slot


class Slots:
    """The server's connection slots (module docstring)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self.by_client: Counter[str | None] = Counter()

    @property
    def taken(self) -> int:
        return self.by_client.total()

    def take(self, client: str | None) -> str | None:
        """A slot for a new connection from ``client`` (its address; None: unknown, no per-client cap): None
        when taken, else why not (`CLIENT` or `SERVER`)."""
        if client is not None and self.by_client[client] >= self.per_client:
            return CLIENT
        if self.taken >= self.total:
            return SERVER
        self.by_client[client] += 1
        return None

    def give_back(self, client: str | None) -> None:
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]


def refusing(app: ASGIApp, why: str, slots: Slots) -> ASGIApp:
    """The app a connection without a slot talks to: ``app`` for `HEALTH_PATH`, a JSON 429 / 503 otherwise."""

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == HEALTH_PATH:
            return await app(scope, receive, send)
        if why == CLIENT:
            status, message, code = 429, (f"this client already has {slots.per_client} open connections, the most "
                                          "one address may hold (--max-connections-per-client); close one or retry "
                                          "shortly"), "too_many_connections"
        else:
            status, message, code = 503, (f"the server is serving its {slots.total} connections "
                                          "(--max-connections); retry shortly"), "server_busy"
        await send_json(send, status, error_body(message, "rate_limit_error" if status == 429 else "server_error",
                                                 code=code), ((b"retry-after", b"1"), (b"connection", b"close")))

    return refuse
