"""How fast does the K3 backbone train and decode on this CPU — and against transformers, with identical weights?

1. Apples to apples: a ~31M-parameter Kimi Linear model (d=256, 8 layers, 16 experts top-2) built
   by transformers, converted with `k3.interop.kimi_linear.from_transformers`, both run in this process:
   training tokens/s (forward+backward, batch 4 x 512) and decode tokens/s (batch 1, after a prompt).
2. The `tiny` and `small` presets: training tokens/s and decode tokens/s at batch 1 and 8, contexts 512
   and 4096, plus an all-KDA variant of `small` whose decode time per token should not grow with context.

Decode runs as in a serving process, without gradients: the presets decode before they train, and the Kimi Linear
pair's gradients are dropped after its training rows.

"kimi-k3 compiled" rows decode with `k3.model.compiled.CompiledModel` (``k3 generate --compile``: inductor with
frozen weights and its C++ GEMM templates); the first call's time (the compilation, or a load from inductor's disk
cache) is reported beside them, and an operator profile of `small`'s compiled step says where its time goes.

Every k3 decode figure comes with its roofline (`k3.sizing.roofline`): the bytes the step must read (weights, the
selected experts' weights, KDA states, MLA caches) over the measured copy bandwidth, and its FLOPs over the measured
matmul rate; "% of roof" is that limit's step time over the measured step time.

    python benchmarks/model.py            # ~10 min on 2 cores
    python benchmarks/model.py --quick    # fewer contexts, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import copy_gbps, machine, matmul_gflops, median_seconds, table, write_results  # noqa: E402
from timing import timed_decode  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import preset  # noqa: E402
from k3.sizing.roofline import decode_cost  # noqa: E402
from k3.model.state import DecoderState  # noqa: E402


def train_tokens_per_s(step, batch: int, seq: int) -> float:
    seconds, _ = median_seconds(step, min_repeats=3, budget_s=4.0)
    return batch * seq / seconds


def k3_train_step(model: K3ForCausalLM, ids: torch.Tensor):
    def step():
        logits, _ = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        model.zero_grad(set_to_none=True)
        loss.backward()
    return step


def prefilled(model: K3ForCausalLM, batch: int, context: int) -> tuple[torch.Tensor, DecoderState]:
    """A first decode token ``[batch, 1]`` and the state after ``context`` random prompt tokens (eager prefill)."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        _, state = model(torch.randint(0, vocab, (batch, context)), state=model.new_state(batch))
    return torch.randint(0, vocab, (batch, 1)), state


def k3_decode_tokens_per_s(model: K3ForCausalLM, batch: int, context: int, steps: int = 32) -> float:
    """Prefill ``context`` tokens, then time single-token decode calls (batch-wide; `timed_decode`)."""
    token, state = prefilled(model, batch, context)
    held = [token, state]

    def step() -> None:
        logits, held[1] = model(held[0], state=held[1])
        held[0] = logits[:, -1:].argmax(-1)

    with torch.no_grad():
        step()  # warm-up
        return timed_decode(step, batch, steps)


def compiled_decoder(model: K3ForCausalLM, batch: int, context: int,
                     steps: int = 32) -> tuple[Callable[[], float], float]:
    """The compiled decode step (`k3.model.compiled.CompiledModel`, tuned: ``k3 generate --compile``) at ``batch``:
    (a function giving its tokens/s after a fresh ``context``-token prefill, `timed_decode`, as often as called;
    seconds of its first call — compilation or inductor's disk cache)."""
    from k3.model.compiled import CompiledModel

    compiled = CompiledModel(model)
    held: list = []

    def step() -> None:
        logits, held[1] = compiled.decode(held[0], held[1])
        held[0] = logits[:, -1].argmax(-1, keepdim=True)

    def rate() -> float:
        held[:] = prefilled(model, batch, context)
        step()
        return timed_decode(step, batch, steps)

    held[:] = prefilled(model, batch, context)
    step()  # compiles (or loads inductor's on-disk cache)
    return rate, sum(compiled.compile_seconds.values())


def k3_compiled_decode(model: K3ForCausalLM, batch: int, context: int, steps: int = 32) -> tuple[float, float]:
    """`k3_decode_tokens_per_s` with the compiled decode step (`compiled_decoder`): (tokens/s, seconds of the
    first call — compilation or inductor's disk cache)."""
    rate, compile_s = compiled_decoder(model, batch, context, steps)
    return rate(), compile_s


def operator_profile(model: K3ForCausalLM, context: int, steps: int = 20, top: int = 12) -> list[dict]:
    """Where a compiled batch-1 decode step's time goes: torch.profiler's self CPU time per operator and per
    generated C++ kernel (inductor's ``cpp.enable_kernel_profile``), as ms per step and share of the step."""
    from torch._inductor import config as inductor
    from torch.profiler import profile

    from k3.model.compiled import CompiledModel

    inductor.cpp.enable_kernel_profile = True  # a record per generated kernel: the graph's time, attributed
    compiled = CompiledModel(model)
    token, state = prefilled(model, 1, context)
    for _ in range(3):  # each step continues the last, as decoding does (the MLA caches grow in place)
        _, state = compiled.decode(token, state)
    with profile() as prof:
        for _ in range(steps):
            _, state = compiled.decode(token, state)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [{"operator": e.key[:60], "calls_per_step": e.count / steps, "ms_per_step": e.self_cpu_time_total / 1e3
             / steps, "share": e.self_cpu_time_total / total} for e in events[:top]]
    return rows + [{"operator": "(all)", "ms_per_step": total / 1e3 / steps, "share": 1.0}]


def kimi_linear_pair(vocab_size: int = 32000, pad_token_id: int | None = None):
    """A transformers Kimi Linear model (d=256, 8 layers, 16 experts top-2; ~31M parameters at the default
    vocabulary) and its k3 conversion (identical weights)."""
    import peers

    from k3.interop.kimi_linear import from_transformers

    tf = peers.transformers_kimi_linear()
    config = tf.KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=1024, moe_intermediate_size=128,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, num_local_experts=16, num_experts_per_tok=2,
        n_shared_experts=1, linear_num_heads=4, linear_head_dim=64, pad_token_id=pad_token_id, bos_token_id=None,
        eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = tf.KimiLinearForCausalLM(config)
    return hf, from_transformers(hf)


def hf_train_step(model, ids: torch.Tensor):
    def step():
        out = model(ids, labels=ids)
        model.zero_grad(set_to_none=True)
        out.loss.backward()
    return step


def hf_decode_tokens_per_s(model, batch: int, context: int, steps: int = 32) -> float:
    vocab = model.config.vocab_size
    with torch.no_grad():
        out = model(torch.randint(0, vocab, (batch, context)), use_cache=True)
        held = [out.cache, torch.randint(0, vocab, (batch, 1))]

        def step() -> None:
            out = model(held[1], cache=held[0], use_cache=True)
            held[0], held[1] = out.cache, out.logits[:, -1:].argmax(-1)

        step()  # warm-up
        return timed_decode(step, batch, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    contexts = [512] if args.quick else [512, 4096]
    rows: list[dict] = []
    bandwidth, flops_rate = copy_gbps() * 1e9, matmul_gflops() * 1e9

    def roof(row: dict, config) -> dict:  # noqa: ANN001
        """``row`` with its roofline: the limit's step time, the roof it is under, the fraction reached."""
        cost = decode_cost(config, row["batch"], row["context"])
        limit = cost.seconds(bandwidth, flops_rate)
        row.update(roof_ms=1e3 * limit, bound=cost.bound(bandwidth, flops_rate), step_ms=1e3 * row["batch"]
                   / row["tokens_per_s"], roof_fraction=limit * row["tokens_per_s"] / row["batch"])
        return row

    # 1. identical weights, transformers vs k3
    hf, ours = kimi_linear_pair()
    pair = f"kimi-linear-{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M"
    ids = torch.randint(0, 32000, (4, 513))
    hf.train(), ours.train()
    for name, step in (("transformers", hf_train_step(hf, ids[:, :-1])), ("kimi-k3", k3_train_step(ours, ids))):
        rows.append({"model": pair, "impl": name, "task": "train fwd+bwd", "batch": 4, "context": 512,
                     "tokens_per_s": train_tokens_per_s(step, 4, 512)})
        print(json.dumps(rows[-1]), flush=True)
    hf.eval(), ours.eval()
    hf.zero_grad(set_to_none=True), ours.zero_grad(set_to_none=True)  # decode as a serving process: no gradients
    for context in contexts:
        for name, fn in (("transformers", hf_decode_tokens_per_s), ("kimi-k3", k3_decode_tokens_per_s)):
            rows.append(roof({"model": pair, "impl": name, "task": "decode", "batch": 1, "context": context,
                              "tokens_per_s": fn(hf if name == "transformers" else ours, 1, context)}, ours.config))
            print(json.dumps(rows[-1]), flush=True)
        tokens_per_s, compile_s = k3_compiled_decode(ours, 1, context)
        rows.append(roof({"model": pair, "impl": "kimi-k3 compiled", "task": "decode", "batch": 1, "context": context,
                          "tokens_per_s": tokens_per_s, "compile_s": compile_s}, ours.config))
        print(json.dumps(rows[-1]), flush=True)
    del hf, ours

    # 2. k3 presets
    all_kda = preset("small")
    all_kda.mla_layers = []
    variants = {"tiny": preset("tiny"), "small": preset("small"), "small-all-kda": all_kda}
    for name, config in variants.items():
        torch.manual_seed(0)
        model = K3ForCausalLM(config).eval()
        # decode first, as a serving process would (after a training step in this process the same compiled
        # decode graph of `small` ran up to 1.75x slower: the gradients held and the training's heap)
        for batch in (1, 8):
            for context in contexts:
                rows.append(roof({"model": name, "impl": "kimi-k3", "task": "decode", "batch": batch,
                                  "context": context, "tokens_per_s": k3_decode_tokens_per_s(model, batch, context)},
                                 config))
                print(json.dumps(rows[-1]), flush=True)
                if name == "small":
                    tokens_per_s, compile_s = k3_compiled_decode(model, batch, context)
                    rows.append(roof({"model": name, "impl": "kimi-k3 compiled", "task": "decode", "batch": batch,
                                      "context": context, "tokens_per_s": tokens_per_s, "compile_s": compile_s},
                                     config))
                    print(json.dumps(rows[-1]), flush=True)
        if name != "small-all-kda":
            ids = torch.randint(0, config.vocab_size, (4, 513))
            model.train()
            rows.append({"model": name, "impl": "kimi-k3", "task": "train fwd+bwd", "batch": 4, "context": 512,
                         "tokens_per_s": train_tokens_per_s(k3_train_step(model, ids), 4, 512)})
            print(json.dumps(rows[-1]), flush=True)

    torch.manual_seed(0)
    profiled = K3ForCausalLM(variants["small"]).eval()
    profile_rows = [{"context": context, **row} for context in contexts for row in operator_profile(profiled, context)]

    def find(model, impl, task, context=512, batch=1):
        return next(r["tokens_per_s"] for r in rows if (r["model"], r["impl"], r["task"], r["context"], r["batch"])
                    == (model, impl, task, context, batch if task == "decode" else 4))

    summary = {
        "train_speedup_vs_transformers": find(pair, "kimi-k3", "train fwd+bwd") / find(pair, "transformers",
                                                                                       "train fwd+bwd"),
        "decode_speedup_vs_transformers": {c: find(pair, "kimi-k3", "decode", c) / find(pair, "transformers",
                                                                                      "decode", c)
                                           for c in contexts},
        "compiled_decode_speedup_vs_transformers": {c: find(pair, "kimi-k3 compiled", "decode", c)
                                                    / find(pair, "transformers", "decode", c) for c in contexts},
        "all_kda_decode_time_ratio_longest_vs_512": find("small-all-kda", "kimi-k3", "decode", contexts[-1])
        and find("small-all-kda", "kimi-k3", "decode", 512) / find("small-all-kda", "kimi-k3", "decode", contexts[-1]),
    }
    print()
    print(f"roofs: copy bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 matmul {flops_rate / 1e9:.1f} GFLOP/s")
    print(table(rows, [("model", "model"), ("impl", "implementation"), ("task", "task"), ("batch", "batch"),
                       ("context", "context"), ("tokens_per_s", "tokens/s"), ("step_ms", "ms / step"),
                       ("roof_ms", "roofline ms"), ("bound", "bound"), ("roof_fraction", "of roof"),
                       ("compile_s", "first call s")]))
    print("\nwhere the compiled batch-1 decode step of small goes (torch.profiler self CPU time):")
    print(table(profile_rows, [("context", "context"), ("operator", "operator"), ("calls_per_step", "calls / step"),
                               ("ms_per_step", "ms / step"), ("share", "share")]))
    print(json.dumps(summary, indent=2))
    path = write_results("model", {"machine": machine(), "copy_gbps": bandwidth / 1e9,
                                   "matmul_gflops": flops_rate / 1e9, "rows": rows, "summary": summary,
                                   "compiled_decode_profile": profile_rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
