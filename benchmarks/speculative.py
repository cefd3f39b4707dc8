"""Speculative decoding against plain decoding, side by side: n-gram and EAGLE-3 drafters, fixed and adaptive γ.

Needs a trained target and, for the EAGLE-3 rows, a draft trained on it (nothing is downloaded):

    make demo                                                     # the mini preset -> runs/mini
    .venv/bin/k3 train-draft --ckpt runs/mini --out runs/mini-draft --steps 300 --max-minutes 5
    python benchmarks/speculative.py --target runs/mini --draft runs/mini-draft [--compile]

The issue's stated target is `small` (results then go to ``speculative*_small.json``):

    .venv/bin/k3 train --preset small --out runs/small --steps 450 --tokens-per-step 4096 --curriculum 0:256
    .venv/bin/k3 train-draft --ckpt runs/small --out runs/small-draft --steps 1900 --max-minutes 34
    python benchmarks/speculative.py --target runs/small --draft runs/small-draft [--compile]

Two workloads from the standard library's source: **text** continues a 64-token slice of it; **edit** is a code-editing
request of up to 256 tokens — a function, a marker, and the function's first line again — whose answer should repeat
most of the prompt (whether a target's answers do is what `copying.py` measures). For each drafter (``ngram``: prompt
lookup, no model; ``eagle``: the draft), batch 1 and 8 — 8 requests started together and timed until the last ends (a
static batch), and 32 requests through 8 slots, each refilled from the queue as a request ends (as a server runs them) —
greedy and temperature 0.8, γ drafted always (``--always-draft``) or adaptively (the default), the decode tokens/s of
64-token continuations through the engine without HTTP, beside plain decoding of the same prompts in the same pass
(passes repeated, medians reported; the speed-up is the median of each pass's own ratio); the acceptance rate per draft
position; tokens kept per verified run; the steps in which a speculating engine's request decoded plainly; the tokens
kept per run by output length (16-token bins).
Greedy outputs are checked identical to plain decoding: in every timed pass, and at batch 1 on ``--checked`` (16)
more prompts per workload, untimed. With ``--compile`` every engine shares one set of compiled
graphs (decode batches 1, 2, 4 and 8 as `k3 serve --max-batch 8` has them, verification of γ + 1 tokens, with and
without the EAGLE features), all built before anything is timed.
Targets (issue 36): batch-1 greedy ≥ 1.5× (EAGLE), n-gram ≥ 2× on edits, batch 8 ≥ 1.0×, no row below 0.95×.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402

from k3.model.checkpoint import load_model  # noqa: E402
from k3.model.compiled import CompiledModel  # noqa: E402
from k3.serve.engine.drafting import EagleDrafter  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.options import EngineOptions  # noqa: E402


def prompts(tokenizer, n: int, workload: str, length: int = 64) -> list[list[int]]:
    """``n`` prompts of about ``length`` tokens: a slice of a source file (text), or a function, a marker and the
    function's first line (edit)."""
    files = sorted(Path(random.__file__).parent.glob("*.py"))
    rng = random.Random(0)
    out: list[list[int]] = []
    while len(out) < n:
        source = rng.choice(files).read_text()
        if workload == "text":
            ids = tokenizer.encode(source)
            if len(ids) > 2 * length:
                start = rng.randrange(len(ids) - length)
                out.append(ids[start:start + length])
            continue
        functions = [f for f in source.split("\n    def ")[1:] if 150 < len(f) < 1500]
        if functions:
            body = "    def " + rng.choice(functions)
            ids = tokenizer.encode(body + "\n# the same method, with its docstring rewrapped:\n" + body.split("\n")[0])
            out.append(ids[-4 * length:])
    return out


def decode(engine: Engine, batch: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Seconds from the first generated token until every request ended (the prefills of requests queued behind a
    full batch included) and the generated tokens."""
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


def batch1_run(description: str) -> tuple[argparse.Namespace, object, object]:
    """The batch-1 EAGLE scripts' start (`speculative_paused.py`, `speculative_chain.py`): their arguments
    (``--target``, ``--draft``, ``--prompts``, ``--passes``), 2 threads, and the target and its tokenizer loaded."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", default="runs/mini")
    parser.add_argument("--draft", default="runs/mini-draft", help="an EAGLE-3 draft of the target")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    return (args, *load_model(Path(args.target)))


def replay_bytes(config, gamma: int) -> tuple[int, int]:
    """(KDA replay buffers for one verified run of γ+1 tokens, per-position KDA state snapshots), fp32."""
    k = config.kda
    layers = config.layer_kinds().count("kda")
    channels = k.num_heads * (2 * k.head_dim + k.value_head_dim)
    per_token = 2 * channels + k.num_heads * (k.head_dim + 1)  # conv inputs, q|k|v after conv, g, β
    snapshot = k.num_heads * k.head_dim * k.value_head_dim + (k.conv_size - 1) * channels
    return 4 * layers * (gamma + 1) * per_token, 4 * layers * (gamma + 1) * snapshot


def build(options: EngineOptions, target, tokenizer, compiled: CompiledModel | None) -> Engine:
    """`EngineOptions.build` with a shared set of compiled graphs."""
    return Engine(target, tokenizer, max_batch=options.max_batch, prefill_chunk=options.prefill_chunk,
                  drafter=replace(options, compile=compiled is not None).drafter(target),  # the draft's steps too
                  num_draft_tokens=options.num_draft_tokens,
                  adaptive_draft=not options.always_draft, compile=compiled)


def answers(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """``engine``'s answer to each prompt of ``batch``, one request at a time (untimed; after a row's statistics
    were read)."""
    return [decode(engine, [p], params)[1][0] for p in batch]


def tokens_per_second(timed: tuple[float, list[list[int]]]) -> float:
    """Decode tokens per second of one engine's `decode` in a pass."""
    seconds, outputs = timed
    return sum(map(len, outputs)) / seconds


def timed_pass(engines: dict, batch: list[list[int]], params: SamplingParams, turn: int = 0) -> dict:
    """Each engine decodes ``batch`` in turn, the order rotated by ``turn`` so that no engine always runs in the
    same place of a pass: its seconds and tokens."""
    names, k = list(engines), turn % len(engines)
    names = names[k:] + names[:k]
    return {name: decode(engines[name], batch, params) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="runs/mini")
    parser.add_argument("--draft", default="runs/mini-draft", help="an EAGLE-3 draft ('' for the n-gram rows only)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--checked", type=int, default=16,
                        help="prompts whose greedy answers each batch-1 engine must give as plain decoding (untimed)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_model(Path(args.target))
    plain_options = EngineOptions(max_batch=8, prefix_cache=False)  # k3 serve --max-batch 8 --no-prefix-cache
    drafters = {"ngram": "ngram", **({"eagle": args.draft} if args.draft else {})}
    for draft in drafters.values():  # a wrong --draft fails here, not after minutes of compiling
        replace(plain_options, draft=draft).drafter(target)
    compiled = CompiledModel(target, batches=(1, 2, 4, 8)) if args.compile else None  # `k3 serve`'s buckets to 8
    if compiled is not None:
        for draft in drafters.values():  # decode, prefill and verification graphs, with and without features
            build(replace(plain_options, draft=draft, num_draft_tokens=args.gamma), target, tokenizer,
                  compiled).warm_up()
        print(f"{compiled.compilations} graphs compiled in {sum(compiled.compile_seconds.values()):.0f} s", flush=True)
    built = 0 if compiled is None else compiled.compilations
    rows, positions, by_length = [], {}, {}
    checked = {workload: prompts(tokenizer, args.checked, workload) for workload in ("text", "edit")}
    plain_answers: dict[str, list] = {}
    for workload in ("text", "edit"):
        for batch_size, requests in ((1, 1), (8, 8), (8, 32)):  # 32: a queue through 8 slots, as a server runs
            batch = prompts(tokenizer, requests, workload)
            for temperature in (0.0, 0.8):
                params = SamplingParams(max_tokens=args.tokens, temperature=temperature, seed=0)
                engines = {"plain": build(plain_options, target, tokenizer, compiled)}
                for name, draft in drafters.items():
                    for always in (True, False):
                        engines[(name, always)] = build(replace(plain_options, draft=draft, num_draft_tokens=args.gamma,
                                                                always_draft=always), target, tokenizer, compiled)
                assert isinstance(engines[("eagle", True)].drafter, EagleDrafter) if args.draft else True
                timed_pass(engines, batch, params)  # warm-up
                passes = [timed_pass(engines, batch, params, turn) for turn in range(args.passes)]
                plain_tokens = passes[0]["plain"][1]
                plain_rate = statistics.median(tokens_per_second(p["plain"]) for p in passes)
                for key, engine in engines.items():
                    if key == "plain":
                        continue
                    name, always = key
                    if temperature == 0:
                        assert all(p[key][1] == plain_tokens for p in passes), f"{key}: greedy differs from plain"
                    rate = statistics.median(tokens_per_second(p[key]) for p in passes)
                    # the ratio within each pass (plain beside it), then the median: the machine's drift between passes
                    # moves both rates of a pass alike
                    ratio = statistics.median(tokens_per_second(p[key]) / tokens_per_second(p["plain"]) for p in passes)
                    stats = engine.speculation
                    rows.append({"workload": workload, "drafter": name, "gamma": "always" if always else "adaptive",
                                 "batch": batch_size, "requests": requests, "temperature": temperature,
                                 "plain_tok_s": plain_rate,
                                 "spec_tok_s": rate, "speed_up": ratio,
                                 "acceptance": stats["accepted"] / max(1, stats["drafted"]),
                                 "kept_per_run": (stats["accepted"] + stats["runs"]) / max(1, stats["runs"]),
                                 "plain_steps": stats["plain"], "runs": stats["runs"]})
                    print(rows[-1], flush=True)
                    key = f"{workload}/{name}/{rows[-1]['gamma']}/b{batch_size}x{requests}/t{temperature}"
                    positions[key] = [
                        round(stats[f"accepted_at_{i}"] / stats[f"drafted_at_{i}"], 3) if stats[f"drafted_at_{i}"]
                        else None for i in range(1, args.gamma + 1)]
                    by_length[key] = {
                        n: round(stats[f"kept_from_{n}"] / stats[f"runs_from_{n}"], 2)
                        for n in range(0, args.tokens, 16) if stats[f"runs_from_{n}"]}
                    if temperature == 0 and batch_size == 1:  # one prompt is timed; more are checked, untimed
                        if workload not in plain_answers:
                            plain_answers[workload] = answers(engines["plain"], checked[workload], params)
                        assert answers(engine, checked[workload], params) == plain_answers[workload], \
                            f"{key}: greedy differs from plain on the checked prompts"
    print(table(rows, [("workload", "workload"), ("drafter", "drafter"), ("gamma", "γ"), ("batch", "batch"),
                       ("requests", "requests"), ("temperature", "temperature"), ("plain_tok_s", "plain tok/s"),
                       ("spec_tok_s", "speculative tok/s"), ("speed_up", "speed-up"), ("acceptance", "acceptance"),
                       ("kept_per_run", "tokens kept per run"), ("runs", "runs"), ("plain_steps", "plain steps")]))
    print("\nacceptance by draft position (1 … γ):")
    for key, rates in positions.items():
        print(f"  {key}: {rates}")
    print("\ntokens kept per verified run by output length (runs verified while the output held n … n+15 tokens):")
    for key, kept in by_length.items():
        print(f"  {key}: {kept}")
    if compiled is not None:
        print(f"graphs compiled while timed: {compiled.compilations - built}")
    replay, snapshots = replay_bytes(target.config, args.gamma)
    print(f"\nKDA replay buffers per verified run (γ = {args.gamma}): {replay:,} bytes; per-position snapshots: "
          f"{snapshots:,} bytes ({snapshots / replay:.1f}x)")
    payload = {"machine": machine(), "compiled": args.compile, "rows": rows, "acceptance_by_position": positions,
               "kept_per_run_by_output_length": by_length, "replay_bytes": replay, "snapshot_bytes": snapshots,
               "graphs_compiled_while_timed": None if compiled is None else compiled.compilations - built}
    name = "speculative" + ("_compiled" if args.compile else "") + ("" if args.gamma == 4 else f"_gamma{args.gamma}") \
        + ("" if Path(args.target).name == "mini" else f"_{Path(args.target).name}")  # e.g. runs/small: _small
    print(f"results: {write_results(name, payload)}")


if __name__ == "__main__":
    main()
