"""`k3 serve` (a real subprocess on a free loopback port) and `k3 chat` (stdin/stdout)."""

from __future__ import annotations

import http.client
import io
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import serving
from http_api import start_server
from k3.cli import main
from k3.model.checkpoint import load_model, save_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "k3-tiny"
    return save_model(path, serving.model(), serving.tokenizer())


def test_save_model_round_trip(ckpt):
    model, tok = load_model(ckpt)
    reference = serving.model()
    assert tok == serving.tokenizer()
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert a.equal(b), name


def test_k3_serve_subprocess(ckpt):
    proc, port = start_server(ckpt)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert client.models.list().data[0].id == "k3-tiny"
        reply = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens <= 5 and reply.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sigterm_drains_running_requests_then_exits_cleanly(ckpt):
    """SIGTERM: new requests are refused (the listening socket closes; a request on an open connection
    gets 503), running streams finish normally, then the process exits 0."""
    proc, port = start_server(ckpt)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        request = dict(model="k3-tiny", prompt="x = 1", max_tokens=400, temperature=0)
        alone = client.completions.create(**request).choices[0]
        assert alone.finish_reason == "length"  # the greedy continuation of this prompt runs to max_tokens
        chunks = iter(client.completions.create(**request, stream=True))
        first = next(chunks)
        idle = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        idle.connect()  # an open connection with no request yet
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert first.choices[0].text + "".join(c.choices[0].text for c in rest) == alone.text
        assert rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=30) == 0 and "k3 serve: stopped" in proc.stdout.read()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        try:  # the idle connection was closed at the signal, or its request is refused
            idle.request("GET", "/health")
            assert idle.getresponse().status == 503
        except (OSError, http.client.HTTPException):
            pass
    finally:
        proc.kill()
        proc.wait()


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024


def test_huge_bodies_are_refused_cheaply_and_memory_returns(ckpt):
    """A 50 MB body is refused from its Content-Length (413) before it is read; a 15 MB prompt within the
    body limit is refused by the cheap length bound before tokenizing; the process does not keep the memory."""
    proc, port = start_server(ckpt)
    try:
        headers = {"authorization": "Bearer k", "content-type": "application/json"}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        before = rss_mib(proc.pid)
        with socket.create_connection(("127.0.0.1", port)) as s:  # only the head and a little of the body
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\n"
                      b"content-type: application/json\r\ncontent-length: 52428800\r\n\r\n{\"prompt\": \"")
            assert s.recv(100).startswith(b"HTTP/1.1 413")
        prompt = json.dumps({"model": "k3-tiny", "prompt": "x" * (15 * 2**20)})
        for _ in range(3):
            conn.request("POST", "/v1/completions", body=prompt, headers=headers)
            response = conn.getresponse()
            error = json.loads(response.read())["error"]
            assert response.status == 400 and error["code"] == "context_length_exceeded", error
            assert "at least" in error["message"]  # the cheap bound, not a full tokenization
        conn.request("GET", "/health")
        assert json.loads(conn.getresponse().read())["status"] == "ok"
        assert rss_mib(proc.pid) < before + 100
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_k3_chat_session(ckpt, monkeypatch, capsys):
    lines = "hello\n/mode instruct\nwhat now?\n/mode loud\n/reset\nagain\n/quit\nnever read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert main(["chat", "--ckpt", str(ckpt), "--max-tokens", "6", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "k3 chat (thinking mode)" in out and "(instruct mode)" in out
    assert "[reasoning]" in out  # thinking mode streams the think channel first
    assert "(unknown mode 'loud'" in out and "(history cleared)" in out


def test_k3_serve_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["serve", "--ckpt", str(tmp_path)]) == 2
    assert "no checkpoint here" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--max-body-mb", "0"), ("--request-timeout", "-1"),
                                         ("--header-timeout", "nan"), ("--max-choices", "1.5")])
def test_invalid_limits_are_refused_naming_the_flag(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ckpt", str(tmp_path), flag, value])
    assert exit_.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


SERVE_WITHOUT_TRAINING = """
import importlib.abc, json, sys, urllib.request

class NoTraining(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "k3.train" or name.startswith("k3.train."):
            raise ImportError(f"{name} is blocked: serving must not need the training package")

sys.meta_path.insert(0, NoTraining())
import k3.cli  # the command's modules import no training module either
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine
from k3.serve.options import load

model, tokenizer = load(sys.argv[1])
engine = Engine(model, tokenizer).start()
with BackgroundServer(create_app(engine, "m")) as server:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
engine.stop()
assert reply["usage"]["completion_tokens"] >= 1, reply
assert not any(m == "k3.train" or m.startswith("k3.train.") for m in sys.modules), sorted(sys.modules)
print("ok")
"""


def test_serving_runs_without_the_training_package(ckpt):
    done = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_TRAINING, str(ckpt)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
