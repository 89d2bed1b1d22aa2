"""Byte layout of format v1: the header at offset 0 and the trailer in the last 64 bytes.

docs/format.md is normative; this module mirrors its byte tables. Pure Python.

::

    [0, 4096)                  header (64 meaningful bytes, then zeros)
    [4096, index_offset)       chunks, each starting at a multiple of ALIGNMENT, zero padded
    [index_offset, +length)    index: UTF-8 JSON (see index.py)
    [file_size - 64, size)     trailer
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import CorruptCheckpointError, NewerFormatError, UnsupportedFormatError
from .checksum import checksum

MAGIC = b"\x93GDSCKPT"
TRAILER_MAGIC = b"GDSCKIDX"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
ALIGNMENT = 4096
"""Every chunk starts at a multiple of this; it is also the size of the header region."""
HEADER_REGION = 4096
HEADER_SIZE = 64
TRAILER_SIZE = 64
MAX_INDEX_BYTES = 1 << 30
"""Readers refuse an index larger than this before reading it (1 GiB, ~10 million chunks)."""

# magic, major, minor, header_region, alignment, flags, 36 reserved bytes, crc32c
_HEADER = struct.Struct("<8sHHIII36sI")
# magic, major, minor, flags, index_offset, index_length, index_crc, reserved, file_length,
# 12 reserved bytes, crc32c
_TRAILER = struct.Struct("<8sHHIQQII Q12sI".replace(" ", ""))
assert _HEADER.size == HEADER_SIZE and _TRAILER.size == TRAILER_SIZE


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment


def pack_header(minor: int = FORMAT_MINOR) -> bytes:
    """The 4096-byte header region a v1 writer puts at offset 0 (``minor``: the file's minor
    version, 1 for a file that uses a 1.1 addition such as a delta base)."""
    body = _HEADER.pack(MAGIC, FORMAT_MAJOR, minor, HEADER_REGION, ALIGNMENT, 0, bytes(36), 0)
    crc = checksum(body[:60])
    return body[:60] + struct.pack("<I", crc) + bytes(HEADER_REGION - HEADER_SIZE)


@dataclass(frozen=True)
class Header:
    """The decoded header."""

    major: int
    minor: int
    alignment: int


def _check_major(major: int, minor: int, intact: bool = False) -> None:
    """Refuse a file of another major version (docs/format.md, "Versioning"): a higher one in a
    header whose checksum holds (``intact``) is a newer gdsckpt's file (``NewerFormatError``)."""
    if major != FORMAT_MAJOR:
        raise (NewerFormatError if intact and major > FORMAT_MAJOR else UnsupportedFormatError)(
            f"checkpoint format version {major}.{minor} is not supported by this reader "
            f"(it reads major version {FORMAT_MAJOR}); upgrade gdsckpt"
        )


def foreign_hint(data: bytes) -> str:
    """What a file that is no gdsckpt checkpoint looks like, from its first bytes, and how to read
    it (``""`` where it looks like nothing known): the formats a user most often hands a loader
    by mistake."""
    convert = "or convert it with 'gdsckpt convert IN OUT.gdsckpt'"
    if data[:4] == b"PK\x03\x04":
        return f": it is a zip archive, as torch.save writes: load it with torch.load, {convert}"
    if data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return f": it is a pickle, as the legacy torch.save writes: load it with torch.load, {convert}"
    if len(data) >= 9 and data[8:9] == b"{" and 1 < int.from_bytes(data[:8], "little") < 1 << 27:
        return f": it is a safetensors file: load it with safetensors, {convert}"
    return ""


def unpack_header(data: bytes) -> Header:
    """Decode and validate the first 64 bytes of a file.

    Raises ``UnsupportedFormatError`` for a foreign file or an unknown major version, and
    ``CorruptCheckpointError`` for a header that fails its checksum.
    """
    if len(data) < HEADER_SIZE or data[:8] != MAGIC:
        raise UnsupportedFormatError(f"not a gdsckpt checkpoint (bad magic number at offset 0){foreign_hint(data)}")
    _magic, major, minor, region, alignment, _flags, _reserved, crc = _HEADER.unpack(data[:HEADER_SIZE])
    intact = checksum(data[:60]) == crc
    _check_major(major, minor, intact)
    if not intact:
        raise CorruptCheckpointError("header checksum mismatch")
    if region != HEADER_REGION or alignment != ALIGNMENT:
        raise CorruptCheckpointError(f"header declares region {region} / alignment {alignment}, expected 4096")
    return Header(major, minor, alignment)


@dataclass(frozen=True)
class Trailer:
    """The decoded trailer: where the index is and how to check it."""

    major: int
    minor: int
    index_offset: int
    index_length: int
    index_crc: int
    file_length: int


def pack_trailer(index_offset: int, index_length: int, index_crc: int, minor: int = FORMAT_MINOR) -> bytes:
    """The 64-byte trailer that ends every v1 file."""
    file_length = index_offset + index_length + TRAILER_SIZE
    body = _TRAILER.pack(
        TRAILER_MAGIC, FORMAT_MAJOR, minor, 0, index_offset, index_length, index_crc, 0,
        file_length, bytes(12), 0,
    )
    return body[:60] + struct.pack("<I", checksum(body[:60]))


def unpack_trailer(data: bytes, file_size: int) -> Trailer:
    """Decode and validate the last 64 bytes of a file of ``file_size`` bytes.

    Checks, before anything is allocated from it: magic, version, checksum, that the file length
    matches (catching truncation and appended bytes) and that the index lies between the header
    region and the trailer and is at most ``MAX_INDEX_BYTES``.
    """
    if file_size < HEADER_REGION + TRAILER_SIZE:
        raise CorruptCheckpointError(
            f"file is {file_size} bytes, shorter than the smallest checkpoint "
            f"({HEADER_REGION + TRAILER_SIZE}): truncated"
        )
    if len(data) != TRAILER_SIZE or data[:8] != TRAILER_MAGIC:
        raise CorruptCheckpointError("no trailer at the end of the file: truncated, not fully written, or followed by "
                                     "other bytes (a checkpoint ends with its trailer)")
    (_magic, major, minor, _flags, index_offset, index_length, index_crc, _r, file_length, _r2,
     crc) = _TRAILER.unpack(data)
    _check_major(major, minor)
    if checksum(data[:60]) != crc:
        raise CorruptCheckpointError("trailer checksum mismatch")
    if file_length != file_size:
        raise CorruptCheckpointError(
            f"file is {file_size} bytes but its trailer records {file_length}: truncated or appended to "
            f"(a checkpoint ends its file, or the stream it is read from)"
        )
    if (index_offset < HEADER_REGION or index_offset % ALIGNMENT
            or index_offset + index_length + TRAILER_SIZE != file_size):
        raise CorruptCheckpointError(
            f"trailer places the index at [{index_offset}, +{index_length}) which is not inside the file"
        )
    if index_length > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"index of {index_length} bytes exceeds the {MAX_INDEX_BYTES}-byte cap")
    return Trailer(major, minor, index_offset, index_length, index_crc, file_length)
