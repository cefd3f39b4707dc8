"""Kimi Linear checkpoints on the K3 backbone (SPEC §9).

Kimi Linear (Moonshot's predecessor: KDA + MLA, plain residual stream, SwiGLU MoE) is a K3 config
with these options: ``kda.gate = "softplus"`` (``g = -exp(A)·softplus(z + dt_bias)``), a low-rank output
gate (``kda.output_gate_rank = head_dim``), ``attn_res.enabled = False`` (pre-norm residual stream),
``mla.q_lora_rank = None`` and ``mla.output_gate = False``, ``moe.activation = "swiglu"``,
``moe.latent_dim = None`` (routed experts at width d), ``moe.routed_scaling_factor`` and
``moe.first_k_dense``. `k3.config.from_hf_dict` builds that config from a ``config.json``.

Weight mapping (ours ← Hugging Face). Two source layouts are accepted: transformers' in-memory layout
(fused ``conv1d``, ``forget_gate.*``, stacked ``experts.gate_up_proj``) and the original checkpoint layout
(``q_conv1d/k_conv1d/v_conv1d``, ``f_a_proj``…, ``block_sparse_moe.experts.N.w1/w2/w3``):

=============================================  ================================================================
``embed_tokens.weight``                        ``model.embed_tokens.weight``
``layers.i.mixer_norm.weight``                 ``model.layers.i.input_layernorm.weight``
``layers.i.ffn_norm.weight``                   ``model.layers.i.post_attention_layernorm.weight``
KDA ``layers.i.mixer.{q,k,v,b,o}_proj``        ``self_attn.{q,k,v,b,o}_proj``
KDA ``mixer.conv.weight [C, 4]``               ``self_attn.conv1d.weight [C, 1, 4]`` = cat(q_conv1d, k_conv1d, v_conv1d)
KDA ``mixer.f_a_proj / f_b_proj / dt_bias``    ``self_attn.[forget_gate.]f_a_proj / f_b_proj / dt_bias``
KDA ``mixer.A_log [H]``                        ``self_attn.[forget_gate.]A_log [1, 1, H, 1]``
KDA ``mixer.g_a_proj / g_b_proj / o_norm``     ``self_attn.g_a_proj / g_b_proj / o_norm``
MLA ``mixer.q_proj``                           ``self_attn.q_proj``
MLA ``mixer.kv_a_proj / kv_a_norm``            ``self_attn.kv_a_proj_with_mqa / kv_a_layernorm``
MLA ``mixer.kv_b_proj / o_proj``               ``self_attn.kv_b_proj / o_proj``
dense ``ffn.{gate,up,down}_proj``              ``mlp.{gate,up,down}_proj``
MoE ``ffn.router.weight / balance_bias``       ``mlp.gate.weight / e_score_correction_bias`` (``block_sparse_moe.``)
MoE ``ffn.experts.gate_up [E, 2F, d]``         ``mlp.experts.gate_up_proj`` = per expert cat(w1, w3)
MoE ``ffn.experts.down [E, d, F]``             ``mlp.experts.down_proj`` = stack(w2)
MoE ``ffn.shared.{gate,up,down}_proj``         ``mlp.shared_experts.{gate,up,down}_proj``
``norm.weight`` / ``lm_head.weight``           ``model.norm.weight`` / ``lm_head.weight``
=============================================  ================================================================
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from k3.config import K3Config
from k3.config.hf import from_hf_dict
from k3.files import CONFIG_LIMIT, read_json
from k3.model.lm import K3ForCausalLM
from k3.model.safetensors_io import Shards

_KDA = {"q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "f_a_proj", "f_b_proj", "dt_bias", "g_a_proj",
        "g_b_proj", "o_norm"}
_MLA = {"q_proj": "q_proj", "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm",
        "kv_b_proj": "kv_b_proj", "o_proj": "o_proj", "q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm",
        "q_b_proj": "q_b_proj"}


def config_from_hf(hf: dict[str, Any]) -> K3Config:
    """A validated K3 config expressing a Kimi Linear ``config.json`` (dict); unsupported options are errors."""
    groups = hf.get("num_expert_group", hf.get("n_group", 1)) or 1
    if groups != 1:
        raise ValueError(f"Kimi Linear config: grouped routing (num_expert_group={groups}) is not supported")
    if not hf.get("moe_renormalize", hf.get("norm_topk_prob", True)):
        raise ValueError("Kimi Linear config: routing without renormalised weights (norm_topk_prob=False) "
                         "is not supported")
    return from_hf_dict(hf).validate()


def _normalise(hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """Original-checkpoint names → transformers' in-memory layout (fused conv, forget_gate, stacked experts)."""
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, int, str], Tensor] = {}
    convs: dict[str, dict[str, Tensor]] = {}
    for name, t in hf.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)", r"self_attn.forget_gate.\1", name)
        if m := re.match(r"(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$", name):
            experts[(m[1], int(m[2]), m[3])] = t
        elif m := re.match(r"(.*\.self_attn)\.([qkv])_conv1d\.weight$", name):
            convs.setdefault(m[1], {})[m[2]] = t
        else:
            out[name] = t
    for prefix, parts in convs.items():
        out[f"{prefix}.conv1d.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], 0)
    for prefix in sorted({p for p, _, _ in experts}):
        n = 1 + max(i for p, i, _ in experts if p == prefix)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[(prefix, i, "w1")], experts[(prefix, i, "w3")]], 0) for i in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[(prefix, i, "w2")] for i in range(n)])
    return out


def convert_state_dict(hf: dict[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """Rename (and reshape) a Kimi Linear state dict, either layout, into `K3ForCausalLM` names."""
    hf = _normalise(hf)
    kinds = config.layer_kinds()
    out: dict[str, Tensor] = {}
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            out["embed_tokens.weight"] = t
        elif name == "model.norm.weight":
            out["norm.weight"] = t
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["lm_head.weight"] = t
        elif m := re.match(r"model\.layers\.(\d+)\.(.+)$", name):
            i, rest = int(m[1]), m[2]
            out[f"layers.{i}.{_layer_name(rest, kinds[i], name)}"] = _layer_tensor(rest, t)
        else:
            raise ValueError(f"Kimi Linear checkpoint: unexpected tensor {name!r}")
    return out


def _layer_name(rest: str, kind: str, full: str) -> str:
    rest = rest.replace("input_layernorm.", "mixer_norm.").replace("post_attention_layernorm.", "ffn_norm.")
    if rest.startswith(("mixer_norm.", "ffn_norm.")):
        return rest
    if rest.startswith("self_attn."):
        module, _, leaf = rest.removeprefix("self_attn.").removeprefix("forget_gate.").partition(".")
        if kind == "kda" and module == "conv1d":
            return "mixer.conv.weight"
        if kind == "kda" and module in _KDA | {"A_log"}:
            return f"mixer.{module}" + (f".{leaf}" if leaf else "")
        if kind == "mla" and module in _MLA:
            return f"mixer.{_MLA[module]}.{leaf}"
    if rest.startswith("mlp."):
        rest = rest.removeprefix("mlp.")
        if rest.startswith("shared_experts."):
            return f"ffn.shared.{rest.removeprefix('shared_experts.')}"
        rest = {"gate.weight": "router.weight", "gate.e_score_correction_bias": "router.balance_bias",
                "experts.gate_up_proj": "experts.gate_up", "experts.down_proj": "experts.down"}.get(rest, rest)
        return f"ffn.{rest}"
    raise ValueError(f"Kimi Linear checkpoint: unexpected tensor {full!r} for a {kind.upper()} layer")


def _layer_tensor(rest: str, t: Tensor) -> Tensor:
    if rest.endswith("conv1d.weight"):
        return t.reshape(t.shape[0], t.shape[-1])  # [C, 1, w] → [C, w]
    if rest.endswith("A_log"):
        return t.reshape(-1)  # [1, 1, H, 1] → [H]
    return t


def _build(config: K3Config, state: dict[str, Tensor]) -> K3ForCausalLM:
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"Kimi Linear checkpoint does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def from_transformers(model: Any) -> K3ForCausalLM:
    """Convert a transformers ``KimiLinearForCausalLM`` (config and weights) into a `K3ForCausalLM`."""
    config = config_from_hf(model.config.to_dict())
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return _build(config, convert_state_dict(state, config))


def load_kimi_linear(path: str | Path) -> K3ForCausalLM:
    """Read a local Kimi Linear checkpoint directory (``config.json`` + safetensors), without transformers."""
    path = Path(path)
    config_file = path / "config.json"
    try:
        hf_config = read_json(config_file, CONFIG_LIMIT)
    except OSError as err:
        raise ValueError(f"{config_file}: cannot read the checkpoint config ({err})") from err
    shards = Shards(path)  # regular files, headers and index checked; tensors memory-mapped
    state: dict[str, Tensor] = {name: shards.tensor(name) for name in shards}
    config = config_from_hf(hf_config)
    return _build(config, convert_state_dict(state, config))
