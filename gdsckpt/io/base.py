"""Storage backends behind one submit/wait interface.

The save pipeline talks to a ``StorageWriter`` and the restore pipeline to a ``StorageReader``;
POSIX files, kvikio/cuFile, an in-memory store and a null sink are interchangeable
implementations. Call order for a writer (the pipeline keeps it):

1. ``submit_write(offset, buffer)`` any number of times, from one thread, for disjoint ranges;
   each returns a ``Future`` that completes when the bytes are handed to the storage. The buffer
   must stay alive and unchanged until that future is done.
2. ``write_tail(offset, data)`` once, after every submitted write has completed: the index and the
   trailer (small, host bytes).
3. ``commit()`` to make the file durable and visible at its target path atomically, or ``abort()``
   to discard it. After either, the writer is closed. ``abort()`` is safe to call at any point and
   more than once.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.layout import ALIGNMENT


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """A uint8 numpy array of ``nbytes`` whose data pointer is a multiple of ``alignment``.

    O_DIRECT and cuFile need aligned host buffers; numpy's allocator only guarantees 16 bytes.
    """
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


class StorageWriter(ABC):
    """Where a checkpoint's bytes go. See the module docstring for the call order."""

    name: str = "abstract"
    """Reported as ``SaveReport.backend`` (e.g. ``"posix+odirect+writeback"``, ``"kvikio-compat"``)."""
    stalled: bool = False
    """Set by a save whose wait for one of this writer's writes outlasted ``Config.timeout``:
    ``abort`` then does not wait another timeout for that write (it keeps its file open), so the
    save fails once, with its error naming the chunk."""

    @abstractmethod
    def submit_write(self, offset: int, data: Any) -> Future[None]:
        """Start writing ``data`` (a contiguous buffer this backend accepts) at ``offset``."""

    @abstractmethod
    def write_tail(self, offset: int, data: bytes) -> None:
        """Write the final bytes (index and trailer) synchronously."""

    @abstractmethod
    def commit(self) -> None:
        """Make the complete file durable and visible at the target path, atomically."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; the target path is left as it was."""

    def backlog(self) -> int | None:
        """Writes submitted and not finished yet, where the backend can tell (None: it cannot).
        0 while chunks are still coming means the storage waits for the encoder: ``codec="auto"``
        on the CPU then compresses a chunk only where that saves more write time than it takes
        (``HostEngine``)."""
        return None

    def pace(self) -> WritePace | None:
        """The bytes of the writes submitted and not finished, and the speed the writes have
        reached, where the backend can tell (None: it cannot). ``HostEngine``'s adaptive
        ``codec="auto"`` weighs them against its codec's speed."""
        return None


@dataclass(frozen=True)
class WritePace:
    """What a ``StorageWriter`` measured of its storage (``StorageWriter.pace``)."""

    pending_bytes: int
    """Bytes submitted and not on storage yet."""
    bytes_per_second: float | None
    """Bytes written per second while writes were running (None before any finished; ``inf``
    for a writer whose writes cost nothing, the null sink)."""


class StorageReader(ABC):
    """Where a checkpoint's bytes come from."""

    name: str = "abstract"
    size: int
    stalled: bool = False
    """Set by a restore whose wait for one of this reader's reads outlasted ``Config.timeout``:
    ``close`` then does not wait another timeout for that read nor raise (the read keeps its file
    open and its buffer referenced), so the restore fails once, with its error naming the chunk."""

    @abstractmethod
    def read(self, offset: int, length: int) -> bytes:
        """Read exactly ``length`` bytes synchronously (header, trailer, index)."""

    @abstractmethod
    def submit_read(self, offset: int, out: np.ndarray) -> Future[np.ndarray]:
        """Start reading ``out.nbytes`` bytes at ``offset`` into the host array ``out``."""

    @abstractmethod
    def close(self) -> None:
        """Release the file and threads."""

    def file_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the open file, or None where the reader has no file (in memory): two
        readers of one path read the same bytes only if these match."""
        return None

    def __enter__(self) -> StorageReader:
        return self

    def __exit__(self, exc_type: object, error: BaseException | None, traceback: object) -> None:
        if error is None:
            self.close()
            return
        # Closing after a failure never replaces the failure's error (a corrupt chunk named, say)
        # with the close's own timeout for a read still running elsewhere.
        with contextlib.suppress(TimeoutError):
            self.close()
