"""Products by weights that are inputs of a compiled graph, through oneDNN (issue 37).

A graph whose weights are its inputs — a precompiled step (`k3.model.precompiled`), an untuned prefill piece —
leaves each matrix product to ``aten.mm``, which on CPU calls MKL. Decoding streams the weights once per token, so a
step runs at the speed its products read them: MKL's fp32 GEMV reads ~14 GB/s on two cores of this machine, where
oneDNN's matmul reads the same plain row-major weights at ~22–26 GB/s (the 1024 × 1024 to 4096 × 1024 matrices of a
d=1024 model, 1 to 64 rows). oneDNN costs ~15 µs a call more, which loses on small weights: ``small``'s precompiled
decode step takes 5.8–6.4 ms with every product through it, 4.4–5.0 with MKL. So only weights of `MIN_ELEMENTS` (2^20, a
1024 × 1024 matrix) or more go through it: ``small`` keeps MKL's speed, and a d=1024 model's step at batch 1 takes
19.6 ms against 23.1–23.4 with MKL (eager 34.5; ``python benchmarks/onednn.py``, which also times every product through
oneDNN).

`ONEDNN`, an inductor post-grad pass, turns those ``mm`` / ``addmm`` of an fp32 CPU input by the transpose of a 2-D
fp32 graph input into `linear` (``k3::linear``): one custom operator, called by the graph like its other library
calls, saved with a precompiled graph and loaded with it. Frozen weights (a tuned step) are constants, not inputs,
and keep inductor's own prepacked oneDNN products. The results are the product's within float reassociation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["MIN_ELEMENTS", "ONEDNN", "OneDNNLinear", "linear"]


MIN_ELEMENTS = 1 << 20  # smaller weights stay with MKL (see the module docstring)
_LIBRARY = torch.library.Library("k3", "FRAGMENT")  # a plain definition: a few µs a call less than `custom_op`'s
_LIBRARY.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for ``x [M, K]``, ``weight [N, K]``, ``bias [N]`` or None (``k3::linear``): oneDNN's
    matmul for fp32 CPU tensors with K > 0 where PyTorch has oneDNN, `torch.nn.functional.linear` otherwise."""
    tensors = [x, weight] if bias is None else [x, weight, bias]
    if (torch.backends.mkldnn.is_available() and x.dim() == 2 and weight.dim() == 2 and x.shape[1] > 0
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


_LIBRARY.impl("linear", linear, "CompositeExplicitAutograd")


@torch.library.register_fake("k3::linear", lib=_LIBRARY)
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class OneDNNLinear(CustomGraphPass):
    """Inductor's ``post_grad_custom_pre_pass``: ``mm(x, permute(w, [1, 0]))`` and ``addmm(b, x, permute(w, [1, 0]))``
    (default ``beta`` and ``alpha``, ``b`` of the product's width) become ``k3::linear(x, w, b)`` where ``w`` is an
    fp32 CPU graph input of two dimensions and at least `MIN_ELEMENTS` elements and ``x`` is fp32 on the CPU."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.kwargs or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            bias, x, transposed = (None, *node.args) if node.target is aten.mm.default else node.args
            weight = _transposed_input(transposed)
            if weight is None or not _fp32_cpu(x, 2) or (bias is not None and not (
                    _fp32_cpu(bias, 1) and bias.meta["val"].shape[0] == weight.meta["val"].shape[0])):
                continue
            with graph.inserting_before(node):
                product = graph.call_function(torch.ops.k3.linear.default, (x, weight, bias))
            product.meta = dict(node.meta)
            node.replace_all_uses_with(product)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        """Part of inductor's cache key for the graphs compiled with this pass: this file's hash and `MIN_ELEMENTS`."""
        return get_hash_for_files((__file__,)) + str(MIN_ELEMENTS).encode()


def _transposed_input(node: object) -> torch.fx.Node | None:
    """``w`` where ``node`` is ``permute(w, [1, 0])`` of a graph input ``w``: fp32, CPU, two dimensions and at least
    `MIN_ELEMENTS` elements."""
    if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.permute.default
            and list(node.args[1]) == [1, 0]):
        return None
    weight = node.args[0]
    if not (isinstance(weight, torch.fx.Node) and weight.op == "placeholder" and _fp32_cpu(weight, 2)):
        return None
    return weight if weight.meta["val"].numel() >= MIN_ELEMENTS else None


def _fp32_cpu(node: object, dims: int) -> bool:
    """Whether ``node`` is a graph value: an fp32 CPU tensor of ``dims`` dimensions."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return (isinstance(value, Tensor) and value.dtype == torch.float32 and value.device.type == "cpu"
            and value.dim() == dims)


ONEDNN = OneDNNLinear()
