"""The package's import rules (docs/architecture.md, "Layers"), checked on the source.

Every module of ``gdsckpt/`` is parsed with ``ast``; every import in it (at the top or inside a
function) is checked against two rules:

1. **Imports point down.** Each package has a layer (``LAYERS`` below, lowest first). A module
   may import from its own package and from packages of lower layers only:

   ====  ==========================================================
   0     ``errors``, ``version``, ``collector``
   1     ``format``
   2     ``codecs``
   3     ``io``
   4     ``pipeline``
   5     ``state``, ``config`` (``Config`` checks codec names against the registry)
   6     ``api``
   7     ``background``
   8     ``manager``, ``integrations``, ``tools``
   9     ``cli``
   10    the package root: ``gdsckpt/__init__``, ``__main__`` and the re-export modules
   ====  ==========================================================

   Packages of one layer do not import each other.
2. **No other module's private names.** ``from m import _x``, and ``m._x`` where ``m`` is an
   imported gdsckpt module, are refused (``__future__``-style dunders such as ``__version__``
   are names, not privates). A module's own underscore names are its business.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gdsckpt"

LAYERS: dict[str, int] = {
    "errors": 0, "version": 0, "collector": 0,
    "format": 1,
    "codecs": 2,
    "io": 3,
    "pipeline": 4,
    "state": 5, "config": 5,
    "api": 6,
    "background": 7,
    "manager": 8, "integrations": 8, "tools": 8,
    "cli": 9,
}
ROOT_LAYER = 10
"""Modules directly in ``gdsckpt/`` that are not in ``LAYERS``: the package root and the
documented re-export paths (``gdsckpt.dcp``, ``gdsckpt.lightning``, ...)."""


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``gdsckpt.a.b`` of a source file (``__init__.py`` names its package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> tuple[str, int]:
    """The top-level unit (``"api"``, ``"errors"``, or ``""`` for the root) and its layer."""
    parts = module.split(".")
    if len(parts) == 1:
        return "", ROOT_LAYER
    unit = parts[1]
    return unit, LAYERS.get(unit, ROOT_LAYER)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def violations(source: str, module: str, is_package: bool, known: set[str]) -> list[str]:
    """Every breach of the two rules in one module's source. ``known``: every gdsckpt module
    name, to tell ``from package import submodule`` from ``from module import name``."""
    tree = ast.parse(source)
    unit, layer = layer_of(module)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> gdsckpt module it is bound to

    def check_target(target: str, line: int) -> None:
        if not target.startswith("gdsckpt"):
            return
        target_unit, target_layer = layer_of(target)
        if target_unit == unit and unit:
            return
        if target_layer > layer or (target_layer == layer and target_unit != unit):
            found.append(f"{module}:{line} imports {target} (layer {target_layer}) from layer {layer}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                check_target(name.name, node.lineno)
                if name.name.startswith("gdsckpt"):
                    aliases[name.asname or name.name.split(".")[0]] = name.name if name.asname else "gdsckpt"
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve(module, is_package, node)
            if not source_module.startswith("gdsckpt"):
                continue
            for name in node.names:
                submodule = f"{source_module}.{name.name}"
                if submodule in known:
                    check_target(submodule, node.lineno)
                    aliases[name.asname or name.name] = submodule
                    continue
                check_target(source_module, node.lineno)
                if name.name.startswith("_") and not name.name.startswith("__") and source_module != module:
                    found.append(f"{module}:{node.lineno} imports private {source_module}.{name.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.value.id in aliases):
            found.append(f"{module}:{node.lineno} uses private {aliases[node.value.id]}.{node.attr}")
    return found


def _modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_points_down_and_at_public_names() -> None:
    modules = _modules()
    known = set(modules)
    found = []
    for module, path in modules.items():
        found += violations(path.read_text(encoding="utf-8"), module, path.name == "__init__.py", known)
    assert not found, "import rule violations:\n" + "\n".join(found)


def test_every_top_level_unit_has_a_layer() -> None:
    units = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()
             if (path.is_dir() and (path / "__init__.py").exists()) or path.suffix == ".py"}
    unplaced = units - set(LAYERS) - {"__init__", "__main__"}
    shims = {"dcp", "lightning", "lossy", "async_save", "demo"}
    assert unplaced <= shims, f"give these a layer in LAYERS (or make them re-export modules): {unplaced - shims}"


KNOWN = {"gdsckpt", "gdsckpt.api", "gdsckpt.api.saving", "gdsckpt.io", "gdsckpt.io.posix", "gdsckpt.format",
         "gdsckpt.cli", "gdsckpt.state"}


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("gdsckpt.io.posix", "from ..api import save", "imports gdsckpt.api (layer 6) from layer 3"),
    ("gdsckpt.io.posix", "def f():\n    from gdsckpt.cli import main", "imports gdsckpt.cli"),
    ("gdsckpt.io.posix", "import gdsckpt.api.saving", "imports gdsckpt.api.saving"),
    ("gdsckpt.state", "from ..api import saving", "imports gdsckpt.api.saving"),
    ("gdsckpt.api", "from ..format import _reject", "imports private gdsckpt.format._reject"),
    ("gdsckpt.api", "from .. import io as _io\n_io._helper()", "uses private gdsckpt.io._helper"),
    ("gdsckpt.api", "from ..io import posix\nposix._fd", "uses private gdsckpt.io.posix._fd"),
    ("gdsckpt.tools", "from ..cli import main", "imports gdsckpt.cli (layer 9) from layer 8"),
    ("gdsckpt.tools", "from ..integrations import dcp", "imports gdsckpt.integrations"),
    ("gdsckpt.io.posix", "from .base import _local", "imports private gdsckpt.io.base._local"),
])
def test_the_checker_finds_a_bad_import(module: str, source: str, expected: str) -> None:
    is_package = module.count(".") < 2
    found = violations(textwrap.dedent(source), module, is_package,
                       KNOWN | {"gdsckpt.integrations", "gdsckpt.integrations.dcp", "gdsckpt.tools"})
    assert any(expected in line for line in found), found


@pytest.mark.parametrize(("module", "source"), [
    ("gdsckpt.api", "from ..io import posix\nfrom ..format import align_up"),
    ("gdsckpt.api.saving", "from . import reports\nfrom .resolve import open_reader"),
    ("gdsckpt.io.posix", "from ..errors import CheckpointError\nimport torch\nfrom .base import StorageReader"),
    ("gdsckpt", "from .api import save\nfrom .version import __version__"),
])
def test_the_checker_passes_a_good_import(module: str, source: str) -> None:
    is_package = module.count(".") < 2
    assert violations(source, module, is_package, KNOWN) == []
