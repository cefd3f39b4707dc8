"""The training commands of ``k3``: ``k3 train`` (SPEC §7), ``k3 eval``, ``k3 convert-ckpt``, ``k3 train-draft``
(an EAGLE-3 draft), ``k3 quantize`` (the release's MXFP4 experts) and ``k3 export`` (the release layout with a Hugging
Face tokenizer, `k3.interop.export`). The training package is imported only when a command runs: ``k3 serve``
never loads it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from k3.config import PACKED_ACTIVATIONS, PRESETS
from k3.serve.options import SEED, THREADS, positive


def _curriculum(text: str) -> list[list[float]]:
    """``"0:256,0.6:1024"`` → ``[[0.0, 256], [0.6, 1024]]``; ``"paper"`` / ``"paper:BASE"`` → the paper's four
    stages (SPEC §7, `k3.train.pretrain.paper_curriculum`) with first length 8192 / ``BASE``."""
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
    validation = run.last_validation or run.evaluate()
    a = validation.anchors
    print(f"step {run.step_index}/{config.steps}: validation loss {validation.loss:.4f} "
          f"(perplexity {math.exp(validation.loss):.2f})")
    print(f"metrics: {run.metrics_path}  plot: {run.out / 'curves.png'}")
    print(f"validation text: {validation.bits_per_byte:.3f} bits per byte over {validation.bytes:,} bytes; the same "
          f"bytes as one file: zlib -9 {a['zlib_bpb']:.3f}, xz -9e {a['xz_bpb']:.3f}; window by window: zlib -9 "
          f"{a['zlib_window_bpb']:.3f}, xz -9e {a['xz_window_bpb']:.3f}")
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
        lr=args.lr, seed=args.seed, data=args.data or [], layer_kind=args.layer_kind, mask=args.mask,
        feature_layers=args.feature_layers, feature_source=args.feature_source, draft_vocab=args.draft_vocab,
        ckpt_every=args.ckpt_every,
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
    from k3.train.pretrain import Run, TrainConfig, pinned
    from k3.train.sharded import resolve  # a training checkpoint of either format

    path = resolve(Path(args.ckpt))
    config = TrainConfig.from_dict(read_train(path))
    config.out, config.progress = str(path.parent), False
    if args.data:
        config.data = args.data
    run = Run(pinned(config, path))
    run.prepare_evaluation(path)
    validation = run.evaluate(sys.maxsize if args.all else args.batches)
    print(json.dumps({"checkpoint": str(path), "step": run.step_index, **validation.record()}))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from k3.model.checkpoint import WEIGHTS, resolve
    from k3.model.quantize import quantize_checkpoint

    before = (resolve(Path(args.ckpt)) / WEIGHTS).stat().st_size
    done = quantize_checkpoint(args.ckpt, args.out, args.activations)
    print(f"{done['out']}: routed experts MXFP4-packed, {done['mode']}; expert inputs {done['inputs']}; "
          f"weights {before / 2**20:,.2f} MiB -> {done['bytes'] / 2**20:,.2f} MiB")
    return 0


def _add_train(commands: argparse._SubParsersAction) -> None:
    tr = commands.add_parser("train", help="train a K3 model (Per-Head Muon, quantile balancing, curriculum)")
    tr.add_argument("--preset", choices=PRESETS, default="small")
    tr.add_argument("--steps", type=int, default=1000)
    tr.add_argument("--data", nargs="*", help="text files/folders, .jsonl (text field), .parquet; default: the "
                    "Python standard library's source")
    tr.add_argument("--data-limit-mb", type=positive(float),
                    help="use at most this much of the corpus: the first whole files of --data, in order, or of the "
                    "standard library's source")
    tr.add_argument("--out", default="runs/k3", help="run directory: checkpoints, metrics.jsonl, curves.png")
    tr.add_argument("--resume", action="store_true", help="continue the run in --out if it has a checkpoint")
    tr.add_argument("--tokens-per-step", type=int,
                    help="tokens per optimiser step (default: 4096 per data-parallel rank, rounded up so that every "
                         "curriculum stage's sequences split evenly over the data ranks)")
    tr.add_argument("--grad-accum", type=int, default=1)
    tr.add_argument("--curriculum", type=_curriculum, default="paper:32",
                    help="FRACTION:LENGTH stages, e.g. 0:256,0.6:1024,0.9:4096, or paper:BASE, the paper's "
                         "8K→64K→256K→1M shape from length BASE (stages at 0, 0.5, 0.9, 0.97 of the steps; "
                         "plain 'paper' is BASE 8192) (default: %(default)s)")
    tr.add_argument("--lr", type=positive(float), help="peak learning rate of Muon and AdamW (default: the "
                    "optimiser's, 3e-3)")
    tr.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    tr.add_argument("--qk-clip", type=positive(float, zero=True),
                    help="QK-clip threshold tau for MLA heads (default: Kimi K2's 100; 0 disables)")
    tr.add_argument("--balance", choices=("exact", "histogram", "bias-step", "none"), default="exact")
    tr.add_argument("--bf16", action="store_true", help="bf16 autocast")
    tr.add_argument("--multimodal", action="store_true", help="add generated image-text examples (shapes, "
                    "rendered text, plots, moving-shape videos) to every step, from step 0")
    tr.add_argument("--qat", choices=("mx",), help="quantization-aware training: routed experts on MXFP4 weights "
                    "and MXFP8 E4M3 inputs (fake-quantized, straight-through); may start on a full-precision run "
                    "with --resume")
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--eval-seq-len", type=positive(int), default=256,
                    help="validation window length (the same at every evaluation, whatever the curriculum)")
    tr.add_argument("--ckpt-every", type=int, default=50)
    tr.add_argument("--threads", type=THREADS, help="torch threads (default: the cores other processes leave "
                    "free, re-measured every few seconds)")
    tr.add_argument("--max-minutes", type=float, help="stop after this much wall time (a checkpoint is written)")
    tr.add_argument("--seed", type=SEED, default=0)
    tr.add_argument("--no-progress", action="store_true")
    _add_parallel(tr)
    tr.set_defaults(run=_train)


def _add_parallel(parser: argparse.ArgumentParser) -> None:
    """``k3 train``'s parallelism flags."""
    parallel = parser.add_argument_group("parallelism", "run on N local processes (or under torchrun, which sets the "
                                         "world size); the factors' product is the world size")
    parallel.add_argument("--nproc", type=positive(int), help="processes to start on this machine (torchrun "
                          "--standalone); 1 or absent: this process alone, with no distributed call")
    parallel.add_argument("--dp-shard", type=positive(int), help="FSDP2 shards (default: what the other factors "
                          "leave)")
    parallel.add_argument("--dp-replicate", type=positive(int), help="model replicas, HSDP (default 1)")
    parallel.add_argument("--ep", type=positive(int), help="expert-parallel ranks: the routed experts split "
                          "over them (default 1)")
    parallel.add_argument("--cp", type=positive(int), help="context-parallel ranks: each sequence cut into this "
                          "many contiguous segments (default 1)")
    parallel.add_argument("--ep-slots", type=positive(int, zero=True), help="MoonEP: redundant expert slots per "
                          "expert-parallel rank for copies of hot experts, at most E/ep (default E/ep: every rank "
                          "processes exactly S×K assignments); 0: plain expert parallelism")


def _add_convert_ckpt(commands: argparse._SubParsersAction) -> None:
    cc = commands.add_parser("convert-ckpt", help="a training checkpoint in the other format: single-process files "
                             "<-> sharded torch.distributed.checkpoint (any number of processes loads the latter)")
    cc.add_argument("--ckpt", required=True, help="a training checkpoint directory, or a run directory (its newest)")
    cc.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")
    cc.set_defaults(run=_convert_ckpt)


def _add_train_draft(commands: argparse._SubParsersAction) -> None:
    td = commands.add_parser("train-draft", help="train an EAGLE-3 draft for speculative decoding on a frozen target")
    td.add_argument("--ckpt", required=True, help="the target: a run directory or a checkpoint directory")
    td.add_argument("--out", required=True, help="run directory: draft checkpoints and metrics.jsonl")
    td.add_argument("--resume", action="store_true", help="continue the run in --out if it has a checkpoint")
    td.add_argument("--steps", type=positive(int), default=1000)
    td.add_argument("--seq-len", type=positive(int), default=128, help="tokens per training window")
    td.add_argument("--batch-size", type=positive(int), default=8)
    td.add_argument("--lr", type=positive(float), default=1e-3, help="AdamW peak learning rate (cosine decay)")
    td.add_argument("--seed", type=SEED, default=0)
    td.add_argument("--data", nargs="*", help="text files/folders, .jsonl, .parquet; default: the Python standard "
                    "library's source (as k3 train)")
    td.add_argument("--data-limit-mb", type=positive(float),
                    help="use at most this much of the corpus: the first whole files of --data, in order, or of the "
                    "standard library's source")
    td.add_argument("--layer-kind", choices=("mla", "kda"), default="mla", help="the draft's sequence mixer")
    td.add_argument("--mask", choices=("eagle3", "causal"),
                    help="what an unrolled draft step attends to: eagle3 (the default for an MLA draft) sees the "
                    "target's features for the prefix and its own chain, as when serving; causal (a KDA draft's) "
                    "its own step's earlier positions")
    td.add_argument("--feature-layers", type=int, nargs=3, metavar=("LOW", "MID", "HIGH"),
                    help="0-based target layers where the fused features are captured (default: the last layers of "
                    "AttnRes blocks 1, 4 and the last; with --feature-source inputs: 2, L//2, L-3)")
    td.add_argument("--feature-source", choices=("blocks", "inputs"),
                    help="the features: outputs of the AttnRes blocks the feature layers end (the K3 report's; the "
                    "default for a target of at least three blocks) or the layers' retrieved inputs (EAGLE-3's)")
    td.add_argument("--draft-vocab", type=positive(int), help="reduced draft vocabulary: the corpus's most "
                    "frequent target tokens (default: the target's whole vocabulary)")
    td.add_argument("--ckpt-every", type=positive(int), default=100)
    td.add_argument("--max-minutes", type=positive(float, zero=True),
                    help="stop after this much wall time (with a checkpoint)")
    td.add_argument("--threads", type=THREADS, help="torch threads (default: torch's)")
    td.add_argument("--no-progress", action="store_true")
    td.set_defaults(run=_train_draft)


def _add_eval(commands: argparse._SubParsersAction) -> None:
    ev = commands.add_parser("eval", help="validation loss, perplexity and bits per byte of a checkpoint, with zlib "
                                          "-9 and xz -9e on the same bytes")
    ev.add_argument("--ckpt", required=True, help="a run directory or a checkpoint directory")
    ev.add_argument("--data", nargs="*")
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--batches", type=positive(int), help="the first N validation batches (default: the run's "
                                                              "eval_batches, as training evaluated)")
    which.add_argument("--all", action="store_true", help="every validation window: the whole held-out text")
    ev.set_defaults(run=_eval)


def _export(args: argparse.Namespace) -> int:
    if args.format == "gguf":
        from k3.interop.gguf_export import export_gguf

        out = export_gguf(Path(args.ckpt), Path(args.out), verify=not args.no_verify)
        print(f"k3 export: {out} ({out.stat().st_size:,} bytes: llama.cpp's kimi-k3 GGUF with our tokenizer and "
              f"chat template)")
        return 0
    from k3.interop.export import export

    written = export(Path(args.ckpt), Path(args.out), verify=not args.no_verify)
    print(f"k3 export: {len(written)} files in {args.out} (the release layout and a Hugging Face tokenizer with the "
          f"chat template)")
    return 0


def _add_export(commands: argparse._SubParsersAction) -> None:
    ex = commands.add_parser("export", help="a checkpoint in the release layout with a Hugging Face tokenizer and "
                             "chat template (transformers, vLLM, SGLang, mlx-lm)")
    ex.add_argument("--ckpt", required=True, help="a run or checkpoint directory")
    ex.add_argument("--out", required=True, help="the new directory, or with --format gguf the new file (must not "
                    "exist)")
    ex.add_argument("--format", choices=("release", "gguf"), default="release",
                    help="release: the released Kimi K3 layout with a Hugging Face tokenizer; gguf: one GGUF file for "
                         "llama.cpp's kimi-k3 architecture, fp32 with the experts as stored (MXFP4 when packed) "
                         "(default: %(default)s)")
    ex.add_argument("--no-verify", action="store_true", help="load the checkpoint without checking its checksums")
    ex.set_defaults(run=_export)


def _add_quantize(commands: argparse._SubParsersAction) -> None:
    qz = commands.add_parser("quantize", help="pack a checkpoint's routed experts as MXFP4 (the release's layout)")
    qz.add_argument("--ckpt", required=True, help="a run or checkpoint directory")
    qz.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")
    qz.add_argument("--activations", choices=PACKED_ACTIVATIONS, default="keep",
                    help="expert inputs: keep (the checkpoint's MX inputs if trained with --qat, else none, as "
                         "the release), none, or an MXFP8 format (default: %(default)s)")
    qz.set_defaults(run=_quantize)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``train``, ``convert-ckpt``, ``train-draft``, ``eval``, ``quantize`` and ``export``."""
    for add in (_add_train, _add_convert_ckpt, _add_train_draft, _add_eval, _add_quantize, _add_export):
        add(commands)
