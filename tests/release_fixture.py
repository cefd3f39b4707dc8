"""A reduced Kimi K3 release directory, written from the published key list (SPEC §10) — not by kimi-k3's code.

Tiny widths, the release's key names and dtypes (bf16, fp32 for the KDA convolutions / A_log / dt_bias /
o_norm and the router bias, uint8 packed MXFP4 routed experts), a dense layer 0, KDA and MLA layers, three
AttnRes blocks, the vision tensors, a config.json in the released field names and two shards with an index.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, LAYERS, HEADS, HEAD_DIM = 64, 6, 2, 32
MLA_LAYERS = [4, 6]  # 1-based
EXPERTS, TOP_K, LATENT, EXPERT_HIDDEN, DENSE = 4, 2, 64, 64, 96
Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 32, 32, 16, 8, 16
A_LOG_STORED = 32  # stored longer than the number of heads, as the release's [128] for 96 heads
VISION = {"vt_hidden_size": 32, "qkv_hidden_size": 48, "vt_num_attention_heads": 2, "vt_intermediate_size": 64,
          "vt_num_hidden_layers": 2, "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
          "init_pos_emb_time": 4, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 32,
          "pos_emb_type": "divided_fixed", "norm_type": "rmsnorm", "text_hidden_size": HIDDEN}


def release_config(vocab_size: int) -> dict:
    mla = set(MLA_LAYERS)
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "intermediate_size": DENSE, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "initializer_range": 0.02, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 2, "q_lora_rank": Q_RANK,
        "kv_lora_rank": KV_RANK, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_DIM,
        "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": EXPERTS, "num_experts_per_token": TOP_K,
        "num_shared_experts": 2, "moe_intermediate_size": EXPERT_HIDDEN, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "routed_expert_hidden_size": LATENT,
        "latent_moe_use_norm": True, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "linear_attn_config": {"num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "kda_layers": [i for i in range(1, LAYERS + 1) if i not in mla],
                               "full_attn_layers": MLA_LAYERS},
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "weights": {
                "group_size": 32, "num_bits": 4, "type": "float", "scale_dtype": "torch.uint8"}}}},
        "bos_token_id": vocab_size - 256, "eos_token_id": vocab_size - 254, "pad_token_id": vocab_size - 1,
    }
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
            "bos_token_id": vocab_size - 256, "eos_token_id": vocab_size - 254, "pad_token_id": vocab_size - 1,
            "media_placeholder_token_id": vocab_size - 256 + 21, "tie_word_embeddings": False,
            "text_config": text, "vision_config": VISION}


def release_tensors(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bf16 = lambda *shape, std=0.08: (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)  # noqa: E731
    fp32 = lambda *shape, std=0.3: torch.randn(*shape, generator=g) * std  # noqa: E731
    gain = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)  # noqa: E731
    t: dict[str, torch.Tensor] = {}
    m = "language_model.model."
    t[m + "embed_tokens.weight"] = bf16(vocab_size, HIDDEN, std=1.0)
    t["language_model.lm_head.weight"] = bf16(vocab_size, HIDDEN)
    t[m + "norm.weight"] = gain(HIDDEN)
    t[m + "output_attn_res_norm.weight"] = gain(HIDDEN)
    t[m + "output_attn_res_proj.weight"] = bf16(1, HIDDEN, std=0.3)
    P = HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"{m}layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + name + ".weight"] = gain(HIDDEN)
        t[p + "self_attention_res_proj.weight"] = bf16(1, HIDDEN, std=0.3)
        t[p + "mlp_res_proj.weight"] = bf16(1, HIDDEN, std=0.3)
        a = p + "self_attn."
        if i + 1 in MLA_LAYERS:
            t[a + "q_a_proj.weight"] = bf16(Q_RANK, HIDDEN)
            t[a + "q_a_layernorm.weight"] = gain(Q_RANK)
            t[a + "q_b_proj.weight"] = bf16(HEADS * (NOPE + ROPE), Q_RANK, std=0.3)
            t[a + "kv_a_proj_with_mqa.weight"] = bf16(KV_RANK + ROPE, HIDDEN, std=0.3)
            t[a + "kv_a_layernorm.weight"] = gain(KV_RANK)
            t[a + "kv_b_proj.weight"] = bf16(HEADS * (NOPE + V_DIM), KV_RANK, std=0.3)
            t[a + "g_proj.weight"] = bf16(HEADS * V_DIM, HIDDEN)
            t[a + "o_proj.weight"] = bf16(HIDDEN, HEADS * V_DIM)
        else:
            for b in "qkv":
                t[a + f"{b}_proj.weight"] = bf16(P, HIDDEN, std=0.15)
                t[a + f"{b}_conv1d.weight"] = fp32(P, 1, 4, std=0.5)
            t[a + "f_a_proj.weight"] = bf16(HEAD_DIM, HIDDEN)
            t[a + "f_b_proj.weight"] = bf16(P, HEAD_DIM, std=0.3)
            t[a + "A_log"] = torch.empty(A_LOG_STORED).uniform_(-1.0, 1.0, generator=g)
            t[a + "dt_bias"] = fp32(P, std=1.0)
            t[a + "b_proj.weight"] = bf16(HEADS, HIDDEN, std=0.3)
            t[a + "g_proj.weight"] = bf16(P, HIDDEN)
            t[a + "o_norm.weight"] = 1 + 0.1 * torch.randn(HEAD_DIM, generator=g)
            t[a + "o_proj.weight"] = bf16(HIDDEN, P)
        if i == 0:
            for name, shape in (("gate_proj", (DENSE, HIDDEN)), ("up_proj", (DENSE, HIDDEN)),
                                ("down_proj", (HIDDEN, DENSE))):
                t[f"{p}mlp.{name}.weight"] = bf16(*shape)
            continue
        b = p + "block_sparse_moe."
        t[b + "gate.weight"] = bf16(EXPERTS, HIDDEN, std=0.3)
        t[b + "gate.e_score_correction_bias"] = 0.05 * torch.randn(EXPERTS, generator=g)
        t[b + "routed_expert_down_proj.weight"] = bf16(LATENT, HIDDEN, std=0.15)
        t[b + "routed_expert_norm.weight"] = gain(LATENT)
        t[b + "routed_expert_up_proj.weight"] = bf16(HIDDEN, LATENT)
        for name, shape in (("gate_proj", (2 * EXPERT_HIDDEN, HIDDEN)), ("up_proj", (2 * EXPERT_HIDDEN, HIDDEN)),
                            ("down_proj", (HIDDEN, 2 * EXPERT_HIDDEN))):
            t[f"{b}shared_experts.{name}.weight"] = bf16(*shape)
        for e in range(EXPERTS):
            for w, (rows, cols) in (("w1", (EXPERT_HIDDEN, LATENT)), ("w3", (EXPERT_HIDDEN, LATENT)),
                                    ("w2", (LATENT, EXPERT_HIDDEN))):
                t[f"{b}experts.{e}.{w}.weight_packed"] = torch.randint(0, 256, (rows, cols // 2), generator=g,
                                                                       dtype=torch.uint8)
                t[f"{b}experts.{e}.{w}.weight_scale"] = torch.randint(120, 125, (rows, cols // 32), generator=g,
                                                                      dtype=torch.uint8)
    v = VISION
    h, qkv = v["vt_hidden_size"], v["qkv_hidden_size"]
    t["vision_tower.patch_embed.proj.weight"] = bf16(h, 3, 14, 14)
    t["vision_tower.patch_embed.pos_emb.weight"] = bf16(4, 4, h)
    for k in range(v["vt_num_hidden_layers"]):
        q = f"vision_tower.encoder.blocks.{k}."
        t[q + "wqkv.weight"], t[q + "wo.weight"] = bf16(3 * qkv, h), bf16(h, qkv)
        t[q + "norm0.weight"], t[q + "norm1.weight"] = gain(h), gain(h)
        t[q + "mlp.fc0.weight"], t[q + "mlp.fc1.weight"] = bf16(v["vt_intermediate_size"], h), bf16(
            h, v["vt_intermediate_size"])
    t["vision_tower.encoder.final_layernorm.weight"] = gain(h)
    t["mm_projector.proj.0.weight"], t["mm_projector.proj.2.weight"] = bf16(4 * h, 4 * h), bf16(HIDDEN, 4 * h)
    t["mm_projector.post_norm.weight"] = gain(HIDDEN)
    return t


def write_release(directory: Path, vocab_size: int = 512, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the reduced release into ``directory`` (two shards + index + config.json); returns its tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = release_tensors(vocab_size, seed)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), 1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(release_config(vocab_size), indent=2))
    return tensors
