"""The graph process of `k3.model.graph_worker` (``python -m k3.model.graph_process``, started by `GraphWorker`):
read the header line and the `layout_copy` from standard input, build each family's precompiled graph in order
(`CompiledModel.precompile`) and name it on standard output once saved; exit when standard input ends."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import TextIO

import torch

from k3.model.compiled import CompiledModel
from k3.model.graph_worker import NICE, exit_with_parent, restore
from k3.model.precompiled import layout_digest

__all__ = ["main"]


def main(channel: TextIO) -> int:
    """Build what standard input asks for, naming each family on ``channel``; the exit status (3: another layout).
    ``channel`` must stay open until the process exits: the server reads its end of file as the process's end."""
    header = json.loads(sys.stdin.buffer.readline())
    data = sys.stdin.buffer.read(header["bytes"])
    exit_with_parent()
    os.nice(NICE)
    torch.set_num_threads(header["threads"])  # part of every graph's key
    model = restore(data, header["device"])
    if layout_digest(model) != header["digest"]:
        print("k3 graph process: the model's copy has another layout digest than the server's model; no graph is "
              "built here", file=sys.stderr, flush=True)
        return 3

    def built(family: tuple) -> None:
        print(json.dumps(list(family)), file=channel, flush=True)

    CompiledModel(model).precompile([tuple(f) for f in header["families"]], built)
    return 0


if __name__ == "__main__":
    # The server reads only the families named on this private copy of standard output; whatever else writes there
    # (a library's print) goes to standard error. It stays open until `os._exit`, so the server never sees its end
    # of file (and closes this process's standard input, `exit_with_parent`: exit status 0) before the exit status
    # is set.
    CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        code = main(CHANNEL)
    except BaseException:  # noqa: BLE001 - reported as exit status 1, not as the parent's end of file (status 0)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # without waiting on the compiler's worker pool to wind down
