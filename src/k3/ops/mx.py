"""Microscaling formats (OCP MX v1.0; SPEC §0, §7, §9): MXFP4 (E2M1), MXFP8 (E4M3, E5M2), blocks of 32 values
along the last (reduction) axis sharing one E8M0 scale byte ``s``; a block's values are ``element · 2^(s − 127)``.

`encode` is exact for any floating input (fp32, bf16, …; computed in fp64):

- shared exponent ``floor(log2 amax) − emax_elem``, clamped to [−127, 127] (bytes 0 … 254; as torchao clamps):
  an all-zero block gets byte 0, and a wider input's block beyond 2^127 · max (fp64 only) gets byte 254 with its
  elements saturated;
- elements are ``x / 2^shared`` rounded to nearest, ties to even, saturating at ±max (E2M1 6, E4M3 448,
  E5M2 57,344); the sign is kept, so a negative value that rounds to zero is −0;
- a block holding NaN or ±inf gets scale byte 255 (E8M0 NaN; the whole block decodes to NaN) and element codes 0;
- a last dimension that is not a multiple of 32 is refused (no padding).

Where torchao 0.18.0's ``to_mx`` (FLOOR) differs, deliberately: it divides by the scale clamped to ≥ 2⁻¹²⁶, so a
nonzero block with scale byte 0 is encoded at 2⁻¹²⁶ while its byte says 2⁻¹²⁷ (we use 2⁻¹²⁷, the byte's value); a
block with ±inf but no NaN gets a finite byte there (we write 255, as OCP and newer torchao do); element codes in
NaN blocks are ours. `decode` detects NaN on the scale byte, never on the decoded float.

`fake_quantize` is ``decode(encode(x))`` in ``x``'s dtype with the straight-through estimator (the gradient passes
unchanged): the forward of quantization-aware training (SPEC §7).

MXFP4 storage is compressed-tensors' ``mxfp4-pack-quantized``, the layout of the released routed experts: two
E2M1 codes per byte, element ``2i`` in the low nibble (`pack_fp4`); `quantize` / `dequantize` work on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32
NAN_SCALE = 255


@dataclass(frozen=True)
class Format:
    """An MX element format: sign, ``ebits`` exponent and ``mbits`` mantissa bits; ``emax`` is the exponent of the
    largest normal (``emax_elem``), ``max`` the largest finite magnitude."""

    name: str
    ebits: int
    mbits: int
    emax: int
    max: float

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (subnormals share it): ``1 − bias``."""
        return 2 - 2 ** (self.ebits - 1)

    def magnitude_code(self, a: Tensor) -> Tensor:
        """Non-negative fp64 ``a`` → the code (without sign) of the nearest value, ties to even, saturating.

        Codes are monotone in value: ``(q − emin)·2^mbits + round(a / 2^(q − mbits))`` with ``q`` the binade
        (at least ``emin``), which also covers subnormals and a round-up into the next binade.
        """
        q = torch.where(a > 0, torch.frexp(a).exponent - 1, self.emin).clamp_min(self.emin)
        steps = torch.round(torch.ldexp(a, self.mbits - q))  # torch.round: half to even
        code = (q - self.emin) * 2**self.mbits + steps.long()
        return code.clamp_max(self.max_code)

    @property
    def max_code(self) -> int:
        """The code of ``max``, the largest finite magnitude."""
        q = int(self.max).bit_length() - 1
        return (q - self.emin) * 2**self.mbits + int(self.max) // 2 ** (q - self.mbits)

    def values(self) -> Tensor:
        """fp32 value of every code, ``[2^bits]``. Codes above the largest finite are NaN, except the one worth
        ``2^(emax+1)``, which is infinity (only E5M2 has it, IEEE-style)."""
        mag = torch.arange(2 ** (self.bits - 1))
        field, mant = mag // 2**self.mbits, mag % 2**self.mbits
        normal = (field > 0).long()
        value = torch.ldexp((mant + normal * 2**self.mbits).double(), field - normal + self.emin - self.mbits)
        special = torch.where(value == 2.0 ** (self.emax + 1), torch.inf, torch.nan).double()
        value = torch.where(mag > self.max_code, special, value)
        return torch.cat([value, -value]).float()


FORMATS: dict[str, Format] = {
    "mxfp4": Format("mxfp4", ebits=2, mbits=1, emax=2, max=6.0),
    "mxfp8_e4m3": Format("mxfp8_e4m3", ebits=4, mbits=3, emax=8, max=448.0),
    "mxfp8_e5m2": Format("mxfp8_e5m2", ebits=5, mbits=2, emax=15, max=57344.0),
}


def _format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise ValueError(f"MX: unknown format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def _blocks(x: Tensor, what: str) -> Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"{what}: the last dimension ({x.shape[-1]}) must be a multiple of {BLOCK}")
    return x.unflatten(-1, (-1, BLOCK))


def encode(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """``x`` ``[..., n]`` (floating, n a multiple of 32) → ``(codes [..., n], scale [..., n/32])`` uint8, one
    element code per byte (sign bit ``bits − 1``). NaN/inf: see the module docstring."""
    f = _format(fmt)
    if not x.is_floating_point():
        raise ValueError(f"MX encode: x must be floating point, got {x.dtype}")
    blocks = _blocks(x.detach().to(torch.float64), f"MX encode ({f.name})")
    amax = blocks.abs().amax(-1)  # NaN if the block holds a NaN
    finite = torch.isfinite(amax)
    shared = torch.where(amax > 0, torch.frexp(amax).exponent - 1 - f.emax, -127).clamp(-127, 127)
    shared = shared.masked_fill(~finite, 0)
    scaled = torch.ldexp(blocks, -shared.unsqueeze(-1)).masked_fill(~finite.unsqueeze(-1), 0.0)
    codes = f.magnitude_code(scaled.abs()) | (torch.signbit(scaled).long() << (f.bits - 1))
    scale = (shared + 127).masked_fill(~finite, NAN_SCALE)
    return codes.flatten(-2).to(torch.uint8), scale.to(torch.uint8)


def _scale_values(scale: Tensor) -> Tensor:
    """fp32 ``2^(s − 127)`` of E8M0 bytes ``s``; NaN for byte 255."""
    factor = torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.int() - 127)
    return factor.masked_fill(scale == NAN_SCALE, torch.nan)


def decode(codes: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """``codes`` uint8 ``[..., n]`` and ``scale`` uint8 ``[..., n/32]`` → ``[..., n]`` in ``dtype``: computed in
    fp32, exact there (fp32 overflow gives ±inf); scale byte 255 makes its block NaN."""
    f = _format(fmt)
    if codes.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MX decode: codes and scale must be uint8, got {codes.dtype} and {scale.dtype}")
    if codes.shape[:-1] != scale.shape[:-1] or codes.shape[-1] != scale.shape[-1] * BLOCK:
        raise ValueError(f"MX decode: codes {list(codes.shape)} and scale {list(scale.shape)} do not match "
                         f"(expected [..., n] and [..., n/{BLOCK}])")
    values = f.values().to(codes.device)[codes.long()]
    return (_blocks(values, "MX decode") * _scale_values(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def pack_fp4(codes: Tensor) -> Tensor:
    """4-bit codes uint8 ``[..., n]`` (n even) → ``[..., n/2]``: element ``2i`` in the low nibble, ``2i+1`` high."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: codes must be uint8 with an even last dimension, got {codes.dtype} "
                         f"{list(codes.shape)}")
    if bool((codes > 0x0F).any()):
        raise ValueError("pack_fp4: codes must be 4-bit (0..15)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of `pack_fp4`: uint8 ``[..., n/2]`` → ``[..., n]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: packed must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def _check_packed(packed: Tensor, scale: Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4: packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * BLOCK:
        raise ValueError(f"MXFP4: packed {list(packed.shape)} and scale {list(scale.shape)} do not match "
                         f"(expected [..., n/2] and [..., n/{BLOCK}])")


def _byte_values(device: torch.device) -> Tensor:
    """fp32 ``[256, 2]``: the two E2M1 values of every packed byte (low nibble first)."""
    values = FORMATS["mxfp4"].values()
    byte = torch.arange(256)
    return torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1).to(device)


_BYTE_VALUES: dict[torch.device, Tensor] = {}


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``packed`` uint8 ``[..., n/2]`` and ``scale`` uint8 ``[..., n/32]`` → ``[..., n]`` in ``dtype`` (exact in
    fp32 and wider: every E2M1 value times a power of two): `decode` of `unpack_fp4`, in one lookup of each byte's
    two values and one product by its block's scale."""
    _check_packed(packed, scale)
    table = _BYTE_VALUES.get(packed.device)
    if table is None:
        table = _BYTE_VALUES[packed.device] = _byte_values(packed.device)
    values = table.index_select(0, packed.reshape(-1).int()).view(*scale.shape, BLOCK // 2, 2)
    return (values * _scale_values(scale)[..., None, None]).flatten(-3).to(dtype)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[..., n]`` (n a multiple of 32, finite) → ``(packed [..., n/2], scale [..., n/32])`` uint8: MXFP4
    `encode` then `pack_fp4`; non-finite values are refused (a weight must not carry them)."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("MXFP4: cannot quantize non-finite values")
    codes, scale = encode(x, "mxfp4")
    return pack_fp4(codes), scale


def _round_trip(x: Tensor, f: Format) -> Tensor:
    """``decode(encode(x))`` computed directly in fp32, where every step is exact: scaling by powers of two
    stays within fp32's range (a value scaled below fp32's subnormals is far below half an element step and
    rounds to zero either way), and an element times its scale is at least 2⁻¹⁴³, an fp32 subnormal."""
    if not x.is_floating_point():
        raise ValueError(f"MX fake_quantize: x must be floating point, got {x.dtype}")
    blocks = _blocks(x.detach().float(), f"MX fake_quantize ({f.name})")
    amax = blocks.abs().amax(-1, keepdim=True)
    shared = torch.where(amax > 0, torch.frexp(amax).exponent - 1 - f.emax, -127).clamp_min(-127)
    scaled = torch.ldexp(blocks, -shared)
    q = torch.frexp(scaled).exponent.sub(1).clamp_min(f.emin)  # the binade; 0 and subnormals use emin
    element = torch.ldexp(torch.round(torch.ldexp(scaled, f.mbits - q)), q - f.mbits).clamp(-f.max, f.max)
    out = torch.ldexp(element, shared).masked_fill(~torch.isfinite(amax), torch.nan)
    return out.flatten(-2).to(x.dtype)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, fmt: str) -> Tensor:  # noqa: ANN001
        return _round_trip(x, _format(fmt))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad, None


def fake_quantize(x: Tensor, fmt: str) -> Tensor:
    """``decode(encode(x, fmt))`` in ``x.dtype`` — the exact values an MX matmul sees — with the straight-through
    estimator: ``∂/∂x`` is the identity, so the gradient is the one taken at the quantized values (SPEC §7)."""
    return _FakeQuantize.apply(x, fmt)
