"""Same-input projections as one matrix product (issue 18).

A layer multiplies its input by several weights: KDA's q, k, v, decay and β projections and output gate (SPEC §1),
MLA's query and key–value down-projections and output gate (§2), a GLU's gate and up projections (Eq. 18). At one
decode token each is a small matrix–vector product whose fixed cost (a kernel call, a parallel region) outweighs its
arithmetic; stacked row-wise they are one product over the same bytes. Where the weights are constants of a compiled
graph (`k3.model.compiled`'s frozen decode step) the stacking is folded once, at compilation; anywhere else it would
copy the weights on every call, so `project` stacks only inside `fused()` and only while compiling.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

class _Fused(threading.local):
    """Per thread (a graph compiled in the background traces beside one that runs): inside `fused`. Set on every
    thread from the start: dynamo guards what a trace read of it, and a guard on the attribute's absence failed
    once any call on the thread had entered `fused`, compiling again graphs traced before it (the EAGLE draft's)."""

    on = False


_FUSED = _Fused()


@contextmanager
def fused(on: bool = True) -> Iterator[None]:
    """Within (on this thread): `project` traces one product on the stacked weights (for graphs whose weights are
    constants)."""
    previous, _FUSED.on = _FUSED.on, on
    try:
        yield
    finally:
        _FUSED.on = previous


def project(x: Tensor, *layers: nn.Module) -> list[Tensor]:
    """``[layer(x) for layer in layers]``, as one matmul on the stacked weights when tracing inside `fused` and
    every layer is a plain bias-free `nn.Linear` of one dtype (anything else runs module by module, its hooks
    included)."""
    stack = (_FUSED.on and torch.compiler.is_compiling() and len(layers) > 1
             and all(_plain(layer) for layer in layers) and len({layer.weight.dtype for layer in layers}) == 1)
    if not stack:
        return [layer(x) for layer in layers]
    weight = torch.cat([layer.weight for layer in layers])
    return list(F.linear(x, weight).split([layer.out_features for layer in layers], dim=-1))


def constant(weight: Tensor) -> Tensor:
    """``weight`` (a view of a parameter) as a contiguous tensor of its own when tracing inside `fused` — folded
    once, at compilation — else the view itself. Inductor's C++ GEMM templates (torch 2.13, ``max_autotune``; batched
    and plain products alike) read a constant operand from the start of its storage, ignoring a view's offset: MLA's
    ``W_uv``, the second half of ``kv_b_proj.weight``, gave a verification graph logits 0.02–1.1 off (tested in
    `tests/model/test_compiled.py`; the product alone: ``tests/model/test_projections.py``). Compiled experts read
    gathered copies (`k3.model.width.Experts._gathered`), not views."""
    if _FUSED.on and torch.compiler.is_compiling():
        return weight.contiguous()
    return weight


def _plain(layer: nn.Module) -> bool:
    """A bias-free `nn.Linear` itself (not a subclass, e.g. an MX fake-quant layer) without forward hooks."""
    return (type(layer) is nn.Linear and layer.bias is None
            and not (layer._forward_hooks or layer._forward_pre_hooks))
