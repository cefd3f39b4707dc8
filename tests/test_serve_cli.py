"""`k3 serve` (a real subprocess on a free loopback port) and `k3 chat` (stdin/stdout)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time

import openai
import pytest

import serving
from k3.cli import main
from k3.train.checkpoint import load_model, save_model


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_k3_serve_subprocess(ckpt):
    port = free_port()
    command = [sys.executable, "-m", "k3.cli", "serve", "--ckpt", str(ckpt), "--port", str(port), "--api-key", "k"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert "model 'k3-tiny'" in proc.stdout.readline()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        deadline = time.monotonic() + 60
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert models.data[0].id == "k3-tiny"
        reply = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens <= 5 and reply.choices[0].finish_reason in ("length", "stop")
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
