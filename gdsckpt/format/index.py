"""The JSON index of format v1: schema, serialisation and validation.

docs/format.md ("Index") is normative; this module mirrors it. Pure Python.

The index is parsed with ``json`` (never pickle) and validated completely before the reader
allocates anything from it: every offset and length is checked against the file size, every
tensor's byte count against its shape, and the tensors' segments must tile every chunk exactly
(no holes, no overlaps), so no chunk can be referenced twice to amplify a small file into a
large allocation.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import collector
from ..errors import CorruptCheckpointError, NewerFormatError, UnsupportedFormatError
from .checksum import CHECKSUM_ALGORITHM
from .dtypes import DTYPES
from .layout import ALIGNMENT, FORMAT_MAJOR, FORMAT_MINOR, HEADER_REGION

MAX_CHUNK_RAW_BYTES = 1 << 30
"""No chunk may decode to more than 1 GiB."""
MAX_EXPANSION = 1 << 16
"""A chunk's raw length is at most this many times its stored length (zstd's own ceiling is
about 32,768:1), so a small file cannot claim a huge decoded size."""
MAX_TENSOR_BYTES = 1 << 60
"""An array's bytes (and its ``span_bytes``) are at most this, each of its dimensions below it
(docs/format.md §6.5)."""
MAX_DIMS = 64
"""An array has at most this many dimensions (docs/format.md §6.5)."""
MAX_TREE_DEPTH = 512
XOR_BASE = "xorbase/1"
"""The transform of a delta chunk (format 1.1): its raw bytes are the XOR of the arrays' element
bytes with those of the same arrays in the base checkpoint (docs/format.md §9.5)."""
MAX_BASE_DEPTH = 1 << 10
MAX_CHAIN_STAGES = 8
"""A chain has at most this many stages (docs/format.md §6.3). Each transform is a full pass over
a chunk's decoded bytes, so an unbounded chain let a 174 KiB file keep a reader busy for minutes;
writers emit at most 3 stages (xorbase/1, byteplanes/1, a codec)."""
BYTE_PLANES = "byteplanes/1"
V1_CODECS = frozenset({"none/1", "zstd/1", "lz4/1", "deflate/1", "nvcomp.ans/1", "nvcomp.gdeflate/1",
                       "nvcomp.snappy/1", "nvcomp.bitcomp/1", "nvcomp.cascaded/1", "nvcomp.bitcomp-lossy/1"})
"""The codecs of §9.1: a chain's last stage and no other (§6.3). A reader that does not know a
name cannot tell a codec from a transform; one it knows as a codec anywhere else makes the chain
corrupt at parse time, not an unknown transform when a chunk is decoded."""
PLANE_WIDTHS = (2, 4, 8)
"""The ``width`` values of a byteplanes/1 stage (§9.2)."""
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
TENSOR_KINDS = ("torch", "numpy", "cupy", "jax")
_CODEC_NAME = re.compile(r"[a-z0-9_.\-]+/[0-9]+")
"""A versioned stage name; matched with ``fullmatch`` (``$`` would accept a trailing newline)."""


# ChunkRecord and Segment are immutable named tuples rather than frozen dataclasses: a reader
# makes one per chunk and per segment before its first read, and a tuple is made in about half
# the time of a frozen dataclass (whose __init__ goes through object.__setattr__ per field).

class ChunkRecord(NamedTuple):
    """One chunk: ``stored`` bytes at ``offset`` that decode through chain ``chain`` to ``raw`` bytes."""

    offset: int
    stored: int
    raw: int
    crc: int
    chain: int

    def to_json(self) -> list[int]:
        """The chunk's record in the index: ``[offset, stored, raw, crc, chain]``."""
        return [self.offset, self.stored, self.raw, self.crc, self.chain]


class Segment(NamedTuple):
    """``length`` bytes of a tensor, found at ``raw_offset`` in the decoded bytes of ``chunk``."""

    chunk: int
    raw_offset: int
    length: int


@dataclass
class TensorRecord:
    """One array: where its bytes are and how to rebuild it.

    ``segments`` concatenated give the array's elements in C order, little-endian. ``alias``, when
    set, means this entry is the very same array as tensor ``alias`` (no segments of its own).
    """

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    device: str = "cpu"
    segments: list[Segment] = field(default_factory=list)
    alias: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    lossy: dict[str, Any] | None = None
    """Informative ``lossy`` member (§6.5): how ``save(lossy=...)`` rounded the values."""

    @property
    def nbytes(self) -> int:
        """Bytes of the array's elements: the product of its shape times its dtype's item size."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_json(self) -> dict[str, Any]:
        """The record as its JSON object in the index (docs/format.md): ``alias`` or ``segments``,
        then its extra members and ``lossy`` where set."""
        out: dict[str, Any] = {
            "key": self.key, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
            "device": self.device,
        }
        if self.alias is not None:
            out["alias"] = self.alias
        else:
            out["segments"] = [[s.chunk, s.raw_offset, s.length] for s in self.segments]
        out.update(self.extra)
        if self.lossy is not None:
            out["lossy"] = self.lossy
        return out


@dataclass
class Index:
    """The decoded index of one checkpoint file."""

    chains: list[list[dict[str, Any]]]
    chunks: list[ChunkRecord]
    tensors: list[TensorRecord]
    tree: Any
    writer: str = ""
    minor: int = FORMAT_MINOR
    user: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] | None = None
    """The base of a delta checkpoint (format 1.1): ``{"path", "index_sha256", "file_length",
    "depth"}``; None for a full checkpoint."""

    def delta_ids(self) -> list[int]:
        """Tensors stored as the XOR with the base (their chunks' chains begin with xorbase/1)."""
        return [i for i, record in enumerate(self.tensors)
                if record.segments and _is_delta_chain(self.chains[self.chunks[record.segments[0].chunk].chain])]

    @collector.paused()
    def to_json_bytes(self) -> bytes:
        """Serialise: compact UTF-8 JSON with a fixed key order (files are reproducible)."""
        doc: dict[str, Any] = {
            "format": "gdsckpt",
            "version": [FORMAT_MAJOR, self.minor],
            "writer": self.writer,
            "checksum": CHECKSUM_ALGORITHM,
            "alignment": ALIGNMENT,
            "chains": self.chains,
            "chunks": [c.to_json() for c in self.chunks],
            "tensors": [t.to_json() for t in self.tensors],
            "tree": self.tree,
        }
        if self.base is not None:
            doc["base"] = self.base
        if self.user:
            doc["user"] = self.user
        # No cycle check (a fifth of the encoding's time): the tree and the records come from
        # ``flatten``, which refuses reference cycles, or from a parsed index, which has none.
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                          check_circular=False).encode("utf-8")


def span_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """The bytes an array's strides span: the product of its dimensions with each 0 counted as 1,
    times ``itemsize``. An empty array's other dimensions still set its strides, which torch and
    NumPy hold in 64 bits, so this, not just the array's byte count, is bounded (§6.5)."""
    span = itemsize
    for dimension in shape:
        span *= dimension or 1
    return span


def shape_limit_error(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why this reader would refuse an array record of ``shape`` and ``itemsize`` as corrupt
    (docs/format.md §6.5: at most ``MAX_DIMS`` dimensions, each in ``[0, MAX_TENSOR_BYTES)``, and
    ``span_bytes`` at most ``MAX_TENSOR_BYTES``), or None where it accepts it. Writers ask before
    writing anything, so that a save never leaves a file every load refuses."""
    if len(shape) > MAX_DIMS:
        return f"it has {len(shape)} dimensions, more than the {MAX_DIMS} a checkpoint holds"
    limit = f"2**{MAX_TENSOR_BYTES.bit_length() - 1}"
    for dimension in shape:
        if not 0 <= dimension < MAX_TENSOR_BYTES:
            return f"its dimension {dimension} is not below {limit}, the bound of a checkpoint's dimensions"
    span = span_bytes(shape, itemsize)
    if span > MAX_TENSOR_BYTES:
        counted = " (each 0 dimension counted as 1)" if 0 in shape else ""
        return f"it spans {span} bytes{counted}, more than the {limit} a checkpoint holds for one array"
    return None


def _fail(message: str, **context: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"invalid index: {message}", **context)


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 63) -> int:
    # bool is an int subclass in Python; the format never stores a bool where an int is due.
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value < hi:
        raise _fail(f"{what} must be an integer in [{lo}, {hi}), got {value!r:.80}")
    return value


def reject_constant(name: str) -> Any:
    """``json.loads``'s ``parse_constant`` hook: NaN and Infinity are not JSON, so refuse them."""
    raise ValueError(f"non-standard JSON constant {name}")


_DECODER = json.JSONDecoder(parse_constant=reject_constant)
"""Made once: ``json.loads`` with a hook builds a new decoder (and scanner) per call."""


@collector.paused()
def parse_index(data: bytes, *, index_offset: int) -> Index:
    """Parse and fully validate index bytes; ``index_offset`` bounds every chunk's extent.

    Raises ``CorruptCheckpointError`` naming the first violated rule, or
    ``UnsupportedFormatError`` for an index of another major version.
    """
    try:
        # decoded as UTF-8 first: json.loads of bytes would also accept UTF-16 and UTF-32 (§6.1)
        doc = _DECODER.decode(data.decode("utf-8"))
    except RecursionError:
        raise _fail("nesting too deep") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise _fail(f"not valid UTF-8 JSON ({err})") from err
    if not isinstance(doc, dict) or doc.get("format") != "gdsckpt":
        raise _fail("not a gdsckpt index object")
    version = doc.get("version")
    if (not isinstance(version, list) or len(version) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)):
        raise _fail(f"version must be [major, minor], got {version!r:.80}")
    if version[0] != FORMAT_MAJOR:
        # the index's checksum held (the trailer's): a higher major is a newer gdsckpt's
        raise (NewerFormatError if version[0] > FORMAT_MAJOR else UnsupportedFormatError)(
            f"index format version {version[0]}.{version[1]} is not supported (this reader reads "
            f"major version {FORMAT_MAJOR}); upgrade gdsckpt"
        )
    if doc.get("checksum") != CHECKSUM_ALGORITHM:
        raise _fail(f"checksum algorithm {doc.get('checksum')!r:.40} is not {CHECKSUM_ALGORITHM!r}")
    if "alignment" in doc and _int(doc["alignment"], "alignment") != ALIGNMENT:  # 4096.0 is not an integer (§6.1)
        raise _fail(f"alignment must be {ALIGNMENT}")

    chains = _parse_chains(doc.get("chains"))
    chunks = _parse_chunks(doc.get("chunks"), len(chains), index_offset)
    tensors = _parse_tensors(doc.get("tensors"), chunks)
    tree = doc.get("tree")
    validate_tree(tree, len(tensors))
    user = doc.get("user", {})
    if not isinstance(user, dict):
        raise _fail("user must be an object")
    writer = doc.get("writer", "")
    base = _parse_base(doc["base"]) if "base" in doc else None
    _check_delta_chunks(chains, chunks, tensors, base)
    _check_plane_widths(chains, chunks)
    return Index(chains=chains, chunks=chunks, tensors=tensors, tree=tree,
                 writer=writer if isinstance(writer, str) else "", minor=version[1], user=user, base=base)


def _is_delta_chain(chain: list[dict[str, Any]]) -> bool:
    return bool(chain[0]["name"] == XOR_BASE)


def _parse_base(raw: Any) -> dict[str, Any]:
    """The ``base`` member: where the base checkpoint is and what it must be (§6.8)."""
    if not isinstance(raw, dict):
        raise _fail("base must be an object")
    path = raw.get("path")
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
        raise _fail(f"base path must be a non-empty string, got {path!r:.80}")
    digest = raw.get("index_sha256")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        raise _fail("base index_sha256 must be 64 lower-case hex digits")
    _int(raw.get("file_length"), "base file_length", HEADER_REGION + 64)
    _int(raw.get("depth"), "base depth", 1, MAX_BASE_DEPTH + 1)
    return raw


def _check_delta_chunks(chains: list[list[dict[str, Any]]], chunks: list[ChunkRecord],
                        tensors: list[TensorRecord], base: dict[str, Any] | None) -> None:
    """xorbase/1 only first in a chain, only with a base, and a tensor's chunks all delta or none."""
    for number, chain in enumerate(chains):
        if any(stage["name"] == XOR_BASE for stage in chain[1:]) or chain[-1]["name"] == XOR_BASE:
            raise _fail(f"chain {number}: {XOR_BASE} must be the first stage, before a codec")
    delta_chains = [_is_delta_chain(chain) for chain in chains]
    if not any(delta_chains):
        return  # no chunk is a delta chunk: every tensor's chunks are all "none", with or without a base
    delta = [delta_chains[chunk.chain] for chunk in chunks]
    if base is None and any(delta):
        raise _fail(f"chunks use {XOR_BASE} but the index names no base")
    for record in tensors:
        kinds = {delta[segment.chunk] for segment in record.segments}
        if len(kinds) > 1:
            raise _fail("a tensor's chunks must all be delta chunks or none", key=record.key)


def _check_plane_widths(chains: list[list[dict[str, Any]]], chunks: list[ChunkRecord]) -> None:
    """A chunk whose chain has byteplanes/1 decodes to a multiple of its width (§9.2): checked at
    open, so that no decoder (the GPU's reshapes included) meets one that is not."""
    widths = [next((stage["width"] for stage in chain if stage["name"] == BYTE_PLANES), 1)
              for chain in chains]
    if all(width == 1 for width in widths):
        return  # no chain has byte planes: every length is a multiple of 1
    for number, chunk in enumerate(chunks):
        if chunk.raw % widths[chunk.chain]:
            raise _fail(f"chain {chunk.chain}: {BYTE_PLANES} width {widths[chunk.chain]} does not divide the "
                        f"chunk's {chunk.raw} decoded bytes", chunk=number)


def _parse_chains(raw: Any) -> list[list[dict[str, Any]]]:
    if not isinstance(raw, list):
        raise _fail("chains must be a list")
    chains = []
    for i, chain in enumerate(raw):
        if not isinstance(chain, list) or not chain:
            raise _fail(f"chain {i} must be a non-empty list of stages")
        if len(chain) > MAX_CHAIN_STAGES:  # before anything else: each stage costs a pass per chunk
            raise _fail(f"chain {i} has {len(chain)} stages, more than {MAX_CHAIN_STAGES}")
        for stage in chain:
            if not isinstance(stage, dict) or not isinstance(stage.get("name"), str) \
                    or not _CODEC_NAME.fullmatch(stage["name"]):
                raise _fail(f"chain {i} has a stage without a valid versioned name: {stage!r:.80}")
        names = [stage["name"] for stage in chain]
        if len(set(names)) != len(names):
            raise _fail(f"chain {i} names a stage twice: {'+'.join(names)!r:.200}")
        if any(name in V1_CODECS for name in names[:-1]):
            raise _fail(f"chain {i}: a codec is only ever the last stage: {'+'.join(names)!r:.200}")
        for position, stage in enumerate(chain):
            if stage["name"] != BYTE_PLANES:
                continue
            width = stage.get("width")
            if position == len(chain) - 1:
                raise _fail(f"chain {i}: {BYTE_PLANES} is a transform and must be followed by a codec")
            if not isinstance(width, int) or isinstance(width, bool) or width not in PLANE_WIDTHS:
                raise _fail(f"chain {i}: {BYTE_PLANES} width must be one of {PLANE_WIDTHS}, "
                            f"got {width!r:.40}")
        chains.append(chain)
    return chains


def _parse_chunks(raw: Any, n_chains: int, index_offset: int) -> list[ChunkRecord]:
    if not isinstance(raw, list):
        raise _fail("chunks must be a list")
    chunks: list[ChunkRecord] = []
    append = chunks.append
    previous_end = HEADER_REGION
    for i, entry in enumerate(raw):
        if type(entry) is not list or len(entry) != 5:
            raise _fail("chunk record must be [offset, stored, raw, crc, chain]", chunk=i)
        offset, stored, raw_len, crc, chain = entry
        # The common case in one expression (JSON integers are exactly ``int``); anything else goes
        # through the field-by-field checks, which name what is wrong.
        if not (type(offset) is int and HEADER_REGION <= offset <= index_offset
                and type(stored) is int and 0 <= stored <= index_offset
                and type(raw_len) is int and 0 <= raw_len <= MAX_CHUNK_RAW_BYTES
                and type(crc) is int and 0 <= crc < 1 << 32 and type(chain) is int and 0 <= chain < n_chains):
            offset = _int(entry[0], f"chunk {i} offset", HEADER_REGION, index_offset + 1)
            stored = _int(entry[1], f"chunk {i} stored length", 0, index_offset + 1)
            raw_len = _int(entry[2], f"chunk {i} raw length", 0, MAX_CHUNK_RAW_BYTES + 1)
            crc = _int(entry[3], f"chunk {i} checksum", 0, 1 << 32)
            chain = _int(entry[4], f"chunk {i} chain", 0, max(n_chains, 1))
            if chain >= n_chains:
                raise _fail(f"chunk {i} names chain {chain} of {n_chains}", chunk=i)
        if offset % ALIGNMENT:
            raise _fail(f"chunk offset {offset} is not a multiple of {ALIGNMENT}", chunk=i)
        if offset < previous_end:
            raise _fail(f"chunk at {offset} overlaps the previous chunk or the header", chunk=i)
        previous_end = offset + stored
        if previous_end > index_offset:
            raise _fail(f"chunk [{offset}, +{stored}) runs past the index at {index_offset}", chunk=i)
        if raw_len > max(stored, 1) * MAX_EXPANSION or (stored == 0) != (raw_len == 0):
            raise _fail(f"chunk claims {raw_len} raw bytes from {stored} stored bytes", chunk=i)
        append(ChunkRecord(offset, stored, raw_len, crc, chain))
    return chunks


_TENSOR_MEMBERS = frozenset(("key", "kind", "dtype", "shape", "device", "segments", "alias", "lossy"))
"""The members of a tensor record with a meaning of their own; any other is kept in ``extra``."""
_ITEMSIZES = {name: spec.itemsize for name, spec in DTYPES.items()}


def _parse_tensors(raw: Any, chunks: list[ChunkRecord]) -> list[TensorRecord]:
    if not isinstance(raw, list):
        raise _fail("tensors must be a list")
    tensors: list[TensorRecord] = []
    keys: set[str] = set()
    spans: list[Segment] = []  # every segment of every tensor: together they must tile every chunk
    chunk_raw = [chunk.raw for chunk in chunks]
    itemsizes = _ITEMSIZES
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise _fail(f"tensor {i} must be an object")
        key = entry.get("key")
        if not isinstance(key, str) or key in keys:
            raise _fail(f"tensor {i} has a missing or duplicate key {key!r:.80}")
        keys.add(key)
        kind, dtype, shape_raw = entry.get("kind"), entry.get("dtype"), entry.get("shape")
        if kind not in TENSOR_KINDS:
            raise _fail(f"kind {kind!r:.40} is not one of {TENSOR_KINDS}", key=key)
        if not isinstance(dtype, str) or dtype not in itemsizes:  # a list is unhashable: check type first
            raise _fail(f"unknown dtype {dtype!r:.40}", key=key)
        if not isinstance(shape_raw, list) or len(shape_raw) > MAX_DIMS:
            raise _fail(f"shape must be a list of at most {MAX_DIMS} dimensions", key=key)
        shape = tuple(shape_raw)
        for d in shape:  # a loop, not all(...): most shapes have one or two dimensions
            if type(d) is not int or not 0 < d < MAX_TENSOR_BYTES:
                shape = tuple(_int(d, f"tensor {key!r} dimension", 0, MAX_TENSOR_BYTES) for d in shape_raw)
                # An empty array's other dimensions still set its strides: torch and NumPy refuse a
                # shape whose nonzero dimensions multiply past int64 (e.g. [0, 2^59, 2^59]).
                if span_bytes(shape, itemsizes[dtype]) > MAX_TENSOR_BYTES:
                    raise _fail(f"shape {list(shape)!r:.80} spans more than {MAX_TENSOR_BYTES} bytes", key=key)
                break
        nbytes = math.prod(shape) * itemsizes[dtype]
        if nbytes > MAX_TENSOR_BYTES:
            raise _fail(f"tensor claims {nbytes} bytes", key=key)
        device = entry.get("device", "cpu")
        if not isinstance(device, str):
            raise _fail("device must be a string", key=key)
        extra = ({} if entry.keys() <= _TENSOR_MEMBERS
                 else {k: v for k, v in entry.items() if k not in _TENSOR_MEMBERS})
        # positional, in TensorRecord's field order: keywords cost about twice as much per record
        record = TensorRecord(key, kind, dtype, shape, device, [], None, extra,
                              _parse_lossy(entry["lossy"], key) if "lossy" in entry else None)
        if "alias" in entry:
            if "segments" in entry:
                raise _fail("a tensor has either segments or an alias, not both", key=key)
            target = _int(entry["alias"], f"tensor {key!r} alias", 0, max(i, 1))
            if target >= i or tensors[target].alias is not None:
                raise _fail(f"alias {target} must name an earlier tensor record that is not an alias",
                            key=key)
            # the same kind too: a reader restores an alias as its target's object (§6.7)
            source = tensors[target]
            if (source.kind, source.dtype, source.shape) != (kind, dtype, shape):
                raise _fail(f"alias {target} names a {source.kind} {source.dtype}{list(source.shape)} "
                            f"array but this record is a {kind} {dtype}{list(shape)} one", key=key)
            record.alias = target
        else:
            record.segments = _parse_segments(entry.get("segments"), chunk_raw, key, nbytes, spans)
        tensors.append(record)
    _check_tiling(spans, chunk_raw)
    return tensors


def _check_tiling(spans: list[Segment], chunk_raw: list[int]) -> None:
    """The segments tile every chunk's decoded bytes exactly: sorted by chunk and offset, each
    starts where the one before it in its chunk ended, and a chunk's last ends at its raw length
    (a chunk with no segments must decode to no bytes). Errors name the first bad chunk."""
    spans.sort()  # writers emit segments in chunk order, so this is about one pass
    chunk, position = 0, 0
    for number, start, length in spans:
        while chunk < number:  # every segment of ``chunk`` seen
            if position != chunk_raw[chunk]:
                raise _fail(f"tensors cover {position} of the chunk's {chunk_raw[chunk]} decoded bytes",
                            chunk=chunk)
            chunk, position = chunk + 1, 0
        if start != position:
            raise _fail(f"decoded bytes [{min(start, position)}, {max(start, position)}) are "
                        f"{'referenced twice' if start < position else 'not referenced by any tensor'}",
                        chunk=chunk)
        position = start + length
    for last in range(chunk, len(chunk_raw)):  # the chunk of the last segment, then any after it
        if position != chunk_raw[last]:
            raise _fail(f"tensors cover {position} of the chunk's {chunk_raw[last]} decoded bytes", chunk=last)
        position = 0


_LARGEST_FLOAT = int(sys.float_info.max)


def _parse_lossy(raw: Any, key: str) -> dict[str, Any]:
    """A tensor record's ``lossy`` member (§6.5): informative, but a malformed one is corrupt."""
    if not isinstance(raw, dict) or not isinstance(raw.get("mode"), str):
        raise _fail("lossy must be an object with a string mode", key=key)
    for name in ("rel_bound", "abs_bound", "max_error"):
        value = raw.get(name)
        # bool is not a number here; an int must be one a float holds (inspect prints it as one)
        if not ((isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _LARGEST_FLOAT)
                or (isinstance(value, float) and math.isfinite(value) and value >= 0)):
            raise _fail(f"lossy {name} must be a finite number >= 0, got {value!r:.40}", key=key)
    if raw["max_error"] > raw["abs_bound"]:
        raise _fail(f"lossy max_error {raw['max_error']!r:.40} is above abs_bound {raw['abs_bound']!r:.40}", key=key)
    return raw


def _parse_segments(raw: Any, chunk_raw: list[int], key: str, nbytes: int,
                    spans: list[Segment]) -> list[Segment]:
    """A data record's segments (``chunk_raw``: each chunk's raw length), also added to ``spans``
    for the tiling check."""
    if not isinstance(raw, list):
        raise _fail("segments must be a list", key=key)
    segments = []
    total = 0
    count = len(chunk_raw)
    for entry in raw:
        if type(entry) is not list or len(entry) != 3:
            raise _fail("segment must be [chunk, raw_offset, length]", key=key)
        chunk, start, length = entry
        if not (type(chunk) is int and 0 <= chunk < count and type(start) is int and start >= 0
                and type(length) is int and length >= 1 and start + length <= MAX_CHUNK_RAW_BYTES):
            chunk = _int(entry[0], "segment chunk", 0, max(count, 1))
            if chunk >= count:
                raise _fail(f"segment names chunk {chunk} of {count}", key=key)
            start = _int(entry[1], "segment offset", 0, MAX_CHUNK_RAW_BYTES + 1)
            length = _int(entry[2], "segment length", 1, MAX_CHUNK_RAW_BYTES + 1)
        if start + length > chunk_raw[chunk]:
            raise _fail(f"segment [{start}, +{length}) runs past the chunk's {chunk_raw[chunk]} bytes",
                        key=key, chunk=chunk)
        segments.append(Segment(chunk, start, length))
        total += length
    spans.extend(segments)
    if total != nbytes:
        raise _fail(f"segments hold {total} bytes but dtype and shape need {nbytes}", key=key)
    return segments


_SCALAR_TYPES = frozenset(("int", "float", "bool", "str", "none"))
_INT_TEXT = re.compile(r"-?[0-9]{1,4300}")
_FLOAT_BITS = re.compile(r"[0-9a-f]{16}")


def validate_tree(tree: Any, n_tensors: int) -> None:
    """Check the structure tree: node kinds, scalar encodings, each tensor referenced exactly once."""
    seen = [False] * n_tensors
    stack: list[tuple[Any, int, bool]] = [(tree, 0, False)]  # (node, depth, inside an OrderedDict's meta)
    pop, push = stack.pop, stack.append
    while stack:
        node, depth, in_meta = pop()
        if depth > MAX_TREE_DEPTH:
            raise _fail(f"structure nested deeper than {MAX_TREE_DEPTH}")
        kind = node.get("t") if isinstance(node, dict) else None
        if not isinstance(kind, str):
            raise _fail(f"structure node must be an object with a type 't': {node!r:.80}")
        if kind == "tensor":
            if in_meta:
                raise _fail("an OrderedDict's meta holds a tensor node (meta holds plain values only)")
            tid = node.get("id")
            if type(tid) is not int or not 0 <= tid < n_tensors:
                tid = _int(tid, "tensor node id", 0, max(n_tensors, 1))
            if tid >= n_tensors or seen[tid]:
                raise _fail(f"tensor {tid} is missing or referenced twice by the structure")
            seen[tid] = True
        elif kind == "dict":
            items = node.get("items")
            if not isinstance(items, list):
                raise _fail("dict node needs an items list")
            child = depth + 1
            for pair in items:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _fail("dict item must be [key, value]")
                key, value = pair
                key_kind = key.get("t") if isinstance(key, dict) else None
                if not isinstance(key_kind, str) or key_kind not in _SCALAR_TYPES:
                    raise _fail(f"dict key must be a scalar node: {key!r:.80}")
                if key_kind == "str" and child <= MAX_TREE_DEPTH:
                    # the usual key, checked here rather than through the stack
                    if not isinstance(key.get("v"), str):
                        raise _fail("str node needs a string")
                else:
                    push((key, child, in_meta))
                push((value, child, in_meta))
            if "meta" in node:
                push((node["meta"], child, True))
        elif kind == "list" or kind == "tuple":
            items = node.get("items")
            if not isinstance(items, list):
                raise _fail(f"{kind} node needs an items list")
            child = depth + 1
            for item in items:
                push((item, child, in_meta))
        elif kind in _SCALAR_TYPES:
            _validate_scalar(node)
        else:
            raise _fail(f"unknown structure node type {kind!r:.40}")
    if not all(seen):
        raise _fail(f"tensor {seen.index(False)} is not referenced by the structure")


def _validate_scalar(node: dict[str, Any]) -> None:
    kind, value = node["t"], node.get("v")
    if kind == "str":
        if not isinstance(value, str):
            raise _fail("str node needs a string")
    elif kind == "int":
        if not isinstance(value, str) or not _INT_TEXT.fullmatch(value):
            raise _fail(f"int node needs a decimal string: {value!r:.80}")
    elif kind == "float":
        if not isinstance(value, str) or not _FLOAT_BITS.fullmatch(value):
            raise _fail(f"float node needs 16 hex digits of IEEE-754 bits: {value!r:.80}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise _fail("bool node needs true or false")
