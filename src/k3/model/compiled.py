"""Compiled forward steps (issue 18): `torch.compile` (inductor) of the decode step and the prefill-chunk step.

Eager decoding pays Python and dispatch overhead on ~2,000 small operators per token; compiled, a step is one graph
of fused kernels (C++/OpenMP on CPU, Triton on CUDA). `CompiledStep` compiles `K3ForCausalLM.forward_groups` for one
group, ``(input_ids [B, T], state) -> (logits [B, V] of each row's last position, state)``, with no graph break: the
routers select and count with static-shape code (`k3.model.width.Router`), the routed experts run on the gathered
weights of each token's selected experts (`Experts._gathered`), and the token-id check runs here, before the call.

Recompilation is deliberate. A graph is built per shape key — batch size, chunk length, whether the MLA caches hold
0, 1 or more entries (dynamo specialises sizes 0 and 1; longer caches share one graph, their length marked dynamic,
up to `CASCADE_SUM` attended positions and beyond it another), left padding or none — and ``compilations`` counts
the graphs. The MLA caches enter a graph as `k3.model.sequence.mla.MLASlots` (their storage with room for the step's
entries, its length carried as a dynamic size) and the graph writes the new entries in place, so a decode step no
longer copies the caches (`MLACache` keeps its values immutable: a second continuation of a state moves to new
storage); compiled, the products over the cache are generated reductions. `CompiledModel` keeps the keys a server
reaches to a set it can build before serving (`warm_up`, ``k3 serve --compile``): the first tokens of a sequence (a
cache of 0 or 1 positions) run eagerly, and a decode batch always carries its padding. A key seen before runs under
``skip_guard_eval_unsafe`` (only the guards that tell its graphs apart), which saves ~0.5 ms of guard checks per
call; the key also holds what else a guard tests (dtypes, strides made canonical, train/eval mode, the thread
count, where the weights live and how often they were written), so a call that might need a new graph always runs
every guard.
`CompiledModel` buckets the keys: decode batches are padded up to the next of `DECODE_BATCHES` with copies of row 0
(vLLM's capture sizes), and a prefill chunk runs as pieces of the `PREFILL_PIECES` lengths (37 = 16 + 16 + 4 + 1) —
exact, since the state carries across pieces, and no padding token ever enters a state.

``tuned`` (the default for decode) adds inductor's freezing, its C++ GEMM templates (``max_autotune``) and its C++
wrapper: the weights become constants of the graph, the products of one input are one product on the stacked
weights (`k3.model.projections.fused`, stacked once at compilation), the matrix–vector products are generated
code fused with their neighbours instead of library calls, and the kernels are called from C++ — 2.5× faster decode
on CPU, ~60 s of compilation per graph. Frozen weights are snapshots, so a change to the model's parameters (an
optimiser step, a `load_state_dict`) is detected at the next call, which resets `torch.compiler` (every compiled
graph of the process) and compiles anew. Compiled kernels are cached on disk by inductor. Importing this module
imports nothing of the compiler; it sets torch.nn's global parameter and buffer registration hooks (a counter that
tells the weights' list went stale).
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

import torch
from torch import Tensor

from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts
from k3.model.projections import fused
from k3.model.sequence.kda import KDAState
from k3.model.sequence.mla import MLACache, MLASlots
from k3.model.state import DecoderState
from k3.model.width import Experts

DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
PREFILL_PIECES = (64, 16, 4, 1)
# inductor's C++ code sums more than this many fp32 terms in chunks (`need_use_acc_helper` in its cpp codegen), so a
# graph of a dynamic cache length holds a guard on which side of it the attention's length lies: two graph families
CASCADE_SUM = 4096
_RESETS = [0]  # `torch.compiler.reset` calls made here: every shape key seen before is cold again
_REGISTRATIONS = [0]  # parameters and buffers (re)registered on any module since this module was imported


def _registered(*_: object) -> None:
    """torch.nn's global hook on a parameter or buffer assigned to any module."""
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_buffer_registration_hook(_registered)


def _eager_packed_dispatch() -> None:
    """Packed experts' dispatch runs eagerly inside a compiled step: which experts a step reads depends on the
    routing (a graph per routing otherwise), and their product is the packed-byte kernel's, not inductor's. Marked
    when a step is first compiled: `torch.compiler.disable` at import would load the compiler for eager users."""
    if "forward" not in vars(PackedExperts):
        PackedExperts.forward = torch.compiler.disable(Experts.forward)


class CompiledStep:
    """``step(input_ids [B, T], state) -> (logits [B, V], state)``: what ``model.forward_groups([(input_ids,
    state)])[0]`` gives (logits within float reassociation, ~1e-5 relative in fp32), compiled once per shape key.
    A ``replayed`` step is a speculative verification: ``forward_groups(..., full=[True], replay=[True])``, logits
    of every position ``[B·T, V]`` and a state whose `Replay` rolls back to any prefix of the run."""

    def __init__(self, model: K3ForCausalLM, tuned: bool = False, replayed: bool = False) -> None:
        self.model, self.tuned, self.replayed = model, tuned, replayed
        _eager_packed_dispatch()
        self.compilations = 0
        self.compile_seconds: dict[tuple, float] = {}  # shape key -> seconds of the call that compiled it
        self._warm: set[tuple] = set()
        self._registrations, self._tensors = -1, []
        self._weights = self._weights_version()
        self._compiled = torch.compile(self._forward, backend=self._backend, dynamic=False)
        # one code object holds every instance's graphs: dynamo's default of 8 would fall back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)

    def _forward(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        (logits, after), = self.model.forward_groups([(input_ids, state)], full=[self.replayed],
                                                     replay=[self.replayed])
        return logits, after

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]):  # noqa: ANN202
        from torch._inductor.compile_fx import compile_fx

        self.compilations += 1
        return compile_fx(graph, example_inputs)

    def _options(self) -> dict:
        """Inductor's options for a new graph: dynamo reads ``freezing`` while it traces, inductor on first call."""
        if not self.tuned:
            return {}
        cpu = next(self.model.parameters()).device.type == "cpu"
        return {"freezing": True, "max_autotune": True, "cpp_wrapper": True,  # the graph's calls made from C++ too
                **({"max_autotune_gemm_backends": "CPP,ATEN"} if cpu else {})}

    def _weights_version(self) -> tuple[int, int]:
        """Where the weights live and how often they were written (what frozen graphs hold as constants). The list
        of weights is gathered again only after a module anywhere (re)registered a parameter or buffer: walking the
        module tree on every step cost ~0.7 ms, a fifth of a compiled decode step of ``small``."""
        if self._registrations != _REGISTRATIONS[0]:
            self._registrations = _REGISTRATIONS[0]
            self._tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.data_ptr() for t in self._tensors), sum(t._version for t in self._tensors)

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        vocab = self.model.config.vocab_size
        if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: a compiled step takes integer ids [B, T], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids: token ids must lie in [0, vocab_size={vocab})")
        if state.batch_size != input_ids.shape[0] or state.replay is not None:
            raise ValueError(f"state: expected a DecoderState of batch size {input_ids.shape[0]} without a replay")
        weights = self._weights_version()
        if self.tuned and weights != self._weights:  # frozen weights gone stale: every graph is built anew
            torch.compiler.reset()
            _RESETS[0] += 1
        self._weights = weights
        tokens = input_ids.shape[1]
        shape = (*input_ids.shape, cached(state, tokens), state.padding is None, state.depth is None,
                 frozenset(layer.latent.dtype if isinstance(layer, MLACache) else layer.recurrent.dtype
                           for layer in state.layers),
                 self.model.training, torch.get_num_threads(),  # a guard of dynamo's global state
                 torch.is_inference_mode_enabled(),  # inference tensors dispatch differently
                 tuple(layer.capture for layer in self.model.layers))  # features kept (`K3ForCausalLM.capture`)
        key, built = (*shape, weights, _RESETS[0]), self.compilations
        warm = key in self._warm
        if warm:
            stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        else:
            from torch._inductor import config as inductor

            stance = inductor.patch(self._options())
        slots = _slots(state, tokens)
        inputs = DecoderState([_graph_input(layer) for layer in slots], _optional(state.depth), 0,
                              _optional(state.padding))
        start = time.perf_counter()
        # frozen weights: the products of one input run as one (`k3.model.projections`); the token count is
        # bookkeeping outside the graph (a Python int the graph would specialise on)
        with stance, fused(self.tuned):
            logits, after = self._compiled(_canonical(input_ids), inputs)
        self._warm.add(key)
        if self.compilations > built:
            self.compile_seconds[shape] = time.perf_counter() - start
        # the graph's output caches view the storage it wrote into: tie them to it, now that much longer
        layers = [before.storage.advance(out) if isinstance(before, MLASlots) else out
                  for out, before in zip(after.layers, slots, strict=True)]
        replay = None if after.replay is None else replace(after.replay, before=state)  # the caller's own state
        return logits, replace(after, layers=layers, position=state.position + tokens, replay=replay)


def _slots(state: DecoderState, tokens: int) -> list:
    """Each MLA layer's cache as `MLASlots` with room for ``tokens`` entries (the graph writes them in place), all of
    one capacity (a graph's symbolic sizes of equal values are one symbol, which later calls must keep equal)."""
    slots = [layer.slots(tokens) if isinstance(layer, MLACache) else layer for layer in state.layers]
    if len({s.latent_storage.shape[1] for s in slots if isinstance(s, MLASlots)}) > 1:
        slots = [MLACache(s.latent, s.shared_key).slots(tokens) if isinstance(s, MLASlots) else s for s in slots]
    return slots


def _graph_input(layer: KDAState | MLASlots) -> KDAState | MLASlots:
    """A layer's state as a graph input: `MLASlots` without its Python bookkeeping, the storage's length dimension
    and the length carrier marked dynamic; a KDA state with canonical strides."""
    if not isinstance(layer, MLASlots):
        return replace(layer, **{f.name: _canonical(getattr(layer, f.name)) for f in fields(layer)})
    for t in (layer.latent_storage, layer.key_storage):
        torch._dynamo.maybe_mark_dynamic(t, 1)
    torch._dynamo.maybe_mark_dynamic(layer.filled, 0)
    return replace(layer, storage=None)


def _optional(t: Tensor | None) -> Tensor | None:
    return None if t is None else _canonical(t)


def _canonical(t: Tensor) -> Tensor:
    """``t`` with a fresh tensor's strides (dynamo guards on every stride, size-1 dimensions' included): a slice of
    a prompt or a ShortConv window cut from a chunk would otherwise make a graph of its own."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    return t if t.stride() == tuple(reversed(expected)) else t.clone(memory_format=torch.contiguous_format)


def cached(state: DecoderState, tokens: int = 1) -> int:
    """The cache part of a shape key for a step of ``tokens`` new positions: the MLA caches' length, 0, 1, 2 for "2 or
    more" (dynamo specialises sizes 0 and 1; longer caches share a graph) or 3 where the attention spans more than
    `CASCADE_SUM` positions; 2 for a model without MLA layers."""
    length = min((layer.length for layer in state.layers if isinstance(layer, MLACache)), default=None)
    if length is None:
        return 2
    return length if length < 2 else 3 if length + tokens > CASCADE_SUM else 2


def pieces(length: int, sizes: tuple[int, ...] = PREFILL_PIECES) -> list[int]:
    """``length`` as a sum of ``sizes`` (which hold 1), largest first: the compiled prefill's chunk pieces."""
    out = []
    for size in sorted(sizes, reverse=True):
        out += [size] * (length // size)
        length %= size
    return out


class CompiledModel:
    """A model's decode and prefill-chunk steps, compiled over bucketed shapes (``k3 generate / serve / chat
    --compile``, ``Engine(compile=True)``). Called like the model (``compiled(input_ids, state)``, `decode`,
    `prefill`) they return what ``model(input_ids, state=state)`` gives at the last position: logits ``[B, 1, V]``
    and the state; `step` gives the logits ``[B, V]`` of `K3ForCausalLM.forward_groups` (the engine's form)."""

    def __init__(self, model: K3ForCausalLM, batches: tuple[int, ...] = DECODE_BATCHES,
                 sizes: tuple[int, ...] = PREFILL_PIECES, tuned: bool = True) -> None:
        if 1 not in sizes or min(batches, default=0) < 1:
            raise ValueError(f"sizes must hold 1 and batches be positive, got sizes={sizes}, batches={batches}")
        self.model, self.batches, self.sizes = model, tuple(sorted(batches)), tuple(sizes)
        self.decode_step, self.prefill_step = CompiledStep(model, tuned), CompiledStep(model)
        self.verify_step = CompiledStep(model, tuned, replayed=True)
        # the last padded decode: (the rows returned, the whole bucket), so a batch that is not a bucket continues
        # its filler rows too and its caches keep growing in place instead of being stacked anew every step
        self._padded: tuple[DecoderState, DecoderState] | None = None

    @property
    def compilations(self) -> int:
        return self.decode_step.compilations + self.prefill_step.compilations + self.verify_step.compilations

    @property
    def compile_seconds(self) -> dict[tuple, float]:
        return {**{("decode", *k): s for k, s in self.decode_step.compile_seconds.items()},
                **{("prefill", *k): s for k, s in self.prefill_step.compile_seconds.items()},
                **{("verify", *k): s for k, s in self.verify_step.compile_seconds.items()}}

    def bucket(self, batch: int) -> int:
        """The decode batch size ``batch`` rows run at (a larger batch than every bucket: its own size)."""
        return next((b for b in self.batches if b >= batch), batch)

    def step(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The last-position logits ``[B, V]`` and the state: `decode_rows` for one token per row, `prefill_rows`
        otherwise."""
        return (self.decode_rows if input_ids.shape[1] == 1 else self.prefill_rows)(input_ids, state)

    def __call__(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """`step` with the model's logits shape ``[B, 1, V]`` (its forward's last position)."""
        logits, state = self.step(input_ids, state)
        return logits.unsqueeze(1), state

    def decode(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """`decode_rows` with the model's logits shape ``[B, 1, V]``."""
        logits, state = self.decode_rows(input_ids, state)
        return logits.unsqueeze(1), state

    def prefill(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """`prefill_rows` with the model's logits shape ``[B, 1, V]`` (the chunk's last position)."""
        logits, state = self.prefill_rows(input_ids, state)
        return logits.unsqueeze(1), state

    def decode_rows(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """One token per row, ``input_ids [B, 1]``; the batch padded to its bucket with copies of row 0. An unpadded
        state runs as one padded by zeros (the same attention: one graph per bucket, not two); a step on a cache of
        0 or 1 positions (the first tokens of a sequence) runs eagerly, so that every graph a server can reach is
        one that `warm_up` builds."""
        if cached(state) < 2:
            return self._eager(input_ids, state)
        batch, unpadded = input_ids.shape[0], state.padding is None
        extra = self.bucket(batch) - batch
        if extra:
            kept = self._padded
            if kept is not None and kept[0] is state:  # the rows this returned last step: continue its whole bucket
                state = kept[1]
            else:
                first = state.select(slice(0, 1))
                state = DecoderState.stack([state, *[first] * extra])
            input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, -1)])
        elif unpadded:
            state = replace(state, padding=state.row_padding())
        logits, after = self.decode_step(input_ids, state)
        out = after.select(slice(0, batch)) if extra else after
        out = replace(out, padding=None) if unpadded else out
        self._padded = (out, after) if extra else None
        return logits[:batch], out

    def verify(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """A speculative verification ``input_ids [B, T]`` (each row's pending token and drafts, right-padded):
        the logits of every position ``[B·T, V]`` (rows first) and the state with its `Replay`, as
        ``forward_groups(..., full=[True], replay=[True])``. Rows are padded to the decode bucket with copies of
        row 0, one graph per (bucket, T); on a cache of 0 or 1 positions it runs eagerly, as `decode`."""
        if cached(state, input_ids.shape[1]) < 2:
            with torch.no_grad():
                return self.model.forward_groups([(input_ids, state)], full=[True], replay=[True])[0]
        batch, tokens, unpadded = input_ids.shape[0], input_ids.shape[1], state.padding is None
        extra = self.bucket(batch) - batch
        if extra:
            state = DecoderState.stack([state, *[state.select(slice(0, 1))] * extra])
            input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, -1)])
        elif unpadded:
            state = replace(state, padding=state.row_padding())
        logits, after = self.verify_step(input_ids, state)
        out = after.select(slice(0, batch)) if extra else after
        return logits[:batch * tokens], replace(out, padding=None) if unpadded else out

    def prefill_rows(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """A chunk ``input_ids [B, T]`` as pieces of the bucket lengths (a 1-token piece is a decode step; a piece
        on a cache of exactly one position, after a 1-token first piece, runs eagerly like such a decode step)."""
        logits, start = None, 0
        for size in pieces(input_ids.shape[1], self.sizes):
            part = input_ids[:, start:start + size]
            if size == 1:
                logits, state = self.decode_rows(part, state)
            else:
                logits, state = (self._eager if cached(state) == 1 else self.prefill_step)(part, state)
            start += size
        return logits, state

    @torch.no_grad()
    def _eager(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The step uncompiled: the function the graphs are traced from, run as it is."""
        return self.decode_step._forward(input_ids, state)

    @torch.inference_mode()
    def warm_up(self, max_batch: int, max_model_len: int | None = None, verify_tokens: int = 0,
                prefill: bool = True) -> float:
        """Compile every graph that serving with at most ``max_batch`` requests reaches, before any request arrives
        (vLLM's capture at start-up): each prefill piece on an empty cache and on a longer one (unless ``prefill``
        is False: a server whose drafter reads the target's features prefills eagerly), each decode bucket up
        to ``bucket(max_batch)`` on stacked rows (with ``verify_tokens``, each bucket's verification of that many
        tokens too) — in inference mode, as the engine steps — and, where a context of ``max_model_len`` tokens
        (default: the model's) passes `CASCADE_SUM` positions, the pieces and buckets again on a cache that long.
        Returns the seconds taken; afterwards no traffic compiles."""
        start = time.perf_counter()
        contexts = [self._context(2)]
        if (max_model_len or self.model.config.context_length) > CASCADE_SUM:
            contexts.append(self._context(CASCADE_SUM))
        for size in self.sizes if prefill else ():
            if size > 1:
                for context in [self._context(0), *contexts]:
                    self.prefill_step(self._zeros(1, size), context)
        for context in contexts:
            for batch in self.batches:
                if batch <= self.bucket(max_batch):
                    self.decode(self._zeros(batch, 1), DecoderState.stack([context] * batch))
                    if verify_tokens:
                        self.verify(self._zeros(batch, verify_tokens), DecoderState.stack([context] * batch))
        return time.perf_counter() - start

    def _zeros(self, batch: int, length: int) -> Tensor:
        """Token ids ``[batch, length]`` of zeros, on the model's device."""
        return torch.zeros(batch, length, dtype=torch.long, device=next(self.model.parameters()).device)

    def _context(self, length: int, chunk: int = 512) -> DecoderState:
        """The state after ``length`` zero tokens, prefilled eagerly in chunks of ``chunk``."""
        state = self.model.new_state(1, next(self.model.parameters()).device)
        for start in range(0, length, chunk):
            state = self._eager(self._zeros(1, min(chunk, length - start)), state)[1]
        return state

