"""k3.config: presets, validation, JSON / Hugging Face round trips, schedule and parameter audit (SPEC §0)."""

from __future__ import annotations

import dataclasses
import json
import re
from fractions import Fraction

import pytest
from torch.overrides import TorchFunctionMode

from k3.sizing.audit import audit
from k3.config.hf import from_hf_dict
from k3.config import (PRESETS, PUBLISHED_ACTIVE, PUBLISHED_TOTAL, PUBLISHED_VISION, SIZE_LIMITS, K3Config, load_config,
                       preset)
from k3.sizing.params import count_parameters
from peers import transformers_kimi_linear


# ---------------------------------------------------------------------- the published model
def test_paper_preset_validates_and_matches_the_published_shape():
    c = preset("paper").validate()
    kinds = c.layer_kinds()
    assert len(kinds) == 93 and kinds.count("kda") == 69 and kinds.count("mla") == 24
    assert [i + 1 for i, k in enumerate(kinds) if k == "mla"] == list(range(4, 93, 4)) + [93]
    assert c.ffn_kinds() == ["dense"] + ["moe"] * 92
    assert c.mla.cache_scalars_per_token() == 576
    assert c.mla.expanded_scalars_per_token() == 30_720
    assert Fraction(30_720, 576) == Fraction(160, 3)  # 53 1/3
    assert c.depth_sources() == 9
    assert c.context_length == 2**20
    assert c.situ.gate_cap * c.situ.up_cap == 100


def test_paper_audit_numbers():
    a = audit(preset("paper"))
    assert (a["kda_layers"], a["mla_layers"]) == (69, 24)
    assert a["mla_cache_ratio"] == Fraction(160, 3)
    assert (a["depth_sources"], a["complete_blocks"], a["partial_block_layers"]) == (9, 7, 9)
    assert a["routed_fraction"] == Fraction(1, 56)
    assert abs(a["total"] / PUBLISHED_TOTAL - 1) < 0.02
    assert abs(a["active"] / PUBLISHED_ACTIVE - 1) < 0.02
    assert abs(a["vision"] / PUBLISHED_VISION - 1) < 0.02
    # Routed fraction (1.79%) and active/total (~3.7%) are different quantities (seed §3.2).
    assert 0.035 < a["active_fraction"] < 0.04 and a["routed_fraction"] < a["active_fraction"]
    assert a["assumptions"], "every assumed dimension is documented"


def test_count_parameters_allocates_nothing():
    class NoTensors(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"count_parameters called torch: {func}")

    with NoTensors():
        total, active = count_parameters(preset("paper"))
    assert total > active > 0


def test_small_presets():
    tiny, small = (count_parameters(preset(name)) for name in ("tiny", "small"))
    assert tiny[0] < 1e6
    assert 1e6 < small[1] < 1e7 and small[0] < 3e7  # a few million active, trainable on a laptop CPU


@pytest.mark.parametrize("n_layers", [1, 2, 4, 5, 8, 93])
def test_schedule_three_kda_to_one_mla_last_forced(n_layers):
    kinds = preset("paper").__class__(num_layers=n_layers).layer_kinds()
    assert kinds[-1] == "mla"
    assert all(k == ("mla" if (i + 1) % 4 == 0 else "kda") for i, k in enumerate(kinds[:-1]))


def test_explicit_mla_layers_override_the_period():
    c = K3Config(num_layers=6, mla_layers=[2, 6])
    assert c.layer_kinds() == ["kda", "mla", "kda", "kda", "kda", "mla"]


# ---------------------------------------------------------------------- validation
def _with(**changes):
    """The paper config with dotted-path changes applied, e.g. ``_with(**{"moe.num_experts": 0})``."""
    c = preset("paper")
    for path, value in changes.items():
        *parents, name = path.split(".")
        obj = c
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, name, value)
    return c


BAD = [
    ("vocab_size", 0), ("hidden_size", -1), ("num_layers", 0), ("num_layers", "93"), ("mla_period", 0),
    ("context_length", 0), ("rms_norm_eps", 0.0), ("rms_norm_eps", "x"), ("initializer_range", -0.1),
    ("tie_word_embeddings", "no"), ("mla_layers", [0]), ("mla_layers", [94]), ("mla_layers", [4, 4]),
    ("mla_layers", 4),
    ("kda.num_heads", 0), ("kda.head_dim", 0), ("kda.value_head_dim", -2), ("kda.conv_size", 0),
    ("kda.decay_rank", 0), ("kda.chunk_size", 0), ("kda.chunk_size", 40), ("kda.gate", "relu"),
    ("kda.g_min", 0.0), ("kda.output_gate_rank", -1), ("kda.a_log_size", 95),
    ("mla.num_heads", 0), ("mla.q_lora_rank", 0), ("mla.kv_lora_rank", 0), ("mla.qk_nope_head_dim", 0),
    ("mla.qk_shared_head_dim", 0), ("mla.v_head_dim", 0), ("mla.output_gate", 1),
    ("mla.norm_eps", 0.0), ("attn_res.key_gain", "yes"),
    ("attn_res.block_size", 0), ("attn_res.enabled", None),
    ("situ.gate_cap", 0.0), ("situ.up_cap", -25.0),
    ("moe.num_experts", 0), ("moe.num_experts_per_token", 0), ("moe.num_experts_per_token", 897),
    ("moe.num_shared_experts", -1), ("moe.shared_hidden", 0), ("moe.expert_hidden", 0), ("moe.latent_dim", 0),
    ("moe.first_k_dense", 94), ("moe.first_k_dense", -1), ("moe.dense_hidden", 0), ("moe.activation", "gelu"),
    ("moe.routed_scaling_factor", 0.0),
    ("mx.block_size", 0), ("mx.weight_format", "int4"), ("mx.activation_format", "mxfp4"),
    ("mx.enabled", "yes"),
    ("vision.num_layers", 0), ("vision.head_dim", 0), ("vision.pos_emb_size", -1), ("vision.num_heads", 0),
    ("vision.mlp_hidden", 0),
    ("vision.patch_size", 0), ("vision.merge_size", 0), ("vision.in_channels", 0), ("vision.out_dim", 4096),
    ("vision.enabled", 0),
]


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_every_impossible_config_is_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"config\.{field} = .* must be"):
        _with(**{field: value}).validate()


class Unwalked(list):
    """A list whose entries must not be read: a refusal that walks it first fails the test."""

    def __iter__(self):  # noqa: ANN204
        raise AssertionError("a million-entry list was walked before the sizes were checked")

    def __getitem__(self, index):  # noqa: ANN001, ANN204
        raise AssertionError("a million-entry list was read before the sizes were checked")


def test_sizes_are_bounded_every_preset_inside_and_a_crafted_config_refused_at_once():
    for name in PRESETS:  # the published 2.78T model and every preset stay far inside
        preset(name).validate()
    for name, limit in SIZE_LIMITS.items():
        config = preset("paper")
        owner, _, field = name.rpartition(".")
        setattr(getattr(config, owner) if owner else config, field, limit + 1)
        with pytest.raises(ValueError, match=re.escape(f"config.{name} = {limit + 1} is invalid: must be at most "
                                                       f"{limit:,}")):
            config.validate()
    crafted = dataclasses.replace(preset("tiny"), context_length=2**40, mla_layers=Unwalked(range(1, 10**6)))
    with pytest.raises(ValueError, match=r"config\.context_length = 1099511627776 is invalid: must be at most "
                                         r"134,217,728 \(k3\.config\.SIZE_LIMITS\)"):
        crafted.validate()  # the sizes are checked before any list is walked
    with pytest.raises(ValueError, match=r"config\.mla_layers = .* must be a list of at most num_layers=4"):
        dataclasses.replace(preset("tiny"), mla_layers=list(range(1, 10**6))).validate()


def test_vision_width_must_split_into_heads_without_an_explicit_head_dim():
    with pytest.raises(ValueError, match=r"config\.vision\.hidden_size = 961 .* multiple of vision\.num_heads=12"):
        _with(**{"vision.head_dim": None, "vision.hidden_size": 961}).validate()
    _with(**{"vision.hidden_size": 962}).validate()  # the release's qkv width is heads x head_dim, not the width


@pytest.mark.parametrize("changes, field", [
    ({"moe.latent_dim": 3585}, "moe.latent_dim"),
    ({"moe.expert_hidden": 3000}, "moe.expert_hidden"),
    ({"moe.latent_dim": None, "hidden_size": 7160, "vision.out_dim": 7160}, "hidden_size"),
])
def test_mx_quantized_widths_must_divide_into_32_blocks(changes, field):
    with pytest.raises(ValueError, match=rf"config\.{field} = .* multiple of mx\.block_size=32"):
        _with(**changes).validate()
    _with(**changes, **{"mx.enabled": False}).validate()  # the same widths are fine unquantized


# ---------------------------------------------------------------------- serialisation
@pytest.mark.parametrize("name", PRESETS)
def test_json_round_trip_is_lossless(name, tmp_path):
    c = preset(name)
    assert K3Config.from_json(c.to_json()) == c
    path = tmp_path / "config.json"
    c.save(path)
    assert K3Config.load(path) == c
    assert json.loads(path.read_text()) == dataclasses.asdict(c)


def test_round_trip_keeps_every_field_of_a_modified_config():
    c = _with(**{"mla_layers": [3, 93], "kda.gate": "softplus", "moe.latent_dim": None, "mla.q_lora_rank": None})
    assert K3Config.from_json(c.to_json()) == c


@pytest.mark.parametrize("text, message", [
    ('{"hidden_sizes": 5}', "unknown config field 'hidden_sizes'"),
    ('{"kda": {"heads": 2}}', "unknown config field 'kda.heads'"),
    ('{"kda": 3}', "config field 'kda' must be an object"),
    ('[1, 2]', "config must be a JSON object"),
])
def test_bad_json_is_an_error_naming_the_key(text, message):
    with pytest.raises(ValueError, match=message):
        K3Config.from_json(text)


def test_complete_configs_list_every_missing_field():
    data = preset("tiny").to_dict()
    assert K3Config.from_dict(data, complete=True) == preset("tiny")
    del data["hidden_size"], data["kda"]["chunk_size"], data["moe"]["num_experts"], data["vision"]
    with pytest.raises(ValueError, match=r"^missing fields: hidden_size, kda\.chunk_size, moe\.num_experts, vision$"):
        K3Config.from_dict(data, complete=True)
    assert K3Config.from_dict({"num_layers": 5}).hidden_size == 7168  # a user's file may leave fields to the paper


def test_a_checkpoint_from_before_a_field_was_added_loads_with_its_old_behaviour():
    """``kda.decay`` came after checkpoints existed: a checkpoint's config without it decays per channel, as every
    model did then (found when `make demo`'s run stopped loading); it stays the only field that may be absent."""
    data = preset("tiny").to_dict()
    data["kda"]["decay"] = "head"
    assert K3Config.from_dict(data, complete=True).kda.decay == "head"
    del data["kda"]["decay"]
    assert K3Config.from_dict(data, complete=True) == preset("tiny")
    assert "decay" not in data["kda"]  # the caller's dict is left as it was
    del data["kda"]["g_min"]
    with pytest.raises(ValueError, match=r"^missing fields: kda\.g_min$"):
        K3Config.from_dict(data, complete=True)


def test_corrupt_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": ')
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        K3Config.load(path)


def test_a_hugging_face_config_is_read_by_load_config_not_k3config_load(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "kimi_linear"}))
    with pytest.raises(ValueError, match="config.json: a Hugging Face config.json .*k3.config.load_config"):
        K3Config.load(path)
    preset("tiny").save(path)
    assert load_config(path) == preset("tiny")  # our own files too


def test_reads_a_kimi_linear_hugging_face_config(tmp_path):
    hf = {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
        "num_attention_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 256, "num_experts_per_token": 8,
        "num_shared_experts": 1, "moe_intermediate_size": 1024, "intermediate_size": 9216,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5,
        "model_max_length": 1048576, "hidden_act": "silu", "tie_word_embeddings": False,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                               "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                               "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    c = load_config(path).validate()
    assert [i + 1 for i, k in enumerate(c.layer_kinds()) if k == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert (c.kda.gate, c.kda.output_gate_rank, c.kda.decay_rank) == ("softplus", 128, 128)
    assert (c.mla.q_lora_rank, c.mla.output_gate, c.attn_res.enabled) == (None, False, False)
    assert (c.moe.num_experts, c.moe.num_experts_per_token, c.moe.latent_dim) == (256, 8, None)
    assert c.moe.activation == "swiglu" and c.moe.routed_scaling_factor == pytest.approx(2.446)
    assert c.context_length == 1048576
    total, active = count_parameters(c)
    assert 45e9 < total < 52e9 and 2.5e9 < active < 3.5e9  # Kimi-Linear-48B-A3B


def test_reads_transformers_own_kimi_linear_config():
    tf = transformers_kimi_linear()
    hf_config = tf.KimiLinearConfig(hidden_size=64, num_hidden_layers=5, num_attention_heads=2,
                                    linear_num_heads=2, linear_head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
    c = from_hf_dict(hf_config.to_dict()).validate()
    expected = ["mla" if t == "full_attention" else "kda" for t in hf_config.layer_types]
    assert c.layer_kinds() == expected
    assert (c.hidden_size, c.num_layers, c.kda.num_heads, c.kda.head_dim) == (64, 5, 2, 16)
    assert (c.moe.num_experts, c.moe.num_experts_per_token, c.moe.expert_hidden) == (4, 2, 32)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


def test_hf_config_missing_fields_is_an_error():
    with pytest.raises(ValueError, match="hidden_size"):
        from_hf_dict({"model_type": "kimi_linear"})

