"""Write docs/api.md, the API reference, from the package's docstrings and signatures.

The reference is generated so it cannot drift from the code: ``tests/test_docs.py`` regenerates
it and fails when the committed file differs. Run ``python3 tools/make_api_docs.py`` after
changing a public signature or docstring. A public member of a documented module or class without
a docstring fails both the run and ``--check`` (exit code 1, naming it): it would otherwise be left
out of the reference without a word.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"
SECTIONS = [
    ("gdsckpt", None),
    ("gdsckpt.dcp", ["GdsStorageWriter", "GdsStorageReader", "GdsStorageInfo", "PickleOnlyMetadataWarning",
                     "item_key"]),
    ("gdsckpt.lossy", None),
    ("gdsckpt.async_save", None),
    ("gdsckpt.config", ["resolve_config", "preset_names"]),
    ("gdsckpt.io", ["NullWriter", "PreloadedReader"]),
    ("gdsckpt.lightning", ["GdsCheckpointIO"]),
]
HEADER = """# API reference

Generated from the docstrings by `tools/make_api_docs.py` (a test keeps it current). The file
format is specified in [format.md](format.md); options in [configuration.md](configuration.md).
"""


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "(no docstring)")


def _describe_class(name: str, cls: type, undocumented: list[str]) -> list[str]:
    lines = [f"### class `{name}{_signature(cls)}`", "", _doc(cls), ""]
    if dataclasses.is_dataclass(cls):
        lines.append("| field | type | default |")
        lines.append("|---|---|---|")
        for field in dataclasses.fields(cls):
            default = "" if field.default is dataclasses.MISSING else f"`{field.default!r}`"
            lines.append(f"| `{field.name}` | `{field.type}` | {default} |")
        lines.append("")
    for member_name, member in sorted(vars(cls).items()):
        if member_name.startswith("_"):
            continue
        target = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not callable(target):
            continue
        if not getattr(target, "__doc__", None):
            undocumented.append(f"{name}.{member_name}")
            continue
        kind = "property" if isinstance(member, property) else "method"
        signature = "" if kind == "property" else _signature(target)
        lines += [f"- {kind} `{member_name}{signature}`: " + _doc(target).replace("\n", "\n  "), ""]
    return lines


def render(undocumented: list[str] | None = None) -> str:
    """The reference as Markdown. Every documented module, class and function, and every public
    method and property of a documented class, without a docstring of its own is appended to
    ``undocumented`` (as ``module.name`` or ``module.Class.member``)."""
    missing: list[str] = [] if undocumented is None else undocumented
    lines = [HEADER]
    top = importlib.import_module("gdsckpt")
    for module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _doc(module), ""]
        if not module.__doc__:
            missing.append(module_name)
        names = names or [n for n in module.__all__ if not n.startswith("__")]
        # Described once, under ``gdsckpt``, where a module re-exports the same object.
        shared = [n for n in names if module is not top and getattr(top, n, None) is getattr(module, n)]
        if shared:
            lines += ["Also here, as described under `gdsckpt`: " + ", ".join(f"`{n}`" for n in shared) + ".", ""]
        for name in (n for n in names if n not in shared):
            obj = getattr(module, name)
            if callable(obj) and not obj.__doc__:
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                class_missing: list[str] = []
                lines += _describe_class(name, obj, class_missing)
                missing += [f"{module_name}.{member}" for member in class_missing]
            elif callable(obj):
                lines += [f"### `{name}{_signature(obj)}`", "", _doc(obj), ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    """Write (or with ``--check``, compare) docs/api.md; returns the exit code: 1 where the
    committed file differs (``--check``) or where a public member has no docstring (named on
    stderr; nothing is written then)."""
    undocumented: list[str] = []
    text = render(undocumented)
    if undocumented:
        print("public members without a docstring (docs/api.md would omit them):\n  "
              + "\n  ".join(undocumented), file=sys.stderr)
        return 1
    if "--check" in sys.argv:
        return 0 if OUTPUT.exists() and OUTPUT.read_text() == text else 1
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
