"""Parameter counts and checkpoint bytes of a `K3Config`, computed analytically without allocating (SPEC §0)."""

from __future__ import annotations

from k3.config import K3Config


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
    a_log = k.num_heads if k.a_log_size is None else k.a_log_size
    decays = hk if k.decay == "channel" else k.num_heads  # per key channel (KDA) or per head (GDN-style)
    decay = d * k.decay_rank + k.decay_rank * decays + a_log + decays  # W_f1, W_f2, A_log, dt_bias
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


#: Bits per MXFP4 weight in storage: a 4-bit E2M1 element plus one 8-bit E8M0 scale per block of 32 (SPEC §7).
MXFP4_BITS = 4 + 8 / 32


def routed_expert_parameters(c: K3Config) -> int:
    """Parameters of all routed experts (every MoE layer), the part MXFP4 stores packed (SPEC §7, §10)."""
    e = c.moe
    width = c.hidden_size if e.latent_dim is None else e.latent_dim
    return c.ffn_kinds().count("moe") * e.num_experts * _glu(width, e.expert_hidden)


def checkpoint_bytes(c: K3Config) -> dict[str, float]:
    """Checkpoint size with every weight bf16, and with the routed experts MXFP4 (the rest bf16)."""
    total, routed = parameter_breakdown(c)["total"][0], routed_expert_parameters(c)
    return {"routed_experts": routed, "bf16": 2 * total,
            "mxfp4_experts": 2 * (total - routed) + routed * MXFP4_BITS / 8}


def vision_parameters(c: K3Config) -> tuple[int, int]:
    """MoonViT-V2 (SPEC §6, §10), bias-free → (encoder, projector).

    Encoder: patch embedding and position table, blocks (2 RMSNorms, fused qkv to heads·head_dim, output
    projection, MLP), final norm. Projector: 2×2 merge → Linear (merged → merged) – GELU – Linear (→ d) →
    RMSNorm at width d.
    """
    v = c.vision
    if not v.enabled:
        return 0, 0
    h = v.hidden_size
    inner = v.num_heads * (v.head_dim if v.head_dim is not None else h // v.num_heads)
    patch = v.in_channels * v.patch_size**2 * h + v.pos_emb_size**2 * h
    block = 2 * h + 4 * h * inner + 2 * h * v.mlp_hidden
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
    # Per layer two pre-norm gains; with AttnRes also two pseudo-queries (and key gains), plus the final ones.
    per_retrieval = 2 if c.attn_res.key_gain else 1
    depth = c.num_layers * 2 * d + d + ((2 * c.num_layers + 1) * d * per_retrieval if c.attn_res.enabled else 0)
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
