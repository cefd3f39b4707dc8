"""Shared pieces of the serving tests: a tokenizer trained on real text and small random-init K3 models."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from k3 import K3ForCausalLM
from k3.config import preset
from k3.tokenization.bpe import Tokenizer

VOCAB = 512


@cache
def tokenizer() -> Tokenizer:
    """Byte-level BPE trained on the standard library's ``json`` package (about 50 KB, well under a second)."""
    texts = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    return Tokenizer.train(texts, VOCAB)


def model(seed: int = 0) -> K3ForCausalLM:
    """The ``tiny`` preset (KDA and MLA layers, AttnRes, MoE) with random weights, in eval mode."""
    torch.manual_seed(seed)
    m = K3ForCausalLM(preset("tiny"))
    with torch.no_grad():  # sharper logits than the init so greedy choices are well separated
        m.lm_head.weight.mul_(8.0)
    return m.eval()


def prompts() -> list[list[int]]:
    """Prompts of assorted lengths (1 to ~120 tokens) cut from real text."""
    tok = tokenizer()
    text = (Path(json.__file__).parent / "decoder.py").read_text()
    lengths = [1, 5, 17, 33, 64, 120, 9, 48]
    return [tok.encode(text[i * 300:])[:n] for i, n in enumerate(lengths)]


class Scripted(K3ForCausalLM):
    """A real tiny K3 whose logits are overridden to emit ``script`` after a prompt of ``start`` tokens.

    Used where the API's handling of specific generated text (tool calls, a failure mid-stream) is tested;
    the request still runs through the real engine, state and batching. ``fail_after`` generated tokens,
    the forward raises.
    """

    def __init__(self, start: int, script: list[int], fail_after: int | None = None) -> None:
        torch.manual_seed(0)
        super().__init__(preset("tiny"))
        self.start, self.script, self.fail_after = start, script, fail_after
        self.eval()

    def forward_groups(self, groups, full=None, replay=None):
        results = super().forward_groups(groups, full, replay)
        for (ids, state), (logits, _) in zip(groups, results):
            generated = state.position + ids.shape[1] - self.start  # tokens generated after this call
            if self.fail_after is not None and generated > self.fail_after:
                raise RuntimeError("scripted failure")
            if 0 <= generated < len(self.script):
                logits[:, self.script[generated]] += 1e4
        return results


CYCLE = [101, 57, 300, 12, 404, 77, 250]


class Cycling(K3ForCausalLM):
    """A real ``tiny`` K3 whose logits favour, at every position, the token after the one it read in ``CYCLE`` (the
    cycle's first token after any other): its answer repeats the cycle, as an edit repeats its input. The bias
    depends on the input token only, so it is the same in decode rows, prefill chunks and verification runs."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(preset("tiny"))
        self.eval()
        self.successor = torch.full((self.config.vocab_size,), CYCLE[0])
        self.successor[CYCLE] = torch.tensor(CYCLE[1:] + CYCLE[:1])

    def forward_groups(self, groups, full=None, replay=None):
        results = super().forward_groups(groups, full, replay)
        for (ids, _), (logits, _), every in zip(groups, results, full or [False] * len(groups)):
            read = ids.reshape(-1) if every else ids[:, -1]
            logits[torch.arange(len(read)), self.successor[read]] += 1e4
        return results


def recording(drafter_class: type) -> type:
    """``drafter_class`` keeping every proposal it makes in ``.proposals``."""

    class Recording(drafter_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.proposals: list = []

        def propose(self, *args, **kwargs):
            draft = super().propose(*args, **kwargs)
            self.proposals.append(draft)
            return draft

    return Recording
