"""``k3 export --format gguf`` (issue 39, item 5), held to llama.cpp's own converter: for a checkpoint with float
experts and its MXFP4-packed twin, the file we write equals — key for key, tensor for tensor, byte for byte — what
``convert_hf_to_gguf.py --outtype f32`` (llama-cpp-python 0.3.36's vendored llama.cpp) writes from the same weights in
the release layout. The converter only knows tokenizers by a hash of its test string's ids, so it is told the
pre-tokenizer's name (``gpt-2``, the split our byte-level BPE uses); everything else is its own."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import serving
from k3.cli import main
from k3.config import preset
from k3.interop.export import write_tokenizer
from k3.model.checkpoint import load_model, save_model
from k3.model.lm import K3ForCausalLM
from k3.model.pretrained import release_config, release_tensors
from k3.model.quantize import pack_model
from k3.model.safetensors_io import write_shards
from peers import llama_cpp_converter

gguf = pytest.importorskip("gguf")

CONVERT = r'''
import runpy, sys
from pathlib import Path
source = Path(sys.argv.pop(1))
sys.path[:0] = [str(source), str(source / "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = str(source / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''
# Keys only the converter writes: a size label ("4x209K") computed from parameter counts.
CONVERTER_ONLY = {"general.size_label"}


def release_dir(model: K3ForCausalLM, directory: Path) -> Path:
    """``model``'s weights in the release layout at full precision (fp32, experts as the model holds them), with
    our Hugging Face tokenizer: what the converter reads."""
    write_shards(directory, release_tensors(model, stored=False))
    config = release_config(model)
    if not model.config.mx.enabled:  # float experts: no compressed-tensors MXFP4 to unpack
        del config["text_config"]["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    write_tokenizer(serving.tokenizer(), directory, model.config.context_length)
    return directory


def converted(release: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp_converter()), str(release), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.") and k != "general.name"}


def tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    return {t.name: (t.tensor_type.name, [int(n) for n in t.shape], np.asarray(t.data).tobytes())
            for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module", params=["float experts", "packed MXFP4 experts"])
def checkpoint(request, tmp_path_factory) -> Path:
    model = serving.model()
    if request.param.startswith("packed"):
        model = pack_model(model)
    return save_model(tmp_path_factory.mktemp("gguf") / "ckpt", model, serving.tokenizer())


def test_the_gguf_equals_llama_cpps_conversion_of_the_same_weights(checkpoint, tmp_path, capsys):
    ours = tmp_path / "ours.gguf"
    assert main(["export", "--ckpt", str(checkpoint), "--format", "gguf", "--out", str(ours)]) == 0
    assert f"k3 export: {ours}" in capsys.readouterr().out
    model, _ = load_model(checkpoint)
    theirs = converted(release_dir(model, tmp_path / "release"), tmp_path / "theirs.gguf")
    mine, peer = fields(ours), fields(theirs)
    assert {k: v for k, v in peer.items() if k not in CONVERTER_ONLY} == mine
    assert mine["general.architecture"] == "kimi-k3" and mine["tokenizer.ggml.pre"] == "gpt-2"
    assert mine["general.file_type"] == (38 if model.config.mx.enabled else 0)  # MOSTLY_MXFP4_MOE / ALL_F32
    ours_t, theirs_t = tensors(ours), tensors(theirs)
    assert ours_t.keys() == theirs_t.keys()
    for name in ours_t:
        assert ours_t[name] == theirs_t[name], name
    kinds = {kind for kind, _, _ in ours_t.values()}
    assert kinds == ({"F32", "MXFP4"} if model.config.mx.enabled else {"F32"})


def test_a_padded_vocabulary_is_declared_to_the_models_size(tmp_path):
    """A model whose vocabulary is larger than its tokenizer's: the ids past the tokenizer are unused entries, so
    llama.cpp's vocabulary and the output matrix agree in size."""
    config = dataclasses.replace(preset("tiny"), vocab_size=640)
    tokenizer = serving.tokenizer()
    ckpt = save_model(tmp_path / "ckpt", K3ForCausalLM(config), tokenizer)
    out = tmp_path / "padded.gguf"
    assert main(["export", "--ckpt", str(ckpt), "--format", "gguf", "--out", str(out)]) == 0
    found = fields(out)
    size = len(tokenizer.get_vocab())
    assert found["kimi-k3.vocab_size"] == 640 and len(found["tokenizer.ggml.tokens"]) == 640
    assert found["tokenizer.ggml.tokens"][size:] == [f"[PAD{i}]" for i in range(size, 640)]
    assert found["tokenizer.ggml.token_type"][size:] == [5] * (640 - size)  # UNUSED
    assert found["tokenizer.ggml.token_type"][:12] == [3] * 12  # the chat special tokens: CONTROL
    assert tensors(out)["output.weight"][1] == [config.hidden_size, 640]


def test_export_gguf_refuses_an_existing_file_and_a_config_llama_cpp_cannot_read(tmp_path, capsys):
    ckpt = save_model(tmp_path / "ckpt", serving.model(), serving.tokenizer())
    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"keep")
    assert main(["export", "--ckpt", str(ckpt), "--format", "gguf", "--out", str(existing)]) == 2
    assert "already exists" in capsys.readouterr().err and existing.read_bytes() == b"keep"
    mini = save_model(tmp_path / "mini", K3ForCausalLM(preset("mini")), serving.tokenizer())
    out = tmp_path / "mini.gguf"
    assert main(["export", "--ckpt", str(mini), "--format", "gguf", "--out", str(out)]) == 2
    assert "decay_rank" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".*.partial"))
    assert main(["export", "--ckpt", str(ckpt), "--format", "gguf", "--out", str(tmp_path / "no" / "x.gguf")]) == 2
    assert "is not a directory" in capsys.readouterr().err



def test_both_exports_refuse_a_tokenizer_they_cannot_write_and_write_nothing(tmp_path):
    """A Kimi (tiktoken-style) tokenizer: neither the release layout's tokenizer files nor GGUF's vocabulary carry it
    (`k3.interop.export.exportable`), so both writers refuse it by name before writing anything."""
    from k3.interop.gguf_export import write_gguf
    from k3.tokenization.kimi import KimiTokenizer
    from kimi_fixtures import build_kimi_tokenizer_files

    build_kimi_tokenizer_files(tmp_path / "kimi")
    tokenizer = KimiTokenizer.load(tmp_path / "kimi")
    model = K3ForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=tokenizer.vocab_size))
    refusal = "only kimi-k3's byte-level BPE tokenizer is exported, got KimiTokenizer"
    with pytest.raises(ValueError, match=refusal):
        write_gguf(model, tokenizer, tmp_path / "out.gguf", "kimi")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=refusal):
        write_tokenizer(tokenizer, tmp_path / "out", 64)
    assert not (tmp_path / "out.gguf").exists() and not list((tmp_path / "out").iterdir())
