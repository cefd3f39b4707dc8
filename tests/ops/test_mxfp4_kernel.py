"""The packed MXFP4 product's CPU kernel (`k3.ops.mxfp4_kernel`, issue 37) against the fp64 product of the decoded
weights (`k3.ops.mx.dequantize`, itself bit-exact against mlx and torchao), and packed experts through it against
the PyTorch path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from k3.ops import mx, mxfp4_kernel

pytestmark = pytest.mark.skipif(not mxfp4_kernel.available(torch.zeros(1)), reason="no C compiler for the kernel")


def reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ mx.dequantize(packed, scale, torch.float64).T


def assert_close(got: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Within fp32 summation error: K·eps times Σ|x||w| per output."""
    want = reference(x, packed, scale)
    bound = x.shape[1] * 2**-23 * (x.double().abs() @ mx.dequantize(packed, scale, torch.float64).abs().T) + 1e-30
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= bound).all()


@pytest.fixture(scope="module", params=["native", "portable"])
def library(request):
    """The kernel as built by default (AVX-512 where the CPU has it), and its portable loop."""
    flags = mxfp4_kernel.FLAGS + (("-mno-avx512f",) if request.param == "portable" else ())
    built = mxfp4_kernel.build(flags)
    assert built is not None
    return built


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 40])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (64, 512), (130, 64)])
def test_the_kernel_is_the_product_of_the_decoded_weights(library, rows, shape):
    torch.manual_seed(rows)
    n, k = shape
    packed, scale = mx.quantize(torch.randn(n, k) * torch.rand(n, 1) * 4)
    x = torch.randn(rows, k)
    assert_close(mxfp4_kernel.gemv(x, packed, scale, library), x, packed, scale)
    assert_close(mxfp4_kernel.gemv(x.t().contiguous().t(), packed, scale, library), x, packed, scale)  # strided x


def test_every_byte_and_the_extreme_scales(library):
    """All 256 bytes under scale bytes 0 (2^-127, subnormal), 1, 127, 200 and 255 (NaN, the whole block)."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(5, 1)  # 16 blocks per row
    scale = torch.tensor([0, 1, 127, 200, 127], dtype=torch.uint8)[:, None].repeat(1, 16)
    scale[4, 3] = 255
    x = torch.randn(2, 512)
    got = mxfp4_kernel.gemv(x, packed, scale, library)
    assert got[:, 4].isnan().all() and got[:, :4].isfinite().all()
    assert_close(got[:, :4], x, packed[:4], scale[:4])
    nibbles = torch.zeros(1, 16, dtype=torch.uint8)
    nibbles[0, 0] = 0x71  # element 0: code 1 (0.5), element 1: code 7 (6.0)
    picks = torch.eye(32)[:2]
    got = mxfp4_kernel.gemv(picks, nibbles, torch.tensor([[128]], dtype=torch.uint8), library)  # scale 2
    assert got.flatten().tolist() == [1.0, 12.0]


def test_refusals_and_the_switch():
    packed, scale = mx.quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_kernel.gemv(torch.randn(1, 32), packed, scale)
    with pytest.raises(ValueError, match="fp32"):
        mxfp4_kernel.gemv(torch.randn(1, 64, dtype=torch.float64), packed, scale)
    assert not mxfp4_kernel.available(torch.zeros(1, dtype=torch.bfloat16))
    assert not mxfp4_kernel.available(torch.zeros(1, requires_grad=True))
    env = {**os.environ, "K3_MXFP4_KERNEL": "0"}
    code = "import torch; from k3.ops import mxfp4_kernel; print(mxfp4_kernel.available(torch.zeros(1)))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("input_format", [None, "mxfp8_e4m3"])
def test_packed_experts_through_the_kernel_equal_the_pytorch_path(monkeypatch, input_format):
    """Decode-sized batches (1, 3, 8 tokens) and a prefill-sized one: the same outputs as decoded weights and a
    matmul, within fp32 summation error."""
    from k3.config import MXConfig, SiTUConfig
    from k3.model.packed import PackedExperts
    from k3.model.width import Experts

    torch.manual_seed(0)
    experts = Experts(8, 64, 96, "situ", SiTUConfig(), mx_config=MXConfig(enabled=True, activation_format=input_format))
    packed = PackedExperts.pack(experts).eval()
    for tokens in (1, 3, 8, 100):
        x = torch.randn(tokens, 64)
        weights, indices = torch.rand(tokens, 2), torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
        with torch.no_grad():
            got = packed(x, weights, indices)
            monkeypatch.setattr(PackedExperts, "KERNEL_ROWS", 0)
            want = packed(x, weights, indices)
            monkeypatch.undo()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_failed_build_warns_and_leaves_the_pytorch_path(monkeypatch, tmp_path):
    """A compiler that fails (here `false`) gives no kernel and one warning, nothing cached; callers fall back."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="MXFP4 kernel unavailable"):
        assert mxfp4_kernel.build(mxfp4_kernel.FLAGS + ("-DK3_TEST_BUILD",)) is None
    assert not list((tmp_path / "k3" / "kernels").glob("*.so"))


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows on 4 experts: past KERNEL_ROWS, the decoded-weights path
def test_pair_products_give_each_row_its_own_experts_fp64_product(rows):
    """`k3.model.packed.pair_products` (the compiled step's packed expert operator) against each row's fp64 product
    with its expert's weights, decoded by `mx.decode` of the unpacked codes."""
    from k3.model.packed import pair_products

    g = torch.Generator().manual_seed(rows)
    experts, out_features, in_features = 4, 48, 64
    quantized = [mx.quantize(torch.randn(out_features, in_features, generator=g)) for _ in range(experts)]
    packed, scale = torch.stack([q[0] for q in quantized]), torch.stack([q[1] for q in quantized])
    xs, pairs = torch.randn(rows, in_features, generator=g), torch.randint(0, experts, (rows,), generator=g)
    got = pair_products(xs, packed, scale, pairs)
    want = torch.stack([mx.decode(mx.unpack_fp4(packed[e]), scale[e], "mxfp4", torch.float64) @ xs[m].double()
                        for m, e in enumerate(pairs.tolist())])
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
