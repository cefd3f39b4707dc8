"""EAGLE's greedy proposals as one graph against step by step (issue 36), in one run on one set of compiled graphs:
plain decoding, and EAGLE engines drafting γ = 4 always or adaptively whose greedy proposals run either as one tuned
graph of all γ draft steps (`EagleDraft.greedy`, the default) or one compiled draft step per token (``chain=False``,
as sampled proposals run). Batch 1, greedy, 64-token answers to `speculative.prompts`' text and edit prompts, passes
alternating the engines in a rotated order; decode tokens/s from each answer's first token. Every answer is checked
identical to plain decoding's.

    python benchmarks/speculative_chain.py --target runs/mini --draft runs/mini-draft    # ~20 min, most of it building
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402
from speculative import batch1_run, decode, prompts  # noqa: E402

from k3.model.compiled import CompiledModel  # noqa: E402
from k3.model.draft import EagleDraft  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.engine.drafting import EagleDrafter  # noqa: E402

GAMMA = 4


def engines(target, tokenizer, draft: str, compiled: CompiledModel) -> dict[str, Engine]:
    """Plain decoding, then EAGLE drafting always / adaptively with the chain or step by step."""
    out = {"plain": Engine(target, tokenizer, max_batch=1, compile=compiled)}
    for adaptive in (False, True):
        for chain in (True, False):
            drafter = EagleDrafter(EagleDraft.load(draft, target), compile=True, chain=chain)
            name = f"EAGLE {'adaptive' if adaptive else 'always'}, {'one graph' if chain else 'step by step'}"
            out[name] = Engine(target, tokenizer, max_batch=1, drafter=drafter, num_draft_tokens=GAMMA,
                               adaptive_draft=adaptive, compile=compiled)
    return out


def main() -> None:
    args, target, tokenizer = batch1_run(__doc__.split("\n\n")[0])
    compiled = CompiledModel(target, batches=(1,))
    built = engines(target, tokenizer, args.draft, compiled)
    start = time.perf_counter()
    for engine in built.values():
        engine.warm_up()
    compile_s = time.perf_counter() - start
    params, rows = SamplingParams(temperature=0.0, max_tokens=64), []
    for workload in ("text", "edit"):
        batch = prompts(tokenizer, args.prompts, workload)
        for engine in built.values():
            decode(engine, batch[:1], params)
            engine.speculator.counts.clear()
        rates: dict[str, list[float]] = {name: [] for name in built}
        answers: dict[str, list[list[int]]] = {}
        for turn in range(args.passes):
            names = list(built)[turn % len(built):] + list(built)[:turn % len(built)]
            for name in names:
                timed = [decode(built[name], [p], params) for p in batch]
                rates[name].append(sum(len(out[0]) for _, out in timed) / sum(s for s, _ in timed))
                answers[name] = [out[0] for _, out in timed]
        for name, engine in built.items():
            if answers[name] != answers["plain"]:
                raise SystemExit(f"{workload}, {name}: greedy answers differ from plain decoding's")
            counts = engine.speculation
            rows.append({"workload": workload, "engine": name, "tok_s": statistics.median(rates[name]),
                         "vs_plain": statistics.median(a / b for a, b in zip(rates[name], rates["plain"])),
                         "runs": counts["runs"], "kept_per_run": (counts["accepted"] + counts["runs"]) / counts["runs"]
                         if counts["runs"] else None, "plain_steps": counts["plain"],
                         "passes": [round(x) for x in rates[name]]})
    print(table(rows, [("workload", "workload"), ("engine", "engine"), ("tok_s", "tok/s"), ("vs_plain", "÷ plain"),
                       ("runs", "runs"), ("kept_per_run", "kept per run"), ("plain_steps", "plain steps"),
                       ("passes", "passes")]))
    print(f"graphs built in {compile_s:.0f} s")
    path = write_results("speculative_chain", {"machine": machine(), "target": args.target, "draft": args.draft,
                                               "gamma": GAMMA, "compile_s": compile_s, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
