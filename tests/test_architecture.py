"""DESIGN.md's layout rules, checked on the import graph of ``src/k3`` (every ``import`` and ``from … import`` in a
module, at any depth: a function-level import is still a dependency).

* floors, bottom up — config, ops, tokenization (and `k3.files`) → chat, sizing → model → dist, interop,
  generation → train, serve → rl → cli: nothing imports a higher floor, and nothing is in a circle;
* `chat` imports only `tokenization`; `train` and `serve` never import each other; `rl` uses the engine's face, never
  the HTTP layers;
* `serve.engine` never imports `serve.api`, `serve.asgi`, `serve.fleet` or the web frameworks; its scheduler,
  runner, sampler and outputs never import its core; `serve.fleet` imports only `serve.asgi`; `serve.asgi` imports
  nothing from `k3`;
* no module imports another module's ``_private`` name (``from m import _x`` or ``m._x``).

Each rule is also run on a small tree holding one violation, so a rule that can no longer fail is noticed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Floors, bottom up; a module's floor is that of its longest listed prefix.
FLOORS: dict[str, int] = {
    "k3.config": 0, "k3.ops": 0, "k3.tokenization": 0, "k3.files": 0,
    "k3.chat": 1, "k3.sizing": 1,
    "k3": 2, "k3.model": 2,  # the package itself re-exports the model (lazily)
    "k3.dist": 3, "k3.interop": 3, "k3.generation": 3,
    "k3.train": 4, "k3.serve": 4,
    "k3.rl": 5,
    "k3.cli": 6, "k3.__main__": 6,
}
WEB = ("fastapi", "starlette", "pydantic", "uvicorn")
ENGINE_SEAMS = ("scheduler", "runner", "sampler", "outputs")


@dataclass
class Module:
    name: str
    imports: set[str] = field(default_factory=set)  # k3 modules it imports
    external: set[str] = field(default_factory=set)  # top-level names of other packages it imports
    private: list[str] = field(default_factory=list)  # "module._name" it takes from another module


def _name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def scan(root: Path) -> dict[str, Module]:
    """Every module under ``root`` (a ``src`` directory) with what it imports."""
    names = {_name(p, root)[0] for p in root.rglob("*.py")}

    def nearest(target: str) -> str:
        while target not in names and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    modules = {}
    for path in sorted(root.rglob("*.py")):
        name, package = _name(path, root)
        module = modules[name] = Module(name)
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> k3 module, for ``alias._x`` attribute reads
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "k3":
                        module.imports.add(nearest(a.name))
                        aliases[a.asname or a.name] = a.name
                    else:
                        module.external.add(a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "k3":
                    module.external.add(source.split(".")[0])
                    continue
                for a in node.names:
                    if f"{source}.{a.name}" in names:
                        module.imports.add(f"{source}.{a.name}")
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
                    else:
                        module.imports.add(nearest(source))
                        if a.name.startswith("_") and not a.name.startswith("__"):
                            module.private.append(f"{source}.{a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                module.private.append(f"{aliases[node.value.id]}.{node.attr}")
        module.imports.discard(name)
    return modules


def floor(name: str) -> int:
    prefix = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)
    return FLOORS[prefix]


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in modules[v].imports:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return found


def violations(modules: dict[str, Module]) -> list[str]:
    """Every broken rule, one line each (module docstring)."""
    out = [f"circle: {' <-> '.join(c)}" for c in circles(modules)]
    for m in modules.values():
        for target in sorted(m.imports):
            rule = _rule(m.name, target)
            if rule:
                out.append(f"{m.name} imports {target}: {rule}")
        if within(m.name, "k3.serve.engine"):
            out += [f"{m.name} imports {pkg}: the engine knows nothing of HTTP"
                    for pkg in sorted(m.external & set(WEB))]
        out += [f"{m.name} takes {p}: another module's private name" for p in m.private
                if p.rsplit(".", 1)[0] != m.name]
    return out


def _rule(source: str, target: str) -> str | None:
    if floor(target) > floor(source):
        return f"upward (floor {floor(source)} -> {floor(target)})"
    if within(source, "k3.chat") and not within(target, "k3.chat", "k3.tokenization"):
        return "chat imports only tokenization"
    if within(source, "k3.train") and within(target, "k3.serve") or \
            within(source, "k3.serve") and within(target, "k3.train"):
        return "train and serve never import each other"
    if within(source, "k3.rl") and within(target, "k3.serve") and not within(target, "k3.serve.engine"):
        return "rl uses the engine's face, never the HTTP layers"
    if within(source, "k3.serve.engine") and within(target, "k3.serve.api", "k3.serve.asgi", "k3.serve.fleet"):
        return "the engine knows nothing of HTTP"
    if any(source == f"k3.serve.engine.{seam}" for seam in ENGINE_SEAMS) and target == "k3.serve.engine.core":
        return "the engine's seams return values to its core, never import it"
    if within(source, "k3.serve.fleet") and not within(target, "k3.serve.fleet", "k3.serve.asgi"):
        return "the fleet speaks HTTP only (serve.asgi)"
    if within(source, "k3.serve.asgi") and not within(target, "k3.serve.asgi"):
        return "serve.asgi imports nothing from k3"
    return None


def test_the_tests_mirror_the_source_tree():
    """Each test folder is named after the package of ``src/k3`` whose modules it tests."""
    tests = Path(__file__).resolve().parent
    folders = [d for d in tests.rglob("*") if d.is_dir() and not d.name.startswith((".", "__"))]
    assert folders and [d for d in folders if not (SRC / "k3" / d.relative_to(tests)).is_dir()] == []


def test_the_tree_keeps_the_design_rules():
    modules = scan(SRC)
    assert len(modules) > 100 and "k3.serve.engine.core" in modules
    assert violations(modules) == []


@pytest.mark.parametrize("module, source, expected", [
    ("k3/model/lm.py", "from k3.train import driver\n", "k3.model.lm imports k3.train.driver: upward"),
    ("k3/config/schema.py", "import k3.config.hf\n", "circle: k3.config.hf <-> k3.config.schema"),
    ("k3/chat/native.py", "from k3.config.schema import K3Config\n", "chat imports only tokenization"),
    ("k3/serve/engine/core.py", "from k3.serve.api import protocol\n", "the engine knows nothing of HTTP"),
    ("k3/serve/engine/core.py", "import fastapi\n", "k3.serve.engine.core imports fastapi"),
    ("k3/serve/engine/runner.py", "from k3.serve.engine.core import Engine\n", "never import it"),
    ("k3/serve/fleet/router.py", "from k3.serve.engine import Engine\n", "the fleet speaks HTTP only"),
    ("k3/serve/asgi/guard.py", "from k3.config import preset\n", "serve.asgi imports nothing from k3"),
    ("k3/train/driver.py", "from k3.serve.engine import Engine\n", "train and serve never import each other"),
    ("k3/rl/rollout.py", "from k3.serve.api.protocol import APIError\n", "never the HTTP layers"),
    ("k3/rl/sft.py", "from k3.train.driver import _after_step\n", "takes k3.train.driver._after_step"),
    ("k3/rl/sft.py", "from k3.train import driver\ndriver._after_step()\n", "takes k3.train.driver._after_step"),
])
def test_each_rule_fails_on_a_violating_import(tmp_path, module, source, expected):
    files = {"k3/__init__.py": "", "k3/config/__init__.py": "", "k3/config/schema.py": "",
             "k3/config/hf.py": "from k3.config.schema import K3Config\n", "k3/model/__init__.py": "",
             "k3/model/lm.py": "", "k3/chat/__init__.py": "", "k3/chat/native.py": "", "k3/train/__init__.py": "",
             "k3/train/driver.py": "_after_step = 1\n", "k3/rl/__init__.py": "", "k3/rl/rollout.py": "",
             "k3/rl/sft.py": "", "k3/serve/__init__.py": "", "k3/serve/api/__init__.py": "",
             "k3/serve/api/protocol.py": "", "k3/serve/engine/__init__.py": "", "k3/serve/engine/core.py": "",
             "k3/serve/engine/runner.py": "", "k3/serve/fleet/__init__.py": "", "k3/serve/fleet/router.py": "",
             "k3/serve/asgi/__init__.py": "", "k3/serve/asgi/guard.py": ""}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(scan(tmp_path)) == []
    (tmp_path / module).write_text((tmp_path / module).read_text() + source)
    found = violations(scan(tmp_path))
    assert len(found) == 1 and expected in found[0], found
