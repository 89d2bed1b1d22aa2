"""Storage backends: POSIX files, an in-memory store and a null sink (kvikio in ``io.kvikio``)."""

from .base import StorageReader, StorageWriter, aligned_empty
from .memory import MemoryReader, MemoryStore, MemoryWriter, NullWriter
from .posix import PosixReader, PosixWriter, remove_stale_temporaries

__all__ = [
    "MemoryReader", "MemoryStore", "MemoryWriter", "NullWriter", "PosixReader", "PosixWriter",
    "StorageReader", "StorageWriter", "aligned_empty", "remove_stale_temporaries",
]
