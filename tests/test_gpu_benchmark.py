"""`benchmarks/gpu.py` runs where no GPU is (``--device cpu --quick``): the script a lent GPU machine runs must not
rot between the sessions that have one. Its sections' results are checked, not its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_runs_on_a_cpu(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--quick", "--out",
                          str(out), "--only", "equivalence", "decode", "train", "kda", "prefill", "dist",
                          "--target", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert not [name for name, section in results.items() if isinstance(section, dict) and "error" in section]
    fp32 = [r for r in results["equivalence"]["rows"] if r["dtype"] == "float32"]
    assert {r["feature"] for r in fp32} == {"plain", "prefix cache", "n-gram speculation", "packed MXFP4"}
    assert all(r["identical"] for r in fp32)  # on the CPU a device copy is the CPU run itself
    assert [r["batch"] for r in results["decode"]["rows"]] == [1, 4]
    assert results["dist"]["rows"] == [{"backend": "gloo", "device": "cpu", "all_reduce_ok": True,
                                        "all_gather_ok": True}]
    assert results["prefill"]["auto"] == "torch" and results["prefill"]["rows"][0]["max_diff_rel"] == 0
    assert results["train"]["rows"][0]["tokens_s"] > 0 and len(results["kda"]["rows"]) == 2
    assert "| feature | dtype |" in run.stdout  # the README's tables
