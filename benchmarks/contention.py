"""How fast do training and decoding run when another process shares the cores, by OpenMP setting?

PyTorch's CPU build runs its operators on GNU OpenMP (libgomp), whose idle worker threads spin before they
sleep. Alone that saves wake-up latency; when another busy process shares the cores, the spinning threads
take the CPU time the working threads need and a step can take many times longer. Each case runs in a
fresh process (the settings are read when the OpenMP runtime loads) and measures, on the `small` preset:

* a training step: forward, masked loss and backward of 4 × 256 tokens (median of 3);
* decoding: milliseconds per token at batch 1 after a 64-token prompt (median of 30).

Settings: libgomp's default, ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once), ``GOMP_SPINCOUNT`` 10k / 100k,
one torch thread, and ``auto``: `k3.train.threads.CoreShare` (what ``k3 train`` does by default) choosing
the thread count from the cores the other processes leave free. Competitors: none, a pure-Python busy
loop (one core), and another process training `small` continuously under the same setting (two k3 runs
on one machine).

    python benchmarks/contention.py        # ~8 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402

SETTINGS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-100k": {"GOMP_SPINCOUNT": "100000"},
    "spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "1 thread": {"K3_BENCH_THREADS": "1"},
    "auto": {"K3_BENCH_AUTO": "1"},  # k3's default for training: `k3.train.threads.CoreShare`
}
COMPETITORS = ("none", "busy loop", "k3 training")
BUSY = "while True: pass"


def _env(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return {**env, **SETTINGS[setting]}


def measure(mode: str) -> dict:
    """In the case process: time the training step and decoding (``mode`` "case"), or train forever ("load")."""
    import torch

    from k3 import K3ForCausalLM
    from k3.config import preset

    if os.environ.get("K3_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["K3_BENCH_THREADS"]))
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("small"))
    x = torch.randint(0, 4096, (4, 256))

    def train_step() -> float:
        t0 = time.perf_counter()
        logits, _ = model(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    if mode == "load":
        while True:
            train_step()
    train_step()
    if os.environ.get("K3_BENCH_AUTO"):  # let CoreShare measure the other processes for a few windows
        from k3.train.threads import CoreShare

        share, start = CoreShare(window_s=1.0), time.perf_counter()
        while time.perf_counter() - start < 4:
            train_step()
            share.update()
    train_s = sorted(train_step() for _ in range(3))[1]
    model.eval()
    with torch.no_grad():
        _, state = model(torch.randint(0, 4096, (1, 64)), state=model.new_state(1))
        token = torch.tensor([[5]])
        times = []
        for _ in range(35):
            t0 = time.perf_counter()
            _, state = model(token, state=state)
            times.append(time.perf_counter() - t0)
    return {"train_step_s": train_s, "decode_ms": 1000 * sorted(times[5:])[15]}


def case(setting: str, competitor: str) -> dict:
    load = None
    if competitor == "busy loop":
        load = subprocess.Popen([sys.executable, "-c", BUSY])
    elif competitor == "k3 training":
        load = subprocess.Popen([sys.executable, __file__, "--run", "load"], env=_env(setting))
    try:
        if load is not None:
            time.sleep(8)  # the competitor is running at full speed
        done = subprocess.run([sys.executable, __file__, "--run", "case"], env=_env(setting), capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
        return json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s"}
    finally:
        if load is not None:
            load.kill()
            load.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", choices=("case", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args()
    if args.run:
        print(json.dumps(measure(args.run)))
        return
    rows = []
    for setting in args.settings:
        for competitor in COMPETITORS:
            result = case(setting, competitor)
            rows.append({"setting": setting, "competitor": competitor, **result})
            print(f"{setting:10s} {competitor:12s} {result}", file=sys.stderr, flush=True)
    alone = {r["setting"]: r for r in rows if r["competitor"] == "none"}
    for r in rows:
        base = alone.get("default", {})
        if "train_step_s" in r and "train_step_s" in base:
            r["train_vs_default_alone"] = r["train_step_s"] / base["train_step_s"]
            r["decode_vs_default_alone"] = r["decode_ms"] / base["decode_ms"]
    print(table(rows, [("setting", "setting"), ("competitor", "sharing the cores with"),
                       ("train_step_s", "train step (s)"), ("train_vs_default_alone", "× default alone"),
                       ("decode_ms", "decode (ms/token)"), ("decode_vs_default_alone", "× default alone"),
                       ("error", "error")]))
    print(write_results("contention", {"machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
