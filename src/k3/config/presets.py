"""The presets (SPEC §0): ``paper`` (the published Kimi K3), ``tiny``, ``mini``, ``small`` and ``release-tiny``; the
published figures the paper preset is audited against, and where the release or our assumptions fixed a value."""

from __future__ import annotations

from k3.config.schema import (
    MEDIA_TOKEN_ID,
    AttnResConfig,
    K3Config,
    KDAConfig,
    MLAConfig,
    MoEConfig,
    MXConfig,
    VisionConfig,
)

# Published figures the paper preset is audited against (SPEC §0, report Table 1).
PUBLISHED_TOTAL = 2.78e12
PUBLISHED_ACTIVE = 104.2e9
PUBLISHED_VISION = 401e6

ASSUMPTIONS: dict[str, str] = {
    "vision: video in chunks of 4 frames": (
        "the release's processors take images only; a video is cut into chunks of init_pos_emb_time = 4 frames, "
        "each one grid (as Kimi K2.5 and vLLM's K3 port do), its frames averaged by the sd2_tpool merge."
    ),
}

#: Where the released ``moonshotai/Kimi-K3`` (SPEC §10) fixed a value or a semantic question the paper left
#: open — the published preset follows the release; each entry names its source (``k3 info`` prints them).
RELEASE_DECISIONS: dict[str, str] = {
    "moe.dense_hidden = 33,792": "text_config.intermediate_size (our paper-era assumption was Kimi K2's 18,432).",
    "rms_norm_eps = 1e-5": "text_config.rms_norm_eps; MLA's q_a/kv_a latent norms use 1e-6 (mla.norm_eps), "
                           "as in the remote modeling_kimi_linear.py and mlx-lm kimi_k3.",
    "mla.q_lora_rank = 1,536": "text_config.q_lora_rank (was assumed from Kimi K2).",
    "kda.decay_rank = 128": "f_a_proj [128, d] / f_b_proj [H·d_k, 128]: the decay projection has rank d_k.",
    "moe.shared_hidden = 3,072 x 2": "shared_experts.{gate,up}_proj [6,144, d]: two experts of 3,072 fused.",
    "kda.a_log_size = 128": "self_attn.A_log is stored [128]; the model reads its first num_heads entries "
                            "(remote code; mlx-lm kimi_k3 sanitize keeps A_log[:num_heads]).",
    "attn_res.key_gain = true": "{self_attention,mlp,output_attn}_res_norm.weight: the AttnRes key RMSNorm has "
                                "a learnable gain; scores are res_proj · (gain ⊙ rms(v)), softmax in fp32 "
                                "(mlx-lm kimi_k3 _attn_res_combine). Blocks start where layer % 12 == 0.",
    "situ caps 4 / 25": "activation_situ_beta = 4 caps the gate (w1, gate_proj: 4·tanh(g/4)·σ(g)), "
                        "activation_situ_linear_beta = 25 the up branch (w3, up_proj: 25·tanh(u/25)).",
    "routed_scaling_factor before the latent norm": "router weights are renormalised and scaled before "
                                                   "routed_expert_norm (mlx-lm kimi_k3 _group_expert_select).",
    "vision width 1,024": "vision_config.vt_hidden_size (was assumed 960), qkv 1,536 = 12 x 128, MLP 4,096, "
                          "projector 4,096 -> 7,168 (mm_projector.proj.0 / proj.2, post_norm).",
    "vision.attention = joint": "the released encoder (its modeling_kimi_k3.py; SGLang's and vLLM's ports) attends "
                                "over all patches of an image or a <= 4-frame chunk at once (one cu_seqlens segment "
                                "per grid), not in the paper's alternating spatial / temporal blocks; 2-D RoPE "
                                "(theta 10,000, column/row pairs) on top of pos_emb resized bilinearly, a sinusoidal "
                                "time embedding when t > 1, RMSNorm eps = fp32 epsilon, projector GELU(erf) then "
                                "post_norm (eps 1e-5), no biases.",
    "MXFP4 routed experts": "quantization_config: compressed-tensors mxfp4-pack-quantized, group 32, weights "
                            "only (w1/w2/w3 weight_packed uint8 [out, in/2] + weight_scale E8M0 [out, in/32]).",
}


# ---------------------------------------------------------------------- presets
def preset(name: str) -> K3Config:
    """`"paper"` (SPEC §0 exactly), `"tiny"` (unit tests), `"mini"` (`make demo`: 2.3M parameters, the best
    validation loss after five minutes on 2 cores of the shapes measured), `"small"` (13.6M) or `"release-tiny"` (the
    dimensions the peers' kernels need — MLA latent 512 + shared 64, KDA K = V = 128 — in the release's layout)."""
    if name == "paper":
        return K3Config()
    if name == "tiny":
        return K3Config(
            vocab_size=512,
            hidden_size=64,
            num_layers=4,
            context_length=4096,
            kda=KDAConfig(num_heads=2, head_dim=16, value_head_dim=16, decay_rank=16, a_log_size=None,
                          chunk_size=16),
            mla=MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                          qk_shared_head_dim=8, v_head_dim=16),
            attn_res=AttnResConfig(block_size=2),
            moe=MoEConfig(num_experts=4, num_experts_per_token=2, num_shared_experts=1, expert_hidden=64,
                          shared_hidden=64, latent_dim=32, first_k_dense=1, dense_hidden=128),
            vision=VisionConfig(num_layers=2, hidden_size=32, num_heads=2, head_dim=None, mlp_hidden=64,
                                pos_emb_size=8, out_dim=64, patch_budget=1024,
                                media_token_id=MEDIA_TOKEN_ID),
            mx=MXConfig(enabled=False),  # full precision; `k3 train --qat mx` turns MX on
        )
    if name == "small":
        return K3Config(
            vocab_size=4096,
            hidden_size=256,
            num_layers=8,
            context_length=8192,
            kda=KDAConfig(num_heads=4, head_dim=64, value_head_dim=64, decay_rank=32, a_log_size=None,
                          chunk_size=64),
            mla=MLAConfig(num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                          qk_shared_head_dim=32, v_head_dim=64),
            attn_res=AttnResConfig(block_size=3),
            moe=MoEConfig(num_experts=16, num_experts_per_token=2, num_shared_experts=1, expert_hidden=128,
                          shared_hidden=128, latent_dim=128, first_k_dense=1, dense_hidden=768),
            vision=VisionConfig(num_layers=4, hidden_size=128, num_heads=4, head_dim=None, mlp_hidden=512,
                                pos_emb_size=16, out_dim=256, patch_budget=1024,
                                media_token_id=MEDIA_TOKEN_ID),
            mx=MXConfig(enabled=False),  # full precision; `k3 train --qat mx` turns MX on
        )
    if name == "mini":  # `make demo`: the most learning in five minutes on 2 cores (benchmarks/demo.py)
        return K3Config(
            vocab_size=4096,
            hidden_size=128,
            num_layers=4,
            context_length=8192,
            kda=KDAConfig(num_heads=2, head_dim=64, value_head_dim=64, decay_rank=32, a_log_size=None,
                          chunk_size=64),
            mla=MLAConfig(num_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64,
                          qk_shared_head_dim=32, v_head_dim=64),
            attn_res=AttnResConfig(block_size=2),
            moe=MoEConfig(num_experts=8, num_experts_per_token=2, num_shared_experts=1, expert_hidden=128,
                          shared_hidden=128, latent_dim=64, first_k_dense=1, dense_hidden=384),
            vision=VisionConfig(num_layers=2, hidden_size=64, num_heads=2, head_dim=None, mlp_hidden=256,
                                pos_emb_size=16, out_dim=128, patch_budget=1024,
                                media_token_id=MEDIA_TOKEN_ID),
            mx=MXConfig(enabled=False),  # full precision; `k3 train --qat mx` turns MX on
        )
    if name == "release-tiny":  # `small`'s scale with the kernels' shapes: vLLM / SGLang serve what it trains
        return K3Config(
            vocab_size=4096,
            hidden_size=256,
            num_layers=4,
            context_length=8192,
            kda=KDAConfig(num_heads=2, head_dim=128, value_head_dim=128, decay_rank=128, a_log_size=None,
                          chunk_size=64),  # FlashKDA: K = V = 128; the release's decay rank = head_dim
            mla=MLAConfig(num_heads=2, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_shared_head_dim=64, v_head_dim=128),  # fused MLA decode: 512 latent + 64 shared (rope)
            attn_res=AttnResConfig(block_size=2),
            moe=MoEConfig(num_experts=8, num_experts_per_token=2, num_shared_experts=1, expert_hidden=128,
                          shared_hidden=128, latent_dim=128, first_k_dense=1, dense_hidden=512),
            vision=VisionConfig(num_layers=2, hidden_size=64, num_heads=2, head_dim=None, mlp_hidden=256,
                                pos_emb_size=16, out_dim=256, patch_budget=1024,
                                media_token_id=MEDIA_TOKEN_ID),
            mx=MXConfig(enabled=False),  # full precision; `k3 train --qat mx` turns MX on
        )
    raise ValueError(f"unknown preset {name!r}; expected one of {PRESETS}")


PRESETS = ("paper", "tiny", "mini", "small", "release-tiny")
