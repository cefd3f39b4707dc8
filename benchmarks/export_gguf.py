"""Our GGUF export in llama.cpp (issue 39, item 5): ``k3 export --format gguf`` files loaded by llama.cpp's ``kimi-k3``
architecture, their greedy tokens and tokenizer held to kimi-k3's. Optional, never in CI.

The peer is llama-cpp-python 0.3.36 built from its source distribution (`llamacpp.ensure_llama_cpp`: ~25 min on 2
cores, once). The models:

* ``tiny`` trained for ``--steps`` steps on the standard library (``k3 train``), so greedy text is text;
* ``release-tiny`` with random weights (seed 0): the release's kernel shapes (kv_lora_rank 512, rope 64, K = V = 128).

Each is exported twice: with float experts (every tensor fp32) and packed (``k3 quantize``: MXFP4 experts, as the
release). Rows, per model and experts: over ``--prompts`` prompts cut from held-out text, how many of ``--tokens``
greedy tokens llama.cpp and kimi-k3 (eager, fp32) agree on, the first disagreement, and the prompts' next-token logits
(max |Δ| over max |logit|). llama.cpp multiplies MXFP4 weights with activations it rounds to 8 bits (``q8_0``), so
the packed rows compare W4A8 against our W4A32: agreement there is expected to be close, not exact. The tokenizer
rows: texts (code, prose, Unicode, runs of whitespace, digits, a rendered chat with its special tokens) tokenized by
llama.cpp with special tokens parsed against ``Tokenizer.encode(..., allow_special=True)``, and decoded back.

    python benchmarks/export_gguf.py          # ~5 min once llama-cpp-python is built
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results  # noqa: E402
from llamacpp import ensure_llama_cpp, llama_cpp_source  # noqa: E402

from k3.chat.native import render_text  # noqa: E402
from k3.cli import main as k3  # noqa: E402
from k3.model.checkpoint import load_model, save_model  # noqa: E402
from k3.model.lm import K3ForCausalLM  # noqa: E402
from k3.model.packed import PackedExperts  # noqa: E402
from k3.config import preset  # noqa: E402
from k3.train.data import stdlib_documents  # noqa: E402

TEXTS = [
    "def parse(text: str) -> dict:\n    return {k: v for k, v in pairs}\n",
    "The quick brown fox jumps over the lazy dog, 1234567890 times.",
    "naïve café — 東京の天気は晴れです 🙂👍🏽 Ελληνικά русский",
    "    \n\n\t\t  trailing   spaces   \n",
    "x=3.14159e-10; y = -0x1F; z = 1_000_000",
    "it's they're we've I'm you'll he'd",
]


def texts(tokenizer) -> list[str]:  # noqa: ANN001
    """`TEXTS`, two slices of standard-library source and a rendered chat (special tokens as literals)."""
    docs = [d.text for d in stdlib_documents(limit_bytes=200_000)]
    chat = render_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
                        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
                       tokenizer, mode="instruct")
    return TEXTS + [docs[3][:2000], docs[-1][-2000:], chat]


def models(work: Path, steps: int) -> dict[str, Path]:
    """The checkpoints (module docstring): name → checkpoint directory."""
    assert k3(["train", "--preset", "tiny", "--out", str(work / "tiny"), "--steps", str(steps),
               "--eval-every", str(steps), "--ckpt-every", str(steps)]) == 0
    _, tokenizer = load_model(work / "tiny")
    torch.manual_seed(0)
    release = save_model(work / "release-tiny", K3ForCausalLM(preset("release-tiny")), tokenizer)
    out = {"tiny": work / "tiny", "release-tiny": release}
    for name in list(out):
        packed = work / f"{name}-packed"
        assert k3(["quantize", "--ckpt", str(out[name]), "--out", str(packed)]) == 0
        out[f"{name} packed"] = packed
    return out


def peer(gguf: Path, request: dict, work: Path) -> dict:
    path = work / "request.json"
    path.write_text(json.dumps(request))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("export_gguf_peer.py")), str(gguf), str(path)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp on {gguf}: {(done.stderr or done.stdout)[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ours(model: K3ForCausalLM, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """kimi-k3's greedy continuations and next-token logits (eager, fp32)."""
    continuations, first = [], []
    with torch.no_grad():
        for ids in prompts:
            logits, state = model(torch.tensor([ids]), state=model.new_state(1))
            first.append(logits[0, -1].double())
            out = [int(logits[0, -1].argmax())]
            while len(out) < steps:
                logits, state = model(torch.tensor([[out[-1]]]), state=state)
                out.append(int(logits[0, -1].argmax()))
            continuations.append(out)
    return continuations, first


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's ``q8_0`` rounding of a matmul input, as its CPU MXFP4 product takes it: blocks of 32 along the last
    axis, ``d = max|x| / 127``, codes ``round(x / d)``, the scale kept in fp16."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (codes * d.to(torch.float16).to(x.dtype)).reshape(x.shape)


def with_w4a8(model: K3ForCausalLM) -> K3ForCausalLM:
    """``model`` with every packed expert's inputs rounded as `q8_0` (what llama.cpp computes)."""
    for module in model.modules():
        if isinstance(module, PackedExperts):
            module._input = q8_0  # the inputs `Experts._input` would MX-quantize
    return model


def agreement(mine: list[list[int]], theirs: list[list[int]]) -> tuple[str, str, list[int]]:
    """Greedy tokens equal (of all), prompts whose continuations are identical, and the first disagreements."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(mine, theirs)]
    equal = sum(a == b for x, y in zip(mine, theirs) for a, b in zip(x, y))
    return (f"{equal}/{sum(len(x) for x in mine)}", f"{sum(f is None for f in first)}/{len(first)}",
            [f for f in first if f is not None])


def compare(name: str, ckpt: Path, work: Path, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    gguf = work / f"{name.replace(' ', '-')}.gguf"
    assert k3(["export", "--ckpt", str(ckpt), "--format", "gguf", "--out", str(gguf)]) == 0
    model, tokenizer = load_model(ckpt)
    held_out = list(stdlib_documents(limit_bytes=400_000))[-1].text
    prompts = [tokenizer.encode(held_out[i * 300: i * 300 + 120])[:24] for i in range(args.prompts)]
    sample = texts(tokenizer)
    theirs = peer(gguf, {"prompts": prompts, "steps": args.tokens, "texts": sample}, work)
    row = {"model": name, "bytes": gguf.stat().st_size}
    for inputs in ("fp32", "q8_0") if model.config.mx.enabled else ("fp32",):
        mine, logits = ours(with_w4a8(model) if inputs == "q8_0" else model, prompts, args.tokens)
        agree, identical, first = agreement(mine, theirs["greedy"])
        diff = max(float((torch.tensor(t, dtype=torch.float64) - m).abs().max() / m.abs().max())
                   for t, m in zip(theirs["prompt_logits"], logits))
        row |= {f"agree_{inputs}": agree, f"identical_{inputs}": identical, f"first_disagreement_{inputs}": first,
                f"logits_rel_max_diff_{inputs}": diff}
        if inputs == "fp32":  # a random model's greedy text holds padding ids past the tokenizer
            row["sample"] = tokenizer.decode([t for t in mine[0] if t < tokenizer.vocab_size])
    tokens = [{"model": name, "text": repr(text[:32]),
               "ids_equal": t["ids"] == tokenizer.encode(text, allow_special=True), "decoded_equal": t["text"] == text}
              for text, t in zip(sample, theirs["tokenized"])]
    return row, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps of the tiny model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    args = parser.parse_args()
    torch.set_num_threads(2)
    ensure_llama_cpp(llama_cpp_source())
    rows, tokens = [], []
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        for name, ckpt in models(work, args.steps).items():
            row, toks = compare(name, ckpt, work, args)
            rows.append(row)
            tokens += toks
            print(row, flush=True)
    print(table(rows, [("model", "model"), ("bytes", "GGUF bytes"), ("agree_fp32", "greedy equal (ours fp32)"),
                       ("identical_fp32", "prompts identical"), ("logits_rel_max_diff_fp32", "logits max |Δ| / max"),
                       ("agree_q8_0", "greedy equal (ours W4A8)"), ("identical_q8_0", "prompts identical"),
                       ("logits_rel_max_diff_q8_0", "logits max |Δ| / max")]))
    print(table(tokens, [("model", "model"), ("text", "text"), ("ids_equal", "ids equal"),
                         ("decoded_equal", "decodes back")]))
    path = write_results("gguf", {"machine": machine(), "llama_cpp_python": "0.3.36", "rows": rows,
                                  "tokenizer": tokens})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
