"""The Kimi Delta Attention layer (SPEC §1, Eq. 1–6): projections, ShortConv, gates, recurrence, gated norm."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.projections import project
from k3.ops import kda, kda_fla


# `KDALayer._init_bounded_gate`: the bounded gate's initial σ(logit) is at most 1 − ε (a floor above Kimi Linear's
# initial decays).
BOUNDED_INIT_EPS = 1e-3


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass
class KDAState:
    """One KDA layer's causal state: the ShortConv window and the recurrent state."""

    conv: Tensor  # [B, conv_size - 1, 2·H·d_k + H·d_v]: the last projected (pre-conv) inputs
    recurrent: Tensor  # [B, H, d_k, d_v], fp32 (fp64 for an fp64 model)


@dataclass
class KDAProjections:
    """What the layer input ``x`` ``[B, T, d]`` is multiplied into (SPEC §1), in one `project` call."""

    conv_in: Tensor  # [B, T, 2·H·d_k + H·d_v]: the ShortConv's inputs, x W_q | x W_k | x W_v
    decay: Tensor  # [B, T, decay_rank]: x W_f1
    beta: Tensor  # [B, T, H]: β's logits
    gate: Tensor  # [B, T, H·d_v] (full-rank gate) or [B, T, output_gate_rank] (x W_g_a)


@dataclass
class KDAReplay:
    """What one KDA layer consumed for a run of (drafted) tokens — the projected ShortConv inputs and the
    recurrence's q, k, v, g, β — enough to advance its state by any prefix of the run without the other tokens
    (speculative decoding's replay, SPEC §8): ``T·(2·C + H·(2 + K))`` scalars per row instead of a
    ``H·K·V + (w−1)·C`` state snapshot per position."""

    conv_in: Tensor  # [B, T, C]
    q: Tensor  # [B, T, H, K]
    k: Tensor
    v: Tensor  # [B, T, H, V]
    g: Tensor  # [B, T, H, K]
    beta: Tensor  # [B, T, H]


def chunk_length(chunk_size: int, T: int) -> int:
    """The recurrence's chunk length for a prefill of ``T`` tokens: short pieces are not padded to a long chunk."""
    return min(chunk_size, -(-T // 16) * 16)


def advance(records: list[KDAReplay], states: list[KDAState], n: int, chunk_size: int | None = None
            ) -> list[KDAState]:
    """Each KDA layer's state before a run (``states``) after the first ``n`` tokens of its ``records``: token by
    token as decoding does, or with a ``chunk_size`` in the chunked form, as a prefill of those ``n`` tokens would
    (`chunk_length`: a prefix-cache cut inside a prefill piece). The layers' recurrences run as one batch,
    stacked along the batch dimension (every row of a KDA recurrence is independent; a model's KDA layers share one
    `KDAConfig`), so replaying a whole model costs one recurrence's calls, not one per layer."""
    if not records:
        return []
    rows = [s.recurrent.shape[0] for s in states]
    k, v, g, beta = (torch.cat([getattr(r, name)[:, :n] for r in records]) for name in ("k", "v", "g", "beta"))
    recurrent = torch.cat([s.recurrent for s in states])
    if chunk_size is not None:
        q = torch.cat([r.q[:, :n] for r in records])
        _, recurrent = kda.chunked(q, k, v, g, beta, initial_state=recurrent, chunk_size=chunk_length(chunk_size, n))
    else:
        recurrent = kda.state_after(k, v, g, beta, recurrent)
    return [KDAState(_window(s.conv, r.conv_in[:, :n]), state)
            for r, s, state in zip(records, states, recurrent.to(states[0].recurrent.dtype).split(rows), strict=True)]


def _window(conv: Tensor, inputs: Tensor) -> Tensor:
    """A ShortConv window ``conv`` ``[B, width − 1, C]`` after it read ``inputs`` ``[B, n, C]``: the last
    ``width − 1`` inputs of the two."""
    window = torch.cat([conv, inputs.to(conv.dtype)], dim=1)
    return window[:, window.shape[1] - conv.shape[1]:]


def advance_rows(records: list[KDAReplay], states: list[KDAState], counts: list[int]) -> list[list[KDAState]]:
    """`advance` token by token with a count per batch row: row b of every layer after the first ``counts[b]``
    tokens, as a list per row of each layer's batch-1 state. The rows run together, longest count first, and each
    drops out of the batch once its count is reached, so the work is each row's own (a speculative verification's
    rows keep runs of different lengths, `DecoderState.accept_rows`)."""
    L, B = len(records), len(counts)
    order = sorted(range(B), key=lambda b: -counts[b])
    device = states[0].recurrent.device
    index = torch.tensor(order, device=device)
    steps = max(counts, default=0)

    def rows_first(tensors: list[Tensor]) -> Tensor:  # [L] × [B, …] -> [B·L, …], rows in `order`, layers inner
        return torch.stack(tensors, dim=1).index_select(0, index).flatten(0, 1)

    k, v, g, beta = (rows_first([getattr(r, name)[:, :steps] for r in records]) for name in ("k", "v", "g", "beta"))
    recurrent, done, live, t = rows_first([s.recurrent for s in states]), [None] * B, B, 0
    while live:
        end = counts[order[live - 1]]  # the shortest count still running: every running row reads to there
        if end > t:
            rows = slice(0, live * L)
            recurrent, t = kda.state_after(k[rows, t:end], v[rows, t:end], g[rows, t:end], beta[rows, t:end],
                                           recurrent[rows]), end
        while live and counts[order[live - 1]] == t:  # these rows' counts are reached: their states are final
            live -= 1
            done[order[live]] = recurrent[live * L:(live + 1) * L]
    out = []
    for b, final in enumerate(done):
        final = final.to(states[0].recurrent.dtype)
        layers = []
        for layer, (r, s) in enumerate(zip(records, states, strict=True)):
            layers.append(KDAState(_window(s.conv[b:b + 1], r.conv_in[b:b + 1, :counts[b]]), final[layer:layer + 1]))
        out.append(layers)
    return out


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution without bias, then SiLU (SPEC §1).

    One depthwise convolution over the concatenated q|k|v channels is exactly the three per-branch
    convolutions. Its streaming state is the last ``width - 1`` inputs.
    """

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))

    def forward(self, x: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor]:
        """x ``[B, T, C]``, window ``[B, width-1, C]`` (zeros at the start) → (``[B, T, C]``, new window)."""
        B, T, C = x.shape
        width = self.weight.shape[1]
        if window is None:
            window = x.new_zeros(B, width - 1, C)
        full = torch.cat([window.to(x.dtype), x], dim=1)
        weight = self.weight.to(x.dtype)
        if T <= 64:  # decode and short prefill chunks: a windowed dot per channel beats a convolution call on CPU
            y = (full.unfold(1, width, 1) * weight).sum(-1)
        else:
            y = F.conv1d(full.transpose(1, 2), weight.unsqueeze(1), groups=C).transpose(1, 2)
        return F.silu(y), full[:, full.shape[1] - (width - 1):].clone(memory_format=torch.contiguous_format)


class KDALayer(nn.Module):
    """KDA sequence mixer: ``forward(x, state) -> (y, state)``.

    ``q = L2Norm(SiLU(Conv(x W_q)))``, ``k = L2Norm(SiLU(Conv(x W_k)))``, ``v = SiLU(Conv(x W_v))``; decay ``g``
    from the low-rank ``x W_f1 W_f2`` through the bounded K3 gate (or Kimi Linear's softplus gate);
    ``β = sigmoid(x W_b)``; the recurrence via `k3.ops.kda` (``chunked`` for T > 1, ``step`` for one
    token with a state); per-head RMSNorm times ``sigmoid(gate)``, the gate full-rank (K3) or low-rank
    ``g_a/g_b`` (Kimi Linear); output projection.
    """

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        c, d = config.kda, config.hidden_size
        self.num_heads, self.head_dim, self.value_dim = c.num_heads, c.head_dim, c.value_head_dim
        self.gate, self.g_min, self.chunk_size = c.gate, c.g_min, c.chunk_size
        self.decay_width = c.head_dim if c.decay == "channel" else 1  # per key channel (KDA) or per head (GDN)
        self.eps = config.rms_norm_eps
        self.initializer_range = config.initializer_range
        hk, hv = c.num_heads * c.head_dim, c.num_heads * c.value_head_dim
        self.q_proj = nn.Linear(d, hk, bias=False)
        self.k_proj = nn.Linear(d, hk, bias=False)
        self.v_proj = nn.Linear(d, hv, bias=False)
        self.conv = ShortConv(2 * hk + hv, c.conv_size)
        self.f_a_proj = nn.Linear(d, c.decay_rank, bias=False)
        self.f_b_proj = nn.Linear(c.decay_rank, c.num_heads * self.decay_width, bias=False)
        # The release stores A_log [a_log_size] and reads its first num_heads entries (SPEC §10).
        self.A_log = nn.Parameter(torch.empty(c.num_heads if c.a_log_size is None else c.a_log_size))
        self.dt_bias = nn.Parameter(torch.empty(c.num_heads * self.decay_width))
        self.b_proj = nn.Linear(d, c.num_heads, bias=False)
        if c.output_gate_rank:
            self.g_a_proj = nn.Linear(d, c.output_gate_rank, bias=False)
            self.g_b_proj = nn.Linear(c.output_gate_rank, hv, bias=False)
        else:
            self.g_proj = nn.Linear(d, hv, bias=False)
        self.o_norm = RMSNorm(c.value_head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(hv, d, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, initializer_range); the decay parameters per gate (`_init_bounded_gate`,
        `_init_softplus_gate`)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.initializer_range)
        nn.init.normal_(self.conv.weight, std=1.0 / math.sqrt(self.conv.weight.shape[1]))
        if self.dt_bias.is_meta:  # a skeleton (`k3.model.packed.skeleton`): its values will be loaded
            return
        with torch.no_grad():
            if self.gate == "bounded":
                self._init_bounded_gate()
            else:
                self._init_softplus_gate()

    def _init_bounded_gate(self) -> None:
        """K3's gate ``g = g_min·σ(e^A·(z + dt_bias))`` (SPEC §1) starts at Kimi Linear's initial decays: fla's
        draws ``A ~ U[1, 16]`` per head and ``dt ~ logU[1e-3, 1e-1]`` per entry give ``g₀ = −A·dt`` ∈ [−1.6, −1e-3]
        (memory time constants ``1/|g|`` of 0.6 to 1,000 tokens, most of them long), written as ``A_log = 0``,
        ``dt_bias = logit(g₀/g_min)`` (at most 1 − `BOUNDED_INIT_EPS` for a floor above −1.6).

        The paper gives no init. At init the low-rank ``z`` is ≈ 0, so ``g ≈ g₀``, and the gradient of ``g`` by
        ``z`` is ``g₀(1 − g₀/g_min)`` ≈ Kimi Linear's ``−A·σ(dt_bias)`` ≈ ``g₀``: both gates start alike in value and
        slope, and every channel stays live (``|∂α/∂logit| ≈ α·|g₀| ≥ ~1e-3``). Measured (`benchmarks/synthetic.py`,
        width 64, 800 steps): the previous init, ``g₀/g_min ~ U[ε, 1 − ε]`` (most channels forgetting within a
        token or two), learnt MQAR at 0.16–0.38 and Palindrome at 64 tokens at 0.11, where this one and the softplus
        gate learn both (≥ 0.94); fla's softplus init reused as is put the logit at −106…−3 (gradients below 1e-6).
        """
        self.A_log.zero_()
        A = self.dt_bias.new_empty(self.num_heads, 1).uniform_(1.0, 16.0)
        dt = self.dt_bias.new_empty(self.num_heads, self.decay_width).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        u = (A * dt / -self.g_min).clamp(max=1 - BOUNDED_INIT_EPS)
        self.dt_bias.copy_(torch.logit(u).flatten())

    def _init_softplus_gate(self) -> None:
        """Kimi Linear's gate ``g = −e^A·softplus(z + dt_bias)``: fla's init ``A ~ U[1, 16]``,
        ``dt_bias = softplus⁻¹(dt)``, ``dt ~ logU[1e-3, 1e-1]``."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def new_state(self, batch_size: int, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> KDAState:
        dtype = dtype or self.q_proj.weight.dtype
        channels, width = self.conv.weight.shape
        return KDAState(
            conv=torch.zeros(batch_size, width - 1, channels, device=device, dtype=dtype),
            recurrent=torch.zeros(batch_size, self.num_heads, self.head_dim, self.value_dim, device=device,
                                  dtype=torch.promote_types(dtype, torch.float32)),
        )

    def decay(self, low_rank: Tensor) -> Tensor:
        """The per-channel log-decay ``g`` ``[B, T, H, d_k]`` (fp32) from the low-rank ``x W_f1``; with
        ``kda.decay = "head"`` one decay per head, the same on its d_k channels (Gated DeltaNet's scalar gate)."""
        z = self.f_b_proj(low_rank).unflatten(-1, (self.num_heads, self.decay_width))
        if self.gate == "bounded":
            g = kda.bounded_decay(z, self.A_log[: self.num_heads], self.dt_bias, self.g_min)
        else:
            g = kda.softplus_decay(z, self.A_log[: self.num_heads], self.dt_bias)
        return g if self.decay_width == self.head_dim else g.expand(*g.shape[:-1], self.head_dim)

    def forward(self, x: Tensor, state: KDAState | None,
                record: list[KDAReplay] | None = None) -> tuple[Tensor, KDAState | None]:
        """``record`` (a list): append the run's `KDAReplay`, to advance ``state`` by a prefix of it later."""
        T = x.shape[1]
        projected = self.projections(x)
        replay, window = self.features(projected, None if state is None else state.conv)
        if record is not None:
            record.append(replay)
        q, k, v, g, beta = replay.q, replay.k, replay.v, replay.g, replay.beta
        initial = None if state is None else state.recurrent
        if T == 1 and initial is not None:
            o, final = (kda_fla.step if kda_fla.enabled(q, v) else kda.step)(q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                                                             beta[:, 0], initial)
            o = o.unsqueeze(1)
        elif record is not None and initial is not None and T <= kda.TILE and torch.compiler.is_compiling():
            o, final = kda.steps(q, k, v, g, beta, initial)  # traced verification: generated kernels, no solve
        elif kda_fla.enabled(q, v):  # fla's Triton kernels on CUDA (optional; `k3.ops.kda_fla`)
            o, final = kda_fla.chunked(q, k, v, g, beta, initial)
        else:
            floor = self.g_min if self.gate == "bounded" else float("-inf")
            o, final = kda.chunked(q, k, v, g, beta, initial_state=initial,
                                   chunk_size=chunk_length(self.chunk_size, T), decay_floor=floor)
        return self.readout(projected, o), None if state is None else KDAState(conv=window, recurrent=final)

    def projections(self, x: Tensor) -> KDAProjections:
        """``x`` ``[B, T, d]`` times the q, k, v, decay, β and output-gate weights (one product where `project`
        stacks them)."""
        gate = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        q, k, v, decay, beta, gate = project(x, self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                                             gate)
        return KDAProjections(torch.cat([q, k, v], -1), decay, beta, gate)

    def features(self, projected: KDAProjections, window: Tensor | None) -> tuple[KDAReplay, Tensor]:
        """The recurrence's inputs after the ShortConv ``window`` (None: zeros), as a `KDAReplay`, and the new
        window."""
        H, K, V = self.num_heads, self.head_dim, self.value_dim
        qkv, window = self.conv(projected.conv_in, window)
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        q, k = kda.l2norm(q.unflatten(-1, (H, K))), kda.l2norm(k.unflatten(-1, (H, K)))
        beta = torch.sigmoid(_at_least_fp32(projected.beta))
        g = self.decay(projected.decay)
        return KDAReplay(projected.conv_in, q, k, v.unflatten(-1, (H, V)), g, beta), window

    def readout(self, projected: KDAProjections, o: Tensor) -> Tensor:
        """The layer output from the recurrence's output ``o`` ``[B, T, H, V]``: gated per-head norm, projection."""
        H, V = self.num_heads, self.value_dim
        gate = projected.gate if hasattr(self, "g_proj") else self.g_b_proj(projected.gate)
        o = self.o_norm(_at_least_fp32(o)) * torch.sigmoid(_at_least_fp32(gate.unflatten(-1, (H, V))))
        return self.o_proj(o.flatten(2).to(projected.conv_in.dtype))
