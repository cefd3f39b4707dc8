"""MX formats (issue 15, item 1; SPEC §7, §9): `k3.ops.mx` bit-exact against torchao 0.18.0's ``to_mx`` (FLOOR) /
``to_dtype``, the deliberate differences pinned down, and hypothesis properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.ops import mx

FMTS = tuple(mx.FORMATS)


def _torchao():
    return pytest.importorskip("torchao.prototype.mx_formats.mx_tensor",
                               reason="torchao==0.18.0 (the `test` extra) is the MX reference")


def _elem_dtype(fmt: str) -> torch.dtype:
    return {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn,
            "mxfp8_e5m2": torch.float8_e5m2}[fmt]


def _theirs(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's ``(codes, scale)`` as uint8, MXFP4 codes unpacked with our `unpack_fp4`."""
    scale, data = _torchao().to_mx(x.contiguous(), _elem_dtype(fmt), mx.BLOCK)
    data = data.view(torch.uint8)
    return (mx.unpack_fp4(data) if fmt == "mxfp4" else data), scale.view(torch.uint8)


def _hard_blocks(dtype: torch.dtype) -> torch.Tensor:
    """``[6, 24·32]``: per-block magnitudes 2^-149 … 2^126, fp32 subnormals, zero blocks, the dtype's max."""
    g = torch.Generator().manual_seed(15)
    blocks = torch.rand(6, 24, mx.BLOCK, generator=g, dtype=torch.float64) * 4 - 2
    exponents = torch.randint(-150, 127, (6, 24, 1), generator=g)
    exponents[:, :4] = torch.tensor([-149, -140, -130, -126]).unsqueeze(-1)  # scale byte 0 in every format
    blocks = torch.ldexp(blocks, exponents)
    blocks[:, 4] = 0.0
    blocks[:, 5, ::3] = torch.finfo(dtype).max
    blocks[:, 6] = torch.randint(-3, 4, (6, mx.BLOCK), generator=g) * 2.0**-149  # integer multiples of the least
    return blocks.flatten(-2).to(dtype)


def _byte0_nonzero(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Element mask of nonzero blocks that got scale byte 0 (where torchao 0.18 divides by 2^-126)."""
    amax = x.float().unflatten(-1, (-1, mx.BLOCK)).abs().amax(-1)
    return ((scale == 0) & (amax > 0)).repeat_interleave(mx.BLOCK, -1)


def test_formats_and_their_codes():
    assert {k: (f.bits, f.emax, f.max) for k, f in mx.FORMATS.items()} == {
        "mxfp4": (4, 2, 6.0), "mxfp8_e4m3": (8, 8, 448.0), "mxfp8_e5m2": (8, 15, 57344.0)}
    assert mx.FORMATS["mxfp4"].values().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):  # every byte, NaN and inf included, as torch's own fp8 dtypes read it
        torch.testing.assert_close(mx.FORMATS[fmt].values(),
                                   torch.arange(256, dtype=torch.uint8).view(_elem_dtype(fmt)).float(),
                                   rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
def test_encode_is_bit_exact_against_torchao(fmt, dtype):
    x = _hard_blocks(dtype)
    codes, scale = mx.encode(x, fmt)
    their_codes, their_scale = _theirs(x, fmt)
    assert torch.equal(scale, their_scale)
    differ = _byte0_nonzero(x, scale)
    assert 0 < int(differ.sum()) < x.numel() // 2
    assert torch.equal(codes[~differ], their_codes[~differ])
    # Deliberate: torchao 0.18 encodes byte-0 blocks at 2^-126 while the byte means 2^-127, i.e. as if x were
    # halved; ours are torchao's codes for 2x (still a byte-0 block), at the scale the byte states.
    assert torch.equal(codes[differ], _theirs(x * 2, fmt)[0][differ])


def test_byte0_blocks_decode_at_their_value_unlike_torchao_0_18():
    x = torch.zeros(mx.BLOCK)
    x[0] = 2.0**-125  # E2M1: floor(log2 amax) − 2 = −127 → byte 0, element 4
    codes, scale = mx.encode(x, "mxfp4")
    assert scale.item() == 0 and codes[0].item() == 6
    assert mx.decode(codes, scale, "mxfp4")[0].item() == 2.0**-125
    their_codes, their_scale = _theirs(x, "mxfp4")
    assert mx.decode(their_codes, their_scale, "mxfp4")[0].item() == 2.0**-126  # torchao's own round trip halves it


@pytest.mark.parametrize("fmt", FMTS)
def test_ties_round_to_even_and_values_saturate(fmt):
    f = mx.FORMATS[fmt]
    finite = f.values()[: f.max_code + 1].double()
    mids = (finite[:-1] + finite[1:]) / 2  # exactly between two codes
    top = 2.0 ** (f.emax + 1)
    over = torch.tensor([f.max * 1.01, (f.max + top) / 2, top * 0.999], dtype=torch.float64)  # beyond max
    below, sign = torch.arange(mids.numel()), 1 << (f.bits - 1)
    even = torch.where(below % 2 == 0, below, below + 1)
    saturated = torch.full((3,), f.max_code)
    x = torch.cat([mids, -mids, over, -over])
    expected = torch.cat([even, even | sign, saturated, saturated | sign])
    pad = -x.numel() % (mx.BLOCK - 1)
    x, expected = torch.cat([x, x.new_zeros(pad)]), torch.cat([expected, expected.new_zeros(pad)])
    # every block also holds max, so amax is in [2^emax, 2^(emax+1)) and the scale is 2^0
    x = torch.cat([torch.full((x.numel() // (mx.BLOCK - 1), 1), f.max, dtype=torch.float64),
                   x.view(-1, mx.BLOCK - 1)], -1).flatten().float()
    expected = torch.cat([torch.full((expected.numel() // (mx.BLOCK - 1), 1), f.max_code),
                          expected.view(-1, mx.BLOCK - 1)], -1).flatten()
    codes, scale = mx.encode(x, fmt)
    assert (scale == 127).all() and torch.equal(codes.long(), expected)
    assert torch.equal(codes, _theirs(x, fmt)[0])


@pytest.mark.parametrize("fmt", FMTS)
def test_nan_and_inf_blocks(fmt):
    x = torch.linspace(-3, 3, 4 * mx.BLOCK).reshape(2, 2 * mx.BLOCK)
    x[0, 5], x[1, 40] = torch.nan, -torch.inf
    codes, scale = mx.encode(x, fmt)
    assert scale[0, 0] == scale[1, 1] == 255 and (codes[0, :32] == 0).all() and (codes[1, 32:] == 0).all()
    decoded = mx.decode(codes, scale, fmt)
    assert decoded[0, :32].isnan().all() and decoded[1, 32:].isnan().all() and decoded[0, 32:].isfinite().all()
    their_codes, their_scale = _theirs(x, fmt)
    assert their_scale[0, 0] == 255  # NaN: the same byte (their element codes there are immaterial)
    assert their_scale[1, 1] == 128 - mx.FORMATS[fmt].emax + 127  # deliberate: 0.18 gives inf a finite byte
    assert torch.equal(codes[0, 32:], their_codes[0, 32:]) and torch.equal(codes[1, :32], their_codes[1, :32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
def test_decode_is_bit_exact_against_torchao(fmt, dtype):
    f = mx.FORMATS[fmt]
    n = max(2**f.bits, mx.BLOCK)
    codes = torch.arange(2**f.bits, dtype=torch.uint8).repeat(256, n // 2**f.bits)  # every code …
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(-1).repeat(1, n // mx.BLOCK)  # … with every scale byte
    ours = mx.decode(codes, scale, fmt, dtype)
    data = mx.pack_fp4(codes) if fmt == "mxfp4" else codes.view(_elem_dtype(fmt))
    theirs = _torchao().to_dtype(data, scale.view(torch.float8_e8m0fnu), _elem_dtype(fmt), mx.BLOCK, dtype)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert mx.decode(torch.tensor([1] + [0] * 31, dtype=torch.uint8), torch.tensor([254], dtype=torch.uint8),
                     "mxfp4")[0].item() == 2.0**126  # byte 254 is 2^127, not NaN


def test_mxfp4_quantize_is_encode_then_pack():
    x = _hard_blocks(torch.float32)
    codes, scale = mx.encode(x, "mxfp4")
    packed, scale_q = mx.quantize(x)
    assert torch.equal(scale_q, scale) and torch.equal(packed, mx.pack_fp4(codes))
    assert torch.equal(mx.dequantize(packed, scale), mx.decode(codes, scale, "mxfp4"))
    assert mx.quantize(torch.tensor([-1e-3, 6.0] * 16))[0][0].item() == 0x78  # −tiny → −0 (code 8), low nibble
    with pytest.raises(ValueError, match="non-finite"):
        mx.quantize(torch.full((32,), torch.inf))


def test_refusals():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.encode(torch.ones(3, 48), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="floating point"):
        mx.encode(torch.ones(32, dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="unknown format"):
        mx.encode(torch.ones(32), "mxfp6")
    with pytest.raises(ValueError, match="do not match"):
        mx.decode(torch.zeros(64, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), "mxfp4")
    with pytest.raises(ValueError, match="4-bit"):
        mx.pack_fp4(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        mx.pack_fp4(torch.zeros(3, dtype=torch.uint8))


_blocks = st.tuples(
    st.lists(st.floats(-8, 8, width=32), min_size=mx.BLOCK, max_size=mx.BLOCK),
    st.integers(-150, 120),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_blocks, min_size=1, max_size=3), st.sampled_from(FMTS))
def test_error_bound_and_idempotence(blocks, fmt):
    f = mx.FORMATS[fmt]
    x = torch.cat([torch.ldexp(torch.tensor(v, dtype=torch.float64), torch.tensor(k)) for v, k in blocks]).float()
    codes, scale = mx.encode(x, fmt)
    x_hat = mx.decode(codes, scale, fmt)
    step = torch.ldexp(torch.ones(scale.shape, dtype=torch.float64), scale.long() - 127).repeat_interleave(32)
    inside = x.double().abs() <= f.max * step
    bound = step * 2.0 ** (f.emax - f.mbits - 1)  # half the top binade's spacing; E2M1: exactly the scale
    assert ((x_hat.double() - x.double()).abs() <= bound)[inside].all()
    assert torch.equal(mx.decode(*mx.encode(x_hat, fmt), fmt), x_hat)


@given(st.lists(st.integers(0, 15), min_size=0, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_pack_unpack_round_trip(values):
    codes = torch.tensor(values, dtype=torch.uint8)
    packed = mx.pack_fp4(codes)
    assert torch.equal(mx.unpack_fp4(packed), codes)
    assert torch.equal(mx.pack_fp4(mx.unpack_fp4(packed)), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
def test_fake_quantize_is_decode_of_encode(fmt, dtype):
    """The fp32 fast path equals the fp64 encode → decode bit for bit: subnormal-range, zero, huge, NaN/inf blocks."""
    x = _hard_blocks(dtype)
    x[0, 7 * mx.BLOCK + 3], x[1, 8 * mx.BLOCK] = float("nan"), float("-inf")
    expected = mx.decode(*mx.encode(x, fmt), fmt, dtype)
    got = mx.fake_quantize(x, fmt)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))


@settings(max_examples=200, deadline=None)
@given(st.lists(_blocks, min_size=1, max_size=3), st.sampled_from(FMTS))
def test_fake_quantize_property(blocks, fmt):
    x = torch.cat([torch.ldexp(torch.tensor(v, dtype=torch.float64), torch.tensor(k)) for v, k in blocks]).float()
    assert torch.equal(mx.fake_quantize(x, fmt), mx.decode(*mx.encode(x, fmt), fmt))


def test_fake_quantize_passes_the_gradient_straight_through():
    x = torch.randn(3, 64, requires_grad=True)
    grad = torch.randn(3, 64)
    mx.fake_quantize(x, "mxfp4").backward(grad)
    assert torch.equal(x.grad, grad)
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.fake_quantize(torch.randn(4, 48), "mxfp4")
    with pytest.raises(ValueError, match="floating point"):
        mx.fake_quantize(torch.zeros(32, dtype=torch.int32), "mxfp4")


@pytest.mark.parametrize("fmt", FMTS)
def test_fp64_blocks_beyond_the_largest_scale_saturate_at_it(fmt):
    """E8M0's largest finite byte is 254 (2^127): an fp64 block above 2^127 · max keeps it and saturates its elements
    (the byte wrapped before: 2^200 got byte 69 and decoded to 1.4e-17). Up to there the scale is exact."""
    f = mx.FORMATS[fmt]
    for exponent in [127 + f.emax, 127 + f.emax + 1, 131, 200, 1023]:
        x = torch.full((2, mx.BLOCK), 2.0**exponent, dtype=torch.float64)
        x[1] = -x[1]
        x[:, 1] /= 4  # a smaller element, to check elements are not all forced to max
        codes, scale = mx.encode(x, fmt)
        want = min(exponent - f.emax, 127) + 127
        assert (scale == want).all(), (exponent, scale)
        elements = mx.decode(codes, torch.full_like(scale, 127), fmt, torch.float64)  # at 2^0: the elements
        top = min(2.0 ** (exponent - want + 127), f.max)
        assert elements[0, 0] == top and elements[1, 0] == -top
        assert elements[0, 1] == min(2.0 ** (exponent - want + 127) / 4, f.max)
        decoded = mx.decode(codes, scale, fmt)  # fp32: the largest elements lie beyond its range, so ±inf
        assert decoded[0, 0] == torch.inf and decoded[1, 0] == -torch.inf and not decoded.isnan().any()
    if fmt == "mxfp4":
        packed, scale = mx.quantize(torch.full((1, mx.BLOCK), 2.0**200, dtype=torch.float64))
        assert scale.item() == 254 and (mx.unpack_fp4(packed) == f.max_code).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dequantize_reads_every_byte_and_scale_as_decode_does(dtype):
    """All 256 bytes under scale bytes 0, 1, 126, 127, 128, 200, 254 and 255 (NaN): the byte-pair lookup equals
    `decode` of the unpacked codes, bit for bit (NaN where decode gives NaN)."""
    scales = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)  # [8, 256]: 16 blocks per row
    scale = scales[:, None].expand(-1, 16).contiguous()
    got, want = mx.dequantize(packed, scale, dtype), mx.decode(mx.unpack_fp4(packed), scale, "mxfp4", dtype)
    assert got.dtype == want.dtype == dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert got[-1].isnan().all() and got[0].isfinite().all()
