"""Hugging Face ``config.json`` files ↔ `K3Config` (SPEC §9, §10).

* `from_hf_dict`: Kimi Linear / Kimi K2 / DeepSeek-V3 field names (no AttnRes, SiTU, latent MoE, vision, MX),
  and the released Kimi K3 (``model_type: kimi_k3``), which `from_release_dict` reads exactly;
* `to_release_dict`: the released layout written back (``save_pretrained``);
* `load_config`: any config file — ours (`K3Config.load`) or a Hugging Face ``config.json`` (it has ``model_type``).

Every release field is either mapped or checked: an option the model cannot express is a `ValueError` naming
the field, never silently dropped.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from k3.config.schema import (
    AttnResConfig,
    K3Config,
    KDAConfig,
    MLAConfig,
    MoEConfig,
    MXConfig,
    SiTUConfig,
    VisionConfig,
)
from k3.files import CONFIG_LIMIT, read_json

#: compressed-tensors format of the released routed experts (SPEC §10).
MXFP4_FORMAT = "mxfp4-pack-quantized"


def load_config(path: str | os.PathLike) -> K3Config:
    """Read our JSON (`K3Config.save`) or a Hugging Face-style ``config.json`` (detected by ``model_type``); a
    user-written file may leave fields out (they take the paper defaults, e.g. for ``k3 info --config``)."""
    data = read_json(path, CONFIG_LIMIT)
    if isinstance(data, dict) and "model_type" in data:
        return from_hf_dict(data)
    return K3Config.from_dict(data)


def from_hf_dict(hf: dict[str, Any]) -> K3Config:
    """Map a Hugging Face ``config.json`` (Kimi Linear, Kimi K2 / DeepSeek-V3 field names, or the released
    Kimi K3 via `from_release_dict`) to `K3Config`.

    Kimi Linear's ``linear_attn_config`` layer lists are 1-based; ``layer_types`` is 0-based.
    Peers have no AttnRes, SiTU, gated MLA, latent MoE, vision or MX, so those are switched off.
    """

    def get(*names: str, default: Any = None) -> Any:
        for name in names:
            if name in hf and hf[name] is not None:
                return hf[name]
        return default

    if is_release(hf):
        return from_release_dict(hf)
    n_layers = get("num_hidden_layers", "num_layers")
    if n_layers is None or "hidden_size" not in hf:
        raise ValueError("Hugging Face config needs 'hidden_size' and 'num_hidden_layers'")
    linear = hf.get("linear_attn_config") or {}
    mla_layers: list[int]
    if "full_attn_layers" in linear:
        mla_layers = [int(i) for i in linear["full_attn_layers"]]
    elif hf.get("layer_types"):
        mla_layers = [i + 1 for i, t in enumerate(hf["layer_types"]) if t == "full_attention"]
    elif hf.get("model_type") == "kimi_linear":
        # transformers' KimiLinearConfig default: 0-based index i > 0 with i % 4 == 0 is full attention.
        mla_layers = [i + 1 for i in range(n_layers) if i and i % 4 == 0]
    else:  # all-MLA peers (Kimi K2, DeepSeek-V3)
        mla_layers = list(range(1, n_layers + 1))

    heads = get("num_attention_heads", default=32)
    n_experts = get("num_experts", "n_routed_experts", "num_local_experts", default=1)
    act = get("hidden_act", default="silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Hugging Face config: hidden_act={act!r} is not supported (expected 'silu')")
    return K3Config(
        vocab_size=get("vocab_size", default=163840),
        hidden_size=hf["hidden_size"],
        num_layers=n_layers,
        mla_layers=mla_layers,
        context_length=get("max_position_embeddings", "model_max_length", default=131072),
        rms_norm_eps=get("rms_norm_eps", default=1e-6),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        initializer_range=get("initializer_range", default=0.02),
        kda=KDAConfig(
            num_heads=linear.get("num_heads", get("linear_num_heads", default=heads)),
            head_dim=linear.get("head_dim", get("linear_head_dim", default=128)),
            value_head_dim=linear.get("head_dim", get("linear_head_dim", default=128)),
            conv_size=linear.get("short_conv_kernel_size", get("linear_conv_kernel_dim", default=4)),
            gate="softplus",
            decay_rank=linear.get("head_dim", get("linear_head_dim", default=128)),
            a_log_size=None,
            output_gate_rank=linear.get("head_dim", get("linear_head_dim", default=128)),
        ),
        mla=MLAConfig(
            num_heads=heads,
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank", default=512),
            qk_nope_head_dim=get("qk_nope_head_dim", default=128),
            qk_shared_head_dim=get("qk_rope_head_dim", default=64),
            v_head_dim=get("v_head_dim", default=128),
            output_gate=False,
        ),
        attn_res=AttnResConfig(enabled=False),
        moe=MoEConfig(
            num_experts=n_experts,
            num_experts_per_token=get("num_experts_per_token", "num_experts_per_tok", default=1),
            num_shared_experts=get("num_shared_experts", "n_shared_experts", default=0),
            expert_hidden=get("moe_intermediate_size", default=1),
            shared_hidden=get("moe_intermediate_size", default=1),
            latent_dim=None,
            first_k_dense=get("first_k_dense_replace", default=1),
            dense_hidden=get("intermediate_size", default=1),
            activation="swiglu",
            routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
        ),
        vision=VisionConfig(enabled=False, out_dim=hf["hidden_size"]),
        mx=MXConfig(enabled=False),
    )


# ---------------------------------------------------------------------- the release (model_type kimi_k3)
def _require(text: dict[str, Any], name: str, expected: Any, why: str) -> None:
    value = text.get(name, expected)
    if value != expected:
        raise ValueError(f"Kimi K3 config: {name}={value!r} is not supported ({why}; expected {expected!r})")


def _field(section: dict[str, Any], name: str, where: str) -> Any:
    if name not in section or section[name] is None:
        raise ValueError(f"Kimi K3 config: {where}.{name} is missing")
    return section[name]


def is_release(hf: dict[str, Any]) -> bool:
    """A released-layout config: ``model_type: kimi_k3``, or a ``kimi_linear`` text config with SiTU."""
    return hf.get("model_type") == "kimi_k3" or (hf.get("model_type") == "kimi_linear" and hf.get("hidden_act") ==
                                                 "situ")


def quantization(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The text model's ``quantization_config`` (top level or in ``text_config``), if any."""
    text = hf.get("text_config", hf)
    return text.get("quantization_config") or hf.get("quantization_config")


def from_release_dict(hf: dict[str, Any]) -> K3Config:
    """The released ``config.json`` (SPEC §10) → `K3Config`; every decision is listed in `RELEASE_DECISIONS`."""
    text = hf.get("text_config", hf)
    if not isinstance(text, dict):
        raise ValueError("Kimi K3 config: text_config must be an object")
    f = lambda name: _field(text, name, "text_config")  # noqa: E731
    linear = f("linear_attn_config")
    lf = lambda name: _field(linear, name, "text_config.linear_attn_config")  # noqa: E731
    _require(text, "hidden_act", "situ", "K3 uses SiTU-GLU")
    _require(text, "moe_router_activation_func", "sigmoid", "the router is a sigmoid")
    _require(text, "moe_renormalize", True, "routing weights are renormalised")
    _require(text, "num_expert_group", 1, "grouped routing is not implemented")
    _require(text, "moe_layer_freq", 1, "every layer after the dense ones is MoE")
    _require(text, "mla_use_nope", True, "MLA has no positional encoding")
    _require(text, "num_nextn_predict_layers", 0, "MTP layers are not implemented")
    latent = text.get("routed_expert_hidden_size")
    if latent is not None:
        _require(text, "latent_moe_use_norm", True, "the latent MoE always normalises")
    n_layers, heads, head_dim = f("num_hidden_layers"), lf("num_heads"), lf("head_dim")
    kda_layers = [int(i) for i in lf("kda_layers")]
    mla_layers = [int(i) for i in lf("full_attn_layers")]
    if not isinstance(n_layers, int) or len(kda_layers) + len(mla_layers) != n_layers or \
            sorted(kda_layers + mla_layers) != list(range(1, n_layers + 1)):  # the count first: no 2^40-long range
        raise ValueError("Kimi K3 config: linear_attn_config.kda_layers and full_attn_layers must partition the "
                         f"layers 1..{n_layers}")
    quant = quantization(hf)
    block = text.get("attn_res_block_size")
    d = f("hidden_size")
    return K3Config(
        vocab_size=f("vocab_size"), hidden_size=d, num_layers=n_layers, mla_layers=mla_layers,
        context_length=f("max_position_embeddings"), rms_norm_eps=float(f("rms_norm_eps")),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        initializer_range=float(text.get("initializer_range", 0.02)),
        kda=KDAConfig(num_heads=heads, head_dim=head_dim, value_head_dim=head_dim,
                      conv_size=lf("short_conv_kernel_size"),
                      gate="bounded" if linear.get("gate_lower_bound") is not None else "softplus",
                      g_min=float(linear.get("gate_lower_bound") or -5.0), decay_rank=head_dim,
                      a_log_size=head_dim, output_gate_rank=0 if linear.get("use_full_rank_gate") else head_dim),
        mla=MLAConfig(num_heads=f("num_attention_heads"), q_lora_rank=text.get("q_lora_rank"),
                      kv_lora_rank=f("kv_lora_rank"), qk_nope_head_dim=f("qk_nope_head_dim"),
                      qk_shared_head_dim=f("qk_rope_head_dim"), v_head_dim=f("v_head_dim"),
                      output_gate=bool(text.get("mla_use_output_gate", False)), norm_eps=1e-6),
        attn_res=AttnResConfig(enabled=block is not None, block_size=block or 12, key_gain=True),
        situ=SiTUConfig(gate_cap=float(f("activation_situ_beta")), up_cap=float(f("activation_situ_linear_beta"))),
        moe=MoEConfig(num_experts=f("num_experts"), num_experts_per_token=f("num_experts_per_token"),
                      num_shared_experts=text.get("num_shared_experts", 0), expert_hidden=f("moe_intermediate_size"),
                      shared_hidden=f("moe_intermediate_size"), latent_dim=latent,
                      first_k_dense=text.get("first_k_dense_replace", 0), dense_hidden=f("intermediate_size"),
                      activation="situ", routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0))),
        vision=_vision(hf.get("vision_config"), d, hf.get("media_placeholder_token_id", 163605)),
        mx=mx_from_quantization(quant),
    )


#: compressed-tensors' description of MXFP8 E4M3 inputs quantized on the fly in groups of 32 (E8M0 scales).
MXFP8_INPUTS = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                "dynamic": True, "scale_dtype": "torch.uint8"}


def quantization_config(mx: MXConfig) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` of MXFP4-packed routed experts (the release's, SPEC §10),
    with ``input_activations`` when ``mx`` also quantizes the experts' inputs (MXFP8 E4M3; E5M2 has no
    compressed-tensors spelling and is refused, as are weights other than MXFP4)."""
    if mx.enabled and mx.weight_format != "mxfp4":
        raise ValueError(f"mx.weight_format = {mx.weight_format!r}: only MXFP4 weights are stored packed "
                         f"({MXFP4_FORMAT})")
    inputs = mx.activation_format if mx.enabled else None
    if inputs not in (None, "mxfp8_e4m3"):
        raise ValueError(f"mx.activation_format = {inputs!r}: compressed-tensors describes MXFP8 E4M3 inputs "
                         f"only")
    group = {"format": MXFP4_FORMAT, "targets": ["Linear"], "weights": {
        "group_size": 32, "num_bits": 4, "type": "float", "strategy": "group", "symmetric": True,
        "scale_dtype": "torch.uint8"}}
    if inputs is not None:
        group["input_activations"] = dict(MXFP8_INPUTS)
    return {"quant_method": "compressed-tensors", "format": MXFP4_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}


def mx_from_quantization(quant: dict[str, Any] | None) -> MXConfig:
    """``quantization_config`` → `MXConfig`: MXFP4 weights in groups of 32, MXFP8 E4M3 inputs if a group
    declares ``input_activations`` (8-bit float, groups of 32); anything else is a ValueError naming it."""
    if not quant:
        return MXConfig(enabled=False)
    if not isinstance(quant, dict) or quant.get("format") != MXFP4_FORMAT:
        raise ValueError(f"quantization_config: format {quant.get('format') if isinstance(quant, dict) else quant!r} "
                         f"is not supported (expected {MXFP4_FORMAT!r})")
    groups = quant.get("config_groups") or {}
    sizes = {g.get("weights", {}).get("group_size", 32) for g in groups.values()} or {32}
    if sizes != {32}:
        raise ValueError(f"quantization_config: MXFP4 group_size {sorted(sizes)} is not supported (expected 32)")
    inputs = [g["input_activations"] for g in groups.values() if g.get("input_activations")]
    for spec in inputs:
        if (spec.get("num_bits"), spec.get("type"), spec.get("group_size", 32)) != (8, "float", 32):
            raise ValueError(f"quantization_config: input_activations {spec} are not supported (expected MXFP8: "
                             f"num_bits 8, type float, group_size 32)")
    return MXConfig(enabled=True, weight_format="mxfp4", activation_format="mxfp8_e4m3" if inputs else None)


def _vision(v: dict[str, Any] | None, d: int, media: int) -> VisionConfig:
    if not v:
        return VisionConfig(enabled=False, out_dim=d)
    f = lambda name: _field(v, name, "vision_config")  # noqa: E731
    merge = list(v.get("merge_kernel_size", [2, 2]))
    if len(merge) != 2 or merge[0] != merge[1]:
        raise ValueError(f"Kimi K3 config: vision_config.merge_kernel_size={merge} must be square")
    heads = f("vt_num_attention_heads")
    qkv = v.get("qkv_hidden_size")
    if qkv is not None and qkv % heads:
        raise ValueError(f"Kimi K3 config: vision_config.qkv_hidden_size={qkv} is not a multiple of "
                         f"vt_num_attention_heads={heads}")
    for key, wanted in (("merge_type", "sd2_tpool"), ("pos_emb_type", "divided_fixed"), ("norm_type", "rmsnorm"),
                        ("pos_emb_interpolation_mode", "bilinear"), ("attn_bias", False), ("linear_bias", False),
                        ("patch_embed_proj_bias", False)):
        if key in v and v[key] != wanted:
            raise ValueError(f"Kimi K3 config: vision_config.{key}={v[key]!r} is not supported (expected "
                             f"{wanted!r}, the release's)")
    if v.get("init_pos_emb_height", 0) != v.get("init_pos_emb_width", v.get("init_pos_emb_height", 0)):
        raise ValueError("Kimi K3 config: vision_config.init_pos_emb_height and init_pos_emb_width must be equal")
    return VisionConfig(enabled=True, num_layers=f("vt_num_hidden_layers"), hidden_size=f("vt_hidden_size"),
                        num_heads=heads, head_dim=None if qkv is None else qkv // heads,
                        mlp_hidden=f("vt_intermediate_size"), patch_size=f("patch_size"), merge_size=merge[0],
                        pos_emb_size=v.get("init_pos_emb_height", 0), out_dim=v.get("text_hidden_size", d),
                        attention="joint", max_frames=v.get("init_pos_emb_time", 4), media_token_id=media)


def _vision_dict(v: VisionConfig) -> dict[str, Any]:
    """`VisionConfig` → the released ``vision_config`` (joint attention only: the release's)."""
    if v.attention != "joint":
        raise ValueError(f"vision.attention = {v.attention!r}: the release format describes joint attention only")
    return {"vt_hidden_size": v.hidden_size, "qkv_hidden_size": v.num_heads * v.qkv_head_dim,
            "vt_num_attention_heads": v.num_heads, "vt_intermediate_size": v.mlp_hidden,
            "vt_num_hidden_layers": v.num_layers, "patch_size": v.patch_size, "init_pos_emb_height": v.pos_emb_size,
            "init_pos_emb_width": v.pos_emb_size, "init_pos_emb_time": v.max_frames,
            "merge_kernel_size": [v.merge_size, v.merge_size], "merge_type": "sd2_tpool",
            "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear", "norm_type": "rmsnorm",
            "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
            "mm_hidden_size": v.hidden_size, "text_hidden_size": v.out_dim}


def _not_in_release(c: K3Config) -> list[str]:
    """The fields of ``c`` the release's config fixes to other values (`from_release_dict` derives them)."""
    k, fixed = c.kda, []
    if k.decay != "channel":
        fixed.append(f"kda.decay = {k.decay!r} (the release's decays per key channel)")
    fixed += [f"kda.{name} = {getattr(k, name)} (the release's is head_dim = {k.head_dim})"
              for name in ("decay_rank", "value_head_dim") if getattr(k, name) != k.head_dim]
    if k.output_gate_rank not in (0, k.head_dim):
        fixed.append(f"kda.output_gate_rank = {k.output_gate_rank} (the release's is 0 or head_dim = {k.head_dim})")
    if c.moe.num_shared_experts and c.moe.shared_hidden != c.moe.expert_hidden:
        fixed.append(f"moe.shared_hidden = {c.moe.shared_hidden} (the release's is expert_hidden = "
                     f"{c.moe.expert_hidden})")
    if c.moe.activation != "situ":
        fixed.append(f"moe.activation = {c.moe.activation!r} (the release's is 'situ')")
    if c.mla.norm_eps != 1e-6:
        fixed.append(f"mla.norm_eps = {c.mla.norm_eps} (the release's is 1e-06)")
    if c.attn_res.enabled and not c.attn_res.key_gain:
        fixed.append("attn_res.key_gain = False (the release's has a key gain)")
    return fixed


def to_release_dict(config: K3Config, template: dict[str, Any] | None = None) -> dict[str, Any]:
    """`K3Config` → the released ``config.json`` layout; fields of ``template`` (the loaded file) we do not model
    are kept as they were, so a loaded release saves back with the same config."""
    c = config.validate()
    if refused := _not_in_release(c):
        raise ValueError("the release's config.json cannot describe " + "; ".join(refused) + ": such a checkpoint "
                         "would not load back")
    hf = copy.deepcopy(template) if template else {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
        "tie_word_embeddings": c.tie_word_embeddings, "text_config": {}}
    text = hf.setdefault("text_config", {})
    kinds = c.layer_kinds()
    k, m, e = c.kda, c.mla, c.moe
    text.update({
        "model_type": "kimi_linear", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers, "max_position_embeddings": c.context_length,
        "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
        "initializer_range": c.initializer_range, "hidden_act": "situ",
        "activation_situ_beta": c.situ.gate_cap, "activation_situ_linear_beta": c.situ.up_cap,
        "attn_res_block_size": c.attn_res.block_size if c.attn_res.enabled else None,
        "linear_attn_config": {
            **text.get("linear_attn_config", {}),
            "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "mla"],
            "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "kda"],
            "gate_lower_bound": k.g_min if k.gate == "bounded" else None, "head_dim": k.head_dim,
            "num_heads": k.num_heads, "short_conv_kernel_size": k.conv_size,
            "use_full_rank_gate": k.output_gate_rank == 0},
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads, "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_shared_head_dim, "v_head_dim": m.v_head_dim, "mla_use_nope": True,
        "mla_use_output_gate": m.output_gate, "num_experts": e.num_experts,
        "num_experts_per_token": e.num_experts_per_token, "num_shared_experts": e.num_shared_experts,
        "moe_intermediate_size": e.expert_hidden, "routed_expert_hidden_size": e.latent_dim,
        "latent_moe_use_norm": e.latent_dim is not None, "first_k_dense_replace": e.first_k_dense,
        "intermediate_size": e.dense_hidden, "routed_scaling_factor": e.routed_scaling_factor,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "moe_layer_freq": 1,
        "num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    })
    if c.vision.enabled and not hf.get("vision_config"):
        hf["vision_config"] = _vision_dict(c.vision)
        hf["media_placeholder_token_id"] = c.vision.media_token_id
    if quantization(hf) is None:  # routed experts are always saved packed
        text["quantization_config"] = quantization_config(c.mx if c.mx.enabled else MXConfig())
    return hf
