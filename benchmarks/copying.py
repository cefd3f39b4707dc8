"""Does the target copy? What prompt lookup can find in its answers, without timing anything (issue 36).

    python benchmarks/copying.py --target runs/small            # results/copying_small.json

The n-gram drafter (`k3.serve.engine.ngram`) pays only where the target's answer repeats text it has seen. For each of
`speculative.py`'s workloads this takes the target's greedy answers (eager, through the engine) and reports:
- the share of the answers' 4-grams found in their prompts, and in the prompt or the answer before them (a 4-gram is
  counted at its last token, from an answer's fourth token on; an edit answer that repeats its method scores ~1);
- the drafter replayed over those answers at γ for several (min_n, max_n): verified runs, tokens kept per run, steps
  decoded plainly (no match), and the speed-up over plain decoding if a verified run costs ``--price`` plain steps.
  Greedy verification keeps the accepted drafts and the target's next token, so the replay emits exactly the answer and
  needs no model; only the price is assumed (2.1: compiled `mini` at batch 1, stop 59, `speculative_steps.py`).
A last row per workload replays the *copying answer*: the prompt's own continuation after the earlier occurrence of
its last 4 tokens, i.e. what a target that repeated its input would emit — the bound on what the drafter gives when
the premise holds, not a measurement of a model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402
from speculative import decode, prompts  # noqa: E402

from k3.model.checkpoint import load_model  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.engine.ngram import NGramDrafter  # noqa: E402

LOOKUPS = ((1, 4), (2, 4), (3, 4), (3, 6), (4, 8))  # (min_n, max_n); the drafter's default: (MIN_N, MAX_N)
DEFAULT = (NGramDrafter.MIN_N, NGramDrafter.MAX_N)


def copied(pairs: list[tuple[list[int], list[int]]], n: int = 4, answer_too: bool = False) -> float:
    """The share of the answers' n-grams (at each answer token from the n-th) that occur in the prompt (and, with
    ``answer_too``, earlier in the answer)."""
    found = total = 0
    for prompt, answer in pairs:
        seen = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
        for t in range(n - 1, len(answer)):
            gram = tuple(answer[t - n + 1:t + 1])
            found += gram in seen
            total += 1
            if answer_too:
                seen.add(gram)
    return found / max(1, total)


def replay(pairs: list[tuple[list[int], list[int]]], gamma: int, min_n: int, max_n: int) -> dict[str, float]:
    """Greedy speculative decoding of the known answers with the n-gram drafter: runs, tokens emitted by them, steps
    decoded plainly. The answer's first token comes from the prefill, as in the engine."""
    runs = kept = plain = 0
    drafter = NGramDrafter(max_n=max_n, min_n=min_n)
    for i, (prompt, answer) in enumerate(pairs):
        sequence, t = [*prompt, answer[0]], 1
        while t < len(answer):
            draft = drafter.lookup(str(i), sequence, min(gamma, len(answer) - t - 1))
            accepted = 0
            while accepted < len(draft) and draft[accepted] == answer[t + accepted]:
                accepted += 1
            emitted = accepted + 1
            runs, kept, plain = runs + bool(draft), kept + emitted * bool(draft), plain + (not draft)
            sequence += answer[t:t + emitted]
            t += emitted
        drafter.end(str(i))
    return {"runs": runs, "kept_per_run": kept / max(1, runs), "plain_steps": plain}


def copying_answer(prompt: list[int], length: int, n: int = 4) -> list[int]:
    """What follows the latest earlier occurrence of the prompt's last ``n`` tokens, continued with period
    (end − match) past the prompt's end: the answer of a target that repeats its input (the drafter's own lookup
    with exactly ``n`` tokens)."""
    return NGramDrafter(max_n=n, min_n=n).lookup("answer", prompt, length)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="runs/mini")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--price", type=float, default=2.1, help="a verified run's cost in plain decode steps")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_model(Path(args.target))
    rows = []
    for workload in ("text", "edit"):
        batch = prompts(tokenizer, args.requests, workload)
        greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0)
        _, answers = decode(Engine(target, tokenizer, max_batch=8), batch, greedy)
        sources = {"target": list(zip(batch, answers, strict=True))}
        if workload == "edit":
            bound = [(p, copying_answer(p, args.tokens)) for p in batch]
            sources["copying answer"] = [(p, a) for p, a in bound if len(a) == args.tokens]
        for source, pairs in sources.items():
            for min_n, max_n in LOOKUPS if source == "target" else [DEFAULT]:
                counts = replay(pairs, args.gamma, min_n, max_n)
                tokens = sum(len(a) - 1 for _, a in pairs)
                rows.append({"workload": workload, "answers": source, "count": len(pairs),
                             "in_prompt": copied(pairs), "in_prompt_or_answer": copied(pairs, answer_too=True),
                             "lookup": f"{min_n}–{max_n}" + (" (default)" if (min_n, max_n) == DEFAULT else ""),
                             **counts,
                             "speed_up": tokens / (counts["runs"] * args.price + counts["plain_steps"])})
                print(rows[-1], flush=True)
    print(table(rows, [("workload", "workload"), ("answers", "answers"), ("count", "n"),
                       ("in_prompt", "4-grams in prompt"), ("in_prompt_or_answer", "in prompt or answer"),
                       ("lookup", "min_n–max_n"), ("runs", "runs"), ("kept_per_run", "kept per run"),
                       ("plain_steps", "plain steps"), ("speed_up", f"speed-up at {args.price} steps a run")]))
    results = {"machine": machine(), "target": args.target, "gamma": args.gamma, "price": args.price, "rows": rows}
    name = "copying" + ("" if Path(args.target).name == "mini" else f"_{Path(args.target).name}")
    print(write_results(name, results))


if __name__ == "__main__":
    main()
