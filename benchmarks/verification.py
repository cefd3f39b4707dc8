"""What a speculative verification costs by context (issue 36): MLA's absorbed path against the full one.

A verification reads a request's pending token and γ drafts (γ + 1 = 5 tokens) over its cache. On the full path
each MLA layer first up-projects every cached position into per-head keys and values — work that grows with the
context, on every verification; on the absorbed path (`k3.model.sequence.mla`, ``T ≤ ABSORBED_TOKENS``, as decode)
each query row reads the latent cache once. Both paths run side by side in one process on the same states, eager
and compiled (`CompiledModel`'s tuned decode and verification graphs, one set per path, built before anything is
timed), beside a plain decode step of the same state timed in the same run (the compiled paths run one after the
other, so each is compared with its own decode steps); ``verify ÷ decode`` is what the adaptive rule prices a run
at (`k3.serve.engine.payoff`). Random weights (timings do not depend on them), batch 1, 2 threads.

    python benchmarks/verification.py                     # small, contexts 200 2000 6000, ~20 min
    python benchmarks/verification.py --eager-only        # ~1 min
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, median_seconds, table, write_results  # noqa: E402

from k3.config import preset  # noqa: E402
from k3.model.compiled import CompiledModel  # noqa: E402
from k3.model.lm import K3ForCausalLM  # noqa: E402
from k3.model.sequence import mla  # noqa: E402

PATHS = {"full": 1, "absorbed": mla.ABSORBED_TOKENS}  # the largest T attending in latent space: before, decode only


def timings(step, verify, states: dict, vocab: int, generator: torch.Generator) -> dict[int, tuple[float, float]]:
    """Per context, the median ms of a decode step and of a 5-token verification from its state."""
    out = {}
    with torch.inference_mode():
        for context, state in states.items():
            decode = median_seconds(lambda s=state: step(torch.randint(0, vocab, (1, 1), generator=generator), s))[0]
            checked = median_seconds(lambda s=state: verify(torch.randint(0, vocab, (1, 5), generator=generator), s))[0]
            out[context] = (decode * 1e3, checked * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--contexts", type=int, nargs="+", default=[200, 2000, 6000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = K3ForCausalLM(preset(args.preset)).eval()
    vocab, generator = model.config.vocab_size, torch.Generator().manual_seed(0)
    with torch.inference_mode():
        states = {n: model(torch.randint(0, vocab, (1, n), generator=generator), state=model.new_state(1))[1]
                  for n in args.contexts}
    rows = []
    for mode in ("eager",) if args.eager_only else ("eager", "compiled"):
        measured, built = {}, {}
        for path, limit in PATHS.items():
            mla.ABSORBED_TOKENS = limit
            if mode == "eager":
                def step(ids, state):
                    return model.forward_groups([(ids, state)])

                def verify(ids, state):
                    return model.forward_groups([(ids, state)], full=[True], replay=[True])
            else:
                torch._dynamo.reset()
                compiled = CompiledModel(model, batches=(1,))
                start = time.perf_counter()
                compiled.warm_up(1, max(args.contexts) + 16, verify_tokens=5, prefill=False)
                built[path] = round(time.perf_counter() - start)
                step, verify = compiled.step, compiled.verify
            measured[path] = timings(step, verify, states, vocab, generator)
        mla.ABSORBED_TOKENS = PATHS["absorbed"]
        for context in args.contexts:
            (d_full, v_full), (d_abs, v_abs) = measured["full"][context], measured["absorbed"][context]
            rows.append({"mode": mode, "context": context, "decode_full_ms": round(d_full, 2),
                         "verify_full_ms": round(v_full, 2), "decode_absorbed_ms": round(d_abs, 2),
                         "verify_absorbed_ms": round(v_abs, 2),
                         "full_steps": round(v_full / d_full, 2), "absorbed_steps": round(v_abs / d_abs, 2),
                         "speedup": round(v_full / v_abs, 2), "compile_s": built or None})
    print(table(rows, [("mode", "mode"), ("context", "context"), ("decode_full_ms", "decode ms (full run)"),
                       ("verify_full_ms", "verify, full ms"), ("decode_absorbed_ms", "decode ms (absorbed run)"),
                       ("verify_absorbed_ms", "verify, absorbed ms"),
                       ("full_steps", "full ÷ decode"), ("absorbed_steps", "absorbed ÷ decode"),
                       ("speedup", "speed-up")]))
    write_results("verification", {"machine": machine(), "preset": args.preset, "threads": args.threads,
                                   "rows": rows})


if __name__ == "__main__":
    main()
