"""The ``k3`` command."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from k3.cli import post as cli_post
from k3.sizing.audit import audit, format_audit
from k3.config import PACKED_ACTIVATIONS, PRESETS, K3Config, load_config, preset


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
    """The serving plan, or with ``--gpus`` the training plan (`k3.dist.plan`)."""
    config, title = _config(args)
    if args.gpus is None:
        given = [flag for flag in ("dp_replicate", "dp_shard", "ep", "cp") if getattr(args, flag) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is a training-plan flag: give --gpus too")
        from k3.sizing.serving import format_plan, plan

        result = plan(config, args.context, args.batch)
        print(json.dumps(result, indent=2) if args.json else format_plan(result, title))
        return 0
    from k3.dist.plan import build_layout, format_training_plan, training_plan

    layout = build_layout(config, args.gpus, args.seq, args.dp_replicate, args.dp_shard, args.ep, args.cp)
    result = training_plan(config, layout, args.seq, args.batch_seqs, args.gpu_memory_gb,
                           recompute=not args.no_recompute, flash=not args.no_flash)
    print(json.dumps(result, indent=2) if args.json else format_training_plan(result, title))
    return 0


def _positive(kind: type, zero: bool = False) -> Callable[[str], int | float]:
    """An argparse type: a positive (or, with ``zero``, non-negative) int or float; errors name the flag."""
    def parse(text: str) -> int | float:
        value = kind(text)
        if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a {'non-negative' if zero else 'positive'} number, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _curriculum(text: str) -> list[list[float]]:
    """``"0:256,0.6:1024"`` → ``[[0.0, 256], [0.6, 1024]]``; ``"paper"`` / ``"paper:BASE"`` → the paper's four
    stages (SPEC §7, `k3.train.loop.paper_curriculum`) with first length 8192 / ``BASE``."""
    name, _, base = text.partition(":")
    if name == "paper":
        from k3.train.pretrain import PAPER_BASE, paper_curriculum

        try:
            return paper_curriculum(int(base) if base else PAPER_BASE)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected paper or paper:BASE (BASE a positive integer, the "
                                             f"first stage's length), got {text!r}") from err
    try:
        return [[float(frac), int(length)] for frac, length in (part.split(":") for part in text.split(","))]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected FRACTION:LENGTH,... or paper[:BASE], got {text!r}") from err


def _train(args: argparse.Namespace) -> int:
    from k3.train.distributed import train_command
    from k3.train.pretrain import TrainConfig
    from k3.train.optim import OptimConfig

    chosen = {"qk_clip": args.qk_clip} if args.qk_clip is not None else {}
    if args.lr is not None:
        chosen.update(lr=args.lr, adam_lr=args.lr)
    optim = OptimConfig(optimizer=args.optimizer, **chosen)
    config = TrainConfig(
        out=args.out, preset=args.preset, steps=args.steps, tokens_per_step=args.tokens_per_step,
        grad_accum=args.grad_accum, curriculum=args.curriculum, bf16=args.bf16, eval_every=args.eval_every,
        ckpt_every=args.ckpt_every, eval_seq_len=args.eval_seq_len, seed=args.seed, data=args.data or [],
        balance=args.balance, max_minutes=args.max_minutes, progress=not args.no_progress, optim=optim,
        threads=args.threads, qat=args.qat, multimodal=args.multimodal,
        data_limit_bytes=None if args.data_limit_mb is None else int(args.data_limit_mb * 2**20),
    )
    run = train_command(config, args.resume, args.argv, args.nproc, args.ep_slots, dp_replicate=args.dp_replicate,
                        dp_shard=args.dp_shard, ep=args.ep, cp=args.cp)
    if isinstance(run, int):  # the launcher (torchrun's status) or a rank other than 0
        return run
    loss = run.last_val_loss if run.last_val_loss is not None else run.evaluate()
    print(f"step {run.step_index}/{config.steps}: validation loss {loss:.4f} (perplexity {math.exp(loss):.2f})")
    print(f"metrics: {run.metrics_path}  plot: {run.out / 'curves.png'}")
    return 0


def _convert_ckpt(args: argparse.Namespace) -> int:
    from k3.train.sharded import convert, is_sharded

    out = convert(Path(args.ckpt), Path(args.out))
    kind = "sharded (torch.distributed.checkpoint)" if is_sharded(out) else "single-process"
    print(f"wrote {out} ({kind})")
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    from k3.train.draft import DraftTrainConfig, expected_accepted, train_draft

    config = DraftTrainConfig(
        ckpt=args.ckpt, out=args.out, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
        lr=args.lr, seed=args.seed, data=args.data or [], layer_kind=args.layer_kind,
        feature_layers=args.feature_layers, draft_vocab=args.draft_vocab, ckpt_every=args.ckpt_every,
        max_minutes=args.max_minutes, threads=args.threads, progress=not args.no_progress,
        data_limit_bytes=None if args.data_limit_mb is None else int(args.data_limit_mb * 2**20),
    )
    run = train_draft(config, resume=args.resume)
    acceptance = run.evaluate()
    print(f"step {run.step_index}/{config.steps}: expected acceptance per draft step (validation): "
          + " ".join(f"{a:.3f}" for a in acceptance))
    print(f"expected accepted tokens per {config.unroll}-token draft: {expected_accepted(acceptance):.2f} "
          f"(plus the target's own token)")
    print(f"draft: {run.out / 'latest'}  metrics: {run.metrics_path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from k3.train.checkpoint import read_train
    from k3.train.pretrain import Run, TrainConfig
    from k3.train.sharded import resolve  # a training checkpoint of either format

    path = resolve(Path(args.ckpt))
    config = TrainConfig.from_dict(read_train(path))
    config.out, config.progress = str(path.parent), False
    if args.data:
        config.data = args.data
    run = Run(config)
    run.prepare_evaluation(path)
    loss = run.evaluate(args.batches)
    print(json.dumps({"checkpoint": str(path), "step": run.step_index, "val_loss": loss, "val_ppl": math.exp(loss)}))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from k3.model.checkpoint import WEIGHTS, resolve
    from k3.model.quantize import quantize_checkpoint

    before = (resolve(Path(args.ckpt)) / WEIGHTS).stat().st_size
    done = quantize_checkpoint(args.ckpt, args.out, args.activations)
    print(f"{done['out']}: routed experts MXFP4-packed, {done['mode']}; expert inputs {done['inputs']}; "
          f"weights {before / 2**20:,.2f} MiB -> {done['bytes'] / 2**20:,.2f} MiB")
    return 0


def _load(path: str):
    """(model, tokenizer) of a released Kimi K3 directory (`K3ForCausalLM.from_pretrained`, its tiktoken
    tokenizer) or of a kimi-k3 checkpoint / run directory."""
    from k3.model.pretrained import is_release_dir

    if is_release_dir(path):
        from k3.model.lm import K3ForCausalLM
        from k3.tokenization.kimi import KimiTokenizer

        return K3ForCausalLM.from_pretrained(path), KimiTokenizer.load(path)
    from k3.model.checkpoint import load_model

    return load_model(Path(path))


def _generate(args: argparse.Namespace) -> int:
    from k3.generation import stream

    model, tokenizer = _load(args.ckpt)
    prompt = tokenizer.encode(args.prompt) or [tokenizer.bos_id]
    compiled = None
    if args.compile:
        from k3.model.compiled import CompiledModel

        compiled = CompiledModel(model)
    print(args.prompt, end="", flush=True)
    ids: list[int] = []
    for token in stream(model, prompt, args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                        stop_ids=(tokenizer.eos_id,), step=compiled):
        ids.append(token)
    print(tokenizer.decode(ids))
    if compiled is not None:
        print(f"k3: {compiled.compilations} compiled graphs, {sum(compiled.compile_seconds.values()):.1f} s of "
              f"first calls", file=sys.stderr)
    return 0


def _engine(args: argparse.Namespace, **options):
    from k3.serve.engine.cache import PrefixCache
    from k3.serve.engine import Engine

    model, tokenizer = _load(args.ckpt)
    cache = None if args.no_prefix_cache else PrefixCache.for_model(
        model, tokenizer, int(args.prefix_cache_gb * 2**30), args.cache_block_tokens, args.cache_checkpoint_every,
        args.cache_page_blocks)
    return Engine(model, tokenizer, max_model_len=args.max_model_len, max_batch=args.max_batch,
                  prefill_chunk=args.prefill_chunk, prefix_cache=cache, drafter=_drafter(args, model),
                  num_draft_tokens=args.num_draft_tokens, compile=args.compile, **options)


def _drafter(args: argparse.Namespace, target):
    """`--draft DIR`: an EAGLE-3 draft (`k3 train-draft`, a run or checkpoint directory) or a small kimi-k3
    checkpoint with the target's vocabulary drafts for speculative decoding."""
    if args.draft is None:
        return None
    from k3.model.draft import EagleDraft
    from k3.serve.engine.drafting import EagleDrafter, ModelDrafter

    path = Path(args.draft)
    if (path / "draft.json").exists() or (path / "latest").exists() and not (path / "model.safetensors").exists() \
            and any(path.glob("step-*/draft.json")):
        return EagleDrafter(EagleDraft.load(path, target))
    draft, _ = _load(args.draft)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"--draft {args.draft}: vocabulary {draft.config.vocab_size} differs from the target's "
                         f"{target.config.vocab_size}")
    return ModelDrafter(draft)


#: ``k3 serve`` flags of `k3.serve.asgi.guard.Limits`: flag, field, type, scale (flag → field), help.
_LIMIT_FLAGS = (
    ("--max-body-mb", "max_body_bytes", float, 2**20, "largest request body in MiB (413 beyond)"),
    ("--max-choices", "max_choices", int, 1, "most generations per request, prompts x n (400 beyond)"),
    ("--max-connections", "max_connections", int, 1, "most open connections and running requests (503 beyond)"),
    ("--header-timeout", "header_timeout", float, 1, "seconds for a client to send a request's headers (the "
     "connection is closed)"),
    ("--body-timeout", "body_timeout", float, 1, "seconds for a request body to arrive (408)"),
    ("--keep-alive-timeout", "keep_alive_timeout", float, 1, "idle seconds before a keep-alive connection is closed"),
    ("--request-timeout", "request_timeout", float, 1, "seconds for a generation to finish (408, the work is "
     "cancelled; 0: no limit)"),
    ("--drain-timeout", "drain_timeout", float, 1, "on SIGTERM, seconds to let running requests finish before "
     "cancelling them"),
)


def _limits(args: argparse.Namespace):
    from k3.serve.asgi.guard import Limits

    defaults = Limits()
    values = {field: type(getattr(defaults, field))(getattr(args, flag[2:].replace("-", "_")) * scale)
              for flag, field, _, scale, _ in _LIMIT_FLAGS}
    return Limits(**{**values, "request_timeout": values["request_timeout"] or None}, public_docs=args.public_docs)


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    from k3.serve.asgi.guard import Limits

    defaults = Limits()
    group = parser.add_argument_group("limits (README, 'Limits')")
    for flag, field, kind, scale, help_ in _LIMIT_FLAGS:
        group.add_argument(flag, type=_positive(kind, zero=field == "request_timeout"),
                           default=kind(getattr(defaults, field) / scale), help=help_)
    group.add_argument("--max-queue", type=_positive(int),
                       help="most generations waiting for a batch slot (default 1024; 429 with Retry-After beyond)")
    group.add_argument("--public-docs", action="store_true", help="serve /docs and /openapi.json without the API key")


def _serve(args: argparse.Namespace) -> int:
    if args.replicas > 1:
        from k3.serve.fleet.launch import run_fleet

        return run_fleet(args.ckpt, args.replicas, args.port, args.argv[1:], host=args.host, limits=_limits(args))
    import torch

    from k3.serve.api.app import create_app
    from k3.serve.asgi.server import Server

    limits = _limits(args)  # invalid limits are refused before the model is loaded
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) - 1))
    engine = _engine(args, **({"max_waiting": args.max_queue} if args.max_queue else {}))
    if engine.compiled is not None:  # every graph built before the first request: none stalls a running batch
        seconds = engine.compiled.warm_up(engine.max_batch, engine.max_model_len)
        print(f"k3 serve: {engine.compiled.compilations} graphs compiled in {seconds:.1f} s (decode batches up to "
              f"{engine.compiled.bucket(engine.max_batch)}, prefill pieces {engine.compiled.sizes}, context "
              f"{engine.max_model_len} tokens)", flush=True)
    engine.start()
    name = args.model_name or Path(args.ckpt).resolve().name
    app = create_app(engine, name, api_key=args.api_key, default_mode=args.mode, limits=limits,
                     separate_reasoning=not args.reasoning_in_content, allowed_origins=args.allowed_origins)
    server = Server(app, host=args.host, port=args.port)
    print(f"k3 serve: model {name!r} at http://{args.host}:{args.port}/v1 (context {engine.max_model_len} tokens)",
          flush=True)
    try:
        server.run()
    finally:
        engine.stop()
    print("k3 serve: stopped", flush=True)
    return 0


def _route(args: argparse.Namespace) -> int:
    from k3.serve.fleet.launch import run_router

    return run_router(args.replica, args.host, args.port, long_threshold=args.long_threshold,
                      short_budget=args.short_budget, long_budget=args.long_budget)


def _chat(args: argparse.Namespace) -> int:
    from k3.chat.native import MODES
    from k3.serve.engine import SamplingParams
    from k3.chat import chat_format

    engine = _engine(args)
    tokenizer = engine.tokenizer
    fmt = chat_format(tokenizer)
    mode, history = args.mode, []
    stops = fmt.stop_ids(tokenizer)
    visuals = _chat_images(args.image, engine, fmt)
    print(f"k3 chat ({mode} mode). Commands: /reset, /mode thinking|instruct, /quit", flush=True)
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            history = []
            print("(history cleared)", flush=True)
            continue
        if line.startswith("/mode"):
            wanted = line.split()[-1]
            if wanted not in MODES:
                print(f"(unknown mode {wanted!r}; choose {' or '.join(MODES)})", flush=True)
            else:
                mode = wanted
                print(f"({mode} mode)", flush=True)
            continue
        images = [{"type": "image_url", "image_url": {"url": path}} for path in args.image] if not history else []
        history.append({"role": "user", "content": [*images, {"type": "text", "text": line}] if images else line})
        prompt = fmt.render(history, tokenizer, mode, **_slots(visuals))  # the images lead the first message
        budget = engine.max_model_len - len(prompt)
        if budget < 1:
            print("(the conversation fills the context; /reset to start over)", flush=True)
            history.pop()
            continue
        params = SamplingParams(max_tokens=min(args.max_tokens, budget), temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, stop_token_ids=stops)
        parts = {"reasoning": "", "content": "", "tools": ""}
        channel = None
        for output in engine.generate(prompt, params, processor=fmt.AssistantParser(tokenizer, mode),
                                      images=visuals or None):
            for ch, text in output.deltas:
                if ch != channel:
                    print(f"\n[{ch}] " if channel else f"[{ch}] ", end="")
                    channel = ch
                print(text, end="", flush=True)
                parts[ch] += text
        print(flush=True)
        history.append({"role": "assistant", "content": parts["content"] + parts["tools"],
                        "reasoning_content": parts["reasoning"]})
    return 0


def _slots(visuals: list) -> dict:
    """``render``'s ``media`` for the ``--image`` parts: the images, in order."""
    images = iter(visuals)
    return {"media": lambda part, where: next(images)} if visuals else {}


def _chat_images(paths: list[str], engine, fmt) -> list:
    """The ``--image`` files as model inputs (a ValueError naming the file if one does not decode)."""
    if not paths:
        return []
    if engine.model.vision is None or not getattr(fmt, "IMAGES", False):
        raise ValueError("--image: this model has no vision encoder, or its chat format has no image slots")
    from k3.tokenization.image import image_input

    out = []
    for path in paths:
        try:
            out.append(image_input(path, engine.model.config.vision.patch_budget))
        except ValueError as err:
            raise ValueError(f"--image {path}: {err}") from err
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3: model, training and serving.")
    commands = parser.add_subparsers(dest="command", required=True)
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
    pl.add_argument("--context", type=_positive(int), default=131072, help="tokens per sequence (default 131072)")
    pl.add_argument("--batch", type=_positive(int), default=1, help="sequences served at once")
    pl.add_argument("--json", action="store_true")
    train_plan = pl.add_argument_group("training plan (k3.dist.plan)")
    train_plan.add_argument("--gpus", type=_positive(int), help="world size: plan training on this many GPUs")
    train_plan.add_argument("--gpu-memory-gb", type=_positive(float), default=80.0,
                            help="memory per GPU in GiB; a plan that does not fit is refused (default %(default)s)")
    for flag, help_ in (("--dp-replicate", "model replicas (HSDP outer dimension; default 1)"),
                        ("--dp-shard", "FSDP shards (default: what the other factors leave of --gpus)"),
                        ("--ep", "expert-parallel ranks (default 1)"), ("--cp", "context-parallel ranks (default 1)")):
        train_plan.add_argument(flag, type=_positive(int), help=help_)
    train_plan.add_argument("--seq", type=_positive(int), default=65536, help="tokens per sequence (default 65536)")
    train_plan.add_argument("--batch-seqs", type=_positive(int), default=1,
                            help="sequences per data rank per step (default 1)")
    train_plan.add_argument("--no-recompute", action="store_true", help="keep every layer's activations")
    train_plan.add_argument("--no-flash", action="store_true", help="MLA materialises its attention scores")
    pl.set_defaults(run=_plan)

    tr = commands.add_parser("train", help="train a K3 model (Per-Head Muon, quantile balancing, curriculum)")
    tr.add_argument("--preset", choices=PRESETS, default="small")
    tr.add_argument("--steps", type=int, default=1000)
    tr.add_argument("--data", nargs="*", help="text files/folders, .jsonl (text field), .parquet; default: the "
                    "Python standard library's source")
    tr.add_argument("--data-limit-mb", type=float, help="use at most this much of the standard-library corpus")
    tr.add_argument("--out", default="runs/k3", help="run directory: checkpoints, metrics.jsonl, curves.png")
    tr.add_argument("--resume", action="store_true", help="continue the run in --out if it has a checkpoint")
    tr.add_argument("--tokens-per-step", type=int, default=4096)
    tr.add_argument("--grad-accum", type=int, default=1)
    tr.add_argument("--curriculum", type=_curriculum, default="paper:32",
                    help="FRACTION:LENGTH stages, e.g. 0:256,0.6:1024,0.9:4096, or paper:BASE, the paper's "
                         "8K→64K→256K→1M shape from length BASE (stages at 0, 0.5, 0.9, 0.97 of the steps; "
                         "plain 'paper' is BASE 8192) (default: %(default)s)")
    tr.add_argument("--lr", type=float)
    tr.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    tr.add_argument("--qk-clip", type=_positive(float, zero=True),
                    help="QK-clip threshold tau for MLA heads (default: Kimi K2's 100; 0 disables)")
    tr.add_argument("--balance", choices=("exact", "histogram", "bias-step", "none"), default="exact")
    tr.add_argument("--bf16", action="store_true", help="bf16 autocast")
    tr.add_argument("--multimodal", action="store_true", help="add generated image-text examples (shapes, "
                    "rendered text, plots, moving-shape videos) to every step, from step 0")
    tr.add_argument("--qat", choices=("mx",), help="quantization-aware training: routed experts on MXFP4 weights "
                    "and MXFP8 E4M3 inputs (fake-quantized, straight-through); may start on a full-precision run "
                    "with --resume")
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--eval-seq-len", type=_positive(int), default=256,
                    help="validation window length (the same at every evaluation, whatever the curriculum)")
    tr.add_argument("--ckpt-every", type=int, default=50)
    tr.add_argument("--threads", type=_positive(int), help="torch threads (default: the cores other processes leave "
                    "free, re-measured every few seconds)")
    tr.add_argument("--max-minutes", type=float, help="stop after this much wall time (a checkpoint is written)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--no-progress", action="store_true")
    parallel = tr.add_argument_group("parallelism", "run on N local processes (or under torchrun, which sets the world "
                                     "size); the factors' product is the world size")
    parallel.add_argument("--nproc", type=_positive(int), help="processes to start on this machine (torchrun "
                          "--standalone); 1 or absent: this process alone, with no distributed call")
    parallel.add_argument("--dp-shard", type=_positive(int), help="FSDP2 shards (default: what the other factors "
                          "leave)")
    parallel.add_argument("--dp-replicate", type=_positive(int), help="model replicas, HSDP (default 1)")
    parallel.add_argument("--ep", type=_positive(int), help="expert-parallel ranks: the routed experts split "
                          "over them (default 1)")
    parallel.add_argument("--cp", type=_positive(int), help="context-parallel ranks: each sequence cut into this "
                          "many contiguous segments (default 1)")
    parallel.add_argument("--ep-slots", type=_positive(int, zero=True), help="MoonEP: redundant expert slots per "
                          "expert-parallel rank for copies of hot experts, at most E/ep (default E/ep: every rank "
                          "processes exactly S×K assignments); 0: plain expert parallelism")
    tr.set_defaults(run=_train)

    cc = commands.add_parser("convert-ckpt", help="a training checkpoint in the other format: single-process files "
                             "<-> sharded torch.distributed.checkpoint (any number of processes loads the latter)")
    cc.add_argument("--ckpt", required=True, help="a training checkpoint directory, or a run directory (its newest)")
    cc.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")
    cc.set_defaults(run=_convert_ckpt)

    td = commands.add_parser("train-draft", help="train an EAGLE-3 draft for speculative decoding on a frozen target")
    td.add_argument("--ckpt", required=True, help="the target: a run directory or a checkpoint directory")
    td.add_argument("--out", required=True, help="run directory: draft checkpoints and metrics.jsonl")
    td.add_argument("--resume", action="store_true", help="continue the run in --out if it has a checkpoint")
    td.add_argument("--steps", type=_positive(int), default=1000)
    td.add_argument("--seq-len", type=_positive(int), default=128, help="tokens per training window")
    td.add_argument("--batch-size", type=_positive(int), default=8)
    td.add_argument("--lr", type=_positive(float), default=1e-3, help="AdamW peak learning rate (cosine decay)")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--data", nargs="*", help="text files/folders, .jsonl, .parquet; default: the Python standard "
                    "library's source (as k3 train)")
    td.add_argument("--data-limit-mb", type=float, help="use at most this much of the standard-library corpus")
    td.add_argument("--layer-kind", choices=("mla", "kda"), default="mla", help="the draft's sequence mixer")
    td.add_argument("--feature-layers", type=int, nargs=3, metavar=("LOW", "MID", "HIGH"),
                    help="0-based target layers whose retrieved inputs are fused (default: 2, L//2, L-3)")
    td.add_argument("--draft-vocab", type=_positive(int), help="reduced draft vocabulary: the corpus's most "
                    "frequent target tokens (default: the target's whole vocabulary)")
    td.add_argument("--ckpt-every", type=_positive(int), default=100)
    td.add_argument("--max-minutes", type=_positive(float, zero=True),
                    help="stop after this much wall time (with a checkpoint)")
    td.add_argument("--threads", type=_positive(int), help="torch threads (default: torch's)")
    td.add_argument("--no-progress", action="store_true")
    td.set_defaults(run=_train_draft)

    ev = commands.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    ev.add_argument("--ckpt", required=True, help="a run directory or a checkpoint directory")
    ev.add_argument("--data", nargs="*")
    ev.add_argument("--batches", type=int)
    ev.set_defaults(run=_eval)

    qz = commands.add_parser("quantize", help="pack a checkpoint's routed experts as MXFP4 (the release's layout)")
    qz.add_argument("--ckpt", required=True, help="a run or checkpoint directory")
    qz.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")
    qz.add_argument("--activations", choices=PACKED_ACTIVATIONS, default="keep",
                    help="expert inputs: keep (the checkpoint's MX inputs if trained with --qat, else none, as "
                         "the release), none, or an MXFP8 format (default: %(default)s)")
    qz.set_defaults(run=_quantize)

    gen = commands.add_parser("generate", help="continue a prompt with a trained checkpoint")
    gen.add_argument("--ckpt", required=True, help="a run, checkpoint or released Kimi K3 directory")
    gen.add_argument("--prompt", default="")
    gen.add_argument("--max-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--compile", action="store_true", help="prefill and decode through torch.compile'd graphs "
                     "(inductor; the prompt in pieces of 64/16/4/1 tokens; ~45 s per new graph, kernels cached on "
                     "disk)")
    gen.set_defaults(run=_generate)
    for name, help_, run in (("serve", "an OpenAI-compatible HTTP server for a checkpoint", _serve),
                             ("chat", "chat with a checkpoint in the terminal", _chat)):
        sub = commands.add_parser(name, help=help_)
        sub.add_argument("--ckpt", required=True, help="a run directory, a checkpoint directory, or a released "
                         "Kimi K3 directory (config.json with model_type kimi_k3, shards, tiktoken tokenizer)")
        sub.add_argument("--mode", choices=("thinking", "instruct"),
                         default="instruct" if name == "serve" else "thinking",
                         help="the chat mode when a request does not choose one (default: %(default)s)")
        sub.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
        sub.add_argument("--max-batch", type=int, default=32, help="most requests decoded together")
        sub.add_argument("--prefill-chunk", type=int, default=64,
                         help="prompt tokens prefilled per step while other requests decode (their latency vs "
                              "the new prompt's time to first token)")
        sub.add_argument("--draft", help="speculative decoding: an EAGLE-3 draft (k3 train-draft) or a small "
                         "checkpoint with the same vocabulary")
        sub.add_argument("--num-draft-tokens", type=_positive(int), default=4,
                         help="tokens drafted per step with --draft (default %(default)s)")
        sub.add_argument("--compile", action="store_true", help="decode and prefill-chunk steps through "
                         "torch.compile'd graphs: decode batches padded to 1, 2, 4 … 32 rows, chunks cut into "
                         "64/16/4/1-token pieces (one compilation each: k3 serve builds them all before it listens, "
                         "for batches up to --max-batch; k3 chat on first use)")
        cache = sub.add_argument_group("prefix cache (README, 'Prefix cache')")
        cache.add_argument("--prefix-cache-gb", type=_positive(float, zero=True), default=1.0,
                           help="bytes for cached MLA pages and KDA checkpoints, in GiB (default: %(default)s)")
        cache.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt")
        cache.add_argument("--cache-block-tokens", type=_positive(int), default=64,
                           help="tokens per hash block (the paper's 512; default %(default)s for small models)")
        cache.add_argument("--cache-checkpoint-every", type=_positive(int), default=8,
                           help="KDA checkpoint every N hash blocks of a long prompt (default %(default)s)")
        cache.add_argument("--cache-page-blocks", type=_positive(int), default=4,
                           help="hash blocks per physical MLA page, the unit of allocation (default %(default)s)")
        sub.set_defaults(run=run)
        if name == "serve":
            sub.add_argument("--host", default="127.0.0.1")
            sub.add_argument("--port", type=int, default=8000)
            sub.add_argument("--replicas", type=_positive(int), default=1,
                             help="engine processes behind a cache-aware router (k3 route): replicas on ports "
                                  "PORT+1..PORT+N, the router on --port (default: %(default)s, no router)")
            sub.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
            sub.add_argument("--model-name", help="the served model id (default: the checkpoint directory name)")
            sub.add_argument("--threads", type=int, help="torch intra-op threads (default: all cores but one, which "
                             "is left to the HTTP server)")
            sub.add_argument("--reasoning-in-content", action="store_true",
                             help="put the thinking into 'content' as <think>...</think> unless a request asks "
                                  "'separate_reasoning: true' (default: 'reasoning_content', as vLLM and DeepSeek)")
            sub.add_argument("--allowed-origins", type=lambda text: [o.strip() for o in text.split(",") if o.strip()],
                             default=[], help="comma-separated origins allowed by CORS, or '*' (default: none)")
            _limit_flags(sub)
        else:
            sub.add_argument("--max-tokens", type=int, default=256)
            sub.add_argument("--temperature", type=float, default=0.7)
            sub.add_argument("--top-p", type=float, default=0.95)
            sub.add_argument("--seed", type=int)
            sub.add_argument("--image", action="append", default=[], metavar="PATH",
                             help="an image (PNG, JPEG, WebP, ...) shown with the first message (repeatable)")

    ro = commands.add_parser("route", help="a cache-aware router in front of running `k3 serve` replicas")
    ro.add_argument("--replica", action="append", required=True, metavar="URL",
                    help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat the flag for each)")
    ro.add_argument("--host", default="127.0.0.1")
    ro.add_argument("--port", type=int, default=8000)
    ro.add_argument("--long-threshold", type=_positive(int), default=32768,
                    help="body bytes beyond which a request is 'long' (default: %(default)s)")
    ro.add_argument("--short-budget", type=_positive(int), default=64,
                    help="short requests relayed at once (429 beyond; default: %(default)s)")
    ro.add_argument("--long-budget", type=_positive(int), default=4,
                    help="long requests relayed at once (429 beyond; default: %(default)s)")
    ro.set_defaults(run=_route)
    cli_post.add_commands(commands, _positive)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # `k3 serve --replicas` passes its flags on
    try:
        return args.run(args)
    except (ValueError, OSError) as err:
        print(f"k3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
