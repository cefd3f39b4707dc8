"""RMSNorm (used throughout: pre-mixer norms, MLA latents, per-head KDA output norm, LatentMoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``x / sqrt(mean(x²) + eps) · weight``, computed in at least fp32 and returned in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    weight = None if weight is None else weight.to(dtype)
    return F.rms_norm(x.to(dtype), (x.shape[-1],), weight, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned gain (initialised to 1)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
