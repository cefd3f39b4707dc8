"""Where a speculative decode step's time goes at batch 1 (issue 36), beside plain decoding in the same run: prompt
lookup (`--draft ngram`) drafting γ = 4 every step it finds a match, on the code-editing prompts of
`speculative.prompts` (answers that should repeat the prompt: `copying.py`), greedy, 64-token answers, compiled by
default. Each engine step is timed and sorted by kind — a plain step, a verification step, and the plain step right
after a verification (the request's state returns to the decode group) — and inside them the target's graph calls and
the state's `accept` (the KDA replay of the kept tokens). ``--lookup 2-4 3-4`` runs one speculating engine per lookup
range (``--prompt-lookup-min/-max``) in the same passes; ``--workload text`` takes the text prompts instead. Greedy
outputs of every engine are checked identical to plain decoding on every prompt of every pass.

    python benchmarks/speculative_steps.py --target runs/mini [--eager]     # ~4 min with warm compile caches
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402
from speculative import build, decode, prompts  # noqa: E402

from k3.model.checkpoint import load_model  # noqa: E402
from k3.model.compiled import CompiledModel  # noqa: E402
from k3.model.state import DecoderState  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.options import EngineOptions  # noqa: E402


class Steps:
    """Seconds of each engine step by engine and kind, and of the calls inside them (the engines share one set of
    compiled graphs, so a call is filed under the engine whose step makes it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.engine, self.verifying, self.verified = "", False, {}
        self._targets: list = []  # the compiled graphs or models whose calls are timed

    def timed(self, label: str, function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[self.engine][label].append(time.perf_counter() - start)
        return run

    def step(self, name: str, step) -> None:
        """One step of engine ``name`` (``step``: the engine's own), filed under its kind."""
        self.engine, self.verifying, start = name, False, time.perf_counter()
        step()
        kind = "verification step" if self.verifying else \
            "step after a verification" if self.verified.get(name) else "plain step"
        self.seconds[name][kind].append(time.perf_counter() - start)
        self.verified[name] = self.verifying

    def instrument(self, name: str, engine: Engine) -> None:
        """Time ``engine``'s steps, and its target calls unless another engine on the same graphs already does."""
        engine.step = functools.partial(self.step, name, engine.step)
        compiled = engine.runner.compiled
        target = engine.runner.model if compiled is None else compiled
        if any(t is target for t in self._targets):
            return
        self._targets.append(target)
        if compiled is not None:
            compiled.verify = self.timed("target graph: verification", self._verifying(compiled.verify))
            compiled.step = self.timed("target graph: decode", compiled.step)
        else:
            forward_groups = target.forward_groups

            def groups(groups, full=None, replay=None):
                self.verifying = self.verifying or any(replay or [])
                return forward_groups(groups, full, replay)

            target.forward_groups = self.timed("target forward", groups)

    def _verifying(self, verify):
        def run(*args):
            self.verifying = True
            return verify(*args)
        return run


@torch.inference_mode()  # as the engine steps
def accept_seconds(target, compiled: CompiledModel | None, prompt: list[int], gamma: int, repeats: int = 200
                   ) -> dict[int, float]:
    """Median seconds of `DecoderState.accept` keeping n = 1 … γ tokens of one verified run of γ + 1 after
    ``prompt`` (on the compiled verification graph unless eager); keeping all γ + 1 is free."""
    ids = torch.tensor([prompt], device=target.device)
    _, state = target.forward_groups([(ids, target.new_state(1))], full=[False], replay=[False])[0]
    run = ids[:, :gamma + 1]
    _, verified = compiled.verify(run, state) if compiled is not None else \
        target.forward_groups([(run, state)], full=[True], replay=[True])[0]
    out = {}
    for n in range(1, gamma + 1):
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            verified.accept(n)
            seconds.append(time.perf_counter() - start)
        out[n] = statistics.median(seconds)
    return out


def lookup_bounds(text: str) -> tuple[int, int]:
    """``MIN-MAX`` (``--lookup``) as two ints; anything else is refused with the text it got."""
    low, dash, high = text.partition("-")
    if not (dash and low.isdigit() and high.isdigit()):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX (two whole numbers, e.g. 3-4), got {text!r}")
    return int(low), int(high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="runs/mini")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--workload", choices=("edit", "text"), default="edit", help="`speculative.prompts`'s")
    parser.add_argument("--lookup", nargs="+", default=[(2, 4)], metavar="MIN-MAX",
                        type=lookup_bounds,
                        help="n-gram lookup bounds (--prompt-lookup-min/-max), one speculating engine each")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_model(Path(args.target))
    plain = EngineOptions(max_batch=1, prefix_cache=False)
    ngrams = {f"n-gram {low}-{high}, drafting always": replace(
        plain, draft="ngram", num_draft_tokens=4, always_draft=True, prompt_lookup_min=low, prompt_lookup_max=high)
        for low, high in args.lookup}
    compiled = None if args.eager else CompiledModel(target, batches=(1,))
    start = time.perf_counter()
    if compiled is not None:
        build(next(iter(ngrams.values())), target, tokenizer, compiled).warm_up()
    compile_s = time.perf_counter() - start
    batch = prompts(tokenizer, args.prompts, args.workload)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    engines = {"plain": build(plain, target, tokenizer, compiled),
               **{name: build(options, target, tokenizer, compiled) for name, options in ngrams.items()}}
    steps, accept = Steps(), DecoderState.accept
    for engine in engines.values():
        decode(engine, batch[:1], params)  # warm-up
    for name, engine in engines.items():
        steps.instrument(name, engine)
    DecoderState.accept = steps.timed("accept", accept)
    rates: dict[str, list[float]] = defaultdict(list)
    outputs: dict[str, list] = defaultdict(list)
    try:
        for _ in range(args.passes):  # the engines alternate, so the machine's drift moves both alike
            for name, engine in engines.items():
                timed = [decode(engine, [p], params) for p in batch]
                rates[name].append(sum(len(out[0]) for _, out in timed) / sum(s for s, _ in timed))
                outputs[name].append([out[0] for _, out in timed])
    finally:
        DecoderState.accept = accept
    rows = [{"engine": name, "tok_s": statistics.median(rates[name]), "rates": rates[name],
             "vs_plain": statistics.median(a / b for a, b in zip(rates[name], rates["plain"])),
             "counts": dict(engine.speculation)} for name, engine in engines.items()]
    kinds = {name: {label: {"calls": len(s), "median_ms": round(1e3 * statistics.median(s), 3),
                            "total_ms": round(1e3 * sum(s), 1)} for label, s in sorted(labels.items())}
             for name, labels in steps.seconds.items()}
    for name in ngrams:
        assert outputs[name] == outputs["plain"], f"{name}: greedy speculative tokens differ from plain's"
    print(table(rows, [("engine", "engine"), ("tok_s", "tok/s"), ("vs_plain", "÷ plain")]))
    for row in rows[1:]:
        counts = row["counts"]
        print(f"{row['engine']}: {counts.get('runs', 0)} verified runs keeping "
              f"{counts.get('accepted', 0) + counts.get('runs', 0)} tokens, {counts.get('plain', 0)} plain steps")
    print(f"graphs built in {compile_s:.0f} s")
    for name, labels in kinds.items():
        print(f"\n{name} (every step of every pass, prefills included in plain steps):")
        print(table([{"what": k, **v} for k, v in labels.items()], [("what", "what"), ("calls", "calls"),
                                                                     ("median_ms", "median ms"),
                                                                     ("total_ms", "total ms")]))
    accepts = accept_seconds(target, compiled, batch[0], 4)
    print("\naccept of n kept tokens, median ms: " + ", ".join(f"n={n}: {1e3 * x:.3f}" for n, x in accepts.items()))
    path = write_results("speculative_steps" + ("_eager" if args.eager else "") +
                         ("" if args.workload == "edit" else f"_{args.workload}"),
                         {"machine": machine(), "target": args.target, "compiled": not args.eager,
                          "workload": args.workload, "lookup": [f"{a}-{b}" for a, b in args.lookup], "rows": rows,
                          "steps": kinds,
                          "accept_ms": {n: round(1e3 * x, 4) for n, x in accepts.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
