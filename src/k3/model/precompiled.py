"""Precompiled steps (issue 37): graphs a later process loads in seconds instead of compiling them again.

`torch.compile`'s ahead-of-time mode (``aot_compile``, one graph without breaks) traces a step once and serializes
what a later process needs to run it — dynamo's transformed bytecode and inductor's kernels — into one file, which
`torch.compiler.load_compiled_function` loads without tracing: ``small``'s decode step loads in ~2.4 s against ~45 s
to compile it. The weights are *inputs* of these graphs, not constants frozen into them as in a tuned
`k3.model.compiled_step.CompiledStep`: a file holds no weights (~4 MB), serves every checkpoint of one layout and stays
valid when the weights change; the price is speed (a decode step of ``small`` at batch 1: ~5 ms, against ~2.2 ms
frozen and ~12 ms eager, on 2 cores), as weights that are inputs cannot be prepacked: the products by the largest
go through oneDNN instead of MKL (`k3.model.onednn`; a d=1024 model's step: 19.6 ms against 23.1–23.4, eager 34.5).

`GraphFiles` keeps them under ``~/.cache/k3/graphs/<layout>/`` (``$XDG_CACHE_HOME``), one directory per
`layout_digest`: the model's config, every parameter's and buffer's name, shape, dtype and device, the module classes,
the source of the whole ``k3`` package, the torch and Python versions and this CPU's feature flags — anything that
could make a graph compute something else. Inside, a file per shape key (`CompiledStep`'s). A graph is chosen by that
key, not by dynamo's guards (they do not survive serialization: a loaded graph's guards fail on dynamic dimensions),
as a warm `CompiledStep` already skips them. Packed MXFP4 experts are precompiled like the rest: each layer of them is
one custom operator of the graph (`k3.model.packed.experts_product`).
"""

from __future__ import annotations

import hashlib
import platform
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from k3.files import DATA_LIMIT, open_regular, user_cache
from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState
from k3.ops.mxfp4_kernel import cpu_flags

__all__ = ["GraphFiles", "key_name", "layout_digest", "vouch", "weights_digest"]

_PACKAGE = Path(__file__).resolve().parents[1]  # the k3 package: its source is part of every graph's key


def layout_digest(model: K3ForCausalLM) -> str:
    """What a precompiled graph of ``model`` depends on, hashed (see the module docstring)."""
    digest = hashlib.sha256(repr(model.config).encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type};".encode())
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__};".encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(path.read_bytes())
    digest.update(f"{torch.__version__}|{sys.version}|{platform.machine()}|{cpu_flags()}".encode())
    return digest.hexdigest()[:24]


# models whose weights a loader vouched for: (each weight, its storage and version then; the digest)
_VOUCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def vouch(model: torch.nn.Module, source: str) -> None:
    """Record that ``model``'s weights, as they are now, are the values of ``source`` (a checkpoint file's verified
    sha256): `weights_digest` then names them by it and their names, shapes and dtypes instead of hashing every byte
    again (~0.35 s for d=1024's 650 MB), for as long as every weight is the same tensor, on the same storage, and
    unwritten."""
    digest = hashlib.sha256(f"vouched:{source};".encode())
    for name, t in _weights(model):
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    _VOUCHED[model] = ([(weakref.ref(t), t.data_ptr(), t._version) for _, t in _weights(model)],
                       digest.hexdigest()[:24])


def _vouched(model: torch.nn.Module) -> str | None:
    """The digest `vouch` recorded for ``model``, while its weights are still those it saw; else None."""
    if model not in _VOUCHED:
        return None
    seen, digest = _VOUCHED[model]
    now = [t for _, t in _weights(model)]
    same = len(seen) == len(now) and all(ref() is t and t.data_ptr() == ptr and t._version == version
                                         for (ref, ptr, version), t in zip(seen, now))
    return digest if same else None


def weights_digest(model: torch.nn.Module) -> str:
    """The values of every parameter and buffer of ``model`` (name, shape, dtype and bytes), hashed (~1.8 GB/s here;
    or named by the file a loader read them from, `vouch`): part of a tuned graph's cache key, as inductor keeps what
    it derived from frozen weights in the entry."""
    vouched = _vouched(model)
    if vouched is not None:
        return vouched
    digest = hashlib.sha256()
    for name, t in _weights(model):
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        digest.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())
    return digest.hexdigest()[:24]


def key_name(key: tuple) -> str:
    """A file name for a step's shape key (sets written in sorted order)."""
    parts = [sorted(map(str, part)) if isinstance(part, frozenset) else part for part in key]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def forward_step(model: K3ForCausalLM, input_ids: Tensor, state: DecoderState
                 ) -> tuple[Tensor, DecoderState]:
    """The traced function of a step: each row's last-position logits ``[B, V]`` and the state."""
    (logits, after), = model.forward_groups([(input_ids, state)], full=[False], replay=[False])
    return logits, after


def forward_replayed(model: K3ForCausalLM, input_ids: Tensor, state: DecoderState
                     ) -> tuple[Tensor, DecoderState]:
    """The traced function of a verification: every position's logits ``[B·T, V]`` and a state with its `Replay`."""
    (logits, after), = model.forward_groups([(input_ids, state)], full=[True], replay=[True])
    return logits, after


class GraphFiles:
    """The precompiled graphs of one model layout on disk: `load` one, or `compile` and save it."""

    def __init__(self, model: K3ForCausalLM, directory: Path | None = None) -> None:
        self.model, self.digest = model, layout_digest(model)
        self.directory = directory if directory is not None else user_cache("graphs") / self.digest

    def path(self, kind: str, key: tuple) -> Path:
        """The file of the ``kind`` ("step" or "replayed") graph of shape ``key`` (sets written in sorted order)."""
        return self.directory / f"{kind}-{key_name(key)}.pt2"

    def load(self, path: Path) -> Callable | None:
        """The graph saved at ``path``, or None when there is none; a file that does not load (a torch upgrade the
        digest missed, a truncated write, not a regular file or over `k3.files.DATA_LIMIT`) is a warning and None."""
        if not path.is_file():
            return None
        from torch._inductor import config

        from k3.model import onednn  # noqa: F401  (registers ``k3::linear``, which the graphs call)

        try:  # the directory is this CPU's (`layout_digest`): its vector ISAs need no build-and-dlopen probes
            with open_regular(path, DATA_LIMIT) as f, config.patch({"cpp.vec_isa_ok": True}):
                graph = torch.compiler.load_compiled_function(f, external_data={"model": self.model})
        except Exception as err:  # any failure to load means: compile it again
            warnings.warn(f"precompiled graph {path} did not load ({err!r}); compiling it again", RuntimeWarning,
                          stacklevel=2)
            return None
        graph.disable_guard_check()
        return graph

    def compile(self, fn: Callable, path: Path, input_ids: Tensor, state: DecoderState) -> Callable:
        """Trace and compile ``fn(model, input_ids, state)`` as one graph (its products by weights through oneDNN,
        `k3.model.onednn`), save it at ``path`` and return it."""
        from torch._inductor import config

        from k3.model.onednn import ONEDNN

        with config.patch(post_grad_custom_pre_pass=ONEDNN):
            graph = torch.compile(fn, fullgraph=True, dynamic=False).aot_compile(((self.model, input_ids, state), {}))
        graph.disable_guard_check()
        path.parent.mkdir(parents=True, exist_ok=True)
        graph.save_compiled_function(str(path), external_data={"model": self.model})  # atomically (a rename)
        return graph
