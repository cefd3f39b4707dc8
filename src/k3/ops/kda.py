"""Kimi Delta Attention as pure tensor functions (SPEC §1, Eq. 1–6).

Layout follows fla and transformers: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``;
state ``[B, H, K, V]``. ``g`` is the already-activated log-decay (``g <= 0``); the recurrence is

    S_t = (I - β_t k_t k_tᵀ) Diag(exp g_t) S_{t-1} + β_t k_t v_tᵀ,     o_t = scale · S_tᵀ q_t

Three forms compute it and are tested equal:

* `recurrent` — the token-by-token oracle (a loop of `step`), obviously right;
* `chunked` — the chunkwise-parallel form for training and prefill;
* `segment_summary` / `compose` — a segment acts on its incoming state as ``S ↦ M S + U``.

Inputs may be any float dtype; arithmetic runs in fp32 (fp64 when any input is fp64) and the
returned state has that dtype; outputs take ``v``'s dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "recurrent",
    "chunked",
    "step",
    "state_after",
    "segment_summary",
    "compose",
    "bounded_decay",
    "softplus_decay",
    "l2norm",
]

TILE = 16  # sub-chunk tile: exponents are anchored inside 16-token tiles


# ---------------------------------------------------------------------- gates and norm
def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """Regularised L2 norm ``x / sqrt(||x||² + eps)`` (SPEC §1): norm < 1 and zero stays zero."""
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _gate_input(z: Tensor, A_log: Tensor, dt_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    if z.dim() < 2 or not z.is_floating_point():
        raise ValueError(f"z: expected a float tensor [..., H, K], got {z.dtype} {list(z.shape)}")
    H, K = z.shape[-2:]
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    if A_log.numel() != H:
        raise ValueError(f"A_log: expected {H} elements (one per head), got shape {list(A_log.shape)}")
    z = z.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias: expected H*K = {H * K} elements, got shape {list(dt_bias.shape)}")
        z = z + dt_bias.to(dtype).reshape(H, K)
    return z, A_log.to(dtype).reshape(H, 1).exp()


def bounded_decay(z: Tensor, A_log: Tensor, dt_bias: Tensor | None, g_min: float = -5.0) -> Tensor:
    """K3's bounded log-decay ``g = g_min · sigmoid(exp(A) · (z + dt_bias))`` ∈ (g_min, 0) (SPEC §1).

    ``z``: ``[..., H, K]``; ``A_log``: H elements; ``dt_bias``: H·K elements. Returns fp32 (fp64 for fp64 z).
    """
    if not g_min < 0:
        raise ValueError(f"g_min: must be < 0, got {g_min}")
    z, a = _gate_input(z, A_log, dt_bias)
    return g_min * torch.sigmoid(a * z)


def softplus_decay(z: Tensor, A_log: Tensor, dt_bias: Tensor | None) -> Tensor:
    """Kimi Linear's unbounded log-decay ``g = -exp(A) · softplus(z + dt_bias)`` (SPEC §1)."""
    z, a = _gate_input(z, A_log, dt_bias)
    return -a * F.softplus(z)


# ---------------------------------------------------------------------- validation
def _compute_dtype(*xs: Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _check_float(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")


def _check_shape(name: str, x: Tensor, expected: list[int], layout: str) -> None:
    _check_float(name, x)
    if list(x.shape) != expected:
        raise ValueError(f"{name}: expected shape {layout} = {expected}, got {list(x.shape)}")


def _validate(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None,
              single_token: bool = False, lead_name: str = "q") -> tuple[int, ...]:
    """Check shapes/dtypes of a sequence (``[B,T,H,*]``) or a single token (``[B,H,*]``); the others' shapes are read
    from ``q`` (named ``lead_name`` in errors: a function without queries passes its keys there)."""
    _check_float(lead_name, q)
    want = 3 if single_token else 4
    if q.dim() != want:
        layout = "[B, H, K]" if single_token else "[B, T, H, K]"
        raise ValueError(f"{lead_name}: expected {want} dims {layout}, got shape {list(q.shape)}")
    lead, K = list(q.shape[:-1]), q.shape[-1]
    _check_shape("k", k, lead + [K], f"like {lead_name}")
    _check_shape("g", g, lead + [K], f"like {lead_name}")
    _check_float("v", v)
    if v.dim() != want or list(v.shape[:-1]) != lead:
        raise ValueError(f"v: expected shape {lead + ['V']} (leading dims of {lead_name}), got {list(v.shape)}")
    V = v.shape[-1]
    _check_shape("beta", beta, lead, f"{lead_name}'s shape without the last dim")
    B, H = lead[0], lead[-1]
    if state is not None:
        _check_shape("initial_state" if not single_token else "state", state, [B, H, K, V], "[B, H, K, V]")
    return (B, *lead[1:-1], H, K, V)


# ---------------------------------------------------------------------- the recurrence
def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None,
         scale: float | None = None) -> tuple[Tensor, Tensor]:
    """One token from a state (SPEC Eq. 1): q, k, g ``[B,H,K]``; v ``[B,H,V]``; beta ``[B,H]``.

    Decay, then erase along k, then write; the query reads the *updated* state. Decode's fast path
    (tested against `recurrent`): the decay moves onto the reading vectors, ``[k; q]ᵀ Diag(α) S = [α∘k;
    α∘q]ᵀ S`` (one batched product reads the old state), ``δ = v − kᵀS'``, the new state ``α∘S + β k δᵀ``
    is one multiply-add over it (one generated kernel when compiled), and the output is ``qᵀS' + (q·βk) δ``
    — two passes over the state instead of seven. Returns ``(o [B,H,V] in v's dtype, new state [B,H,K,V])``.
    """
    B, H, K, V = _validate(q, k, v, g, beta, state, single_token=True)
    dtype = _compute_dtype(q, k, v, g, beta, state)
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    S = q.new_zeros(B * H, K, V) if state is None else state.to(dtype).reshape(B * H, K, V)
    alpha = g.exp().reshape(B * H, 1, K)
    read = (torch.stack([k, q], dim=2).reshape(B * H, 2, K) * alpha) @ S  # [kᵀS'; qᵀS'], S' = Diag(α) S
    bk = (beta.unsqueeze(-1) * k).reshape(B * H, K, 1)
    delta = v.reshape(B * H, 1, V) - read[:, :1]
    S = torch.addcmul(S * alpha.transpose(1, 2), bk, delta)  # decay, erase along k, write v: a new tensor
    o = read[:, 1:] + (q.reshape(B * H, 1, K) @ bk) * delta
    return (o.reshape(B, H, V) * scale).to(v.dtype), S.view(B, H, K, V)


def steps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None,
          scale: float | None = None) -> tuple[Tensor, Tensor]:
    """A short run from a state as `step` after `step` (SPEC Eq. 1): q, k, g ``[B,T,H,K]``; v ``[B,T,H,V]``;
    beta ``[B,T,H]``. For compiled verification of a few drafted tokens: T fused steps lower to generated
    kernels, where the chunked form's triangular solve is an opaque library call. Returns ``(o [B,T,H,V],
    final state)``."""
    outputs = []
    for t in range(q.shape[1]):
        o, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, scale)
        outputs.append(o)
    return torch.stack(outputs, dim=1), state


def state_after(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """The state after a short run from ``state`` (SPEC Eq. 1), without the outputs: k, g ``[B,T,H,K]``; v
    ``[B,T,H,V]``; beta ``[B,T,H]``; state ``[B,H,K,V]``. What `steps` leaves, for replaying an accepted prefix
    of speculative tokens (SPEC §8): the queries are not read, and the decays, erase keys and write keys of every
    token are formed at once, so each token costs three operators over the state — ``δ = v − (α∘k)ᵀS``, then
    ``α∘S + β k δᵀ`` — where `step` runs a dozen. Returns the state ``[B,H,K,V]`` in the compute dtype."""
    B, T, H, K, V = _validate(k, k, v, g, beta, state, lead_name="k")
    dtype = _compute_dtype(k, v, g, beta, state)
    k, v, g, beta = (x.to(dtype) for x in (k, v, g, beta))

    def tokens_first(x: Tensor, *shape: int) -> Tensor:  # [B, T, H, …] -> [T, B·H, …]
        return x.transpose(0, 1).reshape(T, B * H, *shape)

    alpha = g.exp()
    read = tokens_first(k * alpha, 1, K)  # (α∘k)ᵀ S = kᵀ Diag(α) S
    decay = tokens_first(alpha, K, 1)
    write = tokens_first(beta.unsqueeze(-1) * k, K, 1)
    values = tokens_first(v, 1, V)
    S = state.to(dtype).reshape(B * H, K, V)
    for t in range(T):
        delta = torch.baddbmm(values[t], read[t], S, alpha=-1)  # v − kᵀS'
        S = torch.addcmul(S * decay[t], write[t], delta)
    return S.view(B, H, K, V)


def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
              initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token oracle, Eq. 1 as written: for t = 0..T-1, ``S ← Diag(α_t) S``, ``S ← S + β_t k_t
    (v_t − k_tᵀ S)ᵀ``, ``o_t = q_tᵀ S · scale``. Returns ``(o [B,T,H,V], final state)``."""
    B, T, H, K, V = _validate(q, k, v, g, beta, initial_state)
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        q_t, k_t, v_t, g_t, b_t = (x[:, t].to(dtype) for x in (q, k, v, g, beta))
        S = S * g_t.exp().unsqueeze(-1)
        recalled = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # kᵀ S, [B, H, V]
        S = S + (b_t[..., None] * k_t).unsqueeze(-1) * (v_t - recalled).unsqueeze(-2)
        outputs.append((q_t.unsqueeze(-2) @ S).squeeze(-2) * scale)
    o = torch.stack(outputs, dim=1).to(v.dtype) if outputs else v.new_zeros(B, 0, H, V)
    return o, S


# ---------------------------------------------------------------------- chunkwise-parallel form
# Largest exponent a diagonal tile may form: anchored at the tile start, a column factor reaches
# exp(16·|g|), which must stay finite in the compute dtype (fp32 max ≈ e^88.7, fp64 ≈ e^709).
_MAX_EXPONENT = {torch.float32: 80.0, torch.float64: 700.0}
_CHUNK_HEADS_PER_BLOCK = 32  # chunks·heads whose intermediates are computed at once
# Decay factors below e^-L are flushed to exactly 0 (a dropped term is < e^-L times its undecayed size,
# far below the dtype's rounding), so no product of two factors leaves the normal range: CPUs compute
# subnormal floats many times slower, and strongly decayed chunks are full of them otherwise. Under autocast the
# products come out in bf16 (fp32's range: the same L) or fp16, whose normal range (e^-9.7) is too short to flush in:
# nothing is flushed there.
_FLUSH_EXPONENT = {torch.float32: 30.0, torch.float64: 300.0, torch.bfloat16: 30.0, torch.float16: math.inf}


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Σ of the preceding entries along a short ``dim`` (the tiles of a chunk), as running sums: a few adds that
    fuse with their neighbours, where a library ``cumsum`` costs a call of its own (a sum, never a difference)."""
    sums = [torch.zeros_like(x.narrow(dim, 0, 1))]
    for i in range(x.shape[dim] - 1):
        sums.append(sums[-1] + x.narrow(dim, i, 1))
    return torch.cat(sums, dim)


def _decay(x: Tensor) -> Tensor:
    """``e^x`` for a log-decay ``x <= 0``, exactly 0 where ``x < -L`` (``_FLUSH_EXPONENT``)."""
    floor = -_FLUSH_EXPONENT[x.dtype]
    return x.clamp(min=floor).exp() * (x >= floor)  # never exponentiates -inf or subnormal results: slow on CPU


def _flush(x: Tensor) -> Tensor:
    """``x`` with entries below e^-L in magnitude set to 0, for dimensionless terms (|x| ≲ 1)."""
    return torch.where(x.abs() < math.exp(-_FLUSH_EXPONENT[x.dtype]), 0.0, x)


def _unit_lower_inverse(A: Tensor) -> Tensor:
    """``(I + A)⁻¹`` for the strictly lower part of ``A`` ``[N, C, C]``, by 16×16 tiles, flushed (`_flush`).

    The diagonal tiles are unit-triangular solves; tile row a below them is ``-Xₐₐ (A[a, :a] X[:a, :a])``.
    Flushing every operand keeps the products free of subnormals: a whole-chunk triangular solve of a
    strongly decayed A forms long chains of tiny products, several-fold slower on CPUs.
    """
    N, C, _ = A.shape
    nt = C // TILE
    A = _flush(A)
    diag = A.view(N, nt, TILE, nt, TILE).diagonal(0, 1, 3).permute(0, 3, 1, 2)  # [N, nt, 16, 16]
    eye = torch.eye(TILE, dtype=A.dtype, device=A.device).expand(N, nt, TILE, TILE)
    X_diag = _flush(torch.linalg.solve_triangular(diag, eye, upper=False, unitriangular=True))
    X = X_diag[:, 0]  # the inverse of the leading a tiles, grown one tile row at a time (autograd-safe)
    for a in range(1, nt):
        rows, lead = slice(a * TILE, (a + 1) * TILE), slice(0, a * TILE)
        row = _flush(-(X_diag[:, a] @ _flush(A[:, rows, lead] @ X)))
        X = torch.cat([F.pad(X, (0, TILE)), torch.cat([row, X_diag[:, a]], 2)], 1)
    return X


def _chunk_terms(q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                 g_lowest: float) -> dict[str, Tensor]:
    """Per-chunk terms of the chunkwise form (SPEC §1 form 2), all chunks at once.

    Inputs are ``[N, C, *]`` (N = chunks·batch·heads) in the compute dtype; ``g_lowest`` = min g.
    With ``G`` the in-chunk cumulative log-decay, ``A`` the strictly causal
    ``β_i Σ_c k_ic k_jc e^{G_ic - G_jc}`` and ``T = (I + A)⁻¹ Diag(β)``, returns ``W = T (K⊙e^G)``,
    ``U = T V`` (the chunk's pseudo-values are ``U - W S₀``), ``Kd = K⊙e^{G_C - G}``, ``decay = e^{G_C}``
    and, given q, the unscaled ``Qe = Q⊙e^G`` and causal ``Aqk_ij = Σ_c q_ic k_jc e^{G_ic - G_jc}``. Then

        S_C = Diag(decay) S₀ + Kdᵀ (U - W S₀),      O = scale · (Qe S₀ + Aqk (U - W S₀)).

    Exponents never overflow: ``G`` is kept as 16-token tile-local cumulative sums plus tile totals;
    off the diagonal tiles, rows carry the decay since their tile start and columns the decay to their
    tile end (times the whole tiles in between), so every factor is ≤ 1; a diagonal 16×16 tile
    anchors at its first token when the gate is bounded (16·|g| ≤ 80 in fp32) and otherwise masks the
    non-causal differences to -inf before exponentiating. Tile-local sums also keep the exponent
    differences free of the cancellation a chunk-wide cumulative sum would suffer. Factors ≤ 1 below
    e^-L, and entries of (I + A)⁻¹ below e^-L, are flushed to 0 (`_decay`): every product's operands and
    results then stay normal floats, whatever the decay (drop errors < e^-L relative, L = 30 in fp32).
    """
    N, C, K = k.shape
    nt = C // TILE
    tiles = lambda x: x.view(N, nt, TILE, x.shape[-1])  # noqa: E731
    gt, kt = tiles(g), tiles(k)
    Gl = gt.cumsum(2)  # tile-local cumulative log-decay
    tau = Gl[:, :, -1]  # [N, nt, K] tile totals
    to_end = tau.unsqueeze(2) - Gl  # log-decay from each token to its tile end
    # Columns of every tile b < a, decayed from their token to tile a's start: [N, 16a, K] for each a
    # (a = nt: to the chunk end, which is Kd).
    cols = {
        a: (kt[:, :a] * _decay(to_end[:, :a] + _exclusive_cumsum(tau[:, :a].flip(1), 1).flip(1).unsqueeze(2)))
        .view(N, -1, K)
        for a in range(1, nt + 1)
    }
    causal = torch.ones(TILE, TILE, dtype=torch.bool, device=k.device).tril()
    bounded = -g_lowest * TILE <= _MAX_EXPONENT[k.dtype]
    if bounded:  # anchor at the tile start: columns carry e^{-Gl_j} ≤ e^{16|g|}, finite (its gradient too)
        cols_diag = (kt * (-Gl).exp()).transpose(-1, -2)
        from_start = Gl.exp()  # normal (Gl ≥ -_MAX_EXPONENT); not flushed: it meets a column factor ≥ 1
        off_start = from_start * (Gl >= -_FLUSH_EXPONENT[k.dtype])  # `_decay(Gl)` from the same exponentials
    else:
        off_start = _decay(Gl)  # rows decayed since their tile start, for the off-diagonal tiles
    blocks = []  # Akk and, given q, Aqk
    for x in [kt] if q is None else [kt, tiles(q)]:
        A = k.new_zeros(N, nt, TILE, C)  # one block row per tile
        x_off = x * off_start
        for a in range(1, nt):
            A[:, a, :, : a * TILE] = x_off[:, a] @ cols[a].transpose(1, 2)
        if bounded:
            diag = torch.where(causal, (x * from_start) @ cols_diag, 0.0)
        else:
            gaps = (Gl.unsqueeze(3) - Gl.unsqueeze(2)).masked_fill(~causal[..., None], float("-inf"))
            diag = torch.einsum("naic,najc,naijc->naij", x, kt, _decay(gaps))
        A.view(N, nt, TILE, nt, TILE).diagonal(0, 1, 3).copy_(diag.permute(0, 2, 3, 1))
        blocks.append(A.view(N, C, C))

    # T = (I + Akk)⁻¹ Diag(β), inverted by tiles (only the strictly lower part of Akk is read), then
    # batched matmuls — on CPU cheaper than solving against K+V columns.
    Akk = blocks[0] * beta.unsqueeze(-1)
    T = _unit_lower_inverse(Akk) * beta.unsqueeze(1)
    before = _exclusive_cumsum(tau, 1).unsqueeze(2)  # log-decay from the chunk start to each tile start
    from_chunk_start = _decay(Gl + before)
    terms = {
        "W": T @ (kt * from_chunk_start).view(N, C, K),
        "U": T @ v,
        "Kd": cols[nt],
        "decay": _decay(before[:, -1, 0] + tau[:, -1]),
    }
    if q is not None:
        terms["Qe"] = (tiles(q) * from_chunk_start).view(N, C, K)
        terms["Aqk"] = blocks[1]
    return terms


def _to_chunks(x: Tensor, chunk_size: int, dtype: torch.dtype) -> Tensor:
    """``[B, T, H, *]`` → chunk-major ``[NC, B·H, C, *]``, zero-padded in time (padding leaves the state unchanged)."""
    x = x.to(dtype)
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    B, T, H, D = x.shape
    pad = (-T) % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
    NC = (T + pad) // chunk_size
    return x.view(B, NC, chunk_size, H, D).permute(1, 0, 3, 2, 4).reshape(NC, B * H, chunk_size, D)


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % TILE:
        raise ValueError(f"chunk_size: must be a positive multiple of {TILE}, got {chunk_size!r}")


def _check_decay(g: Tensor) -> float:
    """Require a finite log-decay ``g <= 0``; return its minimum (0.0 when empty)."""
    if not g.numel():
        return 0.0
    lowest, highest = (float(x) for x in torch.aminmax(g.detach()))
    if not (lowest > float("-inf") and highest <= 0):  # NaN fails both comparisons
        raise ValueError(f"g: the log-decay must be finite and <= 0 everywhere, got range [{lowest}, {highest}]")
    return lowest


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
            initial_state: Tensor | None = None, chunk_size: int = 64,
            decay_floor: float = float("-inf")) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel KDA (SPEC §1 form 2) for training and prefill; equals `recurrent`.

    Any ``T`` (the tail chunk is zero-padded), autograd-capable. The intra-chunk terms of every chunk
    are computed at once (`_chunk_terms`); a short loop over chunks carries the state (two small
    matmuls per chunk), then one batched matmul produces every output.
    Under ``torch.compile`` the decay check (a data-dependent branch) is skipped and ``decay_floor``, a known
    lower bound of ``g`` (the bounded gate's ``g_min``), picks the intra-tile form.
    Returns ``(o [B,T,H,V] in v's dtype, final state [B,H,K,V])``.
    """
    B, T, H, K, V = _validate(q, k, v, g, beta, initial_state)
    _check_chunk_size(chunk_size)
    g_lowest = decay_floor if torch.compiler.is_compiling() else _check_decay(g)
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B * H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype).reshape(
        B * H, K, V)
    if T == 0:
        return v.new_zeros(B, 0, H, V), S.view(B, H, K, V)
    qc, kc, vc, gc, bc = (_to_chunks(x, chunk_size, dtype) for x in (q, k, v, g, beta))
    NC, BH, C = kc.shape[:3]
    # Blocks of chunks keep the intermediates cache-sized; the state is carried between them.
    block = max(1, _CHUNK_HEADS_PER_BLOCK // BH)
    outputs = []
    # split (not slicing) so that backward assembles each input's gradient once, not once per block
    for qb, kb, vb, gb, bb in zip(*(x.split(block) for x in (qc, kc, vc, gc, bc))):
        t = _chunk_terms(qb.flatten(0, 1), kb.flatten(0, 1), vb.flatten(0, 1), gb.flatten(0, 1),
                         bb.flatten(0, 1)[..., 0], g_lowest)
        nb = t["W"].shape[0] // BH
        W, U, decay = (t[name].view(nb, BH, *t[name].shape[1:]) for name in ("W", "U", "decay"))
        Kd_T, decay = t["Kd"].transpose(1, 2).view(nb, BH, K, C), decay.unsqueeze(-1)
        starts, values = [], []
        for U_c, W_c, decay_c, Kd_T_c in zip(U.unbind(), W.unbind(), decay.unbind(), Kd_T.unbind()):
            starts.append(S)  # the sequential part: two [C,K]x[K,V]-sized products per chunk
            u = torch.baddbmm(U_c, W_c, S, alpha=-1)  # pseudo-values U - W S
            values.append(u)
            S = torch.baddbmm(S * decay_c, Kd_T_c, u)
        # O = scale · (Qe S₀ + Aqk (U - W S₀)) for every chunk of the block at once.
        outputs.append(torch.baddbmm(t["Aqk"] @ torch.cat(values), t["Qe"], torch.cat(starts), beta=scale, alpha=scale))
    o = torch.cat(outputs).view(NC, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, NC * C, H, V)[:, :T]
    return o.to(v.dtype), S.view(B, H, K, V)


# ---------------------------------------------------------------------- affine segment summaries
def segment_summary(k: Tensor, g: Tensor, beta: Tensor, v: Tensor,
                    chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Affine summary of a segment (SPEC §1 form 4): running it from any state S gives ``M S + U``.

    k, g ``[B,T,H,K]``; beta ``[B,T,H]``; v ``[B,T,H,V]``. Returns M ``[B,H,K,K]`` and U ``[B,H,K,V]``
    — fixed size whatever T, the basis of context parallelism.
    """
    _check_float("k", k)
    if k.dim() != 4:
        raise ValueError(f"k: expected 4 dims [B, T, H, K], got shape {list(k.shape)}")
    B, T, H, K, V = _validate(k, k, v, g, beta, None)
    _check_chunk_size(chunk_size)
    g_lowest = _check_decay(g)
    dtype = _compute_dtype(k, v, g, beta)
    M = torch.eye(K, dtype=dtype, device=k.device).expand(B * H, K, K)
    U = k.new_zeros(B * H, K, V, dtype=dtype)
    if T:
        kc, vc, gc, bc = (_to_chunks(x, chunk_size, dtype) for x in (k, v, g, beta))
        NC, BH = kc.shape[:2]
        t = _chunk_terms(None, kc.flatten(0, 1), vc.flatten(0, 1), gc.flatten(0, 1), bc.flatten(0, 1)[..., 0], g_lowest)
        Kd_T = t["Kd"].transpose(1, 2)
        Mc = (torch.diag_embed(t["decay"]) - Kd_T @ t["W"]).view(NC, BH, K, K)  # S ↦ Mc S + Nc per chunk
        Nc = (Kd_T @ t["U"]).view(NC, BH, K, V)
        for M_c, N_c in zip(Mc.unbind(), Nc.unbind()):
            M, U = M_c @ M, torch.baddbmm(N_c, M_c, U)
    return M.reshape(B, H, K, K), U.reshape(B, H, K, V)


def compose(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Summary of running ``first`` then ``second``: ``S ↦ M₂(M₁S + U₁) + U₂``. Associative, not commutative."""
    (M1, U1), (M2, U2) = first, second
    if M1.shape != M2.shape or U1.shape != U2.shape:
        raise ValueError(f"compose: summaries differ in shape: M {list(M1.shape)} vs {list(M2.shape)}, "
                         f"U {list(U1.shape)} vs {list(U2.shape)}")
    return M2 @ M1, M2 @ U1 + U2
