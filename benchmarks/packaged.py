"""Packaged tuned steps against the traced tuned graphs they replace (issue 37, `k3.model.packaged`), side by side in
one run: for each batch size, the decode step and the verification of ``--tokens`` positions, eager, on the traced
tuned graph (`CompiledStep(tuned=True)`, what ``k3 serve --compile`` decodes with) and on the AOTInductor package of
the same function and options; the seconds to build each, and to load the packages in a fresh process (the import of
torch and k3 included, timed from the process's start to the first step's logits on every package).

    python benchmarks/packaged.py --ckpt runs/mini     # ~10 min on 2 cores

Each step continues from the state the previous one left (a verification keeps one token, as when every draft is
rejected), so the MLA caches are written in place as when serving; the calls of the three paths alternate in
``--rounds`` rounds of ``--calls`` calls, and each row gives the medians of each path's per-call times. The packages
are built in a fresh directory (so the build is timed cold) and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

START = time.perf_counter()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402

from k3.model.checkpoint import load_model  # noqa: E402
from k3.model.compiled_step import CompiledStep  # noqa: E402
from k3.model.packaged import PackagedStep  # noqa: E402
from k3.model.state import DecoderState  # noqa: E402


def context(model, batch: int, length: int) -> tuple[DecoderState, torch.Tensor]:
    """``batch`` rows after ``length`` seeded random tokens (padded: the form a compiled step takes) and ids to feed."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, length + 64))
    with torch.inference_mode():
        _, state = model(ids[:, :length], state=model.new_state(batch))
    return replace(state, padding=state.row_padding()), ids[:, length:]


def paths(model, replayed: bool, directory: Path) -> dict:
    """The three ways to run one step: eager, traced tuned graph, package."""
    packaged = PackagedStep(model, replayed=replayed, directory=directory)
    return {"eager": packaged.eager, "traced": CompiledStep(model, tuned=True, replayed=replayed),
            "packaged": packaged}


def measure(model, batch: int, tokens: int, args, directory: Path) -> dict:
    """One row: build seconds, the logits' distance to eager, and per-call medians of every path."""
    state, ids = context(model, batch, args.context)
    replayed = tokens > 1
    steps = paths(model, replayed, directory)
    row: dict = {"batch": batch, "step": f"verification of {tokens}" if replayed else "decode", "tokens": tokens}
    states = {}

    def advance(after: DecoderState) -> DecoderState:
        """The next call's state: a verification keeps one token (every draft rejected)."""
        if replayed:
            rows = replace(after, padding=None).accept_rows([1] * batch)
            after = rows[0] if batch == 1 else DecoderState.stack(rows)
        return replace(after, padding=after.row_padding())

    with torch.inference_mode():
        expected, _ = steps["eager"](ids[:, :tokens], state)
        for name in ("traced", "packaged"):
            start = time.perf_counter()
            logits, after = steps[name](ids[:, :tokens], state)
            row[f"{name}_build_s"] = time.perf_counter() - start
            states[name] = advance(after)
            row[f"{name}_max_diff"] = (logits - expected).abs().max().item()
        states["eager"] = state
        times: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(args.rounds):
            for name in list(steps)[r % 3:] + list(steps)[:r % 3]:
                for i in range(args.calls):
                    start = time.perf_counter()
                    _, after = steps[name](ids[:, i % 32:i % 32 + tokens], states[name])
                    times[name].append(time.perf_counter() - start)
                    states[name] = advance(after)
    for name, seconds in times.items():
        row[f"{name}_ms"] = 1e3 * statistics.median(seconds)
    row["packaged_vs_traced"] = row["traced_ms"] / row["packaged_ms"]
    row["packaged_vs_eager"] = row["eager_ms"] / row["packaged_ms"]
    return row


def load_only(args) -> None:
    """The child process: every package of this run loaded and stepped once; seconds from the process's start."""
    model, _ = load_model(Path(args.ckpt))
    hits = 0
    for batch in args.batches:
        for tokens in (1, args.tokens):
            state, ids = context(model, batch, args.context)
            step = PackagedStep(model, replayed=tokens > 1, directory=Path(args.load))
            with torch.inference_mode():
                step(ids[:, :tokens], state)
            hits += step.cache_hits
    print(json.dumps({"seconds": time.perf_counter() - START, "loaded": hits}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default="runs/mini")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=5, help="the verification's width (γ + 1)")
    parser.add_argument("--context", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the child process: load the packages in this directory
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.load:
        load_only(args)
        return
    model, _ = load_model(Path(args.ckpt))
    directory = Path(tempfile.mkdtemp(prefix="k3-packages-"))
    try:
        rows = [measure(model, batch, tokens, args, directory) for batch in args.batches for tokens in (1, args.tokens)]
        child = subprocess.run([sys.executable, __file__, "--ckpt", args.ckpt, "--load", str(directory),
                                "--threads", str(args.threads), "--tokens", str(args.tokens), "--context",
                                str(args.context), "--batches", *map(str, args.batches)],
                               capture_output=True, text=True, check=True)
        loaded = json.loads(child.stdout.strip().splitlines()[-1])
        if loaded["loaded"] < len(rows):  # what made the fresh process compile
            print(child.stderr[-4000:], file=sys.stderr)
        size = sum(f.stat().st_size for f in directory.rglob("*.pt2"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(table(rows, [("batch", "batch"), ("step", "step"), ("eager_ms", "eager ms"), ("traced_ms", "traced ms"),
                       ("packaged_ms", "packaged ms"), ("packaged_vs_traced", "÷ traced"),
                       ("packaged_vs_eager", "÷ eager"), ("traced_build_s", "traced build s"),
                       ("packaged_build_s", "package build s"), ("packaged_max_diff", "package logits Δ"),
                       ("traced_max_diff", "traced logits Δ")]))
    print(f"a fresh process loaded {loaded['loaded']} packages ({size / 2**20:.1f} MiB) and stepped each once in "
          f"{loaded['seconds']:.1f} s from its start")
    path = write_results("packaged", {"machine": machine(), "ckpt": args.ckpt, "threads": args.threads,
                                      "context": args.context, "rows": rows, "fresh_process": loaded,
                                      "package_bytes": size})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
