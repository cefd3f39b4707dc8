"""The model configuration schema (SPEC §0): a dataclass tree for the whole K3 model.

`K3Config` is plain data: it round-trips through JSON losslessly and validates every impossible combination
with a `ValueError` naming the field and its accepted range. Dimensions the published summary does not state
are assumptions, each documented on its field (and in `k3.config.presets.ASSUMPTIONS`, which `k3 info`
prints). Hugging Face ``config.json`` files are read by `k3.config.hf`; parameters are counted by
`k3.sizing.params`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from k3.files import CONFIG_LIMIT, read_json, write_text


@dataclass
class KDAConfig:
    """Kimi Delta Attention layers (SPEC §1)."""

    num_heads: int = 96
    head_dim: int = 128  # d_k
    value_head_dim: int = 128  # d_v
    conv_size: int = 4  # causal depthwise ShortConv width
    gate: str = "bounded"  # "bounded": g_min·sigmoid(...) (K3); "softplus": -exp(A)·softplus(...) (Kimi Linear)
    g_min: float = -5.0  # log-decay floor of the bounded gate
    decay: str = "channel"  # "channel": a decay per key channel (KDA); "head": one per head (Gated DeltaNet-style)
    decay_rank: int = 128  # rank of the low-rank decay projection W_f1 W_f2 (assumed)
    a_log_size: int | None = 128  # stored length of A_log; the first num_heads entries are used (release: 128)
    output_gate_rank: int = 0  # 0: full-rank output gate W_g (K3); r > 0: low-rank g_a/g_b (Kimi Linear)
    chunk_size: int = 64  # chunkwise-parallel chunk (multiple of 16)


@dataclass
class MLAConfig:
    """Gated Multi-head Latent Attention without positional encoding (SPEC §2)."""

    num_heads: int = 96
    q_lora_rank: int | None = 1536  # query latent rank (assumed); None: direct query projection (Kimi Linear)
    kv_lora_rank: int = 512  # cached KV latent
    qk_nope_head_dim: int = 128  # per-head content key / query part
    qk_shared_head_dim: int = 64  # shared, never-rotated key (peers call it qk_rope_head_dim)
    v_head_dim: int = 128
    output_gate: bool = True  # sigmoid gate per (head, channel); False for Kimi Linear
    norm_eps: float = 1e-6  # eps of the q_a / kv_a latent RMSNorms (release: 1e-6, the rest of the model 1e-5)

    def cache_scalars_per_token(self) -> int:
        """Scalars one MLA layer caches per token: the KV latent plus the shared key."""
        return self.kv_lora_rank + self.qk_shared_head_dim

    def expanded_scalars_per_token(self) -> int:
        """Scalars an uncompressed per-head cache would hold: H·(content key + shared key + value)."""
        return self.num_heads * (self.qk_nope_head_dim + self.qk_shared_head_dim + self.v_head_dim)


@dataclass
class AttnResConfig:
    """Block Attention Residuals over depth (SPEC §3); disabled = plain residual stream."""

    enabled: bool = True
    block_size: int = 12  # layers per depth block
    key_gain: bool = True  # learnable gain on the key RMSNorm of every retrieval (release: *_res_norm.weight)


@dataclass
class SiTUConfig:
    """Soft caps of the SiTU-GLU activation (SPEC §4): |SiTU| <= gate_cap·up_cap."""

    gate_cap: float = 4.0
    up_cap: float = 25.0


@dataclass
class MoEConfig:
    """Stable LatentMoE and the dense FFN layers (SPEC §4)."""

    num_experts: int = 896  # routed experts
    num_experts_per_token: int = 16  # top-k
    num_shared_experts: int = 2
    expert_hidden: int = 3072  # routed-expert hidden width
    shared_hidden: int = 3072  # hidden width of each shared expert (assumed = expert_hidden)
    latent_dim: int | None = 3584  # routed experts work at this width; None: at d (plain MoE)
    first_k_dense: int = 1  # the first k layers use a dense FFN
    dense_hidden: int = 33792  # dense FFN hidden width (release: intermediate_size)
    activation: str = "situ"  # "situ" (K3) or "swiglu" (Kimi Linear / K2)
    routed_scaling_factor: float = 1.0  # multiplies the routed mixture (Kimi Linear: 2.446)


#: ``<|media|>`` of our trainable tokenizer (`k3.tokenization.bpe.SPECIAL_TOKENS`): the presets' visual slot.
MEDIA_TOKEN_ID = 11


@dataclass
class VisionConfig:
    """MoonViT-V2 encoder and projector (SPEC §6, §10: the released vision_config)."""

    enabled: bool = True
    num_layers: int = 27
    hidden_size: int = 1024
    num_heads: int = 12
    head_dim: int | None = 128  # None: hidden_size / num_heads (release: qkv_hidden_size 1,536 = 12 x 128)
    mlp_hidden: int = 4096
    pos_emb_size: int = 64  # learned position table pos_emb_size x pos_emb_size x hidden (0: none)
    patch_size: int = 14
    in_channels: int = 3
    merge_size: int = 2  # 2x2 spatial merge
    out_dim: int = 7168  # projector output: must equal the language width d
    attention: str = "joint"  # "joint": all frames of a chunk together (release); "divided": spatial / temporal
    max_frames: int = 4  # frames per video chunk (release: init_pos_emb_time; the time embedding's rows)
    rope_theta: float = 10000.0  # 2-D rotary embedding inside attention (release: Rope2DPosEmbRepeated)
    norm_eps: float = 2**-7  # encoder RMSNorms: torch.nn.RMSNorm's default eps in the release's bf16 (mlx-vlm's)
    patch_budget: int = 65536  # 14-px patches per image at most; larger images are downscaled (release)
    media_token_id: int = 163605  # the placeholder a visual token fills (release: <|media_pad|>)

    @property
    def qkv_head_dim(self) -> int:
        """Width of one attention head: ``head_dim``, or ``hidden_size / num_heads`` when None."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


@dataclass
class MXConfig:
    """Microscaling quantization of routed experts (SPEC §7).

    ``enabled``: routed experts compute on MX weights (``weight_format``) and MX inputs (``activation_format``;
    None keeps inputs in high precision). Float experts fake-quantize them in the forward pass with a
    straight-through estimator (quantization-aware training, ``k3 train --qat mx``: MXFP4 weights, MXFP8 E4M3
    inputs); packed experts hold the MXFP4 codes (``k3 quantize``, the release). The published preset is the
    release's: MXFP4 weights only (its ``quantization_config`` has no input activations, SPEC §10).
    """

    enabled: bool = True
    weight_format: str = "mxfp4"
    activation_format: str | None = None
    block_size: int = 32


MX_WEIGHT_FORMATS = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
MX_ACTIVATION_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2")
#: ``k3 quantize --activations``: keep the model's MX inputs (none without QAT), none, or MXFP8 E4M3 (the one input
#: format compressed-tensors' ``quantization_config`` can describe).
PACKED_ACTIVATIONS = ("keep", "none", "mxfp8_e4m3")

_WIDTH, _HEADS, _LAYERS = 2**18, 2**12, 1024
#: The largest value `K3Config.validate` admits for each size, by dotted field name: far beyond any published model
#: (the paper preset: vocabulary 163,840, width 7,168, 93 layers, 896 experts, 1M context) yet small enough that a
#: crafted ``config.json`` (a context of 2^40 tokens, a width of 10^9) is refused in milliseconds, before anything
#: is built or allocated. The parameter count as a whole is bounded by `k3.sizing.memory.check_fits`.
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 2**22, "hidden_size": 2**17, "num_layers": _LAYERS, "context_length": 2**27,
    "kda.num_heads": _HEADS, "kda.head_dim": _HEADS, "kda.value_head_dim": _HEADS, "kda.conv_size": 1024,
    "kda.decay_rank": _WIDTH, "kda.a_log_size": _HEADS, "kda.output_gate_rank": _WIDTH, "kda.chunk_size": 4096,
    "mla.num_heads": _HEADS, "mla.q_lora_rank": _WIDTH, "mla.kv_lora_rank": _WIDTH, "mla.qk_nope_head_dim": _HEADS,
    "mla.qk_shared_head_dim": _HEADS, "mla.v_head_dim": _HEADS, "attn_res.block_size": _LAYERS,
    "moe.num_experts": 2**16, "moe.num_shared_experts": 1024, "moe.expert_hidden": _WIDTH,
    "moe.shared_hidden": _WIDTH, "moe.latent_dim": _WIDTH, "moe.dense_hidden": _WIDTH,
    "vision.num_layers": _LAYERS, "vision.hidden_size": 2**17, "vision.num_heads": _HEADS, "vision.head_dim": _HEADS,
    "vision.mlp_hidden": _WIDTH, "vision.pos_emb_size": 4096, "vision.patch_size": 1024, "vision.in_channels": 1024,
    "vision.merge_size": 256, "vision.max_frames": 4096, "vision.patch_budget": 2**24,
}

_SUBCONFIGS: dict[str, type] = {
    "kda": KDAConfig,
    "mla": MLAConfig,
    "attn_res": AttnResConfig,
    "situ": SiTUConfig,
    "moe": MoEConfig,
    "vision": VisionConfig,
    "mx": MXConfig,
}


@dataclass
class K3Config:
    """The whole model. Defaults are the published Kimi K3 (SPEC §0); see `preset`."""

    vocab_size: int = 163840
    hidden_size: int = 7168  # d
    num_layers: int = 93
    mla_period: int = 4  # layer i (1-based) is MLA iff i % mla_period == 0 or i is the last layer
    mla_layers: list[int] | None = None  # explicit 1-based MLA layer indices (overrides the period rule)
    context_length: int = 1_048_576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    attn_res: AttnResConfig = field(default_factory=AttnResConfig)
    situ: SiTUConfig = field(default_factory=SiTUConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    mx: MXConfig = field(default_factory=MXConfig)

    # ------------------------------------------------------------------ schedule
    def layer_kinds(self) -> list[str]:
        """One of "kda" / "mla" per layer: 3 KDA : 1 MLA, the last layer forced to MLA (SPEC §0)."""
        if self.mla_layers is not None:
            mla = set(self.mla_layers)
            return ["mla" if i in mla else "kda" for i in range(1, self.num_layers + 1)]
        return [
            "mla" if i % self.mla_period == 0 or i == self.num_layers else "kda"
            for i in range(1, self.num_layers + 1)
        ]

    def ffn_kinds(self) -> list[str]:
        """One of "dense" / "moe" per layer: the first `moe.first_k_dense` layers are dense."""
        return ["dense" if i < self.moe.first_k_dense else "moe" for i in range(self.num_layers)]

    def depth_sources(self) -> int:
        """AttnRes sources after the last layer: embedding + completed blocks + a non-empty partial."""
        full, partial = divmod(self.num_layers, self.attn_res.block_size)
        return 1 + full + (1 if partial else 0)

    # ------------------------------------------------------------------ validation
    def validate(self) -> K3Config:
        """Raise `ValueError` naming the field and its accepted range for any impossible combination (sizes beyond
        `SIZE_LIMITS` first)."""
        _within_limits(self)
        _positive(self, "vocab_size", "hidden_size", "num_layers", "mla_period", "context_length")
        _check(_real(self.rms_norm_eps) and self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "> 0")
        _check(_real(self.initializer_range) and self.initializer_range > 0, "initializer_range",
               self.initializer_range, "> 0")
        _flags(self, "tie_word_embeddings")
        _flags(self.mla, "output_gate", prefix="mla")
        _flags(self.attn_res, "enabled", "key_gain", prefix="attn_res")
        _flags(self.vision, "enabled", prefix="vision")
        _flags(self.mx, "enabled", prefix="mx")
        if self.mla_layers is not None:
            _check(isinstance(self.mla_layers, list) and len(self.mla_layers) <= self.num_layers, "mla_layers",
                   self.mla_layers, f"a list of at most num_layers={self.num_layers} layer indices, or null")
            for i in self.mla_layers:
                _check(isinstance(i, int) and 1 <= i <= self.num_layers, "mla_layers", self.mla_layers,
                       f"1-based layer indices in [1, num_layers={self.num_layers}]")
            _check(len(set(self.mla_layers)) == len(self.mla_layers), "mla_layers", self.mla_layers,
                   "distinct indices")

        k = self.kda
        _positive(k, "num_heads", "head_dim", "value_head_dim", "conv_size", "decay_rank", "chunk_size", prefix="kda")
        _check(k.gate in ("bounded", "softplus"), "kda.gate", k.gate, "'bounded' or 'softplus'")
        _check(k.decay in ("channel", "head"), "kda.decay", k.decay, "'channel' or 'head'")
        _check(_real(k.g_min) and k.g_min < 0, "kda.g_min", k.g_min, "< 0")
        _check(isinstance(k.output_gate_rank, int) and k.output_gate_rank >= 0, "kda.output_gate_rank",
               k.output_gate_rank, ">= 0 (0 = full rank)")
        _check(k.chunk_size % 16 == 0, "kda.chunk_size", k.chunk_size, "a positive multiple of 16")
        _check(k.a_log_size is None or (isinstance(k.a_log_size, int) and k.a_log_size >= k.num_heads),
               "kda.a_log_size", k.a_log_size, f">= kda.num_heads={k.num_heads} or null")

        m = self.mla
        _positive(m, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_shared_head_dim", "v_head_dim", prefix="mla")
        _check(_real(m.norm_eps) and m.norm_eps > 0, "mla.norm_eps", m.norm_eps, "> 0")
        _check(m.q_lora_rank is None or (isinstance(m.q_lora_rank, int) and m.q_lora_rank > 0), "mla.q_lora_rank",
               m.q_lora_rank, "> 0 or null")

        _positive(self.attn_res, "block_size", prefix="attn_res")
        _check(_real(self.situ.gate_cap) and self.situ.gate_cap > 0, "situ.gate_cap", self.situ.gate_cap, "> 0")
        _check(_real(self.situ.up_cap) and self.situ.up_cap > 0, "situ.up_cap", self.situ.up_cap, "> 0")

        e = self.moe
        _positive(e, "num_experts", "num_experts_per_token", "expert_hidden", "dense_hidden", prefix="moe")
        _check(e.num_experts_per_token <= e.num_experts, "moe.num_experts_per_token", e.num_experts_per_token,
               f"[1, moe.num_experts={e.num_experts}]")
        _check(isinstance(e.num_shared_experts, int) and e.num_shared_experts >= 0, "moe.num_shared_experts",
               e.num_shared_experts, ">= 0")
        if e.num_shared_experts:
            _positive(e, "shared_hidden", prefix="moe")
        _check(e.latent_dim is None or (isinstance(e.latent_dim, int) and e.latent_dim > 0), "moe.latent_dim",
               e.latent_dim, "> 0 or null")
        _check(isinstance(e.first_k_dense, int) and 0 <= e.first_k_dense <= self.num_layers, "moe.first_k_dense",
               e.first_k_dense, f"[0, num_layers={self.num_layers}]")
        _check(e.activation in ("situ", "swiglu"), "moe.activation", e.activation, "'situ' or 'swiglu'")
        _check(_real(e.routed_scaling_factor) and e.routed_scaling_factor > 0, "moe.routed_scaling_factor",
               e.routed_scaling_factor, "> 0")

        x = self.mx
        if x.enabled:
            _check(x.block_size == 32, "mx.block_size", x.block_size, "32 (the OCP MX block, k3.ops.mx)")
            _check(x.weight_format in MX_WEIGHT_FORMATS, "mx.weight_format", x.weight_format,
                   " / ".join(MX_WEIGHT_FORMATS))
            _check(x.activation_format is None or x.activation_format in MX_ACTIVATION_FORMATS,
                   "mx.activation_format", x.activation_format, " / ".join(MX_ACTIVATION_FORMATS) + " / null")
            # Routed-expert matmuls are blocked along their input width: ℓ (gate/up) and the hidden (down).
            routed_in = e.latent_dim if e.latent_dim is not None else self.hidden_size
            name = "moe.latent_dim" if e.latent_dim is not None else "hidden_size"
            _check(routed_in % x.block_size == 0, name, routed_in,
                   f"a multiple of mx.block_size={x.block_size} (MX-quantized routed-expert input width)")
            _check(e.expert_hidden % x.block_size == 0, "moe.expert_hidden", e.expert_hidden,
                   f"a multiple of mx.block_size={x.block_size} (MX-quantized routed-expert input width)")

        v = self.vision
        if v.enabled:
            _positive(v, "num_layers", "hidden_size", "num_heads", "mlp_hidden", "patch_size", "in_channels",
                      "merge_size", "out_dim", prefix="vision")
            if v.head_dim is None:
                _check(v.hidden_size % v.num_heads == 0, "vision.hidden_size", v.hidden_size,
                       f"a multiple of vision.num_heads={v.num_heads} (or set vision.head_dim)")
            else:
                _positive(v, "head_dim", prefix="vision")
            _check(isinstance(v.pos_emb_size, int) and v.pos_emb_size >= 0, "vision.pos_emb_size", v.pos_emb_size,
                   ">= 0")
            _check(v.out_dim == self.hidden_size, "vision.out_dim", v.out_dim,
                   f"equal to hidden_size={self.hidden_size}")
            _check(v.attention in ("joint", "divided"), "vision.attention", v.attention, "'joint' or 'divided'")
            _positive(v, "max_frames", "patch_budget", prefix="vision")
            _check(isinstance(v.media_token_id, int) and 0 <= v.media_token_id < self.vocab_size,
                   "vision.media_token_id", v.media_token_id, f"a token id in [0, vocab_size={self.vocab_size})")
            _check(v.qkv_head_dim % 4 == 0, "vision.head_dim", v.qkv_head_dim,
                   "a multiple of 4 (the 2-D rotary embedding turns row and column pairs)")
            _check(v.hidden_size % 2 == 0, "vision.hidden_size", v.hidden_size, "even (the time embedding)")
            _check(_real(v.rope_theta) and v.rope_theta > 0, "vision.rope_theta", v.rope_theta, "> 0")
            _check(_real(v.norm_eps) and v.norm_eps > 0, "vision.norm_eps", v.norm_eps, "> 0")
        return self

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], complete: bool = False) -> K3Config:
        """Build from `to_dict` output; unknown keys are an error naming the key. Absent fields take the
        paper defaults unless ``complete`` (checkpoints), where they are an error listing every one."""
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        if complete:
            data = with_added_fields(data)
        missing = missing_fields(data) if complete else []
        if missing:
            raise ValueError(f"missing fields: {', '.join(missing)}")
        kwargs: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in names:
                raise ValueError(f"unknown config field {key!r}; expected one of {sorted(names)}")
            if key in _SUBCONFIGS:
                kwargs[key] = _build(_SUBCONFIGS[key], value, key)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str, complete: bool = False) -> K3Config:
        return cls.from_dict(json.loads(text), complete)

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (`k3.files.atomic_write`)."""
        write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> K3Config:
        """Read a file written by `save` (a user-written file may leave fields out: they take the paper defaults,
        e.g. for ``k3 info --config``; checkpoints are read with ``from_dict(..., complete=True)`` instead).
        A Hugging Face ``config.json`` (it has ``model_type``) is read by `k3.config.load_config`."""
        data = read_json(path, CONFIG_LIMIT)
        if isinstance(data, dict) and "model_type" in data:
            raise ValueError(f"{os.fspath(path)}: a Hugging Face config.json (model_type {data['model_type']!r}); "
                             f"read it with k3.config.load_config")
        return cls.from_dict(data)


#: Fields added after checkpoints were first written, each with the value that keeps an older checkpoint's behaviour:
#: a complete config (a checkpoint's) may lack these, and only these.
ADDED_FIELDS = {"kda.decay": "channel"}


def with_added_fields(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every absent `ADDED_FIELDS` entry filled in (a copy; ``data`` is left as it is)."""
    out = dict(data)
    for name, value in ADDED_FIELDS.items():
        section, _, key = name.partition(".")
        if isinstance(out.get(section), dict) and key not in out[section]:
            out[section] = {**out[section], key: value}
    return out


def missing_fields(data: dict[str, Any]) -> list[str]:
    """Dotted names of the `K3Config` fields ``data`` lacks, sub-config fields included (``moe.num_experts``)."""
    missing = []
    for f in dataclasses.fields(K3Config):
        if f.name not in data:
            missing.append(f.name)
        elif f.name in _SUBCONFIGS and isinstance(data[f.name], dict):
            missing += [f"{f.name}.{g.name}" for g in dataclasses.fields(_SUBCONFIGS[f.name])
                        if g.name not in data[f.name]]
    return missing


def _build(kind: type, value: Any, prefix: str) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"config field {prefix!r} must be an object, got {type(value).__name__}")
    names = {f.name for f in dataclasses.fields(kind)}
    for key in value:
        if key not in names:
            raise ValueError(f"unknown config field '{prefix}.{key}'; expected one of {sorted(names)}")
    return kind(**value)


def _within_limits(config: K3Config) -> None:
    """Every integer size of ``config`` at most its `SIZE_LIMITS` entry (other types are `validate`'s to refuse)."""
    for name, limit in SIZE_LIMITS.items():
        owner, _, field_name = name.rpartition(".")
        value = getattr(getattr(config, owner) if owner else config, field_name)
        if isinstance(value, int) and not isinstance(value, bool):
            _check(value <= limit, name, value, f"at most {limit:,} (k3.config.SIZE_LIMITS)")


def _check(ok: bool, name: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ValueError(f"config.{name} = {value!r} is invalid: must be {accepted}")


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _flags(obj: Any, *names: str, prefix: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        _check(isinstance(value, bool), f"{prefix}.{name}" if prefix else name, value, "true or false")


def _positive(obj: Any, *names: str, prefix: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        full = f"{prefix}.{name}" if prefix else name
        _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, full, value, "a positive integer")
