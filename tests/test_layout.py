"""The house's layout (issue 45): distributed/ and planner/ without import circles, a core that imports neither
TorchRec's mirrors (compat/torchrec/) nor the opt-in same-host transport, and TorchRec's paths served by the finder
as the same module objects. Imports are read with ``ast``: lazy (in-function) and ``TYPE_CHECKING`` imports count.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lightning_shardrec
from lightning_shardrec.compat.torchrec.paths import ALIASES

ROOT = Path(lightning_shardrec.__file__).parent
PKG = "lightning_shardrec"

def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join((PKG, *parts))] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (``from p import m`` counts as ``p.m``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(module)
    out = set()
    for m in found:
        while m and m not in modules:
            m = m.rpartition(".")[0]
        if m and m != name and m.startswith(PKG):
            out.add(m)
    return out


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def _graph(prefix: str) -> dict[str, set[str]]:
    modules = _modules()
    inside = {n: p for n, p in modules.items() if n == prefix or n.startswith(prefix + ".")}
    return {n: {m for m in _imports(n, p, modules) if m in inside} for n, p in inside.items()}


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [{"a", "b", "c"}]


@pytest.mark.parametrize("package", ["distributed", "planner"])
def test_the_package_has_no_import_circle(package):
    got = sorted(sorted(m.removeprefix(PKG + ".") for m in c) for c in _circles(_graph(f"{PKG}.{package}")))
    assert not got, f"import circles in {package}/ (lazy and TYPE_CHECKING imports count): {got}"


# the package root installs the finder; the transport's own modules, and the test helper that simulates hosts
# for its tests, may reach it
_MAY_IMPORT = {
    f"{PKG}.compat": {PKG},
    f"{PKG}.distributed.transport": {f"{PKG}.testing"},
}


@pytest.mark.parametrize("edge", sorted(_MAY_IMPORT))
def test_the_core_imports_neither_the_torchrec_mirrors_nor_the_transport(edge):
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name == edge or name.startswith(edge + ".") or name in _MAY_IMPORT[edge]:
            continue
        if name.startswith(f"{PKG}.compat."):  # the mirrors import the core, never the other way
            continue
        hits = sorted(m for m in _imports(name, path, modules) if m == edge or m.startswith(edge + "."))
        if hits:
            wrong.append(f"{name} imports {', '.join(hits)}")
    assert not wrong, "\n".join(wrong)


def test_no_package_holds_more_than_15_files():
    crowded = []
    for folder in [ROOT, *sorted(p for p in ROOT.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        files = [p for p in folder.glob("*.py")]
        if files and len(files) > 15:
            crowded.append(f"{folder.relative_to(ROOT)}: {len(files)} files")
    assert not crowded, crowded


#: the packages split into rooms (issue 45): each room's ``__init__`` says what it holds and what it may import
ROOMED = ("distributed", "lightning", "planner")


def test_every_room_says_what_it_holds_and_may_import():
    silent = []
    for init in sorted(i for top in ROOMED for i in (ROOT / top).glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if not doc or "import" not in doc.lower():
            silent.append(str(init.relative_to(ROOT)))
    assert not silent, f"room __init__ without what it holds and may import: {silent}"


@pytest.mark.parametrize("path", sorted(ALIASES))
def test_torchrec_paths_are_the_modules_that_serve_them(path):
    old = importlib.import_module(f"{PKG}.{path}")
    assert old is importlib.import_module(f"{PKG}.{ALIASES[path]}")
    assert old.__spec__.name == f"{PKG}.{ALIASES[path]}"  # the module keeps its own spec
