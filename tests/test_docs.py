"""The generated API reference matches the code (regenerate with tools/make_api_docs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER_PAGES = ["quickstart.md", "configuration.md", "object-storage.md", "troubleshooting.md"]


def test_api_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("make_api_docs", ROOT / "tools" / "make_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "api.md").read_text()
    undocumented: list[str] = []
    assert committed == module.render(undocumented), "docs/api.md is stale: run python3 tools/make_api_docs.py"
    assert not undocumented, f"public members without a docstring: {undocumented}"


def test_docs_link_to_files_that_exist() -> None:
    import re

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_api_reference_describes_what_the_docs_tell_users_to_call() -> None:
    """Every public ``gdsckpt....`` function or class the README and the user's docs name (a name
    in its module's ``__all__``, or a method of such a class) has its entry in docs/api.md. The
    developers' pages (reliability, performance, architecture, contributing, format) name
    internals on purpose."""
    import importlib
    import inspect
    import re

    api = (ROOT / "docs" / "api.md").read_text()
    described = set(re.findall(r"^(?:### (?:class )?|- (?:method|property) )`(\w+)", api, re.M))
    missing = set()
    for page in [ROOT / "README.md", *(ROOT / "docs" / name for name in USER_PAGES)]:
        for reference in set(re.findall(r"gdsckpt(?:\.[A-Za-z]\w*)+", page.read_text())):
            parts = reference.split(".")
            depth = max(i for i in range(1, len(parts) + 1) if _is_module(".".join(parts[:i])))
            owner: object = importlib.import_module(".".join(parts[:depth]))
            public = True
            for name in parts[depth:]:
                exported = getattr(owner, "__all__", None) if inspect.ismodule(owner) else None
                public = public and (exported is None or name in exported) and hasattr(owner, name)
                owner = getattr(owner, name, None)
            if public and owner is not None and not inspect.ismodule(owner) and parts[-1] not in described:
                missing.add(f"{reference} ({page.name})")
    assert not missing, f"named in the docs, not in docs/api.md: {sorted(missing)}"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module that is not a package
        return False
