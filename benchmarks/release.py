"""Loading a released-layout Kimi K3 directory: time and peak memory, kimi-k3 against mlx-lm's kimi_k3.

Two reduced checkpoints in the official layout are generated (tests/release_fixture.py): the test-size one
(6 layers, d = 64, 4 experts) and an expert-heavy one (6 layers, d = 256, 256 experts of 512 × 256), whose
packed MXFP4 experts dominate the bytes on disk — the shape of the real release, where 1.35 TiB of 1.45 are
routed experts. Each loader runs in a fresh process: wall time to a usable model, peak resident memory
(VmHWM) and resident memory after one 16-token forward. kimi-k3 keeps experts packed in memory-mapped shards
(pages are read when an expert is chosen); mlx-lm reads every tensor (``lazy=False``).
Then ``k3 plan`` for the full release.

    python benchmarks/release.py      # ~1 min
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
from harness import machine, peak_rss_mib, rss_mib, run_isolated, table, write_results  # noqa: E402

import release_fixture  # noqa: E402

SHAPES = {"test-size": {}, "expert-heavy": {"HIDDEN": 256, "EXPERTS": 256, "LATENT": 256, "EXPERT_HIDDEN": 512,
                                             "TOP_K": 8, "DENSE": 512}}
DEFAULTS = {name: getattr(release_fixture, name) for dims in SHAPES.values() for name in dims}
PROMPT = list(range(1, 17))


def _case(loader: str, directory: str) -> dict:
    """Run in a fresh process: load with ``loader`` and forward 16 tokens."""
    t0 = time.perf_counter()
    if loader == "kimi-k3":
        import torch

        from k3.model.lm import K3ForCausalLM

        model = K3ForCausalLM.from_pretrained(directory)
        loaded = time.perf_counter() - t0
        peak_load = peak_rss_mib()
        with torch.no_grad():
            model(torch.tensor([PROMPT]))
    else:
        import mlx.core as mx
        from mlx_lm.utils import load_model

        model, _ = load_model(Path(directory))
        loaded = time.perf_counter() - t0
        peak_load = peak_rss_mib()
        mx.eval(model(mx.array([PROMPT])))
    return {"load_s": loaded, "peak_load_mib": peak_load, "rss_after_forward_mib": rss_mib(),
            "peak_mib": peak_rss_mib()}


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(_case(sys.argv[1], sys.argv[2])))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape, dims in SHAPES.items():
            for name, value in {**DEFAULTS, **dims}.items():  # the fixture reads its dimensions from globals
                setattr(release_fixture, name, value)
            release_fixture.VISION = {**release_fixture.VISION, "text_hidden_size": release_fixture.HIDDEN}
            directory = Path(tmp) / shape
            tensors = release_fixture.write_release(directory)
            disk = sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 2**20
            experts = sum(t.numel() for n, t in tensors.items() if ".experts." in n) / 2**20
            for loader in ("kimi-k3", "mlx-lm"):
                result = run_isolated(Path(__file__), [loader, str(directory)], timeout_s=600)
                rows.append({"checkpoint": shape, "loader": loader, "disk_mib": disk, "experts_mib": experts,
                             **result})
    print(table(rows, [("checkpoint", "checkpoint"), ("loader", "loader"), ("disk_mib", "shards MiB"),
                       ("experts_mib", "packed experts MiB"), ("load_s", "load s"),
                       ("peak_load_mib", "peak RSS at load MiB"), ("rss_after_forward_mib", "RSS after forward MiB"),
                       ("peak_mib", "peak RSS MiB")]))
    from k3.config import preset
    from k3.sizing.serving import format_plan, plan

    full = plan(preset("paper"), context=131072)
    print()
    print(format_plan(full, "the released Kimi K3"))
    print(f"\nresults: {write_results('release', {'machine': machine(), 'rows': rows, 'plan': full})}")


if __name__ == "__main__":
    main()
