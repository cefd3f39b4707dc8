"""The ``k3`` command: the parser assembled from the command families, each a module with ``add_commands``:

* `k3.cli.info` — ``info``, ``plan``;
* `k3.cli.train` — ``train``, ``convert-ckpt``, ``train-draft``, ``eval``, ``quantize``;
* `k3.cli.serve` — ``generate``, ``serve``, ``chat``, ``route`` (engine flags: `k3.serve.options.EngineOptions`);
* `k3.cli.post` — ``chats``, ``sft``, ``rl``, ``distill``.

A command's ``ValueError`` or ``OSError`` is printed as ``k3 COMMAND: error: ...`` with exit status 2."""

from __future__ import annotations

import argparse
import sys

from k3.cli import info, post, serve, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3: model, training and serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    for family in (info, train, serve, post):
        family.add_commands(commands)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # `k3 serve --replicas` passes its flags on
    try:
        return args.run(args)
    except (ValueError, OSError) as err:
        print(f"k3 {args.command}: error: {err}", file=sys.stderr)
        return 2
