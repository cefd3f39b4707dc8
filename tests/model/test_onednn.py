"""``k3::linear`` and the pass that puts it into graphs whose weights are inputs (`k3.model.onednn`, issue 37): the
operator against an fp64 product, its fallbacks, its fake (``opcheck``), and which products a real compilation
rewrites — fp32 CPU products by the transpose of a graph input, with or without a bias — and which it leaves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.model import onednn
from k3.model.onednn import ONEDNN, OneDNNLinear, linear


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in fp64, one output at a time."""
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float64)
    for i in range(x.shape[0]):
        for j in range(weight.shape[0]):
            out[i, j] = (x[i].double() * weight[j].double()).sum() + (0.0 if bias is None else float(bias[j]))
    return out


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_operator_is_the_fp64_product(rows, with_bias):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 19), torch.randn(37, 19)
    bias = torch.randn(37) if with_bias else None
    expected = _reference(x, weight, bias)
    for inputs in ((x, weight), (x.t().contiguous().t(), weight), (x, weight.t().contiguous().t())):  # strides
        out = torch.ops.k3.linear(*inputs, bias)
        assert out.dtype == torch.float32 and out.shape == (rows, 37)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_what_onednn_does_not_take_goes_to_torch_linear():
    """fp64, an empty inner dimension and an empty batch: `torch.nn.functional.linear`'s results."""
    x, weight, bias = torch.randn(3, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64), None
    torch.testing.assert_close(linear(x, weight, bias), _reference(x, weight, bias), rtol=1e-12, atol=1e-12)
    bias = torch.randn(4)
    assert torch.equal(linear(torch.randn(3, 0), torch.randn(4, 0), bias), bias.expand(3, 4))
    assert linear(torch.randn(0, 5), torch.randn(4, 5)).shape == (0, 4)


def test_the_operator_and_its_fake_agree():
    x, weight, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    torch.library.opcheck(torch.ops.k3.linear.default, (x, weight, bias),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


class _Recording(OneDNNLinear):
    """The pass, keeping the targets of the graph it rewrote."""

    def __init__(self) -> None:
        self.targets: list = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        super().__call__(graph)
        self.targets = [node.target for node in graph.nodes if node.op == "call_function"]


def test_a_compiled_graph_takes_the_products_by_weight_inputs_and_leaves_the_others(monkeypatch):
    """fp32 products of an input by a transposed weight input of `MIN_ELEMENTS` or more, with and without a bias,
    become ``k3::linear``; a product by a smaller weight, by a computed matrix, a product of two activations not
    transposed and an fp64 product stay ``mm``. The compiled function gives the fp64 results."""
    from torch._inductor import config

    def step(x, weight, bias, small, other, x64, w64):
        hidden = F.linear(x, weight, bias)  # addmm
        out = F.linear(torch.relu(hidden), weight.t()[:, :8].t().contiguous())  # a computed matrix
        return F.linear(x, weight), F.linear(x, small), out, hidden @ other, F.linear(x64, w64)

    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 16 * 16)
    torch.manual_seed(0)
    inputs = (torch.randn(2, 16), torch.randn(16, 16), torch.randn(16), torch.randn(15, 16), torch.randn(16, 4),
              torch.randn(2, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64))
    recording = _Recording()
    torch._dynamo.reset()
    with config.patch(post_grad_custom_pre_pass=recording, fx_graph_cache=False):
        outs = torch.compile(step, fullgraph=True)(*inputs)
    aten = torch.ops.aten
    assert recording.targets.count(torch.ops.k3.linear.default) == 2
    assert recording.targets.count(aten.mm.default) == 4 and aten.addmm.default not in recording.targets
    x, weight, bias, small, other, x64, w64 = inputs
    hidden = _reference(x, weight, bias)
    expected = (_reference(x, weight, None), _reference(x, small, None), torch.relu(hidden) @ weight[:8].double().t(),
                hidden @ other.double(), x64 @ w64.t())
    for out, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_the_cache_key_holds_the_pass_source_and_its_threshold(monkeypatch):
    """Inductor keys graphs compiled with the pass by its `uuid`: another threshold is another key."""
    key = ONEDNN.uuid()
    assert key == OneDNNLinear().uuid()
    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 0)
    assert ONEDNN.uuid() != key
