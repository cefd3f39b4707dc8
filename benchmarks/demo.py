"""Which model learns most in `make demo`'s five minutes on this machine? (Issue 10, item 8.)

Each candidate keeps every K3 mechanism (KDA + MLA, Block AttnRes, SiTU Stable LatentMoE, Per-Head
Muon, quantile balancing, QK-clip) and trains on the Python standard library's source for a fixed wall
time. Its step count is set from a short measured probe so that the learning-rate schedule (warmup,
cosine decay) completes inside the budget; the validation loss is at the same 256-token windows for all.
A sample (the demo's prompt and sampling settings) shows whether the result is recognisably Python.

    python benchmarks/demo.py                     # 4 candidates x 5 min, ~25 min on 2 cores
    python benchmarks/demo.py --append --candidates d96-L4 d128-L4@2048   # more candidates, same table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, machine, table, write_results  # noqa: E402

from k3.config import AttnResConfig, K3Config, preset  # noqa: E402
from k3.serve.engine import Engine, SamplingParams  # noqa: E402
from k3.train.pretrain import Run, TrainConfig, train  # noqa: E402

PROMPT = "def "


def shaped(width: int, layers: int, heads: int, experts: int = 8) -> K3Config:
    """The `small` preset narrowed: width, depth and heads scaled together, every mechanism kept."""
    c = preset("small")
    head = width // heads
    c.hidden_size, c.num_layers, c.mla_period = width, layers, min(c.mla_period, layers)
    c.kda = dataclasses.replace(c.kda, num_heads=heads, head_dim=head, value_head_dim=head, decay_rank=head // 2)
    c.mla = dataclasses.replace(c.mla, num_heads=heads, q_lora_rank=width // 2, kv_lora_rank=width // 2,
                                qk_nope_head_dim=head, qk_shared_head_dim=head // 2, v_head_dim=head)
    c.attn_res = AttnResConfig(block_size=2)
    c.moe = dataclasses.replace(c.moe, num_experts=experts, expert_hidden=width, shared_hidden=width,
                                latent_dim=32 * max(1, width // 64), dense_hidden=3 * width)  # MX blocks of 32
    c.vision = dataclasses.replace(c.vision, enabled=False, out_dim=width)
    return c.validate()


CANDIDATES = {
    "small": lambda: preset("small"),
    "d192-L6": lambda: shaped(192, 6, 3),
    "d128-L6": lambda: shaped(128, 6, 2),
    "d128-L4": lambda: preset("mini"),  # = shaped(128, 4, 2): the winner, now the `mini` preset
    "d96-L4": lambda: shaped(96, 4, 2),
}


def probe_seconds_per_step(config: TrainConfig, steps: int = 4) -> float:
    """Median seconds of a training step (after one warm-up) at the run's settings."""
    run = Run(config)
    run.prepare(resume=False)
    run.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run.step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def candidate(spec: str, minutes: float, args: argparse.Namespace, work: Path) -> dict:
    """Train candidate ``NAME[@TOKENS_PER_STEP]`` for ``minutes``; its row of the table."""
    name, _, tokens = spec.partition("@")
    tokens_per_step = int(tokens or args.tokens_per_step)
    model = CANDIDATES[name]()
    base = dict(tokens_per_step=tokens_per_step, curriculum=args.curriculum, eval_batches=8, progress=False,
                model=model.to_dict(), seed=0)
    probe_dir = work / f"{name}-probe"
    probe = probe_seconds_per_step(TrainConfig(out=str(probe_dir), steps=1000, **base))
    # eval and checkpoints cost about a tenth: size the schedule to finish inside the budget
    steps = max(10, int(0.9 * 60 * minutes / probe))
    out = work / name
    shutil.copytree(probe_dir / "tokenizer", out / "tokenizer")  # the same tokenizer, not trained again
    config = TrainConfig(out=str(out), steps=steps, eval_every=max(1, steps // 5), ckpt_every=steps,
                         max_minutes=minutes, **base)
    start = time.time()
    run = train(config)
    seconds = time.time() - start
    engine = Engine(run.model, run.tokenizer)
    ids = [t for o in engine.generate(run.tokenizer.encode(PROMPT), SamplingParams(
        max_tokens=120, temperature=0.8, top_p=0.95, seed=0, stop_token_ids=(run.tokenizer.eos_id,)))
        for t in o.token_ids]
    row = {"candidate": name, "tokens_per_step": tokens_per_step,
           "parameters": sum(p.numel() for p in run.model.parameters()), "probe_s_per_step": probe,
           "steps": run.step_index, "planned_steps": steps, "tokens": run.step_index * tokens_per_step,
           "seconds": seconds, "val_loss": run.last_validation.loss,
           "val_bpb": run.last_validation.bits_per_byte, **run.last_validation.anchors,
           "sample": PROMPT + run.tokenizer.decode([t for t in ids if t != run.tokenizer.eos_id])}
    shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--candidates", nargs="+", default=["small", "d192-L6", "d128-L6", "d128-L4"],
                        help=f"NAME[@TOKENS_PER_STEP], NAME one of {', '.join(CANDIDATES)}")
    parser.add_argument("--tokens-per-step", type=int, default=4096)
    parser.add_argument("--curriculum", type=json.loads, default=[[0.0, 256]],
                        help="JSON list of [fraction, length] stages")
    parser.add_argument("--append", action="store_true", help="add the rows to benchmarks/results/demo.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3-demo-"))
    saved = RESULTS / "demo.json"
    rows = json.loads(saved.read_text())["rows"] if args.append and saved.exists() else []
    try:
        for name in args.candidates:
            rows.append(candidate(name, args.minutes, args, work))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows, [("candidate", "candidate"), ("tokens_per_step", "tokens / step"),
                       ("parameters", "parameters"), ("steps", "steps"),
                       ("tokens", "tokens"), ("seconds", "s"), ("val_loss", "val loss")]))
    for row in rows:
        print(f"\n--- {row['candidate']} ---\n{row['sample']}")
    print(write_results("demo", {"machine": machine(), "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
