"""An independent implementation of format v1, written from docs/format.md, for the format tests.

Nothing here imports gdsckpt: the header and trailer are parsed with ``struct``, checksums come
from a table-driven pure-Python CRC-32C (cross-checked against the ``crc32c`` package), chunks are
decoded with the codec libraries the spec names and a byte-plane inverse written from the spec's
definition, and the structure tree is walked by the spec's rules. When this module and the library
agree on the golden files, the spec describes what the code does.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c_package

MAGIC = b"\x93GDSCKPT"
TRAILER_MAGIC = b"GDSCKIDX"
HEADER = struct.Struct("<8sHHIII36sI")           # docs/format.md, "Header"
TRAILER = struct.Struct("<8sHHIQQII Q12sI".replace(" ", ""))  # docs/format.md, "Trailer"
ALIGNMENT = 4096
HEADER_REGION = 4096

# dtype name -> (itemsize, byte-plane width); docs/format.md, "Dtypes"
DTYPES = {
    "bool": (1, 0), "uint8": (1, 0), "int8": (1, 0), "uint16": (2, 0), "int16": (2, 0),
    "uint32": (4, 0), "int32": (4, 0), "uint64": (8, 0), "int64": (8, 0),
    "float8_e4m3fn": (1, 0), "float8_e5m2": (1, 0), "float8_e4m3fnuz": (1, 0),
    "float8_e5m2fnuz": (1, 0), "float8_e8m0fnu": (1, 0), "float16": (2, 2), "bfloat16": (2, 2),
    "float32": (4, 4), "float64": (8, 8), "complex32": (4, 2), "complex64": (8, 4),
    "complex128": (16, 8),
}

# ---------------------------------------------------------------------------------------------
# CRC-32C

CRC32C_POLY_REFLECTED = 0x82F63B78


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (CRC32C_POLY_REFLECTED if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _table()


def crc32c_pure(data: bytes, crc: int = 0) -> int:
    """CRC-32C by the spec's definition (reflected, init and xorout 0xFFFFFFFF); ``crc``
    continues a previous value like the library's ``checksum(data, value)``."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ _TABLE[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def crc32c_fast(data: Any) -> int:
    """CRC-32C through the ``crc32c`` package (hardware accelerated), for chunk bodies."""
    return int(_crc32c_package.crc32c(bytes(data)))


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``: zlib's ``crc32_combine``
    (GF(2) matrix powers of the one-zero-bit operator) with the Castagnoli polynomial. This is
    how a GPU that checksums a chunk in independent blocks gets the one value the index stores."""
    if len2 <= 0:
        return crc1
    odd = [CRC32C_POLY_REFLECTED] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # 8, 32, 128 ... zero bits
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


# ---------------------------------------------------------------------------------------------
# file parsing


def align_up(value: int) -> int:
    return -(-value // ALIGNMENT) * ALIGNMENT


@dataclass
class ParsedFile:
    header: dict[str, Any]
    trailer: dict[str, Any]
    index_bytes: bytes
    index: dict[str, Any]


def parse_header(data: bytes) -> dict[str, Any]:
    magic, major, minor, region, alignment, flags, reserved, crc = HEADER.unpack(data[:64])
    return {"magic": magic, "major": major, "minor": minor, "header_region": region,
            "alignment": alignment, "flags": flags, "reserved": reserved, "crc": crc}


def parse_trailer(data: bytes) -> dict[str, Any]:
    (magic, major, minor, flags, index_offset, index_length, index_crc, reserved1, file_length,
     reserved2, crc) = TRAILER.unpack(data[-64:])
    return {"magic": magic, "major": major, "minor": minor, "flags": flags, "index_offset": index_offset,
            "index_length": index_length, "index_crc": index_crc, "reserved1": reserved1,
            "file_length": file_length, "reserved2": reserved2, "crc": crc}


def parse_file(data: bytes) -> ParsedFile:
    """Header, trailer and index of a v1 file, each checked against its checksum."""
    header = parse_header(data)
    assert header["magic"] == MAGIC and header["major"] == 1
    assert crc32c_pure(data[:60]) == header["crc"]
    trailer = parse_trailer(data)
    assert trailer["magic"] == TRAILER_MAGIC and trailer["major"] == 1
    assert crc32c_pure(data[-64:-4]) == trailer["crc"]
    assert trailer["file_length"] == len(data)
    start, length = trailer["index_offset"], trailer["index_length"]
    assert start + length + 64 == len(data)
    index_bytes = data[start:start + length]
    assert crc32c_pure(index_bytes) == trailer["index_crc"]
    return ParsedFile(header, trailer, index_bytes, json.loads(index_bytes.decode("utf-8")))


# ---------------------------------------------------------------------------------------------
# chunk decoding


def byteplanes_forward(data: bytes, width: int) -> bytes:
    """Output byte ``p * n + i`` is byte ``width - 1 - p`` of element ``i`` (n = len / width):
    the most significant byte of every element first, then the next, ... the least last."""
    n = len(data) // width
    return bytes(data[i * width + (width - 1 - p)] for p in range(width) for i in range(n))


def byteplanes_inverse(data: bytes, width: int) -> bytes:
    """Undo ``byteplanes_forward``: byte ``j`` of element ``i`` is input byte ``(width-1-j) * n + i``."""
    n = len(data) // width
    return bytes(data[(width - 1 - j) * n + i] for i in range(n) for j in range(width))


def decode_stage(name: str, stored: bytes, raw_length: int) -> bytes:
    if name == "none/1":
        return stored
    if name == "zstd/1":
        import zstandard

        return zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_length)
    if name == "lz4/1":
        import lz4.block

        return lz4.block.decompress(stored, uncompressed_size=raw_length) if raw_length else b""
    if name == "deflate/1":
        return zlib.decompressobj(-15).decompress(stored)
    raise ValueError(f"codec {name} not implemented by the spec reader")


def decode_chunk(data: bytes, doc: dict[str, Any], number: int) -> bytes:
    offset, stored, raw, crc, chain_id = doc["chunks"][number]
    body = data[offset:offset + stored]
    assert crc32c_fast(body) == crc, f"chunk {number} checksum"
    chain = doc["chains"][chain_id]
    out = decode_stage(chain[-1]["name"], body, raw)
    for stage in reversed(chain[:-1]):
        assert stage["name"] == "byteplanes/1", stage
        out = byteplanes_inverse(out, stage["width"])
    assert len(out) == raw, f"chunk {number} decoded to {len(out)} bytes, not {raw}"
    return out


def tensor_bytes(data: bytes, doc: dict[str, Any]) -> dict[str, bytes]:
    """key -> element bytes (C order, little-endian) of every tensor, aliases resolved."""
    raws = [decode_chunk(data, doc, i) for i in range(len(doc["chunks"]))]
    out: dict[str, bytes] = {}
    records = doc["tensors"]
    for record in records:
        source = records[record["alias"]] if "alias" in record else record
        out[record["key"]] = b"".join(raws[c][o:o + n] for c, o, n in source["segments"])
    return out


# ---------------------------------------------------------------------------------------------
# the structure tree


def decode_scalar(node: dict[str, Any]) -> Any:
    t = node["t"]
    if t == "none":
        return None
    if t == "bool":
        return node["v"]
    if t == "int":
        return int(node["v"])
    if t == "float":
        return struct.unpack(">d", bytes.fromhex(node["v"]))[0]
    assert t == "str"
    return node["v"]


def key_component(value: Any) -> str:
    """docs/format.md, "Key paths": the text of one path component, JSON-Pointer escaped."""
    if value is None:
        text = "None"
    elif isinstance(value, bool):
        text = "True" if value else "False"
    elif isinstance(value, float):
        text = repr(value)  # shortest round-trip form: "2.5", "1e+16", "inf", "nan"
    else:
        text = str(value)
    return text.replace("~", "~0").replace("/", "~1")


def tensor_paths(tree: dict[str, Any]) -> dict[int, str]:
    """tensor id -> key path of its node."""
    found: dict[int, str] = {}
    stack: list[tuple[dict[str, Any], list[str]]] = [(tree, [])]
    while stack:
        node, path = stack.pop()
        if node["t"] == "tensor":
            found[node["id"]] = "/".join(path)
        elif node["t"] in ("list", "tuple"):
            stack.extend((child, path + [str(i)]) for i, child in enumerate(node["items"]))
        elif node["t"] == "dict":
            stack.extend((child, path + [key_component(decode_scalar(k))]) for k, child in node["items"])
    return found


def plain_values(tree: dict[str, Any]) -> dict[str, Any]:
    """key path -> decoded value of every scalar node outside dict keys and meta."""
    found: dict[str, Any] = {}
    stack: list[tuple[dict[str, Any], list[str]]] = [(tree, [])]
    while stack:
        node, path = stack.pop()
        if node["t"] in ("list", "tuple"):
            stack.extend((child, path + [str(i)]) for i, child in enumerate(node["items"]))
        elif node["t"] == "dict":
            stack.extend((child, path + [key_component(decode_scalar(k))]) for k, child in node["items"])
        elif node["t"] != "tensor":
            found["/".join(path)] = decode_scalar(node)
    return found


# ---------------------------------------------------------------------------------------------
# the invariants a reader must check (docs/format.md, "Invariants")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


V1_CODECS = {"none/1", "zstd/1", "lz4/1", "deflate/1", "nvcomp.ans/1", "nvcomp.gdeflate/1", "nvcomp.snappy/1",
             "nvcomp.bitcomp/1", "nvcomp.cascaded/1", "nvcomp.bitcomp-lossy/1"}
"""§9.1's codecs: only ever the last stage of a chain (§6.3)."""


def violations(doc: Any, index_offset: int) -> list[str]:
    """Every normative invariant of an index document that ``doc`` breaks (empty: valid)."""
    problems: list[str] = []
    if not isinstance(doc, dict) or doc.get("format") != "gdsckpt":
        return ["not a gdsckpt index"]
    version = doc.get("version")
    if not (isinstance(version, list) and len(version) == 2 and all(_is_int(v) for v in version)
            and version[0] == 1):
        return ["version"]
    if doc.get("checksum") != "crc32c":
        problems.append("checksum")
    if "alignment" in doc and (not _is_int(doc["alignment"]) or doc["alignment"] != 4096):
        problems.append("alignment")
    if "user" in doc and not isinstance(doc["user"], dict):
        problems.append("user")
    chains = doc.get("chains")
    if not isinstance(chains, list) or not all(
            isinstance(c, list) and c and all(isinstance(s, dict) and isinstance(s.get("name"), str)
                                              and re.fullmatch(r"[a-z0-9_.\-]+/[0-9]+", s["name"])
                                              for s in c) for c in chains):
        return problems + ["chains"]
    plane_widths = []  # per chain: the byteplanes/1 width a chunk's raw length is a multiple of
    for chain in chains:
        names = [stage["name"] for stage in chain]
        if len(chain) > 8 or len(set(names)) != len(names):
            return problems + ["chain length or repeated stage"]
        if any(name in V1_CODECS for name in names[:-1]):
            return problems + ["codec before the last stage"]
        width = 1
        for position, stage in enumerate(chain):
            if stage["name"] == "byteplanes/1":
                width = stage.get("width")
                if position == len(chain) - 1 or not _is_int(width) or width not in (2, 4, 8):
                    return problems + ["byteplanes stage"]
        plane_widths.append(width)
    chunks = doc.get("chunks")
    if not isinstance(chunks, list):
        return problems + ["chunks"]
    previous_end = HEADER_REGION
    for record in chunks:
        if not (isinstance(record, list) and len(record) == 5 and all(_is_int(v) for v in record)):
            return problems + ["chunk record"]
        offset, stored, raw, crc, chain = record
        if offset % ALIGNMENT or offset < previous_end or stored < 0 or offset + stored > index_offset:
            problems.append("chunk extent")
        if not 0 <= raw <= 1 << 30 or raw > max(stored, 1) * 65536 or (stored == 0) != (raw == 0):
            problems.append("chunk raw length")
        if not 0 <= crc < 1 << 32 or not 0 <= chain < len(chains):
            problems.append("chunk crc/chain")
        elif raw % plane_widths[chain]:
            problems.append("chunk raw length vs byte planes")
        previous_end = offset + stored
    if problems:
        return problems
    tensors = doc.get("tensors")
    if not isinstance(tensors, list):
        return ["tensors"]
    coverage: list[list[tuple[int, int]]] = [[] for _ in chunks]
    keys = set()
    for i, record in enumerate(tensors):
        if not isinstance(record, dict) or not isinstance(record.get("key"), str) or record["key"] in keys:
            return ["tensor key"]
        keys.add(record["key"])
        if record.get("kind") not in ("torch", "numpy", "cupy", "jax") \
                or not isinstance(record.get("dtype"), str) or record["dtype"] not in DTYPES \
                or not isinstance(record.get("device", "cpu"), str):
            return ["tensor kind/dtype/device"]
        shape = record.get("shape")
        if not isinstance(shape, list) or len(shape) > 64 \
                or not all(_is_int(d) and 0 <= d < 1 << 60 for d in shape):
            return ["tensor shape"]
        nbytes = math.prod(shape) * DTYPES[record["dtype"]][0]
        if nbytes > 1 << 60:
            return ["tensor size"]
        if "alias" in record:
            target = record["alias"]
            if "segments" in record or not _is_int(target) or not 0 <= target < i \
                    or "alias" in tensors[target] or tensors[target]["dtype"] != record["dtype"] \
                    or tensors[target]["kind"] != record["kind"] \
                    or tensors[target]["shape"] != shape:
                return ["alias"]
            continue
        segments = record.get("segments")
        if not isinstance(segments, list):
            return ["segments"]
        total = 0
        for segment in segments:
            if not (isinstance(segment, list) and len(segment) == 3 and all(_is_int(v) for v in segment)):
                return ["segment record"]
            chunk, start, length = segment
            if not 0 <= chunk < len(chunks) or start < 0 or length < 1 or start + length > chunks[chunk][2]:
                return ["segment extent"]
            coverage[chunk].append((start, length))
            total += length
        if total != nbytes:
            return ["segment total"]
    for c, spans in enumerate(coverage):
        position = 0
        for start, length in sorted(spans):
            if start != position:
                return ["tiling"]
            position += length
        if position != chunks[c][2]:
            return ["tiling"]
    seen = [0] * len(tensors)
    stack: list[tuple[Any, int, bool]] = [(doc.get("tree"), 0, False)]
    while stack:
        node, depth, in_meta = stack.pop()
        if depth > 512 or not isinstance(node, dict) or not isinstance(node.get("t"), str):
            return ["tree node"]
        t = node["t"]
        if t in ("list", "tuple"):
            if not isinstance(node.get("items"), list):
                return ["tree items"]
            stack.extend((child, depth + 1, in_meta) for child in node["items"])
        elif t == "dict":
            if not isinstance(node.get("items"), list):
                return ["tree items"]
            for pair in node["items"]:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict)
                        and pair[0].get("t") in ("int", "float", "bool", "str", "none")):
                    return ["dict item"]
                stack.append((pair[0], depth + 1, in_meta))
                stack.append((pair[1], depth + 1, in_meta))
            if "meta" in node:
                stack.append((node["meta"], depth + 1, True))
        elif t == "tensor":
            tid = node.get("id")
            if in_meta or not _is_int(tid) or not 0 <= tid < len(tensors):
                return ["tensor node"]
            seen[tid] += 1
        elif t == "int":
            if not isinstance(node.get("v"), str) or not re.fullmatch(r"-?[0-9]{1,4300}", node["v"]):
                return ["int node"]
        elif t == "float":
            if not isinstance(node.get("v"), str) or not re.fullmatch(r"[0-9a-f]{16}", node["v"]):
                return ["float node"]
        elif t == "bool":
            if not isinstance(node.get("v"), bool):
                return ["bool node"]
        elif t == "str":
            if not isinstance(node.get("v"), str):
                return ["str node"]
        elif t != "none":
            return ["node type"]
    if any(count != 1 for count in seen):
        return ["tensor references"]
    return []


# ---------------------------------------------------------------------------------------------
# writing (for hostile files: a well-formed container around any index document)


def pack_header(major: int = 1, minor: int = 0, flags: int = 0) -> bytes:
    body = HEADER.pack(MAGIC, major, minor, HEADER_REGION, ALIGNMENT, flags, bytes(36), 0)[:60]
    return body + struct.pack("<I", crc32c_pure(body)) + bytes(HEADER_REGION - 64)


def pack_trailer(index_offset: int, index: bytes, major: int = 1, minor: int = 0) -> bytes:
    file_length = index_offset + len(index) + 64
    body = TRAILER.pack(TRAILER_MAGIC, major, minor, 0, index_offset, len(index), crc32c_pure(index), 0,
                        file_length, bytes(12), 0)[:60]
    return body + struct.pack("<I", crc32c_pure(body))


def build_file(index: bytes | dict[str, Any], chunk_area: bytes = b"", *, major: int = 1) -> bytes:
    """Header, ``chunk_area`` (placed at 4096 and zero padded to the alignment), ``index`` (a
    document is serialised compactly) and a trailer, all with correct checksums."""
    if isinstance(index, dict):
        index = json.dumps(index, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    area = chunk_area + bytes(align_up(len(chunk_area)) - len(chunk_area))
    return pack_header(major) + area + index + pack_trailer(HEADER_REGION + len(area), index, major)
