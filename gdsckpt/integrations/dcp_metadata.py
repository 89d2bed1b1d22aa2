"""DCP's ``Metadata`` as JSON (``.metadata.json``, schema 1): plain values only, encoded by the
writer and decoded and checked by the reader without unpickling anything from the file.

``GdsStorageWriter`` writes this form beside DCP's pickle ``.metadata``; ``GdsStorageReader``
reads it first (``gdsckpt.integrations.dcp``). Every field is validated strictly: a wrong type, an
unknown member, a duplicate key or a value out of range raises ``CorruptCheckpointError`` naming
the field.

Beyond its fields, a document is checked as a whole, so that a changed byte cannot make a load
deliver the wrong data:

- ``digest``: the SHA-256 of the document's canonical form (sorted keys, no spaces, ASCII), the
  ``digest`` and ``pickle`` members left out. A reader recomputes it and refuses a document whose
  content changed after it was written. ``pickle`` needs no cover: it is checked against the
  ``.metadata`` file it names (length and SHA-256), so a changed binding is refused there. Documents
  written before the digest existed have none and are read without it (a single changed byte cannot
  remove it: a changed member name is an unknown field). The digest detects damage, not forgery:
  whoever may write the directory may write a matching digest.
- consistency (``check_metadata``, also applied to a trusted pickle): the chunks of each tensor tile
  it exactly, as DCP's default save planner guarantees (inside its bounds, no two overlapping, their
  elements adding up to the tensor's; rank-local metadata, ``__<rank>.metadata`` of a save without
  collectives, describes only that rank's shards: there the chunks need not cover the tensor), and
  each storage entry names a chunk of its tensor, sits
  under the key ``GdsStorageWriter`` gives that chunk (``item_key``), and names the same ``file_id``
  as every other entry of its rank file.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedFormatError
from ..format.index import reject_constant
from ..state import escape_key, torch_dtype, torch_dtype_name

METADATA_NAME = ".metadata"
JSON_SUFFIX = ".json"
"""``.metadata.json`` (``__<rank>.metadata.json`` beside rank-local metadata): the JSON form."""
METADATA_JSON_FORMAT = "gdsckpt-dcp-metadata"
METADATA_JSON_SCHEMA = 1
MAX_METADATA_JSON_BYTES = 1 << 30
"""A larger ``.metadata.json`` is refused unread (it takes about 300 bytes a tensor)."""
MAX_TENSOR_DIMS = 1024
"""Most dimensions a tensor in ``.metadata.json`` may have."""
SUFFIX = ".gdsckpt"
DCP_VERSION = "1.0.0"
FILE_ID_PREFIX = "gdsckpt.dcp.file_id."
"""A rank file holds an empty array keyed ``FILE_ID_PREFIX + <file_id>``: the id of the save that
wrote it, read from the index alone. No DCP item can have that key (an item's key holds ``@``)."""
_FILE_ID_HEX_DIGITS = 32


@dataclass(frozen=True)
class GdsStorageInfo:
    """Where one write item lives: the rank file (relative to the checkpoint directory), its key
    in that file (as ``gdsckpt.open(...).get`` takes it) and its length in bytes.

    ``file_id``: the random id the save wrote into that rank file (32 lower-case hex digits, kept
    there as the key of an empty array, ``gdsckpt.dcp.file_id.<id>``). A reader refuses a rank
    file that holds another id: another save replaced it after this metadata's save wrote it. None
    in metadata written before rank files had ids."""

    relative_path: str
    key: str
    length: int
    file_id: str | None = None

    @property
    def offset(self) -> int:
        """Not a byte offset: torch's ``FileSystemReader`` (which ``dcp.load`` picks for a
        ``checkpoint_id`` alone, and ``dcp_to_torch_save`` uses) asks for one to read a raw slice,
        and a gdsckpt rank file has none to give. ``UnsupportedFormatError`` naming the reader."""
        raise UnsupportedFormatError(
            f"{self.relative_path!r} is a rank file of gdsckpt.dcp.GdsStorageWriter (a compressed gdsckpt "
            f"file), which torch's FileSystemReader cannot read: load it with dcp.load(state, "
            f"storage_reader=gdsckpt.dcp.GdsStorageReader(path)), or turn it into a torch.save file with "
            f"gdsckpt.dcp.GdsStorageReader and torch.save")

    @property
    def transform_descriptors(self) -> None:
        """As ``offset``: what torch's ``FileSystemReader`` reads besides the offset."""
        return self.offset  # type: ignore[return-value]  # raises


def item_name(index: MetadataIndex) -> str:
    """``fqn@offsets`` (``"w@0,128"``; ``"step@"`` for an item without offsets): the write item's
    top-level dict key in its rank file (``gdsckpt.save`` escapes it into a key path)."""
    offsets = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    return f"{index.fqn}@{offsets}"


def item_key(index: MetadataIndex) -> str:
    """The key of a write item in its rank file, as ``gdsckpt.open(...).get`` takes it: the item
    name ``fqn@offsets`` escaped as a key path component (``/`` and ``~`` in an FQN)."""
    return escape_key(item_name(index))


# ---------------------------------------------------------------------------------------------
# DCP's Metadata as JSON (schema 1): plain values only, decoded and checked without unpickling

_LAYOUTS = {name: getattr(torch, name) for name in
            ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged")
            if hasattr(torch, name)}
_MEMORY_FORMATS = {name: getattr(torch, name) for name in
                   ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")}
_MAX_ELEMENTS = 1 << 63


class UnexpressibleMetadata(Exception):
    """Metadata holds a value that schema 1 of the JSON form has no encoding for."""


def _member_name(table: dict[str, Any], value: Any, what: str) -> str:
    for name, member in table.items():
        if member is value:
            return name
    raise UnexpressibleMetadata(f"{what} {value!r:.80}")


def _dtype_name(dtype: Any, what: str) -> str:
    name = torch_dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    if name is None:
        raise UnexpressibleMetadata(f"{what} {dtype!r:.80}")
    return name


def encode_metadata_json(metadata: Metadata, pickled: bytes, *, rank_local: bool = False) -> bytes:
    """The JSON form of ``metadata`` (schema 1), bound to ``pickled`` (the ``.metadata`` bytes
    written with it) by length and SHA-256. Raises ``UnexpressibleMetadata`` naming the first value the
    schema cannot hold, or when the JSON would not decode to a ``Metadata`` equal to ``metadata``
    (which includes metadata that fails ``check_metadata``; ``rank_local`` as there)."""
    tensors: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        what = f"state_dict_metadata[{fqn!r:.80}]"
        if type(md) is BytesStorageMetadata:
            tensors[fqn] = {"type": "bytes"}
        elif type(md) is TensorStorageMetadata and type(md.properties) is TensorProperties:
            props = md.properties
            tensors[fqn] = {
                "type": "tensor", "dtype": _dtype_name(props.dtype, f"{what}.dtype"),
                "layout": _member_name(_LAYOUTS, props.layout, f"{what}.layout"),
                "requires_grad": props.requires_grad,
                "memory_format": _member_name(_MEMORY_FORMATS, props.memory_format, f"{what}.memory_format"),
                "pin_memory": props.pin_memory, "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        else:
            raise UnexpressibleMetadata(f"{what}, a {type(md).__name__}")
    planner = metadata.planner_data
    if planner is not None:
        if not isinstance(planner, dict) or not all(type(path) is tuple for path in planner.values()):
            raise UnexpressibleMetadata(f"planner_data {planner!r:.80}")
        planner = {fqn: list(path) for fqn, path in planner.items()}
    if not isinstance(metadata.storage_data, dict):
        raise UnexpressibleMetadata(f"storage_data, a {type(metadata.storage_data).__name__}")
    storage = []
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or type(info) is not GdsStorageInfo:
            raise UnexpressibleMetadata(f"storage_data entry {index!r:.80}: {info!r:.80}")
        storage.append({"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                        "index": index.index, "file": info.relative_path, "key": info.key,
                        "length": info.length, "file_id": info.file_id})
    storage_meta = metadata.storage_meta
    meta = None if storage_meta is None else {
        "checkpoint_id": storage_meta.checkpoint_id, "save_id": storage_meta.save_id,
        "load_id": storage_meta.load_id, "modules": storage_meta.modules}
    doc = {"format": METADATA_JSON_FORMAT, "schema": METADATA_JSON_SCHEMA,
           "pickle": {"bytes": len(pickled), "sha256": hashlib.sha256(pickled).hexdigest()},
           "version": metadata.version, "state_dict_metadata": tensors, "planner_data": planner,
           "storage_data": storage, "storage_meta": meta}
    try:
        doc["digest"] = _digest(doc)
        data = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
        decoded, _binding = decode_metadata_json(data, "being written", rank_local=rank_local)
    except (TypeError, ValueError, CheckpointError) as err:  # a value of a type the schema lacks
        raise UnexpressibleMetadata(str(err)) from err
    # A field of a type the schema does not keep (a list where DCP holds a tuple, a str subclass,
    # an index hint) would decode to something else: such metadata is written as the pickle only.
    hints = [index.index for index in metadata.storage_data]
    if decoded != metadata or [index.index for index in decoded.storage_data] != hints:
        raise UnexpressibleMetadata("a field whose type the JSON form does not keep")
    return data


_UNDIGESTED = ("digest", "pickle")
"""Document members the digest leaves out: itself, and the binding checked against ``.metadata``."""


def _digest(doc: dict[str, Any]) -> str:
    """The SHA-256 of ``doc``'s canonical JSON without the ``_UNDIGESTED`` members: the same for
    the writer's document and for what a reader parses back from its bytes."""
    canonical = json.dumps({key: value for key, value in doc.items() if key not in _UNDIGESTED},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _is_hex(text: str, digits: int) -> bool:
    return len(text) == digits and not text.strip("0123456789abcdef")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r:.80}")
        out[key] = value
    return out


class _MetadataJsonDecoder:
    """Strict schema-1 validation of one ``.metadata.json``; every error names the field."""

    def __init__(self, where: str, rank_local: bool) -> None:
        self.where = where
        self.rank_local = rank_local

    def fail(self, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid DCP metadata {self.where}: {message}")

    def fields(self, value: Any, what: str, names: tuple[str, ...],
               optional: tuple[str, ...] = ()) -> dict[str, Any]:
        """``value`` as an object with exactly the members ``names`` (and any of ``optional``)."""
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be an object, got {type(value).__name__}")
        missing = [name for name in names if name not in value]
        unknown = [name for name in value if name not in names and name not in optional]
        if missing or unknown:
            raise self.fail(f"{what}: missing fields {missing}, unknown fields {unknown!r:.200}")
        return value

    def optional_integer(self, value: Any, what: str) -> int | None:
        return None if value is None else self.integer(value, what)

    def integer(self, value: Any, what: str) -> int:
        # bool is an int subclass in Python; the schema never stores a bool where an int is due
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _MAX_ELEMENTS:
            raise self.fail(f"{what} must be an integer in [0, 2**63), got {value!r:.80}")
        return value

    def optional_text(self, value: Any, what: str) -> str | None:
        return None if value is None else self.text(value, what)

    def text(self, value: Any, what: str) -> str:
        if isinstance(value, str):
            return value
        raise self.fail(f"{what} must be a string, got {type(value).__name__}")

    def flag(self, value: Any, what: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(f"{what} must be true or false, got {value!r:.80}")
        return value

    def dims(self, value: Any, what: str) -> torch.Size:
        if not isinstance(value, list) or len(value) > MAX_TENSOR_DIMS:
            raise self.fail(f"{what} must be a list of at most {MAX_TENSOR_DIMS} integers, got {value!r:.80}")
        return torch.Size([self.integer(d, what) for d in value])

    def member(self, table: dict[str, Any], value: Any, what: str) -> Any:
        if not isinstance(value, str) or value not in table:
            raise self.fail(f"{what} {value!r:.80} is not one of {sorted(table)}")
        return table[value]

    def dtype(self, value: Any, what: str) -> torch.dtype:
        try:
            return torch_dtype(self.text(value, what))
        except (KeyError, TypeError):
            raise self.fail(f"{what} {value!r:.80} is not a dtype this torch has") from None

    def tensor(self, entry: dict[str, Any], what: str) -> TensorStorageMetadata:
        self.fields(entry, what, ("type", "dtype", "layout", "requires_grad", "memory_format", "pin_memory",
                                  "size", "chunks"))
        size = self.dims(entry["size"], f"{what}.size")
        if math.prod(size) >= _MAX_ELEMENTS:
            raise self.fail(f"{what}.size {list(size)} has 2**63 or more elements")
        props = TensorProperties(dtype=self.dtype(entry["dtype"], f"{what}.dtype"),
                                 layout=self.member(_LAYOUTS, entry["layout"], f"{what}.layout"),
                                 requires_grad=self.flag(entry["requires_grad"], f"{what}.requires_grad"),
                                 memory_format=self.member(_MEMORY_FORMATS, entry["memory_format"],
                                                           f"{what}.memory_format"),
                                 pin_memory=self.flag(entry["pin_memory"], f"{what}.pin_memory"))
        if not isinstance(entry["chunks"], list):
            raise self.fail(f"{what}.chunks must be a list")
        chunks = []
        for number, raw in enumerate(entry["chunks"]):
            where = f"{what} chunk {number}"
            self.fields(raw, where, ("offsets", "sizes"))
            offsets = self.dims(raw["offsets"], f"{where} offsets")
            sizes = self.dims(raw["sizes"], f"{where} sizes")
            if len(offsets) != len(size) or len(sizes) != len(size) \
                    or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
                raise self.fail(f"{where} (offsets {list(offsets)}, sizes {list(sizes)}) lies outside "
                                f"size {list(size)}")
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        return TensorStorageMetadata(properties=props, size=size, chunks=chunks)

    def decode(self, data: bytes) -> tuple[Metadata, dict[str, Any]]:
        """The ``Metadata`` and the ``pickle`` binding (length and SHA-256 of its ``.metadata``)."""
        try:
            doc = json.loads(data.decode("utf-8"), parse_constant=reject_constant,
                             object_pairs_hook=_no_duplicate_keys)
        except RecursionError:
            raise self.fail("nesting too deep") from None
        except (UnicodeDecodeError, ValueError) as err:
            raise self.fail(f"not valid UTF-8 JSON ({err})") from err
        if not isinstance(doc, dict) or doc.get("format") != METADATA_JSON_FORMAT:
            raise self.fail(f"not a gdsckpt DCP metadata object (format must be {METADATA_JSON_FORMAT!r})")
        if doc.get("schema") != METADATA_JSON_SCHEMA:
            raise UnsupportedFormatError(f"DCP metadata {self.where} has schema {doc.get('schema')!r:.40}; "
                                         f"this gdsckpt reads schema {METADATA_JSON_SCHEMA}: upgrade gdsckpt")
        # "digest" is optional: documents written before it existed have none (module docstring)
        self.fields(doc, "the document", ("format", "schema", "pickle", "version", "state_dict_metadata",
                                          "planner_data", "storage_data", "storage_meta"), optional=("digest",))
        binding = self.fields(doc["pickle"], "pickle", ("bytes", "sha256"))
        self.integer(binding["bytes"], "pickle.bytes")
        if not _is_hex(self.text(binding["sha256"], "pickle.sha256"), 64):
            raise self.fail("pickle.sha256 must be 64 lower-case hex digits")
        recorded_digest = doc.get("digest")
        if recorded_digest is not None and not _is_hex(self.text(recorded_digest, "digest"), 64):
            raise self.fail("digest must be 64 lower-case hex digits")
        if not isinstance(doc["state_dict_metadata"], dict):
            raise self.fail("state_dict_metadata must be an object")
        entries: dict[str, Any] = {}
        for fqn, entry in doc["state_dict_metadata"].items():
            what = f"state_dict_metadata[{fqn!r:.80}]"
            kind = entry.get("type") if isinstance(entry, dict) else None
            if kind == "bytes":
                self.fields(entry, what, ("type",))
                entries[fqn] = BytesStorageMetadata()
            elif kind == "tensor":
                entries[fqn] = self.tensor(entry, what)
            else:
                raise self.fail(f"{what}.type {kind!r:.40} is not 'tensor' or 'bytes'")
        planner = doc["planner_data"]
        if planner is not None:
            if not isinstance(planner, dict):
                raise self.fail("planner_data must be an object or null")
            for fqn, path in planner.items():
                if not isinstance(path, list) or not all(isinstance(part, str) or (
                        isinstance(part, int) and not isinstance(part, bool)) for part in path):
                    raise self.fail(f"planner_data[{fqn!r:.80}] must be a list of strings and integers")
            planner = {fqn: tuple(path) for fqn, path in planner.items()}
        metadata = Metadata(state_dict_metadata=entries, planner_data=planner,
                            storage_data=self.storage_data(doc["storage_data"], entries),
                            storage_meta=self.storage_meta(doc["storage_meta"]),
                            version=self.optional_text(doc["version"], "version"))
        # Every field is valid; now the document as a whole. The digest first: a changed byte is
        # then reported as what it is, not as whichever inconsistency it happens to cause.
        if recorded_digest is not None and _digest(doc) != recorded_digest:
            raise self.fail("its content does not match its digest: the file was changed or damaged "
                            "after it was written")
        check_metadata(metadata, self.where, rank_local=self.rank_local)
        return metadata, binding

    def storage_data(self, raw: Any, entries: dict[str, Any]) -> dict[MetadataIndex, GdsStorageInfo]:
        if not isinstance(raw, list):
            raise self.fail("storage_data must be a list")
        out: dict[MetadataIndex, GdsStorageInfo] = {}
        for number, item in enumerate(raw):
            what = f"storage_data[{number}]"
            # "file_id" is optional: metadata written before rank files had ids has none
            self.fields(item, what, ("fqn", "offset", "index", "file", "key", "length"), optional=("file_id",))
            fqn = self.text(item["fqn"], f"{what}.fqn")
            if fqn not in entries:
                raise self.fail(f"{what}.fqn {fqn!r:.80} is not in state_dict_metadata")
            offset = None if item["offset"] is None else self.dims(item["offset"], f"{what}.offset")
            index = MetadataIndex(fqn, offset, self.optional_integer(item["index"], f"{what}.index"))
            file = self.text(item["file"], f"{what}.file")
            if Path(file).name != file or file in ("", ".", "..") or "\0" in file:
                raise self.fail(f"{what}.file {file!r:.80} is not a file name inside the checkpoint")
            if index in out:
                raise self.fail(f"{what}: {fqn!r:.80} at offset {offset} is listed twice")
            file_id = self.optional_text(item.get("file_id"), f"{what}.file_id")
            if file_id is not None and not _is_hex(file_id, _FILE_ID_HEX_DIGITS):
                raise self.fail(f"{what}.file_id must be {_FILE_ID_HEX_DIGITS} lower-case hex digits")
            out[index] = GdsStorageInfo(file, self.text(item["key"], f"{what}.key"),
                                        self.integer(item["length"], f"{what}.length"), file_id)
        return out

    def storage_meta(self, raw: Any) -> StorageMeta | None:
        if raw is None:
            return None
        self.fields(raw, "storage_meta", ("checkpoint_id", "save_id", "load_id", "modules"))
        modules = raw["modules"]
        if not isinstance(modules, list):
            raise self.fail("storage_meta.modules must be a list of strings")
        ids = {name: self.optional_text(raw[name], f"storage_meta.{name}")
               for name in ("checkpoint_id", "save_id", "load_id")}
        return StorageMeta(**ids,
                           modules=[self.text(m, "storage_meta.modules") for m in modules])


def decode_metadata_json(data: bytes, where: str, *, rank_local: bool = False) -> tuple[Metadata, dict[str, Any]]:
    """Validate ``.metadata.json`` bytes strictly (schema 1: fields, digest, ``check_metadata``;
    ``rank_local`` for ``__<rank>.metadata.json``, as there) and rebuild DCP's ``Metadata``;
    returns it with the ``pickle`` binding. Raises ``CorruptCheckpointError`` naming the field."""
    return _MetadataJsonDecoder(where, rank_local).decode(data)


# ---------------------------------------------------------------------------------------------
# consistency of a whole Metadata (decoded from JSON, or a trusted pickle)

def check_metadata(metadata: Metadata, where: str, *, rank_local: bool = False) -> None:
    """Refuse, with a ``CorruptCheckpointError`` naming ``where`` and the tensor or entry, metadata
    that cannot describe a checkpoint ``GdsStorageWriter`` wrote: the chunks of a tensor that do not
    tile it exactly (outside its bounds, overlapping, or leaving elements uncovered: DCP's default
    save planner refuses such a plan; ``rank_local`` metadata, of one rank's save without
    collectives, holds only that rank's chunks, which may leave elements uncovered), a storage
    entry for no chunk of its tensor or under another key than ``item_key`` gives it, or two
    entries of one rank file with different ``file_id``.
    Entries not written by ``GdsStorageWriter`` (a trusted pickle of torch's ``FileSystemWriter``)
    are left to the reader, which refuses them by name."""
    def fail(message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid DCP metadata {where}: {message}")

    chunk_offsets: dict[str, set[tuple[int, ...]]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            problem = _tiling_problem(md.size, md.chunks, complete=not rank_local)
            if problem is not None:
                raise fail(f"the chunks of {fqn!r:.80} {problem}")
            chunk_offsets[fqn] = {tuple(chunk.offsets) for chunk in md.chunks}
    file_ids: dict[str, str | None] = {}
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(info, GdsStorageInfo):
            continue
        what = f"storage entry {index.fqn!r:.80} at offset {None if index.offset is None else list(index.offset)}"
        if index.fqn not in metadata.state_dict_metadata:
            raise fail(f"{what} is for no entry of state_dict_metadata")
        if index.fqn in chunk_offsets:
            if index.offset is None or tuple(index.offset) not in chunk_offsets[index.fqn]:
                raise fail(f"{what} is for no chunk of that tensor")
        elif index.offset is not None:
            raise fail(f"{what} has an offset, but {index.fqn!r:.80} is a byte item")
        if info.key != item_key(index):
            raise fail(f"{what} names key {info.key!r:.80}; that item's key is {item_key(index)!r:.80}")
        if file_ids.setdefault(info.relative_path, info.file_id) != info.file_id:
            raise fail(f"the entries of {info.relative_path!r:.80} name two file ids")


def _tiling_problem(size: torch.Size, chunks: list[ChunkStorageMetadata], complete: bool) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``size`` exactly (or, unless ``complete``, a part of
    it); None when they do.

    With every chunk inside the bounds, no two overlapping and as many elements in the chunks as
    in the tensor, every element lies in exactly one chunk. Overlaps are found by a sweep along the
    dimension in which the chunks' offsets vary most: a chunk is compared only with the chunks it
    meets along that dimension (a few for the shards DCP writes, not all of them)."""
    dims = len(size)
    for chunk in chunks:
        if len(chunk.offsets) != dims or len(chunk.sizes) != dims or any(
                o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, size)):
            return (f"do not fit its size {list(size)} (a chunk at offsets {list(chunk.offsets)}, "
                    f"sizes {list(chunk.sizes)})")
    held = sum(math.prod(chunk.sizes) for chunk in chunks)
    if held > math.prod(size) or (complete and held != math.prod(size)):
        return f"hold {held} elements; the tensor of size {list(size)} has {math.prod(size)}"
    if dims == 0:
        return None  # one element, held by at most one chunk
    boxes = [(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in chunks if math.prod(chunk.sizes)]
    if len(boxes) < 2:
        return None
    sweep = max(range(dims), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    boxes.sort(key=lambda box: box[0][sweep])
    open_boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in boxes:
        open_boxes = [(o, n) for o, n in open_boxes if o[sweep] + n[sweep] > offsets[sweep]]
        for other_offsets, other_sizes in open_boxes:
            if all(max(a, b) < min(a + m, b + n)
                   for a, m, b, n in zip(other_offsets, other_sizes, offsets, sizes)):
                return f"overlap (at offsets {list(other_offsets)} and {list(offsets)})"
        open_boxes.append((offsets, sizes))
    return None
