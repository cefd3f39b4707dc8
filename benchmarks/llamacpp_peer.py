"""One llama.cpp decode case for `benchmarks/llamacpp.py`, run in its own process: no torch here, so ggml's
OpenMP runtime is the only one, and a crash of the peer loses one row.

    python benchmarks/llamacpp_peer.py MODEL.gguf BATCH THREADS SEED    # prints one JSON line
"""

from __future__ import annotations

import json
import random
import sys

from timing import timed_decode

PROMPT = 32
AGREE_TOKENS = 16


def prompt(vocab: int, batch: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of `PROMPT` ids below ``vocab``, the same for a seed on both sides of the benchmark."""
    draw = random.Random(seed)
    return [[draw.randrange(vocab) for _ in range(PROMPT)] for _ in range(batch)]


def run(gguf: str, batch: int, threads: int, seed: int, steps: int = 32, blocks: int = 5) -> dict:
    """Decode tokens/s at ``batch`` (greedy: each step feeds every sequence its last argmax; the median over
    ``blocks`` runs of ``steps`` steps after one warm-up step), the prompt's next-token logits of sequence 0 and its
    first `AGREE_TOKENS` greedy tokens."""
    import llama_cpp as ll
    import numpy as np

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(gguf.encode(), ll.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    params = ll.llama_context_default_params()
    params.n_ctx = batch * (PROMPT + 2 + steps * blocks)
    params.n_batch, params.n_seq_max = PROMPT * batch, batch
    params.n_threads = params.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model, params)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    native = ll.llama_batch_init(PROMPT * batch, 0, 1)
    position = [0] * batch

    def decode(rows: list[list[int]]) -> np.ndarray:
        """Append ``rows[s]`` to sequence s; the logits of each sequence's last position, ``[batch, vocab]``."""
        n, last = 0, []
        for s, ids in enumerate(rows):
            for k, token in enumerate(ids):
                native.token[n], native.pos[n], native.n_seq_id[n] = token, position[s] + k, 1
                native.seq_id[n][0], native.logits[n] = s, k == len(ids) - 1
                n += 1
            position[s] += len(ids)
            last.append(n - 1)
        native.n_tokens = n
        if ll.llama_decode(ctx, native) != 0:
            raise RuntimeError("llama_decode failed")
        return np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy()
                         for i in last])

    logits = decode(prompt(vocab, batch, seed))
    first = logits[0].tolist()
    held = [logits.argmax(-1)]
    greedy = [int(held[0][0])]

    def step() -> None:
        held[0] = decode([[int(t)] for t in held[0]]).argmax(-1)
        greedy.append(int(held[0][0]))

    step()
    tokens_per_s = timed_decode(step, batch, steps, blocks)
    ll.llama_batch_free(native)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return {"tokens_per_s": tokens_per_s, "prompt_logits": first,
            "greedy": greedy[:AGREE_TOKENS]}


if __name__ == "__main__":
    path, batch, threads, seed = sys.argv[1:5]
    print(json.dumps(run(path, int(batch), int(threads), int(seed))))
