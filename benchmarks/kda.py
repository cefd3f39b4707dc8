"""How fast is k3's chunkwise KDA on this CPU, against the recurrence and the peers' pure-torch chunk paths?

Forward and forward+backward, B=1, H=4, K=V=128, T in {1024, 4096, 16384}, fp32 and bf16, for
``k3.ops.kda.chunked`` (eager, and ``torch.compile``d as the compiled prefill runs it: forward, T ≤ 4096),
``k3.ops.kda.recurrent``, transformers' ``chunk_kimi_delta_attention`` and fla's ``naive_chunk_kda`` — all
measured in this run, each case in a fresh process (clean peak memory),
beside the machine's measured dense matmul rate.

FLOPs are the chunk algorithm's matmul FLOPs (``chunk_flops``; elementwise work not counted) for
chunk-form implementations and the recurrence's for ``recurrent``; forward+backward counts 3×
forward. Peak memory is the case process's resident high-water mark above its state before the call.

    python benchmarks/kda.py                 # full sweep (~10 min on 2 cores)
    python benchmarks/kda.py --T 1024 4096   # a subset
    python benchmarks/kda.py --impl chunked chunked_compiled --mode fwd   # writes results/kda-chunked-….json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    machine,
    matmul_gflops,
    median_seconds,
    peak_rss_mib,
    reset_peak_rss,
    rss_mib,
    run_isolated,
    table,
    write_results,
)

B, H, K, V, CHUNK = 1, 4, 128, 128, 64
IMPLS = ("chunked", "chunked_compiled", "recurrent", "transformers_chunk", "fla_naive_chunk")
G_MIN = -5.0  # `kda.bounded_decay`'s default floor: the inputs' decay bound, as the model's gate passes it
COMPILED_MAX_T = 4096  # the compiled graph unrolls the chunk loop: T / 64 iterations
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASE_TIMEOUT_S = 600


def chunk_flops(T: int, C: int = CHUNK, tile: int = 16) -> float:
    """Matmul FLOPs of ``k3.ops.kda.chunked`` (forward), per the steps of ``_chunk_terms`` and the scan."""
    nt = C // tile
    per_chunk = (
        2 * 2 * tile * tile * K * (nt * (nt - 1) // 2 + nt)  # Akk and Aqk tiles (off-diagonal + diagonal)
        + C**3 / 3  # unit-triangular inverse
        + 2 * C * C * (K + V)  # W = T (K e^G), U = T V
        + 2 * 2 * C * K * V  # scan: U - W S, Kd^T u
        + 2 * C * C * V + 2 * C * K * V  # outputs: Aqk u + Qe S
    )
    return B * H * (T // C) * per_chunk


def recurrent_flops(T: int) -> float:
    """Decay, read kᵀS, rank-1 write, output read: ≈ 7·K·V per token and head."""
    return B * H * T * 7 * K * V


def inputs(T: int, dtype: torch.dtype, grad: bool) -> list[torch.Tensor]:
    from k3.ops import kda

    gen = torch.Generator().manual_seed(T)
    q = kda.l2norm(torch.randn(B, T, H, K, generator=gen))
    k = kda.l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    g = kda.bounded_decay(torch.randn(B, T, H, K, generator=gen), torch.zeros(H), torch.zeros(H * K))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [x.to(dtype).requires_grad_(grad) for x in (q, k, v, g, beta)]


def implementation(name: str):
    """The function under test, called as ``fn(q, k, v, g, beta) -> (o, state)``."""
    from k3.ops import kda

    if name == "chunked":
        return lambda *a: kda.chunked(*a, chunk_size=CHUNK)
    if name == "chunked_compiled":  # what the compiled prefill runs (`k3.model.compiled`)
        return torch.compile(lambda *a: kda.chunked(*a, chunk_size=CHUNK, decay_floor=G_MIN), dynamic=False)
    if name == "recurrent":
        return kda.recurrent
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import peers

    if name == "transformers_chunk":
        fn = peers.transformers_kimi_linear().chunk_kimi_delta_attention
        return lambda *a: fn(*a, chunk_size=CHUNK, output_final_state=True)
    if name == "fla_naive_chunk":
        fn = peers.fla_naive().naive_chunk_kda
        return lambda *a: fn(*a, chunk_size=CHUNK, output_final_state=True)
    raise ValueError(name)


def run_case(impl: str, T: int, dtype: str, mode: str) -> dict:
    """One measurement, in this (fresh) process."""
    fn = implementation(impl)
    grad = mode == "fwd+bwd"
    args = inputs(T, DTYPES[dtype], grad)

    def call():
        if grad:
            for a in args:
                a.grad = None
            o, s = fn(*args)
            (o.float().sum() + s.sum()).backward()
        else:
            with torch.no_grad():
                fn(*args)

    reset_peak_rss()
    before, start = rss_mib(), time.perf_counter()
    call()  # the first call sets the memory high-water mark (and compiles `chunked_compiled`)
    first, peak = time.perf_counter() - start, peak_rss_mib() - before
    seconds, repeats = median_seconds(call, min_repeats=2, budget_s=3.0)
    return {"seconds": seconds, "repeats": repeats, "peak_mib": max(peak, 0.0), "first_call_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--mode", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="skip a case whose time, extrapolated linearly from the previous T, exceeds this")
    parser.add_argument("--max-mib", type=float, default=6144.0,
                        help="skip a case whose peak memory, extrapolated linearly from the previous T, exceeds this")
    parser.add_argument("--case", nargs=4, metavar=("IMPL", "T", "DTYPE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        impl, T, dtype, mode = args.case
        print(json.dumps(run_case(impl, int(T), dtype, mode)))
        return

    # bf16 matmul has no fast path on CPUs without AVX512-BF16/AMX: measure it on a smaller product.
    rates = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16, n=512)}
    print(f"dense matmul: fp32 {rates['fp32']:.1f} GFLOP/s (2048^3), bf16 {rates['bf16']:.1f} GFLOP/s (512^3)",
          flush=True)
    rows = []
    for mode in args.mode:
        for dtype in args.dtype:
            for impl in args.impl:
                last = None
                for T in sorted(args.T):
                    row = {"impl": impl, "T": T, "dtype": dtype, "mode": mode}
                    grow = T / last["T"] if last else 0.0
                    if impl == "chunked_compiled" and (mode != "fwd" or T > COMPILED_MAX_T):
                        row["note"] = "not run: the compiled prefill's case is the forward, T ≤ 4096"
                    elif last and last["seconds"] * grow > args.budget_s:
                        row["note"] = f"skipped: est. {last['seconds'] * grow:.0f} s per call"
                    elif last and last["peak_mib"] * grow > args.max_mib:
                        row["note"] = f"skipped: est. {last['peak_mib'] * grow / 1024:.1f} GiB peak"
                    else:
                        result = run_isolated(Path(__file__), ["--case", impl, str(T), dtype, mode], CASE_TIMEOUT_S)
                        if "error" in result:
                            row["note"] = result["error"]
                        else:
                            flops = (recurrent_flops(T) if impl == "recurrent" else chunk_flops(T))
                            flops *= 3 if mode == "fwd+bwd" else 1
                            row.update(result, tokens_per_s=B * T / result["seconds"],
                                       gflops=flops / result["seconds"] / 1e9)
                            row["pct_matmul"] = 100 * row["gflops"] / rates["fp32"]
                            last = {"seconds": result["seconds"], "peak_mib": result["peak_mib"], "T": T}
                    rows.append(row)
                    print(json.dumps(row), flush=True)

    def find(impl, T, dtype="fp32", mode="fwd"):
        return next((r for r in rows if (r["impl"], r["T"], r["dtype"], r["mode"]) == (impl, T, dtype, mode)
                     and "seconds" in r), None)

    for r in rows:
        ours = find("chunked", r["T"], r["dtype"], r["mode"])
        if ours and "seconds" in r:
            r["chunked_speedup"] = r["seconds"] / ours["seconds"]
    summary = {}
    ours = find("chunked", 4096)
    if ours:
        peers = [find(p, 4096) for p in ("transformers_chunk", "fla_naive_chunk")]
        peers = [p for p in peers if p]
        rec = find("recurrent", 4096)
        bf16 = find("chunked", 4096, "bf16")
        mem = {T: r["peak_mib"] for T in sorted(args.T) if (r := find("chunked", T))}
        summary = {
            "T4096_fp32_fwd_speedup_vs_fastest_peer":
                min(p["seconds"] for p in peers) / ours["seconds"] if peers else None,
            "T4096_fp32_fwd_speedup_vs_recurrent": rec["seconds"] / ours["seconds"] if rec else None,
            "T4096_fp32_fwd_pct_of_matmul_rate": ours["pct_matmul"],
            "T4096_fp32_fwd_compiled_pct_of_matmul_rate": (c := find("chunked_compiled", 4096)) and c["pct_matmul"],
            "T4096_fwd_bf16_over_fp32_time": bf16["seconds"] / ours["seconds"] if bf16 else None,
            "chunked_fp32_fwd_peak_mib_by_T": mem,
        }
    columns = [("mode", "mode"), ("dtype", "dtype"), ("T", "T"), ("impl", "implementation"),
               ("tokens_per_s", "tokens/s"), ("gflops", "GFLOP/s"), ("pct_matmul", "% of fp32 matmul"),
               ("peak_mib", "peak MiB"), ("first_call_s", "first call s"), ("chunked_speedup", "chunked is N× faster"),
               ("note", "note")]
    print()
    print(f"dense fp32 matmul: {rates['fp32']:.1f} GFLOP/s; bf16: {rates['bf16']:.1f} GFLOP/s "
          f"({machine()['cores']} cores, {machine()['cpu_capability']})")
    print(table(rows, columns))
    print()
    print(json.dumps(summary, indent=2))
    name = "kda" if args.impl == list(IMPLS) else "-".join(["kda", *args.impl])  # a subset: its own file
    path = write_results(name, {"machine": machine(), "matmul_gflops": rates, "rows": rows, "summary": summary,
                                 "shape": {"B": B, "H": H, "K": K, "V": V, "chunk": CHUNK}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
