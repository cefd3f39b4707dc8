"""A real `k3 serve` process for the tests (on a free loopback port, API key "k"), and its memory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from gloo import free_port


def start_server(ckpt, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """A real `k3 serve` process (API key "k") on a free port, once it answers; ``env`` adds to the environment."""
    port = free_port()
    command = [sys.executable, "-m", "k3.cli", "serve", "--ckpt", str(ckpt), "--port", str(port), "--api-key", "k",
               *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    assert "model 'k3-tiny'" in proc.stdout.readline()
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid`` now, in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024
