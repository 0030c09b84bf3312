"""Private torch symbols live in ``lightning_shardrec/_compat/`` only, Lightning's in ``lightning/pl_compat/`` (#40).

Every module of the package is parsed with ``ast`` (nothing is imported) and each use of a private name of
torch or Lightning is listed: an attribute chain ``torch.a._b`` (also through an alias such as
``import torch.distributed as dist`` -> ``dist._x``), ``import torch._x``, ``from torch.x import _y``,
``from torch._x import y``, ``getattr(torch.x, "_y")``, and the same for ``lightning``, ``lightning_fabric``
and ``pytorch_lightning``. A private name is one that starts with an underscore and is not a dunder
(``torch.__version__`` is public). A use outside ``lightning_shardrec/_compat/`` fails the test, naming
``file:line`` and the symbol, so the next torch or Lightning release is one file's work.

What the scan cannot see: private attributes reached through an object rather than a module
(``loader._state_dicts()``), since that needs types; review catches those.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_shardrec"
COMPAT = (PACKAGE / "_compat", PACKAGE / "lightning" / "pl_compat")  # torch's (core); Lightning's (its layer)
ROOTS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")


@dataclass(frozen=True, kw_only=True)
class PrivateUse:
    """One use of a private torch/Lightning name: where, and the dotted symbol."""

    path: Path
    line: int
    symbol: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}: {self.symbol}"


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _watched(dotted: str) -> bool:
    return dotted.split(".")[0] in ROOTS


def _has_private(dotted: str) -> bool:
    return any(_is_private(part) for part in dotted.split("."))


class _Scanner(ast.NodeVisitor):
    """Collects private uses in one module; ``aliases`` maps local names to the dotted torch/Lightning path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}
        self.found: list[PrivateUse] = []

    def _report(self, node: ast.AST, symbol: str) -> None:
        self.found.append(PrivateUse(path=self.path, line=getattr(node, "lineno", 0), symbol=symbol))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not _watched(alias.name):
                continue
            if _has_private(alias.name):
                self._report(node, alias.name)
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                root = alias.name.split(".")[0]
                self.aliases[root] = root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or node.module is None or not _watched(node.module):
            return
        for alias in node.names:
            dotted = f"{node.module}.{alias.name}"
            if _has_private(dotted):
                self._report(node, dotted)
            self.aliases[alias.asname or alias.name] = dotted

    def _dotted(self, node: ast.expr) -> str | None:
        """``a.b.c`` resolved through the aliases, or None when the chain does not start at a watched name."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.aliases:
            return None
        return ".".join([self.aliases[node.id], *reversed(parts)])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self._dotted(node)
        if dotted is not None:
            base = self._dotted(node.value) if isinstance(node.value, ast.Attribute) else None
            # Report the longest chain once: an inner chain that is already private was reported by its parent.
            if _is_private(node.attr) or (base is None and _has_private(dotted)):
                self._report(node, dotted)
                return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        is_getattr = isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
        if is_getattr and len(node.args) >= 2:
            target = self._dotted(node.args[0])
            name = node.args[1]
            literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
            if target is not None and literal and _is_private(name.value):  # type: ignore[attr-defined]
                self._report(node, f"{target}.{name.value}")  # type: ignore[attr-defined]
        self.generic_visit(node)


def scan_source(source: str, path: Path) -> list[PrivateUse]:
    """The private torch/Lightning uses in one module's source."""
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=str(path)))
    return scanner.found


def scan_package(package: Path = PACKAGE) -> list[PrivateUse]:
    """Every private torch/Lightning use in the package, in file and line order."""
    found: list[PrivateUse] = []
    for path in sorted(package.rglob("*.py")):
        found.extend(scan_source(path.read_text(encoding="utf-8"), path))
    return found


def _outside_compat(found: list[PrivateUse]) -> list[PrivateUse]:
    return [use for use in found if not any(c in use.path.parents for c in COMPAT)]


def _torch_only(found: list[PrivateUse]) -> list[PrivateUse]:
    return [use for use in found if use.symbol.split(".")[0] == "torch"]


def test_no_private_torch_symbol_outside_compat() -> None:
    stray = _torch_only(_outside_compat(scan_package()))
    assert not stray, "private torch symbols outside the compat modules:\n" + "\n".join(map(str, stray))


def test_no_private_lightning_symbol_outside_compat() -> None:
    stray = [use for use in _outside_compat(scan_package()) if use.symbol.split(".")[0] != "torch"]
    assert not stray, "private Lightning symbols outside the compat modules:\n" + "\n".join(map(str, stray))


def test_compat_module_is_where_the_private_uses_are() -> None:
    """The compat modules do hold the torch and Lightning privates (so the scan sees them: a scan that finds
    nothing proves nothing)."""
    torch_side = [use for use in scan_package() if COMPAT[0] in use.path.parents]
    assert any(use.symbol.startswith("torch.serialization._") for use in torch_side), [str(u) for u in torch_side]
    lightning_side = [use for use in scan_package() if COMPAT[1] in use.path.parents]
    assert any(use.symbol.startswith("lightning.") for use in lightning_side), [str(u) for u in lightning_side]


@pytest.mark.parametrize(
    ("source", "symbol"),
    [
        ("import torch\nx = torch.utils._pytree.tree_map", "torch.utils._pytree"),
        ("import torch\nx = torch._C._disabled_torch_function_impl", "torch._C._disabled_torch_function_impl"),
        ("import torch.distributed as dist\ndist._functional_collectives", "torch.distributed._functional_collectives"),
        ("import torch.utils._pytree as pytree", "torch.utils._pytree"),
        ("from torch.utils._pytree import tree_map", "torch.utils._pytree.tree_map"),
        ("from torch.serialization import _open_zipfile_writer", "torch.serialization._open_zipfile_writer"),
        ("from torch.distributed import checkpoint as dcp\ndcp._traverse", "torch.distributed.checkpoint._traverse"),
        (
            "import torch\ngetattr(torch.storage, '_dtype_to_storage_type_map')",
            "torch.storage._dtype_to_storage_type_map",
        ),
        ("from lightning.pytorch.trainer import connectors\nconnectors._x", "lightning.pytorch.trainer.connectors._x"),
        ("from lightning.fabric.utilities.cloud_io import _load", "lightning.fabric.utilities.cloud_io._load"),
        ("import lightning_fabric._graveyard", "lightning_fabric._graveyard"),
    ],
)
def test_scan_finds(source: str, symbol: str) -> None:
    found = scan_source(source, PACKAGE / "example.py")
    assert [use.symbol for use in found] == [symbol]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.__version__",
        "import torch\ntorch.distributed.checkpoint.load",
        "import numpy as np\nnp._core",
        "from ._private import x",
        "class A:\n    def f(self):\n        return self._torch",
        "import torch\nx = torch.ones(1)\nx._version",
    ],
)
def test_scan_ignores_public_and_foreign(source: str) -> None:
    assert scan_source(source, PACKAGE / "example.py") == []
