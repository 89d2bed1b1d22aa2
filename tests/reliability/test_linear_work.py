"""Work and memory linear in the file size (issue 16, item 4): a structure whose key paths are long
(one very long dict key above many plain leaves, or a deep chain of dicts above them) must not make
the reader build one full key-path string per node, which is quadratic in the file size.

Every entry point runs on each hostile file in a fresh process (``python -m
reliability.test_linear_work CHILD``, cwd ``tests/``) with a watchdog thread that ends the child as
soon as its resident set grows past the bound: the pass/fail criterion is memory (growth below
MEMORY_FACTOR x the file size per operation), the subprocess timeout only a hang guard far above the
linear cost. Before the fix ``load_into`` ran out of that bound (a key string per plain value, on
both sides), ``load`` rebuilt the key path of every node (the 4 MB key, 25,000 times) and
``walk_tree`` held the full path of every pending node of the deep chain.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import gdsckpt
from gdsckpt.errors import StateMismatchError

from .harness import record_figure
from .test_hostile_files import RssSampler, _rss

LONG_KEY_BYTES = 4_000_000
DEPTH = 250  # below the 256 levels save accepts
LEAVES = 25_000
MEMORY_FACTOR = 40
"""Resident-set growth allowed per operation, as a multiple of the file size: the parsed structure
alone is about 15x a compact JSON index, and the deep chain's paths held per node were about 40x."""
MESSAGE_ALLOWANCE = 3 * 300 * LEAVES
"""Added for ``load_into_mismatch``: its message lists every leaf, each key cut to about 200
characters, and exists in about three copies (the lines, the message, the test's ``str``)."""
HANG_GUARD_S = 60
"""Far above the linear cost (about a second per operation here); the quadratic one is minutes."""

SHAPES = ("long_key", "deep_chain")
OPERATIONS = ("save", "load_into", "load_into_mismatch", "load", "load_keys", "keys", "inspect", "verify")


def _prefix(shape: str) -> list[str]:
    """The container keys above the leaves."""
    return ["k" * LONG_KEY_BYTES] if shape == "long_key" else ["a"] * DEPTH


def hostile_state(shape: str, leaves: dict[str, Any]) -> dict[str, Any]:
    """``leaves`` under the key path ``_prefix(shape)``."""
    state: dict[str, Any] = leaves
    for key in reversed(_prefix(shape)):
        state = {key: state}
    return state


def _leaves(value: int | None = None) -> dict[str, Any]:
    return {str(i): i if value is None else value for i in range(LEAVES)}


def _limit(operation: str, size: int) -> int:
    """Resident-set growth allowed to ``operation`` on a file of ``size`` bytes."""
    return MEMORY_FACTOR * size + (MESSAGE_ALLOWANCE if operation == "load_into_mismatch" else 0)


def _start_watchdog(state: dict[str, Any]) -> None:
    """End this process (exit status 3) as soon as its resident set grows more than
    ``state["limit"]`` bytes over ``state["baseline"]`` (both set at the start of each operation,
    named ``state["operation"]``)."""
    def watch() -> None:
        while True:
            growth = _rss() - state["baseline"]
            if growth > state["limit"]:
                print(json.dumps({"operation": state["operation"], "over_limit": growth}), flush=True)
                os._exit(3)
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()


def _run(operation: str, shape: str, path: Path, expected: dict[str, Any]) -> None:
    """One entry point on the hostile file, checking what it returns."""
    prefix = "/".join(_prefix(shape))
    if operation == "save":
        gdsckpt.save(expected, path.with_name("saved.gdsckpt"))
    elif operation == "load":
        assert gdsckpt.load(path) == expected
    elif operation == "load_keys":
        assert gdsckpt.load(path, keys=[prefix + "/7"]) == hostile_state(shape, {"7": 7})
    elif operation == "load_into":
        target = hostile_state(shape, _leaves(0))
        assert gdsckpt.load_into(target, path) is target
        assert target == expected
    elif operation == "load_into_mismatch":
        try:
            gdsckpt.load_into(hostile_state(shape, {}), path)
            raise AssertionError("a target without the leaves was accepted")
        except StateMismatchError as err:
            assert "/7'" in str(err), str(err)[:400]
    elif operation == "keys":
        with gdsckpt.open(path) as checkpoint:
            assert checkpoint.keys() == []
    elif operation == "inspect":
        assert gdsckpt.inspect(path).tensors == ()
    elif operation == "verify":
        gdsckpt.verify(path)


def _release_free_memory() -> None:
    """Collect garbage and give free heap pages back to the system (glibc), so that the next
    operation's growth is measured from a resident set without the previous one's free memory."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _child(shape: str, path_text: str) -> None:
    """Child process: every entry point on one hostile file; prints one JSON line per operation
    (its resident-set growth, the inputs it builds included, and its duration)."""
    import torch  # noqa: F401 - load_into imports it: outside the measurement

    path = Path(path_text)
    expected = hostile_state(shape, _leaves())
    gdsckpt.load_into({"x": 0}, path.with_name("warm.gdsckpt"))  # lazy imports, likewise
    size = path.stat().st_size
    running: dict[str, Any] = {"operation": "start", "baseline": _rss(), "limit": MEMORY_FACTOR * size}
    _start_watchdog(running)
    for operation in OPERATIONS:
        _release_free_memory()
        sampler = RssSampler()
        running.update(operation=operation, baseline=sampler.baseline, limit=_limit(operation, size))
        sampler.start()
        started = time.perf_counter()
        _run(operation, shape, path, expected)
        seconds = time.perf_counter() - started
        sampler.stop()
        print(json.dumps({"operation": operation, "peak": sampler.growth, "seconds": seconds}), flush=True)


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved checkpoint per shape (saving is itself one of the measured operations)."""
    files = {}
    for shape in SHAPES:
        directory = tmp_path_factory.mktemp(shape)
        gdsckpt.save({"x": 1}, directory / "warm.gdsckpt")
        files[shape] = directory / "hostile.gdsckpt"
        gdsckpt.save(hostile_state(shape, _leaves()), files[shape])
    return files


@pytest.mark.parametrize("shape", SHAPES)
def test_long_key_paths_cost_linear_time_and_memory(shape: str, hostile_files: dict[str, Path],
                                                    h: Any) -> None:
    path = hostile_files[shape]
    size = path.stat().st_size
    child = h.run_python("-m", "reliability.test_linear_work", shape, str(path), cwd=h.REPO_ROOT / "tests",
                         timeout=HANG_GUARD_S)
    results = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    over = [result for result in results if "over_limit" in result]
    assert not over, f"grew past {MEMORY_FACTOR}x the file size ({size} bytes): {over}"
    assert child.returncode == 0, child.stderr[-4000:]
    assert [result["operation"] for result in results] == list(OPERATIONS)
    for result in results:
        assert result["peak"] < _limit(result["operation"], size), result
    record_figure(f"linear work on {shape}",
                  f"{size / 1e6:.1f} MB file, {LEAVES:,} leaves: " + ", ".join(
                      f"{r['operation']} {r['seconds']:.2f} s / {r['peak'] / size:.1f}x" for r in results)
                  + " (time / resident-set growth over the file size)")


if __name__ == "__main__":
    _child(*sys.argv[1:])


def test_partial_load_follows_requested_keys_component_by_component(tmp_path: Path) -> None:
    """``load(keys=...)`` compares requested keys with each component in place instead of joining
    every node's key: escaped ``/``, an empty key, list indices and nested requests keep working."""
    import torch

    path = tmp_path / "state.gdsckpt"
    gdsckpt.save({"a/b": {"c": 1}, "": {"x": [10, {"y": 2}]}, "a": {"b": torch.ones(2), "bb": 4}}, path)
    assert gdsckpt.load(path, keys=["a~1b"]) == {"a/b": {"c": 1}}
    assert gdsckpt.load(path, keys=["/x/1/y"]) == {"": {"x": [None, {"y": 2}]}}
    assert gdsckpt.load(path, keys=["a/bb"]) == {"a": {"bb": 4}}
    nested = gdsckpt.load(path, keys=["a", "a/b", "a/bb"])  # each one found, though "a" covers the others
    assert list(nested) == ["a"] and nested["a"]["bb"] == 4 and torch.equal(nested["a"]["b"], torch.ones(2))
    with pytest.raises(KeyError, match="'a/b/c'"):
        gdsckpt.load(path, keys=["a/b/c"])
