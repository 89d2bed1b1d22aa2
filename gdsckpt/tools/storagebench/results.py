"""The benchmark's settings and results (one JSON schema), and how sizes are written and read.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ...codecs import known_codec_names
from ...codecs.nvcomp import MAX_CHUNK_BYTES
from ...config import Config, default_io_threads
from ...version import __version__

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

def default_thread_counts() -> tuple[int, ...]:
    """The I/O thread counts swept unless told: the configuration's default (min(8, cores)) and 16."""
    return tuple(sorted({default_io_threads(), 16}))


@dataclass(frozen=True)
class BenchSettings:
    """What to measure. ``depths`` entries of None mean the config's own budgets
    (``max_inflight_bytes`` / ``max_staging_bytes``); an int ``d`` sets both to ``d`` x chunk size."""

    size_bytes: int = GIB
    codecs: tuple[str, ...] = DEFAULT_CODECS
    chunk_sizes: tuple[int, ...] = (4 * MIB, 16 * MIB)
    threads: tuple[int, ...] = field(default_factory=lambda: default_thread_counts())
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
        if self.max_seconds is not None and not 0 < self.max_seconds < math.inf:
            raise ValueError(f"max_seconds must be a finite number > 0, got {self.max_seconds}")
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
    """``raw-posix``, ``raw-kvikio``, ``gdsckpt``, ``gdsckpt-null`` (the null sink and source),
    ``torch`` or ``safetensors``."""
    kind: str
    """``raw``, ``gdsckpt``, ``null`` or ``baseline``."""
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
    warm_load_seconds: list[float] = field(default_factory=list)
    """The load repeated right after the cold one, the file now in the page cache."""
    bit_exact: bool | None = None
    """Every load came back bit-identical to what was saved (None: nothing was loaded)."""
    backend: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def save_gbps(self) -> float | None:
        """Logical GB over the median save time (durable); None for a failed configuration."""
        return self._median_gbps(self.save_seconds)

    @property
    def load_gbps(self) -> float | None:
        """Logical GB over the median load time (cold); None for a failed configuration."""
        return self._median_gbps(self.load_seconds)

    @property
    def warm_load_gbps(self) -> float | None:
        """Logical GB over the median warm load time (the file in the page cache); None for a
        failed configuration."""
        return self._median_gbps(self.warm_load_seconds)

    def _median_gbps(self, seconds: list[float]) -> float | None:
        # A configuration that failed in a later repeat keeps its earlier repeats' seconds (in the
        # JSON, as measured) but has no figure: a median of the repeats that happened to finish
        # would stand in the table beside "failed" as if the configuration delivered it.
        return None if self.status == "failed" else _gbps(self.logical_bytes, seconds)

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
        doc.update(save_gbps=self.save_gbps, load_gbps=self.load_gbps, warm_load_gbps=self.warm_load_gbps,
                   ratio=self.ratio)
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
    baselines_faster: list[str] = field(default_factory=list)
    """One sentence per baseline (torch.save / torch.load, safetensors) that saved or loaded faster
    on this target than the recommendation, with the measured figures and why that happens."""

    def to_json(self) -> dict[str, Any]:
        """The choice, its figures and why."""
        m = self.measurement
        return {"engine": self.engine, "fields": dict(self.fields), "reason": self.reason,
                "baselines_faster": list(self.baselines_faster),
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
                 "null_cpu": ("gdsckpt-null", "cpu"), "null_gpu": ("gdsckpt-null", "gpu"),
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
                "method": {"save": "durable: fsync of the file and of its directory (gdsckpt after its "
                                   "atomic rename) inside the timing, every side",
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
