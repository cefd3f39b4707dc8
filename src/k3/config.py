"""The model configuration: a dataclass tree for the whole K3 model (SPEC §0).

`K3Config` is plain data: it round-trips through JSON losslessly, reads a Hugging Face-style
``config.json`` (Kimi Linear / Kimi K2 field names), validates every impossible combination
with a `ValueError` naming the field and its accepted range, and counts parameters
analytically (`count_parameters`) without allocating a tensor.

Dimensions the published summary does not state are assumptions, each documented on its field
(and in `ASSUMPTIONS`, which `k3 info` prints).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Published figures the paper preset is audited against (SPEC §0, report Table 1).
PUBLISHED_TOTAL = 2.78e12
PUBLISHED_ACTIVE = 104.2e9
PUBLISHED_VISION = 401e6

ASSUMPTIONS: dict[str, str] = {
    "vocab_size = 163,840": "Kimi K2 tokenizer family; the report says only 'about 160K'.",
    "mla.q_lora_rank = 1,536": "query latent rank of Kimi K2 / DeepSeek-V3 MLA; not published for K3.",
    "moe.dense_hidden = 18,432": "width of Kimi K2's single dense FFN layer; not published for K3.",
    "kda.decay_rank = 128": "low-rank decay projection W_f1 W_f2 of rank d_k, as in Kimi Linear.",
    "moe.shared_hidden = 3,072": "each shared expert is a SiTU-GLU of the routed-expert hidden width, at width d.",
    "vision: width 960, MLP 3,840": (
        "12 heads of 80; one divided-attention block (spatial + temporal attention + MLP) gives "
        "an encoder of 399M against the published ~401M; projector 4x960 -> 3,840 -> d on top."
    ),
    "tie_word_embeddings = False": "separate LM head, as in Kimi K2 and Kimi Linear.",
}


@dataclass
class KDAConfig:
    """Kimi Delta Attention layers (SPEC §1)."""

    num_heads: int = 96
    head_dim: int = 128  # d_k
    value_head_dim: int = 128  # d_v
    conv_size: int = 4  # causal depthwise ShortConv width
    gate: str = "bounded"  # "bounded": g_min·sigmoid(...) (K3); "softplus": -exp(A)·softplus(...) (Kimi Linear)
    g_min: float = -5.0  # log-decay floor of the bounded gate
    decay_rank: int = 128  # rank of the low-rank decay projection W_f1 W_f2 (assumed)
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
    dense_hidden: int = 18432  # dense FFN hidden width (assumed, Kimi K2)
    activation: str = "situ"  # "situ" (K3) or "swiglu" (Kimi Linear / K2)
    routed_scaling_factor: float = 1.0  # multiplies the routed mixture (Kimi Linear: 2.446)


@dataclass
class VisionConfig:
    """MoonViT-V2 encoder and projector (SPEC §6). Widths other than heads/layers/patch are assumed."""

    enabled: bool = True
    num_layers: int = 27
    hidden_size: int = 960
    num_heads: int = 12
    mlp_hidden: int = 3840
    patch_size: int = 14
    in_channels: int = 3
    merge_size: int = 2  # 2x2 spatial merge
    out_dim: int = 7168  # projector output: must equal the language width d


@dataclass
class MXConfig:
    """Microscaling quantization of routed experts (SPEC §7): weights MXFP4, input activations MXFP8."""

    enabled: bool = True
    weight_format: str = "mxfp4"
    activation_format: str = "mxfp8_e4m3"
    block_size: int = 32


MX_WEIGHT_FORMATS = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
MX_ACTIVATION_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2")

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
    rms_norm_eps: float = 1e-6
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
        """Raise `ValueError` naming the field and its accepted range for any impossible combination."""
        _positive(self, "vocab_size", "hidden_size", "num_layers", "mla_period", "context_length")
        _check(_real(self.rms_norm_eps) and self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "> 0")
        _check(_real(self.initializer_range) and self.initializer_range > 0, "initializer_range",
               self.initializer_range, "> 0")
        _flags(self, "tie_word_embeddings")
        _flags(self.mla, "output_gate", prefix="mla")
        _flags(self.attn_res, "enabled", prefix="attn_res")
        _flags(self.vision, "enabled", prefix="vision")
        _flags(self.mx, "enabled", prefix="mx")
        if self.mla_layers is not None:
            _check(isinstance(self.mla_layers, list), "mla_layers", self.mla_layers, "a list of layer indices or null")
            for i in self.mla_layers:
                _check(isinstance(i, int) and 1 <= i <= self.num_layers, "mla_layers", self.mla_layers,
                       f"1-based layer indices in [1, num_layers={self.num_layers}]")
            _check(len(set(self.mla_layers)) == len(self.mla_layers), "mla_layers", self.mla_layers,
                   "distinct indices")

        k = self.kda
        _positive(k, "num_heads", "head_dim", "value_head_dim", "conv_size", "decay_rank", "chunk_size", prefix="kda")
        _check(k.gate in ("bounded", "softplus"), "kda.gate", k.gate, "'bounded' or 'softplus'")
        _check(_real(k.g_min) and k.g_min < 0, "kda.g_min", k.g_min, "< 0")
        _check(isinstance(k.output_gate_rank, int) and k.output_gate_rank >= 0, "kda.output_gate_rank",
               k.output_gate_rank, ">= 0 (0 = full rank)")
        _check(k.chunk_size % 16 == 0, "kda.chunk_size", k.chunk_size, "a positive multiple of 16")

        m = self.mla
        _positive(m, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_shared_head_dim", "v_head_dim", prefix="mla")
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
            _positive(x, "block_size", prefix="mx")
            _check(x.weight_format in MX_WEIGHT_FORMATS, "mx.weight_format", x.weight_format,
                   " / ".join(MX_WEIGHT_FORMATS))
            _check(x.activation_format in MX_ACTIVATION_FORMATS, "mx.activation_format", x.activation_format,
                   " / ".join(MX_ACTIVATION_FORMATS))
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
            _check(v.hidden_size % v.num_heads == 0, "vision.hidden_size", v.hidden_size,
                   f"a multiple of vision.num_heads={v.num_heads}")
            _check(v.out_dim == self.hidden_size, "vision.out_dim", v.out_dim,
                   f"equal to hidden_size={self.hidden_size}")
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
        """Write JSON atomically (write to a temporary file, then rename)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> K3Config:
        """Read our JSON or a Hugging Face-style ``config.json`` (detected by ``model_type``).

        A user-written file may leave fields out (they take the paper defaults, e.g. for ``k3 info
        --config``); checkpoints are read with ``from_dict(..., complete=True)`` instead.
        """
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{os.fspath(path)}: not valid JSON ({err})") from err
        if isinstance(data, dict) and "model_type" in data:
            return from_hf_dict(data)
        return cls.from_dict(data)


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


# ---------------------------------------------------------------------- Hugging Face config.json
def from_hf_dict(hf: dict[str, Any]) -> K3Config:
    """Map a Hugging Face ``config.json`` (Kimi Linear, Kimi K2 / DeepSeek-V3 field names) to `K3Config`.

    Kimi Linear's ``linear_attn_config`` layer lists are 1-based; ``layer_types`` is 0-based.
    Peers have no AttnRes, SiTU, gated MLA, latent MoE, vision or MX, so those are switched off.
    """

    def get(*names: str, default: Any = None) -> Any:
        for name in names:
            if name in hf and hf[name] is not None:
                return hf[name]
        return default

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


# ---------------------------------------------------------------------- presets
def preset(name: str) -> K3Config:
    """`"paper"` (SPEC §0 exactly), `"tiny"` (unit tests), `"mini"` (`make demo`: 2.3M parameters, the best
    validation loss after five minutes on 2 cores of the shapes measured) or `"small"` (13.6M)."""
    if name == "paper":
        return K3Config()
    if name == "tiny":
        return K3Config(
            vocab_size=512,
            hidden_size=64,
            num_layers=4,
            context_length=4096,
            kda=KDAConfig(num_heads=2, head_dim=16, value_head_dim=16, decay_rank=16, chunk_size=16),
            mla=MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                          qk_shared_head_dim=8, v_head_dim=16),
            attn_res=AttnResConfig(block_size=2),
            moe=MoEConfig(num_experts=4, num_experts_per_token=2, num_shared_experts=1, expert_hidden=64,
                          shared_hidden=64, latent_dim=32, first_k_dense=1, dense_hidden=128),
            vision=VisionConfig(num_layers=2, hidden_size=32, num_heads=2, mlp_hidden=64, out_dim=64),
        )
    if name == "small":
        return K3Config(
            vocab_size=4096,
            hidden_size=256,
            num_layers=8,
            context_length=8192,
            kda=KDAConfig(num_heads=4, head_dim=64, value_head_dim=64, decay_rank=32, chunk_size=64),
            mla=MLAConfig(num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                          qk_shared_head_dim=32, v_head_dim=64),
            attn_res=AttnResConfig(block_size=3),
            moe=MoEConfig(num_experts=16, num_experts_per_token=2, num_shared_experts=1, expert_hidden=128,
                          shared_hidden=128, latent_dim=128, first_k_dense=1, dense_hidden=768),
            vision=VisionConfig(num_layers=4, hidden_size=128, num_heads=4, mlp_hidden=512, out_dim=256),
        )
    if name == "mini":  # `make demo`: the most learning in five minutes on 2 cores (benchmarks/demo.py)
        return K3Config(
            vocab_size=4096,
            hidden_size=128,
            num_layers=4,
            context_length=8192,
            kda=KDAConfig(num_heads=2, head_dim=64, value_head_dim=64, decay_rank=32, chunk_size=64),
            mla=MLAConfig(num_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64,
                          qk_shared_head_dim=32, v_head_dim=64),
            attn_res=AttnResConfig(block_size=2),
            moe=MoEConfig(num_experts=8, num_experts_per_token=2, num_shared_experts=1, expert_hidden=128,
                          shared_hidden=128, latent_dim=64, first_k_dense=1, dense_hidden=384),
            vision=VisionConfig(num_layers=2, hidden_size=64, num_heads=2, mlp_hidden=256, out_dim=128),
        )
    raise ValueError(f"unknown preset {name!r}; expected one of {PRESETS}")


PRESETS = ("paper", "tiny", "mini", "small")


# ---------------------------------------------------------------------- parameter counting
def _glu(d_in: int, hidden: int) -> int:
    """A gated FFN (SiTU-GLU or SwiGLU): gate and up d_in→hidden, down hidden→d_in, bias-free."""
    return 3 * d_in * hidden


def kda_layer_parameters(c: K3Config) -> int:
    """KDA sequence mixer (SPEC §1): projections, ShortConvs, gates, per-head norm, output."""
    k, d = c.kda, c.hidden_size
    hk, hv = k.num_heads * k.head_dim, k.num_heads * k.value_head_dim
    proj = d * (2 * hk + hv)  # W_q, W_k, W_v
    conv = k.conv_size * (2 * hk + hv)  # depthwise ShortConv per branch
    decay = d * k.decay_rank + k.decay_rank * hk + k.num_heads + hk  # W_f1, W_f2, A_log, dt_bias
    beta = d * k.num_heads  # W_b
    gate = d * hv if k.output_gate_rank == 0 else d * k.output_gate_rank + k.output_gate_rank * hv
    norm = k.value_head_dim  # per-head RMSNorm gain, shared by heads
    out = hv * d
    return proj + conv + decay + beta + gate + norm + out


def mla_layer_parameters(c: K3Config) -> int:
    """Gated MLA (SPEC §2): query (latent), KV latent + shared key, per-head up-projections, gate, output."""
    m, d = c.mla, c.hidden_size
    qk_head = m.qk_nope_head_dim + m.qk_shared_head_dim
    if m.q_lora_rank is None:
        query = d * m.num_heads * qk_head
    else:
        query = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * qk_head
    kv = d * (m.kv_lora_rank + m.qk_shared_head_dim) + m.kv_lora_rank  # W_dkv, W_ks, latent norm
    up = m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)  # W_uk, W_uv
    gate = d * m.num_heads * m.v_head_dim if m.output_gate else 0
    out = m.num_heads * m.v_head_dim * d
    return query + kv + up + gate + out


def moe_layer_parameters(c: K3Config) -> tuple[int, int]:
    """Stable LatentMoE (SPEC §4) → (total, active per token). The balancing bias is a buffer."""
    e, d = c.moe, c.hidden_size
    router = d * e.num_experts
    shared = e.num_shared_experts * _glu(d, e.shared_hidden)
    width = d if e.latent_dim is None else e.latent_dim
    latent = 0 if e.latent_dim is None else 2 * d * e.latent_dim + e.latent_dim  # down, up, RMSNorm
    expert = _glu(width, e.expert_hidden)
    common = router + shared + latent
    return common + e.num_experts * expert, common + e.num_experts_per_token * expert


def vision_parameters(c: K3Config) -> tuple[int, int]:
    """MoonViT-V2 (SPEC §6), bias-free → (encoder, projector).

    Encoder: patch embedding, divided-attention blocks (3 RMSNorms, spatial + temporal attention,
    MLP), final norm. Projector: 2×2 merge → Linear–GELU–Linear → RMSNorm at width d.
    """
    v = c.vision
    if not v.enabled:
        return 0, 0
    h = v.hidden_size
    patch = v.in_channels * v.patch_size**2 * h
    block = 3 * h + 2 * 4 * h * h + 2 * h * v.mlp_hidden
    merged = v.merge_size**2 * h
    return patch + v.num_layers * block + h, merged * merged + merged * v.out_dim + v.out_dim


def count_parameters(c: K3Config) -> tuple[int, int]:
    """(total, active) parameters, computed analytically without allocating (SPEC §0).

    Total includes the vision encoder; active counts what one text token touches: every
    non-routed weight (embedding table and LM head included) plus k of the n routed experts.
    """
    return _breakdown(c)["total"]


def parameter_breakdown(c: K3Config) -> dict[str, tuple[int, int]]:
    """(total, active) per component, plus "total"."""
    return _breakdown(c)


def _breakdown(c: K3Config) -> dict[str, tuple[int, int]]:
    d = c.hidden_size
    kinds, ffns = c.layer_kinds(), c.ffn_kinds()
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    n_dense, n_moe = ffns.count("dense"), ffns.count("moe")
    moe_total, moe_active = moe_layer_parameters(c)
    embed = c.vocab_size * d * (1 if c.tie_word_embeddings else 2)
    # Per layer two pre-norm gains; with AttnRes also two pseudo-queries, plus one final query.
    depth = c.num_layers * 2 * d + d + ((2 * c.num_layers + 1) * d if c.attn_res.enabled else 0)
    parts = {
        "embedding + lm head": (embed, embed),
        "kda layers": (n_kda * kda_layer_parameters(c),) * 2,
        "mla layers": (n_mla * mla_layer_parameters(c),) * 2,
        "dense ffn": (n_dense * _glu(d, c.moe.dense_hidden),) * 2,
        "moe layers": (n_moe * moe_total, n_moe * moe_active),
        "norms + attnres": (depth, depth),
        "vision encoder": (vision_parameters(c)[0], 0),
        "vision projector": (vision_parameters(c)[1], 0),
    }
    parts["total"] = (sum(t for t, _ in parts.values()), sum(a for _, a in parts.values()))
    return parts
