"""MoonViT-V2 (SPEC §6, issue 16): what an image costs on this CPU — encoder speed, visual tokens, prefill.

1. Encoder throughput and visual tokens per image at 224², 448² and 896² (synthetic JPEGs, seed 0) for two encoder
   configurations, randomly initialised (speed does not depend on the values): the ``small`` preset's
   (4 blocks × width 128, patch budget 1,024 — so 896² is downscaled to fit 1,024 patches; the table shows the grid
   actually used) and the published ``paper`` one (27 blocks × width 1,024, 12 heads × 128, MLP 4,096, projector
   to 7,168; ~447M parameters; patch budget 65,536, so nothing here is downscaled), in fp32 and bf16. Per image:
   patches, visual tokens after the 2×2 merge, preprocessing ms (`k3.tokenization.image.image_input` on the JPEG bytes:
   decode + resize + patch), encoder ms (`VisionModel(pixel_values, grid_thw)`, merge and projector included) and
   images/s, and the achieved GFLOP/s against the machine's measured matmul rate of the same dtype
   (`harness.matmul_gflops`). FLOPs are counted analytically: per patch 2·(3·14·14·D) for the patch embedding,
   per block 2·(3·D·inner + inner·D + 2·D·mlp) plus joint attention 4·L·inner for a grid of L patches, and the
   projector 2·(4D·4D + 4D·d) per visual token (norms, GELU and RoPE not counted). The small encoder is also run
   on 8 images packed into one call. Timing: the median of ≥ 3 calls after a warm-up when one call takes < 5 s,
   else the median of 2 calls when one takes < 30 s, else a single call (the ``calls`` column).
2. Prefill of an image-bearing prompt on the ``small`` preset model (8 text tokens, one image's
   ``vision.media_token_id`` slots, 24 text tokens; `K3ForCausalLM(input_ids, pixel_values=, grid_thw=)`, encoder
   included, preprocessing not) against a text-only prompt of the same length, and the split of the image prompt
   into encoder (`embed_multimodal`) and backbone (`forward(inputs_embeds=)`).

Everything runs on ``--threads`` torch threads (default 1, as benchmarks/mx.py: the other core may be busy).

    python benchmarks/vision.py                        # ~4.5 min on 1 thread (paper 896²: 80 s fp32 + 56 s bf16)
    python benchmarks/vision.py --paper-sizes 224 448  # skip the paper encoder's 896² image
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, matmul_gflops, median_seconds, table, write_results  # noqa: E402

from k3.config import VisionConfig, preset  # noqa: E402
from k3.tokenization.image import batch, image_input  # noqa: E402
from k3.model.lm import K3ForCausalLM  # noqa: E402
from k3.model.vision import VisionModel  # noqa: E402

SIZES = (224, 448, 896)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PREFIX, SUFFIX = 8, 24  # text tokens around the image in the prefill prompt


def jpeg(side: int, seed: int = 0) -> bytes:
    """A synthetic side×side photo-like JPEG: smooth colour gradients and stripes plus a little noise."""
    y, x = np.mgrid[:side, :side] / side
    rng = np.random.default_rng(seed)
    rgb = np.stack([x, y, 0.5 + 0.5 * np.sin(12 * (x + y))], -1) * 200 + rng.normal(0, 12, (side, side, 3))
    out = io.BytesIO()
    Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def encoder_flops(v: VisionConfig, out_dim: int, grid: tuple[int, int, int]) -> float:
    """Analytic matmul FLOPs of one grid through `VisionModel` (see the module docstring)."""
    t, h, w = grid
    L, D, inner = t * h * w, v.hidden_size, v.num_heads * v.qkv_head_dim
    block = 2 * (3 * D * inner + inner * D + 2 * D * v.mlp_hidden) + 4 * L * inner
    merged = v.merge_size**2 * D
    tokens = (h // v.merge_size) * (w // v.merge_size)
    projector = tokens * 2 * merged * (merged + out_dim)
    return L * (2 * v.in_channels * v.patch_size**2 * D + v.num_layers * block) + projector


def timed(fn) -> tuple[float, int]:
    """(median seconds, calls timed): adaptive so that the paper encoder's largest image is run once."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first < 5:
        return median_seconds(fn, min_repeats=3, budget_s=min(3.0, 10 * first))
    if first < 30:
        t0 = time.perf_counter()
        fn()
        return (first + time.perf_counter() - t0) / 2, 2
    return first, 1


def preprocess_ms(data: bytes, budget: int) -> float:
    seconds, _ = median_seconds(lambda: image_input(data, budget), min_repeats=5, budget_s=0.5)
    return 1e3 * seconds


@torch.no_grad()
def encoder_rows(name: str, model: VisionModel, config, sizes, images, rates, packed: int = 1) -> list[dict]:
    v, rows = config.vision, []
    for dtype_name, dtype in DTYPES.items():
        model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)  # the caller's stays fp32
        for side in sizes:
            visual = image_input(images[side], v.patch_budget)
            pixels, grid_thw = batch([visual] * packed)
            seconds, calls = timed(lambda m=model, p=pixels, g=grid_thw: m(p, g))
            flops = encoder_flops(v, v.out_dim, visual.grid)
            row = {"encoder": name, "dtype": dtype_name, "image": f"{side}²", "budget": v.patch_budget,
                   "grid": "×".join(map(str, visual.grid[1:])), "patches": visual.pixel_values.shape[0],
                   "tokens": visual.tokens, "batch": packed,
                   "preprocess_ms": preprocess_ms(images[side], v.patch_budget),
                   "encoder_ms": 1e3 * seconds / packed, "images_per_s": packed / seconds, "calls": calls,
                   "gflop": flops / 1e9, "gflops": packed * flops / seconds / 1e9}
            row["pct_matmul"] = 100 * row["gflops"] / rates[dtype_name]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


@torch.no_grad()
def prefill_rows(model: K3ForCausalLM, images: dict[int, bytes]) -> list[dict]:
    v, rows = model.config.vision, []
    gen = torch.Generator().manual_seed(0)

    def text(n: int) -> torch.Tensor:  # random text ids that are never the media placeholder
        ids = torch.randint(0, model.config.vocab_size - 1, (1, n), generator=gen)
        return ids + (ids >= v.media_token_id).long()

    for side, data in images.items():
        visual = image_input(data, v.patch_budget)
        pixels, grid_thw = batch([visual])
        media = torch.full((1, visual.tokens), v.media_token_id)
        ids = torch.cat([text(PREFIX), media, text(SUFFIX)], 1)
        plain = text(ids.shape[1])
        embeds = model.embed_multimodal(ids, pixels, grid_thw)
        image_s, _ = median_seconds(lambda i=ids, p=pixels, g=grid_thw: model(i, pixel_values=p, grid_thw=g), 3, 2.0)
        text_s, _ = median_seconds(lambda i=plain: model(i), 3, 2.0)
        encode_s, _ = median_seconds(lambda i=ids, p=pixels, g=grid_thw: model.embed_multimodal(i, p, g), 3, 1.0)
        backbone_s, _ = median_seconds(lambda e=embeds: model(inputs_embeds=e), 3, 2.0)
        row = {"image": f"{side}²", "grid": "×".join(map(str, visual.grid[1:])), "visual_tokens": visual.tokens,
               "prompt_tokens": ids.shape[1], "preprocess_ms": preprocess_ms(data, v.patch_budget),
               "image_prompt_ms": 1e3 * image_s, "text_prompt_ms": 1e3 * text_s, "ratio": image_s / text_s,
               "encoder_ms": 1e3 * encode_s, "backbone_ms": 1e3 * backbone_s,
               "encoder_share": encode_s / (encode_s + backbone_s)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--paper-sizes", type=int, nargs="*", default=list(SIZES),
                        help="image sides for the paper encoder (none: skip it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    images = {side: jpeg(side) for side in sorted(set(args.sizes) | set(args.paper_sizes))}
    rates = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}
    print(json.dumps({"matmul_gflops": rates}), flush=True)

    torch.manual_seed(0)
    small = K3ForCausalLM(preset("small")).eval()
    counts = {"small": sum(p.numel() for p in small.vision.parameters())}
    encoders = encoder_rows("small", small.vision, small.config, args.sizes, images, rates)
    encoders += encoder_rows("small", small.vision, small.config, args.sizes, images, rates, packed=8)
    prefill = prefill_rows(small, {s: images[s] for s in args.sizes})
    if args.paper_sizes:
        paper_config = preset("paper")
        paper = VisionModel(paper_config).eval()
        counts["paper"] = sum(p.numel() for p in paper.parameters())
        encoders += encoder_rows("paper", paper, paper_config, args.paper_sizes, images, rates)
        del paper

    print(f"\nmatmul rate, {args.threads} thread(s): fp32 {rates['fp32']:.1f} GFLOP/s, bf16 {rates['bf16']:.1f} "
          f"GFLOP/s; encoder parameters: " + ", ".join(f"{k} {n / 1e6:.2f}M" for k, n in counts.items()))
    print("\n1. Encoder throughput and visual tokens per image (JPEG input, batch = images packed per call)")
    print(table(encoders, [("encoder", "encoder"), ("dtype", "dtype"), ("image", "image"), ("budget", "patch budget"),
                           ("grid", "grid h×w"), ("patches", "patches"), ("tokens", "visual tokens"),
                           ("batch", "batch"), ("preprocess_ms", "preprocess ms/img"),
                           ("encoder_ms", "encoder ms/img"), ("images_per_s", "images/s"), ("gflop", "GFLOP/img"),
                           ("gflops", "GFLOP/s"), ("pct_matmul", "% of matmul"), ("calls", "calls")]))
    print(f"\n2. Prefill on the `small` model, fp32: {PREFIX} text + the image's slots + {SUFFIX} text tokens vs "
          "text only, same length")
    print(table(prefill, [("image", "image"), ("grid", "grid h×w"), ("visual_tokens", "visual tokens"),
                          ("prompt_tokens", "prompt tokens"), ("preprocess_ms", "preprocess ms"),
                          ("image_prompt_ms", "image prompt ms"), ("text_prompt_ms", "text prompt ms"),
                          ("ratio", "image / text"), ("encoder_ms", "encoder ms"), ("backbone_ms", "backbone ms"),
                          ("encoder_share", "encoder share")]))
    wall = time.time() - start
    path = write_results("vision", {"machine": machine(), "args": vars(args), "wall_s": wall,
                                    "matmul_gflops": rates, "encoder_parameters": counts,
                                    "encoders": encoders, "prefill": prefill})
    print(f"wrote {path} in {wall:.0f} s")


if __name__ == "__main__":
    main()
