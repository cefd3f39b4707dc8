"""Routed experts kept in the release's packed MXFP4 storage (SPEC §10): 4.25 bits per weight in memory.

`PackedExperts` stores each expert as compressed-tensors tensors — ``packed.E.w1`` (gate), ``w3`` (up), ``w2``
(down), each ``weight_packed`` uint8 ``[out, in/2]`` + ``weight_scale`` E8M0 ``[out, in/32]`` — and computes the
layer as one operator (`experts_product`): up to `PackedExperts.KERNEL_ROWS` fp32 tokens on the CPU in one call of
the packed-byte kernel (`k3.ops.mxfp4_kernel.experts`: each chosen expert's bytes read once, never decoded to
floats), else the dispatch of `k3.model.width.Experts` (sort by expert, one product chain per chosen expert, its
weights decoded exactly by `k3.ops.mx.dequantize` unless the kernel takes its few rows). The operator reads every
expert's bytes stacked (`PackedExperts.stack`, made on first use; the per-expert tensors become views of them, so
the bytes are held once). The buffers are not trainable; `unpack` gives a trainable `Experts` with the same weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from k3.config import MXConfig, SiTUConfig
from k3.model.width import Experts, gated, sorted_dispatch
from k3.ops import mx, mxfp4_kernel

PROJECTIONS = ("w1", "w2", "w3")  # gate [F, W], down [W, F], up [F, W] as the release names them
STACKED = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")


def kernel_runs(x: Tensor) -> bool:
    """Whether rows ``x`` multiply packed bytes through the kernel (`k3.ops.mxfp4_kernel`): at most
    `PackedExperts.KERNEL_ROWS` of them, and the kernel available for them; else decoding the weights is faster."""
    return x.shape[0] <= PackedExperts.KERNEL_ROWS and mxfp4_kernel.available(x)


def product(x: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
    """``x @ W.T`` for the MXFP4 weight ``W = (packed, scale)``: through the kernel where `kernel_runs`, else on the
    weights decoded into ``x.dtype``."""
    return mxfp4_kernel.gemv(x, packed, scale) if kernel_runs(x) else x @ mx.dequantize(packed, scale, x.dtype).T


def expert_product(e: int, xs: Tensor, gate_up: tuple[Tensor, Tensor], down: tuple[Tensor, Tensor],
                   activation: str, caps: tuple[float, float], input_format: str | None) -> Tensor:
    """Expert ``e`` of the stacked packed weights on its tokens ``xs`` ``[n, W]``, its matmul inputs MX
    fake-quantized when ``input_format`` is set: the products `Experts.expert` computes on the decoded weights."""
    def inputs(t: Tensor) -> Tensor:
        return t if input_format is None else mx.fake_quantize(t, input_format)

    gate, up = product(inputs(xs), gate_up[0][e], gate_up[1][e]).chunk(2, dim=-1)
    return product(inputs(gated(gate, up, activation, *caps)), down[0][e], down[1][e])


@torch.library.custom_op("k3::mxfp4_experts", mutates_args=())
def experts_product(x: Tensor, weights: Tensor, indices: Tensor, gate_up_packed: Tensor, gate_up_scale: Tensor,
                    down_packed: Tensor, down_scale: Tensor, activation: str, gate_cap: float, up_cap: float,
                    input_format: str) -> Tensor:
    """`Experts.forward` on stacked packed weights (`PackedExperts.stack`; ``input_format`` "" for none): ``[N, W]``
    in ``x.dtype``. Up to `PackedExperts.KERNEL_ROWS` fp32 CPU tokens without MX inputs go through
    `k3.ops.mxfp4_kernel.experts` in one call; else `sorted_dispatch` of `expert_product`. One operator, so a
    compiled step calls it as one node (which experts it reads depends on the routing, which a graph cannot)."""
    gate_up, down = (gate_up_packed, gate_up_scale), (down_packed, down_scale)
    if not input_format and weights.dtype == torch.float32 and kernel_runs(x):
        return mxfp4_kernel.experts(x, weights, indices, gate_up, down, activation, gate_cap, up_cap)
    return sorted_dispatch(x, weights, indices, gate_up_packed.shape[0], lambda e, xs: expert_product(
        e, xs, gate_up, down, activation, (gate_cap, up_cap), input_format or None))


@experts_product.register_fake
def _(x: Tensor, weights: Tensor, indices: Tensor, gate_up_packed: Tensor, gate_up_scale: Tensor,
      down_packed: Tensor, down_scale: Tensor, activation: str, gate_cap: float, up_cap: float,
      input_format: str) -> Tensor:
    return x.new_empty(x.shape)


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
    on, so a packed model computes exactly what its fake-quantized float model computes (SPEC §7). The layer is one
    operator (`experts_product`) in eager and compiled steps alike: static shapes, no graph break. Where a gradient
    is needed (of the inputs or the routing weights) it is `sorted_dispatch` of `expert` on decoded weights.
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
        self.register_load_state_dict_post_hook(PackedExperts._restack)

    @classmethod
    def like(cls, experts: Experts) -> PackedExperts:
        """Empty packed experts of the same shape, activation and input format as ``experts``."""
        return cls(experts.num_experts, experts.width, experts.hidden, experts.activation,
                   SiTUConfig(experts.gate_cap, experts.up_cap), experts.input_format)

    def reset_parameters(self) -> None:
        """Packed weights are data, not initialised parameters."""

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """x [N, W], weights [N, k], indices [N, k] → Σ_j weights_j · Expert_{indices_j}(x), [N, W] in x.dtype."""
        self.stack()
        if torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad):
            return sorted_dispatch(x, weights, indices, self.num_experts, self.expert)
        return torch.ops.k3.mxfp4_experts(x, weights, indices, *(getattr(self, name) for name in STACKED),
                                          self.activation, self.gate_cap, self.up_cap, self.input_format or "")

    def expert(self, e: int, xs: Tensor) -> Tensor:
        """Expert ``e`` on its tokens ``xs`` ``[n, W]`` (`expert_product`): up to ``KERNEL_ROWS`` fp32 rows on the CPU
        through the packed-byte kernel, which never decodes the weights to floats; otherwise the weights decoded,
        then a matmul."""
        self.stack()
        return expert_product(e, xs, (self.gate_up_packed, self.gate_up_scale), (self.down_packed, self.down_scale),
                              self.activation, (self.gate_cap, self.up_cap), self.input_format)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Expert ``e``'s weights decoded exactly into ``dtype``: ``(cat(w1, w3) [2F, W], w2 [W, F])``."""
        p = self.packed[e]
        return torch.cat([p.w1.weight(dtype), p.w3.weight(dtype)]), p.w2.weight(dtype)

    def stack(self) -> None:
        """Every expert's packed bytes and scales stacked, as `experts_product` reads them (non-persistent buffers
        `STACKED`: ``gate_up`` = cat(w1, w3) ``[E, 2F, ·]``, ``down`` = w2 ``[E, W, ·]``); each expert's own tensors
        become views of them, so the bytes are held once. Made on first use (and before a compiled step's first
        trace), and made again from what a state dict loads."""
        if hasattr(self, "gate_up_packed"):
            return
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, whatever mode the first call runs in
            for name, projections in (("gate_up", ("w1", "w3")), ("down", ("w2",))):
                for kind in ("packed", "scale"):
                    rows = [[getattr(getattr(p, w), f"weight_{kind}") for w in projections] for p in self.packed]
                    stacked = torch.stack([torch.cat(parts) for parts in rows])
                    self.register_buffer(f"{name}_{kind}", stacked, persistent=False)
                    for e, p in enumerate(self.packed):
                        for part, w in zip(stacked[e].split([t.shape[0] for t in rows[e]]), projections):
                            setattr(getattr(p, w), f"weight_{kind}", part)

    def restack(self) -> None:
        """Stack the experts' own tensors anew where a stack was made: after a load assigned new tensors (not in the
        old stack), or after ``to_empty`` gave every buffer and its former views memory of their own."""
        if hasattr(self, STACKED[0]):
            for name in STACKED:
                delattr(self, name)
            self.stack()

    @staticmethod
    def _restack(module: PackedExperts, incompatible_keys: object) -> None:
        """A load-state-dict post-hook: `restack`, so the stacked buffers a compiled step reads are there and
        current."""
        module.restack()

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


_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "orthogonal_", "ones_", "zeros_", "constant_")  # `torch.nn.init`'s, which modules call


@contextlib.contextmanager
def _uninitialised() -> Iterator[None]:
    """`torch.nn.init`'s functions leave their tensor as it is (as transformers' ``no_init_weights``): random
    initialisation on the meta device runs Python kernels whose first call imports dynamo (~1 s). The functions are
    the module's, so a module another thread initialises meanwhile is left uninitialised too (models are loaded
    before serving starts)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def skeleton(cls: Callable[..., nn.Module], config: object, packed: bool) -> nn.Module:
    """``cls(config)`` on the meta device (nothing allocated or initialised), with empty `PackedExperts` if
    ``packed``: load its tensors with ``load_state_dict(..., assign=True)``, and float experts are never
    materialised."""
    with torch.device("meta"), _uninitialised():
        model = cls(config)
        return use_packed_experts(model) if packed else model

