"""The released Kimi K3 checkpoint layout (SPEC §10): `from_pretrained` and `save_pretrained`.

A release directory holds ``config.json`` (``model_type: kimi_k3``), ``model-0000i-of-0000n.safetensors`` shards
and their index. Names are ``language_model.model.layers.N.…`` (text), ``vision_tower.…`` and ``mm_projector.…``
(vision; skipped, and reported in ``model.release.skipped``, only for a config without vision). Our names ↔ the
release's:

==========================================  ==========================================================
``embed_tokens`` / ``norm`` / ``lm_head``   ``language_model.model.embed_tokens`` / ``model.norm`` / ``lm_head``
``final_query`` / ``final_key_gain``        ``model.output_attn_res_proj.weight [1, d]`` / ``output_attn_res_norm``
``layers.N.mixer_norm`` / ``ffn_norm``      ``input_layernorm`` / ``post_attention_layernorm``
``layers.N.{mixer,ffn}_query``              ``{self_attention,mlp}_res_proj.weight [1, d]``
``layers.N.{mixer,ffn}_key_gain``           ``{self_attention,mlp}_res_norm.weight``
KDA ``mixer.conv.weight [3C, w]``           ``self_attn.{q,k,v}_conv1d.weight [C, 1, w]`` (fp32), concatenated
KDA ``mixer.*`` (projections, gates, norm)  ``self_attn.*`` — ``A_log [128]``, ``dt_bias``, ``o_norm`` in fp32
MLA ``mixer.{q_a_norm,kv_a_proj,kv_a_norm}`` ``self_attn.{q_a_layernorm,kv_a_proj_with_mqa,kv_a_layernorm}``
dense ``ffn.{gate,up,down}_proj``           ``mlp.{gate,up,down}_proj``
MoE ``ffn.router.{weight,balance_bias}``    ``block_sparse_moe.gate.{weight,e_score_correction_bias}`` (bias fp32)
MoE ``ffn.latent_{down,norm,up}``           ``block_sparse_moe.routed_expert_{down_proj,norm,up_proj}``
MoE ``ffn.shared.*``                        ``block_sparse_moe.shared_experts.*``
MoE ``ffn.experts.packed.E.wI.weight_*``    ``block_sparse_moe.experts.E.wI.weight_{packed,scale}`` (MXFP4)
``vision.vision_tower.*`` / ``vision.mm_projector.*``  ``vision_tower.*`` / ``mm_projector.*`` (`k3.model.vision`)
==========================================  ==========================================================

Loading memory-maps the shards (`k3.model.safetensors_io.Shards`): packed experts stay views of the files,
everything else is converted once to the requested dtype. Saving writes each tensor in the dtype it was loaded
with (or the release's: fp32 for the tensors above, uint8 experts, bf16 otherwise), so load → save reproduces
every tensor byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from k3.config import K3Config
from k3.config.hf import from_release_dict, is_release, to_release_dict
from k3.files import CONFIG_LIMIT, read_json, write_text
from k3.model.packed import PROJECTIONS, PackedExperts, skeleton
from k3.model.safetensors_io import Shards, write_shards
from k3.model.width import Experts, LatentMoE
from k3.sizing.memory import check_stored

TEXT, MODEL = "language_model.", "language_model.model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
#: Release tensors stored in fp32 (SPEC §10); the rest of the text model is bf16, routed experts uint8.
FP32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")


@dataclass
class ReleaseInfo:
    """What `from_pretrained` read: the original config, each tensor's stored dtype, and what it skipped."""

    config: dict[str, Any]
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    consumed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Rule:
    """Our tensor ``ours`` is made of the release tensors ``names`` by ``join``, and split back by ``split``."""

    ours: str
    names: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor] = lambda ts: ts[0]
    split: Callable[[Tensor], list[Tensor]] = lambda t: [t]


def _row(t: Tensor) -> list[Tensor]:
    return [t.reshape(1, -1)]


def _rules(model: torch.nn.Module) -> list[Rule]:
    """One `Rule` per tensor of ``model``'s state dict."""
    cfg: K3Config = model.config
    rules = [Rule("embed_tokens.weight", (MODEL + "embed_tokens.weight",)),
             Rule("norm.weight", (MODEL + "norm.weight",))]
    if model.lm_head is not None:
        rules.append(Rule("lm_head.weight", (TEXT + "lm_head.weight",)))
    if model.final_query is not None:
        rules.append(Rule("final_query", (MODEL + "output_attn_res_proj.weight",), lambda ts: ts[0].reshape(-1), _row))
    if model.final_key_gain is not None:
        rules.append(Rule("final_key_gain", (MODEL + "output_attn_res_norm.weight",)))
    for i, layer in enumerate(model.layers):
        rules += _layer_rules(cfg, i, layer)
    if model.vision is not None:  # `k3.model.vision` keeps the release's module names
        rules += [Rule(f"vision.{name}", (name,)) for name in model.vision.state_dict()]
    return rules


def _layer_rules(cfg: K3Config, i: int, layer: torch.nn.Module) -> list[Rule]:
    ours, theirs = f"layers.{i}.", f"{MODEL}layers.{i}."
    same = lambda a, b: Rule(ours + a, (theirs + b,))  # noqa: E731
    rules = [same("mixer_norm.weight", "input_layernorm.weight"),
             same("ffn_norm.weight", "post_attention_layernorm.weight")]
    for mine, release in (("mixer", "self_attention_res"), ("ffn", "mlp_res")):
        if getattr(layer, f"{mine}_query") is not None:
            rules.append(Rule(f"{ours}{mine}_query", (f"{theirs}{release}_proj.weight",),
                              lambda ts: ts[0].reshape(-1), _row))
        if getattr(layer, f"{mine}_key_gain") is not None:
            rules.append(same(f"{mine}_key_gain", f"{release}_norm.weight"))
    renames = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm"}
    for name, _ in layer.mixer.named_parameters():
        if name == "conv.weight":
            widths = [cfg.kda.num_heads * cfg.kda.head_dim] * 2 + [cfg.kda.num_heads * cfg.kda.value_head_dim]
            rules.append(Rule(ours + "mixer.conv.weight", tuple(f"{theirs}self_attn.{b}_conv1d.weight" for b in "qkv"),
                              lambda ts: torch.cat([t.reshape(t.shape[0], t.shape[-1]) for t in ts]),
                              lambda t, w=widths: [p.unsqueeze(1) for p in t.split(w)]))
        else:
            module, _, leaf = name.rpartition(".")
            release = f"{renames.get(module, module)}.{leaf}" if module else leaf
            rules.append(same(f"mixer.{name}", f"self_attn.{release}"))
    rules += _ffn_rules(layer.ffn, ours + "ffn.", theirs)
    return rules


def _ffn_rules(ffn: torch.nn.Module, ours: str, theirs: str) -> list[Rule]:
    if not isinstance(ffn, LatentMoE):
        return [Rule(f"{ours}{p}.weight", (f"{theirs}mlp.{p}.weight",)) for p in ("gate_proj", "up_proj", "down_proj")]
    moe = theirs + "block_sparse_moe."
    rules = [Rule(ours + "router.weight", (moe + "gate.weight",)),
             Rule(ours + "router.balance_bias", (moe + "gate.e_score_correction_bias",))]
    if ffn.latent_down is not None:
        rules += [Rule(f"{ours}latent_{a}.weight", (f"{moe}routed_expert_{b}.weight",))
                  for a, b in (("down", "down_proj"), ("norm", "norm"), ("up", "up_proj"))]
    if ffn.shared is not None:
        rules += [Rule(f"{ours}shared.{p}.weight", (f"{moe}shared_experts.{p}.weight",))
                  for p in ("gate_proj", "up_proj", "down_proj")]
    E, F = ffn.experts.num_experts, ffn.experts.hidden
    if isinstance(ffn.experts, PackedExperts):
        return rules + [Rule(f"{ours}experts.packed.{e}.{w}.weight_{kind}", (f"{moe}experts.{e}.{w}.weight_{kind}",))
                        for e in range(E) for w in PROJECTIONS for kind in ("packed", "scale")]
    names = lambda w: tuple(f"{moe}experts.{e}.{w}.weight" for e in range(E))  # noqa: E731
    return rules + [
        Rule(ours + "experts.gate_up", names("w1") + names("w3"),
             lambda ts: torch.cat([torch.stack(ts[:E]), torch.stack(ts[E:])], dim=1),
             lambda t: [*t[:, :F].unbind(), *t[:, F:].unbind()]),
        Rule(ours + "experts.down", names("w2"), torch.stack, lambda t: list(t.unbind()))]


def is_release_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a released-layout ``config.json`` (``model_type: kimi_k3``)."""
    try:
        return is_release(read_json(Path(directory) / "config.json", CONFIG_LIMIT))
    except (OSError, ValueError, AttributeError):
        return False


def read_release_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    try:
        hf = read_json(path, CONFIG_LIMIT)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the checkpoint config ({err})") from err
    if not isinstance(hf, dict) or not is_release(hf):
        raise ValueError(f"{path}: not a Kimi K3 release config (model_type "
                         f"{hf.get('model_type') if isinstance(hf, dict) else None!r}, expected 'kimi_k3')")
    return hf


def _target_dtype(ours: str, dtype: torch.dtype) -> torch.dtype:
    if ".weight_packed" in ours or ".weight_scale" in ours:
        return torch.uint8
    return torch.float32 if ours.endswith(("router.weight", "router.balance_bias")) else dtype


def from_pretrained(cls: type, directory: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    packed: bool = True) -> Any:
    """Load a release directory into ``cls`` (`K3ForCausalLM`); see the module docstring. ``packed=False``
    decodes the MXFP4 experts into trainable float `Experts`."""
    hf = read_release_config(directory)
    config_file = Path(directory) / "config.json"
    config = from_release_dict(hf)
    shards = Shards(directory)  # headers only
    a_log = next((name for name in shards if name.endswith("self_attn.A_log")), None)
    if a_log is not None:  # the stored length of A_log (the model reads its first num_heads entries)
        config.kda.a_log_size = shards.entries[a_log].shape[-1]
    try:  # absurd sizes, and a model larger than the shards, are refused before anything is built
        config.validate()
    except (ValueError, TypeError) as err:
        raise ValueError(f"{config_file}: {err}") from err
    check_stored(config, sum(e.end - e.start for e in shards.entries.values()), str(config_file),
                 f"the shards of {directory}")
    release_packed = any(name.endswith(".weight_packed") for name in shards)
    model = skeleton(cls, config, release_packed)
    expected = model.state_dict()
    state, info = {}, ReleaseInfo(hf)
    for rule in _rules(model):
        parts = [_read(shards, name, shape) for name, shape in
                 zip(rule.names, [t.shape for t in rule.split(expected[rule.ours])])]
        info.dtypes.update({name: t.dtype for name, t in zip(rule.names, parts)})
        info.consumed += rule.names
        state[rule.ours] = rule.join([p if p.dtype == _target_dtype(rule.ours, dtype) else
                                      p.to(_target_dtype(rule.ours, dtype)) for p in parts])
    left = sorted(set(shards) - set(info.consumed))
    info.skipped = [name for name in left if name.startswith(VISION_PREFIXES)]
    unexpected = [name for name in left if not name.startswith(VISION_PREFIXES)]
    if unexpected:
        raise ValueError(f"{directory}: {len(unexpected)} tensors do not belong to this config, e.g. "
                         f"{', '.join(unexpected[:3])}")
    model.load_state_dict(state, strict=True, assign=True)
    if release_packed and not packed:
        for layer in model.layers:
            if isinstance(layer.ffn, LatentMoE):
                layer.ffn.experts = layer.ffn.experts.unpack(dtype)
    model.release = info
    return model.eval()


def _read(shards: Shards, name: str, shape: torch.Size) -> Tensor:
    if name not in shards:
        raise ValueError(f"{shards.directory}: missing tensor {name!r} (expected shape {list(shape)})")
    entry = shards.entries[name]
    if entry.shape != tuple(shape):
        raise ValueError(f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, expected {list(shape)}")
    if name.endswith((".weight_packed", ".weight_scale")) and entry.dtype != torch.uint8:
        raise ValueError(f"{entry.file}: tensor {name!r} is {entry.dtype}, expected uint8 (MXFP4 codes / E8M0 "
                         f"scales)")
    return shards.tensor(name)


def save_pretrained(model: Any, directory: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write ``model`` in the release layout (config.json, shards, index). Float experts are MXFP4-quantized
    (lossy, `k3.ops.mx.quantize`); a model from `from_pretrained` is written back exactly."""
    config = release_config(model)  # refuses what would not load back, before anything is written
    directory = Path(directory)
    paths = write_shards(directory, release_tensors(model), max_shard_bytes)
    write_text(directory / "config.json", json.dumps(config, indent=2))
    return paths


def release_config(model: Any) -> dict[str, Any]:
    """``model``'s config as the release's ``config.json`` (`k3.config.hf.to_release_dict`: a config the layout
    cannot describe is refused)."""
    info: ReleaseInfo | None = getattr(model, "release", None)
    return to_release_dict(model.config, info.config if info else None)


def release_tensors(model: Any, stored: bool = True) -> dict[str, Tensor]:
    """``model``'s tensors under the release's names. ``stored``: as `save_pretrained` stores them — float routed
    experts MXFP4-quantized, each tensor in the dtype it was loaded with or the release's; otherwise the model's own
    tensors, float experts under ``experts.E.wI.weight``."""
    if not stored:
        state = model.state_dict()
        return {name: t.detach() for rule in _rules(model) for name, t in zip(rule.names, rule.split(state[rule.ours]))}
    info: ReleaseInfo | None = getattr(model, "release", None)
    state = model.state_dict()
    for layer_index, layer in enumerate(model.layers):
        if isinstance(layer.ffn, LatentMoE) and isinstance(layer.ffn.experts, Experts) and not isinstance(
                layer.ffn.experts, PackedExperts):
            prefix = f"layers.{layer_index}.ffn.experts."
            packed = PackedExperts.pack(layer.ffn.experts).state_dict()
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
            state.update({prefix + k: v for k, v in packed.items()})
    tensors: dict[str, Tensor] = {}
    for rule in _rules(skeleton(type(model), model.config, packed=True)):
        for name, t in zip(rule.names, rule.split(state[rule.ours].detach())):
            dtype = info.dtypes.get(name) if info else None
            tensors[name] = t.to(dtype or _release_dtype(name)).contiguous()
    return tensors


def _release_dtype(name: str) -> torch.dtype:
    if name.endswith((".weight_packed", ".weight_scale")):
        return torch.uint8
    return torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16
