"""Storage-throughput benchmark: what a storage target does with checkpoint-sized writes and reads.

For each target directory (local NVMe, a shared filesystem, tmpfs, ...) and one synthetic training
state, this measures, on the same bytes and in one run:

- raw I/O through gdsckpt's own storage backends, without compression or pipeline: host memory to
  file and back (``PosixWriter`` / ``PosixReader``: O_DIRECT writes where the filesystem allows,
  buffered reads, as gdsckpt does) and, with CUDA, GPU memory to file and back (kvikio);
- ``gdsckpt.save`` / ``gdsckpt.load`` for every combination of codec, chunk size, I/O thread count
  and pipeline depth asked for (CPU engine on host memory; with CUDA also the GPU engine on GPU
  memory);
- the baselines ``torch.save`` / ``torch.load`` and safetensors ``save_file`` / ``load_file``.

Method (the same for every side): every save is durable (fsync inside the timing); every load is
cold as far as this host can make it (the file is fsynced and dropped from the page cache with
``posix_fadvise(DONTNEED)`` right before the read; a remote or virtual disk may still serve it from
its own cache); each configuration runs ``repeats`` times, round-robin with the others so a slow
phase of the storage hits all of them, and the median is reported; every load is checked bit for
bit against the original. GB/s are logical tensor bytes (10**9) over wall seconds.

Every file the benchmark writes lives in a private directory inside the target
(``.gdsckpt-bench-*``), removed when the run ends, fails or is interrupted. ``recommend`` picks the
fastest lossless gdsckpt configuration of a target and ``preset_toml`` writes it as a preset of
``gdsckpt.Config`` fields.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import gc
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..version import __version__
from ..codecs import PORTABLE_CODECS, known_codec_names
from ..config import Config
from ..codecs.nvcomp import MAX_CHUNK_BYTES
from ..format import align_up
from ..io import PosixReader, PosixWriter, aligned_empty
from ..errors import InsufficientSpaceError

logger = logging.getLogger("gdsckpt")

SCHEMA = "gdsckpt.storagebench/1"
GB = 1e9
GIB = 1 << 30
MIB = 1 << 20
DEFAULT_CODECS = ("auto", "zstd", "lz4", "none")
BASELINES = ("torch", "safetensors")
GPU_MAX_CHUNK_BYTES = MAX_CHUNK_BYTES
"""The GPU engine's largest chunk (nvCOMP's RAW maximum, ``Config.gpu_chunk_bytes``)."""
SAVE_TIE = 0.03
"""Save throughputs within this fraction of the fastest count as a tie (run-to-run noise)."""
RATIO_TIE = 0.01
"""Among tied saves, ratios within this fraction of the best count as a tie (then load speed decides)."""
WORKDIR_PREFIX = ".gdsckpt-bench-"
COLD_READ_METHOD = "fsync + posix_fadvise(POSIX_FADV_DONTNEED) on the file before each read"
COLD_READ_NOTE = ("the page cache of this host is dropped for the file before each read; a remote or "
                  "virtual disk (NFS, a hypervisor's virtio disk, a SAN) may still serve it from its own "
                  "cache, so read figures there can exceed what the media does")
DATA_DESCRIPTION = ("synthetic GPT-style mixed-precision training state: bf16 weights, fp32 master weights "
                    "N(0, 0.02) (norm weights around 1), AdamW exp_avg and exp_avg_sq built from N(0, 1e-3) "
                    "gradients; 14 bytes per parameter (1/7 of the bytes bf16)")



# ---------------------------------------------------------------------------------------------
# settings and results

@dataclass(frozen=True)
class BenchSettings:
    """What to measure. ``depths`` entries of None mean the config's own budgets
    (``max_inflight_bytes`` / ``max_staging_bytes``); an int ``d`` sets both to ``d`` x chunk size."""

    size_bytes: int = GIB
    codecs: tuple[str, ...] = DEFAULT_CODECS
    chunk_sizes: tuple[int, ...] = (4 * MIB, 16 * MIB)
    threads: tuple[int, ...] = (8, 16)
    depths: tuple[int | None, ...] = (None,)
    repeats: int = 3
    device: str = "cpu"
    baselines: tuple[str, ...] = BASELINES
    seed: int = 0
    config: Config = field(default_factory=Config)
    max_seconds: float | None = None
    """A time budget for the measurements (shared out evenly over the targets): once a target's
    share is spent, its configurations not yet measured are skipped and those measured fewer
    times than ``repeats`` keep what they have, so the run ends on time with partial results
    rather than being killed with none (a 512 MiB, two-target GPU run overran a 95 s limit)."""

    def __post_init__(self) -> None:
        if self.size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {self.size_bytes}")
        unknown = [c for c in self.codecs if c not in known_codec_names()]
        if unknown or not self.codecs:
            raise ValueError(f"codec {(unknown or [''])[0]!r} is invalid (expected one of: "
                             f"{', '.join(known_codec_names())})")
        for chunk in self.chunk_sizes:
            if chunk <= 0 or chunk % 4096 or chunk > GIB:
                raise ValueError(f"chunk size {chunk} is invalid (expected a multiple of 4096 between "
                                 f"4 KiB and 1 GiB)")
        if not self.chunk_sizes or not self.threads or not self.depths:
            raise ValueError("chunk_sizes, threads and depths each need at least one value")
        if any(t < 1 for t in self.threads) or any(d is not None and d < 1 for d in self.depths):
            raise ValueError("threads and depths must be >= 1")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is invalid (expected one of: cpu, cuda)")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise ValueError(f"baseline {bad[0]!r} is invalid (expected one of: {', '.join(BASELINES)})")

    def to_json(self) -> dict[str, Any]:
        """The settings as plain JSON values (the config as its fields)."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        doc = {key: list(value) if isinstance(value, tuple) else value for key, value in doc.items()}
        doc["config"] = dataclasses.asdict(self.config)
        return doc


@dataclass
class Measurement:
    """One configuration on one target: per-repeat seconds and the medians derived from them."""

    path: str
    """``raw-posix``, ``raw-kvikio``, ``gdsckpt``, ``torch`` or ``safetensors``."""
    kind: str
    """``raw``, ``gdsckpt`` or ``baseline``."""
    device: str
    """Where the data lives while it is saved and where it is loaded to: ``cpu`` or ``cuda``."""
    engine: str | None = None
    """The gdsckpt engine (``cpu`` / ``gpu``); None for raw I/O and baselines."""
    codec: str | None = None
    chunk_bytes: int | None = None
    """gdsckpt's chunk size, or the block size of each raw read and write."""
    threads: int | None = None
    """I/O threads (``io_threads``; on the GPU also ``kvikio_threads``)."""
    depth: int | None = None
    """Chunks in flight asked for; None: the config's budget."""
    inflight_bytes: int | None = None
    """The in-flight budget that ran (``max_inflight_bytes``, or ``max_staging_bytes`` on the GPU)."""
    lossless: bool = True
    status: str = "pending"
    """``ok`` (its repeats ran: fewer than asked when the time budget ran out, ``reason`` then says
    so), ``failed`` (``reason`` says why) or ``skipped`` (cannot run here, or no time left)."""
    reason: str | None = None
    logical_bytes: int = 0
    file_bytes: int | None = None
    save_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    bit_exact: bool | None = None
    """Every load came back bit-identical to what was saved (None: nothing was loaded)."""
    backend: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def save_gbps(self) -> float | None:
        """Logical GB over the median save time (durable)."""
        return _gbps(self.logical_bytes, self.save_seconds)

    @property
    def load_gbps(self) -> float | None:
        """Logical GB over the median load time (cold)."""
        return _gbps(self.logical_bytes, self.load_seconds)

    @property
    def ratio(self) -> float | None:
        """Logical bytes over bytes on disk."""
        return self.logical_bytes / self.file_bytes if self.file_bytes else None

    @property
    def label(self) -> str:
        """A short description of the configuration, e.g. ``gdsckpt cpu zstd 4MiB x8``."""
        parts = [self.path]
        if self.engine:
            parts.append(self.engine)
        if self.codec:
            parts.append(self.codec)
        if self.chunk_bytes:
            parts.append(format_size(self.chunk_bytes))
        if self.threads:
            parts.append(f"x{self.threads}")
        if self.kind == "gdsckpt":
            parts.append(f"depth {self.depth if self.depth is not None else 'default'}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """Every field, plus the derived medians."""
        doc = dataclasses.asdict(self)
        doc.update(save_gbps=self.save_gbps, load_gbps=self.load_gbps, ratio=self.ratio)
        return doc


@dataclass(frozen=True)
class Recommendation:
    """The configuration ``recommend`` picked for a target, as ``gdsckpt.Config`` fields."""

    target: str
    engine: str
    fields: dict[str, Any]
    """Config field -> value (sizes as ints)."""
    measurement: Measurement
    raw_write_gbps: float | None
    raw_read_gbps: float | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        """The choice, its figures and why."""
        m = self.measurement
        return {"engine": self.engine, "fields": dict(self.fields), "reason": self.reason,
                "save_gbps": m.save_gbps, "load_gbps": m.load_gbps, "ratio": m.ratio,
                "raw_write_gbps": self.raw_write_gbps, "raw_read_gbps": self.raw_read_gbps}


@dataclass
class TargetResult:
    """Everything measured on one target directory."""

    path: str
    filesystem: dict[str, str]
    free_bytes: int
    measurements: list[Measurement] = field(default_factory=list)
    recommendation: Recommendation | None = None

    def to_json(self) -> dict[str, Any]:
        """The target, its measurements and (after ``recommend``) the recommendation."""
        return {"path": self.path, "filesystem": self.filesystem, "free_bytes_before": self.free_bytes,
                "results": [m.to_json() for m in self.measurements],
                "recommendation": self.recommendation.to_json() if self.recommendation else None}


@dataclass
class BenchReport:
    """A whole benchmark run: settings, host, data and one ``TargetResult`` per target."""

    settings: BenchSettings
    host: dict[str, Any]
    data: dict[str, Any]
    targets: list[TargetResult]
    date: str
    seconds: float = 0.0

    def ran(self) -> dict[str, bool]:
        """Which measurement paths completed at least one configuration on some target."""
        paths = {"raw_posix": ("raw-posix", None), "raw_kvikio": ("raw-kvikio", None),
                 "gdsckpt_cpu": ("gdsckpt", "cpu"), "gdsckpt_gpu": ("gdsckpt", "gpu"),
                 "torch": ("torch", None), "safetensors": ("safetensors", None)}
        measured = [m for t in self.targets for m in t.measurements if m.status == "ok"]
        return {name: any(m.path == path and (engine is None or m.engine == engine) for m in measured)
                for name, (path, engine) in paths.items()}

    @property
    def all_ok(self) -> bool:
        """No configuration failed and every load was bit-exact (skipped ones do not count)."""
        return all(m.status != "failed" and m.bit_exact is not False
                   for t in self.targets for m in t.measurements)

    def to_json(self) -> dict[str, Any]:
        """The JSON document the ``gdsckpt bench`` command writes (schema ``SCHEMA``)."""
        return {"schema": SCHEMA, "gdsckpt": __version__, "date": self.date, "seconds": self.seconds,
                "host": self.host, "settings": self.settings.to_json(), "data": self.data,
                "method": {"save": "durable: fsync of the file (and, for gdsckpt and raw writes, of "
                                   "its directory after the atomic rename) inside the timing",
                           "load": COLD_READ_METHOD, "cold_read_note": COLD_READ_NOTE,
                           "statistic": f"median of {self.settings.repeats} round-robin repeats",
                           "unit": "GB/s = 10**9 logical tensor bytes per wall second"},
                "ran": self.ran(), "all_ok": self.all_ok,
                "targets": [t.to_json() for t in self.targets]}


def _gbps(nbytes: int, seconds: list[float]) -> float | None:
    if not seconds:
        return None
    return nbytes / max(statistics.median(seconds), 1e-9) / GB


# ---------------------------------------------------------------------------------------------
# sizes

_UNIT_NAMES = ((1 << 40, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (1 << 10, "KiB"))


def format_size(nbytes: int) -> str:
    """``nbytes`` as an exact size string ``gdsckpt.config.parse_size`` reads back (``"4MiB"``),
    or the plain number when no binary unit divides it."""
    for unit, name in _UNIT_NAMES:
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return str(nbytes)


def human_size(nbytes: float) -> str:
    """``nbytes`` for people: ``"1.00 GiB"``."""
    for unit, name in _UNIT_NAMES:
        if abs(nbytes) >= unit:
            return f"{nbytes / unit:.2f} {name}"
    return f"{int(nbytes)} B"


# ---------------------------------------------------------------------------------------------
# the data

def _layer_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a GPT-style block stack holding exactly ``params`` parameters.

    The width grows with the state (at least two blocks), so the large matrices of a 1 GiB state
    (~44 MiB in fp32) span several chunks of any usual chunk size, as those of a real model do."""
    width = max(64, min(8192, int(math.sqrt(params / 24)) // 128 * 128))
    spec = [("norm1.weight", (width,)), ("norm1.bias", (width,)), ("qkv.weight", (3 * width, width)),
            ("qkv.bias", (3 * width,)), ("proj.weight", (width, width)), ("proj.bias", (width,)),
            ("norm2.weight", (width,)), ("norm2.bias", (width,)), ("fc1.weight", (4 * width, width)),
            ("fc1.bias", (4 * width,)), ("fc2.weight", (width, 4 * width)), ("fc2.bias", (width,))]
    shapes: list[tuple[str, tuple[int, ...]]] = []
    remaining, block = params, 0
    while remaining > 0:
        for name, shape in spec:
            count = math.prod(shape)
            if count >= remaining:  # the last tensor takes exactly what is left
                shapes.append((f"blocks.{block}.{name}", (remaining,) if count > remaining else shape))
                return shapes
            shapes.append((f"blocks.{block}.{name}", shape))
            remaining -= count
        block += 1
    return shapes


def logical_bytes_for(size_bytes: int) -> int:
    """The tensor bytes of ``synthetic_state(size_bytes)``: whole parameters of 14 bytes each."""
    return max(1, size_bytes // 14) * 14


def synthetic_state(nbytes: int, *, seed: int = 0) -> dict[str, Any]:
    """A mixed-precision training state of at most ``nbytes`` tensor bytes, in host memory.

    ``{"model": {name: bf16}, "master": {name: fp32}, "optimizer": {name: {"exp_avg", "exp_avg_sq"}},
    "step": int}``, deterministic in ``seed``. Drawn rather than trained so any size is quick to
    make; codec auto on the CPU stores it at ratios close to those of the trained GPT state of
    docs/performance.md (measured at 256 MiB: whole 1.24, bf16 1.49, fp32 groups 1.20-1.21; the
    trained state: 1.25, 1.55, 1.19-1.23).
    """
    import torch

    params = logical_bytes_for(nbytes) // 14
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {"model": {}, "master": {}, "optimizer": {}, "step": 100}
    for name, shape in _layer_shapes(params):
        master = torch.randn(shape, generator=generator).mul_(0.02)
        if "norm" in name and name.endswith("weight"):
            master.add_(1.0)
        grad = torch.randn(shape, generator=generator).mul_(1e-3)
        # exp_avg_sq averages squared gradients of several steps: a sum of two squares is closer to
        # a trained optimizer's spread of exponents (and ratio) than one square.
        older = torch.randn(shape, generator=generator).mul_(1e-3)
        state["model"][name] = master.to(torch.bfloat16)
        state["master"][name] = master
        state["optimizer"][name] = {"exp_avg": grad.mul(0.1),
                                    "exp_avg_sq": grad.square().add_(older.square()).mul_(5e-4)}
    return state


def flat_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors of a nested dict keyed ``a/b/c`` (plain values left out)."""
    import torch

    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_tensors(value, path + "/"))
        elif isinstance(value, torch.Tensor):
            out[path] = value
    return out


def _same_bits(expected: dict[str, Any], actual: dict[str, Any]) -> bool:
    """Same keys, dtypes, shapes and bit patterns (compared on the expected tensor's device)."""
    import torch

    if expected.keys() != actual.keys():
        return False
    for key, want in expected.items():
        got = actual[key]
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return False
        if not _equal_bytes(want.reshape(-1).view(torch.uint8),
                            got.to(want.device).reshape(-1).contiguous().view(torch.uint8)):
            return False
    return True


def _equal_bytes(a: Any, b: Any) -> bool:
    """Two 1-D uint8 tensors of one length hold the same bytes. Compared as int64 words where the
    storage offsets allow it: torch compares uint8 tensors ~500x slower (measured on the CPU)."""
    import torch

    words = a.numel() // 8 * 8
    try:
        if not torch.equal(a[:words].view(torch.int64), b[:words].view(torch.int64)):
            return False
    except RuntimeError:  # a storage offset that is not a multiple of 8 bytes
        return bool(torch.equal(a, b))
    return bool(torch.equal(a[words:], b[words:]))


def describe_data(state: dict[str, Any], seed: int) -> dict[str, Any]:
    """Sizes of the synthetic state, for the report."""
    tensors = flat_tensors(state)
    by_dtype: dict[str, int] = {}
    for tensor in tensors.values():
        name = str(tensor.dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + tensor.numel() * tensor.element_size()
    return {"kind": "synthetic", "description": DATA_DESCRIPTION, "seed": seed,
            "logical_bytes": sum(by_dtype.values()), "tensors": len(tensors), "bytes_by_dtype": by_dtype,
            "largest_tensor_bytes": max(t.numel() * t.element_size() for t in tensors.values())}


# ---------------------------------------------------------------------------------------------
# targets and the host

def space_needed(settings: BenchSettings) -> int:
    """Bytes a target must have free: one file of ``size`` at a time (uncompressed gdsckpt,
    torch.save and safetensors files are the largest, slightly above the logical size) plus
    headroom, and the 256 MiB storage probe that ``codec="auto"`` on the GPU writes once."""
    need = align_up(settings.size_bytes) + settings.size_bytes // 20 + 64 * MIB
    if settings.device == "cuda" and "auto" in settings.codecs and settings.config.storage_gbps is None:
        from ..pipeline.autotune import PROBE_BYTES

        need += PROBE_BYTES
    return need


def check_target(path: str | os.PathLike[str], need_bytes: int) -> int:
    """Check ``path`` is a writable directory with ``need_bytes`` free; return its free bytes.

    Raises ``FileNotFoundError`` / ``NotADirectoryError`` / ``PermissionError`` for a bad path and
    ``InsufficientSpaceError`` when it lacks room."""
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"target {str(target)!r} does not exist")
    if not target.is_dir():
        raise NotADirectoryError(f"target {str(target)!r} is not a directory")
    if not os.access(target, os.W_OK | os.X_OK):
        raise PermissionError(f"target {str(target)!r} is not writable by this user")
    free = shutil.disk_usage(target).free
    if free < need_bytes:
        raise InsufficientSpaceError(
            f"target {str(target)!r} has {human_size(free)} free but the benchmark needs "
            f"{human_size(need_bytes)} there (one file of the data size at a time, plus headroom): "
            f"choose a smaller --size or another target")
    return free


def filesystem_of(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Mount point, filesystem type and device holding ``directory`` (from /proc/mounts; the
    longest mount point containing it wins)."""
    real = os.path.realpath(directory)
    found = {"mount_point": "?", "type": "?", "device": "?"}
    try:
        with open("/proc/mounts") as handle:
            mounts = [line.split()[:3] for line in handle if len(line.split()) >= 3]
    except OSError:
        return found
    for device, mount_point, fstype in mounts:
        mount_point = mount_point.replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and (found["mount_point"] == "?" or len(mount_point) >= len(found["mount_point"])):
            found = {"mount_point": mount_point, "type": fstype, "device": device}
    return found


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def host_info(device: str) -> dict[str, Any]:
    """Host, CPU, memory and package versions (without importing the GPU packages)."""
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as handle:
            cpu_model = next((line.split(":", 1)[1].strip() for line in handle
                              if line.startswith("model name")), None)
    except OSError:
        pass
    packages = ("torch", "numpy", "zstandard", "lz4", "safetensors", "matplotlib", "cupy-cuda13x",
                "cupy-cuda12x", "kvikio-cu13", "kvikio-cu12", "nvidia-nvcomp-cu13", "nvidia-nvcomp-cu12")
    info: dict[str, Any] = {
        "hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu_model": cpu_model, "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_available_bytes": available_memory(),
        "versions": {name: v for name in packages if (v := _package_version(name)) is not None},
        "gpu": None,
    }
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def resolve_device(requested: str) -> str:
    """``cpu``, or ``cuda`` when asked for (``auto``: when a CUDA GPU with CuPy, nvCOMP and kvikio
    is usable). Raises ``ValueError`` when ``cuda`` is asked for and not usable."""
    if requested == "cpu":
        return "cpu"
    if requested not in ("auto", "cuda"):
        raise ValueError(f"device {requested!r} is invalid (expected one of: cpu, cuda, auto)")
    usable, why = _cuda_usable()
    if usable:
        return "cuda"
    if requested == "cuda":
        raise ValueError(f"device 'cuda' requested but {why}")
    return "cpu"


def _cuda_usable() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    from ..codecs.nvcomp import gpu_available

    if not gpu_available():
        return False, "CuPy or nVCOMP is not usable (pip install 'gdsckpt[cu13]' or '[cu12]')"
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False, "kvikio is not installed (pip install 'gdsckpt[cu13]' or '[cu12]')"
    return True, ""


# ---------------------------------------------------------------------------------------------
# one measurement

def fsync_file(path: Path, *, drop_cache: bool = False) -> None:
    """fsync ``path``; with ``drop_cache`` also ask the kernel to drop its cached pages (clean after
    the fsync, so they can go), so the next read goes to storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class _Case:
    """A measurement and the three steps of one repeat: save (timed), load (timed), check."""

    measurement: Measurement
    suffix: str
    save: Callable[[Path], dict[str, Any]] | None = None
    load: Callable[[Path], Any] | None = None
    check: Callable[[Any], bool] | None = None


def _run_once(case: _Case, path: Path, sync: Callable[[], None]) -> None:
    """One durable save and one cold load of ``case`` at ``path``; the file is removed after."""
    m = case.measurement
    assert case.save is not None and case.load is not None and case.check is not None
    loaded = None
    # No garbage-collector pass inside a timed call (memory is freed by reference counting; a full
    # gc.collect() before each call would cost ~0.2 s with torch loaded, each time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        sync()
        started = time.perf_counter()
        details = case.save(path)
        sync()
        save_seconds = time.perf_counter() - started
        file_bytes = path.stat().st_size
        fsync_file(path, drop_cache=True)
        sync()
        started = time.perf_counter()
        loaded = case.load(path)
        sync()
        load_seconds = time.perf_counter() - started
        exact = case.check(loaded)
    # one configuration failing (a codec, memory, a baseline) ends only that configuration
    except Exception as err:  # noqa: BLE001
        m.status, m.reason = "failed", f"{type(err).__name__}: {err}"
        logger.warning("%s failed: %s", m.label, m.reason)
        return
    finally:
        if collecting:
            gc.enable()
        del loaded
        path.unlink(missing_ok=True)
    m.save_seconds.append(save_seconds)
    m.load_seconds.append(load_seconds)
    m.file_bytes = file_bytes
    m.bit_exact = exact and m.bit_exact is not False
    m.backend = details.pop("backend", m.backend)
    m.details.update(details)
    if not exact:
        logger.warning("%s: the load was not bit-exact", m.label)


# ---------------------------------------------------------------------------------------------
# what runs on each side

@dataclass
class _Side:
    """The data on one device and how to wait for that device."""

    device: str
    engine: str
    state: dict[str, Any]
    tensors: dict[str, Any]
    raw: Any
    """The state's bytes, concatenated and padded to 4 KiB: host (aligned) or device memory."""
    sync: Callable[[], None]


def _host_side(state: dict[str, Any]) -> _Side:
    import torch

    tensors = flat_tensors(state)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    raw = aligned_empty(align_up(total))  # O_DIRECT wants 4 KiB-aligned buffers and lengths
    raw[total:] = 0
    offset = 0
    for tensor in tensors.values():
        count = tensor.numel() * tensor.element_size()
        raw[offset:offset + count] = tensor.reshape(-1).view(torch.uint8).numpy()
        offset += count
    return _Side("cpu", "cpu", state, tensors, raw, lambda: None)


def _gpu_side(host: _Side) -> _Side:
    import torch

    def to_cuda(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: to_cuda(value) for key, value in node.items()}
        return node.to("cuda") if isinstance(node, torch.Tensor) else node

    state = to_cuda(host.state)
    raw = torch.from_numpy(host.raw).to("cuda")
    torch.cuda.synchronize()
    return _Side("cuda", "gpu", state, flat_tensors(state), raw, torch.cuda.synchronize)


def _raw_case(side: _Side, chunk: int, threads: int, config: Config, logical: int) -> _Case:
    """Raw I/O of the state's bytes through gdsckpt's backends: blocks of ``chunk`` bytes, all
    submitted at once to ``threads`` threads, then fsync (and the atomic rename gdsckpt does)."""
    gpu = side.device == "cuda"
    m = Measurement("raw-kvikio" if gpu else "raw-posix", "raw", side.device, chunk_bytes=chunk,
                    threads=threads, logical_bytes=logical)
    size = side.raw.nbytes if not gpu else side.raw.numel()
    offsets = range(0, size, chunk)

    def save(path: Path) -> dict[str, Any]:
        if gpu:
            from ..io.kvikio import KvikioWriter

            writer: PosixWriter = KvikioWriter(path, threads=threads, task_size=config.kvikio_task_size,
                                               o_direct=config.o_direct, fsync=True)
        else:
            writer = PosixWriter(path, threads=threads, o_direct=config.o_direct, fsync=True)
        try:
            futures = [writer.submit_write(offset, side.raw[offset:offset + chunk]) for offset in offsets]
            for future in futures:
                future.result()
            writer.write_tail(size, b"")
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        return {"backend": writer.name}

    def load(path: Path) -> Any:
        if gpu:
            import torch

            from ..io.kvikio import KvikioReader

            out: Any = torch.empty(size, dtype=torch.uint8, device="cuda")
            reader: PosixReader = KvikioReader(path, threads=threads, task_size=config.kvikio_task_size)
        else:
            out = aligned_empty(size)
            reader = PosixReader(path, threads=threads)
        try:
            futures = [reader.submit_read(offset, out[offset:offset + chunk]) for offset in offsets]
            for future in futures:
                future.result()
        finally:
            reader.close()
        return out

    def check(out: Any) -> bool:
        if gpu:
            import torch

            return bool(torch.equal(out, side.raw))
        import numpy as np

        return bool(np.array_equal(out, side.raw))

    return _Case(m, ".bin", save, load, check)


def _gdsckpt_case(side: _Side, codec: str, chunk: int, threads: int, depth: int | None, base: Config,
                  logical: int) -> _Case:
    """``gdsckpt.save`` / ``gdsckpt.load`` with one configuration (durable, engine pinned)."""
    m = Measurement("gdsckpt", "gdsckpt", side.device, engine=side.engine, codec=codec, chunk_bytes=chunk,
                    threads=threads, depth=depth, logical_bytes=logical)
    case = _Case(m, ".gdsckpt")
    gpu = side.engine == "gpu"
    if not gpu and codec != "auto" and codec not in PORTABLE_CODECS:
        m.status, m.reason = "skipped", f"codec {codec!r} runs on the GPU engine only"
        return case
    if gpu and chunk > GPU_MAX_CHUNK_BYTES:
        m.status, m.reason = "skipped", (f"the GPU engine's chunks are at most "
                                         f"{format_size(GPU_MAX_CHUNK_BYTES)} (nvCOMP)")
        return case
    if gpu:
        budget = depth * chunk if depth is not None else base.max_staging_bytes
        config = base.replace(codec=codec, engine="gpu", gpu_chunk_bytes=chunk, io_threads=threads,
                              kvikio_threads=threads, max_staging_bytes=budget, fsync=True)
    else:
        budget = depth * chunk if depth is not None else max(base.max_inflight_bytes, chunk)
        config = base.replace(codec=codec, engine="cpu", chunk_bytes=chunk, io_threads=threads,
                              max_inflight_bytes=budget, fsync=True)
    m.inflight_bytes = budget

    def save(path: Path) -> dict[str, Any]:
        from ..api import save as gdsckpt_save

        report = gdsckpt_save(side.state, path, codec=codec, config=config)
        return {"backend": report.backend, "codec_ran": report.codec, "chunks": report.chunks,
                "chains": report.chains, "auto": report.auto}

    def load(path: Path) -> Any:
        from ..api import load as gdsckpt_load

        return gdsckpt_load(path, device=side.device, config=config)

    case.save, case.load = save, load
    case.check = lambda loaded: _same_bits(side.tensors, flat_tensors(loaded))
    return case


def _baseline_case(side: _Side, name: str, logical: int) -> _Case:
    """``torch.save`` + fsync / ``torch.load``, or safetensors ``save_file`` + fsync / ``load_file``."""
    import torch

    m = Measurement(name, "baseline", side.device, logical_bytes=logical)
    if name == "torch":
        def save(path: Path) -> dict[str, Any]:
            with path.open("wb") as handle:
                torch.save(side.state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            return {"backend": "torch.save"}

        def load(path: Path) -> Any:
            return flat_tensors(torch.load(path, map_location=side.device, weights_only=True))

        return _Case(m, ".pt", save, load, lambda loaded: _same_bits(side.tensors, loaded))
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        m.status, m.reason = "skipped", "safetensors is not installed (pip install 'gdsckpt[bench]')"
        return _Case(m, ".safetensors")

    def save_st(path: Path) -> dict[str, Any]:
        save_file(side.tensors, str(path))
        fsync_file(path)
        return {"backend": "safetensors.save_file"}

    def load_st(path: Path) -> Any:
        loaded = load_file(str(path), device="cuda" if side.device == "cuda" else "cpu")
        if side.device == "cpu":
            # load_file maps the file on the CPU: touch one byte of every page so the timed load
            # reads what the other sides read
            for tensor in loaded.values():
                if tensor.numel():
                    int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())
        return loaded

    return _Case(m, ".safetensors", save_st, load_st, lambda loaded: _same_bits(side.tensors, loaded))


def _cases(side: _Side, settings: BenchSettings, logical: int) -> list[_Case]:
    cases = [_raw_case(side, chunk, threads, settings.config, logical)
             for chunk in settings.chunk_sizes for threads in settings.threads]
    cases += [_gdsckpt_case(side, codec, chunk, threads, depth, settings.config, logical)
              for codec in settings.codecs for chunk in settings.chunk_sizes
              for threads in settings.threads for depth in settings.depths]
    cases += [_baseline_case(side, name, logical) for name in settings.baselines]
    return cases


# ---------------------------------------------------------------------------------------------
# the run

@contextmanager
def bench_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A private directory inside ``target`` for the benchmark's files, removed with everything in
    it when the block ends, however it ends."""
    path = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=target))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _warm_up(side: _Side, directory: Path, settings: BenchSettings) -> None:
    """One small save and load first (untimed), as any process that has checkpointed once has
    done: codec libraries, nvCOMP kernels and thread pools start on first use; on the GPU, the
    storage probe of codec auto runs here (it is cached per filesystem), not inside a timed save."""
    import torch

    from ..api import load as gdsckpt_load
    from ..api import save as gdsckpt_save

    runnable = [c for c in settings.codecs if side.engine == "gpu" or c == "auto" or c in PORTABLE_CODECS]
    if not runnable:
        return
    first = next(iter(side.tensors.values()))
    sample = {"w": first.reshape(-1)[: 1 << 20].clone()}
    config = settings.config.replace(engine=side.engine, fsync=True)
    if side.engine == "gpu" and "auto" in settings.codecs:
        from ..pipeline.autotune import storage_gbps

        storage_gbps(directory, config.storage_gbps)
    path = directory / "warm-up.gdsckpt"
    for codec in runnable:
        try:
            gdsckpt_save(sample, path, codec=codec, config=config)
            gdsckpt_load(path, device=side.device, config=config)
        except Exception as err:  # noqa: BLE001 - the measurement of this codec records the failure
            logger.warning("warm-up of codec %r on the %s engine failed: %s", codec, side.engine, err)
        finally:
            path.unlink(missing_ok=True)
    if side.device == "cuda":
        torch.cuda.synchronize()


def run_benchmark(settings: BenchSettings, targets: list[str | os.PathLike[str]], *,
                  advance: Callable[[int], None] | None = None) -> BenchReport:
    """Measure every configuration of ``settings`` on every target; see the module docstring.

    Targets are checked (``check_target``) before any data is made. After each save+load (and for
    each skipped one) ``advance(n)`` is called with the state's logical bytes, up to
    ``progress_total`` in all. Every file written is removed before this returns or raises
    (KeyboardInterrupt included)."""
    import torch

    started = time.perf_counter()
    need = space_needed(settings)
    free = {str(target): check_target(target, need) for target in targets}
    memory = available_memory()
    if memory is not None and memory < 3 * settings.size_bytes:
        logger.warning("only %s of memory is available; the benchmark holds about three copies of the "
                       "%s state (data, raw buffer, what a load returns)", human_size(memory),
                       human_size(settings.size_bytes))
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    host_state = synthetic_state(settings.size_bytes, seed=settings.seed)
    data = describe_data(host_state, settings.seed)
    logical = data["logical_bytes"]
    sides = [_host_side(host_state)]
    if settings.device == "cuda":
        sides.append(_gpu_side(sides[0]))
    report = BenchReport(settings, host_info(settings.device), data, [], date)
    tick = advance or (lambda _n: None)
    try:
        for number, target in enumerate(targets):
            result = TargetResult(str(Path(target).resolve()), filesystem_of(target), free[str(target)])
            report.targets.append(result)
            deadline = None
            if settings.max_seconds is not None:
                left = settings.max_seconds - (time.perf_counter() - started)
                deadline = time.perf_counter() + left / (len(targets) - number)
            with bench_directory(target) as directory:
                _measure_target(result, sides, settings, logical, directory, tick, deadline)
    finally:
        del sides
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    report.seconds = time.perf_counter() - started
    return report


def progress_total(settings: BenchSettings, targets: int) -> int:
    """The sum of what ``run_benchmark`` passes to ``advance``: the state's logical bytes once per
    configuration, repeat and target (skipped configurations included)."""
    sides = 2 if settings.device == "cuda" else 1
    per_side = (len(settings.chunk_sizes) * len(settings.threads)
                * (1 + len(settings.codecs) * len(settings.depths)) + len(settings.baselines))
    return per_side * sides * settings.repeats * targets * logical_bytes_for(settings.size_bytes)


def _measure_target(result: TargetResult, sides: list[_Side], settings: BenchSettings, logical: int,
                    directory: Path, tick: Callable[[int], None], deadline: float | None = None) -> None:
    cases = [(side, case) for side in sides for case in _cases(side, settings, logical)]
    result.measurements = [case.measurement for _side, case in cases]
    for side in sides:
        _warm_up(side, directory, settings)
    # Round-robin: every configuration once per round, so a slow phase of the storage (a noisy
    # neighbour, a cache flush) hits all of them rather than one configuration's repeats.
    for round_number in range(settings.repeats):
        gc.collect()  # once a round: garbage of earlier rounds is not collected inside a timing
        for number, (side, case) in enumerate(cases):
            m = case.measurement
            if deadline is not None and time.perf_counter() > deadline and m.status in ("pending", "ok"):
                if m.status == "pending":
                    m.status, m.reason = "skipped", "the time budget (--max-seconds) was spent first"
                elif len(m.save_seconds) < settings.repeats:
                    m.reason = (f"{len(m.save_seconds)} of {settings.repeats} repeats: the time budget "
                                f"(--max-seconds) was spent")
                tick(logical)
                continue
            if m.status in ("pending", "ok"):
                _run_once(case, directory / f"case-{number}{case.suffix}", side.sync)
                if m.status != "failed":
                    m.status = "ok"
                    logger.info("%s round %d/%d: %s: save %.3f GB/s, load %.3f GB/s, ratio %.3f",
                                result.path, round_number + 1, settings.repeats, m.label,
                                logical / m.save_seconds[-1] / GB, logical / m.load_seconds[-1] / GB,
                                m.ratio or 0.0)
            tick(logical)


# ---------------------------------------------------------------------------------------------
# the recommendation

def recommend(result: TargetResult, engine: str | None = None) -> Recommendation | None:
    """The fastest lossless gdsckpt configuration of ``result`` by durable save throughput.

    Saves within ``SAVE_TIE`` of the fastest count as a tie (run-to-run noise); among those the
    best ratio wins (fewer bytes stored), and among ratios within ``RATIO_TIE`` the fastest cold
    load. ``engine``: ``gpu`` or ``cpu`` (default: ``gpu`` when it ran, else ``cpu``). Only
    configurations whose every repeat ran and loaded bit-exact qualify; None when none did."""
    ok = [m for m in result.measurements
          if m.kind == "gdsckpt" and m.status == "ok" and m.bit_exact and m.lossless and m.save_seconds]
    if engine is None:
        engine = "gpu" if any(m.engine == "gpu" for m in ok) else "cpu"
    candidates = [m for m in ok if m.engine == engine]
    if not candidates:
        return None
    fastest = max(m.save_gbps or 0.0 for m in candidates)
    tied = [m for m in candidates if (m.save_gbps or 0.0) >= fastest * (1 - SAVE_TIE)]
    best_ratio = max(m.ratio or 0.0 for m in tied)
    tied_ratio = [m for m in tied if (m.ratio or 0.0) >= best_ratio * (1 - RATIO_TIE)]
    chosen = max(tied_ratio, key=lambda m: m.load_gbps or 0.0)
    reason = (f"fastest durable save of {len(candidates)} lossless {engine}-engine configurations "
              f"({fastest:.3f} GB/s)")
    if len(tied) > 1:
        reason += (f"; {len(tied)} saved within {SAVE_TIE:.0%} of it (run-to-run noise), of which this one "
                   f"stores the fewest bytes (ratio {chosen.ratio:.3f})")
        if len(tied_ratio) > 1:
            reason += (f" and, among ratios within {RATIO_TIE:.0%}, loads fastest "
                       f"({chosen.load_gbps:.3f} GB/s)")

    raw_path = "raw-kvikio" if engine == "gpu" else "raw-posix"
    raws = [m for m in result.measurements if m.path == raw_path and m.status == "ok" and m.save_seconds]
    same = [m for m in raws if m.chunk_bytes == chosen.chunk_bytes and m.threads == chosen.threads]
    raw = same[0] if same else (max(raws, key=lambda m: m.save_gbps or 0.0) if raws else None)
    assert chosen.chunk_bytes is not None and chosen.threads is not None and chosen.codec is not None
    fields: dict[str, Any] = {"codec": chosen.codec}
    if engine == "gpu":
        fields.update(gpu_chunk_bytes=chosen.chunk_bytes, kvikio_threads=chosen.threads,
                      io_threads=chosen.threads, max_staging_bytes=chosen.inflight_bytes)
    else:
        fields.update(chunk_bytes=chosen.chunk_bytes, io_threads=chosen.threads,
                      max_inflight_bytes=chosen.inflight_bytes)
    if engine == "gpu" and chosen.codec not in PORTABLE_CODECS and chosen.codec != "auto":
        # a GPU-only codec (ANS, ...) under engine "auto" would send a state in host memory to the
        # CPU engine, which cannot encode it: with "gpu" every save compresses on the GPU
        fields["engine"] = "gpu"
    if raw is not None and raw.save_gbps:
        # what codec="auto" weighs compression against: the storage's durable write speed, as
        # measured here at the chosen block size and thread count
        fields["storage_gbps"] = round(raw.save_gbps, 3)
    return Recommendation(result.path, engine, fields, chosen, raw.save_gbps if raw else None,
                          raw.load_gbps if raw else None, reason)


def preset_toml(recommendation: Recommendation, report: BenchReport) -> str:
    """The recommendation as a TOML preset: flat top-level keys named like ``gdsckpt.Config``
    fields (sizes as ``"4MiB"`` strings), under a comment header saying where the figures came from."""
    m = recommendation.measurement
    target = next(t for t in report.targets if t.path == recommendation.target)
    fs = target.filesystem

    def clean(text: str) -> str:  # a comment ends at a newline: keep paths from starting new lines
        return text.replace("\n", " ").replace("\r", " ")

    lines = [
        "# gdsckpt configuration preset, written by `gdsckpt bench --recommend`",
        f"# date: {report.date}",
        f"# host: {clean(report.host.get('hostname') or '?')} ({clean(report.host.get('cpu_model') or '?')}, "
        f"{report.host.get('cpu_affinity') or report.host.get('cpu_count')} cores"
        + (f", {clean(report.host['gpu'])}" if report.host.get("gpu") else "") + f"), gdsckpt {__version__}",
        (f"# target: {clean(target.path)} ({fs['type']} on {clean(fs['device'])}, mounted at "
         f"{clean(fs['mount_point'])})"),
        (f"# data: {human_size(report.data['logical_bytes'])} synthetic bf16 + fp32 training state; durable "
         f"saves, cold loads, median of {report.settings.repeats}"),
        (f"# measured: {m.label}: save {m.save_gbps:.3f} GB/s, load {m.load_gbps:.3f} GB/s, "
         f"ratio {m.ratio:.3f}"),
    ]
    if recommendation.raw_write_gbps is not None:
        lines.append(f"# raw I/O on this target: write {recommendation.raw_write_gbps:.3f} GB/s, "
                     f"read {recommendation.raw_read_gbps or 0.0:.3f} GB/s (cold: {COLD_READ_METHOD}; a "
                     f"remote or virtual disk may still cache)")
    lines.append(f"# why: {clean(recommendation.reason)}")
    lines.append("# load with gdsckpt.Config.from_toml(path)")
    for name, value in recommendation.fields.items():
        if name.endswith("_bytes"):
            lines.append(f"{name} = {json.dumps(format_size(value))}")
        elif isinstance(value, str):
            lines.append(f"{name} = {json.dumps(value)}")
        else:
            lines.append(f"{name} = {value!r}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# plots

def target_slug(number: int, path: str) -> str:
    """A file-name-safe name for the ``number``-th target (``1-nvme``)."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", Path(path).name).strip("-") or "root"
    return f"{number}-{name}"


def write_plots(report: BenchReport, out_dir: str | os.PathLike[str]) -> list[Path]:
    """One PNG per target and engine: save and load GB/s by codec (groups) and chunk size (bars),
    each bar the best median over thread counts and depths, with raw I/O and the baselines as
    lines. Returns the files written; none (with a logged warning) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: no plots written (pip install 'gdsckpt[bench]')")
        return []
    written = []
    for number, target in enumerate(report.targets, 1):
        for engine in ("cpu", "gpu"):
            rows = [m for m in target.measurements if m.kind == "gdsckpt" and m.engine == engine
                    and m.status == "ok"]
            if not rows:
                continue
            device = rows[0].device
            others = [m for m in target.measurements if m.kind != "gdsckpt" and m.device == device
                      and m.status == "ok"]
            path = Path(out_dir) / f"bench-{target_slug(number, target.path)}-{engine}.png"
            figure = _plot_target(Figure(figsize=(11, 4.5)), target, engine, rows, others, report)
            figure.savefig(path, dpi=110)
            written.append(path)
    return written


def _plot_target(figure: Any, target: TargetResult, engine: str, rows: list[Measurement],
                 others: list[Measurement], report: BenchReport) -> Any:
    codecs = list(dict.fromkeys(m.codec for m in rows))
    chunks = sorted({m.chunk_bytes for m in rows if m.chunk_bytes})
    width = 0.8 / max(len(chunks), 1)
    # raw I/O is the ceiling (black, dashed); each baseline has its own colour (dotted)
    colours = {"torch": "tab:red", "safetensors": "tab:purple"}
    for axis, what in zip(figure.subplots(1, 2), ("save", "load")):
        for i, chunk in enumerate(chunks):
            values = []
            for codec in codecs:
                speeds = [getattr(m, f"{what}_gbps") or 0.0 for m in rows
                          if m.codec == codec and m.chunk_bytes == chunk]
                values.append(max(speeds, default=0.0))
            positions = [x + (i - (len(chunks) - 1) / 2) * width for x in range(len(codecs))]
            axis.bar(positions, values, width, label=f"{format_size(chunk)} chunks")
        for path in dict.fromkeys(m.path for m in others):
            best = max((getattr(m, f"{what}_gbps") or 0.0) for m in others if m.path == path)
            kind = next(m.kind for m in others if m.path == path)
            axis.axhline(best, linestyle="--" if kind == "raw" else ":", color=colours.get(path, "black"),
                         linewidth=1.2, label=f"{path} {best:.2f}")
        axis.set_xticks(range(len(codecs)))
        axis.set_xticklabels(codecs)
        axis.set_ylabel("GB/s (logical bytes)")
        axis.set_title(f"{'durable save' if what == 'save' else 'cold load'}")
        axis.legend(fontsize="small")
    figure.suptitle(f"{target.path} ({target.filesystem['type']}), {engine} engine, "
                    f"{human_size(report.data['logical_bytes'])}, median of {report.settings.repeats}; "
                    f"bars: best over threads and depths", fontsize="medium")
    figure.tight_layout()
    return figure
