"""fla's Triton KDA kernels as an optional backend on CUDA (issue 39; fla-core 0.6.0, ``fla.ops.kda``).

`k3.model.sequence.kda.KDALayer` runs a prompt's recurrence through fla's ``chunk_kda`` and a decode step through its
``fused_recurrent_kda`` where `enabled` says so: a CUDA tensor, fla importable and ``K3_KDA_BACKEND`` not ``torch``
(``auto``, the default, uses fla when it imports; ``fla`` makes a failed import an error). Everything else — the CPU,
fp64, key widths above fla's 256, training, no fla — runs `k3.ops.kda`, which the tests hold to the loop oracle.
fla computes the same recurrence (SPEC §1, Eq. 1) with the same layout (``[B, T, H, K]``, state ``[B, H, K, V]``) and
already-activated log-decay ``g``; its products run on tensor cores (TF32 in fp32), so it agrees with `k3.ops.kda`
within `TOLERANCE` of the output's largest magnitude rather than to fp32 rounding (measured: ``benchmarks/gpu.py``).

Inference only: both kernels are called through ``k3::fla_chunk_kda`` / ``k3::fla_recurrent_kda``, custom operators
that `torch.compile` keeps whole in a graph (prefill chunks and decode steps of `k3.model.compiled` on CUDA). A step
that needs gradients (training) runs `k3.ops.kda` until fla's backward has been checked against it on a GPU.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

__all__ = ["TOLERANCE", "enabled", "chunked", "step"]

#: Largest |fla − k3.ops.kda| / max |k3.ops.kda| of a layer's output, by input dtype (``tests/ops/test_kda_fla.py``).
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}
_SETTINGS = ("auto", "fla", "torch")


def _setting() -> str:
    value = os.environ.get("K3_KDA_BACKEND", "auto")
    if value not in _SETTINGS:
        raise ValueError(f"K3_KDA_BACKEND: expected one of {_SETTINGS}, got {value!r}")
    return value


_MODULE: dict[str, object] = {}  # "kda": fla.ops.kda once imported; "error": why not; "use": `_available`'s last


def _fla():  # noqa: ANN202
    """``fla.ops.kda``, or None where it does not import (the error kept for ``K3_KDA_BACKEND=fla``)."""
    if "kda" not in _MODULE:
        try:
            _MODULE["kda"] = importlib.import_module("fla.ops.kda")
        except Exception as err:  # an optional dependency: any import failure means "not available"
            _MODULE["kda"], _MODULE["error"] = None, f"{type(err).__name__}: {err}"
    return _MODULE["kda"]


def _available() -> bool:
    """fla is to be used where it can: ``K3_KDA_BACKEND`` is not ``torch`` and fla imports (``fla``: or an error).
    While `torch.compile` traces, the answer of the last call outside it (no import inside a graph; none yet: no)."""
    if torch.compiler.is_compiling():
        return bool(_MODULE.get("use", False))
    setting = _setting()
    if setting == "fla" and _fla() is None:
        raise RuntimeError(f"K3_KDA_BACKEND=fla but fla.ops.kda does not import ({_MODULE['error']})")
    _MODULE["use"] = setting != "torch" and _fla() is not None
    return _MODULE["use"]


def enabled(q: Tensor, v: Tensor) -> bool:
    """Whether the recurrence of these inputs runs on fla: CUDA, fp32/bf16/fp16, K ≤ 256, no gradient needed (fla's
    backward is not yet checked against ours on a GPU: training keeps `k3.ops.kda`), and `_available`."""
    inference = not (torch.is_grad_enabled() and (q.requires_grad or v.requires_grad))
    return (q.is_cuda and q.dtype in TOLERANCE and v.dtype == q.dtype and q.shape[-1] <= 256 and inference
            and _available())


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`k3.ops.kda.chunked` on fla's ``chunk_kda``: ``(o [B,T,H,V] in v's dtype, final state [B,H,K,V] fp32)``;
    ``initial_state`` None is the zero state."""
    state = _zero_state(q, v) if initial_state is None else initial_state.float()
    return torch.ops.k3.fla_chunk_kda(q, k, v, g.float(), beta.float(), state)


def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """`k3.ops.kda.step` on fla's ``fused_recurrent_kda``: q, k, g ``[B,H,K]``, v ``[B,H,V]``, beta ``[B,H]``;
    returns ``(o [B,H,V], new state [B,H,K,V] fp32)``."""
    o, final = torch.ops.k3.fla_recurrent_kda(*(t.unsqueeze(1) for t in (q, k, v)), g.float().unsqueeze(1),
                                              beta.float().unsqueeze(1), state.float())
    return o.squeeze(1), final


def _zero_state(q: Tensor, v: Tensor) -> Tensor:
    B, _, H, K = q.shape
    return q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)


@torch.library.custom_op("k3::fla_chunk_kda", mutates_args=())
def _chunk_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    o, final = _fla().chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    return o.to(v.dtype), final


@_chunk_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(v), torch.empty_like(state)


@torch.library.custom_op("k3::fla_recurrent_kda", mutates_args=())
def _recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  state: Tensor) -> tuple[Tensor, Tensor]:
    o, final = _fla().fused_recurrent_kda(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True)
    return o.to(v.dtype), final


@_recurrent_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(v), torch.empty_like(state)
