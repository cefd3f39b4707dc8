"""Does the K3 recipe beat a conventional one at toy scale? (The counterpart of the paper's scaling comparison.)

At equal tokens (same steps, tokens per step, data, tokenizer and sequence length) each variant trains a
~2.3M-parameter model on the Python standard library's source and reports the final validation loss,
averaged over seeds:

* ``k3``: Block AttnRes, 3 KDA : 1 MLA, SiTU-GLU Stable LatentMoE, Per-Head Muon, quantile balancing;
* ``baseline``: plain residual stream, MLA in every layer, standard top-k SwiGLU MoE (no latent), AdamW,
  bias-step balancing;
* ablations swapping one component of ``k3``: AttnRes off, KDA→MLA, SiTU→SwiGLU, Muon→AdamW, quantile →
  bias-step balancing.

Wall time per run is reported beside the loss (compute per token differs a little between variants).

    python benchmarks/recipe.py                  # 7 variants x 2 seeds, ~25 min on 2 cores
    python benchmarks/recipe.py --steps 40 --seeds 0   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, machine, table, write_results  # noqa: E402

from k3.config import AttnResConfig, K3Config, preset  # noqa: E402
from k3.files import atomic_write  # noqa: E402
from k3.train.pretrain import TrainConfig, train  # noqa: E402
from k3.train.optim import OptimConfig  # noqa: E402


def base_model() -> K3Config:
    c = preset("small")
    c.hidden_size, c.num_layers, c.vocab_size = 128, 4, 4096
    c.kda = dataclasses.replace(c.kda, num_heads=2, head_dim=64, value_head_dim=64, decay_rank=32)
    c.mla = dataclasses.replace(c.mla, num_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                                qk_shared_head_dim=16, v_head_dim=32)
    c.attn_res = AttnResConfig(block_size=2)
    c.moe = dataclasses.replace(c.moe, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                                expert_hidden=128, shared_hidden=128, latent_dim=64, dense_hidden=384)
    c.vision = dataclasses.replace(c.vision, enabled=False, out_dim=128)
    return c.validate()


def variant(name: str) -> tuple[K3Config, dict]:
    """(model config, training overrides) of a recipe variant."""
    c, train = base_model(), {}
    all_mla = list(range(1, c.num_layers + 1))
    if name in ("baseline", "no-attnres"):
        c.attn_res = AttnResConfig(enabled=False)
    if name in ("baseline", "kda->mla"):
        c.mla_layers = all_mla
    if name == "baseline":
        c.moe = dataclasses.replace(c.moe, latent_dim=None, activation="swiglu")
    if name == "situ->swiglu":
        c.moe = dataclasses.replace(c.moe, activation="swiglu")
    if name in ("baseline", "muon->adamw"):
        train["optim"] = OptimConfig(optimizer="adamw")
    if name in ("baseline", "quantile->bias-step"):
        train["balance"] = "bias-step"
    return c.validate(), train


VARIANTS = ("k3", "baseline", "no-attnres", "kda->mla", "situ->swiglu", "muon->adamw", "quantile->bias-step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--data-limit-mb", type=float, default=3.0)
    parser.add_argument("--summarize", type=Path, help="re-report the runs of an earlier results JSON")
    args = parser.parse_args()
    if args.summarize:
        saved = json.loads(args.summarize.read_text())
        report(saved["runs"], saved["args"])
        return

    work = Path(tempfile.mkdtemp(prefix="k3-recipe-"))
    tokenizer_file: Path | None = None
    runs = []
    for name in args.variants:
        model, overrides = variant(name)
        for seed in args.seeds:
            out = work / f"{name}-{seed}"
            if tokenizer_file is not None:  # one tokenizer for every run: equal data, equal tokens
                (out / "tokenizer").mkdir(parents=True)
                shutil.copy(tokenizer_file, out / "tokenizer" / "tokenizer.json")
            config = TrainConfig(out=str(out), steps=args.steps, tokens_per_step=args.tokens_per_step,
                                 curriculum=[[0.0, args.seq_len]], eval_every=args.steps, eval_batches=16,
                                 ckpt_every=args.steps, seed=seed, data_limit_bytes=int(args.data_limit_mb * 2**20),
                                 progress=False, model=model.to_dict(), **overrides)
            start = time.time()
            run = train(config)
            tokenizer_file = tokenizer_file or out / "tokenizer" / "tokenizer.json"
            row = {"variant": name, "seed": seed, "val_loss": run.last_validation.loss, "seconds": time.time() - start,
                   "tokens": args.steps * args.tokens_per_step,
                   "parameters": sum(p.numel() for p in run.model.parameters())}
            runs.append(row)
            print(json.dumps(row), flush=True)
            if tokenizer_file.parent.parent != out:
                shutil.rmtree(out)
    shutil.rmtree(work, ignore_errors=True)
    report(runs, vars(args))


def summarize(runs: list[dict]) -> list[dict]:
    """Per variant: mean validation loss over seeds and the mean paired difference to ``k3`` at the same
    seed (each seed has its own validation documents, so the paired difference is the sharper number)."""
    k3 = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == "k3"}
    rows = []
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        losses = [r["val_loss"] for r in mine]
        paired = [r["val_loss"] - k3[r["seed"]] for r in mine if r["seed"] in k3]
        rows.append({"variant": name, "val_loss": statistics.mean(losses), "spread": (max(losses) - min(losses)) / 2,
                     "vs_k3": statistics.mean(paired) if paired else None,
                     "vs_k3_min": min(paired) if paired else None, "vs_k3_max": max(paired) if paired else None,
                     "seeds": len(losses), "seconds": statistics.mean(r["seconds"] for r in mine),
                     "parameters": mine[0]["parameters"]})
    return rows


def report(runs: list[dict], args: dict) -> None:
    rows = summarize(runs)
    print()
    print(f"{args['steps']} steps x {args['tokens_per_step']} tokens (sequence {args['seq_len']}), "
          f"seeds {args['seeds']}")
    print(table(rows, [("variant", "variant"), ("val_loss", "val loss (mean)"), ("spread", "± half-range"),
                       ("vs_k3", "vs k3, paired by seed"), ("vs_k3_min", "min over seeds"),
                       ("vs_k3_max", "max over seeds"),
                       ("seconds", "s / run"), ("parameters", "parameters")]))
    plot(rows, RESULTS / "recipe.png")
    path = write_results("recipe", {"machine": machine(), "args": args, "runs": runs, "summary": rows})
    print(f"wrote {path} and {RESULTS / 'recipe.png'}")


def plot(rows: list[dict], png: Path) -> None:
    """Validation loss minus k3's at the same seed (bars: mean over seeds; whiskers: the seeds' range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["vs_k3"] is not None]
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["variant"] for r in rows]
    means = [r["vs_k3"] for r in rows]
    whiskers = [[m - r["vs_k3_min"] for m, r in zip(means, rows)], [r["vs_k3_max"] - m for m, r in zip(means, rows)]]
    ax.bar(names, means, yerr=whiskers, capsize=4,
           color=["tab:green" if n == "k3" else "tab:red" if n == "baseline" else "tab:blue" for n in names])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("validation loss − k3's (nats; > 0: worse)")
    ax.set_title("K3 recipe vs a conventional baseline and one-component ablations (equal tokens)")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with atomic_write(png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
