"""Serving through the real HTTP API: throughput, time to first token and inter-token latency.

Every measurement starts `k3 serve` in a subprocess on a free loopback port and drives it with the
official `openai` client from this process (one thread per concurrent client, streaming completions
with ``logprobs=0`` so that every generated token arrives as its own chunk).

1. ``small`` (random weights of its shape, or ``--ckpt``): concurrency 1, 4 and 16 — output tokens/s
   over all clients, time to first token (TTFT) and inter-token latency (ITL), p50 / p99; the server
   runs with ``--prefill-chunk 256`` (throughput) rather than its latency-minded default.
2. A Kimi Linear model (d=256, 8 layers, 16 experts top-2; 17.2M parameters with the 4,096-token
   vocabulary) built by transformers and converted with
   `k3.interop.kimi_linear.from_transformers` (identical weights): the same HTTP measurement, beside
   transformers' own ``generate`` run in this process on the same prompts — sequentially (one request
   at a time) and batched (all 16 prompts left-padded in one call); and the same 16 requests through
   the `Engine` in this process without HTTP, to separate the engine from the server — eager, and compiled
   (``Engine(compile=True)``); and ``k3 serve --compile --max-batch 16`` over HTTP, which compiles every graph
   it can reach before it listens (that start-up reported apart as "compile s"). Both Kimi Linear servers run
   with ``--max-model-len 4096`` (the prompts are short): past 4,096 positions a compiled server builds its graphs
   twice (`k3.model.compiled_step.CASCADE_SUM`).

Every throughput row is the median of three timed runs (all three rates are in the JSON); a ``--compile``
server's rows also count the graphs it compiled while timed (``GET /metrics``), so a stall for a new shape key shows.
Each throughput row has its roofline: output tokens/s no implementation could beat here — the prompts' FLOPs at the
measured matmul rate plus every decode step's bytes or FLOPs (`k3.sizing.roofline`) — and the fraction reached.
3. A long prompt arriving while 8 clients stream: the ITL of those clients while it is prefilled, for
   several ``--prefill-chunk`` sizes, against the same clients with no long prompt.

    python benchmarks/serve.py            # ~20 min on 2 cores (compilations included)
    python benchmarks/serve.py --quick    # fewer tokens, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import copy_gbps, machine, matmul_gflops, table, write_results  # noqa: E402
from model import kimi_linear_pair  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.config import K3Config, preset  # noqa: E402
from k3.model.checkpoint import load_model, save_model  # noqa: E402
from k3.sizing.roofline import decode_cost  # noqa: E402
from k3.train.data import stdlib_documents  # noqa: E402
from k3.tokenization.bpe import Tokenizer  # noqa: E402

VOCAB = 4096
THROUGHPUT_CHUNK = 256  # prompt tokens per step in the throughput runs (the latency runs sweep it)
RUNS = 3  # timed runs of each throughput row; the row is their median
KIMI_CONTEXT = 4096  # the Kimi Linear servers' context: a compiled one builds one graph family (`CASCADE_SUM`)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


class Server:
    """``k3 serve`` in a subprocess (its defaults unless a prefill chunk is given); ``with Server(ckpt) as url``."""

    def __init__(self, ckpt: Path, prefill_chunk: int | None = None, compile: bool = False,
                 max_batch: int | None = None, max_model_len: int | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.command = [sys.executable, "-m", "k3.cli", "serve", "--ckpt", str(ckpt), "--port", str(self.port),
                        "--model-name", "bench"] + (["--prefill-chunk", str(prefill_chunk)] if prefill_chunk else []) \
            + (["--compile"] if compile else []) + (["--max-batch", str(max_batch)] if max_batch else []) \
            + (["--max-model-len", str(max_model_len)] if max_model_len else [])

    def __enter__(self) -> str:
        import openai

        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{self.port}/v1"
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        deadline = time.monotonic() + (3600 if "--compile" in self.command else 120)  # --compile: graphs first
        while True:
            try:
                client.models.list()
                return url
            except openai.APIConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("k3 serve did not start") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def stream_one(url: str, prompt: list[int], max_tokens: int, start: threading.Barrier | None = None) -> dict:
    """One streaming completion; returns its send time, token arrival times and count."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    if start is not None:
        start.wait()
    sent = time.perf_counter()
    arrivals = []
    for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           logprobs=0, stream=True):
        now = time.perf_counter()
        arrivals += [now] * len(chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else [])
    return {"sent": sent, "arrivals": arrivals}


def run_clients(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once, one client thread each; aggregate tokens/s, TTFT and ITL percentiles (ms)."""
    results: list[dict] = [{}] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        results[i] = stream_one(url, prompts[i], max_tokens, barrier)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    begin = min(r["sent"] for r in results)
    end = max(r["arrivals"][-1] for r in results)
    tokens = sum(len(r["arrivals"]) for r in results)
    ttft = [(r["arrivals"][0] - r["sent"]) * 1e3 for r in results]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    return {"output_tokens": tokens, "tokens_per_s": tokens / (end - begin), "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99), "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99)}


def median_of(runs: int, measure) -> dict:
    """``measure()`` ``runs`` times (a row each); the row of the median output tok/s, with every run's rate. One run
    can catch a stall of this shared VM's or the server's (a graph compiled for a shape key no earlier run made)."""
    rows = sorted((measure() for _ in range(runs)), key=lambda r: r["tokens_per_s"])
    return {**rows[len(rows) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in rows]}


def compiled_graphs(url: str) -> float:
    """The server's ``k3_compiled_graphs_total`` from ``GET /metrics`` (``--compile`` servers)."""
    import urllib.request

    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=60).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("k3_compiled_graphs_total"))


def long_prompt_interference(url: str, prompts: list[list[int]], long_prompt: list[int], max_tokens: int,
                             delay_s: float) -> dict:
    """Clients stream; after ``delay_s`` a long prompt arrives. ITL of the clients during its prefill."""
    results: list[dict] = [{}] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream_one(url, prompts[i], max_tokens,
                                                                                        barrier)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    time.sleep(delay_s)
    long = stream_one(url, long_prompt, 1)
    for t in threads:
        t.join()
    window = (long["sent"], long["arrivals"][0])
    during, outside = [], []
    for r in results:
        for a, b in zip(r["arrivals"], r["arrivals"][1:]):
            (during if b > window[0] and a < window[1] else outside).append((b - a) * 1e3)
    every = during + outside
    return {"long_prompt_tokens": len(long_prompt), "long_ttft_ms": (window[1] - window[0]) * 1e3,
            "itl_p50_ms": percentile(every, 50), "itl_p99_ms": percentile(every, 99),
            "itl_during_prefill_p50_ms": percentile(during, 50), "itl_during_prefill_p99_ms": percentile(during, 99),
            "itl_without_p50_ms": percentile(outside, 50), "itl_samples_during_prefill": len(during)}


def engine_only(model: K3ForCausalLM, tokenizer: Tokenizer, prompts: list[list[int]], max_tokens: int,
                compiled: bool = False) -> dict:
    """The same requests through the `Engine` in this process, no HTTP: what the server adds on top. ``compiled``:
    ``Engine(compile=True)`` (``k3 serve --compile``), after one untimed pass of the same requests that compiles
    the buckets they use (its time is reported as ``compile_s``)."""
    from k3.serve.engine import SamplingParams
    from k3.serve.options import EngineOptions

    # the servers' engine (k3 serve --prefill-chunk 256 [--compile]) without its prefix cache
    engine = EngineOptions(prefill_chunk=THROUGHPUT_CHUNK, compile=compiled, prefix_cache=False).build(model, tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)

    def run() -> tuple[int, float]:
        done = [0]
        start = time.perf_counter()
        for prompt in prompts:
            engine.add_request(prompt, params, callback=lambda o: done.__setitem__(0, done[0] + len(o.token_ids)))
        while engine.has_work():
            engine.step()
        return done[0], time.perf_counter() - start

    row = {}
    if compiled:
        _, row["compile_s"] = run()

    def timed() -> dict:
        tokens, seconds = run()
        return {"output_tokens": tokens, "tokens_per_s": tokens / seconds}

    return {**median_of(RUNS, timed), **row}


def roofline(config: K3Config, prompts: list[list[int]], max_tokens: int, bandwidth: float,
             flops_rate: float) -> float:
    """Output tokens/s no implementation can beat on this machine for the run: every prompt token's FLOPs at the
    matmul rate, then ``max_tokens`` decode steps of all rows, each bound by its bytes or its FLOPs
    (`k3.sizing.roofline`)."""
    prefill = decode_cost(config, sum(map(len, prompts)), 0).flops / flops_rate
    context = max(map(len, prompts))
    decode = sum(decode_cost(config, len(prompts), context + t).seconds(bandwidth, flops_rate)
                 for t in range(max_tokens))
    return len(prompts) * max_tokens / (prefill + decode)


def transformers_generate(hf, prompts: list[list[int]], max_tokens: int, batched: bool) -> dict:
    """transformers ``generate`` (greedy, exactly ``max_tokens`` new tokens): sequential or one left-padded batch."""
    def generate(batch: list[list[int]]) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        return (out.shape[1] - width) * len(batch)

    start = time.perf_counter()
    tokens = generate(prompts) if batched else sum(generate([p]) for p in prompts)
    return {"output_tokens": tokens, "tokens_per_s": tokens / (time.perf_counter() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", help="a small-shaped checkpoint (default: random weights)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    max_tokens = 16 if args.quick else 64
    concurrency = (1, 4) if args.quick else (1, 4, 16)
    work = Path(tempfile.mkdtemp(prefix="k3-serve-bench-"))

    if args.ckpt:
        _, tokenizer = load_model(Path(args.ckpt))
        small = Path(args.ckpt)
    else:
        tokenizer = Tokenizer.train([d.text for d in stdlib_documents(2 * 2**20)], VOCAB)
        torch.manual_seed(0)
        small = save_model(work / "small", K3ForCausalLM(preset("small")), tokenizer)
    corpus = tokenizer.encode("\n".join(d.text for d in stdlib_documents(2**20)))
    prompts = [corpus[i * 997:i * 997 + 128] for i in range(16)]
    long_prompt = corpus[20_000:20_000 + (512 if args.quick else 2048)]

    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    # 1. the small preset through the HTTP API (a throughput setting: prefill up to 256 tokens a step)
    with Server(small, THROUGHPUT_CHUNK) as url:
        for c in concurrency:
            record({"model": "small", "impl": "kimi-k3 HTTP", "concurrency": c,
                    **median_of(RUNS, lambda c=c: run_clients(url, prompts[:c], max_tokens))})

    # 2. identical Kimi Linear weights: k3 over HTTP vs transformers generate
    hf, ours = kimi_linear_pair(tokenizer.vocab_size, pad_token_id=0)  # generate pads batches with id 0
    hf.eval(), ours.eval()
    pair = f"kimi-linear-{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M"
    kimi = save_model(work / "kimi-linear", ours, tokenizer)
    with Server(kimi, THROUGHPUT_CHUNK, max_model_len=KIMI_CONTEXT) as url:
        for c in concurrency:
            record({"model": pair, "impl": "kimi-k3 HTTP", "concurrency": c,
                    **median_of(RUNS, lambda c=c: run_clients(url, prompts[:c], max_tokens))})
    n = concurrency[-1]
    start = time.perf_counter()
    # the --compile server listens once every graph is built
    with Server(kimi, THROUGHPUT_CHUNK, compile=True, max_batch=n, max_model_len=KIMI_CONTEXT) as url:
        warm_up = time.perf_counter() - start
        for c in concurrency:
            graphs = compiled_graphs(url)
            row = median_of(RUNS, lambda c=c: run_clients(url, prompts[:c], max_tokens))
            record({"model": pair, "impl": "kimi-k3 HTTP --compile", "concurrency": c, **row,
                    "graphs_compiled_while_timed": compiled_graphs(url) - graphs,
                    **({"compile_s": warm_up} if c == n else {})})
    record({"model": pair, "impl": "kimi-k3 engine, no HTTP", "concurrency": n,
            **engine_only(ours, tokenizer, prompts[:n], max_tokens)})
    record({"model": pair, "impl": "kimi-k3 engine compiled, no HTTP", "concurrency": n,
            **engine_only(ours, tokenizer, prompts[:n], max_tokens, compiled=True)})
    pair_config = ours.config
    del ours
    for batched in (False, True):
        record({"model": pair, "impl": f"transformers generate ({'batched' if batched else 'sequential'})",
                "concurrency": n, **median_of(RUNS, lambda batched=batched, model=hf: transformers_generate(
                    model, prompts[:n], max_tokens, batched))})
    del hf

    # 3. a long prompt while 8 clients stream
    interference = []
    clients = 4 if args.quick else 8
    for chunk in ((32, 256) if args.quick else (16, 32, 64, 256)):
        with Server(small, prefill_chunk=chunk) as url:
            row = {"model": "small", "prefill_chunk": chunk, "clients": clients,
                   **long_prompt_interference(url, prompts[:clients], long_prompt, 4 * max_tokens, 2.0)}
        interference.append(row)
        print(json.dumps(row), flush=True)

    bandwidth, flops_rate = copy_gbps() * 1e9, matmul_gflops() * 1e9
    configs = {"small": preset("small"), pair: pair_config}
    for row in rows:  # the roofline of each run: its prompts and output tokens at the machine's limits
        row["roof_tokens_per_s"] = roofline(configs[row["model"]], prompts[:row["concurrency"]], max_tokens,
                                            bandwidth, flops_rate)
        row["roof_fraction"] = row["tokens_per_s"] / row["roof_tokens_per_s"]
    tf_rows = [r for r in rows if r["impl"].startswith("transformers")]
    summary = {"copy_gbps": bandwidth / 1e9, "matmul_gflops": flops_rate / 1e9}
    for impl, key in (("kimi-k3 HTTP", "ratio"), ("kimi-k3 HTTP --compile", "compiled_http_ratio"),
                      ("kimi-k3 engine compiled, no HTTP", "compiled_engine_ratio")):
        ours = next(r for r in rows if r["model"] == pair and r["impl"] == impl and r["concurrency"] == n)
        summary.update({f"{key}_vs_{r['impl']}": ours["tokens_per_s"] / r["tokens_per_s"] for r in tf_rows})
    print(table(rows, [("model", "model"), ("impl", "implementation"), ("concurrency", "concurrency"),
                       ("output_tokens", "output tokens"), ("tokens_per_s", "output tok/s"),
                       ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
                       ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"),
                       ("roof_tokens_per_s", "roofline tok/s"), ("roof_fraction", "of roof"),
                       ("graphs_compiled_while_timed", "graphs compiled while timed"), ("compile_s", "compile s")]))
    print()
    print(table(interference, [("prefill_chunk", "prefill chunk"), ("clients", "streaming clients"),
                               ("long_prompt_tokens", "long prompt"), ("long_ttft_ms", "its TTFT ms"),
                               ("itl_without_p50_ms", "ITL p50 ms, no prefill"),
                               ("itl_during_prefill_p50_ms", "ITL p50 ms, during prefill"),
                               ("itl_during_prefill_p99_ms", "ITL p99 ms, during prefill"),
                               ("itl_p50_ms", "ITL p50 ms, all"), ("itl_p99_ms", "ITL p99 ms, all")]))
    print()
    print(json.dumps(summary, indent=2))
    path = write_results("serve", {"machine": machine(), "max_tokens": max_tokens, "prompt_tokens": 128,
                                   "rows": rows, "long_prompt": interference, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
