"""MXFP4 microscaling (OCP MX v1.0; SPEC §0, §10): E2M1 elements with one E8M0 scale per block of 32.

Storage is compressed-tensors' ``mxfp4-pack-quantized``, the layout of the released routed experts: a weight
``[out, in]`` becomes ``packed`` uint8 ``[out, in/2]`` (element ``2i`` in the low nibble, ``2i+1`` in the high
nibble; a nibble is sign bit 3 and the E2M1 code in bits 0–2) and ``scale`` uint8 ``[out, in/32]`` holding the
biased exponent ``s``: the block's values are ``E2M1 · 2^(s − 127)`` (``s = 255`` is NaN).

`quantize` follows the OCP rule: shared exponent ``floor(log2(max|x|)) − 2`` (2 = E2M1's largest exponent),
elements rounded to the nearest E2M1 value (ties to even), saturating at ±6.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32
#: The eight non-negative E2M1 magnitudes, indexed by the 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_EMAX_ELEM = 2


def _check_packed(packed: Tensor, scale: Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4: packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * BLOCK:
        raise ValueError(f"MXFP4: packed {list(packed.shape)} and scale {list(scale.shape)} do not match "
                         f"(expected [..., n/2] and [..., n/{BLOCK}])")


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``packed`` uint8 ``[..., n/2]`` and ``scale`` uint8 ``[..., n/32]`` → ``[..., n]`` in ``dtype`` (exact in
    fp32 and wider: every E2M1 value times a power of two)."""
    _check_packed(packed, scale)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # [..., n]
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    values = lut[codes].unflatten(-1, (-1, BLOCK))
    exponent = scale.to(torch.int32) - 127
    factor = torch.ldexp(torch.ones(exponent.shape, device=scale.device), exponent).masked_fill(scale == 255, torch.nan)
    return (values * factor.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[..., n]`` (n a multiple of 32, finite) → ``(packed [..., n/2], scale [..., n/32])`` uint8."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4: the last dimension ({x.shape[-1]}) must be a multiple of {BLOCK}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("MXFP4: cannot quantize non-finite values")
    blocks = x.detach().to(torch.float64).unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1)
    shared = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-149))) - _EMAX_ELEM,
                         torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(shared), shared.long()).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=x.device)
    distance = (scaled.abs().clamp_max(6.0).unsqueeze(-1) - magnitudes).abs()  # [..., 32, 8]
    nearest = distance.min(-1, keepdim=True).values
    # ties: the candidate with the even code (its mantissa bit is 0), i.e. the first even among the nearest
    ties = (distance == nearest) & (torch.arange(8, device=x.device) % 2 == 0)
    code = torch.where(ties.any(-1), ties.int().argmax(-1), (distance == nearest).int().argmax(-1))
    code = code + 8 * ((scaled < 0) & (code > 0)).long()
    code = code.flatten(-2).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (shared + 127).to(torch.uint8)
