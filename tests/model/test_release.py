"""The released Kimi K3 format (issue 11): config, load/save, packed MXFP4 experts — against mlx-lm's kimi_k3."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from k3.config import preset
from k3.config.hf import from_release_dict
from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts
from k3.ops import mx as mxfp4
from release_fixture import release_config, write_release

PROMPT = [1, 5, 9, 200, 33, 7, 100, 2, 45, 300, 12, 11]


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("kimi-k3-reduced")
    return directory, write_release(directory)


@pytest.fixture(scope="module")
def mlx_model(release):
    mx = pytest.importorskip("mlx.core")
    load_model = pytest.importorskip("mlx_lm.utils").load_model
    model, _ = load_model(release[0])
    model.set_dtype(mx.float32)
    return model


def _ours(directory: Path, **kwargs) -> K3ForCausalLM:
    return K3ForCausalLM.from_pretrained(str(directory), **kwargs)


def _read(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in index.items():
        with safe_open(str(directory / file), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_logits_equal_mlx_lm_kimi_k3(release, mlx_model):
    mx = pytest.importorskip("mlx.core")
    expected = np.array(mlx_model(mx.array([PROMPT])).astype(mx.float32))
    with torch.no_grad():
        ours = _ours(release[0])(torch.tensor([PROMPT]))[0].numpy()
    assert np.abs(ours - expected).max() <= 1e-4


def test_greedy_continuation_equals_mlx_lm(release, mlx_model):
    mx = pytest.importorskip("mlx.core")
    generate_step = pytest.importorskip("mlx_lm.generate").generate_step
    steps = 12
    theirs = [int(t) for t, _ in generate_step(mx.array(PROMPT), mlx_model, max_tokens=steps,
                                               sampler=lambda x: mx.argmax(x, axis=-1))]
    model = _ours(release[0])
    state, ids, ours = model.new_state(1), torch.tensor([PROMPT]), []
    with torch.no_grad():
        for _ in range(steps):  # our cached decode path: prefill once, then one token at a time
            logits, state = model(ids, state=state)
            ours.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[ours[-1]]])
    assert ours == theirs


def test_every_tensor_is_consumed_once_vision_included(release):
    directory, tensors = release
    model = _ours(directory)
    info = model.release
    assert len(info.consumed) == len(set(info.consumed)) and info.skipped == []
    assert set(info.consumed) == set(tensors)
    ours = model.vision.state_dict()
    for name in (n for n in tensors if n.startswith(("vision_tower.", "mm_projector."))):
        assert torch.equal(ours[name], tensors[name].float()), name  # the release's names, unchanged


def test_vision_is_skipped_and_reported_for_a_config_without_vision(release, tmp_path):
    directory, tensors = release
    config = json.loads((directory / "config.json").read_text())
    del config["vision_config"]
    copy = tmp_path / "text-only"
    shutil.copytree(directory, copy)
    (copy / "config.json").write_text(json.dumps(config))
    info = _ours(copy).release
    assert set(info.skipped) == {n for n in tensors if n.startswith(("vision_tower.", "mm_projector."))}


def test_experts_stay_packed_views_of_the_files(release):
    model = _ours(release[0])
    experts = model.layers[1].ffn.experts
    assert isinstance(experts, PackedExperts)
    packed = experts.packed[0].w1.weight_packed
    assert packed.dtype == torch.uint8 and not packed.untyped_storage().resizable()  # an mmap-backed buffer


def test_save_round_trip_is_byte_identical(release, tmp_path):
    directory, _ = release
    model = _ours(directory)
    model.save_pretrained(str(tmp_path), max_shard_bytes=2**16)
    original, saved = _read(directory), _read(tmp_path)
    assert set(saved) == set(original)  # text and vision
    for name in original:
        assert saved[name].dtype == original[name].dtype, name
        assert saved[name].shape == original[name].shape and torch.equal(saved[name].view(torch.uint8),
                                                                         original[name].view(torch.uint8)), name
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((directory / "config.json").read_text())
    again = _ours(tmp_path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(again(ids)[0], model(ids)[0])


@pytest.mark.parametrize("section, name, value", [
    ("kda", "decay_rank", 8), ("kda", "value_head_dim", 8), ("kda", "output_gate_rank", 4),
    ("moe", "shared_hidden", 16), ("mla", "norm_eps", 1e-5), ("attn_res", "key_gain", False), ("kda", "decay", "head")])
def test_a_config_the_release_cannot_describe_is_refused_before_writing(tmp_path, section, name, value):
    """The release's config.json derives these fields (a KDA decay rank of head_dim, ...). Saving another value
    wrote a checkpoint that `from_pretrained` refused with a shape error; now the save is refused, naming the field,
    and writes nothing. `mini` and `small` (decay rank 32, head_dim 64) are such configs."""
    torch.manual_seed(0)
    tiny = preset("tiny")
    model = K3ForCausalLM(dataclasses.replace(tiny, **{section: dataclasses.replace(getattr(tiny, section),
                                                                                     **{name: value})}))
    with pytest.raises(ValueError, match=f"{section}.{name}"):
        model.save_pretrained(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="kda.decay_rank = 32"):
        K3ForCausalLM(preset("mini")).save_pretrained(str(tmp_path / "mini"))


def test_unpacked_experts_give_the_same_logits(release):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        packed = _ours(release[0])(ids)[0]
        unpacked_model = _ours(release[0], packed=False)
        unpacked = unpacked_model(ids)[0]
    assert not isinstance(unpacked_model.layers[1].ffn.experts, PackedExperts)
    torch.testing.assert_close(unpacked, packed, rtol=0, atol=5e-5)  # the all-experts path sums differently


def test_mxfp4_decoding_is_bit_exact_against_mlx():
    mx = pytest.importorskip("mlx.core")
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (48, 64), generator=g, dtype=torch.uint8)  # every code, both nibbles
    scale = torch.randint(0, 255, (48, 4), generator=g, dtype=torch.uint8)  # every exponent but NaN
    theirs = np.array(mx.dequantize(mx.array(packed.numpy()).view(mx.uint32), mx.array(scale.numpy()),
                                    group_size=32, bits=4, mode="mxfp4").astype(mx.float32))
    ours = mxfp4.dequantize(packed, scale).numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_mxfp4_quantize_round_trips_representable_values():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (16, 32), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 150, (16, 2), generator=g, dtype=torch.uint8)
    values = mxfp4.dequantize(packed, scale)
    again = mxfp4.dequantize(*mxfp4.quantize(values))
    assert torch.equal(again, values)  # MXFP4 values are fixed points of quantize∘dequantize
    # a block's largest magnitude keeps its top code, 6, or decodes within one E2M1 step
    x = torch.randn(8, 64, generator=g)
    error = (mxfp4.dequantize(*mxfp4.quantize(x)) - x).abs()
    assert bool((error <= x.abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, -1) / 2).all())


def test_published_config_is_the_paper_preset():
    hf = release_config(163840)
    text = hf["text_config"]
    text.update(hidden_size=7168, num_hidden_layers=93, num_attention_heads=96, num_key_value_heads=96,
                intermediate_size=33792, max_position_embeddings=1048576, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=896,
                num_experts_per_token=16, moe_intermediate_size=3072, routed_expert_hidden_size=3584,
                attn_res_block_size=12)
    mla = [i for i in range(1, 94) if i % 4 == 0] + [93]
    text["linear_attn_config"].update(num_heads=96, head_dim=128, full_attn_layers=mla,
                                      kda_layers=[i for i in range(1, 94) if i not in mla])
    hf["vision_config"] = {"vt_hidden_size": 1024, "qkv_hidden_size": 1536, "vt_num_attention_heads": 12,
                           "vt_intermediate_size": 4096, "vt_num_hidden_layers": 27, "patch_size": 14,
                           "init_pos_emb_height": 64, "merge_kernel_size": [2, 2], "text_hidden_size": 7168}
    config = from_release_dict(hf)
    assert dataclasses.replace(config, mla_layers=None) == preset("paper")
    assert config.layer_kinds() == preset("paper").layer_kinds()


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama"})), "not a Kimi K3 release"),
    (lambda d: (d / "model-00001-of-00002.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!"),
     "cannot read the safetensors header"),
    (lambda d: (d / "model-00002-of-00002.safetensors").unlink(), "does not exist"),
    (lambda d: _relink(d / "model-00002-of-00002.safetensors", "/dev/zero"), "a character device, not a regular file"),
    (lambda d: _relink(d / "config.json", "/dev/zero"), "cannot read the checkpoint config"),
    (lambda d: _remap(d, "../model-00002-of-00002.safetensors"), "not a .safetensors file name in"),
    (lambda d: _text(d, max_position_embeddings=2**40), r"config.json: config.context_length = 1099511627776 is "
                                                        r"invalid: must be at most 134,217,728"),
    (lambda d: _text(d, vocab_size=2**22), r"config.json: describes a model of [\d,]+ parameters, which the shards "
                                           r"of .* cannot hold"),
])
def test_broken_directories_are_clear_errors(tmp_path, edit, message):
    write_release(tmp_path)
    edit(tmp_path)
    with pytest.raises(ValueError, match=message):
        _ours(tmp_path)


def _relink(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def _remap(directory: Path, name: str) -> None:
    """The index maps the second shard's tensors to ``name`` instead."""
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"] = {k: name if v.startswith("model-00002") else v for k, v in index["weight_map"].items()}
    path.write_text(json.dumps(index))


def _text(directory: Path, **changes) -> None:
    """``config.json`` with ``changes`` in its ``text_config``."""
    path = directory / "config.json"
    hf = json.loads(path.read_text())
    hf["text_config"].update(changes)
    path.write_text(json.dumps(hf))


def test_a_missing_or_misshaped_tensor_is_named(tmp_path):
    tensors = write_release(tmp_path)
    name = "language_model.model.layers.2.self_attn.dt_bias"
    from safetensors.torch import save_file

    save_file({"extra": torch.zeros(1)}, str(tmp_path / "model-00003-of-00003.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    file = index["weight_map"].pop(name)
    shard = _read(tmp_path)
    kept = {n: shard[n] for n, f in index["weight_map"].items() if f == file}
    save_file(kept, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"missing tensor '{name}' \(expected shape \[64\]\)"):
        _ours(tmp_path)
    kept[name] = tensors[name][:10]
    save_file(kept, str(tmp_path / file))
    index["weight_map"][name] = file
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[10\], expected \[64\]"):
        _ours(tmp_path)


def test_release_tiny_has_the_peer_kernels_shapes_and_round_trips_through_mlx_lm(tmp_path):
    """``release-tiny`` (issue 39, item 5): MLA latent 512 + shared key 64 (vLLM's fused MLA decode, 576 wide) and KDA
    K = V = 128 (FlashKDA), in the release layout: saved, it loads in mlx-lm and in kimi-k3 with the same logits."""
    mx = pytest.importorskip("mlx.core")
    load_model = pytest.importorskip("mlx_lm.utils").load_model
    config = preset("release-tiny")
    assert (config.mla.kv_lora_rank, config.mla.qk_shared_head_dim) == (512, 64)
    assert config.kda.head_dim == config.kda.value_head_dim == 128
    torch.manual_seed(0)
    K3ForCausalLM(config).eval().save_pretrained(tmp_path)
    theirs, _ = load_model(tmp_path)
    theirs.set_dtype(mx.float32)
    expected = np.array(theirs(mx.array([PROMPT])).astype(mx.float32))
    with torch.no_grad():
        ours = _ours(tmp_path)(torch.tensor([PROMPT]))[0].numpy()
    assert np.abs(ours - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
