"""On-disk format v1 (normative text: docs/format.md). Pure Python: no torch, numpy or GPU imports."""

from .checksum import CHECKSUM_ALGORITHM, checksum
from .dtypes import DTYPES, DtypeSpec, dtype_spec
from .index import XOR_BASE, ChunkRecord, Index, Segment, TensorRecord, parse_index
from .layout import (
    ALIGNMENT,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HEADER_REGION,
    HEADER_SIZE,
    MAGIC,
    TRAILER_SIZE,
    Header,
    Trailer,
    align_up,
    pack_header,
    pack_trailer,
    unpack_header,
    unpack_trailer,
)

__all__ = [
    "ALIGNMENT",
    "CHECKSUM_ALGORITHM",
    "DTYPES",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "HEADER_REGION",
    "HEADER_SIZE",
    "MAGIC",
    "TRAILER_SIZE",
    "XOR_BASE",
    "ChunkRecord",
    "DtypeSpec",
    "Header",
    "Index",
    "Segment",
    "TensorRecord",
    "Trailer",
    "align_up",
    "checksum",
    "dtype_spec",
    "pack_header",
    "pack_trailer",
    "parse_index",
    "unpack_header",
    "unpack_trailer",
]
