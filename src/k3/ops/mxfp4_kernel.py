"""The optional CPU kernel of the packed MXFP4 product (issue 37; SPEC §10): ``x @ W.T`` reading W's packed bytes,
and a whole routed-experts layer on packed weights in one call (`experts`).

`k3.ops.mx.dequantize` then a matmul decodes every weight to fp32 first; at decode batch sizes that costs far more
than the product. ``mxfp4_gemv.c`` (in this package) decodes each 32-element block in registers and multiplies it
by every row of ``x`` (AVX-512: one permute of the E2M1 table per 16 nibbles). It is compiled on first use by the
system's C compiler (``cc -O3 -march=native -fopenmp``) into ``$XDG_CACHE_HOME/k3/kernels`` (default
``~/.cache``), keyed by its source, the flags and this CPU's feature flags, and loaded with `ctypes`. Where there is
no compiler, the build fails, the tensors are not on the CPU, or ``K3_MXFP4_KERNEL=0``, `available` is False and
callers keep the plain PyTorch path (the default fallback, and the reference this kernel is tested against).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from k3.files import user_cache

__all__ = ["ACTIVATIONS", "FLAGS", "available", "build", "cpu_flags", "experts", "gemv"]

_SOURCE = Path(__file__).with_name("mxfp4_gemv.c")
ACTIVATIONS = ("situ", "swiglu")  # the kernel's activation codes 0 and 1 (k3.model.width.ACTIVATIONS)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # empty until the first build attempt, then [the library or None]


def cpu_flags() -> str:
    """This CPU's feature flags (``/proc/cpuinfo``), what code built for it depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line for line in lines if line.startswith(("flags", "Features"))), platform.processor())


def build(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """Compile with ``flags`` (or find in the cache) and load the kernel; None, with a warning, when that is not
    possible. (Other flags than the default ones give the portable loop: ``-mno-avx512f``.)"""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), cpu_flags().encode(),
                                      compiler.encode()])).hexdigest()[:16]
    try:
        cache = user_cache("kernels")
        target = cache / f"mxfp4_gemv-{key}.so"
        if not target.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built)], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: a concurrent build writes the same bytes
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:  # RuntimeError: no home directory
        detail = getattr(err, "stderr", b"") or b""
        warnings.warn(f"MXFP4 kernel unavailable, using the PyTorch path: {err} {detail.decode(errors='replace')}",
                      RuntimeWarning, stacklevel=3)
        return None
    library.mxfp4_gemv.restype = ctypes.c_int
    library.mxfp4_gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.mxfp4_experts.restype = ctypes.c_int
    library.mxfp4_experts.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int64] * 5 + [ctypes.c_int]
                                      + [ctypes.c_float] * 2 + [ctypes.c_int])
    return library


def _kernel() -> ctypes.CDLL | None:
    if not _library:
        with _lock:
            if not _library:
                _library.append(None if os.environ.get("K3_MXFP4_KERNEL") == "0" else build())
    return _library[0]


def available(x: Tensor) -> bool:
    """Whether `gemv` runs for ``x``: an fp32 CPU tensor that needs no gradient, and the kernel built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad) \
        and _kernel() is not None


def gemv(x: Tensor, packed: Tensor, scale: Tensor, library: ctypes.CDLL | None = None) -> Tensor:
    """``x`` fp32 ``[B, K]`` (CPU) times the MXFP4 weight ``(packed [N, K/2], scale [N, K/32])`` transposed:
    ``[B, N]`` fp32, equal to ``x @ dequantize(packed, scale).T`` up to the order of the sums (``library``: one
    `build` made, else the default one)."""
    library = library or _kernel()
    if library is None:
        raise RuntimeError("the MXFP4 kernel is not available (check `available` first)")
    (B, K), (N, half) = x.shape, packed.shape
    if x.dtype != torch.float32 or packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or half * 2 != K \
            or K % 32 or scale.shape != (N, K // 32):
        raise ValueError(f"MXFP4 gemv: x fp32 [B, K], packed uint8 [N, K/2], scale uint8 [N, K/32] with K a "
                         f"multiple of 32; got {x.dtype} {list(x.shape)}, {packed.dtype} {list(packed.shape)}, "
                         f"{scale.dtype} {list(scale.shape)}")
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous()
    y = torch.empty(B, N, dtype=torch.float32, device=x.device)
    if library.mxfp4_gemv(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), y.data_ptr(), B, N, K,
                          torch.get_num_threads()):
        raise MemoryError("MXFP4 gemv: no memory for the kernel's copy of x")
    return y


def experts(x: Tensor, weights: Tensor, indices: Tensor, gate_up: tuple[Tensor, Tensor], down: tuple[Tensor, Tensor],
            activation: str, gate_cap: float, up_cap: float, library: ctypes.CDLL | None = None) -> Tensor:
    """A routed-experts layer on MXFP4 weights in one call: ``x`` fp32 ``[N, W]`` (CPU), ``weights`` fp32 and
    ``indices`` int64 ``[N, k]`` → ``[N, W]`` fp32, ``Σ_j weights[t, j] · down_e(act(gate_e(x_t), up_e(x_t)))`` with
    ``e = indices[t, j]`` (`k3.model.width.Experts.forward`), summed in the order of the experts' numbers.
    ``gate_up`` = (packed ``[E, 2F, W/2]``, scales ``[E, 2F, W/32]``; rows :F gate, F: up), ``down`` = (packed
    ``[E, W, F/2]``, scales ``[E, W, F/32]``); ``activation`` one of `ACTIVATIONS` with SiTU's caps. Each chosen
    expert's bytes are read once per 16 of its tokens, never decoded to floats."""
    library = library or _kernel()
    if library is None:
        raise RuntimeError("the MXFP4 kernel is not available (check `available` first)")
    (gate_up_packed, gate_up_scale), (down_packed, down_scale) = gate_up, down
    E, two_f, half_w = gate_up_packed.shape
    (N, W), F = x.shape, two_f // 2
    if (x.dtype, weights.dtype, indices.dtype) != (torch.float32, torch.float32, torch.int64) \
            or indices.shape != weights.shape or indices.shape[0] != N or 2 * half_w != W or W % 32 or F % 32 \
            or gate_up_scale.shape != (E, 2 * F, W // 32) or down_packed.shape != (E, W, F // 2) \
            or down_scale.shape != (E, W, F // 32) \
            or any(t.dtype != torch.uint8 for t in (gate_up_packed, gate_up_scale, down_packed, down_scale)):
        raise ValueError(
            f"MXFP4 experts: x fp32 [N, W], weights fp32 and indices int64 [N, k], gate_up uint8 [E, 2F, W/2] and "
            f"[E, 2F, W/32], down uint8 [E, W, F/2] and [E, W, F/32], W and F multiples of 32; got x {x.dtype} "
            f"{list(x.shape)}, weights {weights.dtype} {list(weights.shape)}, indices {indices.dtype} "
            f"{list(indices.shape)}, gate_up {list(gate_up_packed.shape)} {list(gate_up_scale.shape)}, down "
            f"{list(down_packed.shape)} {list(down_scale.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"MXFP4 experts: activation = {activation!r} is invalid: must be one of {ACTIVATIONS}")
    tensors = [t.contiguous() for t in (x, weights, indices, gate_up_packed, gate_up_scale, down_packed, down_scale)]
    out = torch.empty(N, W, dtype=torch.float32, device=x.device)
    status = library.mxfp4_experts(*(t.data_ptr() for t in tensors), out.data_ptr(), N, indices.shape[1], E, W, F,
                                   ACTIVATIONS.index(activation), gate_cap, up_cap, torch.get_num_threads())
    if status == -1:
        raise ValueError(f"MXFP4 experts: an index of `indices` is outside [0, {E})")
    if status:
        raise MemoryError("MXFP4 experts: no memory for the kernel's dispatch buffers")
    return out
