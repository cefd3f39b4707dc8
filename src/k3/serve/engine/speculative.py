"""The lossless acceptance rule of speculative decoding (SPEC §8, issue 14), as pure functions.

A cheap draft proposes γ tokens ``d_0 … d_{γ-1}``, ``d_i`` sampled from its distribution ``q_i``; the target scores
all γ + 1 positions at once, giving ``p_0 … p_γ`` (the distributions `choose` would sample from, see
`probabilities`). `verify` walks the drafts in order and accepts ``d_i`` with probability
``min(1, p_i(d_i) / q_i(d_i))`` (one uniform per examined position; a draft with ``q_i(d_i) = 0`` cannot have been
sampled and is rejected). At the first rejection the next token is drawn from the residual
``normalize(max(p_i − q_i, 0))`` (from ``p_i`` itself where the residual is all zero); when all γ are accepted a
bonus token is drawn from ``p_γ``. Every emitted token is then distributed exactly as sampling the target alone
would give it: ``q_i(x)·min(1, p_i(x)/q_i(x)) = min(p_i(x), q_i(x))`` and the residual supplies the remaining
``max(p_i(x) − q_i(x), 0)``. With a greedy target (one-hot ``p``) the rule reduces to "accept while the target's
argmax agrees, then emit the target's argmax": `verify_greedy`, which draws nothing. All arithmetic is float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.generation import sampling_logits
from k3.serve.engine.sampling import SamplingParams, check_allowed

__all__ = ["probabilities", "verify", "verify_greedy"]


def probabilities(row: Tensor, params: SamplingParams) -> Tensor:
    """The exact distribution (float64, ``[V]``) that `choose` samples from for processed logits ``row`` ``[V]``:
    temperature, min_p, top_k and top_p through `k3.generation.sampling_logits`; one-hot at the argmax for
    temperature 0."""
    check_allowed(row)
    if params.temperature == 0:
        onehot = torch.zeros(row.shape[-1], dtype=torch.float64, device=row.device)
        onehot[row.argmax()] = 1.0
        return onehot
    return sampling_logits(row[None], params.temperature, params.top_p, params.top_k, params.min_p)[0].softmax(-1)


def _uniform(generator: torch.Generator | None) -> float:
    """One float64 uniform in [0, 1) from ``generator`` (on its device)."""
    device = None if generator is None else generator.device
    return float(torch.rand((), dtype=torch.float64, generator=generator, device=device))


def _draw(weights: Tensor, generator: torch.Generator | None) -> int:
    """A token drawn with probability proportional to non-negative ``weights`` ``[V]``, by inverting the cumulative
    sum (a zero weight is never drawn)."""
    cdf = weights.cumsum(0)
    total = float(cdf[-1])
    if not total > 0:
        raise ValueError("speculative: a target distribution has no mass")
    index = int(torch.searchsorted(cdf, _uniform(generator) * total, right=True))
    # u·total can round up to total itself: the draw then belongs to the last token with mass
    return index if index < cdf.shape[0] else int(weights.nonzero()[-1])


def verify(p: Tensor, q: Tensor, draft: list[int], generator: torch.Generator | None) -> tuple[int, int]:
    """``(accepted, next token)`` for ``draft`` (γ tokens) under the module docstring's rule: ``p`` ``[γ+1, V]`` the
    target's distributions at the verified positions, ``q`` ``[γ, V]`` the draft's, which ``draft`` was sampled
    from."""
    gamma = len(draft)
    if p.ndim != 2 or q.ndim != 2 or p.shape[0] != gamma + 1 or q.shape[0] != gamma or (
            gamma and q.shape[1] != p.shape[1]):
        raise ValueError(f"speculative: need p [γ+1, V] and q [γ, V] for γ = {gamma} drafts; got p "
                         f"{list(p.shape)}, q {list(q.shape)}")
    p, q = p.double(), q.double()
    for i, token in enumerate(draft):
        target, proposal = float(p[i, token]), float(q[i, token])
        if _uniform(generator) * proposal < target and proposal > 0:  # u < p/q: accepted w.p. min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        return i, _draw(residual if bool(residual.any()) else p[i], generator)
    return gamma, _draw(p[gamma], generator)


def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, int]:
    """`verify` for a greedy target, without randomness: the drafts are accepted while they equal the target's
    argmax (``target_argmax``, γ + 1 ids), and the next token is the target's argmax where they stop."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"speculative: need γ + 1 = {len(draft) + 1} target ids, got {len(target_argmax)}")
    accepted = next((i for i, (t, d) in enumerate(zip(target_argmax, draft)) if t != d), len(draft))
    return accepted, target_argmax[accepted]
