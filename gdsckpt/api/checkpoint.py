"""Restoring arrays: the shared restore core (targets, aliases, delta bases), and ``Checkpoint``,
the lazily read file that ``gdsckpt.open`` returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import re
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from .. import collector
from ..config import Config
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    DeltaBaseError,
)
from ..format import Index, TensorRecord
from ..io import StorageReader
from ..io.s3 import is_url
from ..pipeline.load import DeferredTargets, OpenedFile, run_restore
from ..state import (
    CupyTarget,
    JaxTarget,
    NumpyTarget,
    TorchTarget,
    torch_dtype_name,
)
from ..state.delta import BaseReader, XorTarget, base_location_of, check_identity
from ..state.lossy import LossyWarning
from .reports import ChunkInfo, Progress, TensorInfo, chain_label
from .resolve import (
    Source,
    destination,
    inflight_budget,
    open_checked,
    open_data_reader,
    open_reader,
    parse_device,
    resolve_config,
    resolve_location,
    restore_engine,
    restore_gpu_device,
    single_destination,
    source_name,
)

_BASE_LOCK = threading.RLock()
"""Guards opening a delta's base (``OpenedFile.base``) against other restores and ``close``.
Reentrant: a base found changed is closed (``Checkpoint.close``, which takes it) while held."""


def _new_base_lock_after_fork() -> None:
    """A forked child's lock starts free: held by another thread at the fork (a delta's base
    being opened), it was never released there and the child's delta reads waited for good."""
    global _BASE_LOCK
    _BASE_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_base_lock_after_fork)


MAX_RESOLVE_DEPTH = 64
"""Deltas a load resolves behind one file (each link is a nested restore, a few stack frames
deep): far beyond ``max_chain``'s default of 8, short of Python's recursion limit."""


_KIND_PACKAGES = {"torch": "torch", "numpy": "numpy", "cupy": "cupy", "jax": "jax"}


def new_target(record: TensorRecord, device: str | None) -> Any:
    """A destination for one array, of the kind it was saved as. A missing array library, or a
    dtype the library cannot hold, is a ``CheckpointError`` naming the array."""
    try:
        return _make_target(record, device)
    except ImportError as err:
        raise CheckpointError(f"array {record.key!r} was saved as a {record.kind} array; loading it needs "
                              f"the {_KIND_PACKAGES[record.kind]} package ({err})") from err
    except TypeError as err:
        raise CheckpointError(f"array {record.key!r} ({record.kind}, {record.dtype}) cannot be "
                              f"restored here: {err}") from err


def parameter_requires_grad(record: TensorRecord) -> bool | None:
    """A torch record's ``parameter`` member: the Parameter's ``requires_grad``, or None for a
    plain tensor (also for a member that is not an object, which this reader cannot use).
    ``CorruptCheckpointError`` for a ``requires_grad`` that is not a boolean, or true on a dtype
    that cannot require grad."""
    parameter = record.extra.get("parameter")
    if not isinstance(parameter, dict):
        return None  # none, or a member this reader cannot use: a plain tensor (docs/format.md §6.5)
    requires_grad = parameter.get("requires_grad", False)
    if not isinstance(requires_grad, bool):  # "no" is not false
        raise CorruptCheckpointError(f"a Parameter's requires_grad must be true or false, got "
                                     f"{requires_grad!r:.40}", key=record.key)
    if requires_grad and not (record.dtype.startswith(("float", "bfloat", "complex"))):
        raise CorruptCheckpointError(f"a {record.dtype} tensor cannot be a Parameter that requires "
                                     f"grad", key=record.key)
    return requires_grad


def numpy_scalar(record: TensorRecord) -> bool:
    """A numpy record's ``scalar`` member: whether the array was a NumPy scalar.
    ``CorruptCheckpointError`` for a member that is not a boolean."""
    scalar = record.extra.get("scalar", False)
    if not isinstance(scalar, bool):
        raise CorruptCheckpointError(f"a tensor record's scalar member must be true or false, got {scalar!r:.40}",
                                     key=record.key)
    return scalar


def _make_target(record: TensorRecord, device: str | None) -> Any:
    if record.kind == "torch":
        return TorchTarget(record.shape, record.dtype, device or "cpu", parameter=parameter_requires_grad(record))
    if record.kind == "numpy":
        return NumpyTarget(record.shape, record.dtype, scalar=numpy_scalar(record))
    if record.kind == "cupy":
        chosen = device if device and device.startswith("cuda") else record.device
        match = re.fullmatch(r"cuda(?::(\d{1,4}))?", chosen)
        if match is None:
            raise CorruptCheckpointError(f"a CuPy array's device is {record.device!r}, not 'cuda:N'",
                                         key=record.key)
        return CupyTarget(record.shape, record.dtype, int(match.group(1) or 0))
    return JaxTarget(record.shape, record.dtype, device)


def restore_arrays(reader: StorageReader, opened: OpenedFile, ids: Iterable[int], config: Config,
                    make_target: Any, gpu_device: int | None = None,
                    progress: Progress | None = None,
                    windows: dict[int, tuple[int, int]] | None = None, engine: Any = None,
                    new_targets: bool = False, lead: Any = None, share: float = 1.0) -> dict[int, Any]:
    """Restore the arrays ``ids`` (aliases resolved) and return id -> finished object.
    ``windows``: data array id -> the byte range of it to restore (``run_restore``). ``engine``:
    a decoding engine the caller keeps (and closes) across restores; by default one is made for
    this restore and closed after it. ``new_targets``: ``make_target`` allocates new arrays (a
    ``load``), so on the GPU engine they may be made while the first chunks are read
    (``pipeline.load.DeferredTargets``), the decoder's staging budget leaving room for them.
    ``lead``: a ``LeadRead`` of the file (``resolve.lead_read``), for the decoder made here.
    ``share``: the part of the restore staging budget this restore has (``GpuDecoder``); a restore
    of delta arrays gives half of it to its decoder and half to its base's (which halves its own
    in turn for a base of its own), so that the decoders alive together stay within the budget."""
    index = opened.index
    ids = list(ids)
    data_ids = sorted({stored_id(index, i) for i in ids})
    delta = set(index.delta_ids()).intersection(data_ids) if index.base is not None else set()
    if delta:
        share /= 2

    @collector.paused()
    def make_all() -> dict[int, Any]:
        return {i: make_target(i, index.tensors[i]) for i in data_ids}

    defer = new_targets and gpu_device is not None and engine is None and not delta and windows is None
    targets: dict[int, Any] | DeferredTargets
    if defer:
        targets = DeferredTargets(data_ids, lambda i: make_target(i, index.tensors[i]))
    else:
        targets = make_all()
        if delta:
            _read_against_base(opened, config, targets, delta, windows, share)
    owned = engine is None
    if engine is None:
        engine = restore_engine(config, gpu_device,
                                reserved_bytes=sum(index.tensors[i].nbytes for i in data_ids) if defer else 0,
                                lead=lead, share=share)
    try:
        run_restore(reader, index, engine, targets, timeout=config.timeout, progress=progress,
                    windows=windows, max_inflight_bytes=inflight_budget(config, engine))
    finally:
        if owned:
            engine.close()
    return _finished(index, ids, targets.resolve() if isinstance(targets, DeferredTargets) else targets)


def _read_against_base(opened: OpenedFile, config: Config, targets: dict[int, Any], delta: set[int],
                       windows: dict[int, tuple[int, int]] | None, share: float = 1.0) -> None:
    """Wrap the targets of the arrays ``delta`` stores as XORs in ``XorTarget``s over the base's
    bytes (the base opened once per file and kept for its later restores)."""
    index = opened.index
    with _BASE_LOCK:  # restores of one open Checkpoint may run in several threads
        if opened.closed:  # closed by another thread: its base would stay open for good
            raise closed_error(opened.path)
        if opened.base is None:  # kept for the next restore of this file: its cache with it
            checkpoint = open_base(opened, config, share)
            opened.base = (checkpoint, checkpoint._base_reader())
        opened_base, base_reader = opened.base  # under the lock: a close may clear it
    base = cast(Checkpoint, opened_base)  # this module put it there, just above
    for i in delta:
        record = index.tensors[i]
        base_record = base._data_record(record.key) if record.key in base else None
        if base_record is None or (base_record.dtype, base_record.shape) != (record.dtype, record.shape):
            raise DeltaBaseError(f"base checkpoint {base.path!r} holds no {record.dtype}"
                                 f"{list(record.shape)} array {record.key!r}, which the delta needs")
        window = (windows or {}).get(i)
        targets[i] = XorTarget(targets[i], base_reader.view(base_record.key, window),
                               window[0] if window is not None else 0)


def _finished(index: Index, ids: list[int], targets: dict[int, Any]) -> dict[int, Any]:
    """Id -> finished object of every restored array and of the aliases among ``ids``."""
    finished = {i: target.finish() for i, target in targets.items()}
    for i in ids:
        alias = index.tensors[i].alias
        if alias is not None:
            finished[i] = alias_object(finished[alias], index.tensors[i], index.tensors[alias])
    return finished


def open_base(opened: OpenedFile, config: Config, share: float = 1.0) -> Checkpoint:
    """The base of a delta checkpoint, opened and checked to be the file the delta was written
    against (``DeltaBaseError`` otherwise); its GPU restores take ``share`` of the restore staging
    budget (``restore_arrays``)."""
    link = opened.index.base
    assert link is not None
    path = base_location_of(opened.path, link)
    missing = DeltaBaseError(f"base checkpoint {str(path)!r} of delta {opened.path!r} is missing "
                             f"(recorded as {link['path']!r})")
    if isinstance(path, Path) and not path.is_file():
        raise missing
    try:
        base = Checkpoint(path, config, staging_share=share)
    except FileNotFoundError as err:  # an object: no HEAD before the open's own
        raise missing from err
    except CheckpointError as err:
        raise DeltaBaseError(f"base checkpoint {str(path)!r} of delta {opened.path!r} cannot be "
                                  f"read: {err}") from err
    try:
        check_identity(path, link, base._opened.index_sha256, base._opened.trailer.file_length)
        # The recorded depth must be the base's own plus one: with the identity check this bounds
        # the recursion of a resolve by what the writer recorded, never by a crafted loop.
        base_depth = base._opened.index.base["depth"] if base._opened.index.base is not None else 0
        if link["depth"] != base_depth + 1:
            raise DeltaBaseError(f"delta {opened.path!r} records chain depth {link['depth']} but its base "
                                      f"{str(path)!r} is {base_depth} deep")
        if link["depth"] > MAX_RESOLVE_DEPTH:
            raise DeltaBaseError(f"delta {opened.path!r} is {link['depth']} deltas deep, more than the "
                                      f"{MAX_RESOLVE_DEPTH} a load resolves: rebase an older link of the chain "
                                      f"('gdsckpt rebase')")
    except BaseException:
        base.close()
        raise
    return base


def closed_error(path: Any, during: bool = False) -> ValueError:
    """The error of a read of a closed checkpoint (as a closed Python file raises ``ValueError``),
    or of one that a ``close`` from another thread met (``during``)."""
    what = "was closed while this read ran" if during else "is closed"
    return ValueError(f"checkpoint {path!r} {what}: open it again to read its arrays")


def stored_id(index: Index, i: int) -> int:
    """The id of the tensor record holding tensor ``i``'s bytes: ``i``, or its alias's target."""
    alias = index.tensors[i].alias
    return i if alias is None else alias


def data_of(index: Index, i: int) -> TensorRecord:
    """The record holding tensor ``i``'s bytes: itself, or the target of an alias."""
    return index.tensors[stored_id(index, i)]


def warn_lossy(index: Index, ids: Iterable[int]) -> None:
    """One ``LossyWarning`` per load call that returns arrays saved with ``save(lossy=...)``."""
    # Entries, not stored arrays: an alias of a lossy array (a tied weight) comes back rounded too.
    lossy = sum(1 for i in set(ids) if data_of(index, i).lossy is not None)
    if lossy:
        warnings.warn(f"{lossy} loaded array(s) were saved lossily (within their recorded error bounds, "
                      f"not bit-exact); gdsckpt.inspect shows each bound", LossyWarning, stacklevel=3)


def alias_object(shared: Any, record: TensorRecord, source: TensorRecord) -> Any:
    """What an alias entry comes back as: the shared object itself, or, where the two entries were
    of different types (a Parameter and a plain tensor of the same view), that type over the same
    memory. The index guarantees that both records are of one kind (``parse_index``); an alias's
    ``parameter`` member obeys the rules of a data record's."""
    if record.kind != "torch" or record.extra.get("parameter") == source.extra.get("parameter"):
        return shared
    import torch

    requires_grad = parameter_requires_grad(record)
    if requires_grad is not None:
        return torch.nn.Parameter(shared.detach(), requires_grad=requires_grad)
    return shared.detach()


class Checkpoint:
    """A lazily read checkpoint (``gdsckpt.open``): the index is read once, arrays on demand."""

    def __init__(self, path: Source, config: Config | None = None, *, staging_share: float = 1.0):
        """``staging_share``: the part of the restore staging budget this file's GPU restores take
        (less than 1 for the base of a delta, whose reads run beside the delta's own)."""
        self.path = source_name(path)
        if isinstance(path, (str, os.PathLike)) and not is_url(path):
            # Reads (and a delta's base, named relative to it) may come after an os.chdir.
            path = os.path.abspath(path)
        self._source = path
        self._config = resolve_config(config)
        self._staging_share = staging_share
        self._reader = open_reader(path, self._config)
        try:
            self._opened = open_checked(self._reader)
        except BaseException:
            self._reader.close()
            raise
        self._by_key = {record.key: i for i, record in enumerate(self._opened.index.tensors)}
        self._infos: list[TensorInfo] | None = None
        """``tensor_infos`` of the index, made on the first ``info``: they cost a pass over every
        array, and a caller asks per key (DCP's reader asks each key of a rank's file)."""
        self._window_lock = threading.Lock()
        self._window_restorers: dict[int | None, tuple[Any, StorageReader, contextlib.ExitStack]] = {}
        """GPU device (None: the CPU engine) -> the engine, data reader and their exit stack that
        ``_read_many`` keeps across its restores (closed by ``close``)."""
        self._closed = False
        # A checkpoint dropped without close() (``gdsckpt.open(p).get(k)``) kept its descriptors,
        # its base's and the disk space of files deleted since, for the life of the process:
        # closed when collected, with a ResourceWarning as for an unclosed Python file. Not at
        # exit: the process's end closes them, and a read still running must not be waited for.
        self._finalizer = weakref.finalize(self, _close_dropped, self.path, self._reader, self._opened,
                                           self._window_restorers, self._window_lock)
        self._finalizer.atexit = False

    def _check_open(self) -> None:
        """``ValueError`` for a read after ``close`` (as a closed Python file raises), rather than
        whatever the closed reader's machinery meets. The index stays readable: ``keys``, ``info``."""
        if self._closed:
            raise closed_error(self.path)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Around a read: a failure that meets the checkpoint closed meanwhile (another thread's
        ``close``: a closed I/O lane, a cancelled read) is the same "closed" ``ValueError`` as a
        read after ``close``, the failure chained to it. A ``CheckpointError`` (damage found)
        stays what it is."""
        self._check_open()
        try:
            yield
        except CheckpointError:
            raise
        except Exception as err:
            if not self._closed:
                raise
            raise closed_error(self.path, during=True) from err

    def keys(self) -> list[str]:
        """Key strings of every array, in file order."""
        return list(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._by_key)

    def _id(self, key: str) -> int:
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"no array {key!r} in {self.path!r}") from None

    def info(self, key: str) -> TensorInfo:
        """Dtype, shape, sizes and codecs of one array, from the index alone."""
        position = self._id(key)
        if self._infos is None:
            self._infos = tensor_infos(self._opened.index)
        return self._infos[position]

    def get(self, key: str, device: Any = None, *, map_location: Any = None) -> Any:
        """Read one array (only its chunks), as the type it was saved as. ``key`` is its key path
        as ``keys()`` lists it (a ``/`` inside a dict key written ``~1``, a ``~`` ``~0``).
        ``device`` or ``map_location`` (not both): where it goes, as for ``gdsckpt.load``."""
        return self.get_many([key], device=device, map_location=map_location)[key]

    def get_many(self, keys: Iterable[str], device: Any = None, *, map_location: Any = None) -> dict[str, Any]:
        """Read several arrays in one restore (their chunks read in parallel, each once);
        returns key -> array, as ``get`` would return each."""
        with self._reading():
            return self._get_many(keys, device, map_location)

    def _get_many(self, keys: Iterable[str], device: Any, map_location: Any) -> dict[str, Any]:
        if isinstance(keys, (str, bytes)):  # its characters are no keys
            raise TypeError(f"get_many takes a list of keys, got the string {keys!r}: get_many([{keys!r}]) "
                            f"or get({keys!r})")
        keys = list(dict.fromkeys(keys))
        ids = [self._id(key) for key in keys]
        location = resolve_location(device, map_location)
        index = self._opened.index
        gpu_device = restore_gpu_device(self._config, single_destination(location, (index.tensors[i] for i in ids)),
                                        index, ids)
        with open_data_reader(self._source, self._config, self._reader, gpu_device) as data_reader:
            arrays = restore_arrays(data_reader, self._opened, ids, self._config,
                                     lambda _i, record: new_target(record, destination(location, record)),
                                     gpu_device, share=self._staging_share)
        warn_lossy(self._opened.index, ids)
        return {key: arrays[i] for key, i in zip(keys, ids)}

    def _fill(self, targets: dict[str, Any]) -> None:
        """Restore each key's stored array into the torch tensor given for it, in place (as
        ``load_into`` fills its targets; no array of the checkpoint's size beside them): keys
        that hold their bytes themselves (no alias), tensors of the stored shape and dtype that
        share no memory with each other. For ``GdsStorageReader``, whose planner names the
        tensors a DCP load fills."""
        with self._reading():
            index = self._opened.index
            by_id = {self._id(key): tensor for key, tensor in targets.items()}
            for i, tensor in by_id.items():
                record = index.tensors[i]
                if (stored_id(index, i) != i or tuple(tensor.shape) != record.shape
                        or torch_dtype_name(tensor.dtype) != record.dtype):
                    raise ValueError(f"{record.key!r} cannot be filled in place: an alias, or not "
                                     f"{record.dtype}{list(record.shape)}")
            devices = {str(tensor.device) for tensor in by_id.values()}
            device = devices.pop() if len(devices) == 1 else None
            gpu_device = restore_gpu_device(self._config, device, index, list(by_id))
            with open_data_reader(self._source, self._config, self._reader, gpu_device) as data_reader:
                restore_arrays(data_reader, self._opened, list(by_id), self._config,
                               lambda i, record: TorchTarget(record.shape, record.dtype, str(by_id[i].device),
                                                             existing=by_id[i]),
                               gpu_device, share=self._staging_share)

    def get_rows(self, key: str, start: int, stop: int, device: Any = None, *, map_location: Any = None) -> Any:
        """Rows ``[start, stop)`` of an array of at least one dimension (``array[start:stop]``),
        reading only the chunks that hold them: how a rank of a resharded DCP load reads its
        slice of a larger tensor. ``TypeError`` for row numbers that are not integers."""
        with self._reading():
            return self._get_rows(key, start, stop, device, map_location)

    def _get_rows(self, key: str, start: int, stop: int, device: Any, map_location: Any) -> Any:
        try:
            start, stop = operator.index(start), operator.index(stop)
        except TypeError:
            raise TypeError(f"rows of {key!r} are numbered by integers, got start={start!r}, stop={stop!r}") from None
        i = self._id(key)
        index = self._opened.index
        record = index.tensors[i]
        data_id = record.alias if record.alias is not None else i
        data = index.tensors[data_id]
        if not data.shape or not 0 <= start <= stop <= data.shape[0]:
            raise IndexError(f"rows [{start}, {stop}) of {key!r} (shape {list(data.shape)}) are out of range")
        row_bytes = data.nbytes // data.shape[0] if data.shape[0] else 0
        target_device = destination(resolve_location(device, map_location), data)
        gpu_device = restore_gpu_device(self._config, target_device, index, [data_id])
        with open_data_reader(self._source, self._config, self._reader, gpu_device) as data_reader:
            def rows_target(_i: int, data_record: TensorRecord) -> Any:
                window = dataclasses.replace(data_record, shape=(stop - start, *data_record.shape[1:]))
                return new_target(window, target_device)

            arrays = restore_arrays(data_reader, self._opened, [i], self._config, rows_target, gpu_device,
                                     windows={data_id: (start * row_bytes, stop * row_bytes)},
                                     share=self._staging_share)
        warn_lossy(index, [i])
        return arrays[i]

    def _data_record(self, key: str) -> TensorRecord:
        """The record holding ``key``'s bytes (an alias's target)."""
        return data_of(self._opened.index, self._id(key))

    def _base_reader(self, *, read_ahead: bool = False, window_bytes: int | None = None,
                     as_base: bool = True) -> BaseReader:
        """A ``BaseReader`` of this checkpoint's arrays (deltas resolved): what a delta built on it
        XORs with, and what ``rebase`` writes out.

        The arrays are listed in the order their bytes lie in the file (by their first chunk), which
        is the order the reader batches small arrays in: in record order, a batch for an array
        packed at the end of the file also fetched the large arrays recorded after it, which a
        convert had already read and the cache had dropped, and an ANS-to-zstd convert fetched
        the file about twice (``experiments/convert_ways.py``)."""
        records = [record for record in self._opened.index.tensors if record.alias is None]
        position = {id(record): min((segment.chunk for segment in record.segments), default=-1)
                    for record in records}
        records.sort(key=lambda record: position[id(record)])  # stable: record order among equals
        sizes = {record.key: record.nbytes for record in records}
        return BaseReader(_CheckpointArrays(self, as_base), sizes, timeout=self._config.timeout, read_ahead=read_ahead,
                          window_bytes=window_bytes)

    def _read_many(self, requests: list[tuple[str, int, int]], device: Any = None) -> list[Any]:
        """Bytes ``[start, stop)`` of each named array (distinct, not aliases) as flat uint8 arrays
        (NumPy, or CuPy on ``device`` ``"cuda:N"``), deltas resolved, in one restore."""
        with self._reading():
            return self._read_windows(requests, device)

    def _read_windows(self, requests: list[tuple[str, int, int]], device: Any) -> list[Any]:
        index = self._opened.index
        target_device = parse_device(device)
        ids, windows, records = [], {}, {}
        for key, start, stop in requests:
            i = self._id(key)
            window = TensorRecord(key=key, kind="numpy", dtype="uint8", shape=(stop - start,))
            if target_device is not None and target_device.startswith("cuda"):
                window.kind, window.device = "cupy", target_device
            ids.append(i)
            windows[i] = (start, stop)
            records[i] = window
        gpu_device = restore_gpu_device(self._config, target_device, index, ids)
        with self._window_lock:
            engine, data_reader = self._window_restorer(gpu_device)
            try:
                arrays = restore_arrays(data_reader, self._opened, ids, self._config,
                                         lambda i, _record: new_target(records[i], target_device), gpu_device,
                                         windows=windows, engine=engine, share=self._staging_share)
                # Kept between windows, the engine gives its staging back between them: a delta's
                # base keeps its window restorer while the delta's own restores size theirs
                # from the whole budget (``share``), which the base's ring would otherwise exceed.
                engine.release_staging()
            except BaseException:
                # a failed restore may leave its engine mid-batch: the next window gets new ones
                self._window_restorers.pop(gpu_device)[2].close()
                raise
        return [arrays[i] for i in ids]

    def _window_restorer(self, gpu_device: int | None) -> tuple[Any, StorageReader]:
        """The engine and data reader of ``_read_many``'s restores on ``gpu_device``, made on first
        use and kept until ``close``: a ``rebase`` or ``convert`` reads a checkpoint in many small
        windows, and a GPU decoder (streams, worker thread, pinned bounce buffer) and a second
        file handle per window cost more than reading the window (caller holds ``_window_lock``)."""
        kept = self._window_restorers.get(gpu_device)
        if kept is None:
            stack = contextlib.ExitStack()
            try:
                data_reader = stack.enter_context(open_data_reader(self._source, self._config, self._reader,
                                                                   gpu_device))
                # a delta's windows read its base beside them: half the share (``restore_arrays``)
                share = self._staging_share / 2 if self._opened.index.base is not None else self._staging_share
                engine = restore_engine(self._config, gpu_device, share=share)
                stack.callback(engine.close)
            except BaseException:
                stack.close()
                raise
            kept = self._window_restorers[gpu_device] = (engine, data_reader, stack)
        return kept[0], kept[1]

    def close(self) -> None:
        """Close the file (and the base a delta's reads opened); reading an array afterwards is a
        ``ValueError``."""
        self._closed = True
        self._finalizer.detach()
        _release(self._reader, self._opened, self._window_restorers, self._window_lock)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(reader: StorageReader, opened: OpenedFile,
             restorers: dict[int | None, tuple[Any, StorageReader, contextlib.ExitStack]],
             lock: threading.Lock) -> None:
    """What ``Checkpoint.close`` closes: the restorers ``_read_many`` kept, the base a delta's
    reads opened, the file."""
    with lock:
        kept = list(restorers.values())
        restorers.clear()
    try:
        for _engine, _reader, stack in kept:
            stack.close()
    finally:
        with _BASE_LOCK:  # a restore about to open the base waits, then finds the file closed
            base, opened.base, opened.closed = opened.base, None, True
        if base is not None:  # a chain's bases close outside it: their reads may be slow to end
            base[0].close()
        reader.close()


def _close_dropped(path: str, *parts: Any) -> None:
    """The finalizer of a ``Checkpoint`` collected without ``close``: ``_release`` its parts, then
    a ``ResourceWarning`` (after: where warnings are errors, one raised in a finalizer would
    otherwise stop the release). Collected on an I/O worker thread (the garbage collector runs
    wherever memory is allocated), the release goes to a thread of its own: closing a reader
    waits for its lane's tasks, which may include the one this worker is running."""
    from ..io.pools import on_a_worker_thread

    try:
        if on_a_worker_thread():
            threading.Thread(target=_release, args=parts, name="gdsckpt-close-dropped", daemon=True).start()
        else:
            _release(*parts)
    finally:
        warnings.warn(f"checkpoint {path!r} was never closed: use 'with gdsckpt.open(...) as ckpt' or call "
                      f"close()", ResourceWarning, stacklevel=2)


def open(path: Source, *, config: Config | None = None) -> Checkpoint:
    """Open a checkpoint for lazy access: ``.keys()``, ``.info(key)``, ``.get(key, device=None)``.
    ``path``: anything ``gdsckpt.load`` reads (a path, a URL, bytes, a seekable binary file object).

    Use as a context manager (``with gdsckpt.open(p) as ckpt: ...``) or call ``.close()``; one
    collected without either is closed then, with a ``ResourceWarning`` (as an unclosed file).
    """
    return Checkpoint(path, config)


class _CheckpointArrays:
    """The ``BaseArrays`` source a delta's base is read through: byte windows of this checkpoint's
    arrays, deltas resolved, one restore per batch of windows (``Checkpoint._read_many``)."""

    def __init__(self, checkpoint: Checkpoint, as_base: bool = True):
        self._checkpoint = checkpoint
        self._as_base = as_base
        """Read as a delta's base (its damage names it); not for a rewrite of the file itself."""

    def read_many(self, requests: list[tuple[str, int, int]], device: Any) -> list[Any]:
        """See ``gdsckpt.state.delta.BaseArrays``."""
        with damage_named_as_base(self._checkpoint.path) if self._as_base else contextlib.nullcontext():
            return self._checkpoint._read_many(requests, device)


@contextlib.contextmanager
def damage_named_as_base(path: str) -> Iterator[None]:
    """Damage found in a delta's base names the base file (``CorruptCheckpointError.base``): it
    read as damage of the delta, whose own chunk of the same number was intact, and pointed the
    user at the wrong file. The innermost base of a chain that holds the damage is the one named."""
    try:
        yield
    except CorruptCheckpointError as err:
        if err.base is not None:
            raise
        raise CorruptCheckpointError(err.reason, key=err.key, chunk=err.chunk, base=str(path)) from err


def opened_file(checkpoint: Checkpoint) -> OpenedFile:
    """The opened file behind ``checkpoint``: header, trailer and validated index (for the API's
    save and verify, which build on a checkpoint they opened)."""
    return checkpoint._opened


@contextlib.contextmanager
def base_chain(checkpoint: Checkpoint, config: Config) -> Iterator[list[OpenedFile]]:
    """The opened files of ``checkpoint`` and of each base below it in turn (``open_base``: each
    checked to be the file its delta was written against, ``DeltaBaseError`` otherwise), closed
    when the block ends."""
    links = [checkpoint]
    try:
        while opened_file(links[-1]).index.base is not None:
            links.append(open_base(opened_file(links[-1]), config))
        yield [opened_file(link) for link in links]
    finally:
        for link in links[1:]:
            link.close()


def base_arrays(checkpoint: Checkpoint, *, read_ahead: bool = False, window_bytes: int | None = None,
                as_base: bool = True) -> BaseReader:
    """A cached reader of ``checkpoint``'s arrays, deltas resolved: what a delta written against it
    XORs with, and what ``rebase`` writes out (``BaseReader`` says what ``read_ahead`` and
    ``window_bytes`` do). ``as_base=False``: the file is read for itself (``rewrite``), so damage
    found in it is not named as a base's (``CorruptCheckpointError.base``)."""
    return checkpoint._base_reader(read_ahead=read_ahead, window_bytes=window_bytes, as_base=as_base)


def data_record(checkpoint: Checkpoint, key: str) -> TensorRecord:
    """The index record holding ``key``'s bytes in ``checkpoint`` (an alias's target)."""
    return checkpoint._data_record(key)


def tensor_infos(index: Index) -> list[TensorInfo]:
    """Per-array facts of an index, as ``Checkpoint.info`` and ``inspect`` report them."""
    infos = []
    delta = set(index.delta_ids())
    holders = [0] * len(index.chunks)  # arrays per chunk: a chunk of one array is that array's, exactly
    for record in index.tensors:
        for segment in record.segments:
            holders[segment.chunk] += 1
    for i, record in enumerate(index.tensors):
        stored = 0.0
        chunks = set()
        codecs = []
        for segment in record.segments:
            chunk = index.chunks[segment.chunk]
            chunks.add(segment.chunk)
            stored += chunk.stored * segment.length / chunk.raw if chunk.raw else 0
            label = chain_label(index.chains[chunk.chain])
            if label not in codecs:
                codecs.append(label)
        alias = index.tensors[record.alias].key if record.alias is not None else None
        infos.append(TensorInfo(record.key, record.kind, record.dtype, record.shape, record.device,
                                record.nbytes, round(stored), len(chunks), tuple(codecs), alias,
                                i in delta, lossy=data_of(index, i).lossy,
                                stored_estimated=any(holders[c] > 1 for c in chunks),
                                ratio=record.nbytes / stored if stored > 0 else None))
    return infos


def chunk_infos(index: Index) -> list[ChunkInfo]:
    """Per-chunk facts of an index: its exact sizes, its chain and the arrays it holds."""
    arrays: list[list[tuple[int, str, int]]] = [[] for _ in index.chunks]
    for record in index.tensors:
        for segment in record.segments:
            arrays[segment.chunk].append((segment.raw_offset, record.key, segment.length))
    return [ChunkInfo(chunk.offset, chunk.stored, chunk.raw, chain_label(index.chains[chunk.chain]),
                      tuple((key, length) for _start, key, length in sorted(held)))
            for chunk, held in zip(index.chunks, arrays)]
