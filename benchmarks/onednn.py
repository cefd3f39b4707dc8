"""Precompiled decode steps with their products through oneDNN or MKL (issue 37, `k3.model.onednn`), side by side.

One process builds the precompiled decode step (`CompiledModel.precompile`: the weights are graph inputs) of one
model three times — the products by weights of `k3.model.onednn.MIN_ELEMENTS` (2^20) or more through oneDNN (the
default), every product through oneDNN, and none (MKL, as before) — each into a graph directory of its own, and
times them alternately (``--rounds``, medians) beside the eager step, on ``small`` and on ``small`` at d=1024
(`startup.wide`), after a 32-token prompt, greedy. A row also gives the rate its step reads weights at
(`gpu.step_bytes`: every weight but the routed experts, and the experts the batch is expected to pick), beside the
machine's copy bandwidth. Graphs are compiled into a temporary directory (~7 minutes).

    python benchmarks/onednn.py      # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import step_bytes  # noqa: E402
from harness import copy_gbps, machine, table, write_results  # noqa: E402
from model import prefilled  # noqa: E402
from startup import wide  # noqa: E402
from timing import timed_decode  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import preset  # noqa: E402
from k3.model import onednn  # noqa: E402
from k3.model.compiled import CompiledModel  # noqa: E402

VARIANTS = {"oneDNN ≥ 2^20 (default)": onednn.MIN_ELEMENTS, "oneDNN, every product": 0, "MKL (no pass)": 2**62}


def decoder(model: K3ForCausalLM, threshold: int, batch: int, directory: Path) -> Callable:
    """The precompiled decode step of ``model`` with the pass at ``threshold``, its graph under ``directory``."""
    onednn.MIN_ELEMENTS = threshold  # read while compiling; part of the pass's cache key
    os.environ["XDG_CACHE_HOME"] = str(directory)  # the precompiled graph's directory (`k3.files.user_cache`)
    compiled = CompiledModel(model)
    compiled.precompile([("decode", batch, 2)])
    return compiled.decode


def rates(model: K3ForCausalLM, batch: int, rounds: int, work: Path) -> dict[str, float]:
    """Median tokens/s of each variant and of the eager step, measured alternately over ``rounds``."""
    steps = {name: decoder(model, threshold, batch, work / f"{batch}-{threshold}")
             for name, threshold in VARIANTS.items()}
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
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args()
    torch.set_num_threads(2)
    bandwidth = copy_gbps() / 2  # bytes read per second of a copy
    rows, work = [], Path(tempfile.mkdtemp(prefix="k3-onednn-"))
    for model_name, config in (("small", preset("small")), ("d=1024", wide())):
        torch.manual_seed(0)
        model = K3ForCausalLM(config).eval()
        for batch in map(int, args.batches.split(",")):
            measured, step_mb = rates(model, batch, args.rounds, work / model_name), step_bytes(model, batch) / 1e6
            for name, rate in measured.items():
                step_s = batch / rate
                rows.append({"model": model_name, "batch": batch, "step": name, "tokens_per_s": round(rate, 1),
                             "step_ms": round(step_s * 1e3, 2), "vs_mkl": round(rate / measured["MKL (no pass)"], 2),
                             "weights_gb_per_s": round(step_mb / step_s / 1e3, 1), "step_mb": round(step_mb, 1)})
            print(rows[-4:], flush=True)
    onednn.MIN_ELEMENTS = VARIANTS["oneDNN ≥ 2^20 (default)"]
    print(table(rows, [("model", "model"), ("batch", "batch"), ("step", "decode step"), ("step_ms", "ms a step"),
                       ("tokens_per_s", "tok/s"), ("vs_mkl", "× MKL"), ("weights_gb_per_s", "weights GB/s")]))
    print(f"copy bandwidth (read): {bandwidth:.1f} GB/s; weight bytes a step reads: "
          + ", ".join(f"{r['model']} batch {r['batch']} {r['step_mb']:.0f} MB" for r in rows if r["step"] == "eager"))
    write_results("onednn", {"machine": machine(), "rows": rows, "copy_read_gb_per_s": bandwidth,
                             "rounds": args.rounds, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
