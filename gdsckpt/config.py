"""Configuration: every knob of a save or load, with its default.

Precedence, highest first: an argument of ``save``/``load`` > a ``Config`` passed as ``config=``
> a ``GDSCKPT_<FIELD>`` environment variable (e.g. ``GDSCKPT_CHUNK_BYTES=8MiB``) > the default.

| field | default | meaning |
|---|---|---|
| codec | ``"auto"`` | ``auto`` (CPU: byte planes + zstd), ``zstd``, ``lz4``, ``deflate``, ``none`` |
| chunk_bytes | 4 MiB | uncompressed bytes per chunk on the CPU engine (multiple of 4096) |
| gpu_chunk_bytes | 16 MiB | the same on the GPU engine (nvCOMP's RAW maximum; the GPU pipeline into a null sink ran at 55 GB/s with 16 MiB chunks against 18-33 with 4 MiB on the H200) |
| pack_below | 1 MiB | arrays smaller than this share chunks |
| byte_planes | ``"auto"`` | ``auto`` (per array, kept where it compresses better), ``always``, ``never`` |
| level | ``None`` | compression level for zstd/deflate (None: the engine's default; CPU: zstd 1, deflate 6) |
| codec_threads | 0 | CPU threads for codecs (0: one per core) |
| io_threads | 8 | threads issuing reads and writes |
| max_inflight_bytes | 256 MiB | bound on chunk bytes between read/encode and write/decode |
| o_direct | ``"auto"`` | O_DIRECT for aligned chunk writes: ``auto`` (where the filesystem allows), true, false. Reads stay buffered: measured, O_DIRECT reads did not speed cold loads and slowed warm ones |
| fsync | True | fsync the file and its directory before a save returns |
| timeout | 600 | seconds any single wait on a worker may take before failing the operation |
| engine | ``"auto"`` | ``auto`` (GPU when the state has CUDA arrays and nvCOMP is usable), ``cpu``, ``gpu`` |
| max_staging_bytes | 1 GiB | GPU staging ring of a save or restore (chunks being compressed / read and decoded), allocated once per operation |
| snapshot_gpu_bytes | 1 GiB | ``save_async``: a state whose CUDA tensors hold at most this many bytes is snapshotted by a copy on its GPU (kept in the snapshot pool between saves); a larger one into pinned host memory |
| kvikio_threads | 16 | kvikio thread pool size (GPU engine) |
| kvikio_task_size | None | kvikio task size in bytes (None: kvikio's default) |
| storage_gbps | None | storage write speed for ``codec="auto"`` on the GPU (None: measured once per filesystem and cached) |
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """Parse a byte size: an int, or a string like ``"4MiB"``, ``"512k"``, ``"1G"`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"not a byte size: {value!r} (examples: 4194304, '4MiB', '512k')")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


_CHOICES = {
    "byte_planes": ("auto", "always", "never"),
    "engine": ("auto", "cpu", "gpu"),
}


@dataclass(frozen=True)
class Config:
    """Options of save and load. Immutable; ``replace(**changes)`` derives a modified copy."""

    codec: str = "auto"
    chunk_bytes: int = 4 << 20
    gpu_chunk_bytes: int = 16 << 20
    pack_below: int = 1 << 20
    byte_planes: str = "auto"
    level: int | None = None
    codec_threads: int = 0
    io_threads: int = 8
    max_inflight_bytes: int = 256 << 20
    o_direct: bool | str = "auto"
    fsync: bool = True
    timeout: float = 600.0
    engine: str = "auto"
    max_staging_bytes: int = 1 << 30
    snapshot_gpu_bytes: int = 1 << 30
    kvikio_threads: int = 16
    kvikio_task_size: int | None = None
    storage_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "gpu_chunk_bytes", "pack_below", "max_inflight_bytes", "max_staging_bytes",
                     "snapshot_gpu_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096 or self.chunk_bytes > 1 << 30:
            raise ValueError(f"chunk_bytes must be a multiple of 4096 between 4 KiB and 1 GiB, "
                             f"got {self.chunk_bytes}")
        if self.gpu_chunk_bytes <= 0 or self.gpu_chunk_bytes % 4096 or self.gpu_chunk_bytes > 16 << 20:
            raise ValueError(f"gpu_chunk_bytes must be a multiple of 4096 between 4 KiB and 16 MiB "
                             f"(nvCOMP's largest chunk), got {self.gpu_chunk_bytes}")
        if self.max_inflight_bytes < self.chunk_bytes:
            raise ValueError(f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least "
                             f"chunk_bytes ({self.chunk_bytes})")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid (expected one of: "
                                 f"{', '.join(choices)})")
        if self.o_direct not in ("auto", True, False):
            raise ValueError(f"o_direct={self.o_direct!r} is invalid (expected one of: auto, True, False)")
        if self.max_staging_bytes <= 0 or self.snapshot_gpu_bytes < 0:
            raise ValueError(f"max_staging_bytes must be > 0 and snapshot_gpu_bytes >= 0, got "
                             f"{self.max_staging_bytes} and {self.snapshot_gpu_bytes}")
        if self.io_threads < 1 or self.codec_threads < 0:
            raise ValueError("io_threads must be >= 1 and codec_threads >= 0")

    @property
    def effective_codec_threads(self) -> int:
        """``codec_threads``, with 0 meaning one per available core."""
        if self.codec_threads:
            return self.codec_threads
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Config:
        """Defaults overridden by ``GDSCKPT_<FIELD>`` environment variables."""
        environ = dict(os.environ if environ is None else environ)
        changes: dict[str, Any] = {}
        for f in fields(cls):
            text = environ.get(f"GDSCKPT_{f.name.upper()}")
            if text is None:
                continue
            changes[f.name] = _coerce(f.name, text)
        return cls(**changes)


def _coerce(name: str, text: str) -> Any:
    if name in ("chunk_bytes", "gpu_chunk_bytes", "pack_below", "max_inflight_bytes", "max_staging_bytes",
                "snapshot_gpu_bytes"):
        return parse_size(text)
    if name in ("codec_threads", "io_threads", "kvikio_threads"):
        return int(text)
    if name == "kvikio_task_size":
        return None if text.lower() in ("", "none") else parse_size(text)
    if name == "level":
        return None if text.lower() in ("", "none") else int(text)
    if name == "timeout":
        return float(text)
    if name == "storage_gbps":
        return None if text.lower() in ("", "none") else float(text)
    if name in ("fsync", "o_direct"):
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        if name == "o_direct" and lowered == "auto":
            return "auto"
        raise ValueError(f"GDSCKPT_{name.upper()}={text!r} is not a boolean")
    return text
