"""The prefix cache on multi-turn workloads: time to first token per turn and prompt tokens reused, cache off and on
side by side (each prompt runs on the cache-off engine, then on the cache-on engine, in one process).

Three workloads on the `small` preset, run through the engine as a server runs it (one request at a time,
conversations interleaved turn by turn), at `k3 serve`'s cache defaults (64-token blocks, a checkpoint every 8):

* **chat**: a shared 300-word system prompt, 4 conversations of 6 turns; each turn adds a 40-word user message
  and a 40-word answer; **chat-long** the same with a 1,500-word system prompt;
* **agent**: 3 tasks of 6 turns sharing the agent's 1,000-word system prompt (its instructions and tool
  descriptions), each with its own 40-word task; each turn appends a 250-word tool output (as a tool message) and a
  40-word answer.

Random weights make timing independent of what the model says, but their tokens are not what a tokenizer would
write, so the next turn's rendering of an answer would differ from the tokens generated; the model is therefore
*scripted* (a bias on its logits) to answer with the canonical tokens of a fixed text, as a trained model
practically does. The chat's system messages are marked as its shared head (`k3.chat.shared_head`), as `k3 serve`
does. Reported per turn: TTFT p50 / p99 off and on, their ratio, the share of prompt tokens reused, and the share of
what the cache could know (the longest prefix the prompt shares with an earlier prompt and its answer: the rest is
new to the server); bytes per cached token. Targets (issue 36): first turns ≥ 0.95×; later turns reuse ≥ 95 % with
TTFT p50 ≥ 3× lower (chat), ≥ 7× (chat-long), ≥ 3× from turn 2 (agent).

    python benchmarks/prefix_cache.py [--compile]       # eager: ~5 min on 2 cores; compiled: + its graphs' build
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import preset  # noqa: E402
from k3.model.compiled import CompiledModel  # noqa: E402
from k3.chat import native as chat  # noqa: E402
from k3.chat import shared_head  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.engine.cache import PrefixCache  # noqa: E402
from k3.serve.options import EngineOptions  # noqa: E402
from k3.tokenization.bpe import Tokenizer  # noqa: E402

TURNS = 6
ANSWER_WORDS = 40


class Scripted(K3ForCausalLM):
    """``small`` whose logits are biased to answer ``script`` after a prompt of ``start`` tokens (module docstring);
    the bias is one addition per step, so timing is the model's. Compiled graphs trace no bias (the position is
    not a graph input): `ScriptedSteps` adds it to what they return."""

    start: int = 0
    script: list[int] = []

    def bias(self, logits: torch.Tensor, ids: torch.Tensor, position: int) -> None:
        """Raise the script's next token in the last-position ``logits`` of ``ids`` read from ``position``."""
        generated = position + ids.shape[1] - self.start
        if 0 <= generated < len(self.script):
            logits[..., self.script[generated]] += 1e4

    def forward_groups(self, groups, full=None, replay=None):
        results = super().forward_groups(groups, full, replay)
        if not torch.compiler.is_compiling():
            for (ids, state), (logits, _) in zip(groups, results):
                self.bias(logits, ids, state.position)
        return results


class ScriptedSteps(CompiledModel):
    """The engine's compiled steps of a `Scripted` model, with its bias (twice where a step ran eagerly: the same
    argmax)."""

    def step(self, input_ids, state):
        logits, after = super().step(input_ids, state)
        self.model.bias(logits, input_ids, state.position)
        return logits, after


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
    system = {"role": "system", "content": text(rng, 1000)}
    return [[system, {"role": "user", "content": text(rng, 40)}] for _ in range(3)]


def first_token_seconds(engine: Engine, prompt: list[int], marks: tuple[int, ...], params: SamplingParams
                        ) -> tuple[float, list[int], int]:
    done: list = []
    start = time.perf_counter()
    engine.add_requests([(prompt, params, None, done.append)], marks=marks)
    first = None
    while engine.has_work():
        engine.step()
        if first is None and any(o.token_ids for o in done):
            first = time.perf_counter() - start
    if done[-1].finish_reason == "error":
        raise RuntimeError(done[-1].error)
    return first, [t for o in done for t in o.token_ids], done[-1].cached_tokens


def known(prompt: list[int], seen: list[list[int]]) -> int:
    """The longest prefix ``prompt`` shares with one of the ``seen`` token sequences."""
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return max((common(prompt, s) for s in seen), default=0)


def run(name: str, model: Scripted, engines: dict[str, Engine], tok: Tokenizer, seed: int = 0) -> list[dict]:
    """One pass over the workload, each prompt on every engine in turn: per (conversation, turn, engine) the TTFT,
    prompt length, cached tokens and the prefix an earlier request had (`known`)."""
    rng = random.Random(seed + 1)
    histories, rows, seen = workload(name, seed), [], []
    end = chat.stop_ids(tok)[0]
    for turn in range(TURNS):
        for c, history in enumerate(histories):
            if name.startswith("chat"):
                history.append({"role": "user", "content": text(rng, 40)})
            elif turn:
                history.append({"role": "tool", "tool_call_id": f"call{turn}", "content": text(rng, 250)})
            prompt = chat.render(history, tok, "instruct")
            head = shared_head(chat, history, prompt, tok, "instruct")
            answer = text(rng, ANSWER_WORDS)
            model.start, model.script = len(prompt), tok.encode(answer) + [end]
            params = SamplingParams(max_tokens=len(model.script), temperature=0, stop_token_ids=(end,))
            before = min(known(prompt, seen), len(prompt) - 1)  # a request computes its last token's logits
            seen.append(prompt + model.script)
            for cache, engine in engines.items():
                seconds, tokens, cached = first_token_seconds(engine, prompt, (head,) if head else (), params)
                assert tokens == model.script, "the scripted answer"
                rows.append({"turn": turn + 1, "conversation": c, "cache": cache, "ttft_s": seconds,
                             "prompt": len(prompt), "cached": cached, "known": before})
            history.append({"role": "assistant", "content": answer})
    return rows


def summarise(name: str, rows: list[dict]) -> list[dict]:
    off, on = ([r for r in rows if r["cache"] == cache] for cache in ("off", "on"))
    out = []
    for turn in range(1, TURNS + 1):
        a = [r["ttft_s"] * 1e3 for r in off if r["turn"] == turn]
        b = [r["ttft_s"] * 1e3 for r in on if r["turn"] == turn]
        prompt = sum(r["prompt"] for r in on if r["turn"] == turn)
        cached = sum(r["cached"] for r in on if r["turn"] == turn)
        known_tokens = sum(r["known"] for r in on if r["turn"] == turn)
        p99 = lambda xs: sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]  # noqa: E731
        out.append({"workload": name, "turn": turn, "prompt_tokens": prompt, "reused_pct": 100 * cached / prompt,
                    "reused_of_known_pct": 100 * cached / known_tokens if known_tokens else float("nan"),
                    "ttft_p50_off_ms": statistics.median(a), "ttft_p50_on_ms": statistics.median(b),
                    "ttft_p99_off_ms": p99(a), "ttft_p99_on_ms": p99(b),
                    "speedup_p50": statistics.median(a) / statistics.median(b)})
    return out


TARGETS = {"chat": (2, 3.0), "chat-long": (2, 7.0), "agent": (2, 3.0)}  # from this turn on: p50 speed-up


def main() -> None:
    compiled = "--compile" in sys.argv[1:]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = preset("small")
    model = Scripted(config).eval()
    texts = [p.read_text() for p in sorted(Path(random.__file__).parent.glob("json/*.py"))]
    tok = Tokenizer.train(texts, config.vocab_size)
    options = EngineOptions(max_model_len=config.context_length)  # k3 serve's cache defaults
    steps = ScriptedSteps(model) if compiled else None
    if compiled:  # one set of graphs for both engines, built before anything is timed; one request at a time
        print(f"compiled in {steps.warm_up(1, config.context_length):.0f} s", flush=True)
    off = Engine(model, tok, max_model_len=options.max_model_len, max_batch=options.max_batch,
                 prefill_chunk=options.prefill_chunk, compile=steps)
    rows = []
    for name in ("chat", "chat-long", "agent"):  # a new cache per workload
        cache = PrefixCache.for_model(model, tok, int(options.prefix_cache_gb * 2**30), options.cache_block_tokens,
                                      options.cache_checkpoint_every, options.cache_page_blocks)
        on = Engine(model, tok, max_model_len=options.max_model_len, max_batch=options.max_batch,
                    prefill_chunk=options.prefill_chunk, prefix_cache=cache, compile=steps)
        rows += summarise(name, run(name, model, {"off": off, "on": on}, tok))
    print(table(rows, [("workload", "workload"), ("turn", "turn"), ("prompt_tokens", "prompt tokens"),
                       ("reused_pct", "reused %"), ("reused_of_known_pct", "reused % of known"),
                       ("ttft_p50_off_ms", "TTFT p50 off ms"),
                       ("ttft_p50_on_ms", "TTFT p50 on ms"), ("speedup_p50", "p50 speed-up"),
                       ("ttft_p99_off_ms", "TTFT p99 off ms"), ("ttft_p99_on_ms", "TTFT p99 on ms")]))
    sizes = cache.sizes()
    print("\n" + table([{"what": k, "bytes": v} for k, v in sizes.items()], [("what", "what"), ("bytes", "bytes")]))
    verdicts = []
    for name, (turn, speedup) in TARGETS.items():
        first = next(r for r in rows if r["workload"] == name and r["turn"] == 1)
        later = [r for r in rows if r["workload"] == name and r["turn"] >= turn]
        verdicts.append(f"{name}: first turn {first['speedup_p50']:.2f}x (target 0.95x); turns >= {turn}: worst "
                        f"p50 speed-up {min(r['speedup_p50'] for r in later):.1f}x (target {speedup:g}x), least "
                        f"reused {min(r['reused_pct'] for r in later):.0f} % (target 95 %), "
                        f"{min(r['reused_of_known_pct'] for r in later):.0f} % of what an earlier request had")
    print("\n" + "\n".join(verdicts))
    payload = {"machine": machine(), "compiled": compiled, "rows": rows, "sizes": sizes, "verdicts": verdicts}
    print(f"results: {write_results('prefix_cache' + ('_compiled' if compiled else ''), payload)}")


if __name__ == "__main__":
    main()
