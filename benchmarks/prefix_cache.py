"""The prefix cache on multi-turn workloads: time to first token per turn and prompt tokens reused, cache off vs on.

Two workloads on the `small` preset (random weights: timing does not depend on what the model says), run through
the engine as a server runs it (one request at a time, conversations interleaved turn by turn):

* **chat**: a shared 300-word system prompt, 4 conversations of 6 turns; each turn adds a 40-word user message
  and the model's 16-token answer to the history; **chat-long** the same with a 1,500-word system prompt;
* **agent**: 3 tasks of 6 turns; each turn appends a 250-word tool output (as a tool message) and the answer.

Reported per turn: TTFT p50 / p99 with the cache off and on and their ratio, and the share of prompt tokens
reused; then the bytes per cached token of KDA checkpoints and MLA pages, and what the same history would cost a
pure-MLA model of the same depth. Target (issue 13): from turn 3 on, ≥ 5× lower TTFT p50 and ≥ 80 % reused.

    python benchmarks/prefix_cache.py        # ~3 min on 2 cores
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import preset  # noqa: E402
from k3.chat import native as chat  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.options import EngineOptions  # noqa: E402
from k3.tokenization.bpe import Tokenizer  # noqa: E402

TURNS = 6
ANSWER = SamplingParams(max_tokens=16, temperature=0)


def text(rng: random.Random, words: int) -> str:
    vocab = ["json", "parse", "value", "object", "list", "the", "returns", "error", "key", "string", "number", "if",
             "file", "decode", "encode", "with", "for", "in", "a", "data", "raise", "indent", "sort", "float"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def workload(name: str, seed: int = 0) -> list[list[dict]]:
    """Per conversation, its opening messages (the history grows as it runs)."""
    rng = random.Random(seed)
    if name.startswith("chat"):
        system = {"role": "system", "content": text(rng, 1500 if name == "chat-long" else 300)}
        return [[system] for _ in range(4)]
    return [[{"role": "system", "content": text(rng, 60)}, {"role": "user", "content": text(rng, 40)}]
            for _ in range(3)]


def first_token_seconds(engine: Engine, prompt: list[int]) -> tuple[float, list[int], int]:
    start, first, tokens, cached = time.perf_counter(), None, [], 0
    for output in engine.generate(prompt, ANSWER):
        if first is None and output.token_ids:
            first = time.perf_counter() - start
        tokens += output.token_ids
        cached = output.cached_tokens
        if output.finish_reason == "error":
            raise RuntimeError(output.error)
    return first, tokens, cached


def run(name: str, engine: Engine, tok: Tokenizer, seed: int = 0) -> list[dict]:
    """One pass over the workload: per (conversation, turn) the TTFT, prompt length and cached tokens."""
    rng = random.Random(seed + 1)
    histories, rows = workload(name, seed), []
    for turn in range(TURNS):
        for c, history in enumerate(histories):
            if name.startswith("chat"):
                history.append({"role": "user", "content": text(rng, 40)})
            elif turn:
                history.append({"role": "tool", "tool_call_id": f"call{turn}", "content": text(rng, 250)})
            prompt = chat.render(history, tok, "instruct")
            seconds, tokens, cached = first_token_seconds(engine, prompt)
            rows.append({"turn": turn + 1, "conversation": c, "ttft_s": seconds, "prompt": len(prompt),
                         "cached": cached})
            history.append({"role": "assistant", "content": tok.decode(tokens)})
    return rows


def summarise(name: str, off: list[dict], on: list[dict]) -> list[dict]:
    out = []
    for turn in range(1, TURNS + 1):
        a = [r["ttft_s"] * 1e3 for r in off if r["turn"] == turn]
        b = [r["ttft_s"] * 1e3 for r in on if r["turn"] == turn]
        prompt = sum(r["prompt"] for r in on if r["turn"] == turn)
        cached = sum(r["cached"] for r in on if r["turn"] == turn)
        p99 = lambda xs: sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]  # noqa: E731
        out.append({"workload": name, "turn": turn, "prompt_tokens": prompt, "reused_pct": 100 * cached / prompt,
                    "ttft_p50_off_ms": statistics.median(a), "ttft_p50_on_ms": statistics.median(b),
                    "ttft_p99_off_ms": p99(a), "ttft_p99_on_ms": p99(b),
                    "speedup_p50": statistics.median(a) / statistics.median(b)})
    return out


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = preset("small")
    model = K3ForCausalLM(config).eval()
    texts = [p.read_text() for p in sorted(Path(random.__file__).parent.glob("json/*.py"))]
    tok = Tokenizer.train(texts, config.vocab_size)
    rows, caches = [], {}
    for name in ("chat", "chat-long", "agent"):
        options = EngineOptions(max_model_len=config.context_length)  # k3 serve's cache: 1 GiB, 64-token blocks ...
        off = run(name, replace(options, prefix_cache=False).build(model, tok), tok)
        engine = options.build(model, tok)
        on = run(name, engine, tok)
        rows += summarise(name, off, on)
        caches[name] = engine.prefix_cache
    print(table(rows, [("workload", "workload"), ("turn", "turn"), ("prompt_tokens", "prompt tokens"),
                       ("reused_pct", "reused %"), ("ttft_p50_off_ms", "TTFT p50 off ms"),
                       ("ttft_p50_on_ms", "TTFT p50 on ms"), ("speedup_p50", "p50 speed-up"),
                       ("ttft_p99_off_ms", "TTFT p99 off ms"), ("ttft_p99_on_ms", "TTFT p99 on ms")]))
    kinds = config.layer_kinds()
    block = caches["chat"].block
    page = next(e.nbytes for k, e in caches["chat"]._entries.items() if k[0] == "page") / (
        block * caches["chat"].page_blocks)
    checkpoint = next(e.nbytes for k, e in caches["chat"]._entries.items() if k[0] == "checkpoint")
    every = block * caches["chat"].checkpoint_every
    sizes = {"mla_page_bytes_per_token": page, "kda_checkpoint_bytes": checkpoint,
             "kda_checkpoint_bytes_per_token_every_8_blocks": checkpoint / every,
             "pure_mla_bytes_per_token": page * len(kinds) / kinds.count("mla")}
    print("\n" + table([{"what": k, "bytes": v} for k, v in sizes.items()], [("what", "what"), ("bytes", "bytes")]))
    later = [r for r in rows if r["turn"] >= 3]
    print(f"\nturns >= 3: worst p50 speed-up {min(r['speedup_p50'] for r in later):.1f}x, "
          f"least reused {min(r['reused_pct'] for r in later):.0f} % (targets: 5x, 80 %)")
    print(f"results: {write_results('prefix_cache', {'machine': machine(), 'rows': rows, 'sizes': sizes})}")


if __name__ == "__main__":
    main()
