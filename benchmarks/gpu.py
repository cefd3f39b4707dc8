"""K3 on a GPU, in one script for a lent machine (issue 39): equivalence with the CPU, KDA against fla, decode
against the HBM roofline, training throughput and MFU, speculative decoding.

Runs with ``PYTHONPATH=src``, the standard library, torch and what ``k3.serve`` imports (numpy, safetensors,
llguidance); fla is optional (its rows are skipped without it). Each section is time-boxed and independent: a
failure is recorded in the JSON with its error and the next section runs.

    PYTHONPATH=src python benchmarks/gpu.py --out results/gpu.json                    # on the GPU machine
    PYTHONPATH=src python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu.json  # the same code, small, on a CPU
    python benchmarks/gpu.py --report benchmarks/results/gpu.json                     # the README's tables

Sections:
- **equivalence**: a random ``tiny`` model (fp32) through the engine on the CPU and on the device: greedy tokens
  of plain decoding, the prefix cache, n-gram speculation, compiled steps and packed MXFP4 experts, each compared
  with the CPU's plain tokens (and bf16 on the device, whose tokens may differ: reported, not required).
- **kda**: ``k3.ops.kda.chunked`` against fla's Triton ``chunk_kda`` at T = 4K … 64K (B 1, H 4, K = V 128), fp32 and
  bf16: forward time and the largest output difference relative to the output's scale.
- **decode** / **compiled_decode** (last: its compilation may run out the machine's time): the ``small`` preset
  (random weights, bf16) decoding at batch 1 and 64 after a 128-token prompt, eager / compiled, in tokens/s beside
  the roofline of the bytes one step must read (weights touched: every non-routed weight, and the expected number of
  distinct routed experts the batch picks) at the HBM bandwidth.
- **train**: forward + backward + AdamW steps of ``small`` and a ~1B configuration in bf16 autocast: tokens/s and
  MFU (6 × active non-embedding parameters per token against the bf16 dense peak).
- **speculative**: with a trained target (``--target``) and EAGLE-3 draft (``--draft``), plain, n-gram and EAGLE
  decoding through the engine on the device, batch 1 and 8, greedy, the text and edit workloads of
  ``benchmarks/speculative.py``; greedy outputs must equal plain decoding.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import table  # noqa: E402

from k3.config import preset  # noqa: E402
from k3.model.compiled import CompiledModel  # noqa: E402
from k3.model.lm import K3ForCausalLM  # noqa: E402
from k3.model.packed import PackedExperts, replace_experts  # noqa: E402
from k3.ops import kda, kda_fla  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.serve.engine.cache import PrefixCache  # noqa: E402
from k3.serve.engine.ngram import NGramDrafter  # noqa: E402
from k3.sizing.params import parameter_breakdown  # noqa: E402
from k3.tokenization.bpe import Tokenizer  # noqa: E402

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # published peaks
BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 tensor-core peaks


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int = 3) -> float:
    """Median seconds of ``fn()`` after one warm-up call (the statistical median: of 2 calls, their mean), the
    device's queue drained around each call."""
    fn()
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak(device: torch.device, table: dict[str, float]) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in table.items() if k in name), None)


# ------------------------------------------------------------------------------------------------ equivalence
def tiny_model() -> K3ForCausalLM:
    torch.manual_seed(0)
    m = K3ForCausalLM(preset("tiny"))
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # well-separated greedy choices, as the serving tests do
    return m.eval()


def tiny_tokenizer() -> Tokenizer:
    texts = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    return Tokenizer.train(texts, 512)


def engine_tokens(model: K3ForCausalLM, tok: Tokenizer, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    engine = Engine(model, tok, **kwargs)
    try:
        out = []
        for prompt in prompts:
            ids: list[int] = []
            for o in engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0)):
                if o.error:
                    raise RuntimeError(o.error)
                ids += o.token_ids
            out.append(ids)
        return out
    finally:
        engine.stop()


def equivalence(device: torch.device, quick: bool) -> dict:
    tok, cpu_model = tiny_tokenizer(), tiny_model()
    text = (Path(json.__file__).parent / "decoder.py").read_text()
    prompts = [tok.encode(text[i * 300:])[:n] for i, n in enumerate([5, 33, 64, 120])]
    prompts += [prompts[3][:70] + [9, 8, 7]]  # shares 70 tokens with the fourth: a cache hit
    reference = engine_tokens(cpu_model, tok, prompts)
    features = {
        "plain": lambda m: {},
        "prefix cache": lambda m: {"prefix_cache": PrefixCache(m.config.layer_kinds(), 2**28, 16, checkpoint_every=1)},
        "n-gram speculation": lambda m: {"drafter": NGramDrafter(min_n=1),
                                         "adaptive_draft": False},
        "compiled": lambda m: {"compile": CompiledModel(m, batches=(1,), sizes=(1, 16), tuned=False),
                               "prefill_chunk": 16},
        "packed MXFP4": None,
    }
    rows = []
    for name, kwargs in features.items():
        if quick and name == "compiled":
            continue
        for dtype in (torch.float32,) if name == "compiled" else (torch.float32, torch.bfloat16):
            start = time.perf_counter()
            model = copy.deepcopy(cpu_model)
            if name == "packed MXFP4":
                cpu_packed = replace_experts(copy.deepcopy(cpu_model), PackedExperts.pack).eval()
                model, kwargs_of = copy.deepcopy(cpu_packed), {}
                expected = engine_tokens(cpu_packed, tok, prompts)  # packed is lossy: against the CPU's packed run
            else:
                kwargs_of, expected = kwargs, reference
            model = model.to(device=device, dtype=dtype).eval()
            options = kwargs_of(model) if callable(kwargs_of) else kwargs_of
            got = engine_tokens(model, tok, prompts, **options)
            same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
            graphed = options["compile"].decode_step.graphed if "compile" in options else None
            rows.append({"feature": name, "dtype": str(dtype).removeprefix("torch."),
                         "tokens_equal": f"{same}/{sum(map(len, expected))}", "identical": got == expected,
                         "cuda_graph_replays": graphed and graphed.replays,
                         "seconds": round(time.perf_counter() - start, 1)})
            print(rows[-1], flush=True)
    return {"rows": rows}


# ------------------------------------------------------------------------------------------------ KDA
def kda_inputs(T: int, dtype: torch.dtype, device: torch.device, H: int = 4, K: int = 128):
    g = torch.Generator(device=device).manual_seed(T)
    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
    q, k = (torch.nn.functional.normalize(rand(1, T, H, K), dim=-1) for _ in range(2))
    v = rand(1, T, H, K)
    decay = -torch.nn.functional.softplus(rand(1, T, H, K)) * 0.1  # log-decay per channel, in (−∞, 0)
    beta = torch.sigmoid(rand(1, T, H))
    return [x.to(dtype) for x in (q, k, v)] + [decay, beta.to(dtype)]


def kda_section(device: torch.device, quick: bool) -> dict:
    try:
        from fla.ops.kda import chunk_kda
    except Exception as err:  # fla is optional
        chunk_kda, missing = None, f"{type(err).__name__}: {err}"
    else:
        missing = None
    rows = []
    for T in ([1024] if quick else [4096, 16384, 65536]):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, g, beta = kda_inputs(T, dtype, device)
            ours = functools.partial(kda.chunked, q, k, v, g, beta)
            row = {"T": T, "dtype": str(dtype).removeprefix("torch."), "k3_ms": 1e3 * timed(ours, device)}
            if chunk_kda is not None and device.type == "cuda":
                theirs = functools.partial(chunk_kda, q, k, v, g.to(dtype), beta)
                out, reference = ours()[0].float(), theirs()[0].float()
                row.update(fla_ms=1e3 * timed(theirs, device),
                           max_diff_rel=(out - reference).abs().max().item() / out.abs().max().item())
            rows.append(row)
            print(row, flush=True)
    return {"rows": rows, "fla": missing or "fla.ops.kda.chunk_kda"}


# ------------------------------------------------------------------------------------------------ decode
def step_bytes(model: K3ForCausalLM, batch: int) -> float:
    """Bytes one decode step reads: every weight outside the routed experts, and the routed experts the batch is
    expected to pick (uniform routing: ``E·(1 − (1 − k/E)^B)`` distinct experts per MoE layer)."""
    moe = model.config.moe
    expert_bytes, other = 0, 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert_bytes += p.numel() * p.element_size()
        else:
            other += p.numel() * p.element_size()
    touched = 1 - (1 - moe.num_experts_per_token / moe.num_experts) ** batch
    return other + expert_bytes * touched


@torch.inference_mode()
def decode_rate(model: K3ForCausalLM, step, batch: int, device: torch.device, steps: int) -> float:
    """Tokens/s of ``steps`` calls of ``step(ids, state)`` after a 128-token prompt (the same state each run)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, 128), device=device)
    _, prompt_state = model(ids, state=model.new_state(batch))
    token = ids[:, -1:]

    def run() -> None:
        state = prompt_state
        for _ in range(steps):
            _, state = step(token, state)
    return batch * steps / timed(run, device, repeat=2)


def decode_section(device: torch.device, quick: bool, compile: bool = False) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = K3ForCausalLM(preset("tiny" if quick else "small")).to(device=device, dtype=dtype).eval()
    bandwidth = peak(device, HBM_BYTES_PER_S)
    rows = []
    for batch in ((1, 4) if quick else (1, 64)):
        eager = decode_rate(model, lambda t, s: model(t, state=s), batch, device, 8 if quick else 32)
        row = {"batch": batch, "eager_tok_s": eager, "bytes_per_step": step_bytes(model, batch)}
        if compile:  # on CUDA: compiled steps launched from Python, then replayed as CUDA graphs
            for name, graphs in (("compiled_tok_s", False), ("cuda_graph_tok_s", True)):
                compiled = CompiledModel(model, batches=(batch,), sizes=(1,), tuned=False)
                graphed = compiled.decode_step.graphed
                if not graphs:
                    compiled.decode_step.graphed = None
                elif graphed is None:
                    continue
                row[name] = decode_rate(model, compiled.decode, batch, device, 8 if quick else 32)
                if graphs:
                    row["captures"] = graphed.captures
        if bandwidth:
            row["roofline_tok_s"] = batch * bandwidth / row["bytes_per_step"]
        rows.append(row)
        print(row, flush=True)
    return {"dtype": str(dtype), "hbm_bytes_per_s": bandwidth, "rows": rows}


# ------------------------------------------------------------------------------------------------ prefill
def perturbing_kda(model: K3ForCausalLM, relative: float = 4e-3) -> list:
    """Forward hooks that multiply every KDA layer's output by ``1 + relative·N(0, 1)`` (seeded): how far a
    bf16-sized change of KDA alone moves this model's logits — the scale `prefill_section`'s difference is read on."""
    gen = torch.Generator(device=model.device).manual_seed(0)

    def hook(module, inputs, output):  # noqa: ANN001, ANN202
        y, state = output
        noise = torch.randn(y.shape, generator=gen, device=y.device)
        return (y.float() * (1 + relative * noise)).to(y.dtype), state
    return [layer.mixer.register_forward_hook(hook) for layer in model.layers if layer.kind == "kda"]


def prefill_section(device: torch.device, quick: bool) -> dict:
    """A prompt's prefill on the model, KDA on `k3.ops.kda` (``K3_KDA_BACKEND=torch``) and on fla's kernels where
    they are enabled (`k3.ops.kda_fla`): seconds and the largest logit difference relative to the logits' scale,
    beside the difference a 0.4 % perturbation of every KDA output makes (`perturbing_kda`)."""
    import os

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = K3ForCausalLM(preset("tiny" if quick else "small")).to(device=device, dtype=dtype).eval()
    rows = []
    for T in ((64,) if quick else (4096, 16384)):
        ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
        row, logits = {"T": T, "dtype": str(dtype).removeprefix("torch.")}, {}
        for backend in ("torch", "auto"):
            os.environ["K3_KDA_BACKEND"] = backend
            with torch.inference_mode():
                run = lambda ids=ids: model(ids, state=model.new_state(1))[0]  # noqa: E731
                row[f"{backend}_s"] = timed(run, device, repeat=2)
                logits[backend] = run().float()
        os.environ["K3_KDA_BACKEND"] = "torch"
        hooks = perturbing_kda(model)
        with torch.inference_mode():
            logits["perturbed"] = model(ids, state=model.new_state(1))[0].float()
        for hook in hooks:
            hook.remove()
        os.environ.pop("K3_KDA_BACKEND")
        scale = logits["torch"].abs().max()
        row["max_diff_rel"] = ((logits["auto"] - logits["torch"]).abs().max() / scale).item()
        row["perturbed_rel"] = ((logits["perturbed"] - logits["torch"]).abs().max() / scale).item()
        row["speed_up"] = row["torch_s"] / row["auto_s"]
        rows.append(row)
        print(row, flush=True)
    return {"auto": "fla" if device.type == "cuda" and kda_fla._available() else "torch", "rows": rows}


# ------------------------------------------------------------------------------------------------ distributed
def dist_section(device: torch.device, quick: bool) -> dict:
    """`k3.dist.mesh.init_world` on this device, one process: the backend it picks (NCCL on CUDA) and an all-reduce
    and all-gather through it."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gloo import free_port, join  # the distributed tests' rendezvous (`benchmarks/distributed.py` uses it too)

    world = join(0, 1, free_port(), {})
    try:
        x = torch.arange(4.0, device=world.device)
        dist.all_reduce(x, group=world.group("dp_shard"))
        gathered = [torch.empty_like(x)]
        dist.all_gather(gathered, x)
        row = {"backend": dist.get_backend(), "device": str(world.device), "all_reduce_ok": x.tolist() == [0, 1, 2, 3],
               "all_gather_ok": gathered[0].tolist() == [0, 1, 2, 3]}
    finally:
        dist.destroy_process_group()
    print(row, flush=True)
    return {"rows": [row]}


# ------------------------------------------------------------------------------------------------ training
def billion() -> object:
    """~1B total parameters from the ``small`` shape, scaled (same mechanisms: KDA/MLA, AttnRes, LatentMoE)."""
    c = preset("small")
    return dataclasses.replace(
        c, vocab_size=32768, hidden_size=1536, num_layers=16,
        kda=dataclasses.replace(c.kda, num_heads=12, head_dim=128, value_head_dim=128, decay_rank=64),
        mla=dataclasses.replace(c.mla, num_heads=12, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_shared_head_dim=64, v_head_dim=128),
        moe=dataclasses.replace(c.moe, num_experts=32, num_experts_per_token=4, expert_hidden=768, shared_hidden=768,
                                latent_dim=768, dense_hidden=4096),
        vision=dataclasses.replace(c.vision, out_dim=1536))


def train_seconds(config, device: torch.device, batch: int, seq: int, repeat: int) -> float:
    """Median seconds of one forward + backward + AdamW step on random tokens (bf16 autocast on CUDA)."""
    torch.manual_seed(0)
    with device:  # initialised where it trains
        model = K3ForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, _ = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed(step, device, repeat)


def train_section(device: torch.device, quick: bool) -> dict:
    rows = []
    configs = {"tiny": preset("tiny")} if quick else {"small": preset("small"), "~1B": billion()}
    flops_peak = peak(device, BF16_FLOPS)
    batch, seq = (2, 64) if quick else (8, 2048)
    for name, config in configs.items():
        seconds = train_seconds(config, device, batch, seq, 2 if quick else 3)
        total, active = parameter_breakdown(config)["total"]
        embeddings = config.vocab_size * config.hidden_size * 2
        tokens_s = batch * seq / seconds
        row = {"model": name, "total_params": total, "active_params": active, "batch": batch, "seq": seq,
               "step_s": seconds, "tokens_s": tokens_s,
               "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
        if flops_peak:
            row["mfu"] = 6 * (active - embeddings) * tokens_s / flops_peak
        rows.append(row)
        print(row, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return {"bf16_peak_flops": flops_peak, "rows": rows}


# ------------------------------------------------------------------------------------------------ speculation
def speculative_section(device: torch.device, quick: bool, target: str, draft: str) -> dict:
    import speculative as bench  # benchmarks/speculative.py: its workloads and timing

    from k3.model.checkpoint import load_model
    from k3.serve.options import EngineOptions

    if not Path(target).exists():
        return {"skipped": f"no target at {target}"}
    model, tok = load_model(Path(target))
    model = model.to(device).eval()
    options = EngineOptions(max_batch=8, prefix_cache=False)
    drafters = {"ngram": "ngram", **({"eagle": draft} if draft and Path(draft).exists() else {})}
    rows = []
    for workload in ("text", "edit"):
        for batch_size in ((1,) if quick else (1, 8)):
            batch = bench.prompts(tok, batch_size, workload)
            params = SamplingParams(max_tokens=16 if quick else 64, temperature=0.0)
            engines = {"plain": bench.build(options, model, tok, None)}
            for name, path in drafters.items():
                engines[name] = bench.build(dataclasses.replace(options, draft=path, num_draft_tokens=4,
                                                                always_draft=True), model, tok, None)
            bench.timed_pass(engines, batch, params)  # warm-up
            passes = [bench.timed_pass(engines, batch, params) for _ in range(1 if quick else 3)]
            plain = statistics.median(sum(map(len, p["plain"][1])) / p["plain"][0] for p in passes)
            for name in drafters:
                same = all(p[name][1] == p["plain"][1] for p in passes)
                rate = statistics.median(sum(map(len, p[name][1])) / p[name][0] for p in passes)
                stats = engines[name].speculation
                rows.append({"workload": workload, "drafter": name, "batch": batch_size, "plain_tok_s": plain,
                             "spec_tok_s": rate, "speed_up": rate / plain, "greedy_equal": same,
                             "acceptance": stats["accepted"] / max(1, stats["drafted"])})
                print(rows[-1], flush=True)
            for engine in engines.values():
                engine.stop()
    return {"rows": rows}


def report(results: dict) -> str:
    """The README's tables from a results file."""
    columns = {"equivalence": ["feature", "dtype", "tokens_equal", "identical", "cuda_graph_replays"],
               "decode": ["batch", "eager_tok_s", "roofline_tok_s", "bytes_per_step"],
               "compiled_decode": ["batch", "eager_tok_s", "compiled_tok_s", "cuda_graph_tok_s", "captures",
                                   "roofline_tok_s"],
               "prefill": ["T", "dtype", "torch_s", "auto_s", "speed_up", "max_diff_rel", "perturbed_rel"],
               "dist": ["backend", "device", "all_reduce_ok", "all_gather_ok"],
               "train": ["model", "total_params", "active_params", "batch", "seq", "tokens_s", "mfu", "peak_gib"],
               "speculative": ["workload", "drafter", "batch", "plain_tok_s", "spec_tok_s", "speed_up", "acceptance",
                               "greedy_equal"],
               "kda": ["T", "dtype", "k3_ms", "fla_ms", "max_diff_rel"]}
    parts = [f"{results.get('device')}, torch {results.get('torch')}"]
    for name, cols in columns.items():
        section = results.get(name)
        if section is None:
            continue
        parts.append(f"\n**{name}**" + (f": {section['error']}" if "error" in section else ""))
        if section.get("rows"):
            parts.append(table(section["rows"], [(c, c) for c in cols]))
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes: checks the script itself on a CPU")
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    parser.add_argument("--target", default="runs/mini")
    parser.add_argument("--draft", default="runs/mini-draft30")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--report", default=None, help="print the tables of this results file, run nothing")
    args = parser.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
    device = torch.device(args.device)
    results: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device)
                     if device.type == "cuda" else "cpu", "quick": args.quick}
    sections = {"equivalence": lambda: equivalence(device, args.quick),  # in order of need: kda's autotuning
                "decode": lambda: decode_section(device, args.quick),       # and compilation may run out the time
                "train": lambda: train_section(device, args.quick),
                "speculative": lambda: speculative_section(device, args.quick, args.target, args.draft),
                "kda": lambda: kda_section(device, args.quick),
                "prefill": lambda: prefill_section(device, args.quick),
                "dist": lambda: dist_section(device, args.quick),
                "compiled_decode": lambda: decode_section(device, args.quick, compile=True)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, run in sections.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            results[name] = run()
        except Exception as err:
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(results, indent=1, default=str))  # kept as each section ends
    print(report(results))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
