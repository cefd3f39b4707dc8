"""The Kimi Linear paper's synthetic tasks — Palindrome, MQAR, Stack — and a small trainer (issue 38, item 2).

They check that a sequence mixer is *trainable* to what the paper says KDA learns, not only numerically exact. Each
task gives, from a seed, token sequences ``[B, L]`` and a mask of the positions whose next token is an answer; the
model is trained with next-token cross-entropy on those positions only and scored by the fraction of answer tokens it
predicts exactly (greedy), on held-out seeded batches. Ids ``0 .. 3`` are markers, the rest symbols (vocabulary 128,
as the paper's setting):

* **Palindrome**: ``n`` random symbols, a separator, then the same symbols reversed (the answers). Needs the whole
  first half kept in the state: a retention problem.
* **MQAR** (multi-query associative recall, Zoology): up to 32 key–value pairs (keys distinct, from the lower half of
  the symbols; values from the upper half), a separator, then to the end of the sequence queries — a stored key at
  random followed by its value (the answers). Needs content-addressed recall among the stored pairs.
* **Stack**: random ``PUSH s x`` and ``POP s`` operations on 4 stacks (a pop one time in three, never of an empty
  stack), each ``POP s`` followed by the value it removes (the answer). Needs last-in-first-out tracking of several
  interleaved, growing states.

`model_config` builds the reproduction's shape (2 layers, width 256, 2 heads × 128, vocabulary 128; a plain residual
stream and a dense FFN, so the sequence mixer is what differs) for a mixer: ``kda`` (per-channel decay), ``gdn`` (one
decay per head: `KDAConfig.decay = "head"`), or ``mla`` (Gated MLA, no positional encoding), with the bounded or the
softplus gate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.config import AttnResConfig, K3Config, preset
from k3.model.lm import K3ForCausalLM

PAD, SEP, PUSH, POP = 0, 1, 2, 3
MARKERS = 4
VOCAB = 128
MIXERS = ("kda", "gdn", "mla")
#: MQAR's stored pairs (at most: fewer when the sequence is shorter than 4 per pair); keys are distinct, from the
#: lower half of the symbols (62 with vocabulary 128).
MQAR_PAIRS = 32
#: Stack's independent stacks (their ids are the first symbols).
STACKS = 4
#: A pop's probability (when a stack holds something): below 1/2, so the stacks grow with the sequence and a pop
#: often reaches a value pushed long before (at 1/2 most pops remove the value pushed just before).
POP_PROBABILITY = 1 / 3


def palindrome(batch: int, length: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n = (length − 1) // 2`` symbols, ``SEP``, the symbols reversed (padded with ``PAD`` to ``length``)."""
    n = (length - 1) // 2
    first = torch.randint(MARKERS, VOCAB, (batch, n), generator=generator)
    tokens = torch.full((batch, length), PAD, dtype=torch.int64)
    tokens[:, :n], tokens[:, n] = first, SEP
    tokens[:, n + 1:2 * n + 1] = first.flip(1)
    answer = torch.zeros(batch, length, dtype=torch.bool)
    answer[:, n + 1:2 * n + 1] = True
    return tokens, answer


def mqar(batch: int, length: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n = min(MQAR_PAIRS, (length − 1) // 4)`` key–value pairs, ``SEP``, then to the end queries: a stored key drawn
    at random followed by its value."""
    n = min(MQAR_PAIRS, (length - 1) // 4)
    half = MARKERS + (VOCAB - MARKERS) // 2
    keys = torch.stack([torch.randperm(half - MARKERS, generator=generator)[:n] for _ in range(batch)]) + MARKERS
    values = torch.randint(half, VOCAB, (batch, n), generator=generator)
    start = 2 * n + 1
    queries = (length - start) // 2
    asked = torch.randint(0, n, (batch, queries), generator=generator)
    tokens = torch.full((batch, length), PAD, dtype=torch.int64)
    tokens[:, 0:2 * n:2], tokens[:, 1:2 * n:2], tokens[:, 2 * n] = keys, values, SEP
    end = start + 2 * queries
    tokens[:, start:end:2], tokens[:, start + 1:end:2] = keys.gather(1, asked), values.gather(1, asked)
    answer = torch.zeros(batch, length, dtype=torch.bool)
    answer[:, start + 1:end:2] = True
    return tokens, answer


def stack(batch: int, length: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Operations on `STACKS` stacks, three tokens each, until ``length`` is filled (``PAD`` after): ``PUSH s x``, or
    with probability `POP_PROBABILITY` when a stack holds something ``POP s y`` on a random non-empty stack ``s``,
    where ``y`` (the answer) is the value that pop removes. Stack ids are the first `STACKS` symbols, values the
    rest."""
    tokens = torch.full((batch, length), PAD, dtype=torch.int64)
    answer = torch.zeros(batch, length, dtype=torch.bool)
    ops = length // 3
    draws = torch.rand(batch, ops, 2, generator=generator).tolist()
    values = torch.randint(MARKERS + STACKS, VOCAB, (batch, ops), generator=generator).tolist()
    for b in range(batch):
        held: list[list[int]] = [[] for _ in range(STACKS)]
        for i in range(ops):
            full = [s for s in range(STACKS) if held[s]]
            t = 3 * i
            if full and draws[b][i][0] < POP_PROBABILITY:
                s = full[int(draws[b][i][1] * len(full))]
                tokens[b, t:t + 3] = torch.tensor([POP, MARKERS + s, held[s].pop()])
                answer[b, t + 2] = True
            else:
                s = int(draws[b][i][1] * STACKS)
                held[s].append(values[b][i])
                tokens[b, t:t + 3] = torch.tensor([PUSH, MARKERS + s, values[b][i]])
    return tokens, answer


TASKS: dict[str, Callable[[int, int, torch.Generator], tuple[Tensor, Tensor]]] = {
    "palindrome": palindrome, "mqar": mqar, "stack": stack}


def model_config(mixer: str, gate: str = "bounded", width: int = 256, layers: int = 2, heads: int = 2,
                 head_dim: int = 128, context: int = 2048) -> K3Config:
    """The reproduction's shape for one sequence mixer (module docstring)."""
    if mixer not in MIXERS:
        raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
    c = preset("tiny")
    c.vocab_size, c.hidden_size, c.num_layers, c.context_length = VOCAB, width, layers, context
    c.mla_layers = list(range(1, layers + 1)) if mixer == "mla" else []
    c.kda = dataclasses.replace(c.kda, num_heads=heads, head_dim=head_dim, value_head_dim=head_dim,
                                decay_rank=head_dim, gate=gate, decay="head" if mixer == "gdn" else "channel")
    c.mla = dataclasses.replace(c.mla, num_heads=heads, q_lora_rank=None, kv_lora_rank=width,
                                qk_nope_head_dim=head_dim, qk_shared_head_dim=head_dim // 2, v_head_dim=head_dim)
    c.attn_res = AttnResConfig(enabled=False)
    c.moe = dataclasses.replace(c.moe, first_k_dense=layers, dense_hidden=2 * width)
    c.vision = dataclasses.replace(c.vision, enabled=False)
    return c.validate()


@dataclass
class SyntheticRun:
    """Train ``model`` on ``task`` at ``length`` tokens (AdamW, warmup then cosine decay) and score it.

    A batch of more than ``micro_tokens`` tokens is differentiated in pieces of rows (gradient accumulation, each
    piece's loss summed over its answers and divided by the whole batch's count): the same gradient, with activations
    that stay cache-sized (at width 256 and 1,024 tokens a step took 7.1 s whole against 5.2 s in 4 pieces)."""

    task: str
    length: int
    model: K3ForCausalLM
    batch: int = 32
    lr: float = 1e-3
    seed: int = 0
    micro_tokens: int = 8192

    def loss(self, tokens: Tensor, answer: Tensor) -> Tensor:
        """Cross-entropy of each answer token, predicted from the position before it, summed."""
        logits, _ = self.model(tokens[:, :-1])
        return F.cross_entropy(logits[answer[:, 1:]], tokens[:, 1:][answer[:, 1:]], reduction="sum")

    def backward(self, tokens: Tensor, answer: Tensor) -> float:
        """The gradient of the batch's mean answer cross-entropy, accumulated piece by piece; that mean."""
        pieces = max(1, math.ceil(tokens.numel() / self.micro_tokens))
        count = int(answer[:, 1:].sum())
        total = 0.0
        for rows, mask in zip(tokens.chunk(pieces), answer.chunk(pieces), strict=True):
            loss = self.loss(rows, mask) / count
            loss.backward()
            total += loss.item()
        return total

    def train(self, steps: int) -> list[float]:
        """``steps`` optimiser steps on fresh seeded batches; the losses."""
        device = self.model.device
        generator = torch.Generator().manual_seed(self.seed)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.1)
        warmup = max(1, steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, s / steps))))
        losses = []
        self.model.train()
        for _ in range(steps):
            tokens, answer = TASKS[self.task](self.batch, self.length, generator)
            optimizer.zero_grad(set_to_none=True)
            losses.append(self.backward(tokens.to(device), answer.to(device)))
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        return losses

    @torch.no_grad()
    def accuracy(self, batches: int = 4) -> float:
        """The fraction of answer tokens predicted exactly (greedy), on batches of a second seeded stream (seed + 10⁶),
        not the training one."""
        device = self.model.device
        generator = torch.Generator().manual_seed(10**6 + self.seed)
        self.model.eval()
        right = total = 0
        for _ in range(batches):
            tokens, answer = (t.to(device) for t in TASKS[self.task](self.batch, self.length, generator))
            logits, _ = self.model(tokens[:, :-1])
            mask = answer[:, 1:]
            right += int((logits.argmax(-1)[mask] == tokens[:, 1:][mask]).sum())
            total += int(mask.sum())
        return right / total
