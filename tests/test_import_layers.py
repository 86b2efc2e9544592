"""The import graph of service/: no module imports one that (directly or through others) imports it back, and each
package imports only from the layers below its own. Every import counts, lazy and TYPE_CHECKING ones too: a type a
lower layer needs from a higher one is a seam drawn the wrong way (define it where it is used, as
service/compose/engine.py defines the Engine the engines implement)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "service"

# top to bottom; a package may import from any layer below its own, never from its own layer's other packages or above
LAYERS = [
    {"__main__"},
    {"main"},
    {"api"},
    {"state"},
    {"engines", "sessions"},  # what serves a prepared request; conversations over the pipeline
    {"compose"},  # the request pipeline (it defines the Engine it hands requests to)
    {"memory"},
    {"vllm", "registry", "tools"},
    {"store", "runtime"},
    {"kv"},
    {"config", "errors", "metrics", "phases", "devserver", ""},  # "" : service/__init__.py
]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
                for alias in node.names:  # `from service.x import y`: the module service.x.y if there is one, else x
                    target = f"{node.module}.{alias.name}"
                    edges[mod].add(target if target in mods else node.module)
            elif isinstance(node, ast.Import):
                edges[mod].update(a.name for a in node.names if a.name in mods)
    for mod in edges:
        edges[mod].discard(mod)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read_from_the_code():
    edges = _graph()
    assert "service.compose.engine" in edges["service.engines.vllm"]  # a TYPE_CHECKING import counts
    assert "service.runtime.composer" in edges["service.runtime.model"]  # so does a lazy one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_every_package_imports_only_from_the_layers_below_it():
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    edges = _graph()
    unknown = sorted({_package(m) for m in edges} - set(layer))
    assert not unknown, f"packages of service/ with no layer in LAYERS: {unknown}"
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                    if _package(a) != _package(b) and layer[_package(b)] <= layer[_package(a)])
    assert upward == []
