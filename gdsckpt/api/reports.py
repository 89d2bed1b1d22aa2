"""Reports the public calls return: what a save wrote, what a file holds, what a verify checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SaveReport:
    """What a save did. ``ratio`` is logical bytes over bytes on disk (the whole file)."""

    path: str
    logical_bytes: int
    stored_bytes: int
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
    """For ``codec="auto"`` on the GPU: ``storage_gbps`` and ``sampled_ratios`` the choice used,
    ``chose``, and ``left_out`` (candidate -> why the staging budget ruled it out; with a single
    candidate left nothing is measured and ``storage_gbps`` is None). On the CPU: ``chose`` (the
    codec), ``adaptive`` (True) and ``stored_as_is``: the chunks stored uncompressed because the
    storage was waiting for the codec threads (``gdsckpt.pipeline.engine``, adaptive compression)."""
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
    chunks: int
    codecs: tuple[str, ...]
    alias_of: str | None = None
    delta: bool = False
    """Stored as the XOR with the same array of the base checkpoint."""
    lossy: dict[str, Any] | None = None
    """For an array saved with ``save(lossy=...)``: ``{"mode", "rel_bound", "abs_bound",
    "max_error"}`` (its values are within ``abs_bound`` of the saved ones, not bit-exact)."""


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

    @property
    def portable(self) -> bool:
        """Whether every chunk decodes without a GPU."""
        return not self.gpu_only


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of ``verify``: every chunk was read, checksummed and decoded."""

    path: str
    chunks: int
    stored_bytes: int
    logical_bytes: int
    seconds: float
    bases: tuple[str, ...] = ()
    """A delta's chain of bases, nearest first, each checked to be present and unchanged (and,
    with ``verify(chain=True)``, verified chunk by chunk too)."""


def chain_label(chain: list[dict[str, Any]]) -> str:
    """A chain as text: stage names joined by ``+`` (``"byteplanes/1+zstd/1"``)."""
    return "+".join(stage["name"] for stage in chain)


Progress = Callable[[int, int], None]
"""``progress(done, total)``: raw bytes written (save) or decoded (load, verify) so far, out of
``total``; called in the calling thread after each chunk."""
