"""The generated API reference matches the code (regenerate with tools/make_api_docs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("make_api_docs", ROOT / "tools" / "make_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == module.render(), "docs/api.md is stale: run python3 tools/make_api_docs.py"


def test_docs_link_to_files_that_exist() -> None:
    import re

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
