"""The figures the reliability tests reached, in the terminal summary (quoted by docs/reliability.md)."""

from __future__ import annotations

from typing import Any

from .harness import FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("reliability figures")
        for name, text in FIGURES.items():
            terminalreporter.write_line(f"{name}: {text}")
