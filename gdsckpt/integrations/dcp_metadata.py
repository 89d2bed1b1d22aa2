"""DCP's ``Metadata`` as JSON (``.metadata.json``, schema 1): plain values only, encoded by the
writer and decoded and checked by the reader without unpickling anything from the file.

``GdsStorageWriter`` writes this form beside DCP's pickle ``.metadata``; ``GdsStorageReader``
reads it first (``gdsckpt.integrations.dcp``). Every field is validated strictly: a wrong type, an
unknown member, a duplicate key or a value out of range raises ``CorruptCheckpointError`` naming
the field.
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
from ..state import torch_dtype, torch_dtype_name

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


@dataclass(frozen=True)
class GdsStorageInfo:
    """Where one write item lives: the rank file (relative to the checkpoint directory), its key
    in that file (as ``gdsckpt.open(...).get`` takes it) and its length in bytes."""

    relative_path: str
    key: str
    length: int


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


def encode_metadata_json(metadata: Metadata, pickled: bytes) -> bytes:
    """The JSON form of ``metadata`` (schema 1), bound to ``pickled`` (the ``.metadata`` bytes
    written with it) by length and SHA-256. Raises ``UnexpressibleMetadata`` naming the first value the
    schema cannot hold, or when the JSON would not decode to a ``Metadata`` equal to ``metadata``."""
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
                        "length": info.length})
    storage_meta = metadata.storage_meta
    meta = None if storage_meta is None else {
        "checkpoint_id": storage_meta.checkpoint_id, "save_id": storage_meta.save_id,
        "load_id": storage_meta.load_id, "modules": storage_meta.modules}
    doc = {"format": METADATA_JSON_FORMAT, "schema": METADATA_JSON_SCHEMA,
           "pickle": {"bytes": len(pickled), "sha256": hashlib.sha256(pickled).hexdigest()},
           "version": metadata.version, "state_dict_metadata": tensors, "planner_data": planner,
           "storage_data": storage, "storage_meta": meta}
    try:
        data = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
        decoded, _binding = decode_metadata_json(data, "being written")
    except (TypeError, ValueError, CheckpointError) as err:  # a value of a type the schema lacks
        raise UnexpressibleMetadata(str(err)) from err
    # A field of a type the schema does not keep (a list where DCP holds a tuple, a str subclass,
    # an index hint) would decode to something else: such metadata is written as the pickle only.
    hints = [index.index for index in metadata.storage_data]
    if decoded != metadata or [index.index for index in decoded.storage_data] != hints:
        raise UnexpressibleMetadata("a field whose type the JSON form does not keep")
    return data


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r:.80}")
        out[key] = value
    return out


class _MetadataJsonDecoder:
    """Strict schema-1 validation of one ``.metadata.json``; every error names the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid DCP metadata {self.where}: {message}")

    def fields(self, value: Any, what: str, names: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be an object, got {type(value).__name__}")
        missing = [name for name in names if name not in value]
        unknown = [name for name in value if name not in names]
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
        self.fields(doc, "the document", ("format", "schema", "pickle", "version", "state_dict_metadata",
                                          "planner_data", "storage_data", "storage_meta"))
        binding = self.fields(doc["pickle"], "pickle", ("bytes", "sha256"))
        self.integer(binding["bytes"], "pickle.bytes")
        digest = self.text(binding["sha256"], "pickle.sha256")
        if len(digest) != 64 or digest.strip("0123456789abcdef"):
            raise self.fail("pickle.sha256 must be 64 lower-case hex digits")
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
        return Metadata(state_dict_metadata=entries, planner_data=planner,
                        storage_data=self.storage_data(doc["storage_data"], entries),
                        storage_meta=self.storage_meta(doc["storage_meta"]),
                        version=self.optional_text(doc["version"], "version")), binding

    def storage_data(self, raw: Any, entries: dict[str, Any]) -> dict[MetadataIndex, GdsStorageInfo]:
        if not isinstance(raw, list):
            raise self.fail("storage_data must be a list")
        out: dict[MetadataIndex, GdsStorageInfo] = {}
        for number, item in enumerate(raw):
            what = f"storage_data[{number}]"
            self.fields(item, what, ("fqn", "offset", "index", "file", "key", "length"))
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
            out[index] = GdsStorageInfo(file, self.text(item["key"], f"{what}.key"),
                                        self.integer(item["length"], f"{what}.length"))
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


def decode_metadata_json(data: bytes, where: str) -> tuple[Metadata, dict[str, Any]]:
    """Validate ``.metadata.json`` bytes strictly (schema 1) and rebuild DCP's ``Metadata``;
    returns it with the ``pickle`` binding. Raises ``CorruptCheckpointError`` naming the field."""
    return _MetadataJsonDecoder(where).decode(data)
