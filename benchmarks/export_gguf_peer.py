"""llama.cpp's side of `benchmarks/export_gguf.py`, run in its own process (no torch here: ggml's OpenMP runtime is the
only one, and a crash of the peer loses one file's rows).

    python benchmarks/export_gguf_peer.py MODEL.gguf REQUEST.json    # prints one JSON line

REQUEST holds ``prompts`` (lists of ids), ``steps`` and ``texts``. The answer holds, per prompt, llama.cpp's greedy
continuation of ``steps`` ids and its next-token logits after the prompt; per text, the ids llama.cpp's tokenizer
gives it (special tokens parsed, nothing added) and the text it decodes those ids back to.
"""

from __future__ import annotations

import ctypes
import json
import sys


def run(gguf: str, prompts: list[list[int]], steps: int, texts: list[str]) -> dict:
    import llama_cpp as ll
    import numpy as np

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(gguf.encode(), ll.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    vocab = ll.llama_model_get_vocab(model)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    longest = max(len(p) for p in prompts) + steps + 1
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_seq_max = longest, longest, 1
    params.n_threads = params.n_threads_batch = 2
    ctx = ll.llama_init_from_model(model, params)
    native = ll.llama_batch_init(longest, 0, 1)

    def decode(ids: list[int], start: int) -> np.ndarray:
        for k, token in enumerate(ids):
            native.token[k], native.pos[k], native.n_seq_id[k] = token, start + k, 1
            native.seq_id[k][0], native.logits[k] = 0, k == len(ids) - 1
        native.n_tokens = len(ids)
        if ll.llama_decode(ctx, native) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, len(ids) - 1), shape=(n_vocab,)).copy()

    continuations, first_logits = [], []
    for ids in prompts:
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        logits = decode(ids, 0)
        first_logits.append(logits.tolist())
        out = [int(logits.argmax())]
        while len(out) < steps:
            out.append(int(decode([out[-1]], len(ids) + len(out) - 1).argmax()))
        continuations.append(out)
    return {"greedy": continuations, "prompt_logits": first_logits,
            "tokenized": [tokenize(ll, vocab, t) for t in texts]}


def tokenize(ll, vocab, text: str) -> dict:  # noqa: ANN001 - llama_cpp's module and vocabulary handle
    """llama.cpp's ids for ``text`` (special tokens parsed, no BOS added) and its text decoded back from them."""
    data = text.encode("utf-8")
    room = len(data) + 8
    ids = (ll.llama_token * room)()
    n = ll.llama_tokenize(vocab, data, len(data), ids, room, False, True)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} slots")
    out = bytearray()
    piece = ctypes.create_string_buffer(256)
    for token in ids[:n]:
        size = ll.llama_token_to_piece(vocab, token, piece, len(piece), 0, True)
        out += piece.raw[:size]
    return {"ids": list(ids[:n]), "text": out.decode("utf-8", errors="replace")}


if __name__ == "__main__":
    request = json.loads(open(sys.argv[2], encoding="utf-8").read())
    print(json.dumps(run(sys.argv[1], request["prompts"], request["steps"], request["texts"])))
