"""A cache-aware router in front of engine replicas (issue 13): each replica's prefix cache only hits when a
conversation keeps landing on it, so requests are placed by consistent hashing on their *leading* content.

Placement: a `HashRing` (virtual nodes) of the healthy replicas maps `routing_key` — for chat the first
system message and the first user message, for completions the first 2,048 characters (or 512 token ids)
of the prompt, which stay the same as a conversation grows — to a primary replica and a secondary (the next
distinct one clockwise). A replica that leaves the ring hands only its own keys on, to their secondaries.

Health: every second each replica's ``/health`` is polled (1 s timeout); two failed checks in a row, or a
refused connection (by a check or a request), take it out of the ring, two good checks put it back.

Failover: a request whose primary fails before a byte reached the client — a transport error, or a 5xx —
is sent once more, to the secondary. Non-streamed answers are read in full before they are relayed, so they
are always retried; a stream is retried only if it failed before its first chunk, and a failure after
that ends it with an ``event: error``. 4xx answers are relayed as they are. The ``Authorization`` header
is passed on: the replicas check the key (the router's `Guard` checks it too when it has one).

Admission: requests with a body are "long" beyond ``long_threshold`` bytes and "short" otherwise; each kind
has its own concurrency budget, beyond which the router answers 429 with ``Retry-After`` — so a few huge
prompts cannot starve short chats, nor the other way round. Only a path (a target beginning with ``/``) is relayed:
``GET @host/…`` would otherwise name another host after the replica's URL, ``OPTIONS *`` none.

``GET /router/status`` reports the replicas by index, in the order given (in the ring or not, how often each was
the primary choice and how many answers it served), the retries and the budgets; every relayed answer names its
replica's index in the ``x-k3-replica`` header. Nothing the router answers names a replica's URL: those are
internal addresses.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import httpx

from k3.serve.asgi.guard import Receive, Scope, Send, error_body, send_json, sse_error

__all__ = ["Budget", "HashRing", "Router", "routing_key"]

PROMPT_CHARS, PROMPT_IDS = 2048, 512  # how much of a completion prompt places it
FALL, RISE = 2, 2  # failed checks in a row that take a replica out of the ring, good ones that put it back
#: Headers that describe one connection, not the message; the proxy's own connection sets its own.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"expect", b"host", b"content-length", b"date",
                        b"server"})


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each member owns ``vnodes`` points on a 64-bit circle, and a key belongs to the
    owner of the first point clockwise from the key's hash."""

    def __init__(self, members: Iterable[str] = (), vnodes: int = 128) -> None:
        self.vnodes = vnodes
        self.members: set[str] = set()
        self._points: list[tuple[int, str]] = []
        for member in members:
            self.add(member)

    def __contains__(self, member: str) -> bool:
        return member in self.members

    def add(self, member: str) -> None:
        if member not in self.members:
            self.members.add(member)
            for i in range(self.vnodes):
                bisect.insort(self._points, (_point(f"{member}#{i}".encode()), member))

    def remove(self, member: str) -> None:
        if member in self.members:
            self.members.discard(member)
            self._points = [point for point in self._points if point[1] != member]

    def lookup(self, key: bytes, count: int = 2) -> list[str]:
        """The first ``count`` distinct members clockwise from ``key``: the primary, the secondary, …"""
        found: list[str] = []
        start = bisect.bisect(self._points, (_point(key), ""))
        for i in range(len(self._points)):
            owner = self._points[(start + i) % len(self._points)][1]
            if owner not in found:
                found.append(owner)
                if len(found) == count:
                    break
        return found


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _lead_prompt(prompt: object) -> str | list | None:
    """What places a completion: the start of its (first) prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts
    if isinstance(prompt, str):
        return prompt[:PROMPT_CHARS]
    return prompt[:PROMPT_IDS] if isinstance(prompt, list) and prompt else None


def routing_key(path: str, body: bytes) -> bytes:
    """The bytes that place a request (module docstring); a request with neither ``messages`` nor ``prompt``, or
    whose body is not JSON (nested past Python's recursion limit included: the replica refuses it), is placed by its
    path and body."""
    try:
        data = json.loads(body) if body else None
        key = _content_key(data) if isinstance(data, dict) else None
    except (ValueError, RecursionError):
        key = None
    return key if key is not None else path.encode() + b"\0" + body


def _content_key(data: dict) -> bytes | None:
    """A chat's leading system and user messages, or a completion's leading prompt; None without either."""
    if isinstance(data.get("messages"), list):
        messages = [m for m in data["messages"] if isinstance(m, dict)]
        system = next((m for m in messages if m.get("role") in ("system", "developer")), None)
        user = next((m for m in messages if m.get("role") == "user"), None)
        lead = [{"role": m.get("role"), "content": m.get("content")} for m in (system, user) if m is not None]
        if lead:
            return b"chat:" + _canonical(lead)
    prompt = _lead_prompt(data.get("prompt"))
    return None if prompt is None else b"prompt:" + _canonical(prompt)


def base_url(url: str) -> str:
    """``url`` as a replica's base URL (no trailing ``/``): http or https, a host, no user info, query or fragment
    (a request target is appended to it); a ValueError naming it otherwise."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as err:
        raise ValueError(f"replica {url!r}: not a URL ({err})") from err
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.userinfo or parsed.query \
            or parsed.fragment:
        raise ValueError(f"replica {url!r}: expected a base URL such as http://127.0.0.1:8001 (http or https, a "
                         f"host, no user info, query or fragment)")
    return url.rstrip("/")


@dataclass
class Budget:
    """A concurrency budget that refuses instead of queueing: a semaphore with a non-blocking acquire."""

    limit: int
    in_use: int = 0
    refused: int = 0

    def acquire(self) -> bool:
        if self.in_use >= self.limit:
            self.refused += 1
            return False
        self.in_use += 1
        return True

    def release(self) -> None:
        self.in_use -= 1


@dataclass
class Replica:
    index: int  # how clients know it (its URL is internal)
    url: str
    failures: int = 0  # failed health checks in a row
    successes: int = 0  # good health checks in a row
    primary: int = 0  # requests it was the primary choice for
    served: int = 0  # answers it gave that were relayed


async def _read_body(receive: Receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Router:
    """The router's ASGI app (serve it behind a `k3.serve.asgi.guard.Guard` for body limits and draining);
    ``async with router:`` opens its HTTP client and runs the health checks."""

    def __init__(self, replicas: Sequence[str], *, long_threshold: int = 32768, short_budget: int = 64,
                 long_budget: int = 4, health_interval: float = 1.0, health_timeout: float = 1.0,
                 vnodes: int = 128) -> None:
        urls = [base_url(url) for url in replicas]
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"replicas: expected distinct base URLs, got {list(replicas)}")
        self.replicas = {url: Replica(i, url) for i, url in enumerate(urls)}
        self.ring = HashRing(urls, vnodes)  # replicas start in the ring; checks and refused connections prune it
        self.long_threshold = long_threshold
        self.budgets = {"short": Budget(short_budget), "long": Budget(long_budget)}
        self.health_interval, self.health_timeout = health_interval, health_timeout
        self.retries = 0
        self._client: httpx.AsyncClient | None = None
        self._health: asyncio.Task | None = None

    async def __aenter__(self) -> Router:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=128))
        self._health = asyncio.create_task(self._check_forever())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health
        await self._client.aclose()

    def status(self) -> dict:
        return {"replicas": [{"index": r.index, "in_ring": r.url in self.ring, "primary": r.primary,
                              "served": r.served, "failed_checks": r.failures} for r in self.replicas.values()],
                "retries": self.retries, "long_threshold": self.long_threshold,
                "budgets": {name: {"limit": b.limit, "in_use": b.in_use, "refused": b.refused}
                            for name, b in self.budgets.items()}}

    # ------------------------------------------------------------------ health
    async def _check_forever(self) -> None:
        while True:
            await asyncio.gather(asyncio.sleep(self.health_interval), *map(self._check, self.replicas.values()))

    async def _check(self, replica: Replica) -> None:
        try:
            response = await self._client.get(replica.url + "/health", timeout=self.health_timeout)
            good = response.status_code == 200
        except httpx.ConnectError:
            return self._take_out(replica)
        except httpx.TransportError:
            good = False
        if good:
            replica.failures, replica.successes = 0, replica.successes + 1
            if replica.successes >= RISE:
                self.ring.add(replica.url)
        else:
            replica.failures, replica.successes = replica.failures + 1, 0
            if replica.failures >= FALL:
                self._take_out(replica)

    def _take_out(self, replica: Replica) -> None:
        replica.failures, replica.successes = max(replica.failures, FALL), 0
        self.ring.remove(replica.url)

    # ------------------------------------------------------------------ requests
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/router/status" and scope["method"] == "GET":
            return await send_json(send, 200, self.status())
        body = await _read_body(receive)
        kind = "long" if len(body) > self.long_threshold else "short"
        budget = self.budgets[kind] if body else None  # bodiless requests (/health, /v1/models) are free
        if budget is not None and not budget.acquire():
            return await send_json(send, 429, error_body(
                f"the router is running its budget of {budget.limit} {kind} requests; retry shortly",
                "rate_limit_error", code=f"{kind}_budget_exhausted"), [(b"retry-after", b"1")])
        relay = asyncio.ensure_future(self._relay(scope, body, send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((relay, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            relay.cancel()  # the client left (or the server is cancelling): closing upstream frees the replica
            watch.cancel()
            await asyncio.wait((relay, watch))
            if budget is not None:
                budget.release()
        if not relay.cancelled():
            relay.result()

    async def _relay(self, scope: Scope, body: bytes, send: Send) -> None:
        target = scope.get("raw_path") or scope["path"].encode()
        if not target.startswith(b"/"):  # "@host/…" would name another host after a replica's URL
            return await send_json(send, 400, error_body("the request target must be a path beginning with '/'",
                                                         "invalid_request_error", code="invalid_url"))
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        choices = self.ring.lookup(await asyncio.to_thread(routing_key, scope["path"], body))  # off the event loop
        if not choices:
            return await send_json(send, 503, error_body("no replica is available", "server_error",
                                                      code="no_replica"), [(b"retry-after", b"1")])
        self.replicas[choices[0]].primary += 1
        for attempt, url in enumerate(choices):
            if await self._forward(self.replicas[url], scope, target, body, send, final=attempt == len(choices) - 1):
                return
            self.retries += 1

    async def _forward(self, replica: Replica, scope: Scope, target: bytes, body: bytes, send: Send,
                       final: bool) -> bool:
        """Relay the request (``target``: its path and query) to ``replica``: True once answered, False when it
        failed before a byte reached the client and is to be retried (never when ``final``)."""
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        try:
            request = self._client.build_request(scope["method"], replica.url + target.decode("latin-1"),
                                                 headers=headers, content=body)
        except httpx.InvalidURL as err:  # longer than httpx's 65,536 characters, say: refused, nothing sent
            await send_json(send, 414 if "too long" in str(err) else 400, error_body(
                f"the request's URL cannot be relayed: {err}", "invalid_request_error", code="invalid_url"))
            return True
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as err:
            if isinstance(err, httpx.ConnectError):
                self._take_out(replica)
            return await self._failed(replica, err, send, final)
        try:
            if response.status_code >= 500 and not final:
                return False
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            chunks = response.aiter_raw()
            try:  # a non-streamed answer in full, a stream's first chunk
                head = await anext(chunks, b"") if streamed else b"".join([chunk async for chunk in chunks])
            except httpx.TransportError as err:
                return await self._failed(replica, err, send, final)
            replica.served += 1
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
            out.append((b"x-k3-replica", str(replica.index).encode()))
            if not streamed:
                out.append((b"content-length", str(len(head)).encode()))
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            await send({"type": "http.response.body", "body": head, "more_body": streamed})
            if streamed:
                await self._stream_rest(replica, chunks, send)
            return True
        finally:
            await response.aclose()

    async def _stream_rest(self, replica: Replica, chunks: AsyncIterator[bytes], send: Send) -> None:
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as err:
            error = error_body(f"replica {replica.index} failed mid-stream ({type(err).__name__})", "server_error",
                               code="replica_failed")
            await send({"type": "http.response.body", "body": sse_error(error), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _failed(self, replica: Replica, err: httpx.TransportError, send: Send, final: bool) -> bool:
        if final:
            await send_json(send, 502, error_body(f"replica {replica.index} failed ({type(err).__name__})",
                                                  "server_error", code="replica_failed"))
        return final
