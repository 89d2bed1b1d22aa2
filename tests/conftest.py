"""Shared fixtures of the gdsckpt test suite.

Helpers are handed to tests as fixtures (not imported from this module), so the suite works no
matter how many ``conftest.py`` files other test directories add.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import struct
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Hypothesis imports libcst to print a patch for a failing example, and libcst warns on import
# (mypy_extensions.TypedDict is deprecated). Under filterwarnings=error that warning, raised in a
# pytest hook, turns a plain test failure into an INTERNALERROR; import it once here, quietly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # pragma: no cover - depends on hypothesis' optional dependencies
        pass

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test dependency
    torch = None  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _fresh_auto_history(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts as a process on a machine that has made no ``codec="auto"`` save yet: the
    choice between compressing and storing as it is (``gdsckpt.pipeline.host_auto``) is learned
    per storage from earlier saves, every test's temporary directory is on the same storage, and
    what was measured is also cached on disk (``XDG_CACHE_HOME``, here a directory of the test's)."""
    from gdsckpt.pipeline.host_auto import HISTORY

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    HISTORY.clear()
    yield
    HISTORY.clear()


FAKE_DEVICE_SCALE = 256
"""The fake device's chunks (64 KiB) are this fraction of the GPU's (16 MiB)."""


@pytest.fixture
def nvcomp_scratch_at_fake_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvCOMP's decode scratch at the fake device's scale: its fixed part (about 100 MiB for
    Zstd, the same for every chunk size) divided by ``FAKE_DEVICE_SCALE``, the part per chunk as
    it is (``decode_scratch`` scales that to the chunk). The fake device's tests restore states of
    a few MiB under budgets of a few MiB, which keeps the restore's budgeting (arena, lead, ring,
    scratch) in play; with the GPU's fixed 96 MiB every one of them would be refused outright.
    The decoder and the fake's codec read the same table, so the bound they test is the same
    rule; ``tests/test_restore_bound.py`` pins the measured table itself."""
    from gdsckpt.pipeline.gpu import staging

    monkeypatch.setattr(staging, "DECODE_SCRATCH", {name: (fixed // FAKE_DEVICE_SCALE, per_chunk)
                                                    for name, (fixed, per_chunk) in staging.DECODE_SCRATCH.items()})


@pytest.fixture(autouse=True)
def _hermetic_environment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``GDSCKPT_*`` variable of the caller's shell changes what a test of this directory sees
    (test packages in subdirectories keep theirs: they may opt in to things through them)."""
    if Path(str(request.node.path)).parent != Path(__file__).parent:
        return
    for name in list(os.environ):
        if name.startswith("GDSCKPT_"):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ckpt_path(tmp_path: Path) -> Path:
    """A checkpoint path in a fresh, empty directory."""
    return tmp_path / "ckpt.gdsckpt"


def small_config(**changes: Any) -> Any:
    """A Config with small chunks, so tiny test states still span many chunks and packs."""
    import gdsckpt

    base: dict[str, Any] = {"chunk_bytes": 4096, "pack_below": 1024, "codec_threads": 2, "io_threads": 2,
                            "fsync": False}
    base.update(changes)
    return gdsckpt.Config(**base)


# ---------------------------------------------------------------------------------------------
# bit-exact comparison of whole states

def tensor_bytes(tensor: Any) -> bytes:
    """The element bytes of a torch tensor in C order (NaN payloads and -0.0 included)."""
    # A fresh 1-D tensor, not .contiguous(): torch calls a single element contiguous whatever its
    # stride, and view() to bytes needs stride 1.
    t = torch.empty(tensor.numel(), dtype=tensor.dtype)
    if t.numel() == 0:
        return b""
    t.copy_(tensor.detach().cpu().reshape(-1))
    return t.view(torch.uint8).numpy().tobytes()


def array_bytes(array: Any) -> bytes:
    """The element bytes of a NumPy array or scalar in C order, little-endian."""
    a = np.asarray(array)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big"):
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a).tobytes()


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=") if dtype.byteorder in "<>" else dtype


def assert_same(expected: Any, actual: Any, path: str = "") -> None:
    """Assert ``actual`` has the types, structure and exact bits of ``expected``."""
    where = path or "<root>"
    if torch is not None and isinstance(expected, torch.Tensor):
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), f"{where}: shape {actual.shape} != {expected.shape}"
        assert actual.device.type == "cpu", where
        if isinstance(expected, torch.nn.Parameter):
            assert actual.requires_grad == expected.requires_grad, f"{where}: requires_grad"
        assert tensor_bytes(actual) == tensor_bytes(expected), f"{where}: bits differ"
        return
    if isinstance(expected, (np.ndarray, np.generic)):
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert _native(actual.dtype) == _native(expected.dtype), f"{where}: {actual.dtype} != {expected.dtype}"
        assert np.shape(actual) == np.shape(expected), f"{where}: shape"
        assert array_bytes(actual) == array_bytes(expected), f"{where}: bits differ"
        return
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert type(next(k for k in actual if k == key)) is type(key), f"{where}: key type of {key!r}"
            assert_same(expected[key], actual[key], f"{path}/{key}")
        if isinstance(expected, collections.OrderedDict):
            assert hasattr(actual, "_metadata") == hasattr(expected, "_metadata"), f"{where}: _metadata"
            if hasattr(expected, "_metadata"):
                assert_same(expected._metadata, actual._metadata, f"{path}/_metadata")
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}/{i}")
        return
    if isinstance(expected, float):
        assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{where}: {actual!r} != {expected!r}"
        return
    assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def float_from_bits(bits: int) -> float:
    """A Python float with exactly these IEEE-754 binary64 bits."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


# ---------------------------------------------------------------------------------------------
# reading a file's index without the library's load path

def read_index(path: Path) -> Any:
    """The parsed index (``gdsckpt.format.Index``) of a checkpoint file."""
    from gdsckpt.format import parse_index, unpack_trailer

    data = Path(path).read_bytes()
    trailer = unpack_trailer(data[-64:], len(data))
    raw = data[trailer.index_offset:trailer.index_offset + trailer.index_length]
    return parse_index(raw, index_offset=trailer.index_offset)


def rewrite_index(path: Path, edit: Any) -> None:
    """Apply ``edit`` to the index JSON document of ``path`` and rewrite index and trailer with
    correct checksums (a well-formed file whose index says something else)."""
    from gdsckpt.format import checksum, pack_trailer, unpack_trailer

    data = Path(path).read_bytes()
    trailer = unpack_trailer(data[-64:], len(data))
    doc = json.loads(data[trailer.index_offset:trailer.index_offset + trailer.index_length])
    edit(doc)
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    Path(path).write_bytes(data[:trailer.index_offset] + raw
                           + pack_trailer(trailer.index_offset, len(raw), checksum(raw)))


# ---------------------------------------------------------------------------------------------
# subprocesses

@contextlib.contextmanager
def dcp_load_fails_saying(caplog: pytest.LogCaptureFixture, pattern: str) -> Iterator[None]:
    """Expect the ``dcp.load`` inside to fail, with ``pattern`` reaching the user: in the
    ``CheckpointException`` where torch passes the storage reader's error on (2.12 and later),
    and in any case in gdsckpt's error log (torch 2.11 raises only "metadata is None")."""
    from torch.distributed.checkpoint.api import CheckpointException

    with caplog.at_level(logging.ERROR, logger="gdsckpt"), pytest.raises(CheckpointException) as raised:
        yield
    logged = [r.getMessage() for r in caplog.records if r.name == "gdsckpt"]
    assert any(re.search(pattern, text) for text in logged), logged
    if "metadata is None" not in str(raised.value) or "read failed" in str(raised.value):
        assert re.search(pattern, str(raised.value)), str(raised.value)


def subprocess_env() -> dict[str, str]:
    """An environment in which ``python -m gdsckpt`` imports this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_python(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``sys.executable *args`` against this checkout and capture its output."""
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(), cwd=str(cwd or REPO_ROOT))


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m gdsckpt *args``."""
    return run_python("-m", "gdsckpt", *args, timeout=timeout)


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """The helpers above, as one namespace: ``h.assert_same(expected, actual)`` etc."""
    return SimpleNamespace(
        REPO_ROOT=REPO_ROOT, small_config=small_config, tensor_bytes=tensor_bytes, array_bytes=array_bytes,
        assert_same=assert_same, float_from_bits=float_from_bits, read_index=read_index,
        rewrite_index=rewrite_index, run_python=run_python, run_cli=run_cli, subprocess_env=subprocess_env,
        dcp_load_fails_saying=dcp_load_fails_saying,
    )
