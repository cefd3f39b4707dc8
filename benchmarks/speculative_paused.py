"""What adaptive EAGLE costs when it mostly does not draft (issue 36: no speculative row below 0.95× of plain), in one
run on one set of compiled graphs: plain decoding; adaptive EAGLE, whose paused steps capture no features
(`Speculator.reads`: the plain graphs, and the draft reads the `READ_AHEAD` steps before each probe); and EAGLE
attached, reading the target's features every step but never drafting (no proposal, no verification) — the floor
of adaptive EAGLE before stop 58, when paused steps still captured. Batch 1, greedy, 64-token answers to
`speculative.prompts` text prompts, passes alternating the engines; decode tokens/s from each answer's first token.

    python benchmarks/speculative_paused.py --target runs/mini --draft runs/mini-draft    # ~5 min with warm caches
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402
from speculative import batch1_run, build, decode, prompts  # noqa: E402

from k3.model.compiled import CompiledModel  # noqa: E402
from k3.serve.engine import SamplingParams  # noqa: E402
from k3.serve.options import EngineOptions  # noqa: E402


def main() -> None:
    args, target, tokenizer = batch1_run(__doc__.split("\n\n")[0])
    plain = EngineOptions(max_batch=1, prefix_cache=False)
    eagle = replace(plain, draft=args.draft, num_draft_tokens=4)
    compiled = CompiledModel(target, batches=(1,))
    start = time.perf_counter()
    for options in (eagle, plain):
        build(options, target, tokenizer, compiled).warm_up()
    compile_s = time.perf_counter() - start
    engines = {"plain": build(plain, target, tokenizer, compiled), "adaptive EAGLE": build(eagle, target, tokenizer,
                                                                                            compiled),
               "EAGLE reading, never drafting": build(eagle, target, tokenizer, compiled)}
    engines["EAGLE reading, never drafting"].speculator.propose = lambda requests: {}
    batch = prompts(tokenizer, args.prompts, "text")
    params = SamplingParams(temperature=0.0, max_tokens=64)
    for engine in engines.values():
        decode(engine, batch[:1], params)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.passes):
        for name, engine in engines.items():
            timed = [decode(engine, [p], params) for p in batch]
            rates[name].append(sum(len(out[0]) for _, out in timed) / sum(s for s, _ in timed))
    rows = [{"engine": name, "tok_s": statistics.median(r), "vs_plain": statistics.median(
        a / b for a, b in zip(r, rates["plain"])), "passes": [round(x) for x in r]} for name, r in rates.items()]
    counts = engines["adaptive EAGLE"].speculation
    print(table(rows, [("engine", "engine"), ("tok_s", "tok/s"), ("vs_plain", "÷ plain"), ("passes", "passes")]))
    print(f"adaptive EAGLE: {counts['runs']} verified runs, {counts['plain']} plain steps; graphs built in "
          f"{compile_s:.0f} s")
    path = write_results("speculative_paused", {"machine": machine(), "target": args.target, "draft": args.draft,
                                                "rows": rows, "runs": counts["runs"], "plain_steps": counts["plain"]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
