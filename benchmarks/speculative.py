"""Speculative decoding with an EAGLE-3 draft: acceptance, accepted length and decode speed, with and without it.

Needs a trained target and a draft trained on it (nothing is downloaded):

    make demo                                                     # the mini preset -> runs/mini
    .venv/bin/k3 train-draft --ckpt runs/mini --out runs/mini-draft --steps 300 --max-minutes 5
    python benchmarks/speculative.py --target runs/mini --draft runs/mini-draft

For batch 1 and 8, greedy and temperature 0.8: decode tokens/s of 64-token continuations of 64-token prompts
from the standard library's source, through the engine without HTTP, plain and speculating with γ draft tokens;
the acceptance rate (accepted / drafted) and the mean tokens kept per verified run (accepted + the corrected or
bonus token). Then the replay buffers' bytes per verified run against per-position state snapshots. Greedy
outputs are checked to be identical. Target (issue 14): ≥ 1.5× batch-1 greedy decode speed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402

from k3.model.checkpoint import load_model  # noqa: E402
from k3.serve.engine.drafting import EagleDrafter  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.options import EngineOptions  # noqa: E402


def prompts(tokenizer, n: int, length: int = 64) -> list[list[int]]:
    files = sorted(Path(random.__file__).parent.glob("*.py"))
    rng = random.Random(0)
    out = []
    while len(out) < n:
        ids = tokenizer.encode(rng.choice(files).read_text())
        if len(ids) > 2 * length:
            start = rng.randrange(len(ids) - length)
            out.append(ids[start:start + length])
    return out


def decode(engine: Engine, batch: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Seconds spent decoding (after every prompt was read) and the generated tokens."""
    outputs: list[list[int]] = [[] for _ in batch]
    first: list[float | None] = [None]

    def callback(i):
        def push(o):
            if o.token_ids and first[0] is None:
                first[0] = time.perf_counter()
            outputs[i].extend(o.token_ids)
        return push

    engine.add_requests([(p, params, None, callback(i)) for i, p in enumerate(batch)])
    while engine.has_work():
        engine.step()
    return time.perf_counter() - first[0], outputs


def replay_bytes(config, gamma: int) -> tuple[int, int]:
    """(KDA replay buffers for one verified run of γ+1 tokens, per-position KDA state snapshots), fp32."""
    k = config.kda
    layers = config.layer_kinds().count("kda")
    channels = k.num_heads * (2 * k.head_dim + k.value_head_dim)
    per_token = 2 * channels + k.num_heads * (k.head_dim + 1)  # conv inputs, q|k|v after conv, g, β
    snapshot = k.num_heads * k.head_dim * k.value_head_dim + (k.conv_size - 1) * channels
    return 4 * layers * (gamma + 1) * per_token, 4 * layers * (gamma + 1) * snapshot


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="runs/mini")
    parser.add_argument("--draft", default="runs/mini-draft")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_model(Path(args.target))
    plain_options = EngineOptions(max_batch=8, prefix_cache=False)  # k3 serve --max-batch 8 --no-prefix-cache
    spec_options = replace(plain_options, draft=args.draft, num_draft_tokens=args.gamma)  # ... --draft DIR
    rows = []
    for batch_size in (1, 8):
        batch = prompts(tokenizer, batch_size)
        for temperature in (0.0, 0.8):
            params = SamplingParams(max_tokens=args.tokens, temperature=temperature, seed=0)
            plain_s, plain = decode(plain_options.build(target, tokenizer), batch, params)
            spec_engine = spec_options.build(target, tokenizer)
            assert isinstance(spec_engine.drafter, EagleDrafter), f"{args.draft} is not an EAGLE-3 draft"
            spec_s, spec = decode(spec_engine, batch, params)
            if temperature == 0:
                assert spec == plain, "speculative greedy decoding differs from plain decoding"
            stats = spec_engine.speculation
            tokens = sum(map(len, spec))
            rows.append({"batch": batch_size, "temperature": temperature, "gamma": args.gamma,
                         "plain_tok_s": sum(map(len, plain)) / plain_s, "spec_tok_s": tokens / spec_s,
                         "speed_up": (tokens / spec_s) / (sum(map(len, plain)) / plain_s),
                         "acceptance": stats["accepted"] / max(1, stats["drafted"]),
                         "kept_per_run": (stats["accepted"] + stats["runs"]) / max(1, stats["runs"])})
    print(table(rows, [("batch", "batch"), ("temperature", "temperature"), ("gamma", "γ"),
                       ("plain_tok_s", "plain tok/s"), ("spec_tok_s", "speculative tok/s"), ("speed_up", "speed-up"),
                       ("acceptance", "acceptance"), ("kept_per_run", "tokens kept per run")]))
    replay, snapshots = replay_bytes(target.config, args.gamma)
    print(f"\nKDA replay buffers per verified run (γ = {args.gamma}): {replay:,} bytes; per-position snapshots: "
          f"{snapshots:,} bytes ({snapshots / replay:.1f}x)")
    payload = {"machine": machine(), "rows": rows, "replay_bytes": replay, "snapshot_bytes": snapshots}
    print(f"results: {write_results('speculative', payload)}")


if __name__ == "__main__":
    main()
