"""Same-input projections stacked into one product (`k3.model.projections`, issue 18): inside `fused` a traced KDA,
MLA or LatentMoE layer multiplies its input once where eager code multiplies it per weight, with the same outputs
(fp64: 1e-12); outside `fused`, or for layers that are not plain bias-free `nn.Linear`, nothing is stacked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3.config import preset
from k3.model.projections import constant, fused, project
from k3.model.sequence.kda import KDALayer
from k3.model.sequence.mla import GatedMLA
from k3.model.width import LatentMoE


def _linear_calls(fn, *args, fuse: bool) -> tuple[int, object]:
    """How many ``linear`` calls the graph dynamo traces from ``fn(*args)`` holds, and its output."""
    counts = []

    def backend(graph: torch.fx.GraphModule, _inputs):  # noqa: ANN202
        nodes = graph.graph.nodes
        counts.append(sum(node.op == "call_function" and node.target is torch._C._nn.linear for node in nodes))
        return graph.forward

    torch._dynamo.reset()
    with fused(fuse), torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return sum(counts), out


def _layers():
    config = preset("tiny")
    torch.manual_seed(0)
    kda, mla, moe = KDALayer(config).double(), GatedMLA(config).double(), LatentMoE(config).double()
    x = torch.randn(2, 1, config.hidden_size, dtype=torch.float64)
    return {
        # q, k, v, decay, β, gate stacked (then the decay's and nothing else's second factor; the output projection)
        "kda": (lambda x, s: kda(x, s), (x, kda.new_state(2, dtype=torch.float64)), 6),
        # query down-projection, kv down-projection (+ gate when the config has one) stacked
        "mla": (lambda x, s: mla(x, s), (x, mla.new_state(2, dtype=torch.float64)), 2 + (mla.g_proj is not None)),
        # latent down-projection and the shared experts' gate and up stacked
        "moe": (lambda x: moe(x), (x,), 3),
    }


@pytest.mark.parametrize("name", ["kda", "mla", "moe"])
def test_fused_trace_stacks_the_products_of_one_input_and_keeps_the_outputs(name):
    fn, args, stacked = _layers()[name]
    with torch.no_grad():
        expected = fn(*args)
    plain, out_plain = _linear_calls(fn, *args, fuse=False)
    fewer, out_fused = _linear_calls(fn, *args, fuse=True)
    assert plain - fewer == stacked - 1, (plain, fewer)
    for got in (out_plain, out_fused):
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got,
                                   expected[0] if isinstance(expected, tuple) else expected, rtol=1e-12, atol=1e-12)


def test_project_runs_layer_by_layer_unless_fused_while_compiling():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 3, bias=False).double(), nn.Linear(8, 5, bias=False).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with fused():  # eager: never stacked
        got = project(x, a, b)
    assert [t.shape[-1] for t in got] == [3, 5]
    torch.testing.assert_close(got[0], x @ a.weight.T, rtol=0, atol=0)
    torch.testing.assert_close(got[1], x @ b.weight.T, rtol=0, atol=0)


def test_layers_with_a_bias_or_hooks_are_not_stacked():
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64)
    biased = [nn.Linear(8, 3).double(), nn.Linear(8, 5, bias=False).double()]
    calls, out = _linear_calls(lambda x: project(x, *biased), x, fuse=True)
    assert calls == 2
    torch.testing.assert_close(out[0], biased[0](x), rtol=1e-12, atol=1e-12)

    class Scaled(nn.Linear):
        def forward(self, x):  # noqa: ANN001, ANN202
            return 2 * super().forward(x)

    sub = [Scaled(8, 3, bias=False).double(), nn.Linear(8, 5, bias=False).double()]
    calls, out = _linear_calls(lambda x: project(x, *sub), x, fuse=True)
    assert calls == 2
    torch.testing.assert_close(out[0], 2 * (x @ sub[0].weight.T), rtol=1e-12, atol=1e-12)

    hooked = [nn.Linear(8, 3, bias=False).double(), nn.Linear(8, 5, bias=False).double()]
    hooked[1].register_forward_hook(lambda _module, _args, out: -out)
    calls, out = _linear_calls(lambda x: project(x, *hooked), x, fuse=True)
    assert calls == 2
    torch.testing.assert_close(out[1], -(x @ hooked[1].weight.T), rtol=1e-12, atol=1e-12)


class _SecondHalf(nn.Module):
    """``x @ W_uv`` as MLA's absorbed attention multiplies it: ``W_uv`` a view at an offset into a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 128, 64) / 8)  # [heads, nope + v, latent]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, constant(self.weight[:, 64:]).transpose(1, 2))


def test_a_constant_view_is_its_own_constant_in_a_frozen_graph_and_the_view_itself_elsewhere():
    """Inductor's C++ batched-GEMM template (frozen weights, ``max_autotune``; torch 2.13) reads a constant operand
    from the start of its storage: on the bare view ``W_uv`` this product came out up to 5.5 off. `constant` makes the
    view a constant of its own where weights are constants (inside `fused`, compiling), so the tuned graph gives eager's
    product; eager, it is the view itself (no copy)."""
    torch.manual_seed(0)
    module, x = _SecondHalf().eval(), torch.randn(2, 5, 64)
    view = module.weight[:, 64:]
    assert constant(view) is view
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    torch._dynamo.reset()
    with torch.no_grad(), fused(), torch._inductor.config.patch(options):
        expected = module(x)
        got = torch.compile(module)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_entering_fused_does_not_compile_again_a_graph_traced_outside_it_on_a_fresh_thread():
    """A graph traced on a thread that had never entered `fused` is still valid after a call there did: dynamo guards
    what the trace read of the per-thread switch (its value, not whether the thread ever set it)."""
    import threading

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as graphs_of

    layers = [nn.Linear(8, 8, bias=False) for _ in range(2)]
    x = torch.randn(3, 8)

    def both(x: torch.Tensor) -> torch.Tensor:
        a, b = project(x, *layers)
        return a + b

    compiled, graphs, errors = torch.compile(both, backend="eager", dynamic=False), [], []

    def serve() -> None:
        try:
            with torch.no_grad():
                compiled(x)
                graphs.append(len(graphs_of(both.__code__)))
                with fused():
                    pass
                compiled(x)
                graphs.append(len(graphs_of(both.__code__)))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    torch._dynamo.reset()
    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()
    assert not errors and graphs == [1, 1]
