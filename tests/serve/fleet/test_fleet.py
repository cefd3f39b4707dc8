"""The cache-aware router (`k3.serve.fleet.router`) and the fleet (`k3 route`, `k3 serve --replicas`): the ring and
routing keys as units, then real `k3 serve` replicas and routers on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

import serving
from gloo import free_port
from k3.model.checkpoint import save_model
from k3.serve.asgi.guard import Guard, Limits
from k3.serve.fleet.launch import replica_flags
from k3.serve.fleet.replicas import FIRST_DELAY, MAX_DELAY, STABLE, Replicas
from k3.serve.fleet.router import PROMPT_CHARS, PROMPT_IDS, HashRing, Router, routing_key

KEY, LONG_THRESHOLD = "k", 200  # the replicas' API key; bodies over 200 bytes are "long" (budget 1)


# ---------------------------------------------------------------------- units
def test_ring_moves_only_the_removed_replicas_keys_to_their_secondaries():
    ring = HashRing(["a", "b", "c", "d"])
    keys = [f"conversation {i}".encode() for i in range(4000)]
    before = {key: ring.lookup(key) for key in keys}
    assert all(len(choice) == 2 and choice[0] != choice[1] for choice in before.values())
    shares = {member: sum(choice[0] == member for choice in before.values()) / len(keys) for member in "abcd"}
    assert all(0.15 < share < 0.35 for share in shares.values()), shares  # virtual nodes balance the load
    ring.remove("c")
    for key, (primary, secondary) in before.items():
        assert ring.lookup(key)[0] == (secondary if primary == "c" else primary)
    ring.add("c")
    assert all(ring.lookup(key) == choice for key, choice in before.items())
    order = ring.lookup(b"x", count=9)
    assert len(order) == len(set(order)) == 4 and order[:2] == ring.lookup(b"x") and HashRing().lookup(b"x") == []


def test_routing_key_is_the_leading_content():
    def chat(*messages):
        return routing_key("/v1/chat/completions", httpx.Request("POST", "/", json={"messages": messages}).content)

    system, first = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    turns = [system, first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert chat(*turns[:2]) == chat(*turns) == chat(*turns[:3])  # a growing conversation keeps its key
    assert chat(*turns[:2]) != chat(first) != chat(system, {"role": "user", "content": "bye"})

    def completion(prompt):
        return routing_key("/v1/completions", httpx.Request("POST", "/", json={"prompt": prompt}).content)

    text = "x" * PROMPT_CHARS
    assert completion(text + "a") == completion(text + "b") == completion([text, "c"]) != completion("a" + text)
    ids = list(range(PROMPT_IDS))
    assert completion(ids + [1]) == completion(ids + [2]) == completion([ids]) != completion(ids[1:])
    assert routing_key("/health", b"") != routing_key("/v1/models", b"") == routing_key("/v1/models", b"")
    assert routing_key("/tokenize", b"{not json") == b"/tokenize\0{not json"
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # json.loads: RecursionError (was a 500)
    assert routing_key("/v1/completions", deep) == b"/v1/completions\0" + deep


def test_replica_urls_and_an_empty_key_are_refused_at_construction():
    """A router over ``notaurl`` ran and waited for it forever; an empty key let an empty bearer token in."""
    for url in ("notaurl", "ftp://x", "http://u:p@127.0.0.1:1", "http://127.0.0.1:1#top"):
        with pytest.raises(ValueError, match=f"replica {url!r}"):
            Router([url])
    assert list(Router(["http://127.0.0.1:1/", "https://host/base"]).replicas) == ["http://127.0.0.1:1",
                                                                                 "https://host/base"]
    with pytest.raises(ValueError, match="api_key: empty"):
        Guard(Router(["http://127.0.0.1:1"]), Limits(), api_key=" ")


def test_restart_backoff_doubles_up_to_its_cap_and_starts_over_after_a_stable_run():
    replicas = Replicas([8001], lambda port: ["true"])
    replicas.started = [time.monotonic()]
    delays = [replicas.delay(0) for _ in range(9)]
    assert delays == [FIRST_DELAY * 2**i for i in range(6)] + [MAX_DELAY] * 3 and FIRST_DELAY * 2**5 < MAX_DELAY
    replicas.started = [time.monotonic() - STABLE]  # it ran long enough before this exit
    assert replicas.delay(0) == FIRST_DELAY


def test_a_replica_lets_its_one_client_the_router_hold_every_connection():
    flags = ["--api-key", "k", "--max-connections", "100", "--max-connections-per-client", "3", "--port", "9",
             "--threads", "2"]
    assert replica_flags(flags, 2) == ["--api-key", "k", "--threads", "2", "--max-connections", "100",
                                       "--max-connections-per-client", "100"]
    assert replica_flags(["--threads", "1"], 2)[2:] == ["--max-connections", str(Limits().max_connections),
                                                        "--max-connections-per-client", str(Limits().max_connections)]


# ---------------------------------------------------------------------- processes
def launch(*args: str, output=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3.cli", *args], stdout=output, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_until(ready, process: subprocess.Popen | None = None, timeout: float = 60, log: Path | None = None) -> None:
    """Poll ``ready`` until it holds; fail (with ``log``'s tail) at ``timeout`` or when ``process`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except httpx.TransportError:
            pass
        exited = process is not None and process.poll() is not None
        if exited or time.monotonic() >= deadline:
            tail = log.read_text()[-4000:] if log else ""
            raise AssertionError(f"{'exited with ' + str(process.returncode) if exited else 'timed out'}\n{tail}")
        time.sleep(0.05)


def replica(ckpt, port: int) -> subprocess.Popen:
    return launch("serve", "--ckpt", str(ckpt), "--port", str(port), "--api-key", KEY, "--max-model-len", "256",
                  "--threads", "1")


def answers(url: str) -> bool:
    return httpx.get(url + "/health", timeout=1).status_code == 200


def status(url: str) -> dict:
    return httpx.get(url + "/router/status", headers={"authorization": f"Bearer {KEY}"}, timeout=5).json()


def in_ring(url: str) -> dict[int, bool]:
    """Each replica's index (the order of the router's --replica flags): whether it is in the ring."""
    return {r["index"]: r["in_ring"] for r in status(url)["replicas"]}


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("fleet") / "k3-tiny", serving.model(), serving.tokenizer())


@pytest.fixture(scope="module")
def fleet(ckpt):
    """Three replicas behind `k3 route` (long budget 1), all with API key "k": (router URL, {replica URL: process}),
    the replicas in the order of their index."""
    ports = [free_port() for _ in range(3)]
    replicas = {f"http://127.0.0.1:{port}": replica(ckpt, port) for port in ports}
    port = free_port()
    router = launch("route", "--port", str(port), "--long-threshold", str(LONG_THRESHOLD), "--long-budget", "1",
                    "--api-key", KEY, *(f"--replica={url}" for url in replicas))
    try:
        for url, process in replicas.items():
            wait_until(lambda url=url: answers(url), process)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: all(in_ring(url).values()), router)
        yield url, replicas
    finally:
        stop(router, *replicas.values())


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat(api: openai.OpenAI, messages: list[dict], max_tokens: int = 3) -> tuple[int, str]:
    """(the index of the replica that answered, the reply)."""
    raw = api.chat.completions.with_raw_response.create(model="k3-tiny", messages=messages, max_tokens=max_tokens,
                                                        temperature=0, extra_body={"ignore_eos": True})
    return int(raw.headers["x-k3-replica"]), raw.parse().choices[0].message.content


def raw_request(url: str, line: bytes) -> bytes:
    """The whole answer to ``line`` (``METHOD TARGET``, sent as it is over a socket, with the key)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(line + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nConnection: close\r\n\r\n")
        return b"".join(iter(lambda: sock.recv(65536), b""))


def test_port_0_prints_the_port_the_router_listens_on():
    """``k3 route --port 0`` printed ``http://127.0.0.1:0/v1``: now the free port chosen, which then answers."""
    router = launch("route", "--port", "0", "--replica", "http://127.0.0.1:1", output=subprocess.PIPE)
    try:
        line = router.stdout.readline().decode()
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert port > 0 and line.startswith("k3 route: 1 replicas behind"), line
        assert httpx.get(f"http://127.0.0.1:{port}/router/status", timeout=10).status_code == 200
    finally:
        stop(router)
        router.stdout.close()


def test_router_status_needs_the_key_and_names_no_replica_url(fleet):
    url, replicas = fleet
    refused = httpx.get(url + "/router/status", timeout=5)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/router/status", headers={"authorization": "Bearer wrong"}, timeout=5).status_code == 401
    answer = httpx.get(url + "/router/status", headers={"authorization": f"Bearer {KEY}"}, timeout=5)
    assert answer.status_code == 200 and [r["index"] for r in answer.json()["replicas"]] == [0, 1, 2]
    assert not any(replica.partition("//")[2] in answer.text for replica in replicas)  # no host:port
    assert "http" not in answer.text
    relayed = httpx.get(url + "/health", timeout=5)  # open, as a replica's own; names its replica by index only
    assert relayed.status_code == 200 and relayed.headers["x-k3-replica"] in {"0", "1", "2"}


def test_a_conversation_stays_on_its_replica_and_conversations_spread(fleet):
    url, replicas = fleet
    api = client(url)
    before = status(url)
    homes = []
    for i in range(12):
        messages = [{"role": "system", "content": "be brief"}] if i % 2 else []
        messages.append({"role": "user", "content": f"conversation {i}: hello"})
        seen = set()
        for turn in range(3):
            replica_url, reply = chat(api, messages)
            seen.add(replica_url)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"turn {turn}"}]
        assert len(seen) == 1, seen  # every turn, with its growing history, on the same replica
        homes.append(seen.pop())
    assert set(homes) <= set(range(len(replicas))) and len(set(homes)) >= 2, homes
    after = status(url)
    primary = {r["index"]: r["primary"] for r in after["replicas"]}
    assert sum(primary.values()) - sum(r["primary"] for r in before["replicas"]) == 36
    assert all(r["primary"] == r["served"] for r in after["replicas"]) and after["retries"] == 0


def test_streams_pass_through_and_client_errors_are_not_retried(fleet):
    url, _ = fleet
    api = client(url)
    request = dict(model="k3-tiny", prompt="def load(path):", max_tokens=12, temperature=0,
                   extra_body={"ignore_eos": True})
    whole = api.completions.with_raw_response.create(**request)
    raw = api.completions.with_raw_response.create(**request, stream=True)
    assert raw.headers["x-k3-replica"] == whole.headers["x-k3-replica"]
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    assert "".join(c.choices[0].text for c in chunks) == whole.parse().choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert api.models.list().data[0].id == "k3-tiny"
    before = status(url)["retries"]
    with pytest.raises(openai.AuthenticationError):  # the replica's 401, relayed as it is
        client(url, key="wrong").completions.create(**request)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(**{**request, "max_tokens": 1000})  # over the replicas' context: their 400
    deep = httpx.post(url + "/v1/completions", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                      headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"}, timeout=30)
    assert deep.status_code == 400 and "not valid JSON" in deep.json()["error"]["message"]  # the router's was a 500
    # a target past httpx's URL limit was a 500; "@evil.example/…" was relayed to http://127.0.0.1:PORT@evil.example
    for target, code in ((b"/v1/models?" + b"a" * 70_000, 414), (b"@evil.example/v1/models", 400), (b"*", 400)):
        answer = raw_request(url, b"OPTIONS " + target)
        assert answer.startswith(b"HTTP/1.1 %d " % code) and b'"invalid_url"' in answer, answer[:300]
    assert status(url)["retries"] == before


def test_a_long_request_budget_refuses_the_next_long_one_but_not_short_ones(fleet):
    url, _ = fleet
    api = client(url)
    long = {"model": "k3-tiny", "prompt": [65] * 80, "max_tokens": 5, "temperature": 0}
    assert len(httpx.Request("POST", "/", json=long).content) > LONG_THRESHOLD
    stream = api.completions.create(**{**long, "max_tokens": 170}, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # admitted and generating
    assert status(url)["budgets"]["long"]["in_use"] == 1
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:
        refused = http.post("/v1/completions", json=long)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "long_budget_exhausted"
        for i in range(3):
            assert chat(api, [{"role": "user", "content": f"short {i}"}])[1]
        stream.close()
        wait_until(lambda: status(url)["budgets"]["long"]["in_use"] == 0)
        assert http.post("/v1/completions", json=long).status_code == 200
    assert status(url)["budgets"]["long"]["refused"] == 1


def test_a_killed_replica_is_failed_over_left_out_and_taken_back(fleet, ckpt):
    """Runs last: it kills one replica of the module's fleet (and restarts it on the same port)."""
    url, replicas = fleet
    api = client(url)
    conversations = [[{"role": "user", "content": f"load {i}"}] for i in range(9)]
    with ThreadPoolExecutor(len(conversations)) as pool:
        running = [pool.submit(chat, api, messages, 150) for messages in conversations]
        victim = None

        def busy() -> bool:
            nonlocal victim
            victim = next((u for u in replicas if httpx.get(u + "/health", timeout=5).json()["running"]), None)
            return victim is not None

        wait_until(busy, timeout=30)
        replicas[victim].send_signal(signal.SIGKILL)
        replicas[victim].wait()
        results = [future.result() for future in running]  # in flight on the victim: retried on secondaries
    assert all(reply for _, reply in results)
    assert status(url)["retries"] >= 1
    index = list(replicas).index(victim)
    wait_until(lambda: not in_ring(url)[index], timeout=10)
    for messages in conversations:
        assert chat(api, messages)[0] != index
    replicas[victim] = replica(ckpt, int(victim.rsplit(":", 1)[1]))
    wait_until(lambda: in_ring(url)[index], replicas[victim], timeout=60)  # two good checks put it back
    assert index in {chat(api, messages)[0] for messages in conversations}


def replica_process(parent: int, port: int) -> int | None:
    """The pid of ``parent``'s live child serving on ``port``, if any."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == parent and state != "Z" and b"--port" in cmdline and \
                cmdline[cmdline.index(b"--port") + 1] == str(port).encode():
            return int(pid)
    return None


def test_k3_serve_replicas_runs_a_fleet_restarts_a_dead_replica_and_stops_it(ckpt, tmp_path):
    port = free_port(3)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "fleet.log"
    with log.open("w") as output:
        fleet = launch("serve", "--ckpt", str(ckpt), "--port", str(port), "--replicas", "2", "--api-key", KEY,
                       "--max-model-len", "256", output=output)
    try:
        wait_until(lambda: all(in_ring(url).values()), fleet, log=log)
        assert sorted(in_ring(url)) == [0, 1]
        assert chat(client(url), [{"role": "user", "content": "hi"}])[0] in in_ring(url)
        dead = replica_process(fleet.pid, port + 1)
        os.kill(dead, signal.SIGKILL)  # replica 0 dies: the launcher starts it again on its port
        wait_until(lambda: replica_process(fleet.pid, port + 1) not in (None, dead), fleet, timeout=30, log=log)
        wait_until(lambda: answers(f"http://127.0.0.1:{port + 1}"), fleet, log=log)
        wait_until(lambda: all(in_ring(url).values()), fleet, log=log)  # and the router takes it back
        assert f"replica 0 (port {port + 1}) exited with code -9; restarting it in" in log.read_text()
        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout=60) == 0
        for p in (port, port + 1, port + 2):  # the router and both replicas are gone
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", p), timeout=2).close()
    finally:
        stop(fleet)
