"""Test-only access to peer implementations used as oracles (skipped with a visible reason if absent).

* fla-core's pure-torch KDA reference ``fla/ops/kda/naive.py`` is loaded by file path, so fla's
  package ``__init__`` (and Triton) is never imported. Its gate references live in ``gate.py`` next
  to Triton kernels; only the two pure-torch functions are extracted from the source.
* transformers' ``models/kimi_linear`` torch paths are imported with ``fla`` blocked: otherwise
  transformers binds fla's Triton kernels, which fail on CPU.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from functools import cache
from pathlib import Path

import pytest


def _fla_dir() -> Path:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install -e '.[test]')")
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def fla_naive() -> types.ModuleType:
    """``fla/ops/kda/naive.py``: ``naive_recurrent_kda`` and ``naive_chunk_kda``."""
    path = _fla_dir() / "ops" / "kda" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def fla_gates() -> types.SimpleNamespace:
    """The pure-torch gate references ``naive_kda_gate`` / ``naive_kda_lowerbound_gate`` from fla's gate.py."""
    import torch
    import torch.nn.functional as F

    source = (_fla_dir() / "ops" / "kda" / "gate.py").read_text()
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        pytest.skip(f"fla's gate.py no longer defines {sorted(wanted)}")
    namespace: dict = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "fla/ops/kda/gate.py", "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in wanted})


@cache
def transformers_kimi_linear() -> types.ModuleType:
    """transformers' ``modeling_kimi_linear`` with its pure-torch KDA paths (fla blocked)."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install -e '.[test]')")
    blocked = "fla" not in sys.modules
    if blocked:
        sys.modules["fla"] = None  # makes `import fla` raise ImportError inside transformers
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear
    finally:
        if blocked:
            del sys.modules["fla"]
    return modeling_kimi_linear


LLAMA_CPP_SOURCE = Path(__file__).resolve().parents[1] / ".venv" / "peers" / "llama_cpp_python-0.3.36"


def llama_cpp_converter() -> Path:
    """The vendored ``llama.cpp`` tree of llama-cpp-python 0.3.36's source distribution (its ``convert_hf_to_gguf.py``,
    ``conversion/`` and ``gguf-py/``; nothing built), unpacked by ``make test``."""
    tree = LLAMA_CPP_SOURCE / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not unpacked at {tree} (make test unpacks it)")
    return tree
