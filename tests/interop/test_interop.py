"""k3.interop.kimi_linear: transformers' Kimi Linear, converted, computes the same function on the K3 backbone."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from k3.interop.kimi_linear import config_from_hf, from_transformers, load_kimi_linear
from peers import transformers_kimi_linear


@pytest.fixture(scope="module")
def hf_model():
    tf = transformers_kimi_linear()
    config = tf.KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=2.446, linear_num_heads=2, linear_head_dim=16, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = tf.KimiLinearForCausalLM(config).eval()
    with torch.no_grad():  # exercise every weight: non-trivial norms, biased routing, varied decays
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return model


def test_config_expresses_kimi_linear(hf_model):
    c = config_from_hf(hf_model.config.to_dict())
    expected = ["mla" if t == "full_attention" else "kda" for t in hf_model.config.layer_types]
    assert c.layer_kinds() == expected and "mla" in expected and "kda" in expected
    assert c.ffn_kinds()[0] == "dense" and c.ffn_kinds()[1] == "moe"
    assert not c.attn_res.enabled and c.kda.gate == "softplus" and c.moe.activation == "swiglu"


def test_converted_model_gives_the_same_logits_and_greedy_continuation(hf_model):
    ours = from_transformers(hf_model)
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
        logits, _ = ours(ids)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    prompt = ids[:1, :11]
    with torch.no_grad():
        hf_tokens = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 11:]
        state = ours.new_state(1)
        step_logits, state = ours(prompt, state=state)
        tokens = []
        for _ in range(12):
            nxt = step_logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            step_logits, state = ours(nxt, state=state)
    assert tokens == hf_tokens.tolist()


def test_load_kimi_linear_from_save_pretrained(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    ours = load_kimi_linear(tmp_path)
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], hf_model(ids).logits, atol=1e-4, rtol=1e-4)


def _original_layout(hf_model) -> dict[str, torch.Tensor]:
    """The released checkpoints' names: q/k/v_conv1d, f_a_proj at self_attn, block_sparse_moe.experts.N.w1/2/3."""
    out = {}
    for name, t in hf_model.state_dict().items():
        t = t.clone()
        name = name.replace("self_attn.forget_gate.", "self_attn.")
        if name.endswith("self_attn.conv1d.weight"):
            for part, chunk in zip("qkv", t.chunk(3, 0)):
                out[name.replace("conv1d", f"{part}_conv1d")] = chunk.contiguous()
            continue
        if ".mlp.gate." in name or ".mlp.experts." in name or ".mlp.shared_experts." in name:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if m := re.match(r"(.*\.experts)\.gate_up_proj$", name):
            for e, w in enumerate(t):
                w1, w3 = w.chunk(2, 0)
                out[f"{m[1]}.{e}.w1.weight"], out[f"{m[1]}.{e}.w3.weight"] = w1.contiguous(), w3.contiguous()
            continue
        if m := re.match(r"(.*\.experts)\.down_proj$", name):
            for e, w in enumerate(t):
                out[f"{m[1]}.{e}.w2.weight"] = w.contiguous()
            continue
        out[name] = t
    return out


def test_load_kimi_linear_from_the_original_checkpoint_layout(hf_model, tmp_path):
    state = _original_layout(hf_model)
    assert any("q_conv1d" in n for n in state) and any(".experts.3.w2." in n for n in state)
    half = sorted(state)[: len(state) // 2]
    save_file({n: state[n] for n in half}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in state if n not in half}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: "model-00001-of-00002.safetensors" if n in half else "model-00002-of-00002.safetensors" for n in state}}))
    hf = hf_model.config.to_dict()
    kinds = hf.pop("layer_types")
    hf["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(kinds) if t == "full_attention"],  # 1-based
        "kda_layers": [i + 1 for i, t in enumerate(kinds) if t != "full_attention"],
        "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    ours = load_kimi_linear(tmp_path)
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], hf_model(ids).logits, atol=1e-4, rtol=1e-4)


def test_bad_checkpoints_are_errors_naming_the_file(hf_model, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_kimi_linear(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_kimi_linear(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_kimi_linear(tmp_path)
    state = {n: t.contiguous() for n, t in hf_model.state_dict().items() if "lm_head" not in n}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_kimi_linear(tmp_path)


def test_grouped_routing_is_rejected(hf_model):
    hf = hf_model.config.to_dict() | {"num_expert_group": 4}
    with pytest.raises(ValueError, match="grouped routing"):
        config_from_hf(hf)
