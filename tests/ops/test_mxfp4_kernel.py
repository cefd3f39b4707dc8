"""The packed MXFP4 product's CPU kernel (`k3.ops.mxfp4_kernel`, issue 37) against the fp64 product of the decoded
weights (`k3.ops.mx.dequantize`, itself bit-exact against mlx and torchao), its whole-layer call against the fp64
layer, and packed experts through it against the PyTorch path."""

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


@pytest.mark.parametrize(("activation", "input_format"), [("situ", None), ("swiglu", None), ("situ", "mxfp8_e4m3")])
def test_packed_experts_through_the_kernel_equal_the_pytorch_path(monkeypatch, activation, input_format):
    """Decode-sized batches (1, 3, 8 and 64 tokens: the kernel's one call for the layer, or per expert with MXFP8
    inputs) and a prefill-sized one: the same outputs as decoded weights and a matmul, within fp32 summation
    error."""
    from k3.config import MXConfig, SiTUConfig
    from k3.model.packed import PackedExperts
    from k3.model.width import Experts

    torch.manual_seed(0)
    experts = Experts(8, 64, 96, activation, SiTUConfig(),
                      mx_config=MXConfig(enabled=True, activation_format=input_format))
    packed = PackedExperts.pack(experts).eval()
    for tokens in (1, 3, 8, 64, 100):
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


def experts_weights(E: int, W: int, F: int, seed: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Stacked MXFP4 experts: gate_up (packed [E, 2F, W/2], scales) and down (packed [E, W, F/2], scales), with
    weights of varied magnitude per row."""
    g = torch.Generator().manual_seed(seed)

    def stacked(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = [mx.quantize(torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g) * 0.3) for _ in range(E)]
        return torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])

    return stacked(2 * F, W), stacked(W, F)


def layer_reference(x, weights, indices, gate_up, down, activation, caps=(4.0, 25.0)) -> torch.Tensor:
    """The routed-experts layer token by token and choice by choice in fp64 (SPEC Eq. 18-19): each expert's weights
    decoded by `mx.decode` of the unpacked codes, the activation `width.situ` (its own tests hold it to the SPEC) or
    SwiGLU in fp64."""
    from k3.model.width import situ

    def weight(packed, scale, e):
        return mx.decode(mx.unpack_fp4(packed[e]), scale[e], "mxfp4", torch.float64)

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(indices[t].tolist()):
            gate, up = (weight(*gate_up, e) @ x[t].double()).chunk(2)
            h = situ(gate, up, *caps) if activation == "situ" else torch.nn.functional.silu(gate) * up
            out[t] += weights[t, j].double() * (weight(*down, e) @ h)
    return out


def routing(tokens: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).reshape(tokens, k)
    return torch.rand(tokens, k, generator=g) * 2 - 0.5, indices


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 17, 40])
@pytest.mark.parametrize(("W", "F", "k"), [(32, 32, 1), (64, 96, 2), (96, 64, 3)])
def test_the_experts_kernel_is_the_fp64_layer(library, activation, tokens, W, F, k):
    """`mxfp4_kernel.experts` (a whole routed-experts layer in one call) against the fp64 layer, token by token."""
    E = 5
    gate_up, down = experts_weights(E, W, F, seed=tokens)
    weights, indices = routing(tokens, E, k, seed=tokens + 1)
    x = torch.randn(tokens, W, generator=torch.Generator().manual_seed(tokens + 2))
    got = mxfp4_kernel.experts(x, weights, indices, gate_up, down, activation, 4.0, 25.0, library)
    want = layer_reference(x, weights, indices, gate_up, down, activation)
    assert got.dtype == torch.float32 and got.shape == (tokens, W)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_a_tokens_experts_output_does_not_depend_on_the_batch(library):
    """Batch invariance: each token's output alone equals, bit for bit, its row in batches of 2 to 40 tokens that
    share its experts (rows run 8, 4, 2 and 1 at a time, each summed in the same order)."""
    E, W, F = 3, 64, 64
    gate_up, down = experts_weights(E, W, F, seed=0)
    g = torch.Generator().manual_seed(1)
    x, weights = torch.randn(40, W, generator=g), torch.rand(40, 2, generator=g)
    indices = torch.tensor([[0, 2]]).repeat(40, 1)
    alone = torch.cat([mxfp4_kernel.experts(x[t:t + 1], weights[t:t + 1], indices[t:t + 1], gate_up, down, "situ",
                                            4.0, 25.0, library) for t in range(40)])
    for tokens in (2, 3, 5, 8, 13, 16, 17, 40):
        batch = mxfp4_kernel.experts(x[:tokens], weights[:tokens], indices[:tokens], gate_up, down, "situ", 4.0,
                                     25.0, library)
        assert torch.equal(batch, alone[:tokens])


def test_a_nan_scale_spoils_only_its_experts_tokens():
    E, W, F = 4, 64, 32
    gate_up, down = experts_weights(E, W, F, seed=3)
    down[1][2, 5, 0] = 255  # E8M0 NaN: expert 2's down row 5
    weights, indices = routing(6, E, 2, seed=4)
    got = mxfp4_kernel.experts(torch.randn(6, W), weights, indices, gate_up, down, "situ", 4.0, 25.0)
    uses = (indices == 2).any(1)
    assert got[uses, 5].isnan().all() and got[~uses].isfinite().all()
    assert got[:, torch.arange(W) != 5].isfinite().all()


def test_the_experts_kernel_refuses_what_it_cannot_compute():
    gate_up, down = experts_weights(4, 64, 32, seed=5)
    x, weights, indices = torch.randn(2, 64), torch.rand(2, 2), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        mxfp4_kernel.experts(x, weights, torch.tensor([[0, 1], [4, 3]]), gate_up, down, "situ", 4.0, 25.0)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        mxfp4_kernel.experts(x, weights, torch.tensor([[0, -1], [2, 3]]), gate_up, down, "situ", 4.0, 25.0)
    with pytest.raises(ValueError, match="activation"):
        mxfp4_kernel.experts(x, weights, indices, gate_up, down, "gelu", 4.0, 25.0)
    with pytest.raises(ValueError, match="weights fp32"):
        mxfp4_kernel.experts(x, weights.double(), indices, gate_up, down, "situ", 4.0, 25.0)
    with pytest.raises(ValueError, match="W and F multiples of 32"):
        mxfp4_kernel.experts(torch.randn(2, 32), weights, indices, gate_up, down, "situ", 4.0, 25.0)


@pytest.mark.parametrize(("tokens", "input_format"), [(1, None), (7, None), (300, None), (7, "mxfp8_e4m3")])
def test_the_packed_experts_operator_is_the_fp64_layer(tokens, input_format):
    """`k3.model.packed.experts_product`, the operator a packed layer is in eager and compiled steps: the kernel's
    one call (1 and 7 tokens), the per-expert dispatch past `KERNEL_ROWS` (300 tokens on 4 experts), and with MXFP8
    inputs, against the fp64 layer (its inputs fake-quantized as the float model's)."""
    from k3.model.packed import experts_product

    E, W, F = 4, 64, 96
    gate_up, down = experts_weights(E, W, F, seed=tokens)
    weights, indices = routing(tokens, E, 2, seed=tokens + 1)
    x = torch.randn(tokens, W, generator=torch.Generator().manual_seed(tokens + 2))
    got = experts_product(x, weights, indices, *gate_up, *down, "situ", 4.0, 25.0, input_format or "")
    if input_format is None:
        want = layer_reference(x, weights, indices, gate_up, down, "situ")
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    else:  # the first products' inputs quantized: within MXFP8's rounding of the fp64 layer
        want = layer_reference(mx.fake_quantize(x, input_format), weights, indices, gate_up, down, "situ")
        torch.testing.assert_close(got.double(), want, rtol=0.1, atol=0.05 * want.abs().max().item())


def test_stacked_packed_experts_hold_their_bytes_once_and_follow_what_is_loaded(tmp_path):
    """The first call stacks the experts' bytes (ordinary tensors, even in inference mode) and makes each expert's
    own tensors views of them; a model so stacked saves, and loading other weights into it is what it computes."""
    from k3.config import SiTUConfig
    from k3.model.packed import PackedExperts
    from k3.model.width import Experts

    torch.manual_seed(0)
    first, second = (PackedExperts.pack(Experts(4, 64, 32, "situ", SiTUConfig())).eval() for _ in range(2))
    x, weights, indices = torch.randn(3, 64), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]])
    with torch.inference_mode():
        before = first(x, weights, indices)
    assert not first.gate_up_packed.is_inference()
    w3 = first.packed[2].w3.weight_packed
    assert w3.untyped_storage().data_ptr() == first.gate_up_packed.untyped_storage().data_ptr()
    assert torch.equal(first.gate_up_packed[2, 32:], w3)
    from safetensors.torch import load_file

    from k3.model.safetensors_io import write_shards
    (path,) = write_shards(tmp_path, first.state_dict())
    saved = load_file(path)
    assert saved.keys() == first.state_dict().keys() and torch.equal(saved["packed.2.w3.weight_packed"], w3)
    with torch.no_grad():
        first.load_state_dict(second.state_dict(), assign=True)
        assert torch.equal(first.gate_up_packed[2, 32:], second.packed[2].w3.weight_packed)  # stacked anew
        assert torch.equal(first(x, weights, indices), second(x, weights, indices))
        first.load_state_dict(saved)
        assert torch.equal(first(x, weights, indices), before)
