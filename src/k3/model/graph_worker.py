"""Precompiled graphs built by a process of their own (issue 37), so a server's compilation never shares its
interpreter lock.

A thread compiling beside the steps (`k3.model.background`) can only run while the server is idle, ~2.5× slower
under its trace hook: with a client pausing 1 s between 64-token requests it built 2 of a server's 8 graphs in 15
minutes. A precompiled graph's weights are inputs (`k3.model.precompiled`), so another process can build it from a
model of the same *layout* — any weights: `GraphWorker` sends the process the model's structure with every
parameter and buffer on ``meta`` (a few kilobytes, `layout_copy`); the process gives it zeroed memory, checks that
its `layout_digest` is the server's (else it builds nothing: its files would lie where the server never looks),
compiles each family at the lowest CPU priority (`NICE`: it takes what the server leaves) and saves it to the graph
directory, naming each family on its standard output as it is saved. The server's thread then only loads the file.
The process ends with its parent: it exits when its standard input (a pipe from the server) reaches end of file.

The process holds the model's size in zeroed memory while it runs (packed experts' bytes once, as the server does):
`start` refuses (`MemoryError`; the server's thread compiles then) where that is more than half the memory the
machine has available.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import threading

import torch
from torch import nn

from k3.model.packed import STACKED, PackedExperts
from k3.sizing.memory import available_bytes

__all__ = ["GraphWorker", "NICE", "layout_bytes", "layout_copy", "restore"]

NICE = 19  # the graph process's niceness: a busy server's steps keep the CPU


def layout_copy(model: nn.Module) -> bytes:
    """``model`` pickled with every parameter and buffer on ``meta`` (shapes, dtypes, strides, classes; no data)."""
    memo: dict[int, object] = {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    memo.update({id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                 for p in model.parameters()})
    return pickle.dumps(copy.deepcopy(model, memo))


def layout_bytes(model: nn.Module) -> int:
    """The bytes `restore` gives ``model``'s `layout_copy`: every parameter and buffer apart, but packed experts' own
    tensors, which are views of their stacked bytes there as here."""
    stacked = {id(getattr(m, name)) for m in model.modules()
               if isinstance(m, PackedExperts) and hasattr(m, STACKED[0]) for name in STACKED}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]
               if t._base is None or id(t._base) not in stacked}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def restore(data: bytes, device: str) -> nn.Module:
    """A `layout_copy` as a model on ``device``, every parameter and buffer zero (finite: a step on it computes).
    ``to_empty`` gives every tensor memory of its own; packed experts' tensors are made views of their stacked
    bytes again (`PackedExperts.restack`) before any page is written, so the bytes are held once, as in ``model``."""
    model = pickle.loads(data)  # the server's own bytes, over a pipe from the server to its own child
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, PackedExperts):
            module.restack()
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.zero_()
    return model


class GraphWorker:
    """The process building precompiled graphs for a server (``python -m k3.model.graph_process``): `start` it
    with the families in order, `wait_for` each before loading its file, `stop` it."""

    def __init__(self, process: subprocess.Popen, families: list[tuple]) -> None:
        self.process, self.families = process, families
        self.failure: str | None = None  # why it ended before building every family

    @classmethod
    def start(cls, model: nn.Module, digest: str, families: list[tuple]) -> GraphWorker:
        """Start the process on a `layout_copy` of ``model`` (on the CPU; its thread count, this one's) to build
        ``families`` in order. Raises where the model cannot be copied (pickled), its copy would take more than half
        the memory available (`MemoryError`) or the process cannot start."""
        need, free = layout_bytes(model), available_bytes(torch.device("cpu"))
        if free is not None and 2 * need > free:
            raise MemoryError(f"the graph process would hold {need:,} bytes of zeroed weights, more than half of the "
                              f"{free:,} bytes available")
        header = {"digest": digest, "families": [list(f) for f in families], "threads": torch.get_num_threads(),
                  "device": model.device.type}
        data = layout_copy(model)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the model's classes import
        process = subprocess.Popen([sys.executable, "-m", "k3.model.graph_process"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env)
        try:
            process.stdin.write(json.dumps({**header, "bytes": len(data)}).encode() + b"\n" + data)
            process.stdin.flush()
        except OSError:
            process.kill()
            process.wait()
            raise
        return cls(process, families)

    def wait_for(self, family: tuple) -> bool:
        """Block until the process has saved ``family``'s graph (True), or has ended without it (False, `failure`
        says why). Families come in the order `start` gave them."""
        if self.failure is None:
            line = self.process.stdout.readline()
            if line == json.dumps(list(family)).encode() + b"\n":  # as the process writes it
                return True
            self.stop()
            code = self.process.returncode
            self.failure = f"the graph process ended (exit status {code}) before building {family}" if not line \
                else f"the graph process built {line.decode().strip()} where {family} was due"
        return False

    def stop(self) -> None:
        """End the process (closing its standard input ends it; killed if it lingers), reap it, close its pipes."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


def exit_with_parent() -> None:
    """In the graph process: exit as soon as standard input (the server's pipe) ends — the server stopped or died."""
    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=watch, name="k3-parent", daemon=True).start()
