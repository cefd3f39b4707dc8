"""Does KDA learn what the Kimi Linear paper says it learns? Palindrome, MQAR and Stack (`k3.train.synthetic`) by
sequence length, for KDA, a Gated DeltaNet-style variant (one decay per head) and Gated MLA, each KDA variant with
K3's bounded gate and with Kimi Linear's softplus gate and its ``dt_bias`` initialisation (issue 38, item 2).

    python benchmarks/synthetic.py                                  # the reproduction's shape, 256 … 2,048 tokens
    python benchmarks/synthetic.py --width 128 --head-dim 64 --lengths 64 128 --steps 800   # what 2 CPU cores allow

Each row trains a fresh model (``--seed``, 0 unless given) on fresh seeded batches for ``--steps`` AdamW steps
(warmup, cosine decay) and scores the greedy accuracy of the answer tokens on held-out batches. Runs on any device
torch has (``--device``), with ``PYTHONPATH=src`` and torch alone. Results: ``benchmarks/results/synthetic.json``
(rows added with ``--append``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, machine, table, write_results  # noqa: E402

from k3.model.lm import K3ForCausalLM  # noqa: E402
from k3.train.synthetic import TASKS, SyntheticRun, model_config  # noqa: E402

#: (name, mixer, gate): KDA and the GDN-style variant with each gate; MLA has no decay gate.
VARIANTS = (("KDA", "kda", "bounded"), ("KDA, softplus gate", "kda", "softplus"), ("GDN-style", "gdn", "bounded"),
            ("GDN-style, softplus gate", "gdn", "softplus"), ("Gated MLA", "mla", "bounded"))


def row(task: str, variant: tuple[str, str, str], length: int, args: argparse.Namespace) -> dict:
    name, mixer, gate = variant
    torch.manual_seed(args.seed)
    config = model_config(mixer, gate, width=args.width, heads=args.heads, head_dim=args.head_dim,
                          context=max(length, 64))
    model = K3ForCausalLM(config).to(args.device)
    run = SyntheticRun(task, length, model, batch=args.batch, lr=args.lr, seed=args.seed)
    start = time.perf_counter()
    losses = run.train(args.steps)
    return {"task": task, "variant": name, "mixer": mixer, "gate": gate, "length": length, "width": args.width,
            "heads": args.heads, "head_dim": args.head_dim, "steps": args.steps, "batch": args.batch, "lr": args.lr,
            "seed": args.seed, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "accuracy": run.accuracy(args.eval_batches), "seconds": time.perf_counter() - start, "device": args.device}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS], choices=[v[0] for v in VARIANTS])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--append", action="store_true", help="add the rows to the existing results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = RESULTS / "synthetic.json"
    rows = json.loads(path.read_text())["rows"] if args.append and path.exists() else []
    chosen = [v for v in VARIANTS if v[0] in args.variants]
    for task in args.tasks:
        for length in args.lengths:
            for variant in chosen:
                rows.append(row(task, variant, length, args))
                print(json.dumps(rows[-1]), flush=True)
    print(table(rows, [("task", "task"), ("variant", "variant"), ("length", "length"), ("width", "width"),
                       ("head_dim", "head dim"), ("steps", "steps"), ("final_loss", "final loss"),
                       ("accuracy", "accuracy"), ("seconds", "s")]))
    print(f"results: {write_results('synthetic', {'machine': machine(), 'rows': rows})}")


if __name__ == "__main__":
    main()
