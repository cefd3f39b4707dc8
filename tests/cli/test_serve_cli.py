"""`k3 serve` (a real subprocess on a free loopback port) and `k3 chat` (stdin/stdout)."""

from __future__ import annotations

import base64
import http.client
import io
import json
import signal
import socket
import subprocess
import sys

import openai
import pytest
import torch
from PIL import Image

import serving
from processes import rss_mib, start_server
from k3.cli import main
from k3.model.checkpoint import load_model, save_model
from k3.serve.options import load, placement


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


def test_sigterm_ends_a_stream_left_at_the_drain_deadline_with_an_error_event(ckpt):
    """A stream still running when the drain period ends gets an ``event: error`` (OpenAI's error body) and
    ``data: [DONE]`` before its connection closes; the process exits 0."""
    proc, port = start_server(ckpt, "--drain-timeout", "0.5")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": "k3-tiny", "prompt": "x = 1", "max_tokens": 4000, "temperature": 0, "stream": True,
                "ignore_eos": True}  # minutes of generation here
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"authorization": "Bearer k", "content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        assert response.readline().startswith(b"data: {")  # generating
        proc.send_signal(signal.SIGTERM)
        rest = response.read().decode()  # to the end of the response: the server ends it
        events = [event.strip() for event in rest.split("\n\n") if event.strip()]
        assert events[-2].startswith("event: error\ndata: ") and events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].partition("data: ")[2])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error" and "--drain-timeout" in \
            error["message"], error
        assert all(event.startswith("data: {") for event in events[:-2])  # whole chunks before it
        assert proc.wait(timeout=30) == 0
        assert "Exception in ASGI application" not in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()


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


def test_k3_chat_keeps_the_conversation_past_a_line_that_is_not_unicode(ckpt, monkeypatch, capsys):
    """A line of invalid UTF-8 (surrogate escapes from the terminal's decoding) ended the session with an error and
    the conversation lost; it is now dropped with a note, and the chat goes on."""
    lines = "hello\n\udcff\udcfe garbage\nagain\n/quit\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert main(["chat", "--ckpt", str(ckpt), "--max-tokens", "4", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "(not sent: " in out and "not valid Unicode" in out
    assert out.count("[reasoning]") == 2  # "hello" and "again" answered


def test_k3_chat_refuses_bad_sampling_settings_before_reading_the_checkpoint(tmp_path, capsys):
    assert main(["chat", "--ckpt", str(tmp_path / "missing"), "--temperature", "nan"]) == 2
    err = capsys.readouterr().err
    assert "temperature: expected a number in [0, 100], got nan" in err and "missing" not in err


def test_k3_serve_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["serve", "--ckpt", str(tmp_path)]) == 2
    assert "no checkpoint here" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--max-body-mb", "0"), ("--request-timeout", "-1"),
                                         ("--header-timeout", "nan"), ("--max-choices", "1.5"),
                                         ("--max-connections-per-client", "0"),
                                         ("--max-logprob-entries", "0"), ("--max-images", "1.5"),
                                         ("--max-decoded-image-mb", "-1"), ("--max-image-decodes", "0")])
def test_invalid_limits_are_refused_naming_the_flag(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ckpt", str(tmp_path), flag, value])
    assert exit_.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_the_answer_and_image_limits_reach_the_server(ckpt):
    """``--max-logprob-entries``, ``--max-images`` and ``--max-decoded-image-mb`` are the server's limits: an
    8 × 8 RGB image takes 512 bytes decoded, more than 0.0004 MiB (419 bytes)."""
    proc, port = start_server(ckpt, "--max-logprob-entries", "10", "--max-images", "1", "--max-decoded-image-mb",
                              "0.0004")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="asks for 24 log-probability entries .* at most 10 "):
            client.completions.create(model="k3-tiny", prompt="x = 1", max_tokens=4, logprobs=5)
        for side, count, message in ((4, 2, "more than 1 images"), (8, 1, "takes 512 bytes, more than the 419")):
            png = io.BytesIO()
            Image.new("RGB", (side, side)).save(png, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(model="k3-tiny", max_tokens=1, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}] * count}])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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


@pytest.mark.parametrize("value", ["gpu", "tpu:0", "cuda:x", "cpu:7"] + ([] if torch.cuda.is_available() else ["cuda"]))
@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_a_device_this_machine_lacks_is_refused_naming_the_flag(tmp_path, capsys, command, value):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--ckpt", str(tmp_path), "--device", value])
    assert exit_.value.code == 2 and "argument --device" in capsys.readouterr().err


def test_placement_defaults_to_the_cuda_device_in_bf16_and_the_cpu_in_fp32():
    device, dtype = placement()
    if torch.cuda.is_available():
        assert (device.type, dtype) == ("cuda", torch.bfloat16)
    else:
        assert (device.type, dtype) == ("cpu", torch.float32)
    assert placement("cpu") == (torch.device("cpu"), torch.float32)
    assert placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


def test_generate_in_bf16_loads_the_model_in_bf16_with_fp32_routers(ckpt, capsys):
    model, _ = load(str(ckpt), device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    routers = [m.weight.dtype for m in model.modules() if type(m).__name__ == "Router"]
    assert routers and set(routers) == {torch.float32}
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "def", "--max-tokens", "5", "--seed", "0",
                 "--dtype", "bfloat16", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a lent GPU machine)")
def test_generate_runs_on_cuda_by_default(ckpt, capsys):
    model, _ = load(str(ckpt))
    assert (model.device.type, model.dtype) == ("cuda", torch.bfloat16)
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "def", "--max-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_generate_stops_at_the_end_of_text_unless_told_to_ignore_it(ckpt, capsys, monkeypatch):
    """``k3 generate`` ends at the tokenizer's end-of-text id; ``--ignore-eos`` decodes past it, exactly
    ``--max-tokens`` tokens (as the API's ``ignore_eos``, and llama.cpp's ``--ignore-eos``)."""
    import k3.generation

    seen: list[tuple] = []
    real = k3.generation.stream

    def recording(*args, **kwargs):
        seen.append(kwargs["stop_ids"])
        return real(*args, **kwargs)

    monkeypatch.setattr(k3.generation, "stream", recording)
    eos = serving.tokenizer().eos_id
    for flags in ([], ["--ignore-eos"]):
        assert main(["generate", "--ckpt", str(ckpt), "--prompt", "def", "--max-tokens", "3", "--temperature", "0",
                     "--device", "cpu", *flags]) == 0
        assert capsys.readouterr().out.startswith("def")
    assert seen == [(eos,), ()]
