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
storage); compiled, the products over the cache are generated reductions. A key seen before runs under
``skip_guard_eval_unsafe`` (only the guards that tell its graphs apart), which saves ~0.5 ms of guard checks per
call; the key also holds what else a guard tests (dtypes, strides made canonical, train/eval mode, the thread
count, where the weights live and how often they were written), so a call that might need a new graph always runs
every guard.

``tuned`` (the default for decode) adds inductor's freezing, its C++ GEMM templates (``max_autotune``) and its C++
wrapper: the weights become constants of the graph, the products of one input are one product on the stacked weights
(`k3.model.projections.fused`, stacked once at compilation), the matrix–vector products are generated code fused with
their neighbours instead of library calls, and the kernels are called from C++ — 2.5× faster decode on CPU, ~60 s of
compilation per graph. The C++ GEMM templates ignore a constant view's storage offset (torch 2.13): inside `fused`
the views of weights that reach a product are constants of their own (`k3.model.projections.constant`) — before,
the verification graphs' logits were off by 0.02–1.1 and greedy speculation emitted other tokens than plain decoding
(found at stop 68; tested). Frozen weights are snapshots, so a change to the model's parameters (an optimiser step,
a `load_state_dict`) is detected at the next call, which resets `torch.compiler` (every compiled graph of the process)
and compiles anew. Importing this module imports nothing of the compiler; it sets torch.nn's global parameter and
buffer registration hooks (a counter that tells the weights' list went stale).

Inductor's cache of graphs, kernels and autotuning results is kept in ``~/.cache/k3/inductor`` (`persistent_cache`)
rather than ``/tmp`` (issue 37); it serves the untuned graphs, but a tuned graph holds MKL's prepacked (mkldnn)
weights, which inductor will not cache, so every process compiles those again (without that packing inductor saves
them, but the step is ~20 % slower: README, "Start-up"). Where inductor does save a frozen graph, the entry holds what
it derived from the weights (blocked copies) under a key of their shapes only, so a frozen graph's key here also holds
the digest of the weights' values (`weights_digest`): it is never loaded for other weights. A *precompiled* step
(``files``, `k3.model.precompiled`: the weights are graph inputs, the whole step is saved to a file) loads in seconds
instead.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import Tensor

from k3.files import user_cache
from k3.model.background import Gate
from k3.model.cudagraph import GraphedDecode
from k3.model.graph_inputs import cache_slots, canonical, graph_state
from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts
from k3.model.precompiled import GraphFiles, forward_replayed, forward_step, weights_digest
from k3.model.projections import fused
from k3.model.sequence.mla import MLACache, MLASlots
from k3.model.state import DecoderState

__all__ = ["CASCADE_SUM", "CompiledStep", "WeightsVersion", "background_begins", "background_ends", "cached",
           "persistent_cache", "tuned_compiling", "tuned_options"]

# inductor's C++ code sums more than this many fp32 terms in chunks (`need_use_acc_helper` in its cpp codegen), so a
# graph of a dynamic cache length holds a guard on which side of it the attention's length lies: two graph families
CASCADE_SUM = 4096
RECOMPILE_LIMIT = 256  # graphs of one code object (`CompiledStep.eager`, every instance's) dynamo keeps
_RESETS = [0]  # `torch.compiler.reset` calls made here: every shape key seen before is cold again
_REGISTRATIONS = [0]  # parameters and buffers (re)registered on any module since this module was imported
_BACKGROUND = [0]  # background compilations running: warm graphs run with every guard checked meanwhile
_COMPILE_LOCK = threading.Lock()


def _registered(*_: object) -> None:
    """torch.nn's global hook on a parameter or buffer assigned to any module."""
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_buffer_registration_hook(_registered)


def persistent_cache() -> str | None:
    """The directory inductor keeps its compiled graphs, C++ kernels and autotuning results in, across processes:
    ``TORCHINDUCTOR_CACHE_DIR`` where set, else ``~/.cache/k3/inductor`` (inductor's own default lies in ``/tmp``,
    which a reboot empties). Inductor keys each entry by the graph, its input shapes and dtypes, its options, the torch
    version and the CPU's instruction set, so one directory serves every model and machine safely. None without a
    home directory (inductor's default then)."""
    try:
        default = str(user_cache("inductor"))
    except RuntimeError:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default)


def _stack_packed(model: K3ForCausalLM) -> None:
    """Packed experts trace as one graph with the rest of the step: their layer is one operator on their stacked
    packed bytes (`PackedExperts.forward`, `k3.model.packed.experts_product`), stacked here before any trace."""
    for module in model.modules():
        if isinstance(module, PackedExperts):
            module.stack()


class WeightsVersion:
    """Called: where a module's weights live and how often they were written (what frozen graphs hold as
    constants). The list of weights is gathered again only after a module anywhere (re)registered a parameter or
    buffer: walking the module tree on every step cost ~0.7 ms, a fifth of a compiled decode step of ``small``. A view
    of another weight is left out (it shares its base's storage and version counter): packed experts' per-expert views
    of their stacked bytes would otherwise add ~0.2 ms a step."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self._registrations, self._tensors = module, -1, []

    def __call__(self) -> tuple[int, int]:
        if self._registrations != _REGISTRATIONS[0]:
            self._registrations = _REGISTRATIONS[0]
            tensors = [*self.module.parameters(), *self.module.buffers()]
            ids = {id(t) for t in tensors}
            self._tensors = [t for t in tensors if t._base is None or id(t._base) not in ids]
        return sum(t.data_ptr() for t in self._tensors), sum(t._version for t in self._tensors)


class CompiledStep:
    """``step(input_ids [B, T], state) -> (logits [B, V], state)``: what ``model.forward_groups([(input_ids,
    state)])[0]`` gives (logits within float reassociation, ~1e-5 relative in fp32), compiled once per shape key.
    A ``replayed`` step is a speculative verification: ``forward_groups(..., full=[True], replay=[True])``, logits
    of every position ``[B·T, V]`` and a state whose `Replay` rolls back to any prefix of the run."""

    def __init__(self, model: K3ForCausalLM, tuned: bool = False, replayed: bool = False,
                 gate: Gate | None = None, files: GraphFiles | None = None) -> None:
        """``files``: the step is precompiled (`k3.model.precompiled`), its graphs loaded from and saved to them."""
        if files is not None and tuned:
            raise ValueError("precompiled: graphs whose weights are inputs (not tuned)")
        self.model, self.tuned, self.replayed, self.gate = model, tuned, replayed, gate
        self.precompiled, self._files = files is not None, files
        self.load_only = False  # precompiled: a graph not on disk raises FileNotFoundError instead of compiling
        persistent_cache()
        _stack_packed(model)
        self.compilations = 0
        self.cache_hits = 0  # of the compilations, graphs loaded from an on-disk cache (inductor's, or `GraphFiles`)
        self.compile_seconds: dict[tuple, float] = {}  # shape key -> seconds of the call that compiled it
        self._warm: set[tuple] = set()
        self._weights_version = WeightsVersion(model)
        self._weights = self._weights_version()
        self._digest: tuple[tuple[int, int] | None, str] = (None, "")  # (`_weights` then, `weights_digest`)
        self._graphs: dict[tuple, Callable] = {}  # precompiled: the graph of each shape key
        self._compiled = torch.compile(self.eager, backend=self._backend, dynamic=False)
        # on CUDA a decode step replays a CUDA graph of its compiled function (`k3.model.cudagraph`)
        cuda = model.device.type == "cuda" and not replayed and files is None
        self.graphed, self._resets = (GraphedDecode() if cuda else None), _RESETS[0]

    @property
    def _function(self) -> Callable:
        """What the graphs compute, of ``(model, input_ids, state)``."""
        return forward_replayed if self.replayed else forward_step

    def eager(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The step uncompiled: the function its graphs are traced from, run as it is."""
        return self._function(self.model, input_ids, state)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]):  # noqa: ANN202
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx

        hits = counters["inductor"]["fxgraph_cache_hit"]
        self.compilations += 1
        out = compile_fx(graph, example_inputs)
        self.cache_hits += counters["inductor"]["fxgraph_cache_hit"] > hits
        return out

    def _options(self) -> dict:
        """Inductor's options for a new graph: dynamo reads ``freezing`` while it traces, inductor on first call.
        Untuned, the products by weights (graph inputs) run through oneDNN (`k3.model.onednn`)."""
        if not self.tuned:
            from k3.model.onednn import ONEDNN

            return {"post_grad_custom_pre_pass": ONEDNN}
        return tuned_options(self.model.device)

    def _weights_digest(self) -> str:
        """`weights_digest` of the model's current weights (hashed again only after they changed): part of a
        frozen graph's cache key. Inductor keeps what it derives from frozen weights (the C++ GEMM template's blocked
        copies) in its cache entry under a key of their shapes: without the digest, a process with other weights of
        the same layout loaded them (measured with MKL's packing off, `small`: logits off by 1.6)."""
        if self._digest[0] != self._weights:
            self._digest = (self._weights, weights_digest(self.model))
        return self._digest[1]

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
        weights = None if self.precompiled else self._weights_version()
        if self.tuned and weights != self._weights:  # frozen weights gone stale: every graph is built anew
            torch.compiler.reset()
            _RESETS[0] += 1
        self._weights = weights
        tokens = input_ids.shape[1]
        windowed = self.graphed is not None and tokens == 1 and cached(state) >= 2
        shape = (*input_ids.shape, "window" if windowed else cached(state, tokens), state.padding is None,
                 state.depth is None,
                 frozenset(layer.latent.dtype if isinstance(layer, MLACache) else layer.recurrent.dtype
                           for layer in state.layers),
                 self.model.training, torch.get_num_threads(),  # a guard of dynamo's global state
                 torch.is_inference_mode_enabled(),  # inference tensors dispatch differently
                 tuple(layer.capture for layer in self.model.layers))  # features kept (`K3ForCausalLM.capture`)
        key = shape if self.precompiled else (*shape, weights, _RESETS[0])  # precompiled: the weights are inputs
        cold, built = key not in self._warm, self.compilations
        if cold and _BACKGROUND[0] and not (self.gate and self.gate.on_thread()):
            return self.eager(input_ids, state)  # a step never compiles beside a background compilation
        start = time.perf_counter()
        out = (self._run_graphed if windowed else self._run_slots)(key, input_ids, state)
        self._warm.add(key)
        if self.compilations > built:
            self.compile_seconds[shape] = time.perf_counter() - start
        return out

    def _run_slots(self, key: tuple, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The step of ``key`` on the MLA caches as `MLASlots` (the graph writes their new entries in place), on its
        traced or precompiled graph."""
        tokens = input_ids.shape[1]
        slots = cache_slots(state, tokens)
        inputs = graph_state(state, slots)
        run = self._run_precompiled if self.precompiled else self._run_traced
        logits, after = run(key, canonical(input_ids), inputs)
        # the graph's output caches view the storage it wrote into: tie them to it, now that much longer
        layers = [before.storage.advance(out) if isinstance(before, MLASlots) else out
                  for out, before in zip(after.layers, slots, strict=True)]
        replay = None if after.replay is None else replace(after.replay, before=state)  # the caller's own state
        return logits, replace(after, layers=layers, position=state.position + tokens, replay=replay)

    def _run_graphed(self, key: tuple, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """A decode step replayed from a CUDA graph of the traced graph of ``key`` (its MLA caches as windows)."""
        if self._resets != _RESETS[0]:  # the graphs were recorded with weights since replaced
            self.graphed.clear()
            self._resets = _RESETS[0]
        return self.graphed(input_ids, state, lambda ids, inputs: self._run_traced(key, ids, inputs))

    def _run_traced(self, key: tuple, input_ids: Tensor, inputs: DecoderState) -> tuple[Tensor, DecoderState]:
        """The graph of ``key`` through dynamo (compiled first if new). Frozen weights: the products of one
        input run as one (`k3.model.projections`); the token count is bookkeeping outside the graph (a Python int
        the graph would specialise on)."""
        if key not in self._warm:
            stance = _compiling(self._options(), self._weights_digest() if self.tuned else None)
        elif _BACKGROUND[0]:  # the stance is global: while another thread compiles, every guard is checked
            stance = contextlib.nullcontext()
        else:
            stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        with stance, fused(self.tuned):
            return self._compiled(input_ids, inputs)

    def _run_precompiled(self, key: tuple, input_ids: Tensor, inputs: DecoderState) -> tuple[Tensor, DecoderState]:
        """The precompiled graph of ``key``: loaded from its file, else compiled and saved (`GraphFiles`)."""
        graph = self._graphs.get(key)
        if graph is None:
            path = self._files.path("replayed" if self.replayed else "step", key)
            with _COMPILE_LOCK:
                graph = self._files.load(path)
                if graph is None and self.load_only:
                    raise FileNotFoundError(path)
                self.cache_hits += graph is not None
                if graph is None:
                    graph = self._files.compile(self._function, path, input_ids, inputs)
            self.compilations += 1
            self._graphs[key] = graph
        return graph(self.model, input_ids, inputs)


def tuned_options(device: torch.device) -> dict:
    """Inductor's options for a graph whose weights are constants: on CPU freezing, the C++ GEMM templates and the C++
    wrapper (the graph's calls made from C++ too); elsewhere freezing alone (a CUDA graph replays the launches)."""
    if device.type != "cpu":
        return {"freezing": True}
    return {"freezing": True, "max_autotune": True, "cpp_wrapper": True, "max_autotune_gemm_backends": "CPP,ATEN"}


@contextlib.contextmanager
def tuned_compiling(*modules: torch.nn.Module) -> Iterator[None]:
    """Within, a call that compiles builds a graph whose weights — the parameters and buffers of ``modules`` — are
    constants, as `CompiledStep`'s tuned graphs are: `tuned_options`, `fused`, one compilation at a time, cached
    under the weights' digest (`weights_digest`). A graph built here is run under `fused` (its shape warm): it holds
    the weights as they were when it compiled."""
    device = next(modules[0].parameters()).device
    with _compiling(tuned_options(device), "+".join(weights_digest(m) for m in modules)), fused():
        yield


@contextlib.contextmanager
def _compiling(options: dict, frozen: str | None = None) -> Iterator[None]:
    """One compilation at a time in this process, under its inductor ``options``. One code object holds every
    instance's graphs, so dynamo's recompile limit (8, per thread: a background thread starts at the default) is
    raised here, on the compiling thread, and reaching it raises: the step is then not marked built, where dynamo's
    silent eager fallback would be (and unchecked guards would later pick another instance's graph). The accumulated
    limit, which counts the code object's compilations in the process (dead instances' included), is raised with
    it: a long-lived server must not stop compiling by age. A graph of ``frozen`` weights (their `weights_digest`)
    is cached, where inductor caches it, under that digest."""
    from torch._dynamo import config as dynamo
    from torch._inductor import config as inductor

    with (_COMPILE_LOCK, inductor.patch(options),
          dynamo.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=16 * RECOMPILE_LIMIT,
                       fail_on_recompile_limit_hit=True),
          torch.compiler.config.patch(cache_key_tag=frozen or "")):
        yield


def cached(state: DecoderState, tokens: int = 1) -> int:
    """The cache part of a shape key for a step of ``tokens`` new positions: the MLA caches' length, 0, 1, 2 for "2 or
    more" (dynamo specialises sizes 0 and 1; longer caches share a graph) or 3 where the attention spans more than
    `CASCADE_SUM` positions; 2 for a model without MLA layers."""
    length = min((layer.length for layer in state.layers if isinstance(layer, MLACache)), default=None)
    if length is None:
        return 2
    return length if length < 2 else 3 if length + tokens > CASCADE_SUM else 2


def background_begins() -> None:
    """A background compilation starts: until it ends, warm graphs run with every guard checked (the skipping stance
    is global) and no other thread's step compiles (it runs eagerly)."""
    _BACKGROUND[0] += 1


def background_ends() -> None:
    """The background compilation that `background_begins` announced has ended."""
    _BACKGROUND[0] -= 1
