"""Start-up of compiled serving (issue 37): from ``k3 serve --compile`` to listening, to the first token and to
compiled speed, cold and warm, beside an eager server, in one run.

Every row starts ``k3 serve`` on ``small`` (random weights of its shape; ``--max-batch 1 --max-model-len 4096``, so
7 graph families: the decode step and the 64/16/4-token prefill pieces on an empty and a filled cache) with its own
inductor cache and graph directory: *cold* empty ones, *warm* the ones the cold start filled. From the moment the
process starts, a client polls the port and then streams 64-token greedy completions of a 40-token prompt one after
another, pausing ``--think`` seconds between them (a chat user's pace), for at most ``--seconds``; it stops early
once ``GET /metrics`` shows every family ready and three more requests were timed. A row reports: seconds to
listening and to the first token (from the process start), the decode tokens/s of the first request and of the last
three, when every precompiled graph was ready (compiled by the graph process, `k3.model.graph_worker`, or loaded)
and when every graph was (the tuned decode graph too, compiled on the server's gated thread). Rows: eager;
``--compile`` (background compilation, cold, then warm); ``--compile --compile-wait`` (warm: every graph built
before listening, the previous behaviour); with ``--only packages``, ``--compile --compile-packages`` cold and warm
alone (the tuned decode graph as an AOTInductor package, `k3.model.packaged`, which the warm start loads).

Then ``k3 generate --compile`` of 200 greedy tokens (``--ignore-eos``: random weights would end sooner) as a whole
process (import, load, compiled step, decoding), beside the same command without ``--compile``: cold (empty caches:
the packaged tuned decode step is compiled), warm (the first warm run loads the package and records what that cost,
`k3.model.payoff`), and warm again (that run loads it only where the record says it pays for its tokens; eager and
deciding runs alternate ``--repeats`` times, and the median of each is reported), on ``small`` and on a wider model
of the same depth (d=1024, 162M parameters, where a step costs what the start-up does not).

    python benchmarks/startup.py              # ~30 min on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402
from serve import Server, stream_one  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import K3Config, preset  # noqa: E402
from k3.model.checkpoint import save_model  # noqa: E402
from k3.train.data import stdlib_documents  # noqa: E402
from k3.tokenization.bpe import Tokenizer  # noqa: E402

MAX_TOKENS = 64
TUNED = 1  # of a row's planned graphs, the tuned ones (the decode step at batch 1): the precompiled come first


def metric(url: str, name: str) -> float | None:
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=60).read().decode()
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), None)


def row(ckpt: Path, name: str, flags: list[str], cache: Path, prompt: list[int], seconds: float,
        think: float) -> dict:
    """One server start: listening, first token, tokens/s over time, families ready (see the module docstring)."""
    server = Server(ckpt, compile="--compile" in flags, max_batch=1, max_model_len=4096)
    server.command += [f for f in flags if f != "--compile"]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    os.environ["XDG_CACHE_HOME"] = str(cache / "xdg")  # the precompiled graphs (`k3.model.precompiled`) too
    start = time.perf_counter()
    with server as url:
        listening = time.perf_counter() - start
        rates, ready_at, first, precompiled_at = [], None, None, None
        while first is None or time.perf_counter() - start < seconds:  # at least one request
            result = stream_one(url, prompt, MAX_TOKENS)
            arrivals = result["arrivals"]
            first = first if first is not None else arrivals[0] - start
            rates.append((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
            planned, built = metric(url, "k3_compile_graphs_planned"), metric(url, "k3_compile_graphs_built")
            if precompiled_at is None and planned is not None and built >= planned - TUNED:
                precompiled_at = time.perf_counter() - start
            if ready_at is None and (planned is None or built == planned):
                ready_at, left = time.perf_counter() - start, 3
            if ready_at is not None:
                left -= 1
                if left < 0:
                    break
            time.sleep(think)
        graphs, hits = metric(url, "k3_compiled_graphs_total"), metric(url, "k3_compiled_graphs_cached_total")
    return {"server": name, "listening_s": round(listening, 1), "first_token_s": round(first, 1),
            "first_tokens_per_s": round(rates[0], 1), "last_tokens_per_s": round(sum(rates[-3:]) / len(rates[-3:]), 1),
            "precompiled_ready_s": None if precompiled_at is None else round(precompiled_at, 1),
            "all_graphs_ready_s": None if ready_at is None or "--compile" not in flags else round(ready_at, 1),
            "requests": len(rates), "graphs_compiled": graphs, "graphs_from_cache": hits}


def wide() -> K3Config:
    """``small`` at width 1024 (its heads, experts and latent scaled with it)."""
    base = preset("small")
    return dataclasses.replace(
        base, hidden_size=1024, kda=dataclasses.replace(base.kda, num_heads=8, head_dim=128, value_head_dim=128),
        mla=dataclasses.replace(base.mla, num_heads=8, q_lora_rank=384, kv_lora_rank=256),
        moe=dataclasses.replace(base.moe, expert_hidden=512, shared_hidden=512, latent_dim=512, dense_hidden=2816),
        vision=dataclasses.replace(base.vision, out_dim=1024))


def generate(ckpt: Path, name: str, flags: list[str], xdg: Path) -> dict:
    """``k3 generate`` of exactly 200 greedy tokens as a process: its wall time (and the compiled run's own
    account)."""
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}, "XDG_CACHE_HOME": str(xdg)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "k3.cli", "generate", "--ckpt", str(ckpt), "--prompt",
                           "def parse(text):", "--max-tokens", "200", "--ignore-eos", "--temperature", "0", *flags],
                          capture_output=True, text=True, env=env, timeout=3600, check=True)
    return {"run": name, "seconds": round(time.perf_counter() - start, 2), "text": done.stdout,
            "account": done.stderr.strip().splitlines()[-1] if flags else ""}


def median_run(runs: list[dict]) -> dict:
    """The run of median seconds, with every run's seconds beside it."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    same = len({r["text"] for r in runs}) == 1  # else no text: the row is not eager's
    return {**ordered[len(ordered) // 2], "all_seconds": [r["seconds"] for r in runs],
            "text": runs[0]["text"] if same else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=900, help="longest a row runs (default %(default)s)")
    parser.add_argument("--think", type=float, default=1.0, help="pause between a client's requests")
    parser.add_argument("--repeats", type=int, default=3, help="eager and warm deciding k3 generate runs, "
                        "alternated (the median is reported)")
    parser.add_argument("--only", choices=("serve", "generate", "packages"),
                        help="one half of the run, or the two --compile-packages servers (cold, warm) alone")
    args = parser.parse_args()
    rows: list[dict] = []
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        tokenizer = Tokenizer.train([d.text for d in stdlib_documents(2 * 2**20)], 4096)
        torch.manual_seed(0)
        ckpt = save_model(work / "small", K3ForCausalLM(preset("small")), tokenizer)
        prompt = tokenizer.encode("def parse(text):\n    " * 8)[:40]
        caches = {"cold": work / "cache", "none": work / "unused"}
        packaged = ["--compile", "--compile-packages"]
        servers = (("--compile --compile-packages, cold", packaged, work / "packaged", args.seconds),
                   ("--compile --compile-packages, warm", packaged, work / "packaged", args.seconds)) \
            if args.only == "packages" else (
                ("eager", [], caches["none"], 60), ("--compile, cold", ["--compile"], caches["cold"], args.seconds),
                ("--compile, warm", ["--compile"], caches["cold"], args.seconds),
                ("--compile --compile-wait, warm", ["--compile", "--compile-wait"], caches["cold"], 60))
        for name, flags, cache, seconds in servers:
            if args.only != "generate":
                rows.append(row(ckpt, name, flags, cache, prompt, seconds, args.think))
                print(rows[-1], flush=True)
        for model_name, config in (("small", preset("small")), ("d=1024", wide())) if args.only in (None, "generate") \
                else ():
            torch.manual_seed(0)
            path = save_model(work / model_name, K3ForCausalLM(config), tokenizer)
            xdg = work / f"xdg-{model_name}"
            first = [generate(path, "--compile, cold", ["--compile"], xdg),
                     generate(path, "--compile, warm, loads and records", ["--compile"], xdg)]
            # eager and deciding runs alternate, ``--repeats`` of each (the median's row is kept): one process's
            # time moves by ±20 % on this shared machine
            pairs = [(generate(path, "eager", [], xdg), generate(path, "--compile, warm, decides", ["--compile"], xdg))
                     for _ in range(args.repeats)]
            rows_here = [median_run([p[0] for p in pairs]), *first, median_run([p[1] for p in pairs])]
            eager_text = rows_here[0]["text"]
            for r in rows_here:
                r.update(model=model_name, speedup=round(rows_here[0]["seconds"] / r["seconds"], 2),
                         same_text=eager_text is not None and r.pop("text") == eager_text)
            runs += rows_here
            print(rows_here, flush=True)
    columns = [("server", "server"), ("listening_s", "listening s"), ("first_token_s", "first token s"),
               ("first_tokens_per_s", "tok/s, 1st request"), ("last_tokens_per_s", "tok/s, last 3"),
               ("precompiled_ready_s", "precompiled graphs ready s"),
               ("all_graphs_ready_s", "all graphs ready s"), ("graphs_compiled", "graphs"),
               ("graphs_from_cache", "from cache")]
    print(table(rows, columns))
    print(table(runs, [("model", "model"), ("run", "k3 generate"), ("seconds", "process s"),
                       ("all_seconds", "every run's s"), ("speedup", "× eager"), ("same_text", "eager's text"),
                       ("account", "compiled run's account")]))
    write_results("startup" if args.only is None else f"startup_{args.only}",
                  {"machine": machine(), "serve": rows, "generate": runs, "max_tokens": MAX_TOKENS,
                   "think_s": args.think, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
