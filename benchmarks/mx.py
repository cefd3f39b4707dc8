"""MX microscaling (SPEC §7, §10): what MXFP4-packed routed experts save, what they cost at decode, and what
quantization-aware training (QAT) buys over post-training quantization (PTQ) at equal tokens.

1. Bytes and memory, ``small`` and a MoE-heavy variant (64 routed experts of 512: 93 % of the parameters, like
   the release's 97.9 %; parameter and routed-expert counts are in the JSON; randomly initialised, seed 0 —
   bytes, memory and speed do not depend on the values): bytes per routed-expert parameter and per model
   parameter (state_dict bytes ÷ the full-precision parameter count) as fp32, bf16 (computed) and MXFP4 packed;
   ``model.safetensors`` of the full-precision checkpoint and of its ``k3 quantize`` output; resident memory after
   `k3.model.checkpoint.load_model` of each, each in a fresh process.
2. Greedy decode tokens/s at batch 1 on each (a 32-token prefill, then ``--decode-tokens`` single-token calls
   with a `DecoderState`), side by side: fp32, bf16, the fake-quantized float model (MX on, float experts), and
   the packed checkpoint — through the packed-byte kernel (`k3.ops.mxfp4_kernel`: each chosen expert's bytes
   read once, never decoded to floats) and through decoded weights (`k3.ops.mx.dequantize`, then a matmul: the
   PyTorch path), then with MXFP8 E4M3 inputs. "expert products ms/token" times one token's routed-experts layer
   (its top-k experts' w1, w3, w2, the activation and the weighted sum: for the packed checkpoint one call of
   `k3.ops.mxfp4_kernel.experts`), times the MoE layers; the roofline is the bytes those experts read per token over
   the machine's copy bandwidth (a 256 MiB copy).
3. Quality, ``mini`` preset (8 experts, top-2), ``--steps`` × 2,048 tokens at length 256, 2
   seeds, one tokenizer: full-precision training (FP), evaluated as trained and after PTQ (its experts packed
   round-to-nearest, MXFP4 weights + MXFP8 E4M3 inputs), and QAT from scratch (``qat="mx"``: the same
   formats fake-quantized with a straight-through estimator) on identical data and initialisation. PTQ and QAT
   losses are both computed with quantized experts, so they compare.

Everything runs on ``--threads`` torch threads (default 1): with two, OpenMP's spinning workers make small
operators 10–20× slower whenever another process is busy on the machine (`k3.train.threads`), and a fixed count
keeps FP and QAT numerically comparable.

    python benchmarks/mx.py                      # ~20 min on 2 cores
    python benchmarks/mx.py --steps 30 --decode-tokens 16   # a quick look
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, median_seconds, peak_rss_mib, reset_peak_rss, rss_mib, run_isolated, table, write_results  # noqa: E402,E501

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import K3Config, preset  # noqa: E402
from k3.model.checkpoint import WEIGHTS, load_model, save_model  # noqa: E402
from k3.model.packed import PackedExperts  # noqa: E402
from k3.model.quantize import pack_model, quantize_checkpoint  # noqa: E402
from k3.model.width import Experts  # noqa: E402
from k3.tokenization.bpe import Tokenizer  # noqa: E402
from k3.train.pretrain import TrainConfig, train  # noqa: E402

MIB = 2**20
PROMPT = 32
E4M3 = "mxfp8_e4m3"


def experts_of(model: torch.nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def state_bytes(model: torch.nn.Module, float_bytes: int | None = None) -> int:
    """Bytes of ``model.state_dict()``; ``float_bytes`` recounts floating-point tensors at that width."""
    return sum(t.numel() * (float_bytes if float_bytes and t.is_floating_point() else t.element_size())
               for t in model.state_dict().values())


# ---------------------------------------------------------------------- 1. bytes and resident memory
def _load_case(path: str) -> dict:
    """In a fresh process: resident memory before and after `load_model` of ``path``, and after ``malloc_trim``
    (loading first builds the float model, so the heap keeps freed pages until trimmed)."""
    before = rss_mib()
    reset_peak_rss()
    t0 = time.perf_counter()
    loaded = load_model(Path(path))  # kept until the measurements are taken
    row = {"load_s": time.perf_counter() - t0, "rss_before_mib": before, "rss_mib": rss_mib(),
           "model_rss_mib": rss_mib() - before, "peak_mib": peak_rss_mib()}
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {**row, "trimmed_model_rss_mib": rss_mib() - before, "modules": len(list(loaded[0].modules()))}


def memory_rows(fp_dir: Path, packed_dir: Path) -> list[dict]:
    fp, _ = load_model(fp_dir)
    packed, _ = load_model(packed_dir)
    params = sum(p.numel() for p in fp.parameters())
    expert_params = sum(p.numel() for e in experts_of(fp) for p in e.parameters())
    packed_bytes = sum(b.numel() * b.element_size() for e in experts_of(packed) for b in e.buffers())
    rows = []
    formats = (("fp32 (full precision)", fp, 4, fp_dir), ("bf16 (computed, no file)", fp, 2, None),
               ("MXFP4 packed (k3 quantize)", packed, None, packed_dir))
    for name, model, width, ckpt in formats:
        row = {"format": name, "expert_params": expert_params, "params": params,
               "expert_bytes_per_param": width or packed_bytes / expert_params,
               "state_mib": state_bytes(model, width) / MIB, "bytes_per_param": state_bytes(model, width) / params}
        if ckpt is not None:
            row["file_mib"] = (ckpt / WEIGHTS).stat().st_size / MIB
            row.update(run_isolated(Path(__file__), ["--load", str(ckpt)], timeout_s=300))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------- 2. decode speed
def set_mx(model: K3ForCausalLM, weights: str | None, inputs: str | None) -> K3ForCausalLM:
    for e in experts_of(model):
        if not isinstance(e, PackedExperts):
            e.weight_format = weights
        e.input_format = inputs
    return model


def bandwidth_gb_s() -> float:
    """Memory bandwidth of a 256 MiB copy (bytes read + written per second), the roofline's denominator."""
    src = torch.ones(64 * MIB)
    dst = torch.empty_like(src)
    seconds, _ = median_seconds(lambda: dst.copy_(src), min_repeats=5, budget_s=1.0)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def expert_bytes(experts: Experts, dtype: torch.dtype) -> int:
    """The bytes one expert's product reads: its packed buffers, or its float weights at ``dtype``'s width."""
    if isinstance(experts, PackedExperts):
        return sum(b.numel() * b.element_size() for b in experts.packed[0].buffers())
    return (experts.gate_up[0].numel() + experts.down[0].numel()) * torch.finfo(dtype).bits // 8


@torch.no_grad()
def decode(model: K3ForCausalLM, tokens: int, dtype: torch.dtype) -> tuple[float, list[int], torch.Tensor, float]:
    """(tokens/s, greedy tokens, prefill logits, ms per token in the routed experts: one token's layer with its
    top-k experts, times the MoE layers) at batch 1."""
    prompt = torch.arange(1, PROMPT + 1)[None] * 37 % model.config.vocab_size
    logits, prefilled = model(prompt, state=model.new_state(1))
    first = logits[:, -1:].argmax(-1)

    def run() -> list[int]:
        token, state, out = first, prefilled, []
        for _ in range(tokens):
            step_logits, state = model(token, state=state)
            token = step_logits[:, -1:].argmax(-1)
            out.append(int(token))
        return out

    seconds, _ = median_seconds(run, min_repeats=3, budget_s=8.0)
    experts, k = experts_of(model), model.config.moe.num_experts_per_token
    x = torch.randn(1, experts[0].width, dtype=dtype)
    weights, indices = torch.full((1, k), 1.0 / k), torch.arange(k)[None]
    layer, _ = median_seconds(lambda: experts[0](x, weights, indices), min_repeats=20, budget_s=0.5)
    return tokens / seconds, run(), logits.float(), 1e3 * layer * len(experts)


def decode_rows(fp_dir: Path, packed_dir: Path, tokens: int, bandwidth: float) -> list[dict]:
    """Side by side: fp32, bf16, the fake-quantized float model, and the packed checkpoint through the packed-byte
    kernel (`k3.ops.mxfp4_kernel`) and through decoded weights (the PyTorch path), without and with MXFP8 inputs."""
    cases = (("fp32 (float experts)", fp_dir, None, None, torch.float32, True),
             ("bf16 (float experts)", fp_dir, None, None, torch.bfloat16, True),
             ("fake-quant: float experts, MX on (MXFP4 w)", fp_dir, "mxfp4", None, torch.float32, True),
             ("packed MXFP4 w, packed-byte kernel", packed_dir, "mxfp4", None, torch.float32, True),
             ("packed MXFP4 w, decoded weights", packed_dir, "mxfp4", None, torch.float32, False),
             ("fake-quant: float experts, MX on (MXFP4 w, MXFP8 in)", fp_dir, "mxfp4", E4M3, torch.float32, True),
             ("packed MXFP4 w, MXFP8 in, packed-byte kernel", packed_dir, "mxfp4", E4M3, torch.float32, True))
    rows, reference, kernel_rows = [], {}, PackedExperts.KERNEL_ROWS
    for name, ckpt, weights, inputs, dtype, kernel in cases:
        model = set_mx(load_model(ckpt)[0], weights, inputs).to(dtype)
        PackedExperts.KERNEL_ROWS = kernel_rows if kernel else 0
        tok_s, out, logits, product_ms = decode(model, tokens, dtype)
        PackedExperts.KERNEL_ROWS = kernel_rows
        layers, k = len(experts_of(model)), model.config.moe.num_experts_per_token
        roofline_ms = 1e3 * expert_bytes(experts_of(model)[0], dtype) * layers * k / (bandwidth * 1e9)
        row = {"model": name, "tokens": tokens, "tokens_per_s": tok_s, "ms_per_token": 1e3 / tok_s,
               "expert_ms_per_token": product_ms, "expert_share": product_ms * tok_s / 1e3,
               "roofline_ms_per_token": roofline_ms, "roofline_share": roofline_ms / product_ms}
        key = (weights, inputs)
        if dtype == torch.float32 and key in reference:  # the packed model computes what its fake-quantized one does
            row["max_logit_diff_vs_fake_quant"] = float((logits - reference[key][0]).abs().max())
            row["same_tokens_as_fake_quant"] = out == reference[key][1]
        elif dtype == torch.float32:
            reference[key] = logits, out
        rows.append(row)
        print(json.dumps(row), flush=True)
    fp32, bf16 = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"]
    for row in rows:
        row["vs_fp32"], row["vs_bf16"] = row["tokens_per_s"] / fp32, row["tokens_per_s"] / bf16
    return rows


# ---------------------------------------------------------------------- 3. quality at equal tokens
def quality_runs(work: Path, args: argparse.Namespace) -> tuple[list[dict], Path]:
    runs: list[dict] = []
    tokenizer: Path | None = None
    for seed in args.seeds:
        for qat in (None, "mx"):
            out = work / f"{qat or 'fp'}-{seed}"
            if tokenizer is not None:  # one tokenizer for every run: identical data for FP and QAT
                (out / "tokenizer").mkdir(parents=True)
                shutil.copy(tokenizer / "tokenizer.json", out / "tokenizer" / "tokenizer.json")
            config = TrainConfig(out=str(out), preset="mini", steps=args.steps, tokens_per_step=2048,
                                 curriculum=[[0.0, 256]], eval_every=args.steps, eval_batches=16,
                                 ckpt_every=args.steps, seed=seed, data_limit_bytes=int(args.data_limit_mb * MIB),
                                 progress=False, threads=args.threads, qat=qat)
            start = time.time()
            run = train(config)
            tokenizer = tokenizer or out / "tokenizer"
            row = {"seed": seed, "method": "QAT" if qat else "FP", "seconds": time.time() - start,
                   "tokens": args.steps * 2048}
            if qat is None:
                row["val_loss_fp"] = run.last_validation.loss
                pack_model(run.model, E4M3)  # PTQ: round-to-nearest MXFP4 weights, MXFP8 E4M3 inputs
                row["val_loss_mx"] = run.evaluate().loss
            else:
                row["val_loss_mx"] = run.last_validation.loss  # its forward already computes with quantized experts
                pack_model(run.model, "keep")
                row["packed_minus_fake_quant"] = run.evaluate().loss - run.last_validation.loss
            runs.append(row)
            print(json.dumps(row), flush=True)
    return runs, tokenizer


def quality_summary(runs: list[dict]) -> list[dict]:
    """One row per method: losses per seed and mean, and the paired difference to FP's full-precision loss."""
    fp = {r["seed"]: r["val_loss_fp"] for r in runs if r["method"] == "FP"}
    methods = (("FP", "full precision", "val_loss_fp"), ("PTQ", "MXFP4 w + MXFP8 in", "val_loss_mx"),
               ("QAT", "MXFP4 w + MXFP8 in", "val_loss_mx"))
    rows = []
    for name, evaluated, key in methods:
        mine = [r for r in runs if r["method"] == ("QAT" if name == "QAT" else "FP")]
        row = {"method": name, "evaluated": evaluated, "mean": statistics.mean(r[key] for r in mine)}
        for r in mine:
            row[f"seed {r['seed']}"] = r[key]
            row[f"delta seed {r['seed']}"] = r[key] - fp[r["seed"]]
        row["delta"] = statistics.mean(r[key] - fp[r["seed"]] for r in mine)
        rows.append(row)
    qat, ptq = rows[2], rows[1]
    rows.append({"method": "QAT − PTQ", "evaluated": "both quantized", "delta": qat["mean"] - ptq["mean"]})
    return rows


# ---------------------------------------------------------------------- main
def fixed(rows: list[dict]) -> list[dict]:
    """Losses to 4 decimals for printing (differences signed)."""
    return [{k: f"{v:{'+' if 'delta' in k or 'minus' in k else ''}.4f}" if isinstance(v, float) and k != "seconds"
             else v for k, v in r.items()} for r in rows]


MOE_HEAVY = "small, 64 experts of 512"  # routed experts 93 % of the parameters (the release: 97.9 %)


def config_of(name: str) -> K3Config:
    """``small``, or `MOE_HEAVY`: small with 64 routed experts of hidden width 512."""
    config = preset("small")
    return config if name == "small" else replace(config, moe=replace(config.moe, num_experts=64, expert_hidden=512))


def checkpoints(work: Path, tokenizer: Path, name: str) -> tuple[Path, Path]:
    """A randomly initialised (seed 0) float checkpoint of ``name`` and its `k3 quantize` output."""
    torch.manual_seed(0)
    slug = name.split(",")[0] + ("-moe" if name == MOE_HEAVY else "")
    fp_dir = save_model(work / f"{slug}-fp", K3ForCausalLM(config_of(name)).eval(), Tokenizer.load(tokenizer))
    packed_dir = work / f"{slug}-mxfp4"
    quantize_checkpoint(fp_dir, packed_dir)  # `k3 quantize --ckpt small-fp --out small-mxfp4`
    return fp_dir, packed_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--data-limit-mb", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps(_load_case(args.load)))
        return
    work = Path(tempfile.mkdtemp(prefix="k3-mx-"))
    start = time.time()
    try:
        runs, tokenizer = quality_runs(work, args)
        torch.set_num_threads(args.threads)
        bandwidth = bandwidth_gb_s()
        memory, speed = [], {}
        for name in ("small", MOE_HEAVY):
            fp_dir, packed_dir = checkpoints(work, tokenizer, name)
            memory += [{"preset": name, **row} for row in memory_rows(fp_dir, packed_dir)]
            speed[name] = decode_rows(fp_dir, packed_dir, args.decode_tokens, bandwidth)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    quality = quality_summary(runs)

    print("\n1. Bytes and resident memory")
    print(table(memory, [("preset", "preset"), ("format", "format"), ("expert_bytes_per_param", "bytes / expert param"),
                         ("bytes_per_param", "bytes / model param"), ("state_mib", "state_dict MiB"),
                         ("file_mib", "model.safetensors MiB"), ("rss_mib", "RSS after load MiB"),
                         ("model_rss_mib", "load adds MiB"), ("trimmed_model_rss_mib", "… after malloc_trim MiB"),
                         ("peak_mib", "peak RSS MiB"),
                         ("load_s", "load s"), ("error", "note")]))
    for name, rows in speed.items():
        print(f"\n2. Greedy decode at batch 1, `{name}`, {PROMPT}-token prompt, {args.decode_tokens} tokens, "
              f"{args.threads} torch thread(s); roofline: the experts' bytes per token at {bandwidth:.1f} GB/s")
        print(table(rows, [("model", "model"), ("tokens_per_s", "tokens/s"), ("vs_fp32", "× fp32"),
                           ("vs_bf16", "× bf16"), ("ms_per_token", "ms/token"),
                           ("expert_ms_per_token", "expert products ms/token"), ("expert_share", "share of token"),
                           ("roofline_ms_per_token", "roofline ms/token"), ("roofline_share", "roofline / products"),
                           ("max_logit_diff_vs_fake_quant", "max |logit diff| vs fake-quant"),
                           ("same_tokens_as_fake_quant", "same tokens as fake-quant")]))
    seeds = [f"seed {s}" for s in args.seeds]
    print(f"\n3. Validation loss at equal tokens, `mini` preset, {args.steps} steps × 2,048 tokens, seeds {args.seeds} "
          "(delta: minus FP's full-precision loss at the same seed)")
    print(table(fixed(quality), [("method", "method"), ("evaluated", "experts evaluated as"),
                                 ("mean", "val loss (mean)"), *[(s, s) for s in seeds], ("delta", "delta (mean)"),
                                 *[(f"delta {s}", f"delta {s}") for s in seeds]]))
    print(table(fixed(runs), [("method", "run"), ("seed", "seed"), ("seconds", "train s"),
                       ("packed_minus_fake_quant", "QAT: packed − fake-quant loss")]))
    path = write_results("mx", {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "load"},
                                "wall_s": time.time() - start, "bandwidth_gb_s": bandwidth, "memory": memory,
                                "decode": speed, "runs": runs,
                                "quality": quality})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
