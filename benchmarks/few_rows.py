"""Tuned decode steps with their products of 2–8 rows through the CPU kernel or MKL (issue 37, `k3.model.few_rows`).

One process builds the tuned decode step (`CompiledModel`: frozen weights, inductor's C++ GEMM templates) of ``small``
at d=1024 (`startup.wide`) twice per batch size — with `k3.model.few_rows.FEW_ROWS` at its default threshold (products
of 2 to 8 rows by weights of 2^20 elements or more through `k3.ops.mxfp4_kernel.dense`) and with the pass turned off
(every product MKL's or the template's, as before) — and times them alternately (``--rounds``, medians) beside the
eager step, after a 32-token prompt, greedy. A row also gives the rate its step reads weights at (`gpu.step_bytes`).

    python benchmarks/few_rows.py      # ~12 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import step_bytes  # noqa: E402
from harness import machine, table, write_results  # noqa: E402
from model import prefilled  # noqa: E402
from startup import wide  # noqa: E402
from timing import timed_decode  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.model import few_rows  # noqa: E402
from k3.model.compiled import CompiledModel  # noqa: E402

VARIANTS = {"kernel, 2–8 rows ≥ 2^20 (default)": few_rows.MIN_ELEMENTS, "MKL and templates (no pass)": 2**62}


def decoder(model: K3ForCausalLM, threshold: int, batch: int) -> Callable:
    """The tuned decode step of ``model`` at ``batch`` with the pass at ``threshold``, built before it is timed."""
    few_rows.MIN_ELEMENTS = threshold  # read while compiling; part of the pass's cache key
    compiled = CompiledModel(model, batches=(batch,), sizes=(1,))
    with torch.inference_mode():
        token, state = prefilled(model, batch, 32)
        compiled.decode(token, state)
    return compiled.decode


def rates(model: K3ForCausalLM, batch: int, rounds: int) -> dict[str, float]:
    """Median tokens/s of each variant and of the eager step, measured alternately over ``rounds``."""
    steps = {name: decoder(model, threshold, batch) for name, threshold in VARIANTS.items()}
    steps["eager"] = lambda ids, state: model(ids, state=state)
    held: list = []
    samples: dict[str, list[float]] = {name: [] for name in steps}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, step in steps.items():
                held[:] = prefilled(model, batch, 32)

                def one(step: Callable = step) -> None:
                    logits, held[1] = step(held[0], held[1])
                    held[0] = logits[:, -1].argmax(-1, keepdim=True)

                one()
                samples[name].append(timed_decode(one, batch, steps=16))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,2,4,8")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, rows = K3ForCausalLM(wide()).eval(), []
    off = "MKL and templates (no pass)"
    for batch in map(int, args.batches.split(",")):
        measured, step_mb = rates(model, batch, args.rounds), step_bytes(model, batch) / 1e6
        for name, rate in measured.items():
            step_s = batch / rate
            rows.append({"model": "d=1024", "batch": batch, "step": name, "tokens_per_s": round(rate, 1),
                         "step_ms": round(step_s * 1e3, 2), "vs_no_pass": round(rate / measured[off], 2),
                         "weights_gb_per_s": round(step_mb / step_s / 1e3, 1), "step_mb": round(step_mb, 1)})
        print(rows[-3:], flush=True)
    few_rows.MIN_ELEMENTS = VARIANTS["kernel, 2–8 rows ≥ 2^20 (default)"]
    print(table(rows, [("batch", "batch"), ("step", "decode step"), ("step_ms", "ms a step"),
                       ("tokens_per_s", "tok/s"), ("vs_no_pass", "× no pass"), ("weights_gb_per_s", "weights GB/s")]))
    write_results("few_rows", {"machine": machine(), "rows": rows, "rounds": args.rounds,
                               "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
