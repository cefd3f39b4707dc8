"""Training on 1, 2 and 4 processes (issue 17; SPEC §8): step time, tokens/s, and the bytes each rank receives per
step measured against `k3.dist.plan`'s prediction — then the plan's table for the paper configuration on 2,048 GPUs.

Every layout trains the ``mini`` preset (KDA, MLA, LatentMoE with 8 experts, Per-Head Muon, quantile balancing)
on the same global batches — ``--tokens-per-step`` tokens of length ``--seq`` from the standard library's source, fp32
— with real gloo process groups on this machine (`k3.train.distributed.DistributedRun`). Per layout: the median
step time over ``--steps`` steps after ``--warmup``, tokens/s, the step-3 loss (the same for every layout: it is the
same computation), and for one step the bytes received per rank by each part — FSDP2's all-gathers and
reduce-scatters, Muon's owner gather/scatter, context parallelism's all-gathers (and their backward all-reduces),
MoonEP's all-to-alls — counted at the collective calls (`k3.dist.comm.CommLedger`, averaged over the ranks), next
to `k3.dist.plan`'s formula for the same configuration and layout.

What 2 cores can show: that the distributed runs compute the same thing and move the predicted bytes. They cannot
show speed-up — two processes share two cores, four processes oversubscribe them, gloo moves bytes through loopback
TCP and every collective is a synchronisation point — so tokens/s falls as processes are added; the ratio to one
process is reported as it is.

    python benchmarks/distributed.py            # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gloo import free_port, join  # noqa: E402
from harness import machine, table, write_results  # noqa: E402

from k3.config import preset  # noqa: E402
from k3.dist import plan  # noqa: E402
from k3.dist.comm import CommLedger  # noqa: E402
from k3.dist.layout import ParallelLayout  # noqa: E402
from k3.train.pretrain import Run, TrainConfig  # noqa: E402
from k3.train.optim import OptimConfig  # noqa: E402

PRESET = "mini"
LAYOUTS = [  # (world, layout flags, MoonEP redundant slots per rank: None = E/ep, 0 = plain EP)
    (1, {}, None),
    (2, {"dp_shard": 2}, None),
    (2, {"cp": 2}, None),
    (2, {"ep": 2}, 0),
    (2, {"ep": 2}, None),
    (4, {"dp_shard": 4}, None),
    (4, {"dp_shard": 2, "cp": 2}, None),
    (4, {"dp_shard": 2, "ep": 2}, None),
]
PARTS = ("fsdp", "muon", "context", "expert")


def _config(out: Path, args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(out=str(out), preset=PRESET, steps=args.warmup + args.steps + 1, tokens_per_step=args.tokens,
                       curriculum=[[0.0, args.seq]], eval_every=10_000, ckpt_every=10_000, progress=False,
                       data_limit_bytes=args.data_mb * 2**20, optim=OptimConfig(lr=3e-3, adam_lr=3e-3), threads=1)


def _measure(run: Run, args: argparse.Namespace) -> dict:
    """Warm-up steps, one step under the ledger, then ``args.steps`` timed steps."""
    losses = [run.step()["loss"] for _ in range(args.warmup)]
    with CommLedger() as ledger:
        losses.append(run.step()["loss"])
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        run.step()
        times.append(time.perf_counter() - start)
    return {"loss_step3": losses[2] if len(losses) > 2 else None, "step_s": statistics.median(times),
            "received": {part: ledger.total(part) for part in PARTS},
            "calls": {p: dict(c) for p, c in ledger.calls.items()}}


def _worker(rank: int, world: int, port: int, layout: dict, slots: int | None, config: dict, args: argparse.Namespace,
            out: str) -> None:
    from k3.train.distributed import DistributedRun

    torch.set_num_threads(1)
    w = join(rank, world, port, layout, timeout_s=300)
    try:
        run = DistributedRun(TrainConfig.from_dict(config), w, slots)
        run.prepare(False)
        result = _measure(run, args)
        everyone = [None] * world
        dist.all_gather_object(everyone, result["received"])
        result["received"] = {p: sum(r[p] for r in everyone) / world for p in PARTS}  # mean over ranks
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def _single(_: int, config: dict, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(2)
    run = Run(TrainConfig.from_dict(config))
    run.prepare(False)
    torch.save(_measure(run, args), out)


def predicted(layout: ParallelLayout, args: argparse.Namespace) -> dict[str, int]:
    """`k3.dist.plan`'s bytes per rank per step for this run (fp32 weights and gradients: no bf16 policy)."""
    config = dataclasses.replace(preset(PRESET), vision=dataclasses.replace(preset(PRESET).vision, enabled=False))
    # text-only training: the vision encoder (its own FSDP unit) is never gathered, has no gradient, no update
    if layout.world == 1:
        return dict.fromkeys(PARTS, 0)
    sequences = args.tokens // args.seq // layout.data_ranks
    kinds = config.layer_kinds()
    fwd = plan.cp_bytes_per_layer(config, layout, args.seq, sequences, dtype_bytes=4)
    bwd = plan.cp_bytes_per_layer(config, layout, args.seq, sequences, dtype_bytes=4, backward=True)
    context = sum(fwd[k] + bwd[k] for k in kinds) if layout.cp > 1 else 0
    tokens = sequences * -(-args.seq // layout.cp)
    fsdp = plan.fsdp_bytes(config, layout, param_bytes=4, grad_bytes=4)
    return {"fsdp": sum(fsdp.values()), "muon": sum(plan.muon_bytes(config, layout).values()), "context": context,
            "expert": plan.all_to_all_bytes(config, layout, tokens, dtype_bytes=4) if layout.ep > 1 else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (global)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--data-mb", type=int, default=2, help="standard-library source to read")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="k3-dist-bench-"))
    tokenizer = base / "tokenizer-run"
    seed = Run(_config(tokenizer, args))
    seed.prepare(False)  # trains the tokenizer once; every layout reuses it
    rows = []
    try:
        for world, flags, slots in LAYOUTS:
            layout = ParallelLayout.for_world(world, **flags)
            name = layout.describe() + ("" if layout.ep == 1 else ", plain EP" if slots == 0 else ", MoonEP")
            out = base / f"run-{len(rows)}"
            out.mkdir()
            shutil.copytree(tokenizer / "tokenizer", out / "tokenizer")
            config, result = _config(out, args).to_dict(), str(base / f"result-{len(rows)}.pt")
            if world == 1:
                mp.spawn(_single, args=(config, args, result), nprocs=1)
            else:
                mp.spawn(_worker, args=(world, free_port(), flags, slots, config, args, result), nprocs=world)
            r = torch.load(result)
            want = predicted(layout, args)
            row = {"world": world, "layout": name, "step_s": r["step_s"],
                   "tokens_per_s": args.tokens / r["step_s"], "loss_step3": r["loss_step3"]}
            for part in PARTS:
                row[f"{part}_kib"] = r["received"][part] / 1024
                row[f"{part}_plan_kib"] = want[part] / 1024
                row[f"{part}_ratio"] = r["received"][part] / want[part] if want[part] else None
            rows.append(row)
            print(f"{name}: {row['tokens_per_s']:.0f} tokens/s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    single = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_1_process"] = row["tokens_per_s"] / single
    paper = preset("paper")
    layout = plan.build_layout(paper, 2048, 65536, dp_shard=8, ep=32, cp=8)
    paper_plan = plan.training_plan(paper, layout, 65536, gpu_memory_gb=80)
    print(f"\n## Training `{PRESET}` on this machine ({os.cpu_count()} cores), {args.tokens} tokens/step of length "
          f"{args.seq}\n")
    print(table(rows, [("layout", "layout"), ("world", "processes"), ("step_s", "step s"),
                       ("tokens_per_s", "tokens/s"), ("vs_1_process", "× 1 process"), ("loss_step3", "loss, step 3")]))
    print("\n## Bytes received per rank per step: measured (KiB) / plan (KiB) = ratio\n")
    cells = []
    for row in rows[1:]:
        cell = {"layout": row["layout"]}
        for part in PARTS:
            m, p = row[f"{part}_kib"], row[f"{part}_plan_kib"]
            cell[part] = f"{m:,.1f} / {p:,.1f}" + (f" = {m / p:.3f}" if p else "")
        cells.append(cell)
    print(table(cells, [("layout", "layout")] + [(p, p) for p in PARTS]))
    print("\n## The paper configuration on 2,048 GPUs (k3 plan --preset paper --gpus 2048 --gpu-memory-gb 80 "
          "--dp-shard 8 --ep 32 --cp 8 --seq 65536)\n")
    print(plan.format_training_plan(paper_plan, "paper"))
    path = write_results("distributed", {"machine": machine(), "preset": PRESET, "tokens_per_step": args.tokens,
                                         "seq": args.seq, "rows": rows, "paper_plan": paper_plan})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
