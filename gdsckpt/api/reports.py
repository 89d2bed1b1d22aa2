"""Reports the public calls return: what a save wrote, what a file holds, what a verify checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SaveReport:
    """What a save did. ``ratio`` is logical bytes over bytes on disk (the whole file)."""

    path: str
    logical_bytes: int
    file_bytes: int
    """Length of the file written: chunks, their padding, header, index and trailer (what
    ``CheckpointInfo.file_bytes`` reports of it; ``VerifyReport.chunk_bytes`` counts the chunks'
    stored bytes alone)."""
    ratio: float
    seconds: float
    codec: str
    backend: str
    engine: str
    tensors: int
    chunks: int
    chains: dict[str, int] = field(default_factory=dict)
    """How many chunks used each codec chain, e.g. ``{"byteplanes/1+zstd/1": 12, "none/1": 1}``."""
    auto: dict[str, Any] = field(default_factory=dict)
    """For a save of CUDA state: ``engine`` and ``engine_reason``. For ``codec="auto"`` on the GPU:
    ``storage_gbps`` and ``sampled_ratios`` the choice used, ``chose``, and ``left_out`` (candidate
    -> why the staging budget ruled it out; with a single candidate left and no engines to weigh
    nothing is measured and ``storage_gbps`` is None). Where the engines were weighed (CUDA state
    of ``pipeline.autotune.WEIGH_MIN_BYTES`` or more): ``gpu_codec`` (the GPU's best),
    ``predicted_gbps`` (``"gpu:<codec>"`` and ``"cpu:zstd"``), ``cpu_codec_gbps``, ``cpu_threads``,
    ``cpu_ratio`` and ``margin``. On the CPU engine: ``chose`` (the codec: ``none`` when every chunk
    was stored as it is), ``adaptive`` (True) and ``stored_as_is``: the chunks stored uncompressed
    (``gdsckpt.pipeline.engine``, adaptive compression). A save of host state to a local file adds
    ``stored`` (``"compressed"`` or ``"as it is"``) and ``stored_reason``, and where the codec's
    pace was known, ``codec_gbps`` (the codec threads' predicted speed) and ``storage_gbps``
    (``gdsckpt.pipeline.host_auto``). A GPU save whose staging fits ``max_staging_bytes`` only with
    chunks smaller than ``gpu_chunk_bytes`` (nvCOMP's Zstd scratch under the default budget) adds
    ``chunk_bytes`` (the size it saved) and ``chunk_reason``."""
    base: str | None = None
    """The base checkpoint of a delta save (as the index records it), None for a full one."""
    delta_tensors: int = 0
    """Arrays stored as the XOR with the base."""
    lossy: tuple[str, ...] = ()
    """Keys of the arrays stored rounded to their error bound (``save(lossy=...)``)."""

    @property
    def throughput(self) -> float:
        """Logical bytes per second of wall time, durable writes included."""
        return self.logical_bytes / self.seconds if self.seconds > 0 else float("inf")

    @property
    def stored_bytes(self) -> int:
        """Deprecated name of ``file_bytes`` (``DeprecationWarning``)."""
        _renamed("SaveReport.stored_bytes", "file_bytes (the file's length)")
        return self.file_bytes


@dataclass(frozen=True)
class TensorInfo:
    """One array in a checkpoint, as ``inspect`` and ``open().info`` describe it."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    nbytes: int
    stored_bytes: int
    """Compressed bytes of the array: exact where its chunks hold nothing else, else an
    estimate (``stored_estimated``); 0 for an alias (stored once, under ``alias_of``)."""
    chunks: int
    codecs: tuple[str, ...]
    alias_of: str | None = None
    delta: bool = False
    """Stored as the XOR with the same array of the base checkpoint."""
    lossy: dict[str, Any] | None = None
    """For an array saved with ``save(lossy=...)``: ``{"mode", "rel_bound", "abs_bound",
    "max_error"}`` (its values are within ``abs_bound`` of the saved ones, not bit-exact)."""
    stored_estimated: bool = False
    """True when the array shares a chunk with other arrays (small arrays are packed together):
    a chunk is compressed as a whole, so ``stored_bytes`` is then the array's share of its chunks'
    stored bytes in proportion to its raw bytes, an estimate, and so is ``ratio``.
    ``CheckpointInfo.chunks`` has the exact figures per chunk."""
    ratio: float | None = None
    """``nbytes`` over stored bytes (from the unrounded share where estimated); None where nothing
    is stored: an alias, an array of no elements."""


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of a checkpoint as its index records it: exact figures."""

    offset: int
    stored_bytes: int
    raw_bytes: int
    codecs: str
    """The chunk's chain, e.g. ``"byteplanes/1+zstd/1"``."""
    arrays: tuple[tuple[str, int], ...]
    """(key, raw bytes of that array in this chunk) of every array the chunk holds, in order."""

    @property
    def ratio(self) -> float:
        """``raw_bytes / stored_bytes`` (1.0 for an empty chunk)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True)
class GroupInfo:
    """The arrays of one group (``CheckpointInfo.groups``) together."""

    arrays: int
    logical_bytes: int
    stored_bytes: int
    """Exact when no chunk of the group holds arrays of another group (``estimated`` False);
    else the chunks it shares count in proportion to the group's raw bytes in them."""
    estimated: bool

    @property
    def ratio(self) -> float | None:
        """``logical_bytes / stored_bytes``, None when the group stores nothing."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else None


@dataclass(frozen=True)
class CheckpointInfo:
    """Summary of a checkpoint file (``inspect``)."""

    path: str
    format_version: tuple[int, int]
    writer: str
    file_bytes: int
    logical_bytes: int
    ratio: float
    tensors: tuple[TensorInfo, ...]
    codecs: dict[str, int]
    base: dict[str, Any] | None = None
    """A delta checkpoint's base (path, index SHA-256, file length, chain depth); None if full."""
    gpu_only: tuple[str, ...] = ()
    """Bitstreams of the file that only a GPU decodes (nvCOMP's ANS, GDeflate, ...); empty when
    every chunk decodes on any machine."""
    chunks: tuple[ChunkInfo, ...] = ()
    """Every chunk, in file order, with its exact stored and raw bytes and the arrays it holds."""

    @property
    def portable(self) -> bool:
        """Whether every chunk decodes without a GPU."""
        return not self.gpu_only

    def groups(self, group_of: Callable[[str], str] | None = None) -> dict[str, GroupInfo]:
        """Arrays, logical and stored bytes per group of arrays, in first-seen order. ``group_of``
        maps a key to its group (default: the key's first part, ``"model"``, ``"optimizer"``;
        ``gdsckpt inspect`` groups an optimizer's state by name too). A chunk whose arrays all
        lie in one group counts whole, exactly, to that group; a chunk shared by several groups
        is split in proportion to their raw bytes in it, and makes their figures estimates.
        Aliases count for nothing (their array is stored once)."""
        name_of = group_of if group_of is not None else (lambda key: key.split("/", 1)[0])
        names = {t.key: name_of(t.key) for t in self.tensors}
        totals: dict[str, list[Any]] = {}
        for t in self.tensors:
            if t.alias_of is None:
                entry = totals.setdefault(names[t.key], [0, 0, 0.0, False])
                entry[0] += 1
                entry[1] += t.nbytes
        for chunk in self.chunks:
            shares: dict[str, int] = {}
            for key, length in chunk.arrays:
                shares[names[key]] = shares.get(names[key], 0) + length
            for name, length in shares.items():
                entry = totals[name]
                entry[2] += chunk.stored_bytes * length / chunk.raw_bytes if chunk.raw_bytes else 0
                entry[3] = entry[3] or len(shares) > 1
        return {name: GroupInfo(arrays, logical, round(stored), estimated)
                for name, (arrays, logical, stored, estimated) in totals.items()}


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of ``verify``: every chunk was read, checksummed and decoded."""

    path: str
    chunks: int
    chunk_bytes: int
    """Stored (compressed) bytes of the chunks read and checked, padding and index not counted:
    less than the file's length (``SaveReport.file_bytes``, ``CheckpointInfo.file_bytes``)."""
    logical_bytes: int
    seconds: float
    bases: tuple[str, ...] = ()
    """A delta's chain of bases, nearest first, each checked to be present and unchanged (and,
    with ``verify(chain=True)``, verified chunk by chunk too)."""

    @property
    def stored_bytes(self) -> int:
        """Deprecated name of ``chunk_bytes`` (``DeprecationWarning``)."""
        _renamed("VerifyReport.stored_bytes", "chunk_bytes (the chunks' stored bytes)")
        return self.chunk_bytes


def _renamed(old: str, new: str) -> None:
    # Both reports called a different figure stored_bytes (the file vs its chunks): each has a
    # name of its own now, and the old one still answers for a while.
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


def chain_label(chain: list[dict[str, Any]]) -> str:
    """A chain as text: stage names joined by ``+`` (``"byteplanes/1+zstd/1"``)."""
    return "+".join(stage["name"] for stage in chain)


Progress = Callable[[int, int], None]
"""``progress(done, total)``: raw bytes written (save) or decoded (load, verify) so far, out of
``total``; called in the calling thread after each chunk."""
