"""Packaged tuned steps (issue 37): a tuned step that a later process loads in seconds, through AOTInductor.

A tuned `k3.model.compiled_step.CompiledStep` graph (frozen weights, inductor's C++ GEMM templates) is compiled again
by every process: inductor will not cache it (~60–100 s a graph). A *packaged* step is the same function
(`k3.model.precompiled.forward_step` or ``forward_replayed``) exported with ``torch.export`` and compiled ahead of
time by AOTInductor under the same tuned options (`tuned_options`, inside `fused`): one ``.pt2`` package per shape
key holding the kernels and the frozen weights, which AOTInductor's C++ loader loads in well under a second
(`small`'s 54-MB decode package: 0.05 s). The call is one C++ function on the flat tensors of the state
(`flat_state`), without dynamo's frame evaluation and guards: on `mini`'s decode step at batch 1 (2 threads)
0.17 ms, against 0.31 ms for the traced tuned graph and 2.1 ms eager (``benchmarks/packaged.py``).

The state enters as `MLASlots` (the package writes the new MLA entries into their storage, as the traced graph
does; their length and capacity are dynamic dimensions, within one side of `CASCADE_SUM` as `cached` keys them),
KDA states, the depth sources and the padding; it returns the logits, the KDA states, the depth sources and, for a
verification, each KDA layer's `KDAReplay` and the run's depth sources. The MLA caches after the step are views of
their storage, made here. The features a drafter captures (`K3ForCausalLM.capture`) are outputs of the package, set
on the layers after the call as an eager step sets them.

Packages are kept under ``~/.cache/k3/packages/<layout>/<weights>/`` (`layout_digest`: the config, the source, torch,
the CPU; `weights_digest`: the values frozen in), one file per shape key (batch, tokens, cache side, dtypes, train
or eval mode, features kept, thread count: the kernels' OpenMP width is fixed at compilation), so a package is only
ever loaded for the weights and the machine it was built for. A file that is not a regular file (a link neither),
exceeds `DATA_LIMIT` beyond twice the weights' bytes, or does not load is compiled again (with a warning for the
last); the loader reads the file checked, through its descriptor (`k3.files.descriptor_path`).
Each package holds a copy of the weights, so the directory is bounded: saving one removes the least recently used
others beyond ``$K3_PACKAGES_GB`` GiB (default 8, `bound`).
"""

from __future__ import annotations

import copy
import os
import stat
import time
import warnings
from dataclasses import fields, replace
from pathlib import Path

import torch
from torch import Tensor

from k3.files import DATA_LIMIT, descriptor_path, open_regular, user_cache
from k3.model.compiled_step import CASCADE_SUM, WeightsVersion, cached, tuned_options
from k3.model.graph_inputs import cache_slots, canonical
from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts
from k3.model.precompiled import forward_replayed, forward_step, key_name, layout_digest, weights_digest
from k3.model.projections import fused
from k3.model.sequence.kda import KDAReplay, KDAState
from k3.model.sequence.mla import MLACache, MLASlots
from k3.model.state import DecoderState, Replay

__all__ = ["PackagedStep", "bound", "flat_state", "kept_bytes"]

_KEPT_GB = 8.0  # default of K3_PACKAGES_GB

_KDA = [f.name for f in fields(KDAState)]
_REPLAY = [f.name for f in fields(KDAReplay)]


def flat_state(state: DecoderState, slots: list) -> list[Tensor]:
    """The tensors a package takes for ``state`` whose layers are ``slots`` (`cache_slots`): per layer the MLA slots'
    storages and length carrier, or the KDA state's tensors (contiguous); then the depth sources and padding."""
    leaves: list[Tensor] = []
    for layer in slots:
        if isinstance(layer, MLASlots):
            leaves += [layer.latent_storage, layer.key_storage, layer.filled]
        else:
            leaves += [getattr(layer, name).contiguous() for name in _KDA]
    return leaves + [state.depth.contiguous(), state.padding.contiguous()]


class _Exported(torch.nn.Module):
    """The step as a module of flat tensors (what ``torch.export`` takes): rebuilds the state from ``leaves`` in the
    layer kinds of ``kinds`` ("mla" / "kda") and flattens what the step returns."""

    def __init__(self, model: K3ForCausalLM, kinds: list[str], replayed: bool) -> None:
        super().__init__()
        self.model, self.kinds, self.replayed = model, kinds, replayed

    def forward(self, input_ids: Tensor, leaves: list[Tensor]) -> tuple[Tensor, ...]:
        layers, i = [], 0
        for kind in self.kinds:
            if kind == "mla":
                layers.append(MLASlots(*leaves[i:i + 3]))
                i += 3
            else:
                layers.append(KDAState(*leaves[i:i + len(_KDA)]))
                i += len(_KDA)
        state = DecoderState(layers, leaves[i], 0, leaves[i + 1])
        logits, after = (forward_replayed if self.replayed else forward_step)(self.model, input_ids, state)
        out = [logits, after.depth]
        out += [layer.captured for layer in self.model.layers if layer.capture is not None]
        out += [getattr(layer, name) for layer in after.layers if isinstance(layer, KDAState) for name in _KDA]
        if self.replayed:
            out.append(after.replay.depth)
            out += [getattr(record, name) for record in after.replay.kda if record is not None for name in _REPLAY]
        return tuple(out)


def kept_bytes() -> int:
    """The most bytes of packages kept under the packages directory: ``$K3_PACKAGES_GB`` GiB (default 8)."""
    text = os.environ.get("K3_PACKAGES_GB", str(_KEPT_GB))
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not 0 <= gib < float("inf"):
        raise ValueError(f"K3_PACKAGES_GB: a number of GiB >= 0, got {text!r}")
    return int(gib * 2**30)


def bound(root: Path, keep: Path, limit: int) -> list[Path]:
    """Remove the least recently used packages under ``root`` (``<layout>/<weights>/*.pt2`` by modification time,
    which a load renews; partial files being written are neither counted nor removed) until those left take at most
    ``limit`` bytes; ``keep``, the package just saved, stays. Returns the paths removed."""
    packages = []
    for path in root.glob("*/*/*.pt2"):
        try:
            info = path.lstat()
        except OSError:  # removed meanwhile by another process
            continue
        if stat.S_ISREG(info.st_mode) and ".partial." not in path.name:
            packages.append((info.st_mtime, info.st_size, path))
    total, removed = sum(size for _, size, _ in packages), []
    for _, size, path in sorted(packages):
        if total <= limit:
            break
        if path == keep:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        removed.append(path)
    return removed


def _sharing_weights(model: K3ForCausalLM) -> K3ForCausalLM:
    """A copy of ``model``'s modules over the same weight tensors: what export traces. Export swaps the traced
    module's weights for fake tensors while it traces, so tracing ``model`` itself made a step that ran meanwhile on
    another thread (serving, while packages are built in the background) read fake weights."""
    return copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]})


class PackagedStep:
    """``step(input_ids [B, T], state) -> (logits, state)`` as `CompiledStep`'s tuned step gives it (``replayed``: a
    verification, every position's logits and a `Replay`; an unpadded state runs as one padded by zeros), on
    AOTInductor packages loaded from ``directory`` (default under ``~/.cache/k3/packages``) or compiled and saved
    there. ``compilations`` counts the packages built or loaded, ``cache_hits`` those loaded, `held` those it holds
    (the current weights')."""

    def __init__(self, model: K3ForCausalLM, replayed: bool = False, directory: Path | None = None,
                 tuned: bool = True) -> None:
        """``tuned=False``: freezing alone (inductor's default products; builds faster, for tests)."""
        if not self.takes(model):
            raise ValueError("packaged steps: packed MXFP4 experts run as a Python operator (`k3::mxfp4_experts`), "
                             "which a package does not call; use the traced steps (packaged=False)")
        self.model, self.replayed, self.tuned = model, replayed, tuned
        self.root = directory if directory is not None else user_cache("packages")
        self.compilations = self.cache_hits = 0
        self.compile_seconds: dict[tuple, float] = {}
        self._packages: dict[tuple, object] = {}
        self._version = WeightsVersion(model)
        # a package holds its kernels and a copy of the weights: a larger file is not one of ours
        self._limit = DATA_LIMIT + 2 * sum(t.numel() * t.element_size() for t in [*model.parameters(),
                                                                                  *model.buffers()])
        self._digests: tuple[tuple, str] | None = None  # (the weights' version, their directory)

    @property
    def held(self) -> int:
        return len(self._packages)

    @staticmethod
    def takes(model: K3ForCausalLM) -> bool:
        """Whether ``model``'s steps can be packaged (not with packed MXFP4 experts)."""
        return not any(isinstance(module, PackedExperts) for module in model.modules())

    @staticmethod
    def layout_directory(layout: str, root: Path | None = None) -> Path:
        """Where the packages of every weights of the layout ``layout`` (`layout_digest`) are kept."""
        return (root if root is not None else user_cache("packages")) / layout

    def eager(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The step unpackaged: the function its packages are exported from, run as it is."""
        return (forward_replayed if self.replayed else forward_step)(self.model, input_ids, state)

    def __call__(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: a packaged step takes integer ids [B, T], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.model.config.vocab_size:
            raise ValueError(f"input_ids: token ids must lie in [0, vocab_size={self.model.config.vocab_size})")
        if state.batch_size != input_ids.shape[0] or state.replay is not None or state.depth is None:
            raise ValueError(f"state: expected a DecoderState of batch size {input_ids.shape[0]} with its depth "
                             "sources, without a replay")
        unpadded = state.padding is None  # runs as a state padded by zeros (the same attention), returned unpadded
        if unpadded:
            state = replace(state, padding=state.row_padding())
        tokens = input_ids.shape[1]
        side = cached(state, tokens)
        if side < 2:
            raise ValueError("a packaged step needs a cache of 2 positions or more (`cached`)")
        slots = cache_slots(state, tokens)
        key = (*input_ids.shape, side, self.tuned, state.depth.dtype,
               frozenset(layer.latent.dtype if isinstance(layer, MLACache) else layer.recurrent.dtype
                         for layer in state.layers), torch.get_num_threads(),
               self.model.training, tuple(layer.capture for layer in self.model.layers), self._weights())
        package = self._packages.get(key)
        leaves = flat_state(state, slots)
        if package is None:
            package = self._packages[key] = self._load_or_compile(key, input_ids, leaves, slots)
        out = package.boxed_run([input_ids.contiguous(), *leaves])
        after = self._state(state, slots, tokens, out[1:])
        return out[0], replace(after, padding=None) if unpadded else after

    def _weights(self) -> str:
        """The directory of the current weights' packages (hashed again only after a weight was written); other
        weights' packages are let go."""
        version = self._version()
        if self._digests is None or self._digests[0] != version:
            weights = f"{layout_digest(self.model)}/{weights_digest(self.model)}"
            if self._digests is not None and weights != self._digests[1]:
                self._packages.clear()  # the previous weights': each package holds a copy of them
            self._digests = (version, weights)
        return self._digests[1]

    def _state(self, state: DecoderState, slots: list, tokens: int, out: list[Tensor]) -> DecoderState:
        """The state after the step from the package's outputs (after the logits): the MLA caches as views of the
        storage the package wrote into, tied to it as `CompiledStep` ties them."""
        depth, out = out[0], out[1:]
        for layer in self.model.layers:  # the features the step kept, as an eager step keeps them
            if layer.capture is not None:
                object.__setattr__(layer, "captured", out.pop(0))
        layers = []
        for layer in slots:
            if isinstance(layer, MLASlots):
                end = layer.length + tokens
                view = MLACache(layer.latent_storage[:, :end], layer.key_storage[:, :end])
                layers.append(layer.storage.advance(view))
            else:
                layers.append(KDAState(*out[:len(_KDA)]))
                out = out[len(_KDA):]
        replay = None
        if self.replayed:
            records: list[KDAReplay | None] = []
            run_depth, out = out[0], out[1:]
            for layer in slots:
                if isinstance(layer, MLASlots):
                    records.append(None)
                else:
                    records.append(KDAReplay(*out[:len(_REPLAY)]))
                    out = out[len(_REPLAY):]
            replay = Replay(state, records, run_depth)
        return replace(state, layers=layers, depth=depth, position=state.position + tokens, replay=replay)

    def _path(self, key: tuple) -> Path:
        *shape, weights = key
        return self.root / weights / f"{'replayed' if self.replayed else 'step'}-{key_name(tuple(shape))}.pt2"

    def _load_or_compile(self, key: tuple, input_ids: Tensor, leaves: list[Tensor], slots: list):  # noqa: ANN202
        """The package of ``key``: loaded from its file, else exported, compiled and saved (atomically)."""
        start, path = time.perf_counter(), self._path(key)
        package = self._load(path)
        if package is None:
            package = self._compile(path, key[2], input_ids, leaves, slots)
        else:
            self.cache_hits += 1
        self.compilations += 1
        self.compile_seconds[tuple(key[:-1])] = time.perf_counter() - start
        return package

    def _load(self, path: Path):  # noqa: ANN202
        """The package at ``path``, or None where there is none (or it is not a regular file within `DATA_LIMIT`, or
        does not load: a warning)."""
        try:
            file = open_regular(path, self._limit, links=False)
        except (OSError, ValueError):  # none, a link, not a regular file, too large
            return None
        try:
            with file:  # the loader reads (and unpacks) the file checked, not whatever the name holds later
                runner = self._runner(descriptor_path(file.fileno()) or path)
        except Exception as err:  # any failure to load means: compile it again
            warnings.warn(f"packaged step {path} did not load ({err!r}); compiling it again", RuntimeWarning,
                          stacklevel=3)
            return None
        try:
            os.utime(path)  # used now: the last to be removed by `bound`
        except OSError:  # a read-only cache
            pass
        return runner

    def _compile(self, path: Path, side: int, input_ids: Tensor, leaves: list[Tensor], slots: list):  # noqa: ANN205
        """Export the step with its MLA caches' lengths and capacities dynamic (within ``side``), compile it with the
        tuned options, save it at ``path`` and load it."""
        tokens = input_ids.shape[1]
        low, high = (2, CASCADE_SUM - tokens) if side == 2 else (CASCADE_SUM - tokens + 1, 2**30)
        length, capacity = torch.export.Dim.AUTO(min=low, max=high), torch.export.Dim.AUTO(min=low + tokens,
                                                                                       max=2**31 - 2)
        dynamic: list = []
        for layer in slots:
            mla = isinstance(layer, MLASlots)
            dynamic += [{1: capacity}, {1: capacity}, {0: length}] if mla else [None] * len(_KDA)
        kinds = ["mla" if isinstance(layer, MLASlots) else "kda" for layer in slots]
        module = _Exported(_sharing_weights(self.model), kinds, self.replayed)
        options = {k: v for k, v in tuned_options(self.model.device).items() if k != "cpp_wrapper"} \
            if self.tuned else {"freezing": True}
        with torch.no_grad(), fused(True), warnings.catch_warnings():
            # the routers' statistics (`Router.last_load`, read by training only) are not kept by a package
            warnings.filterwarnings("ignore", "The tensor attributes .* were assigned during export")
            program = torch.export.export(module, (canonical(input_ids), leaves),
                                          dynamic_shapes=(None, [*dynamic, None, None]), strict=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
        partial.replace(path)
        bound(self.root, path, kept_bytes())
        return self._runner(path)

    def _runner(self, path: Path | str):  # noqa: ANN202
        """The package's runner, whose ``boxed_run`` takes and returns the flat tensors. Made by AOTInductor's C++
        loader directly: ``aoti_load_package`` imports inductor (~1–2 s of a process's start, a third of `small`'s
        200-token ``k3 generate``) and its wrapper parses the package's call spec at every call."""
        index = self.model.device.index  # None: the current device (-1)
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1 if index is None else index)
