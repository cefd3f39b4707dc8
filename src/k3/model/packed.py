"""Routed experts kept in the release's packed MXFP4 storage (SPEC §10): 4.25 bits per weight in memory.

`PackedExperts` has the dispatch of `k3.model.width.Experts` (sort by expert, one small matmul chain per
selected expert) but stores each expert as compressed-tensors tensors — ``packed.E.w1`` (gate), ``w3`` (up),
``w2`` (down), each ``weight_packed`` uint8 ``[out, in/2]`` + ``weight_scale`` E8M0 ``[out, in/32]``. A chosen
expert's few decode-step tokens multiply its packed bytes directly (`k3.ops.mxfp4_kernel`, fp32 on the CPU); else
its weights are decoded (exactly, `k3.ops.mx.dequantize`) only when a token is routed to it. Loaded from
memory-mapped shards, an expert's bytes are read from disk the first time it is chosen. The buffers are
not trainable; `unpack` gives a trainable `Experts` with the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from k3.config import MXConfig, SiTUConfig
from k3.model.width import Experts
from k3.ops import mx, mxfp4_kernel

PROJECTIONS = ("w1", "w2", "w3")  # gate [F, W], down [W, F], up [F, W] as the release names them


def kernel_runs(x: Tensor) -> bool:
    """Whether rows ``x`` multiply packed bytes through the kernel (`k3.ops.mxfp4_kernel`): at most
    `PackedExperts.KERNEL_ROWS` of them, and the kernel available for them; else decoding the weights is faster."""
    return x.shape[0] <= PackedExperts.KERNEL_ROWS and mxfp4_kernel.available(x)


@torch.library.custom_op("k3::mxfp4_pair_products", mutates_args=())
def pair_products(xs: Tensor, packed: Tensor, scale: Tensor, pairs: Tensor) -> Tensor:
    """Row m of ``xs`` ``[M, K]`` times the MXFP4 weight ``(packed [E, N, K/2], scale [E, N, K/32])[pairs[m]]``
    transposed: ``[M, N]`` in ``xs.dtype``. The rows of each expert together: up to `PackedExperts.KERNEL_ROWS` fp32
    rows on the CPU through the packed-byte kernel (its bytes read once, never decoded), else the decoded weights
    times the rows. An operator of its own, so a compiled step calls it as one node (which experts it reads depends
    on the routing, which a graph cannot)."""
    out = xs.new_empty(xs.shape[0], packed.shape[1])
    for e in pairs.unique().tolist():
        rows = (pairs == e).nonzero().squeeze(1)
        x = xs.index_select(0, rows)
        if kernel_runs(x):
            out[rows] = mxfp4_kernel.gemv(x, packed[e], scale[e])
        else:
            out[rows] = x @ mx.dequantize(packed[e], scale[e], x.dtype).T
    return out


@pair_products.register_fake
def _(xs: Tensor, packed: Tensor, scale: Tensor, pairs: Tensor) -> Tensor:
    return xs.new_empty(xs.shape[0], packed.shape[1])


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
    """`Experts` whose weights stay MXFP4-packed; never the all-experts dense path (it would decode every one).

    ``input_format`` (an MXFP8 format or None) quantizes the experts' matmul inputs as `Experts` does with MX
    on, so a packed model computes exactly what its fake-quantized float model computes (SPEC §7). In a compiled step
    (`Experts._gathered`, after `stack`) its products are one operator of the graph (`pair_products`): static shapes,
    no graph break.
    """

    DENSE_LIMIT = 0
    KERNEL_ROWS = 64  # beyond this many tokens on one expert, decoding its weights once and a matmul is faster

    def __init__(self, n_experts: int, width: int, hidden: int, activation: str, situ: SiTUConfig,
                 input_format: str | None = None) -> None:
        nn.Module.__init__(self)
        self.activation = activation
        self.gate_cap, self.up_cap = situ.gate_cap, situ.up_cap
        self.num_experts, self.width, self.hidden = n_experts, width, hidden
        self.weight_format, self.input_format = "mxfp4", input_format
        self.packed = nn.ModuleList(PackedExpert(width, hidden) for _ in range(n_experts))

    @classmethod
    def like(cls, experts: Experts) -> PackedExperts:
        """Empty packed experts of the same shape, activation and input format as ``experts``."""
        return cls(experts.num_experts, experts.width, experts.hidden, experts.activation,
                   SiTUConfig(experts.gate_cap, experts.up_cap), experts.input_format)

    def reset_parameters(self) -> None:
        """Packed weights are data, not initialised parameters."""

    def expert(self, e: int, xs: Tensor) -> Tensor:
        """Expert ``e`` on its tokens ``xs`` ``[n, W]``: up to ``KERNEL_ROWS`` fp32 rows on the CPU through the
        packed-byte kernel (`k3.ops.mxfp4_kernel`), which never decodes the weights to floats; otherwise (or without
        the kernel) the weights decoded, then a matmul."""
        if not kernel_runs(xs):
            return super().expert(e, xs)
        x, p = self._input(xs), self.packed[e]
        gate, up = (mxfp4_kernel.gemv(x, w.weight_packed, w.weight_scale) for w in (p.w1, p.w3))
        return mxfp4_kernel.gemv(self._input(self.activate(gate, up)), p.w2.weight_packed, p.w2.weight_scale)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Expert ``e``'s weights decoded exactly into ``dtype``: ``(cat(w1, w3) [2F, W], w2 [W, F])``."""
        p = self.packed[e]
        return torch.cat([p.w1.weight(dtype), p.w3.weight(dtype)]), p.w2.weight(dtype)

    def stack(self) -> None:
        """Stacked copies of every expert's packed bytes and scales (non-persistent buffers: the packed experts'
        memory once more), which a compiled step's `pair_products` reads; built once, before the first trace."""
        if hasattr(self, "gate_up_packed"):
            return
        for name, projections in (("gate_up", ("w1", "w3")), ("down", ("w2",))):
            for kind in ("packed", "scale"):
                self.register_buffer(f"{name}_{kind}", torch.stack([
                    torch.cat([getattr(getattr(p, w), f"weight_{kind}") for w in projections]) for p in self.packed]),
                    persistent=False)

    def _pair_product(self, name: str, xs: Tensor, pairs: Tensor) -> Tensor:
        """Each row of ``xs`` times its expert's packed ``name`` weight (`pair_products`: one opaque operator in the
        graph, the packed-byte kernel inside)."""
        return torch.ops.k3.mxfp4_pair_products(xs, getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"),
                                                pairs)

    @classmethod
    def pack(cls, experts: Experts) -> PackedExperts:
        """MXFP4-quantize a float `Experts` (`k3.ops.mx.quantize`: lossy, unless MX is already on, when the packed
        weights are exactly the ones its forward fake-quantizes to)."""
        if experts.weight_format not in (None, "mxfp4"):
            raise ValueError(f"cannot pack {experts.weight_format} expert weights as MXFP4")
        out = cls.like(experts)
        for e, p in enumerate(out.packed):
            gate, up = experts.gate_up[e].detach().split(experts.hidden)
            for linear, w in ((p.w1, gate), (p.w3, up), (p.w2, experts.down[e].detach())):
                linear.weight_packed, linear.weight_scale = mx.quantize(w)
        return out

    def unpack(self, dtype: torch.dtype = torch.float32) -> Experts:
        """A trainable float `Experts` holding exactly the decoded weights (MX stays on: it computes the same)."""
        out = Experts(self.num_experts, self.width, self.hidden, self.activation,
                      SiTUConfig(self.gate_cap, self.up_cap),
                      mx_config=MXConfig(enabled=True, activation_format=self.input_format))
        with torch.no_grad():
            for e in range(self.num_experts):
                out.gate_up[e], out.down[e] = self.expert_weights(e, dtype)
        return out.to(dtype)


def replace_experts(model: nn.Module, convert: Callable[[Experts], Experts]) -> nn.Module:
    """Replace every routed `Experts` (packed or not) of ``model``, in place, by ``convert`` of it."""
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, Experts):
            module.experts = convert(experts)
    return model


def use_packed_experts(model: nn.Module) -> nn.Module:
    """Replace every float `Experts` of ``model`` by empty `PackedExperts` of the same shape (to be loaded)."""
    return replace_experts(model, lambda e: e if isinstance(e, PackedExperts) else PackedExperts.like(e))


def skeleton(cls: Callable[..., nn.Module], config: object, packed: bool) -> nn.Module:
    """``cls(config)`` on the meta device (nothing allocated), with empty `PackedExperts` if ``packed``: load its
    tensors with ``load_state_dict(..., assign=True)``, and float experts are never materialised."""
    with torch.device("meta"):
        model = cls(config)
        return use_packed_experts(model) if packed else model

