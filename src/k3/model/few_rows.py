"""Products of a few rows by frozen fp32 weights through the CPU kernel's `dense` (issue 37).

A tuned decode step (`k3.model.compiled_step`, frozen weights) leaves its products by weights to inductor's freezing
pass, which packs them for MKL (``mkl::_mkl_linear``), and to its C++ GEMM template. At 2–8 rows both read the
weights well below the memory's rate (8–10 GB/s for MKL at 8 rows of a 4,136 × 1,024 weight, ~15 GB/s for the
template in a profiled d = 1024 step), where `k3.ops.mxfp4_kernel.dense` (each weight row read once against every
row of x, 3 × B accumulators in AVX-512 registers) reads 21–35 GB/s. Decoding streams every weight once per token,
so a step runs at the speed its products read them (``python benchmarks/few_rows.py``: the tuned step with and
without this pass).

`FEW_ROWS`, an inductor post-grad pass of tuned CPU graphs, turns each ``mkl::_mkl_linear`` of `MIN_ROWS` to
`mxfp4_kernel.DENSE_ROWS` rows by a weight of `MIN_ELEMENTS` or more into `few_rows` (``k3::few_rows``): one
operator, whose call costs more than MKL's, so smaller weights keep MKL, and so does a single row, which MKL's
packed product reads as fast. Where the kernel is not built the operator is `torch.nn.functional.linear`. Results
are the product's within float reassociation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from k3.ops import mxfp4_kernel

__all__ = ["FEW_ROWS", "MIN_ELEMENTS", "MIN_ROWS", "FewRows", "few_rows"]


MIN_ELEMENTS = 1 << 20  # smaller weights stay with MKL (see the module docstring)
MIN_ROWS = 2  # one row stays with MKL, whose packed product reads a single row's weights at the kernel's speed
_LIBRARY = torch.library.Library("k3", "FRAGMENT")
_LIBRARY.define("few_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def few_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for ``x [M, K]``, ``weight [N, K]``, ``bias [N]`` or None (``k3::few_rows``):
    `mxfp4_kernel.dense` for at most `mxfp4_kernel.DENSE_ROWS` fp32 CPU rows where the kernel is built,
    `torch.nn.functional.linear` otherwise."""
    if (x.dim() == 2 and x.shape[0] <= mxfp4_kernel.DENSE_ROWS and weight.dtype == torch.float32
            and weight.device.type == "cpu" and mxfp4_kernel.available(x)):
        y = mxfp4_kernel.dense(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


_LIBRARY.impl("few_rows", few_rows, "CompositeExplicitAutograd")


@torch.library.register_fake("k3::few_rows", lib=_LIBRARY)
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class FewRows(CustomGraphPass):
    """Inductor's ``post_grad_custom_pre_pass`` for frozen graphs: ``mkl::_mkl_linear(x, packed, w, bias, M)`` with
    `MIN_ROWS` ≤ ``M`` ≤ ``DENSE_ROWS`` and ``w`` of at least `MIN_ELEMENTS` elements becomes
    ``k3::few_rows(x, w, bias)`` (the packed copy is then unused and dropped)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _MKL_LINEAR:
                continue
            x, _, weight, bias, rows = node.args
            value = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
            if (not isinstance(value, Tensor) or value.numel() < MIN_ELEMENTS
                    or not MIN_ROWS <= rows <= mxfp4_kernel.DENSE_ROWS):
                continue
            with graph.inserting_before(node):
                product = graph.call_function(torch.ops.k3.few_rows.default, (x, weight, bias))
            product.meta = dict(node.meta)
            node.replace_all_uses_with(product)
            graph.erase_node(node)
            changed = True
        if changed:
            graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        """Part of inductor's cache key for the graphs compiled with this pass: this file's hash, `MIN_ELEMENTS` and
        the kernel's source."""
        return get_hash_for_files((__file__, mxfp4_kernel.SOURCE)) + f"{MIN_ELEMENTS} {MIN_ROWS}".encode()


_MKL_LINEAR = (torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default)  # freezing inserts the packet
FEW_ROWS = FewRows()
