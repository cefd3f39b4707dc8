"""llama.cpp as the CPU peer (issue 37): the same released-layout weights decoded by llama.cpp and by kimi-k3, at
batch 1 and 8, side by side in one run.

The peer is llama-cpp-python 0.3.36 built from its source distribution, whose vendored llama.cpp knows the
``kimi-k3`` architecture; its ``convert_hf_to_gguf.py`` turns a released-layout directory into a GGUF file. On
first use this script downloads that sdist into ``~/.cache/k3/llamacpp`` and builds it into the running
environment (``pip install``; ~25 min on 2 cores; optional, never in CI).

The model is ``small`` at width 1024 (`startup.wide`: 8 layers, 16 routed experts, d=1024; its KDA decay rank is
head_dim, 128, as the release's config implies: 163M parameters, 54 % in routed experts), random weights, seed 0,
saved with `k3.model.pretrained.save_pretrained`: the release's layout and dtypes, MXFP4 routed experts. Two
directories hold the same values: *packed* (the release: MXFP4 experts) and *float* (the experts decoded to
bf16, exactly, and no quantization config). Each is converted with ``--outtype f32`` (llama.cpp repacks the
MXFP4 experts as ggml MXFP4 and keeps every other tensor f32), and loaded by kimi-k3 with
`K3ForCausalLM.from_pretrained` in fp32 (the packed one with `k3.model.packed.PackedExperts`).

The converter recognises a tokenizer by the hash of the ids it gives a test string, so only the release's own
163,840-token vocabulary passes it. This checkpoint has a byte-level vocabulary of its own (256 bytes and the 256
reserved special ids, in ``tiktoken.model`` and ``tokenizer_config.json``), so the conversion runs the
converter's own Kimi vocabulary branch with the pre-tokenizer named ``kimi-k2`` (the same regex,
`k3.tokenization.kimi.PAT_STR`) instead of the hash lookup; nothing else of the converter is changed. Decoding
feeds token ids, so the vocabulary does not enter the timings.

Rows, per checkpoint and batch: decode tokens/s (after a 32-token prompt, greedy, each step feeding the last
argmax; the median over 5 blocks of 32 steps; each engine measured ``--rounds`` times, alternated, and the medians
reported, the ratios as the median of each round's) of llama.cpp (its low-level API: one ``llama_decode`` per step, the
batch as ``batch`` sequences), of kimi-k3 eager and of kimi-k3 compiled (`k3.model.compiled.CompiledModel`, tuned:
what ``k3 generate --compile`` and ``k3 serve --compile`` decode with; its compilation is timed apart), all on
``--threads`` threads. Agreement, per checkpoint at batch 1: the prompt's next-token logits of llama.cpp against
kimi-k3 eager (max |Δ| over max |logit|) and how many of 16 greedy tokens agree.

    python benchmarks/llamacpp.py          # ~18 min once llama-cpp-python is built
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import machine, table, write_results  # noqa: E402
from kimi_fixtures import kimi_config  # noqa: E402
from llamacpp_peer import AGREE_TOKENS, PROMPT, prompt  # noqa: E402
from model import compiled_decoder, k3_decode_tokens_per_s  # noqa: E402
from startup import wide  # noqa: E402

from k3 import K3ForCausalLM  # noqa: E402
from k3.files import CONFIG_LIMIT, read_json, user_cache, write_text  # noqa: E402
from k3.model.pretrained import save_pretrained  # noqa: E402
from k3.model.safetensors_io import Shards, write_shards  # noqa: E402
from k3.ops.mx import dequantize  # noqa: E402
from k3.tokenization.kimi import KimiTokenizer  # noqa: E402

VERSION = "0.3.36"

# Runs the vendored converter with its Kimi vocabulary branch reading a `KimiTokenizer` (see the module docstring).
CONVERT = r'''
import runpy, sys
from pathlib import Path
source = Path(sys.argv.pop(1))
sys.path[:0] = [str(source), str(source / "gguf-py")]
import transformers
from conversion import base
from k3.tokenization.kimi import KimiTokenizer

class RemoteCodeTokenizer:
    """What the converter's kimi-k2 branch reads of the release's remote-code tokenizer."""
    def __init__(self, directory):
        tok = KimiTokenizer.load(directory)
        token_bytes = tok.token_bytes()
        base_size = sum(1 for b in token_bytes if b)
        self.model = type("Model", (), {"_mergeable_ranks": {b: i for i, b in enumerate(token_bytes[:base_size])}})
        self.special_tokens = {tok.id_to_token(i): i for i in range(base_size, len(token_bytes))}
        self.eos_id = tok.eos_id

def no_tokenizer_json(self):
    raise FileNotFoundError("no tokenizer.json: the Kimi branch reads tiktoken.model")

base.TextModel._set_vocab_gpt2 = no_tokenizer_json
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "kimi-k2"
transformers.AutoTokenizer.from_pretrained = lambda directory, **kwargs: RemoteCodeTokenizer(directory)
sys.argv[0] = str(source / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


# ---------------------------------------------------------------------- the peer: source, build, conversion
def llama_cpp_source() -> Path:
    """llama-cpp-python's sdist (downloaded once) and its unpacked tree, in ``~/.cache/k3/llamacpp``."""
    root = user_cache("llamacpp")
    root.mkdir(parents=True, exist_ok=True)
    tarball = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not tarball.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                        str(root), f"llama-cpp-python=={VERSION}"], check=True)
    tree = root / f"llama_cpp_python-{VERSION}"
    if not (tree / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        with tarfile.open(tarball) as archive:
            archive.extractall(root, filter="data")
    return tree


def ensure_llama_cpp(tree: Path) -> None:
    """Build and install llama-cpp-python from ``tree``'s sdist unless this environment has that version."""
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if probe.stdout.strip() == VERSION:
        return
    print(f"building llama-cpp-python {VERSION} from source (~25 min on 2 cores) ...", flush=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    subprocess.run([sys.executable, "-m", "pip", "install", str(tree.with_name(tree.name + ".tar.gz"))],
                   check=True, env=env)


def convert(tree: Path, release: Path, out: Path) -> Path:
    """``convert_hf_to_gguf.py --outtype f32`` of ``release`` (in a fresh interpreter)."""
    source = tree / "vendor" / "llama.cpp"
    done = subprocess.run([sys.executable, "-c", CONVERT, str(source), str(release), "--outtype", "f32", "--outfile",
                           str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {release}:\n{done.stderr[-3000:]}")
    return out


# ---------------------------------------------------------------------- the checkpoints
def tokenizer_files(directory: Path) -> None:
    """A byte-level Kimi vocabulary: 256 byte ranks and the 256 reserved specials (named at the release's offsets,
    `kimi_fixtures.kimi_config`)."""
    KimiTokenizer({bytes([b]): b for b in range(256)}, kimi_config(256)).save(directory)


def checkpoints(work: Path) -> dict[str, Path]:
    """The released-layout *packed* directory and its *float* twin (same values; see the module docstring)."""
    torch.manual_seed(0)
    packed = work / "packed"
    config = wide()
    save_pretrained(K3ForCausalLM(replace(config, kda=replace(config.kda, decay_rank=config.kda.head_dim))), packed)
    tokenizer_files(packed)
    shards, tensors = Shards(packed), {}
    for name in shards:
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            weight = name.removesuffix("_packed")
            tensors[weight] = dequantize(shards.tensor(name), shards.tensor(weight + "_scale"), torch.bfloat16)
        else:
            tensors[name] = shards.tensor(name)
    plain = work / "float"
    write_shards(plain, tensors)
    config = read_json(packed / "config.json", CONFIG_LIMIT)
    del config["text_config"]["quantization_config"]
    write_text(plain / "config.json", json.dumps(config, indent=2))
    tokenizer_files(plain)
    return {"float": plain, "packed": packed}


def run_llama(gguf: Path, batch: int, threads: int, seed: int) -> dict:
    """`llamacpp_peer.run` in its own process (no torch there: one OpenMP runtime)."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("llamacpp_peer.py")), str(gguf), str(batch),
                           str(threads), str(seed)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout or "no output").strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- kimi-k3's side
def k3_agreement(model: K3ForCausalLM, seed: int, peer: dict) -> dict:
    """kimi-k3 eager against llama.cpp at batch 1: the prompt's logits and 16 greedy tokens."""
    ids = torch.tensor(prompt(model.config.vocab_size, 1, seed))
    with torch.no_grad():
        logits, state = model(ids, state=model.new_state(1))
        ours_logits = logits[0, -1].double()
        tokens = [int(ours_logits.argmax())]
        while len(tokens) < AGREE_TOKENS:
            logits, state = model(torch.tensor([[tokens[-1]]]), state=state)
            tokens.append(int(logits[0, -1].argmax()))
    theirs = torch.tensor(peer["prompt_logits"], dtype=torch.float64)
    return {"logits_rel_max_diff": float((theirs - ours_logits).abs().max() / ours_logits.abs().max()),
            "greedy_agree": sum(a == b for a, b in zip(tokens, peer["greedy"])),
            "greedy_agree_prefix": next((i for i, (a, b) in enumerate(zip(tokens, peer["greedy"])) if a != b),
                                        AGREE_TOKENS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="threads for both engines (default %(default)s)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="alternated measurements of each engine (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tree = llama_cpp_source()
    ensure_llama_cpp(tree)
    rows, agreement = [], {}
    with tempfile.TemporaryDirectory() as work:
        for kind, release in checkpoints(Path(work)).items():
            gguf = convert(tree, release, Path(work) / f"{kind}.gguf")
            model = K3ForCausalLM.from_pretrained(release)
            for batch in args.batches:
                compiled, compile_s = compiled_decoder(model, batch, PROMPT)
                rounds, peers = [], []
                for _ in range(args.rounds):  # alternated, so a slow spell of the shared machine hits both engines
                    peers.append(run_llama(gguf, batch, args.threads, args.seed))
                    if "error" in peers[-1]:
                        break
                    rounds.append((peers[-1]["tokens_per_s"], k3_decode_tokens_per_s(model, batch, PROMPT),
                                   compiled()))
                if batch == 1 and rounds:
                    agreement[kind] = k3_agreement(model, args.seed, peers[0])
                row = {"experts": kind, "batch": batch, "rounds": rounds, "compile_s": compile_s,
                       "error": peers[-1].get("error") if peers else None}
                if rounds:
                    llama, eager, ours = (statistics.median(r[i] for r in rounds) for i in range(3))
                    row.update(llama_cpp=llama, k3_eager=eager, k3_compiled=ours,
                               compiled_vs_llama_cpp=statistics.median(r[2] / r[0] for r in rounds),
                               eager_vs_llama_cpp=statistics.median(r[1] / r[0] for r in rounds))
                rows.append(row)
                print(row, flush=True)
            torch.compiler.reset()
    columns = [("experts", "routed experts"), ("batch", "batch"), ("llama_cpp", "llama.cpp tok/s"),
               ("k3_eager", "k3 eager tok/s"), ("k3_compiled", "k3 compiled tok/s"),
               ("compiled_vs_llama_cpp", "compiled ÷ llama.cpp"), ("eager_vs_llama_cpp", "eager ÷ llama.cpp"),
               ("compile_s", "compile s")]
    print(table(rows, columns))
    print(f"agreement with llama.cpp at batch 1: {agreement}")
    path = write_results("llamacpp", {"machine": machine(), "llama_cpp_python": VERSION, "threads": args.threads,
                                      "model": "small at d=1024 (startup.wide), random weights, seed 0",
                                      "rows": rows, "agreement": agreement})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
