"""Whole-file reads: ``load`` (into new arrays), ``inspect`` (the index alone) and ``verify``
(every chunk, every checksum, every base of a delta).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

from .. import collector
from ..codecs import codec_spec
from ..config import Config
from ..errors import UnsupportedFormatError
from ..format import Index
from ..pipeline.load import OpenedFile, run_verify
from ..state import (
    Selection,
    unflatten,
)
from .checkpoint import (
    Checkpoint,
    chunk_infos,
    damage_named_as_base,
    new_target,
    open_base,
    opened_file,
    restore_arrays,
    tensor_infos,
    warn_lossy,
)
from .reports import CheckpointInfo, Progress, VerifyReport, chain_label
from .resolve import (
    Source,
    destination,
    inflight_budget,
    lead_read,
    open_checked,
    open_data_reader,
    open_reader,
    resolve_config,
    resolve_location,
    restore_engine,
    restore_gpu_device,
    single_destination,
    source_name,
)


def load(path: Source, *, device: Any = None, keys: Iterable[str] | None = None,
         config: Config | None = None, progress: Progress | None = None, map_location: Any = None,
         weights_only: bool | None = None) -> Any:
    """Load a checkpoint into the same nested structure and types it was saved from.

    ``weights_only``: taken for ``torch.load``'s callers, and changes nothing: a checkpoint holds
    arrays and plain values only and a load runs no code from the file, so every load is what
    ``torch.load`` calls weights-only (a bool or None; anything else is ``TypeError``).

    ``device``: None or ``"cpu"`` puts torch tensors on the CPU; ``"cuda[:N]"`` (or a
    ``torch.device``) on that GPU (NumPy arrays stay NumPy; CuPy arrays go to that GPU or, with
    None, the GPU they were saved from). ``map_location``: ``torch.load``'s name for it, with its
    meanings: a device or device string as ``device``, or a dict from the device an array was
    saved from to the one it loads to (``{"cuda:1": "cuda:0"}``, ``{"cuda:0": "cpu"}``; arrays
    saved from a device the dict does not name load to that device, as with ``torch.load``). Give
    ``device`` or ``map_location``, not both (``TypeError``); a function as ``map_location`` is
    ``TypeError`` too. ``keys``: key strings (``"model/layer.weight"``; one may be given alone) or prefixes of subtrees
    (``"optimizer"``) to load; only the chunks holding them are read. Dict entries outside the
    selection are left out, list and tuple slots outside it are None. Unknown keys raise
    ``KeyError``; an entry that is not a string (an int, ``None``, ``bytes``) ``TypeError``. ``""``
    is the root's key, selecting everything. ``progress(done, total)``, if given, is called in the
    calling thread after each chunk (raw bytes so far, out of ``total``).

    ``path`` may be an ``s3://bucket/key`` URL (docs/object-storage.md); a checkpoint's ``bytes``;
    a seekable binary file object (``open(p, "rb")``, ``io.BytesIO``), read from its current
    position to its end (the index is found at the end: two checkpoints saved one after the other
    into one stream cannot be read from it, as ``torch.load`` reads them) and left open; or a
    ``gdsckpt.io.StorageReader``, closed when the load ends: ``gdsckpt.io.PreloadedReader(path,
    pinned=True)`` holds the file in memory, to measure a restore without storage.
    """
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(f"weights_only must be a bool or None, got {type(weights_only).__name__}")
    # not a decorator: its frame would be the one warnings name; the index sets the budget
    with collector.young_only():
        cfg = resolve_config(config)
        location = resolve_location(device, map_location)
        selection = Selection(keys)
        with open_reader(path, cfg) as reader, contextlib.ExitStack() as stack:
            # a whole restore into a named GPU starts reading while the index is parsed
            lead = (stack.enter_context(lead_read(path, cfg, reader, restore_gpu_device(cfg, location)))
                    if keys is None and isinstance(location, str) else None)
            opened = open_checked(reader)
            index = opened.index
            wanted = (list(range(len(index.tensors))) if keys is None
                      else [i for i, record in enumerate(index.tensors) if selection.covers(record.key)])
            gpu_device = restore_gpu_device(cfg, single_destination(location, (index.tensors[i] for i in wanted)),
                                            index, wanted)
            if lead is not None and lead.gpu_device != gpu_device:
                lead.read.close()  # not this restore's device: released before the restore allocates
                lead = None
            try:
                data_reader = (lead.reader if lead is not None
                               else stack.enter_context(open_data_reader(path, cfg, reader, gpu_device)))
                arrays = restore_arrays(data_reader, opened, wanted, cfg,
                                        lambda _i, record: new_target(record, destination(location, record)),
                                        gpu_device, progress, new_targets=True,
                                        lead=lead.read if lead is not None else None)
            finally:
                opened.close_base()
        warn_lossy(index, wanted)
        state = unflatten(index.tree, arrays, selection)
        _check_selection(selection, index)
        return state


def _check_selection(selection: Selection, index: Index) -> None:
    """``KeyError`` naming the keys ``selection`` asked for that match no tensor of ``index`` (with
    a sample of the keys it holds); nothing where no keys were asked for."""
    if selection.keys is None:
        return
    unknown = [key for key in selection.keys if key not in selection.matched]
    if unknown:
        sample = ", ".join(repr(t.key) for t in index.tensors[:8])
        raise KeyError(f"keys not in checkpoint: {', '.join(map(repr, unknown))} "
                       f"(tensor keys include: {sample}{', ...' if len(index.tensors) > 8 else ''})")


def inspect(path: Source, *, config: Config | None = None) -> CheckpointInfo:
    """Describe a checkpoint from its index alone (no chunk is read)."""
    cfg = resolve_config(config)
    with open_reader(path, cfg) as reader:
        opened = open_checked(reader)
        size = reader.size
    index = opened.index
    logical = sum(record.nbytes for record in index.tensors if record.alias is None)
    codecs: dict[str, int] = {}
    for chunk in index.chunks:
        label = chain_label(index.chains[chunk.chain])
        codecs[label] = codecs.get(label, 0) + 1
    return CheckpointInfo(source_name(path), (opened.header.major, index.minor), index.writer, size, logical,
                          logical / size if size else 0.0, tuple(tensor_infos(index)), codecs, index.base,
                          tuple(gpu_only_bitstreams(index)),
                          tuple(chunk_infos(index)))


def gpu_only_bitstreams(index: Index) -> list[str]:
    """The bitstreams a file's chunks end in that only a GPU decodes, sorted (none: portable)."""
    used = {index.chains[chunk.chain][-1]["name"] for chunk in index.chunks}
    return sorted(name for name in used if not cpu_decodes(name))


def cpu_decodes(versioned: str) -> bool:
    """Whether bitstream ``versioned`` has a CPU decoder (unknown names count as not)."""
    try:
        return codec_spec(versioned).cpu_readable
    except (ValueError, UnsupportedFormatError):
        return False


def verify(path: Source, *, config: Config | None = None, progress: Progress | None = None,
           chain: bool = False) -> VerifyReport:
    """Read every chunk, check every checksum and decode every stream.

    Returns a ``VerifyReport`` when the file is sound; raises ``CorruptCheckpointError`` naming
    the first bad tensor and chunk otherwise. ``progress(done, total)``, if given, is called in
    the calling thread after each chunk (raw bytes so far, out of ``total``). For a delta
    checkpoint, every base down its chain must also be present, unchanged and of the recorded
    depth (``DeltaBaseError`` otherwise: the delta would not load); ``chain=True`` verifies
    their chunks too.
    """
    # not a decorator: its frame would be the one warnings name; the index sets the budget
    with collector.young_only():
        cfg = resolve_config(config)
        started = time.perf_counter()
        opened, stored = _verify_chunks(path, cfg, progress)
        bases: list[str] = []
        checkpoints: list[Checkpoint] = []
        try:
            current = opened
            while current.index.base is not None:
                base = open_base(current, cfg)  # present, unchanged, of the recorded depth
                checkpoints.append(base)
                bases.append(base.path)
                if chain:
                    with damage_named_as_base(base.path):
                        _verify_chunks(base.path, cfg, None)
                current = opened_file(base)
        finally:
            for checkpoint in checkpoints:
                checkpoint.close()
        index = opened.index
        logical = sum(record.nbytes for record in index.tensors if record.alias is None)
        return VerifyReport(source_name(path), len(index.chunks), stored, logical, time.perf_counter() - started,
                            tuple(bases))


def _verify_chunks(path: Source, config: Config, progress: Progress | None) -> tuple[OpenedFile, int]:
    """Open ``path`` and read, check and decode every chunk; returns the file and its stored bytes."""
    with open_reader(path, config) as reader:
        opened = open_checked(reader)
        gpu_device = restore_gpu_device(config, None, opened.index)
        engine = restore_engine(config, gpu_device)
        try:
            with open_data_reader(path, config, reader, gpu_device) as data_reader:
                stored = run_verify(data_reader, opened.index, engine,
                                    max_inflight_bytes=inflight_budget(config, engine), timeout=config.timeout,
                                    progress=progress)
        finally:
            engine.close()
    return opened, stored
