"""Storage backends: POSIX files, an in-memory store, a null sink and a null source (kvikio in
``io.kvikio``, S3 objects in ``io.s3``)."""

from .base import StorageReader, StorageWriter, aligned_empty
from .memory import MemoryReader, MemoryStore, MemoryWriter, NullWriter, PreloadedReader
from .posix import PosixReader, PosixWriter, remove_stale_temporaries

__all__ = [
    "MemoryReader", "MemoryStore", "MemoryWriter", "NullWriter", "PosixReader", "PosixWriter", "PreloadedReader",
    "StorageReader", "StorageWriter", "aligned_empty", "remove_stale_temporaries",
]
