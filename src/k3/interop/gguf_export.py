"""``k3 export --format gguf``: a kimi-k3 checkpoint as the GGUF file llama.cpp's ``kimi-k3`` architecture reads
(issue 39, item 5).

The file is what llama.cpp's own ``convert_hf_to_gguf.py`` (``conversion/kimi_k3.py``, llama-cpp-python 0.3.36's
vendored copy) writes from our release-layout export with ``--outtype f32``, written here with the ``gguf`` package
(0.19.0) and no llama.cpp checkout:

* the release's text tensors (`k3.model.pretrained.release_tensors`) under llama.cpp's names (`TOP`, `LAYER`), in
  fp32; llama.cpp's folds: each AttnRes ``*_res_norm`` × ``*_res_proj`` pair becomes one ``*_res_score`` vector,
  ``A_log`` becomes ``−exp(A_log)``, the KDA short convolutions take ggml's ``[w, 1, C, 1]`` shape, ``g_proj`` is
  ``ssm_g`` in KDA layers and ``attn_gate`` in MLA layers, and MLA's ``kv_b_proj`` is split into ``attn_k_b``
  (transposed) and ``attn_v_b``;
* routed experts stacked per layer ``[E, out, in]``: packed experts (the release's MXFP4) repacked losslessly into
  ggml's ``block_mxfp4`` (one E8M0 byte, then 16 bytes holding elements j and j + 16 of the block), float experts in
  fp32;
* the hyperparameters under ``kimi-k3.*`` (`_hyperparameters`), from the release ``config.json`` of the model
  (`k3.model.pretrained.release_config`, which refuses what the layout cannot describe);
* our byte-level BPE as a ``gpt2`` vocabulary with the ``gpt-2`` pre-tokenizer — llama.cpp's name for the GPT-2 split
  regex our ``ByteLevel`` pre-tokenizer uses (`k3.tokenization.bpe`) — its merges, the chat special tokens as
  control tokens, ids past the tokenizer up to the model's vocabulary as unused ``[PADi]`` entries, and the chat
  template (`k3.chat.template`). llama.cpp ends a turn at ``<|end|>`` by its text.

Text only: the vision tower is not written (llama.cpp's converter skips it too). Where llama.cpp differs from us
the file cannot say: llama.cpp applies ``rms_norm_eps`` to MLA's latent norms (ours use ``mla.norm_eps``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from k3.chat.template import CHAT_TEMPLATE
from k3.interop.export import exportable
from k3.model.checkpoint import load_model
from k3.model.pretrained import MODEL, TEXT, release_config, release_tensors
from k3.tokenization.bpe import NUM_SPECIAL_TOKENS, Tokenizer

__all__ = ["ARCH", "export_gguf"]

ARCH = "kimi-k3"
#: ggml's type ids (``GGMLQuantizationType``) and file types (``LlamaFileType``) used here.
MXFP4, MXFP4_BLOCK, MXFP4_BYTES = 39, 32, 17
FILE_ALL_F32, FILE_MXFP4_MOE = 0, 38
#: gguf's token types: normal, control (special), unused.
NORMAL, CONTROL, UNUSED = 1, 3, 5
SIGMOID_GATING = 2

#: Release names (after ``language_model.``) → GGUF names, outside the layers.
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
#: Release names inside ``layers.N.`` → ``blk.N.`` names, renamed without other change.
LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # KDA
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight", "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight", "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    # MLA
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    # LatentMoE
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.routed_expert_down_proj.weight": "ffn_routed_down.weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "ffn_routed_up.weight",
    "block_sparse_moe.routed_expert_norm.weight": "ffn_routed_norm.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
#: AttnRes ``<prefix>_norm.weight`` × ``<prefix>_proj.weight`` → one score vector.
RES_SCORES = {"self_attention_res": "attn_res_score.weight", "mlp_res": "ffn_res_score.weight"}
#: Routed expert projections: w1 gate, w2 down, w3 up.
EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}


def export_gguf(ckpt: Path, out: Path, verify: bool = True) -> Path:
    """Write the checkpoint (or run directory's newest checkpoint) ``ckpt`` as the GGUF file ``out`` (module
    docstring), which must not exist."""
    if out.exists() or out.is_symlink():
        raise ValueError(f"--out {out}: already exists (export writes a new file)")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: {out.parent} is not a directory")
    model, tokenizer = load_model(ckpt, verify)
    partial = out.with_name(f".{out.name}.partial")
    try:
        write_gguf(model, tokenizer, partial, name=Path(ckpt).resolve().name)
        partial.rename(out)  # a failed or interrupted export leaves no file under the name asked for
    finally:
        partial.unlink(missing_ok=True)
    return out


def write_gguf(model: Any, tokenizer: Tokenizer, out: Path, name: str) -> None:
    """``model`` (a `K3ForCausalLM`) and ``tokenizer`` as the GGUF file ``out``."""
    import gguf

    exportable(tokenizer)
    text = release_config(model)["text_config"]  # refuses a config the release layout cannot describe
    tensors = gguf_tensors(release_tensors(model, stored=False), text)
    packed = any(raw == MXFP4 for _, raw in tensors.values())
    writer = gguf.GGUFWriter(str(out), ARCH)
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(FILE_MXFP4_MOE if packed else FILE_ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in _hyperparameters(text).items():
        _add(writer, f"{ARCH}.{key}", value)
    _add_vocabulary(writer, tokenizer, text["vocab_size"])
    for tensor_name, (array, raw) in tensors.items():
        writer.add_tensor(tensor_name, array, raw_dtype=gguf.GGMLQuantizationType(raw) if raw is not None else None)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add(writer: Any, key: str, value: Any) -> None:
    """One key-value pair, typed as llama.cpp reads it (bool, uint32, float32, or an int32 array)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_array(key, list(value))


def _hyperparameters(text: dict[str, Any]) -> dict[str, Any]:
    """The ``kimi-k3.*`` keys llama.cpp's ``kimi-k3`` loader reads, from the release ``text_config``."""
    kda, layers = text["linear_attn_config"], text["num_hidden_layers"]
    rank, rope = text["kv_lora_rank"], text["qk_rope_head_dim"]
    out: dict[str, Any] = {
        "block_count": layers, "context_length": text["max_position_embeddings"],
        "embedding_length": text["hidden_size"], "feed_forward_length": text["intermediate_size"],
        "attention.head_count": text["num_attention_heads"],
        # MLA is served as MQA with one latent head; 0 marks a KDA (recurrent) layer. The lists are 1-based.
        "attention.head_count_kv": [1 if i + 1 in kda["full_attn_layers"] else 0 for i in range(layers)],
        "attention.layer_norm_rms_epsilon": float(text["rms_norm_eps"]),
        "expert_count": text["num_experts"], "expert_used_count": text["num_experts_per_token"],
        "expert_group_used_count": text["topk_group"], "expert_gating_func": SIGMOID_GATING,
        "vocab_size": text["vocab_size"],
        "ssm.conv_kernel": kda["short_conv_kernel_size"], "kda.head_dim": kda["head_dim"],
    }
    if kda.get("gate_lower_bound") is not None:
        out["kda.gate_lower_bound"] = float(kda["gate_lower_bound"])
    if text.get("q_lora_rank") is not None:
        out["attention.q_lora_rank"] = text["q_lora_rank"]
    out |= {
        "attention.kv_lora_rank": rank, "rope.dimension_count": rope,
        "attention.key_length": rank + rope, "attention.value_length": rank,
        "attention.key_length_mla": text["qk_nope_head_dim"] + rope, "attention.value_length_mla": text["v_head_dim"],
        "expert_feed_forward_length": text["moe_intermediate_size"],
        "expert_shared_count": text["num_shared_experts"],
        "leading_dense_block_count": text["first_k_dense_replace"],
        "expert_weights_scale": float(text["routed_scaling_factor"]),
        "expert_weights_norm": bool(text["moe_renormalize"]),
    }
    if text.get("routed_expert_hidden_size") is not None:
        out["expert_latent_length"] = text["routed_expert_hidden_size"]
    return out | {"activation.situ_beta": float(text["activation_situ_beta"]),
                  "activation.situ_linear_beta": float(text["activation_situ_linear_beta"]),
                  "attn_res.block_size": text["attn_res_block_size"]}


def _add_vocabulary(writer: Any, tokenizer: Tokenizer, vocab_size: int) -> None:
    """The ``tokenizer.*`` keys (module docstring)."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [UNUSED if i not in by_id else CONTROL if i < NUM_SPECIAL_TOKENS else NORMAL for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in tokenizer.merges()])
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_chat_template(CHAT_TEMPLATE)


def gguf_tensors(release: dict[str, Tensor], text: dict[str, Any]) -> dict[str, tuple[np.ndarray, int | None]]:
    """The GGUF tensors (numpy in the order llama.cpp's shapes read, and the raw ggml type where it is not implied by
    the dtype) of the release-named ``release`` (module docstring)."""
    out: dict[str, tuple[np.ndarray, int | None]] = {}
    for name, gguf_name in TOP.items():
        if TEXT + name in release:
            out[gguf_name] = plain(release[TEXT + name])
    if TEXT + "lm_head.weight" not in release:  # tied: llama.cpp's kimi-k3 requires the output matrix
        out["output.weight"] = plain(release[MODEL + "embed_tokens.weight"])
    if MODEL + "output_attn_res_proj.weight" in release:
        out["output_res_score.weight"] = plain(_score(release, MODEL + "output_attn_res"))
    for i in range(text["num_hidden_layers"]):
        out |= {f"blk.{i}.{k}": v for k, v in _layer(release, f"{MODEL}layers.{i}.", i + 1, text).items()}
    return out


def _layer(release: dict[str, Tensor], prefix: str, number: int, text: dict[str, Any]) -> dict[str, tuple]:
    """Layer ``number`` (1-based)'s GGUF tensors, named inside ``blk.N.``."""
    out = {gguf_name: plain(release[prefix + name]) for name, gguf_name in LAYER.items() if prefix + name in release}
    for res, gguf_name in RES_SCORES.items():
        if prefix + f"{res}_proj.weight" in release:
            out[gguf_name] = plain(_score(release, prefix + res))
    attn = prefix + "self_attn."
    if attn + "A_log" in release:
        out["ssm_a"] = plain(-torch.exp(release[attn + "A_log"].float()[: text["num_attention_heads"]]))
    for b in "qkv":
        if attn + f"{b}_conv1d.weight" in release:
            conv = release[attn + f"{b}_conv1d.weight"]
            out[f"ssm_conv1d_{b}.weight"] = plain(conv.reshape(1, conv.shape[0], 1, conv.shape[-1]))
    if attn + "g_proj.weight" in release:
        kda = number not in text["linear_attn_config"]["full_attn_layers"]
        out["ssm_g.weight" if kda else "attn_gate.weight"] = plain(release[attn + "g_proj.weight"])
    if attn + "kv_b_proj.weight" in release:
        nope, value = text["qk_nope_head_dim"], text["v_head_dim"]
        kv_b = release[attn + "kv_b_proj.weight"]
        k_b, v_b = kv_b.reshape(text["num_attention_heads"], nope + value, kv_b.shape[-1]).split([nope, value], dim=1)
        out["attn_k_b.weight"], out["attn_v_b.weight"] = plain(k_b.transpose(1, 2)), plain(v_b)
    return out | _experts(release, prefix + "block_sparse_moe.experts.", text["num_experts"])


def _experts(release: dict[str, Tensor], prefix: str, count: int) -> dict[str, tuple]:
    """One stacked tensor per projection: ggml MXFP4 blocks from packed experts, fp32 from float ones."""
    out = {}
    for w, gguf_name in EXPERTS.items():
        if f"{prefix}0.{w}.weight_packed" in release:
            blocks = [mxfp4_blocks(release[f"{prefix}{e}.{w}.weight_packed"], release[f"{prefix}{e}.{w}.weight_scale"])
                      for e in range(count)]
            out[gguf_name] = (np.stack(blocks), MXFP4)
        elif f"{prefix}0.{w}.weight" in release:
            stacked = torch.stack([release[f"{prefix}{e}.{w}.weight"] for e in range(count)])
            out[gguf_name] = plain(stacked)
    return out


def plain(t: Tensor) -> tuple[np.ndarray, None]:
    """A GGUF fp32 tensor (its ggml type implied by the dtype)."""
    return t.detach().to(torch.float32).contiguous().numpy(), None


def _score(release: dict[str, Tensor], prefix: str) -> Tensor:
    """An AttnRes score vector: the key gain (``_norm``) times the query (``_proj``), as llama.cpp folds them."""
    return release[prefix + "_norm.weight"].float().flatten() * release[prefix + "_proj.weight"].float().flatten()


def mxfp4_blocks(packed: Tensor, scale: Tensor) -> np.ndarray:
    """ggml ``block_mxfp4`` bytes ``[rows, blocks · 17]`` of release MXFP4 ``packed`` ``[rows, cols / 2]`` (element
    2i in the low nibble, 2i + 1 in the high) and ``scale`` ``[rows, cols / 32]`` (E8M0). Each block is its scale
    byte, then 16 bytes whose low nibble is element j and high nibble element j + 16; the codes are the same E2M1
    indices (ggml doubles its value table and halves the scale)."""
    rows, half = packed.shape
    blocks = 2 * half // MXFP4_BLOCK
    if tuple(scale.shape) != (rows, blocks):
        raise ValueError(f"MXFP4 scales {tuple(scale.shape)} do not match {rows} rows of {blocks} blocks")
    bytes_ = packed.to(torch.uint8).reshape(rows, blocks, MXFP4_BLOCK // 2)
    codes = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=-1).reshape(rows, blocks, MXFP4_BLOCK)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat([scale.to(torch.uint8).reshape(rows, blocks, 1), nibbles], dim=-1)
    return out.reshape(rows, blocks * MXFP4_BYTES).numpy()
