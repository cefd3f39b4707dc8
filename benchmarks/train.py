"""How fast does a K3 training step run on this CPU, and what do Muon and quantile balancing cost?

1. Training tokens/s and peak memory for the `tiny` and `small` presets at sequence lengths 256, 1024
   and 4096 with 4,096 tokens per step (batch 16, 4, 1): forward, masked loss, backward, clipping,
   Per-Head Muon + AdamW step, quantile-balancing update. Each case runs in a fresh process.
2. The optimiser step alone on `small`: Muon (Per-Head Muon on q/k/v, AdamW for the rest) vs AdamW
   for everything, the same gradients.
3. Quantile balancing per step on `small`: the collection hooks plus `update()` (exact and histogram),
   against a step without balancing.

    python benchmarks/train.py     # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, median_seconds, peak_rss_mib, reset_peak_rss, rss_mib, run_isolated, table, write_results  # noqa: E402,E501

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import preset  # noqa: E402
from k3.train.balance import QuantileBalancer  # noqa: E402
from k3.train.data import masked_mean_loss  # noqa: E402
from k3.train.optim import OptimConfig, build_optimizers  # noqa: E402

TOKENS_PER_STEP = 4096


def setup(name: str, seq_len: int, optimizer: str = "muon", balance: str | None = "exact"):
    torch.manual_seed(0)
    config = preset(name)
    model = K3ForCausalLM(config)
    opts = build_optimizers(model, config, OptimConfig(optimizer=optimizer))
    balancer = None if balance is None else QuantileBalancer(model, mode=balance)
    batch = TOKENS_PER_STEP // seq_len
    ids = torch.randint(0, config.vocab_size, (batch, seq_len + 1))
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    return model, opts, balancer, ids, mask


def forward_backward(model, ids, mask) -> None:
    logits, _ = model(ids[:, :-1])
    masked_mean_loss(logits, ids[:, 1:], mask).backward()


def full_step(model, opts, balancer, ids, mask) -> None:
    forward_backward(model, ids, mask)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    if balancer is not None:
        balancer.update()


def run_case(name: str, seq_len: int) -> dict:
    model, opts, balancer, ids, mask = setup(name, seq_len)
    reset_peak_rss()
    before = rss_mib()
    full_step(model, opts, balancer, ids, mask)
    peak = peak_rss_mib() - before
    seconds, _ = median_seconds(lambda: full_step(model, opts, balancer, ids, mask), min_repeats=3, budget_s=6.0)
    return {"seconds": seconds, "tokens_per_s": TOKENS_PER_STEP / seconds, "peak_mib": peak}


def step_all(opts) -> None:
    for opt in opts:
        opt.step()


def optimizer_steps() -> list[dict]:
    rows = []
    for optimizer in ("muon", "adamw"):
        model, opts, _, ids, mask = setup("small", 256, optimizer, balance=None)
        forward_backward(model, ids, mask)  # gradients stay in place: each timed call steps on them
        seconds, _ = median_seconds(partial(step_all, opts), min_repeats=5, budget_s=4.0)
        rows.append({"measure": f"optimizer step ({optimizer})", "preset": "small", "ms": 1e3 * seconds})
    return rows


def balancing_overhead() -> list[dict]:
    rows = []
    for mode in (None, "exact", "histogram"):
        model, opts, balancer, ids, mask = setup("small", 256, balance=mode)
        seconds, _ = median_seconds(partial(full_step, model, opts, balancer, ids, mask), min_repeats=3,
                                    budget_s=6.0)
        update_ms = None
        if balancer is not None:
            forward_backward(model, ids, mask)
            t0 = time.perf_counter()
            balancer.update()
            update_ms = 1e3 * (time.perf_counter() - t0)
        rows.append({"measure": f"training step, balancing={mode or 'off'}", "preset": "small",
                     "ms": 1e3 * seconds, "update_ms": update_ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", nargs=2, metavar=("PRESET", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]))))
        return
    throughput = []
    for name in ("tiny", "small"):
        for seq_len in (256, 1024, 4096):
            row = {"preset": name, "seq_len": seq_len, "batch": TOKENS_PER_STEP // seq_len}
            result = run_isolated(Path(__file__), ["--case", name, str(seq_len)], timeout_s=900)
            row.update(result)
            throughput.append(row)
            print(json.dumps(row), flush=True)
    costs = optimizer_steps() + balancing_overhead()
    for row in costs:
        print(json.dumps(row), flush=True)
    print()
    print(table(throughput, [("preset", "preset"), ("seq_len", "sequence"), ("batch", "batch"),
                             ("tokens_per_s", "train tokens/s"), ("peak_mib", "peak MiB"), ("error", "note")]))
    print()
    print(table(costs, [("measure", "measure"), ("preset", "preset"), ("ms", "ms"),
                        ("update_ms", "balancer update ms")]))
    path = write_results("train", {"machine": machine(), "tokens_per_step": TOKENS_PER_STEP,
                                   "throughput": throughput, "costs": costs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
