"""``k3 info`` (a configuration's audit, SPEC §0) and ``k3 plan`` (the memory to serve it, or with ``--gpus`` to train
it, `k3.dist.plan`)."""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

from k3.config import PRESETS, K3Config, load_config, preset
from k3.serve.options import positive
from k3.sizing.audit import audit, format_audit


def _config(args: argparse.Namespace) -> tuple[K3Config, str]:
    if args.config:
        return load_config(args.config), args.config
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


def _plan(args: argparse.Namespace) -> int:
    """The serving plan, or with ``--gpus`` the training plan (`k3.dist.plan`) of the layout given, or without one
    the layouts that fit, ranked."""
    config, title = _config(args)
    if args.gpus is None:
        given = [flag for flag in ("dp_replicate", "dp_shard", "ep", "cp") if getattr(args, flag) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is a training-plan flag: give --gpus too")
        from k3.sizing.serving import format_plan, plan

        result = plan(config, args.context, args.batch)
        print(json.dumps(result, indent=2) if args.json else format_plan(result, title))
        return 0
    from k3.dist.plan import build_layout, format_layouts, format_training_plan, propose_layouts, training_plan

    if all(getattr(args, flag) is None for flag in ("dp_replicate", "dp_shard", "ep", "cp")):  # propose layouts
        plans = propose_layouts(config, args.gpus, args.seq, args.batch_seqs, args.gpu_memory_gb,
                                recompute=not args.no_recompute, flash=not args.no_flash)
        print(json.dumps(plans, indent=2) if args.json else format_layouts(plans, title))
        return 0
    layout = build_layout(config, args.gpus, args.seq, args.dp_replicate, args.dp_shard, args.ep, args.cp)
    result = training_plan(config, layout, args.seq, args.batch_seqs, args.gpu_memory_gb,
                           recompute=not args.no_recompute, flash=not args.no_flash)
    print(json.dumps(result, indent=2) if args.json else format_training_plan(result, title))
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``info`` and ``plan``."""
    info = commands.add_parser("info", help="audit a configuration: schedule, caches, parameter counts")
    source = info.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=PRESETS, default="paper")
    source.add_argument("--config", help="a kimi-k3 JSON config or a Hugging Face config.json")
    info.add_argument("--json", action="store_true", help="print the audit as JSON")
    info.set_defaults(run=_info)

    pl = commands.add_parser("plan", help="memory to serve a configuration on one machine (packed, mmap'd experts); "
                             "with --gpus, per-rank memory and communication of training it")
    source = pl.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=PRESETS, default="paper")
    source.add_argument("--config", help="a kimi-k3 JSON config or a Hugging Face / released config.json")
    pl.add_argument("--context", type=positive(int), default=131072, help="tokens per sequence (default 131072)")
    pl.add_argument("--batch", type=positive(int), default=1, help="sequences served at once")
    pl.add_argument("--json", action="store_true")
    train_plan = pl.add_argument_group("training plan (k3.dist.plan)")
    train_plan.add_argument("--gpus", type=positive(int), help="world size: plan training on this many GPUs")
    train_plan.add_argument("--gpu-memory-gb", type=positive(float), default=80.0,
                            help="memory per GPU in GiB; a plan that does not fit is refused (default %(default)s)")
    for flag, help_ in (("--dp-replicate", "model replicas (HSDP outer dimension; default 1)"),
                        ("--dp-shard", "FSDP shards (default: what the other factors leave of --gpus; with no layout "
                                       "flag at all, every layout that fits is listed, least communication first)"),
                        ("--ep", "expert-parallel ranks (default 1)"), ("--cp", "context-parallel ranks (default 1)")):
        train_plan.add_argument(flag, type=positive(int), help=help_)
    train_plan.add_argument("--seq", type=positive(int), default=65536, help="tokens per sequence (default 65536)")
    train_plan.add_argument("--batch-seqs", type=positive(int), default=1,
                            help="sequences per data rank per step (default 1)")
    train_plan.add_argument("--no-recompute", action="store_true", help="keep every layer's activations")
    train_plan.add_argument("--no-flash", action="store_true", help="MLA materialises its attention scores")
    pl.set_defaults(run=_plan)
