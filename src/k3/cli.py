"""The ``k3`` command."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

from k3.audit import audit, format_audit
from k3.config import PRESETS, K3Config, preset


def _config(args: argparse.Namespace) -> tuple[K3Config, str]:
    if args.config:
        return K3Config.load(args.config), args.config
    return preset(args.preset), f"preset {args.preset!r}"


def _info(args: argparse.Namespace) -> int:
    config, title = _config(args)
    result = audit(config)
    if args.json:
        def encode(x: object) -> object:
            if isinstance(x, Fraction):
                return [x.numerator, x.denominator]
            raise TypeError(type(x).__name__)

        print(json.dumps(result, default=encode, indent=2))
    else:
        print(format_audit(result, title))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3: model, training and serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="audit a configuration: schedule, caches, parameter counts")
    source = info.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=PRESETS, default="paper")
    source.add_argument("--config", help="a kimi-k3 JSON config or a Hugging Face config.json")
    info.add_argument("--json", action="store_true", help="print the audit as JSON")
    info.set_defaults(run=_info)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:
        print(f"k3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
