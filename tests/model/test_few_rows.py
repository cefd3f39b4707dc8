"""Products of a few rows by frozen weights through the CPU kernel (`k3.model.few_rows`, issue 37): the operator
against `torch.nn.functional.linear`, the pass on a frozen graph's MKL products, and a tuned decode step with it
against eager decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_steps import LOGIT_TOLERANCE, generate_both
from k3 import K3ForCausalLM
from k3.config import preset
from k3.model import few_rows
from k3.model.compiled import CompiledModel
from k3.ops import mxfp4_kernel

pytestmark = pytest.mark.skipif(not mxfp4_kernel.available(torch.zeros(1)), reason="no C compiler for the kernel")


@pytest.mark.parametrize("rows", [1, 2, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_the_operator_is_the_linear_product_and_falls_back_beyond_the_kernel(rows, bias):
    """Up to 8 fp32 rows through the kernel, more rows and other dtypes through `F.linear`; bias added."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 40), torch.randn(24, 40)
    b = torch.randn(24) if bias else None
    got = torch.ops.k3.few_rows(x, w, b)
    assert torch.allclose(got, F.linear(x, w, b), atol=1e-5)
    assert torch.ops.k3.few_rows(x.double(), w.double(), None).dtype == torch.float64


def _mkl_graph(rows: int, weight_elements: int) -> torch.fx.Graph:
    """A frozen graph's product as inductor's freezing leaves it: ``mkl::_mkl_linear(x, packed, w, None, rows)``."""
    graph = torch.fx.Graph()
    x, packed, w = (graph.placeholder(name) for name in ("x", "packed", "w"))
    x.meta["val"], w.meta["val"] = torch.empty(rows, 64), torch.empty(weight_elements // 64, 64)
    graph.output(graph.call_function(torch.ops.mkl._mkl_linear, (x, packed, w, None, rows)))
    return graph


@pytest.mark.parametrize(("rows", "elements", "replaced"), [(2, 1 << 20, True), (8, 1 << 22, True),
                                                            (1, 1 << 22, False), (9, 1 << 22, False),
                                                            (4, (1 << 20) - 64, False)])
def test_the_pass_takes_2_to_8_rows_by_weights_of_2_20_elements(rows, elements, replaced):
    graph = _mkl_graph(rows, elements)
    few_rows.FEW_ROWS(graph)
    targets = [node.target for node in graph.nodes if node.op == "call_function"]
    assert targets == ([torch.ops.k3.few_rows.default] if replaced else [torch.ops.mkl._mkl_linear])
    if replaced:
        (node,) = (n for n in graph.nodes if n.op == "call_function")
        assert [a.name if a is not None else None for a in node.args] == ["x", "w", None]


def test_a_tuned_step_of_two_rows_takes_its_products_through_the_kernel_with_eager_tokens(monkeypatch):
    """Every product by a weight through the kernel (none of `tiny`'s has 2^20 elements): greedy tokens and logits
    of a batch of 2 as eager decoding's, and the graph calls ``k3::few_rows``."""
    monkeypatch.setattr(few_rows, "MIN_ELEMENTS", 0)
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("tiny")).eval()
    compiled = CompiledModel(model, batches=(2,), sizes=(4, 1))
    prompt = torch.tensor([[5, 9, 3, 7, 11, 2, 8, 4], [40, 1, 77, 30, 6, 6, 19, 23]])
    eager, fast, worst = generate_both(model, compiled, prompt, steps=5)
    assert fast == eager and worst < LOGIT_TOLERANCE
    with torch.inference_mode(), torch.profiler.profile() as profile:
        _, state = model(prompt, state=model.new_state(2))
        compiled.decode(prompt[:, -1:], state)
    assert "k3::few_rows" in {event.key for event in profile.key_averages()}
