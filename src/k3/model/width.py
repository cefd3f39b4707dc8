"""The width axis: how one token is transformed (SPEC §4, Eq. 11–13, 18–19; dispatch notes §9).

Dense SiTU-GLU / SwiGLU feed-forward layers, the sigmoid top-k router with a selection-only
balancing bias, sort-by-expert dispatch of the routed experts, and Stable LatentMoE.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.config import K3Config, MXConfig, SiTUConfig
from k3.model.norm import RMSNorm
from k3.model.projections import project
from k3.ops import mx

ACTIVATIONS = ("situ", "swiglu")


def soft_cap(x: Tensor, cap: float) -> Tensor:
    """``cap · tanh(x / cap)``: smooth, odd, |·| < cap, ≈ x near 0 (SPEC Eq. 11)."""
    return cap * torch.tanh(x / cap)


def situ(gate: Tensor, up: Tensor, gate_cap: float, up_cap: float) -> Tensor:
    """SiTU (SPEC Eq. 12–13): ``softCap(g, c_g) · sigmoid(g) · softCap(u, c_u)``, bounded by c_g·c_u.

    The sigmoid sees the *uncapped* gate.
    """
    return soft_cap(gate, gate_cap) * torch.sigmoid(gate) * soft_cap(up, up_cap)


def gated(gate: Tensor, up: Tensor, activation: str, gate_cap: float, up_cap: float) -> Tensor:
    """The gated activation of ``gate`` and ``up`` (SPEC Eq. 18): `situ` with its caps, or SwiGLU."""
    if activation == "situ":
        return situ(gate, up, gate_cap, up_cap)
    return F.silu(gate) * up


def sorted_dispatch(x: Tensor, weights: Tensor, indices: Tensor, num_experts: int,
                    expert: Callable[[int, Tensor], Tensor]) -> Tensor:
    """``Σ_j weights_j · expert(indices_j, x)`` for x [N, W], weights and indices [N, k] (SPEC §9): the N·k pairs
    sorted by expert (stable), ``expert(e, xs)`` once per expert with pairs on its contiguous slice, outputs scaled
    by the pair weight and scatter-added back per token in ``promote(x.dtype, weights.dtype)``; [N, W] in x.dtype."""
    n_tokens, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    outputs = [expert(e, xs) for e, xs in enumerate(x[token].split(counts)) if xs.shape[0]]
    acc = torch.promote_types(x.dtype, weights.dtype)
    y = torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])  # outputs is empty iff N = 0
    y = y.to(acc) * weights.reshape(-1)[order, None].to(acc)
    out = torch.zeros(n_tokens, x.shape[-1], dtype=acc, device=x.device)
    return out.index_add_(0, token, y).to(x.dtype)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation = {activation!r} is invalid: must be one of {ACTIVATIONS}")


class GLU(nn.Module):
    """Bias-free gated FFN ``down(act(gate(x), up(x)))`` with act SiTU or SwiGLU (SPEC Eq. 18).

    Serves as the dense FFN and as the shared experts: n shared experts of hidden F sum to
    exactly one GLU of hidden n·F (their gate/up rows and down columns concatenate).
    """

    def __init__(self, d_in: int, hidden: int, activation: str, situ: SiTUConfig, std: float = 0.02) -> None:
        super().__init__()
        _check_activation(activation)
        self.activation = activation
        self.gate_cap, self.up_cap = situ.gate_cap, situ.up_cap
        self.std = std
        self.gate_proj = nn.Linear(d_in, hidden, bias=False)
        self.up_proj = nn.Linear(d_in, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_in, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(proj.weight, std=self.std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(*project(x, self.gate_proj, self.up_proj))

    def down(self, gate: Tensor, up: Tensor) -> Tensor:
        """The output from the gate and up projections ``x W_gate``, ``x W_up``."""
        return self.down_proj(gated(gate, up, self.activation, self.gate_cap, self.up_cap))


def top_k_sorted(values: Tensor, k: int) -> Tensor:
    """Indices ``[N, k]`` of each row's k largest ``values [N, n]``, ties to the lower index (a stable descending
    sort)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def top_k_first(values: Tensor, k: int) -> Tensor:
    """`top_k_sorted` for finite values as k passes of argmax (the first maximum), which a compiler fuses into one
    kernel where a sort is a library call."""
    picked, remaining = [], values
    for _ in range(k):
        index = remaining.argmax(-1, keepdim=True)
        picked.append(index)
        remaining = remaining.scatter(-1, index, float("-inf"))
    return torch.cat(picked, -1)


class Router(nn.Module):
    """Sigmoid top-k router (SPEC §4): ``s = sigmoid(x W_r)``, route = top_k(s + b), p_j = s_j / Σ_route s.

    The balancing bias ``b`` (a persistent buffer, written by quantile balancing, SPEC §5) only
    selects; the mixture weights are the raw scores renormalised. Weight and bias never drop
    below fp32 (SPEC §9): half-precision casts of the module leave them fp32, and scores are
    computed in ``promote(x.dtype, fp32)``.

    Ties in ``s + b`` go to the lower expert index (a stable descending sort; `torch.topk`
    leaves tie order unspecified). After each forward, ``last_scores`` [N, n] and
    ``last_load`` (int64 [n], pairs routed to each expert) hold detached statistics.
    """

    last_scores: Tensor | None
    last_load: Tensor | None

    def __init__(self, d: int, n_experts: int, k: int, std: float = 0.02) -> None:
        super().__init__()
        if not 1 <= k <= n_experts:
            raise ValueError(f"top-k = {k} is invalid: must be in [1, n_experts={n_experts}]")
        self.k, self.std = k, std
        self.weight = nn.Parameter(torch.empty(n_experts, d, dtype=torch.float32))
        self.register_buffer("balance_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.last_scores = None
        self.last_load = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        nn.init.zeros_(self.balance_bias)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Router:
        super()._apply(fn, recurse)
        for t in (self.weight, self.balance_bias):
            if t.dtype in (torch.float16, torch.bfloat16):
                t.data = t.data.float()
        return self

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, d] → (weights [N, k], indices [N, k] int64, scores [N, n]), weights/scores ≥ fp32."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        scores = torch.sigmoid(x.to(dtype) @ self.weight.to(dtype).T)
        biased = scores + self.balance_bias.to(dtype)
        compiling, n = torch.compiler.is_compiling(), scores.shape[-1]
        indices = (top_k_first if compiling else top_k_sorted)(biased, self.k)  # the same indices, ties included
        chosen = scores.gather(-1, indices)
        weights = chosen / chosen.sum(-1, keepdim=True)
        self.last_scores = scores.detach()
        flat = indices.flatten()  # static-shape counts (bincount's size depends on the data: no graph under compile)
        self.last_load = (F.one_hot(flat, n).sum(0) if compiling else torch.zeros(n, dtype=torch.long, device=x.device)
                          .index_add_(0, flat, torch.ones_like(flat))).detach()  # compiled: one fused reduction
        return weights, indices, scores

    def extra_repr(self) -> str:
        n, d = self.weight.shape
        return f"d={d}, n_experts={n}, k={self.k}"


class Experts(nn.Module):
    """E routed gated experts, stacked: ``gate_up`` [E, 2F, W] (rows :F gate, F: up; the layout of
    transformers' KimiLinearExperts.gate_up_proj) and ``down`` [E, W, F].

    Dispatch (SPEC §9): the N·k token–expert pairs are sorted by expert (stable), each expert with
    at least one pair runs once on its contiguous slice, outputs are scaled by the pair weight and
    scatter-added back per token, accumulating in ``promote(x.dtype, weights.dtype)``.

    For a batch of decode tokens that hits most experts (``E ≤ N·k`` and ``N·E ≤ DENSE_LIMIT``) that is
    one small matmul chain per expert, so instead every expert runs on every token in two matmuls and
    the unselected ones get weight 0 — the same sum with a few operators instead of a few per expert.

    With MX on (``mx.enabled``, SPEC §7) each expert computes on MX-quantized weights (``mx.weight_format``)
    and inputs (``mx.activation_format``; None keeps them in high precision), fake-quantized with the
    straight-through estimator (quantization-aware training); the dense path is then not taken, so a float
    model and its `k3.model.packed.PackedExperts` run the same matmuls on the same values.
    """

    DENSE_LIMIT = 512

    def __init__(
        self, n_experts: int, width: int, hidden: int, activation: str, situ: SiTUConfig, std: float = 0.02,
        mx_config: MXConfig | None = None,
    ) -> None:
        super().__init__()
        _check_activation(activation)
        self.activation = activation
        self.gate_cap, self.up_cap = situ.gate_cap, situ.up_cap
        self.num_experts, self.width, self.hidden, self.std = n_experts, width, hidden, std
        on = mx_config is not None and mx_config.enabled
        self.weight_format: str | None = mx_config.weight_format if on else None
        self.input_format: str | None = mx_config.activation_format if on else None
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * hidden, width))
        self.down = nn.Parameter(torch.empty(n_experts, width, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up, std=self.std)
        nn.init.normal_(self.down, std=self.std)

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """x [N, W], weights [N, k], indices [N, k] → Σ_j weights_j · Expert_{indices_j}(x), [N, W] in x.dtype."""
        n_tokens, k = indices.shape
        if torch.compiler.is_compiling():
            return self._gathered(x, weights, indices)
        mx_on = self.weight_format is not None or self.input_format is not None
        if not mx_on and self.num_experts <= n_tokens * k and n_tokens * self.num_experts <= self.DENSE_LIMIT:
            return self._dense(x, weights, indices)
        return sorted_dispatch(x, weights, indices, self.num_experts, self.expert)

    def expert(self, e: int, xs: Tensor) -> Tensor:
        """Expert ``e`` on its tokens ``xs`` ``[n, W]``."""
        gate_up, down = self.expert_weights(e, xs.dtype)
        gate, up = (self._input(xs) @ gate_up.T).split(self.hidden, dim=-1)
        return self._input(self.activate(gate, up)) @ down.T

    def activate(self, gate: Tensor, up: Tensor) -> Tensor:
        """The experts' gated activation (SiTU or SwiGLU, SPEC Eq. 18) of ``gate`` and ``up``."""
        return gated(gate, up, self.activation, self.gate_cap, self.up_cap)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Expert ``e``'s ``(gate_up [2F, W], down [W, F])`` as it computes: MX fake-quantized (blocks along
        the input width) when MX is on. Float weights keep their own dtype (``dtype`` is for packed ones)."""
        gate_up, down = self.gate_up[e], self.down[e]
        if self.weight_format is None:
            return gate_up, down
        return mx.fake_quantize(gate_up, self.weight_format), mx.fake_quantize(down, self.weight_format)

    def _input(self, x: Tensor) -> Tensor:
        """A matmul input, MX fake-quantized in blocks along its last axis when MX inputs are on."""
        return x if self.input_format is None else mx.fake_quantize(x, self.input_format)

    def _pair_product(self, name: str, xs: Tensor, pairs: Tensor) -> Tensor:
        """Each row of ``xs`` ``[M, in]`` times its expert's ``name`` weight (``"gate_up"`` or ``"down"``, as
        `expert_weights` computes it), the expert ``pairs[m]``, on a gathered copy: ``[M, out]``."""
        w = getattr(self, name)[pairs]
        if self.weight_format is not None:
            w = mx.fake_quantize(w, self.weight_format)
        return (w @ xs.unsqueeze(-1)).squeeze(-1)

    def _gathered(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """Each token–expert pair on its own product with the expert's weights (`_pair_product`): shapes fixed by
        ``[N, k]`` alone (what a compiled decode step traces, `k3.model.compiled`); it reads exactly the selected
        experts."""
        (n, k), pairs = indices.shape, indices.flatten()
        xs = self._input(x).repeat_interleave(k, 0)  # [N·k, W]
        gate, up = self._pair_product("gate_up", xs, pairs).split(self.hidden, dim=-1)
        h = self._input(gated(gate, up, self.activation, self.gate_cap, self.up_cap))
        acc = torch.promote_types(x.dtype, weights.dtype)
        y = self._pair_product("down", h, pairs).to(acc).view(n, k, -1)
        return (y * weights.to(acc).unsqueeze(-1)).sum(1).to(x.dtype)

    def _dense(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """All experts on all tokens, weighted by the routing weight (0 where not selected)."""
        (N, _), (E, _, W) = indices.shape, self.gate_up.shape
        acc = torch.promote_types(x.dtype, weights.dtype)
        gate, up = (x @ self.gate_up.reshape(E * 2 * self.hidden, W).T).view(N, E, 2 * self.hidden).split(
            self.hidden, dim=-1)
        h = gated(gate, up, self.activation, self.gate_cap, self.up_cap)  # [N, E, F]
        y = torch.bmm(h.transpose(0, 1), self.down.transpose(1, 2)).to(acc)  # [E, N, W]
        mix = torch.zeros(N, E, dtype=acc, device=x.device).scatter_add_(1, indices, weights.to(acc))
        return torch.einsum("enw,ne->nw", y, mix).to(x.dtype)

    def extra_repr(self) -> str:
        mx_formats = f", mx={self.weight_format}/{self.input_format}" if self.weight_format or self.input_format else ""
        return (f"n_experts={self.num_experts}, width={self.width}, hidden={self.hidden}, "
                f"activation={self.activation}{mx_formats}")


class LatentMoE(nn.Module):
    """Stable LatentMoE (SPEC §4, Eq. 19; §10):
    ``y = shared(x) + latent_up(RMSNorm(Σ_{j∈route} α p_j Expert_j(latent_down(x))))``.

    Routing sees x at width d in ≥ fp32; routed experts work at the latent width ℓ, shared
    experts (one GLU of hidden n_shared·F_shared) at d. With ``moe.latent_dim = None`` (plain MoE,
    Kimi Linear) there are no latent modules and the experts work at d: ``y = shared(x) + α·Σ p_j E_j(x)``.
    α is ``moe.routed_scaling_factor``.
    """

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        moe, d, std = config.moe, config.hidden_size, config.initializer_range
        self.std = std
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.router = Router(d, moe.num_experts, moe.num_experts_per_token, std)
        self.shared = (
            GLU(d, moe.num_shared_experts * moe.shared_hidden, moe.activation, config.situ, std)
            if moe.num_shared_experts
            else None
        )
        width = d
        self.latent_down: nn.Linear | None = None
        self.latent_norm: RMSNorm | None = None
        self.latent_up: nn.Linear | None = None
        if moe.latent_dim is not None:
            width = moe.latent_dim
            self.latent_down = nn.Linear(d, width, bias=False)
            self.latent_norm = RMSNorm(width, config.rms_norm_eps)
            self.latent_up = nn.Linear(width, d, bias=False)
        self.experts = Experts(moe.num_experts, width, moe.expert_hidden, moe.activation, config.situ, std,
                               config.mx)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for every matrix, norm gain 1, balancing bias 0."""
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared is not None:
            self.shared.reset_parameters()
        if self.latent_down is not None:
            nn.init.normal_(self.latent_down.weight, std=self.std)
            nn.init.normal_(self.latent_up.weight, std=self.std)
            nn.init.ones_(self.latent_norm.weight)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., d] → [..., d]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, indices, _ = self.router(flat)
        shared = [] if self.shared is None else [self.shared.gate_proj, self.shared.up_proj]
        latent = [] if self.latent_down is None else [self.latent_down]
        projected = project(flat, *latent, *shared)  # the products of x, in one where `project` stacks them
        h = projected.pop(0) if latent else flat
        # α scales the routing weights, before the latent norm (SPEC §10; equal to α·y without a latent)
        y = self.experts(h, weights * self.routed_scaling_factor, indices)
        if self.latent_up is not None:
            y = self.latent_up(self.latent_norm(y))
        if self.shared is not None:
            y = self.shared.down(*projected) + y
        return y.reshape(x.shape)


def build_ffn(config: K3Config, layer_index: int) -> nn.Module:
    """The FFN of 0-based layer ``layer_index``: a dense GLU or a LatentMoE per `K3Config.ffn_kinds`."""
    if config.ffn_kinds()[layer_index] == "dense":
        moe = config.moe
        return GLU(config.hidden_size, moe.dense_hidden, moe.activation, config.situ, config.initializer_range)
    return LatentMoE(config)
