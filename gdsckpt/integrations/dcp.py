"""torch.distributed.checkpoint (DCP) storage layer: ``GdsStorageWriter`` and ``GdsStorageReader``.

``torch.distributed.checkpoint.save`` / ``async_save`` / ``load`` work unchanged with them::

    import torch.distributed.checkpoint as dcp
    from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter

    dcp.save({"model": model.state_dict()}, storage_writer=GdsStorageWriter("ckpt/step-100"))
    dcp.load(state, storage_reader=GdsStorageReader("ckpt/step-100"))

A checkpoint is a directory, or an ``s3://bucket/prefix`` URL (the same files as objects below
the prefix, ``gdsckpt.io.s3``; each object appears whole, so the atomic renames below become
single PUTs). Each rank writes one gdsckpt file, ``__<rank>_<file id>.gdsckpt``, through
``gdsckpt.save`` (chunked, compressed, checksummed, atomic): a flat dict of that rank's write
items, keyed ``"<fqn>@<chunk offsets>"`` (the ``MetadataIndex`` of the item). Tensors are stored
as tensors; DCP's byte items (non-tensor state, which DCP itself serialises) are stored as raw
``uint8`` tensors. Each ``WriteResult.storage_data`` is a ``GdsStorageInfo`` (file name, key,
length). The coordinator writes DCP's ``Metadata`` last, twice, each through a temporary file,
fsync, rename and directory fsync: first as JSON, ``.metadata.json`` (a strict schema of plain
values, which a reader decodes without running code from the file; it records the SHA-256 of the
``.metadata`` written with it), then as DCP's own pickle, ``.metadata``, the way
``FileSystemWriter`` does (so older gdsckpt versions, and DCP tools that read the metadata alone,
read it; torch's ``FileSystemReader`` cannot read the rank files, and its first read of one raises
``UnsupportedFormatError`` naming ``GdsStorageReader``).
``.metadata`` is written last: a directory without it is not a checkpoint. Metadata that the JSON
schema cannot express (a custom planner's ``planner_data``, a dtype outside the table) is written
as the pickle only, with a ``PickleOnlyMetadataWarning``.

**A save into a directory that holds a checkpoint replaces it only when it has succeeded.** Its
rank files have names of their own (the save's random file id), so the previous checkpoint's
metadata and the rank files it names stay as they were while the ranks write. If any rank fails
(an error, a full disk, a killed process), DCP raises on every rank and never calls ``finish``:
the previous checkpoint still loads, beside the failed save's files (so the storage needs room
for both checkpoints until a save has succeeded). Once the new metadata is
written, the coordinator removes the rank files it does not name (the previous checkpoint's and
any failed save's) and stale rank-local ``__<rank>.metadata`` files of an earlier save with
``use_collectives=False``, which ``dcp.load`` would otherwise fall back to; a save without
collectives removes only its own rank's. Such a save (torch's experimental
``use_collectives=False``) has no moment when every rank is known to have succeeded: the first
rank to finish removes a collective checkpoint's ``.metadata`` (``dcp.load`` reads it before any
rank-local one, and it names files this save replaces), so a rank whose own save then fails can
no longer load the collective checkpoint with ``dcp.load`` (its rank files stay); the writer warns
when such a save starts over a collective checkpoint. A process killed between the two metadata renames
leaves a ``.metadata.json`` that does not describe ``.metadata``, which the reader refuses,
naming both (nothing is removed before both are written). The JSON form's encoder and strict
decoder live in ``dcp_metadata``; it carries a digest of its own content, and its chunks and
storage entries are checked to fit together (``check_metadata``).

Each save writes its random id into each rank file as well (an empty array keyed
``gdsckpt.dcp.file_id.<id>``) and records it in every storage entry of that file
(``GdsStorageInfo.file_id``). A reader refuses a rank file holding another id, naming it, and a
rank file that is missing: two saves to one directory at once end with the metadata of the one
that finished last, whose files the other's ``finish`` may have removed. Either way the load
fails with a message, never with a mix of two saves.

A writer refuses early what would fail inside ``write_data``: an unknown codec, a compression
level the codec refuses, a GPU-only codec where no GPU is usable (at construction), a sparse
tensor or a dtype gdsckpt cannot store (in ``prepare_local_plan``), so that the save fails
before any rank writes. What the plan does not show (a tensor on the ``meta`` device, a GPU-only
codec for state in host memory) fails in ``write_data``, which leaves the previous checkpoint
as it was.

Loading reads ``.metadata.json`` (never the pickle, unless ``GdsStorageReader(trust_pickle=True)``),
groups the read items by rank file, opens each file once with ``gdsckpt.open`` and reads only the
keys it needs (gdsckpt reads only those arrays' chunks), then narrows each to the requested offsets
and lengths (resharding: load at any world size) and copies it into the planner's tensor, or hands
the bytes to ``planner.load_bytes``. DCP's planner deserialises those bytes with
``torch.load(weights_only=False)``, which runs whatever code they name: without ``trust_pickle``
the reader first loads them with torch's ``weights_only`` loader (an allow-list of plain types)
and refuses, naming it, an item that loader refuses.

Before copying, the reader checks each stored array against the metadata, from the rank file's
index: its dtype must be the tensor's and its shape the chunk's (a byte item: one dimension of
``uint8``). The *target*'s
dtype is the planner's business, as with torch's ``FileSystemReader``: a tensor saved as
``float32`` loads into a ``bfloat16`` target rounded (``Tensor.copy_``), the way a model is loaded
at another precision, and an ``int64`` into an ``int32`` target wraps. Compare
``state_dict_metadata`` dtypes yourself before loading where that must not happen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import pickle
import re
import threading
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import api
from ..api.resolve import check_portable, resolve_config
from ..codecs import codec_spec, versioned_name
from ..codecs.nvcomp import gpu_available
from ..config import Config, check_level
from ..errors import CheckpointError, CodecUnavailableError, CorruptCheckpointError, PickleOnlyMetadataWarning
from ..io.posix import fsync_directory, read_small_file, remove_if_stale, temporary_target, write_atomically
from ..io.s3 import SCHEME, is_url
from ..state import torch_dtype_name
from .dcp_metadata import (
    DCP_VERSION,
    FILE_ID_PREFIX,
    JSON_SUFFIX,
    MAX_METADATA_JSON_BYTES,
    METADATA_NAME,
    SUFFIX,
    GdsStorageInfo,
    UnexpressibleMetadata,
    check_metadata,
    decode_metadata_json,
    encode_metadata_json,
    item_key,
    item_name,
)

logger = logging.getLogger("gdsckpt")

READ_BATCH_BYTES = 1 << 30
"""Most stored bytes one restore of a rank file reads (load side): into the destinations, where
items fill them whole; else ``Config.max_inflight_bytes`` at most, held until delivered."""

__all__ = ["GdsStorageInfo", "GdsStorageReader", "GdsStorageWriter", "PickleOnlyMetadataWarning",
           "item_key"]



@dataclass(frozen=True)
class _FilePrefix:
    prefix: str


_RANK_METADATA = re.compile(r"__[0-9]+" + re.escape(METADATA_NAME) + r"(" + re.escape(JSON_SUFFIX) + r")?")
"""Names of rank-local metadata files, ``__<rank>.metadata`` and ``__<rank>.metadata.json``."""
_RANK_FILE = re.compile(r"__[0-9]+_[0-9A-Za-z]+" + re.escape(SUFFIX))
"""Names of rank files: ``__<rank>_<file id>.gdsckpt`` (``__<rank>_0.gdsckpt`` before file ids
were in the names)."""
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _fsync_dir(path: Path, timeout: float) -> None:
    try:
        fsync_directory(path, timeout=timeout)
    except OSError:  # a TimeoutError too: the removal this follows is done either way
        pass


def _location(path: str | os.PathLike[str]) -> Path | str:
    """A checkpoint's place: a local directory, or an ``s3://`` URL kept as text. Any other URL
    (``gs://``, ``S3://``, ``file:///...``) is a ``ValueError``: taken as a path it would name a
    directory ``gs:/...`` below the working directory."""
    if is_url(path):
        return str(path).rstrip("/")
    if isinstance(path, str) and _URL_SCHEME.match(path):
        raise ValueError(f"checkpoint location {path!r} is a URL of a scheme gdsckpt does not store to: "
                         f"give a local directory, or an object prefix as {SCHEME}bucket/prefix "
                         f"(the only URL scheme supported, in lower case)")
    return Path(path)


def _check_codec(codec: str, config: Config) -> None:
    """Refuse, as ``gdsckpt.save`` would only once a rank writes, a codec this installation does not
    know (``ValueError`` listing the known ones), a GPU-only codec where no GPU engine can run it
    (``CodecUnavailableError``), and a compression level the CPU engine's codec refuses
    (``ValueError``; ``config.level`` applies to zstd, the CPU codec ``"auto"`` uses, and deflate)."""
    check_portable(config, codec)
    name = config.codec if codec == "auto" else codec
    if name != "auto":
        versioned_name(name)  # ValueError listing the known names ("zstd/9", "nvcomp.ans")
        if codec_spec(name).host is None and (config.engine == "cpu" or not gpu_available()):
            raise CodecUnavailableError(
                f"codec {name!r} runs only on the GPU engine (nvCOMP), which "
                f"{'engine=cpu rules out' if config.engine == 'cpu' else 'is not usable here'}: "
                f"choose a portable codec (zstd, lz4, deflate, none) or codec='auto'")
    check_level(name, config.level)


def _check_write_items(plan: SavePlan) -> None:
    """Refuse a plan item ``gdsckpt.save`` cannot store, naming it: a sparse (non-strided) tensor,
    or a dtype outside gdsckpt's table. What the plan does not tell (the device) is checked when
    the rank writes."""
    for item in plan.items:
        data = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or data is None:
            continue
        props = data.properties
        if props.layout != torch.strided:
            raise TypeError(f"tensor {item.index.fqn!r} has layout {props.layout}; GdsStorageWriter saves "
                            f"dense (strided) tensors only: convert it with .to_dense()")
        if torch_dtype_name(props.dtype) is None:
            raise TypeError(f"tensor {item.index.fqn!r} has dtype {props.dtype}, which gdsckpt cannot store")


@dataclass
class _Save:
    """One save's settings, fixed when DCP sets the writer up for it: a later ``reset`` (of another
    save with the same writer) does not move them."""

    path: Path | str
    thread: threading.Thread
    is_coordinator: bool
    rank: int | None
    use_collectives: bool
    save_id: str


class _Files:
    """The few file operations DCP's writer and reader need, on a local directory or on the
    objects below an ``s3://`` prefix (``ObjectDirectory``): a file's location for
    ``gdsckpt.save`` / ``gdsckpt.open``, and small files written whole, read, sized, removed."""

    def __init__(self, location: Path | str, config: Config | None):
        self.location = location
        self.timeout = resolve_config(config).timeout
        """Seconds an fsync of this directory's files may take (``Config.timeout``)."""
        self._objects: Any = None
        if isinstance(location, str):
            from ..io.s3 import ObjectDirectory

            resolved = resolve_config(config)
            self._objects = ObjectDirectory(location, endpoint=resolved.s3_endpoint, timeout=resolved.timeout)

    def of(self, name: str) -> Path | str:
        """Where file ``name`` is: a path, or an object's URL."""
        return self._objects.url_of(name) if self._objects is not None else Path(self.location) / name

    def make(self) -> None:
        """Create the directory (objects need none)."""
        if self._objects is None:
            Path(self.location).mkdir(parents=True, exist_ok=True)

    def names(self) -> list[str]:
        """The names of the files directly in the directory (none if there is no directory)."""
        if self._objects is not None:
            return list(self._objects.names())
        try:
            return os.listdir(self.location)
        except FileNotFoundError:
            return []

    def size(self, name: str) -> int | None:
        """The size of file ``name``, None if there is none."""
        if self._objects is None:
            path = Path(self.location) / name
            return path.stat().st_size if path.is_file() else None
        return self._objects.size(name)

    def read(self, name: str, limit: int) -> bytes:
        """The whole of file ``name`` (at most ``limit`` bytes, ``CorruptCheckpointError`` if
        larger); ``FileNotFoundError`` if there is none."""
        if self._objects is None:
            return read_small_file(Path(self.location) / name, limit)
        return self._objects.read_small(name, limit)

    def sha256(self, name: str, size: int) -> str:
        """The SHA-256 of file ``name`` (``size`` bytes): a file is read in blocks, an object whole."""
        if self._objects is not None:
            return hashlib.sha256(self._objects.read_small(name, max(size, 1))).hexdigest()
        digest = hashlib.sha256()
        with (Path(self.location) / name).open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return digest.hexdigest()

    def write(self, name: str, data: bytes, fsync: bool) -> None:
        """Replace file ``name`` with ``data`` whole: readers see the old or the new."""
        if self._objects is None:
            write_atomically(Path(self.location) / name, data, fsync=fsync, timeout=self.timeout)
        else:
            self._objects.write_small(name, data)

    def remove(self, name: str, fsync: bool) -> None:
        """Remove file ``name`` if it is there."""
        if self._objects is not None:
            self._objects.remove(name)
            return
        path = Path(self.location) / name
        if path.exists():
            path.unlink()
            if fsync:
                _fsync_dir(Path(self.location), self.timeout)


class _DirectoryCheckpoint:
    """What writer and reader share of DCP's protocol: the checkpoint is the directory (or
    ``s3://`` prefix) ``path``."""

    path: Path | str

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        if isinstance(checkpoint_id, Path) or is_url(checkpoint_id):
            return True
        if "://" in str(checkpoint_id):
            return False
        return any(p.exists() and os.access(p, os.W_OK) for p in Path(checkpoint_id).parents)

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        return self.path


class GdsStorageWriter(_DirectoryCheckpoint, StorageWriter):
    """A DCP ``StorageWriter`` that writes one compressed gdsckpt file per rank into ``path``.

    ``codec`` and ``config`` are those of ``gdsckpt.save``; further keyword ``options`` override
    fields of the configuration (``chunk_bytes=``, ``fsync=``, ``level=``, ...). ``fsync`` also
    governs the metadata files. A checkpoint already in ``path`` is replaced once the save has
    succeeded (its metadata, then its rank files and stale rank-local ``__<rank>.metadata``
    files removed); a save that fails leaves it loadable (module docstring). Metadata that
    ``.metadata.json`` cannot express is written to ``.metadata`` only, with a
    ``PickleOnlyMetadataWarning``.

    The constructor refuses an unknown codec or level, and a GPU-only codec where no GPU engine is
    usable (``ValueError`` / ``CodecUnavailableError``); ``path`` may be a directory or an
    ``s3://`` prefix, any other URL is a ``ValueError``. Saves with one writer from several
    threads at once (``dcp.async_save`` while another runs) each keep what DCP set up in their
    own thread: the location named by that thread's ``reset(checkpoint_id)``, else the writer's
    ``path`` when the save is set up, which ``reset`` with a ``checkpoint_id`` moves for every
    later save, as torch's ``FileSystemWriter`` does. An ``async_save`` without a
    ``checkpoint_id`` thus writes where the writer points when its thread starts the save: give
    each save its ``checkpoint_id`` to fix it at the call.
    """

    def __init__(self, path: str | os.PathLike[str], *, codec: str = "auto", config: Config | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.path = _location(path)
        self.codec = codec
        unknown = sorted(set(options) - {field.name for field in dataclasses.fields(Config)})
        if unknown:
            raise TypeError(f"GdsStorageWriter got unknown option(s) {', '.join(map(repr, unknown))}: it takes "
                            f"path, codec=, config= and the fields of gdsckpt.Config (chunk_bytes=, fsync=, "
                            f"level=, portable=, ...); torch FileSystemWriter's own options do not apply, and "
                            f"lossy= and delta saves are not available through DCP")
        self.config = resolve_config(config, **options)
        _check_codec(codec, self.config)  # here, not in every rank's write after the old metadata went
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = False
        self.save_id = str(uuid.uuid4())
        self._init_saves()

    def _init_saves(self) -> None:
        self._lock = threading.Lock()
        self._saves: dict[int, _Save] = {}
        """Thread id -> the save that thread runs (from ``set_up_storage_writer`` to the end of this
        rank's part). Per thread, not one per writer: DCP tells a writer nothing when a save fails
        before ``write_data`` (a planner's error, another rank's), so a writer-wide record of the
        save in flight could not tell a failed save from a running one."""
        self._reset_paths: dict[int, Path | str] = {}
        """Thread id -> the location its ``reset`` named, for the save that thread sets up next."""

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process-based async_save sends the writer to another process: without the lock
        # and this process's saves in flight
        state = self.__dict__.copy()
        for name in ("_lock", "_saves", "_reset_paths"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_saves()

    # -- protocol ------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, at ``checkpoint_id`` when given (DCP calls it with ``save``'s
        ``checkpoint_id``)."""
        with self._lock:
            if checkpoint_id:
                self.path = _location(checkpoint_id)
                self._reset_paths[threading.get_ident()] = self.path
            self.save_id = str(uuid.uuid4())

    @property
    def _files(self) -> _Files:
        return _Files(self._current().path, self.config)

    def storage_meta(self) -> StorageMeta | None:
        """DCP's ``StorageMeta`` of the save running in this thread (its path and save id), else of
        this writer's own path and last save id."""
        save = self._saves.get(threading.get_ident())
        if save is not None and save.thread is threading.current_thread():
            return StorageMeta(checkpoint_id=str(save.path), save_id=save.save_id)
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Begin a save in this thread: record its path (a ``reset`` checkpoint id, else this
        writer's), rank, whether collectives run, and a new save id; warn when a save without
        collectives goes into a directory holding a collective checkpoint."""
        with self._lock:
            # Records of threads that have ended go (a failed save's, whose thread never returned).
            self._saves = {ident: save for ident, save in self._saves.items() if save.thread.is_alive()}
            path = self._reset_paths.pop(threading.get_ident(), self.path)
            save = _Save(path=path, thread=threading.current_thread(), is_coordinator=is_coordinator,
                         rank=kwargs.get("rank"), use_collectives=kwargs.get("use_collectives", True),
                         save_id=str(uuid.uuid4()))
            self._saves[threading.get_ident()] = save
            self.save_id = save.save_id
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        if not save.use_collectives:
            try:
                collective = _Files(path, self.config).size(METADATA_NAME) is not None
            except (OSError, CheckpointError):
                collective = False
            if collective:
                warnings.warn(f"a DCP save without collectives into {str(path)!r}, which holds a collective "
                              f"checkpoint: the first rank to finish removes its {METADATA_NAME}, and a rank "
                              f"whose save fails then cannot load it with dcp.load any more; save into a new "
                              f"directory to keep it", UserWarning, stacklevel=2)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse an item ``gdsckpt.save`` cannot store (before any rank writes), create the
        directory, and without collectives give the plan this rank's file prefix."""
        # An item gdsckpt cannot store fails the save here, before any rank writes.
        _check_write_items(plan)
        save = self._current()
        self._files.make()
        if not save.use_collectives and save.rank is not None:
            plan = dataclasses.replace(plan, storage_data=_FilePrefix(f"__{save.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each rank's plan without one its file prefix (``__<rank>_``); nothing of the
        previous checkpoint is removed here."""
        # Nothing of the previous checkpoint is removed here: every rank writes files of new
        # names, and the previous metadata with the files it names stays loadable until finish
        # replaces it. A save that fails on any rank leaves the directory as it was.
        return [dataclasses.replace(plan, storage_data=_FilePrefix(f"__{i}_"))
                if plan.storage_data is None else plan for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into one gdsckpt file of a new name; a completed future of their
        ``WriteResult``s. With collectives, a rank other than the coordinator ends its part of the
        save here; ``finish`` ends the others'."""
        save = self._current()
        try:
            future = self._write_rank_file(plan, planner)
        except BaseException:
            self._release(save)  # DCP calls no finish after a failed write
            raise
        if save.use_collectives and not save.is_coordinator:
            self._release(save)  # this rank's part of the save is done: finish runs on the coordinator
        return future

    def _write_rank_file(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items to its rank file, with a new file id (``GdsStorageInfo``)."""
        prefix: _FilePrefix = plan.storage_data
        file_id = uuid.uuid4().hex
        # A name of its own per save: the previous checkpoint's rank files stay as they are until
        # this save's metadata has replaced theirs (``_remove_unnamed``).
        file_name = f"{prefix.prefix}{file_id}{SUFFIX}"
        # An empty array whose key holds the id: a reader finds it in the index, reading no chunk.
        state: dict[str, Any] = {FILE_ID_PREFIX + file_id: torch.empty(0, dtype=torch.uint8)}
        results: list[WriteResult] = []
        for item in plan.items:
            name, key = item_name(item.index), item_key(item.index)
            if name in state:
                raise ValueError(f"two write items map to the same key {key!r}")
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise TypeError(f"byte item {item.index.fqn!r} resolved to {type(data).__name__}, "
                                    f"not io.BytesIO")
                value: Any = torch.from_numpy(np.frombuffer(data.getvalue(), dtype=np.uint8).copy())
                length = value.numel()
            else:
                if not isinstance(data, torch.Tensor):
                    raise TypeError(f"tensor item {item.index.fqn!r} resolved to {type(data).__name__}")
                value = data.detach()
                length = value.numel() * value.element_size()
            state[name] = value  # escaped once, by gdsckpt.save: the stored key is ``key``
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=GdsStorageInfo(file_name, key, length, file_id)))
        api.save(state, self._files.of(file_name), codec=self.codec, config=self.config)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write the metadata naming this save's rank files, replacing the previous checkpoint's,
        then remove the rank files it does not name; ends the save either way."""
        save = self._current()
        try:
            self._write_metadata(save, metadata, results)
            self._remove_unnamed(save, results)
        finally:
            self._release(save)

    def _write_metadata(self, save: _Save, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata.json`` and then ``.metadata`` (rank-local ones without collectives)
        into the directory of ``save``."""
        metadata.version = DCP_VERSION
        storage_md: dict[MetadataIndex, Any] = {}
        for rank_results in results:
            storage_md.update({result.index: result.storage_data for result in rank_results})
        metadata.storage_data = storage_md
        metadata.storage_meta = StorageMeta(checkpoint_id=str(save.path), save_id=save.save_id)
        final = self._metadata_path(None if save.use_collectives else save.rank)
        pickled = pickle.dumps(metadata)  # DCP's own serialisation of Metadata (as FileSystemWriter)
        json_name = final + JSON_SUFFIX
        files = self._files
        try:
            encoded: bytes | None = encode_metadata_json(metadata, pickled, rank_local=not save.use_collectives)
        except UnexpressibleMetadata as err:
            encoded = None
            warnings.warn(f"DCP metadata of {str(save.path)!r} is written as the pickle {final} only: "
                          f"{err} has no JSON form; GdsStorageReader loads it only with trust_pickle=True",
                          PickleOnlyMetadataWarning, stacklevel=2)
        # The JSON goes first and .metadata last: .metadata marks the checkpoint complete, and the
        # JSON names the .metadata it was written with (length and SHA-256). Should .metadata not
        # be written (a full disk, say), the previous JSON is put back: it describes the previous
        # .metadata, still in place, and the previous checkpoint loads as before.
        try:
            previous: bytes | None = files.read(json_name, MAX_METADATA_JSON_BYTES)
        except (FileNotFoundError, CheckpointError):
            previous = None
        try:
            if encoded is None:
                files.remove(json_name, self.config.fsync)
            else:
                files.write(json_name, encoded, self.config.fsync)
            files.write(final, pickled, self.config.fsync)
        except BaseException:
            try:
                if previous is None:
                    files.remove(json_name, self.config.fsync)
                else:
                    files.write(json_name, previous, self.config.fsync)
            except (OSError, CheckpointError) as err:
                logger.error("gdsckpt: the DCP save to %s failed writing %s, and putting the previous %s "
                             "back failed too: %s", str(save.path), final, json_name, err)
            raise

    def _remove_unnamed(self, save: _Save, results: list[list[WriteResult]]) -> None:
        """Once the metadata of ``save`` is written: remove the rank files it does not name (the
        previous checkpoint's, a failed save's) and, after a collective save, rank-local
        ``__<rank>.metadata`` files of an earlier save without collectives, which ``dcp.load``
        would fall back to were ``.metadata`` ever missing. A save without collectives removes
        a collective checkpoint's ``.metadata`` (which ``dcp.load`` reads first) and then only
        its own rank's files. The save is complete whatever this step meets: a file it cannot
        remove is logged and left."""
        named = {result.storage_data.relative_path for rank_results in results for result in rank_results
                 if isinstance(result.storage_data, GdsStorageInfo)}
        files = self._files
        own = None if save.use_collectives else f"__{save.rank}_"
        try:
            if not save.use_collectives:
                # A collective checkpoint's .metadata, which dcp.load reads before any rank-local
                # one, names rank files this save replaces: it goes before they do.
                self._remove_metadata(self._metadata_path())
            names = files.names()
            stale = [name for name in names if _RANK_FILE.fullmatch(name) and name not in named
                     and (own is None or name.startswith(own))]
            if save.use_collectives:
                metadata = sorted(name for name in names if _RANK_METADATA.fullmatch(name))
                for name in metadata:  # each .metadata with its JSON, then any JSON left without one
                    if not name.endswith(JSON_SUFFIX) or name[:-len(JSON_SUFFIX)] not in metadata:
                        self._remove_metadata(name.removesuffix(JSON_SUFFIX))
            for name in stale:
                files.remove(name, fsync=False)
            if not isinstance(save.path, str):
                # A rank killed while writing left its rank file's temporary: no later save writes
                # that file name again, so gdsckpt.save's own sweep of its target never finds it.
                for name in names:
                    made_for = temporary_target(name)
                    if made_for is not None and _RANK_FILE.fullmatch(made_for[0]) and made_for[0] not in named \
                            and (own is None or made_for[0].startswith(own)):
                        remove_if_stale(Path(save.path) / name)
            if stale and self.config.fsync and not isinstance(save.path, str):
                _fsync_dir(Path(save.path), self.config.timeout)
        except (OSError, CheckpointError) as err:
            logger.warning("gdsckpt: the DCP save to %s is complete, but removing the files it replaced "
                           "failed: %s", str(save.path), err)

    # -- helpers -------------------------------------------------------------------------------

    def _current(self) -> _Save:
        """The save this thread runs: the one set up in it, or (called outside a DCP save, as a
        test may call ``finish``) one at the writer's own settings."""
        save = self._saves.get(threading.get_ident())
        if save is not None and save.thread is threading.current_thread():
            return save
        return _Save(path=self.path, thread=threading.current_thread(), is_coordinator=self.is_coordinator,
                     rank=self.rank, use_collectives=self.use_collectives, save_id=self.save_id)

    def _release(self, save: _Save) -> None:
        with self._lock:
            ident = save.thread.ident
            if ident is not None and self._saves.get(ident) is save:
                del self._saves[ident]

    @staticmethod
    def _metadata_path(rank: int | None = None) -> str:
        """The name of the (rank's) ``.metadata`` file."""
        return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"

    def _remove_metadata(self, name: str) -> None:
        # .metadata first: without it the directory is no checkpoint, whatever JSON remains
        files = self._files
        files.remove(name, self.config.fsync)
        files.remove(name + JSON_SUFFIX, self.config.fsync)


class GdsStorageReader(_DirectoryCheckpoint, StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by ``GdsStorageWriter``, at any world size.

    It reads DCP's metadata from ``.metadata.json`` (strictly validated JSON, which runs no code
    from the directory) and refuses DCP byte items that torch's ``weights_only`` loader refuses
    (DCP's planner unpickles them). It refuses with ``CorruptCheckpointError``, naming the file:
    metadata whose content no longer matches its digest or whose chunks and entries disagree
    (``dcp_metadata``), a rank file that another save replaced (its file id), and a stored array
    whose dtype or shape is not the metadata's. A target tensor of another dtype than the saved
    one is filled by ``copy_`` (rounded or wrapped), as torch's ``FileSystemReader`` does.
    ``path`` may be a directory or an ``s3://`` prefix; any other URL is a ``ValueError``.

    ``trust_pickle=True`` says the caller trusts the directory: then the pickled ``.metadata`` is
    read where no ``.metadata.json`` describes it (checkpoints of torch's ``FileSystemWriter``, of
    earlier gdsckpt versions, or saved with a ``PickleOnlyMetadataWarning``) and byte items go to
    the planner unchecked; both can run code.
    """

    def __init__(self, path: str | os.PathLike[str], *, config: Config | None = None,
                 trust_pickle: bool = False) -> None:
        super().__init__()
        self.path = _location(path)
        self.config = config
        self.trust_pickle = trust_pickle
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._stored_as: dict[MetadataIndex, tuple[str, tuple[int, ...] | None]] = {}
        """Storage index -> (dtype name, shape) of the array its rank file must hold for it (the
        chunk's sizes; None for a byte item: its recorded length)."""
        self.load_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Forget the previous load's storage data, read ``checkpoint_id`` from now on where one is
        given, and take a new load id."""
        self.storage_data = {}
        self._stored_as = {}
        if checkpoint_id:
            self.path = _location(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``Metadata`` of this checkpoint: from ``.metadata.json`` (strictly validated), or
        from the pickle only where ``trust_pickle`` allows it; a ``CheckpointError`` says why not.

        Some torch versions (2.11) catch that error inside ``dcp.load`` and raise only
        ``metadata is None``: the reason is therefore also logged (logger ``gdsckpt``, ERROR), so
        it reaches the user whatever torch does with the exception."""
        try:
            return self._read_metadata(kwargs.get("rank"))
        except CheckpointError as err:
            logger.error("gdsckpt: cannot read the DCP metadata of %s: %s", str(self.path), err)
            raise

    def _read_metadata(self, rank: int | None) -> Metadata:
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        files = _Files(self.path, self.config)
        size = files.size(name)
        if size is None:
            raise CheckpointError(f"{str(self.path)!r} is not a DCP checkpoint: no {name} (a save "
                                  f"that did not finish leaves none)")
        metadata = self._read_json_metadata(files, name, size, rank_local=rank is not None)
        if metadata is None:
            # trusted by the caller: DCP's pickled Metadata, checked as the JSON is
            metadata = pickle.loads(files.read(name, max(size, 1)))
            if not isinstance(metadata, Metadata):
                raise CorruptCheckpointError(f"{name} in {str(self.path)!r} holds a {type(metadata).__name__}, "
                                             f"not DCP's Metadata")
            check_metadata(metadata, f"{str(files.of(name))!r}", rank_local=rank is not None)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def _read_json_metadata(self, files: _Files, pickle_name: str, pickle_size: int, *,
                            rank_local: bool) -> Metadata | None:
        """The metadata from ``<pickle_name>.json`` if it describes the pickle (``pickle_size``
        bytes); None where the caller trusts the pickle and no JSON describes it; else a
        ``CheckpointError`` saying why."""
        trust = "pass GdsStorageReader(..., trust_pickle=True) if you trust the directory"
        json_name = pickle_name + JSON_SUFFIX
        try:
            json_data = files.read(json_name, MAX_METADATA_JSON_BYTES)
        except FileNotFoundError:
            if self.trust_pickle:
                return None
            raise CheckpointError(
                f"{str(self.path)!r} has only the pickled {pickle_name} (written by torch's "
                f"FileSystemWriter, by an earlier gdsckpt, or with a PickleOnlyMetadataWarning), and "
                f"unpickling runs any code the file names: {trust}") from None
        metadata, binding = decode_metadata_json(json_data, f"{str(files.of(json_name))!r}", rank_local=rank_local)
        # The length is compared first, so a large foreign file is not read; then the SHA-256 of
        # the pickle's bytes (read, never unpickled).
        matches = (pickle_size == binding["bytes"]
                   and files.sha256(pickle_name, pickle_size) == binding["sha256"])
        if not matches:
            if self.trust_pickle:
                return None
            raise CorruptCheckpointError(
                f"{json_name} does not describe {pickle_name} (their recorded length or "
                f"SHA-256 differ: another writer replaced {pickle_name}); to read "
                f"{pickle_name}, {trust}")
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """Take the storage data of ``metadata`` (``CorruptCheckpointError`` without it) and the
        dtype and shape each item was stored with, for the checks of ``read_data``."""
        if metadata.storage_data is None:
            raise CorruptCheckpointError("DCP metadata has no storage_data")
        self.storage_data = metadata.storage_data
        self._stored_as = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                dtype = torch_dtype_name(md.properties.dtype) or str(md.properties.dtype)
                for chunk in md.chunks:
                    self._stored_as[MetadataIndex(fqn, chunk.offsets)] = (dtype, tuple(chunk.sizes))
            else:
                self._stored_as[MetadataIndex(fqn)] = ("uint8", None)
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """``plan`` unchanged: each rank reads its own items from the rank files."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """``plans`` unchanged: nothing is coordinated between ranks for a load."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items rank file by rank file, each file's id and each item's stored dtype
        and shape checked, only the rows a resharded item needs, and hand them to ``planner``; a
        completed future."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = self._info(item)
            per_file.setdefault(info.relative_path, []).append(item)
        for relative_path, items in per_file.items():
            if Path(relative_path).name != relative_path:
                raise CorruptCheckpointError(f"DCP metadata names a file outside the checkpoint: "
                                             f"{relative_path!r}")
            with self._open_rank_file(relative_path) as ckpt:
                self._check_file_id(ckpt, relative_path, {self._info(item).file_id for item in items})
                # Several read items may take pieces of one stored item: each key is read once,
                # in batches (one parallel restore each, on the device their destination lives
                # on: ``_read_items``).
                by_key: dict[str, list[ReadItem]] = {}
                for item in items:
                    by_key.setdefault(self._info(item).key, []).append(item)
                for key, key_items in by_key.items():
                    self._check_stored(ckpt, relative_path, key, key_items)
                # A rank that needs only some rows of a stored item (resharding along dim 0, as
                # FSDP2 / Shard(0) does) reads only the chunks holding them.
                for key in list(by_key):
                    window = self._row_window(by_key[key], ckpt.info(key).shape)
                    if window is not None:
                        self._read_rows(ckpt, key, window, by_key.pop(key), planner)
                self._read_items(ckpt, by_key, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open_rank_file(self, relative_path: str) -> Any:
        """``gdsckpt.open`` of a rank file the metadata names; a missing one is a
        ``CorruptCheckpointError`` saying how that happens."""
        try:
            return api.open(_Files(self.path, self.config).of(relative_path), config=self.config)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{relative_path}, which the DCP metadata of {str(self.path)!r} names, is missing: another "
                f"save to this directory that finished later (two saves at once) removed it, or the "
                f"directory was copied in part; save it again") from None

    def _check_file_id(self, ckpt: Any, relative_path: str, expected: set[str | None]) -> None:
        """Refuse a rank file that another save wrote than the one this metadata describes: its
        file id (``FILE_ID_PREFIX`` key) must be the one recorded with its items. Metadata from
        before rank files had ids records none, and is not checked."""
        if expected == {None}:
            return
        if len(expected) != 1 or None in expected:
            raise CorruptCheckpointError(f"DCP metadata of {str(self.path)!r} names several file ids for "
                                         f"{relative_path}")
        (file_id,) = expected
        if FILE_ID_PREFIX + str(file_id) in ckpt:
            return
        found = [key[len(FILE_ID_PREFIX):] for key in ckpt if key.startswith(FILE_ID_PREFIX)]
        raise CorruptCheckpointError(
            f"{relative_path} in {str(self.path)!r} was written by another save than the one its DCP metadata "
            f"describes (file id {found[0] if found else 'none'}, the metadata's {file_id}): a later or "
            f"concurrent save to this directory replaced it, so the checkpoint would mix two saves; save "
            f"it again")

    def _check_stored(self, ckpt: Any, relative_path: str, key: str, items: list[ReadItem]) -> None:
        """Refuse a stored array that is not what the metadata says of its item: the tensor's dtype
        and the chunk's shape (a byte item: one dimension of ``uint8``; its bytes are DCP's own
        serialisation, which the ``weights_only`` check and DCP's unpickling delimit). Read from
        the file's index; no data is read."""
        index = items[0].storage_index
        if index not in self._stored_as:
            raise CorruptCheckpointError(f"DCP metadata has no chunk for {index}")
        expected_dtype, expected_shape = self._stored_as[index]
        try:
            stored = ckpt.info(key)
        except KeyError:
            raise CorruptCheckpointError(f"{relative_path} in {str(self.path)!r} holds no {key!r}, which "
                                         f"its DCP metadata names") from None
        shape = tuple(stored.shape)
        if stored.dtype != expected_dtype or (shape != expected_shape if expected_shape is not None
                                              else len(shape) != 1):
            said = "a byte item" if expected_shape is None else f"{expected_dtype} {list(expected_shape)}"
            raise CorruptCheckpointError(f"{relative_path} in {str(self.path)!r} holds {key!r} as {stored.dtype} "
                                         f"{list(shape)}; its DCP metadata says {said}")

    @staticmethod
    def _check_byte_item(item: ReadItem, data: bytes) -> None:
        """Refuse a byte item that torch's ``weights_only`` loader refuses. DCP's planner loads
        byte items with ``torch.load(weights_only=False)``, which runs whatever the bytes name;
        the ``weights_only`` loader builds only allow-listed plain types and runs nothing else,
        so what it accepts names nothing else to run."""
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any refusal: torch raises several types
            lines = str(err).splitlines()
            reason = next((line.strip() for line in lines if "WeightsUnpickler error" in line),
                          lines[0] if lines else type(err).__name__)
            raise CheckpointError(
                f"byte item {item.storage_index.fqn!r} holds more than plain values "
                f"({reason.split(' Please use')[0][:300]}); "
                f"DCP's planner would unpickle it and run the code it names: allow its types with "
                f"torch.serialization.add_safe_globals, or pass GdsStorageReader(..., trust_pickle=True) "
                f"if you trust the directory") from None

    def _info(self, item: ReadItem) -> GdsStorageInfo:
        try:
            info = self.storage_data[item.storage_index]
        except KeyError:
            raise CorruptCheckpointError(f"DCP metadata has no storage entry for "
                                         f"{item.storage_index}") from None
        if not isinstance(info, GdsStorageInfo):
            raise CorruptCheckpointError(f"{item.storage_index} was not written by GdsStorageWriter "
                                         f"(storage data {type(info).__name__})")
        return info

    @staticmethod
    def _device(item: ReadItem, planner: LoadPlanner) -> str | None:
        """Where a read item's destination lives: ``"cuda:N"`` restores (and decodes) there,
        None in host memory."""
        if item.type == LoadItemType.BYTE_IO:
            return None
        device = planner.resolve_tensor(item).device
        return f"cuda:{device.index or 0}" if device.type == "cuda" else None

    @staticmethod
    def _row_window(items: list[ReadItem], shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The rows ``[start, stop)`` of a stored item that ``items`` need, when they take whole
        rows (full extent in every dimension after the first) and not all of them; else None."""
        if not shape or any(item.type == LoadItemType.BYTE_IO for item in items):
            return None
        for item in items:
            offsets, lengths = list(item.storage_offsets), list(item.lengths)
            if len(offsets) != len(shape) or any(o != 0 or n != d for o, n, d in
                                                  zip(offsets[1:], lengths[1:], shape[1:])):
                return None
        start = min(int(item.storage_offsets[0]) for item in items)
        stop = max(int(item.storage_offsets[0]) + int(item.lengths[0]) for item in items)
        return None if (start, stop) == (0, shape[0]) else (start, stop)

    def _read_rows(self, ckpt: Any, key: str, window: tuple[int, int], items: list[ReadItem],
                   planner: LoadPlanner) -> None:
        start, stop = window
        rows = ckpt.get_rows(key, start, stop, device=self._device(items[0], planner))
        for item in items:
            offsets = list(item.storage_offsets)
            offsets[0] -= start  # relative to the rows read
            self._deliver(dataclasses.replace(item, storage_offsets=torch.Size(offsets)), rows, planner)

    def _read_items(self, ckpt: Any, by_key: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        """Read ``by_key``'s items from the rank file ``ckpt`` and deliver them. An item that is
        a whole stored tensor, whose destination has its shape and dtype, is restored straight
        into the destination, as ``load_into`` fills a tensor: nothing of its size is held beside
        it. The rest (pieces, other dtypes, aliases, bytes) is read into new tensors and copied,
        at most ``max_inflight_bytes`` of them at a time (or one item larger than that)."""
        filled: dict[str, Any] = {}
        storages: set[tuple[str, int]] = set()
        for key, items in by_key.items():
            target = self._whole_destination(ckpt, key, items, planner, storages)
            if target is not None:
                filled[key] = target

        def fill(keys: list[str]) -> None:
            ckpt._fill({key: filled[key] for key in keys})
            for key in keys:
                planner.commit_tensor(by_key[key][0], filled[key])

        def read_and_copy(keys: list[str]) -> None:
            self._read_batch(ckpt, keys, self._device(by_key[keys[0]][0], planner), by_key, planner)

        self._in_batches(ckpt, filled, READ_BATCH_BYTES, fill)
        held = {key: None if items[0].type == LoadItemType.BYTE_IO else planner.resolve_tensor(items[0])
                for key, items in by_key.items() if key not in filled}
        self._in_batches(ckpt, held, min(READ_BATCH_BYTES, resolve_config(self.config).max_inflight_bytes),
                         read_and_copy)

    @staticmethod
    def _whole_destination(ckpt: Any, key: str, items: list[ReadItem], planner: LoadPlanner,
                           storages: set[tuple[str, int]]) -> Any:
        """The tensor ``key``'s one read item fills whole, where it can be restored into in place:
        the stored array's shape and dtype, its own bytes (no alias), sharing its memory with no
        other such destination (``storages``, updated); else None."""
        if len(items) != 1 or items[0].type == LoadItemType.BYTE_IO:
            return None
        item, info = items[0], ckpt.info(key)
        if (info.alias_of is not None or any(offset != 0 for offset in item.storage_offsets)
                or tuple(item.lengths) != tuple(info.shape)):
            return None
        target = planner.resolve_tensor(item).detach()
        memory = (str(target.device), target.untyped_storage().data_ptr())
        if (tuple(target.shape) != tuple(info.shape) or torch_dtype_name(target.dtype) != info.dtype
                or target.is_sparse or memory in storages):
            return None
        storages.add(memory)
        return target

    def _in_batches(self, ckpt: Any, destinations: dict[str, Any], limit: int, read: Any) -> None:
        """``read(keys)`` for ``destinations``' keys in batches of one device (their destination
        tensors', None: host memory) and at most ``limit`` stored bytes (or one key)."""
        def device_of(tensor: Any) -> str:
            return "" if tensor is None or tensor.device.type != "cuda" else f"cuda:{tensor.device.index or 0}"

        batch: list[str] = []
        batch_bytes, batch_device = 0, ""
        for key in sorted(destinations, key=lambda key: (device_of(destinations[key]), key)):
            device, nbytes = device_of(destinations[key]), ckpt.info(key).nbytes
            if batch and (device != batch_device or batch_bytes + nbytes > limit):
                read(batch)
                batch, batch_bytes = [], 0
            batch.append(key)
            batch_bytes += nbytes
            batch_device = device
        if batch:
            read(batch)

    def _read_batch(self, ckpt: Any, keys: list[str], device: str | None, by_key: dict[str, list[ReadItem]],
                    planner: LoadPlanner) -> None:
        stored = ckpt.get_many(keys, device=device)
        for key in keys:
            for item in by_key[key]:
                self._deliver(item, stored[key], planner)
            del stored[key]  # delivered: its memory may go

    def _deliver(self, item: ReadItem, stored: Any, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            data = stored.numpy().tobytes()
            if not self.trust_pickle:
                self._check_byte_item(item, data)
            planner.load_bytes(item, io.BytesIO(data))
            return
        tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(f"read item {item.storage_index}: target size "
                                         f"{tuple(target.size())} "
                                         f"!= stored piece {tuple(tensor.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

