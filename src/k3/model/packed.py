"""Routed experts kept in the release's packed MXFP4 storage (SPEC §10): 4.25 bits per weight in memory.

`PackedExperts` has the dispatch of `k3.model.width.Experts` (sort by expert, one small matmul chain per
selected expert) but stores each expert as compressed-tensors tensors — ``packed.E.w1`` (gate), ``w3`` (up),
``w2`` (down), each ``weight_packed`` uint8 ``[out, in/2]`` + ``weight_scale`` E8M0 ``[out, in/32]`` — and
decodes an expert's weights (exactly, `k3.ops.mx.dequantize`) only when a token is routed to it. Loaded from
memory-mapped shards, an expert's bytes are read from disk the first time it is chosen. The buffers are
not trainable; `unpack` gives a trainable `Experts` with the same weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3.config import SiTUConfig
from k3.model.width import Experts, _activate
from k3.ops import mx

PROJECTIONS = ("w1", "w2", "w3")  # gate [F, W], down [W, F], up [F, W] as the release names them


class PackedLinear(nn.Module):
    """One bias-free MXFP4 weight ``[out, in]``: buffers ``weight_packed`` and ``weight_scale``."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        if in_features % mx.BLOCK:
            raise ValueError(f"MXFP4 weight: in_features={in_features} must be a multiple of {mx.BLOCK}")
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // mx.BLOCK, dtype=torch.uint8))

    def weight(self, dtype: torch.dtype) -> Tensor:
        return mx.dequantize(self.weight_packed, self.weight_scale, dtype)


class PackedExpert(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = PackedLinear(hidden, width), PackedLinear(hidden, width)  # gate, up
        self.w2 = PackedLinear(width, hidden)  # down


class PackedExperts(Experts):
    """`Experts` whose weights stay MXFP4-packed; never the all-experts dense path (it would decode every one)."""

    DENSE_LIMIT = 0

    def __init__(self, n_experts: int, width: int, hidden: int, activation: str, situ: SiTUConfig) -> None:
        nn.Module.__init__(self)
        self.activation = activation
        self.gate_cap, self.up_cap = situ.gate_cap, situ.up_cap
        self.num_experts, self.width, self.hidden = n_experts, width, hidden
        self.packed = nn.ModuleList(PackedExpert(width, hidden) for _ in range(n_experts))

    def reset_parameters(self) -> None:
        """Packed weights are data, not initialised parameters."""

    def expert(self, e: int, xs: Tensor) -> Tensor:
        p = self.packed[e]
        gate, up = xs @ p.w1.weight(xs.dtype).T, xs @ p.w3.weight(xs.dtype).T
        return _activate(gate, up, self.activation, self.gate_cap, self.up_cap) @ p.w2.weight(xs.dtype).T

    @classmethod
    def pack(cls, experts: Experts) -> PackedExperts:
        """MXFP4-quantize a float `Experts` (`k3.ops.mx.quantize`, lossy)."""
        situ = SiTUConfig(experts.gate_cap, experts.up_cap)
        out = cls(experts.num_experts, experts.width, experts.hidden, experts.activation, situ)
        for e, p in enumerate(out.packed):
            gate, up = experts.gate_up[e].split(experts.hidden)
            for linear, w in ((p.w1, gate), (p.w3, up), (p.w2, experts.down[e])):
                linear.weight_packed, linear.weight_scale = mx.quantize(w)
        return out

    def unpack(self, dtype: torch.dtype = torch.float32) -> Experts:
        """A trainable float `Experts` holding exactly the decoded weights."""
        out = Experts(self.num_experts, self.width, self.hidden, self.activation, SiTUConfig(self.gate_cap,
                                                                                          self.up_cap))
        with torch.no_grad():
            for e, p in enumerate(self.packed):
                out.gate_up[e] = torch.cat([p.w1.weight(dtype), p.w3.weight(dtype)])
                out.down[e] = p.w2.weight(dtype)
        return out.to(dtype)
