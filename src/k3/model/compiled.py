"""A compiled decode step (issue 18): `torch.compile` (inductor) of `K3ForCausalLM`'s one-token call with a state.

Eager decoding pays Python and dispatch overhead on ~2,000 small operators per token; compiled, the step is one
graph of fused kernels (C++/OpenMP on CPU; on CUDA the same code path, where inductor can also use CUDA graphs).
The graph has no break: the routers count their load with a static-shape scatter, the routed experts run on the
gathered weights of each token's selected experts (`k3.model.width.Experts._gathered`), and the token-id check
runs here, eagerly, before the call.

Recompilation: one graph per batch size. The MLA caches grow by one entry per token, so their length is marked
dynamic; the ShortConv windows are given one memory layout; the state's token count stays outside the graph. So
the graph is traced once for every context length: `compilations` counts the graphs inductor built (a test holds
it at one per batch size) and ``compile_seconds`` the first call of each batch size. One exception: dynamo
specialises sizes 0 and 1, so a first step after a one-token prompt builds a graph for that length alone.
Inductor caches its kernels on disk, so a second process compiles faster. Importing this module imports nothing
of the compiler.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor

from k3.model.lm import K3ForCausalLM
from k3.model.sequence.mla import MLACache
from k3.model.state import DecoderState


class CompiledDecode:
    """``step(input_ids [B, 1], state) -> (logits [B, 1, V], state)``: what ``model(input_ids, state=state)`` gives
    (logits within float reassociation: fp32 ~1e-5 relative), compiled once per batch size."""

    def __init__(self, model: K3ForCausalLM) -> None:
        self.model = model
        self.compilations = 0
        self.compile_seconds: dict[int, float] = {}
        self._compiled = torch.compile(self._forward, backend=self._backend, dynamic=False)

    def _forward(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        return self.model(input_ids, state=state)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]):  # noqa: ANN202
        from torch._inductor.compile_fx import compile_fx

        self.compilations += 1
        return compile_fx(graph, example_inputs)

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        vocab = self.model.config.vocab_size
        if input_ids.dim() != 2 or input_ids.shape[1] != 1 or input_ids.is_floating_point():
            raise ValueError(f"input_ids: a compiled decode step takes integer ids [B, 1], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids: token ids must lie in [0, vocab_size={vocab})")
        layers = []
        for layer in state.layers:
            if isinstance(layer, MLACache):
                for t in (layer.latent, layer.shared_key):
                    torch._dynamo.maybe_mark_dynamic(t, 1)
            else:  # a ShortConv window is a view with its producer's strides: give every call one layout
                layer = replace(layer, conv=layer.conv.clone(memory_format=torch.contiguous_format))
            layers.append(layer)
        state = replace(state, layers=layers)
        batch, start = input_ids.shape[0], time.perf_counter()
        # the token count is bookkeeping outside the graph (a Python int the graph would specialise on)
        logits, after = self._compiled(input_ids, replace(state, position=0))
        self.compile_seconds.setdefault(batch, time.perf_counter() - start)
        return logits, replace(after, position=state.position + 1)
