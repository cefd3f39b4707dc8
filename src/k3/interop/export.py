"""``k3 export``: a kimi-k3 checkpoint as a directory other tools load (issue 39, item 4).

The directory is the released Kimi K3 layout (`k3.model.pretrained.save_pretrained`: ``config.json``, safetensors
shards and index, routed experts packed as MXFP4, weights in the release's dtypes) plus a Hugging Face tokenizer:
our byte-level BPE's ``tokenizer.json`` (the `tokenizers` library's own file), ``tokenizer_config.json`` naming the
special tokens and holding the chat template (`k3.chat.template`), and ``generation_config.json`` (the ids that end a
turn). transformers' ``AutoTokenizer`` and mlx-lm load it as it is; ``k3 generate / serve --ckpt DIR`` load it back.
The export is lossy where the release layout is: float experts are quantized to MXFP4, the other weights stored in
bf16 (fp32 where the release keeps fp32); configurations the layout cannot describe are refused before writing.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3.chat.template import CHAT_TEMPLATE
from k3.files import write_text
from k3.model.checkpoint import load_model
from k3.tokenization.bpe import SPECIAL_TOKENS, Tokenizer

__all__ = ["export", "exportable", "write_tokenizer"]

TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


def exportable(tokenizer: object) -> None:
    """Refuse (`ValueError`) ``tokenizer`` unless it is kimi-k3's byte-level BPE, the one tokenizer exported."""
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"export: only kimi-k3's byte-level BPE tokenizer is exported, got {type(tokenizer).__name__}")


def write_tokenizer(tokenizer: Tokenizer, directory: Path, context_length: int) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` for ``tokenizer``."""
    exportable(tokenizer)
    names = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{role}_token": token for role, token in names.items()},
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in names.values()],
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    end_ids = [tokenizer.special_id("end"), tokenizer.eos_id]  # `k3.chat.native.stop_ids`
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": end_ids, "pad_token_id": tokenizer.pad_id}
    paths = [tokenizer.save(directory), directory / TOKENIZER_CONFIG, directory / GENERATION_CONFIG]
    write_text(paths[1], json.dumps(config, indent=2, ensure_ascii=False))
    write_text(paths[2], json.dumps(generation, indent=2))
    return paths


def export(ckpt: Path, out: Path, verify: bool = True) -> list[Path]:
    """Write the checkpoint (or run directory's newest checkpoint) ``ckpt`` to ``out`` (module docstring); returns
    the files written. ``out`` must not exist (nothing is overwritten)."""
    if out.exists():
        raise ValueError(f"--out {out}: already exists (export writes a new directory)")
    model, tokenizer = load_model(ckpt, verify)
    written = model.save_pretrained(out)  # refuses a config the release layout cannot describe, before writing
    return written + [out / "config.json"] + write_tokenizer(tokenizer, out, model.config.context_length)
