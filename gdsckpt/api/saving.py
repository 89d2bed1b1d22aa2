"""Saving: ``save``, the one internal save entry ``save_flat`` (used by ``save``, the background
savers, ``rebase`` and the DCP writer), delta sources, and the guard against replacing a base.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

from .. import collector
from ..codecs import versioned_name
from ..codecs.nvcomp import MAX_CHUNK_BYTES
from ..config import Config, parse_size
from ..errors import (
    CheckpointError,
    DeltaBaseError,
)
from ..format import Index, TensorRecord, dtype_spec
from ..format.layout import TRAILER_SIZE, unpack_trailer
from ..io import PosixWriter, StorageWriter
from ..io.fileobj import FileObjectWriter, is_file_object
from ..io.s3 import is_url
from ..pipeline.autotune import WEIGH_MIN_BYTES, runnable_candidates, storage_gbps
from ..pipeline.host_auto import HISTORY as HOST_AUTO_HISTORY
from ..pipeline.host_auto import storage_key
from ..pipeline.load import content_identity
from ..pipeline.plan import plan_chunks
from ..pipeline.save import run_save
from ..state import (
    FlatArray,
    FlatState,
    flatten,
)
from ..state.delta import DEFAULT_MAX_CHAIN, BaseBytes, XorSource, base_link, base_location_of, base_path_of
from ..state.lossy import LossyPolicy, apply_policy
from ..version import __version__
from . import checkpoint as checkpoint_module
from . import inflight
from .checkpoint import Checkpoint, base_arrays, data_record, opened_file
from .reading import gpu_only_bitstreams, inspect
from .reports import Progress, SaveReport, chain_label
from .resolve import (
    PathLike,
    check_path,
    check_target,
    choose_save_engine,
    cuda_device_of,
    cuda_devices_of,
    device_index,
    host_engine,
    inflight_budget,
    open_reader,
    posix_writer,
    resolve_config,
    resolve_host_codec,
    use_gpu,
)

log = logging.getLogger(__name__)


def save(state: Any, path: PathLike | StorageWriter | BinaryIO, *, codec: str = "auto",
         chunk_bytes: int | str | None = None, config: Config | None = None, progress: Progress | None = None,
         base: PathLike | None = None, max_chain: int = DEFAULT_MAX_CHAIN,
         lossy: LossyPolicy | dict[str, float] | None = None, force: bool = False,
         portable: bool | None = None) -> SaveReport:
    """Save ``state`` (nested dicts/lists/tuples of tensors, arrays and plain values) to ``path``.

    The file appears at ``path`` atomically and durably (fsync of file and directory) when this
    returns; on any error before the rename ``path`` keeps its previous content and no temporary
    file remains. (Should the directory's fsync after the rename fail, or not complete within
    ``config.timeout``, ``path`` already holds the new, complete checkpoint and the ``OSError``
    or ``TimeoutError`` is raised: its entry may not be durable yet.)
    ``codec``: ``"auto"``, ``"zstd"``, ``"lz4"``, ``"deflate"``, ``"none"``, or a GPU-only codec
    (``"ans"``, ...); ``"auto"`` defers to ``config.codec``. ``"auto"`` on the CPU engine is byte
    planes where they help + zstd, a chunk stored as it is while the storage waits for the codec
    threads. For CUDA state it is the GPU's best codec by measured storage speed and sampled
    ratios (nvCOMP ANS on most storage), except that a state of 256 MiB or more goes to the CPU
    engine's portable zstd when that is predicted to save at least 95% as fast: on a disk that
    holds both engines back the file any machine reads costs nothing (``pipeline.autotune``;
    ``SaveReport.auto`` records the figures). ``"zstd"``, ``"lz4"`` and ``"deflate"`` named for
    CUDA state run on the CPU engine, faster than nvCOMP's, unless ``config.engine == "gpu"``.
    ``chunk_bytes`` overrides ``config.chunk_bytes`` and ``config.gpu_chunk_bytes`` (at most
    nvCOMP's 16 MiB there: a larger size still applies to the CPU engine). Raises
    ``TypeError`` naming the key path of
    any value that cannot be saved. A tensor is saved as its dtype, shape and values (and a
    ``Parameter``'s ``requires_grad``): Python attributes set on it (``p.sequence_parallel =
    True``), which ``torch.save`` pickles, are not kept, nor its memory layout (strides).
    ``progress(done, total)``, if given, is called in the calling thread after each chunk
    (raw bytes so far, out of ``total``).

    ``base``: a checkpoint to write a *delta* against: arrays with the same key, dtype and shape as
    in ``base`` are stored as the XOR of their bytes with it (lossless; small where little
    changed), the others in full. The index records the base's path (relative when it lies in
    the same directory tree) and content identity, and loading resolves the chain by itself;
    a load whose base is missing or was changed raises ``DeltaBaseError``. When ``base`` is
    already a delta ``max_chain`` deep, a full checkpoint is written instead (see
    ``SaveReport.base``). ``base`` must not be ``path`` itself.

    A save first waits (at most ``config.timeout``) for any ``save_async``, conversion or other
    save still in flight that writes ``path``, writes its ``base``, or reads ``path`` as a base
    (``gdsckpt.api.inflight``): saves of one file end in the order they were called.

    Replacing a checkpoint that deltas use as their base would leave them unloadable for good:
    when ``path`` exists and a delta checkpoint in its directory names it as its base (and still
    matches its content), ``DeltaBaseError`` lists those deltas and nothing is written;
    ``gdsckpt rebase`` them first, save elsewhere, or pass ``force=True``. Deltas in other
    directories are not searched for.

    A path whose extension names another format (``.pt``, ``.safetensors``, ``.npz`` ...) is
    written all the same, with a ``ForeignExtensionWarning``: that format's tools cannot read it.

    ``path`` may be a writable binary file object (``io.BytesIO()``, ``open(p, "wb")``, a pipe),
    written front to back from its current position as the chunks are encoded (no more of the
    file is held in memory than ``Config.max_inflight_bytes``), flushed and left open; unlike a
    path it is not replaced atomically nor fsynced, and a failed save leaves partial bytes in a
    stream that cannot seek. ``path`` may also be an ``s3://bucket/key`` URL
    (docs/object-storage.md: one multipart upload, the object visible only once complete), or a
    ``gdsckpt.io.StorageWriter``:
    ``gdsckpt.io.NullWriter()`` keeps nothing, to measure the pipeline without storage
    (``SaveReport.path`` is then ``"<null>"``).

    ``lossy`` (default None: every array bit-exact): a ``gdsckpt.lossy.LossyPolicy`` or a dict of
    key pattern -> relative error bound, e.g. ``{"*.exp_avg_sq": 1e-2}``; matching float16 /
    bfloat16 / float32 / float64 torch and NumPy arrays are stored rounded to within
    ``rel * max(|finite x|)`` of their values (NaN and inf kept), see ``gdsckpt.lossy``;
    ``SaveReport.lossy`` lists them and loading them warns (``LossyWarning``).

    ``portable`` (default ``config.portable``, itself False unless ``GDSCKPT_PORTABLE`` says
    otherwise): True writes only codecs that decode without a GPU (``zstd``, ``lz4``, ``deflate``,
    ``none``), so that a CPU-only machine reads the file; a GPU-only ``codec`` then raises
    ``ValueError``, and CUDA state is compressed by the CPU engine (byte planes + zstd for
    ``"auto"``) unless ``config.engine == "gpu"``, where ``"auto"`` is nvCOMP's Zstd if
    ``max_staging_bytes`` holds its scratch (about 1.1 GiB) beside enough staging slots, else its
    LZ4 (``SaveReport.auto["portable_reason"]``). ``SaveReport.auto`` records the engine a save
    of CUDA state ran on and why (``"engine"``, ``"engine_reason"``).
    """
    if portable is not None:
        config = resolve_config(config, portable=portable)
    target = FileObjectWriter(path) if is_file_object(path) else cast("PathLike | StorageWriter", path)
    check_target(target)  # before the state is flattened: a bad path fails, a foreign extension warns
    # after a save_async of this file, of its base, or of a delta on it still in flight (api.inflight)
    with inflight.exclusive(target, base, resolve_config(config).timeout):
        if not force:
            refuse_replacing_base(target, config)
        return save_flat(flatten(state), target, codec=codec, chunk_bytes=chunk_bytes, config=config,
                         progress=progress, base=base, max_chain=max_chain, lossy=lossy)


def check_save_arguments(codec: str, chunk_bytes: int | str | None, config: Config | None, lossy: Any) -> None:
    """What a save refuses of its arguments before it reads the state (an unknown codec, a bad
    chunk size or setting, a lossy policy out of range: ``ValueError`` / ``TypeError``), for the
    callers that save later: ``save_async`` and ``CheckpointManager`` raised it only from the
    background, a save or two later, while the checkpoints of the first steps went missing."""
    resolve_config(config, chunk_bytes=chunk_bytes, gpu_chunk_bytes=_gpu_chunk_bytes(chunk_bytes),
                   codec=None if codec == "auto" else codec)
    if lossy is not None:
        LossyPolicy.of(lossy)


def _gpu_chunk_bytes(chunk_bytes: int | str | None) -> int | None:
    """The GPU engine's share of a save's ``chunk_bytes=``: the same size, at most nvCOMP's largest
    chunk, so that a size only the CPU engine can take (``chunk_bytes="32MiB"``) is no error."""
    return None if chunk_bytes is None else min(parse_size(chunk_bytes), MAX_CHUNK_BYTES)


def save_flat(flat: FlatState, path: PathLike | StorageWriter, *, codec: str = "auto",
              chunk_bytes: int | str | None = None, config: Config | None = None,
              devices: list[str] | None = None, progress: Progress | None = None, base: PathLike | None = None,
              max_chain: int = DEFAULT_MAX_CHAIN,
              lossy: LossyPolicy | dict[str, float] | None = None, rename: bool = True,
              background: bool = False, may_store_as_is: bool = True,
              before_commit: Callable[[], None] | None = None) -> SaveReport:
    """The one save entry of the package: write a flattened state (``gdsckpt.state.flatten``) to
    ``path``. ``save`` (after its guard against replacing a delta's base), the background savers,
    the save worker and ``rebase`` (which builds ``flat`` from a checkpoint's index) all end here.

    Arguments as ``save``, plus: ``devices`` (one per array, in flatten order) overrides the
    device each array's index entry records, and a ``cuda:N`` among them runs the GPU engine on
    device N (where usable) whatever memory the arrays live in: ``save_async`` passes the devices
    of the CUDA tensors it snapshotted into pinned host memory. ``rename=False``: the complete,
    fsynced file is left at a temporary path beside ``path``, given as the report's ``path``; the
    caller renames it (``gdsckpt.background.worker``). ``background``: a save beside training
    (``save_async``), whose speed ``codec="auto"`` does not learn from (``pipeline.host_auto``).
    ``may_store_as_is=False``: ``codec="auto"`` on host state compresses even where the codec
    threads are slower than the local disk (a ``CheckpointManager`` with a remote tier: the file
    is uploaded as well, where every byte saved is worth ``ratio`` bytes of state).
    ``before_commit()`` runs just before the file or object becomes visible; its error aborts the
    save (the save worker checks there that the process owning the snapshot is still alive)."""
    # not a decorator: its frame would be the one warnings name
    with collector.young_only(collector.OBJECTS_PER_ARRAY * len(flat.arrays)):
        started = time.perf_counter()
        cfg = resolve_config(config, chunk_bytes=chunk_bytes, gpu_chunk_bytes=_gpu_chunk_bytes(chunk_bytes),
                             codec=None if codec == "auto" else codec)
        gpu_device = None
        if devices is not None:
            if len(devices) != len(flat.arrays):
                raise ValueError(f"{len(devices)} devices given for {len(flat.arrays)} arrays")
            for array, device in zip(flat.arrays, devices):
                array.device = device
            gpu_device = next((device_index(d) for d in devices if d.startswith("cuda")), None)
        # Rounded before anything reads the sources (a delta then XORs the rounded values); a rewrite
        # (``rebase``, ``convert``) carries its source's rounded arrays over and reports them too.
        lossy_keys = apply_policy(flat, lossy) if lossy is not None else _carried_lossy_keys(flat)
        with contextlib.ExitStack() as stack:
            link: dict[str, Any] | None = None
            delta: set[int] = set()
            if base is not None:
                if isinstance(path, StorageWriter):
                    raise ValueError("a delta save (base=...) needs a file path, not a storage writer")
                link, delta = _delta_sources(flat, path, base, max_chain, cfg, stack)
            # A background save (``devices`` given: a snapshot of CUDA state) keeps the GPU engine's
            # choice: the CPU engine's codec threads would compete with the training loop for the
            # host's cores, which the engines' predicted save speeds do not weigh.
            engine, make_writer, codec_name, auto = _save_engine(cfg, flat, cfg.codec, path, gpu_device,
                                                                  weigh_cpu=not delta and devices is None,
                                                                  learn=not delta and not background
                                                                  and may_store_as_is)
            # the GPU encoder's chunks: gpu_chunk_bytes, or smaller where its staging fits the budget only then
            chunk = engine.chunk_bytes if engine.name == "gpu" else cfg.chunk_bytes
            if engine.name == "gpu" and chunk != cfg.gpu_chunk_bytes:
                auto.update(chunk_bytes=chunk, chunk_reason=(
                    f"gpu_chunk_bytes={cfg.gpu_chunk_bytes} leaves no room for two staging slots beside nvCOMP's "
                    f"{codec_name} scratch within max_staging_bytes={cfg.max_staging_bytes}"))
            plans = plan_chunks(
                [(0 if a.alias is not None else a.source.nbytes, a.source.itemsize if a.source else 1,
                  a.source.plane_width if a.source else 0) for a in flat.arrays],
                chunk_bytes=chunk, pack_below=min(cfg.pack_below, chunk), delta=delta,
            )
            writer: StorageWriter | None = None
            try:
                writer = path if isinstance(path, StorageWriter) else make_writer(path, cfg)
                if not rename:
                    if not isinstance(writer, PosixWriter):
                        writer.abort()
                        raise ValueError(f"a save in a worker process needs a file path, not {path!r}")
                    writer.keep_temporary = True
                result = run_save(plans, engine, writer, progress=progress,
                                  max_inflight_bytes=inflight_budget(cfg, engine),
                                  index=index_template(flat, link), timeout=cfg.timeout,
                                  before_commit=before_commit)
            except BaseException:
                # run_save aborts the writer it was handed; an error before it began (a ^C while the
                # index template is made) would leave the temporary file and its descriptors for the
                # life of the process. abort is safe more than once, and a no-op once committed.
                if writer is not None:
                    with contextlib.suppress(Exception):
                        writer.abort()
                raise
            finally:
                engine.close()
        logical = sum(a.source.nbytes for a in flat.arrays if a.alias is None)
        if auto.get("adaptive"):
            as_is = auto.get("stored") == "as it is"
            # chunks stored uncompressed: all of them, or those whose turn came while the storage waited
            auto["stored_as_is"] = len(result.chunks) if as_is else engine.stored_raw
            key = auto.pop("storage_key", None)
            if key is not None:
                pace = None if as_is else engine.codec_pace()
                HOST_AUTO_HISTORY.record(key, logical, None if pace is None else pace[0] / 1e9,
                                         cfg.effective_codec_threads)
        chains: dict[str, int] = {}
        for record in result.chunks:
            label = chain_label(result.chains[record.chain].to_json())
            chains[label] = chains.get(label, 0) + 1
        return SaveReport(
            path=_report_path(path, writer, rename), logical_bytes=logical, file_bytes=result.file_bytes,
            ratio=logical / result.file_bytes if result.file_bytes else 0.0,
            seconds=time.perf_counter() - started, codec=codec_name, backend=writer.name,
            engine=engine.name, tensors=len(flat.arrays), chunks=len(result.chunks), chains=chains, auto=auto,
            base=link["path"] if link is not None else None, delta_tensors=len(delta), lossy=tuple(lossy_keys),
        )


def _report_path(path: PathLike | StorageWriter, writer: StorageWriter, renamed: bool) -> str:
    """What ``SaveReport.path`` says: the path written, the temporary one a worker renames, or
    ``"<name>"`` of a storage writer given instead of a path."""
    if isinstance(path, StorageWriter):
        return f"<{path.name}>"
    return str(path) if renamed else str(cast(PosixWriter, writer).temp)


def _delta_sources(flat: FlatState, path: PathLike, base: PathLike, max_chain: int, config: Config,
                   stack: contextlib.ExitStack) -> tuple[dict[str, Any] | None, set[int]]:
    """Turn the sources of arrays that ``base`` also holds (same key, dtype, shape) into XORs
    with it; returns the index's ``base`` member and the ids of those arrays, or (None, empty)
    when the base's chain is already ``max_chain`` deep (a full save then)."""
    if isinstance(max_chain, bool) or not isinstance(max_chain, int) or max_chain < 0:
        raise ValueError(f"max_chain must be a non-negative integer, got {max_chain!r}")
    base_path: Path | str = str(base) if is_url(base) else Path(base)
    if is_url(base_path) or is_url(path):
        if str(base_path) == str(path):
            raise ValueError(f"a delta cannot replace its own base {str(base_path)!r}: save it to another path")
    elif not Path(base_path).is_file():
        raise DeltaBaseError(f"base checkpoint {str(base_path)!r} does not exist")
    elif Path(path).exists() and os.path.samefile(base_path, path):
        raise ValueError(f"a delta cannot replace its own base {str(base_path)!r}: save it to another path")
    try:
        checkpoint = stack.enter_context(Checkpoint(base_path, config))
    except FileNotFoundError as err:  # an object (a file was checked above)
        raise DeltaBaseError(f"base checkpoint {str(base_path)!r} does not exist") from err
    opened = opened_file(checkpoint)
    depth = opened.index.base["depth"] if opened.index.base is not None else 0
    if depth >= min(max_chain, checkpoint_module.MAX_RESOLVE_DEPTH):  # never write what a load would refuse
        log.info("base %s is a delta %d deep (max_chain=%d): writing a full checkpoint", base_path, depth,
                 max_chain)
        return None, set()
    # Every link of the base's chain must resolve, and none may be ``path``: a delta saved over
    # a link below its own base (``save(s, x, base=y)`` where ``y`` is a delta on ``x``) replaced
    # the file its chain needs and could never load, nor could ``y``.
    with checkpoint_module.base_chain(checkpoint, config) as chain:
        for link_file in chain[1:]:
            if _same_location(link_file.path, path):
                raise ValueError(f"{str(path)!r} is a base of {str(base_path)!r} (its chain of deltas): a delta "
                                 f"on it saved there would replace a file its own chain needs; save it to "
                                 f"another path, or rebase {str(base_path)!r} first")
        gpu_only = sorted({name for link_file in chain for name in gpu_only_bitstreams(link_file.index)}) \
            if config.portable else []
    if config.portable:
        # A delta loads only where its bases decode: on a base only a GPU decodes, the file
        # portable=True promises (any machine reads it) is a full one.
        if gpu_only:
            log.info("base %s holds chunks only a GPU decodes (%s): portable=True writes a full checkpoint",
                     base_path, ", ".join(gpu_only))
            return None, set()
    link = base_link(path, base_path, opened.index_sha256, opened.trailer.file_length, depth)
    reader = base_arrays(checkpoint)
    delta = set()
    for i, array in enumerate(flat.arrays):
        if array.alias is not None or array.source is None or not array.source.nbytes or array.key not in checkpoint:
            continue
        record = data_record(checkpoint, array.key)
        if (record.dtype, record.shape) == (array.dtype, tuple(array.shape)):
            array.source = XorSource(array.source, reader.view(record.key))
            delta.add(i)
    return link, delta


def _same_location(link: str | None, path: PathLike) -> bool:
    """Whether a base link's location (a file path or an object URL) is ``path``."""
    if link is None:
        return False
    if is_url(link) or is_url(path):
        return str(link) == str(path)
    return Path(path).exists() and Path(link).exists() and os.path.samefile(link, path)


def rebase(path: PathLike, output: PathLike | None = None, *, codec: str = "auto", config: Config | None = None,
           force: bool = False) -> SaveReport:
    """Turn a delta checkpoint into a full one: every array resolved through its chain of bases
    and written in full to ``output`` (default: ``path`` itself, replaced atomically).

    Memory stays bounded: arrays are read and written in windows, never whole. Replacing
    ``path`` changes its content identity, so deltas written against it would no longer load:
    when other checkpoints in its directory name it as their base, an in-place rebase raises
    ``DeltaBaseError`` listing them, unless ``force=True``; so does an existing ``output``
    that deltas use as their base. A full checkpoint is rewritten all the same: its arrays and
    structure are kept, its chunks re-encoded with ``codec`` (its size may change).
    """
    cfg = resolve_config(config)
    output = path if output is None else output
    with inflight.exclusive(output, path, cfg.timeout, what="rebase"):  # after saves of either in flight
        return _rebase(path, output, codec, cfg, force)


def _rebase(path: PathLike, output: PathLike, codec: str, cfg: Config, force: bool) -> SaveReport:
    if is_url(path) or is_url(output):
        if not force:
            refuse_replacing_base(output, cfg)  # in place or not: an object another delta needs
        return rewrite(path, output, codec=codec, config=cfg)
    in_place = Path(output).exists() and os.path.samefile(path, output)
    if in_place and not force:
        dependents = _dependents(Path(path), cfg)
        if dependents:
            raise DeltaBaseError(
                f"{str(path)!r} is the base of {', '.join(repr(str(d)) for d in dependents)}: rebasing it in "
                f"place would make them unloadable; rebase those first, write to another output, or pass "
                f"force=True (--force)")
    elif not force:
        refuse_replacing_base(output, cfg)  # an existing output may be another delta's base
    return rewrite(path, output, codec=codec, config=cfg)


REWRITE_READ_AHEAD = True
REWRITE_WINDOW_BYTES: int | None = None
"""How ``rewrite`` reads its source: windows of this many bytes (None: the configuration's
``max_inflight_bytes``, so that the memory a convert takes stays a multiple of one bound), the
next read ahead while the codec threads work on one (``state.delta.BaseReader``). Why both: a
window read is one restore of the source, whose reads wait while it starts and decodes, and
with one window fetched at a time and none ahead the codec threads wait for each; larger windows
read ahead brought an ANS-to-zstd convert from about 0.85 of the storage's read + write time
to about 1 (docs/performance.md, "Portable files from CUDA state")."""


def rewrite(path: PathLike, output: PathLike, *, codec: str = "auto", config: Config | None = None,
            progress: Progress | None = None) -> SaveReport:
    """Write every array of the checkpoint ``path`` in full to ``output`` with ``codec`` (a delta's
    arrays resolved through its chain of bases), the structure and the records' metadata kept:
    what ``rebase`` and a gdsckpt-to-gdsckpt ``convert`` do. Memory stays bounded whatever the
    checkpoint's size: the arrays are read in windows of a few chunks (``state.delta.BaseReader``,
    decoded by whichever engine their codecs need) while the save pipeline writes the previous
    ones, the next window read ahead. Windows are ``max_inflight_bytes`` each; the reader keeps up
    to three, fills one more and its restore copies one out: beside the save's own bound, a
    rewrite holds up to five times ``max_inflight_bytes`` of host memory (1.25 GiB at the
    default). ``output`` is written as ``save`` writes (atomically, replacing a file there)."""
    cfg = resolve_config(config)
    with Checkpoint(path, cfg) as checkpoint:
        index = opened_file(checkpoint).index
        reader = base_arrays(checkpoint, as_base=False, read_ahead=REWRITE_READ_AHEAD,
                             window_bytes=REWRITE_WINDOW_BYTES or cfg.max_inflight_bytes)
        arrays = []
        for record in index.tensors:
            source = None
            if record.alias is None:
                source = _WindowSource(reader.view(record.key), record.dtype)
            arrays.append(FlatArray(record.key, record.kind, record.dtype, record.shape, record.device, source,
                                    record.alias, dict(record.extra), lossy=record.lossy))
        try:
            return save_flat(FlatState(index.tree, arrays), output, codec=codec, config=cfg, progress=progress)
        finally:
            reader.close()


def refuse_replacing_base(path: PathLike | StorageWriter, config: Config | None) -> None:
    """Raise ``DeltaBaseError`` when ``path`` exists and delta checkpoints in its directory
    depend on it as it is (``_dependents``): replacing it would make them unloadable. Costs
    nothing when ``path`` does not exist; else it reads the index of each file beside it (of
    each object in its prefix, for an ``s3://`` URL)."""
    dependents = deltas_on(path, config)
    if dependents:
        raise DeltaBaseError(
            f"{str(path)!r} is the base of {', '.join(repr(str(d)) for d in dependents)}: replacing it "
            f"would make them unloadable; rebase those first (gdsckpt rebase), write to another path, "
            f"or pass force=True (--force)")


def deltas_on(path: PathLike | StorageWriter, config: Config | None) -> list[Any]:
    """The delta checkpoints beside ``path`` (files in its directory, objects in its prefix) that
    depend on it as it is now; empty when ``path`` does not exist or is no file or object."""
    if is_url(path):
        return _object_dependents(str(path), resolve_config(config))
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return []
    return _dependents(Path(path), resolve_config(config))


def _dependents(path: Path, config: Config) -> list[Path]:
    """Checkpoint files beside ``path`` whose index names ``path`` as their base and records its
    present content identity: the deltas that load now and would not once ``path`` changes.

    Only ``path``'s directory is searched (where ``CheckpointManager`` and most runs keep their
    deltas): a delta in another directory (naming ``path`` by an absolute path, or from a parent
    directory by a relative one) is not found."""
    def names_path(entry: Path, base: dict[str, Any]) -> bool:
        candidate = base_path_of(str(entry), base)
        return candidate.exists() and os.path.samefile(candidate, path)

    entries = [entry for entry in sorted(path.parent.iterdir())
               if not entry.name.startswith(".") and entry.is_file() and not os.path.samefile(entry, path)]
    return _deltas_of(path, entries, names_path, config)


def _object_dependents(url: str, config: Config) -> list[str]:
    """``_dependents`` of an object: the delta objects in its prefix whose base is ``url`` as it
    is now (one listing, then the index of each other checkpoint object there); empty, after
    one HEAD, when there is no object at ``url`` (a save to a new key)."""
    from ..io.s3 import ObjectDirectory

    prefix, _slash, name = url.rpartition("/")
    directory = ObjectDirectory(prefix, endpoint=config.s3_endpoint, timeout=config.timeout)
    if directory.size(name) is None:
        return []
    entries = [directory.url_of(other) for other in sorted(directory.names())
               if other != name and not other.startswith(".")]
    return _deltas_of(url, entries, lambda entry, base: base_location_of(entry, base) == url, config)


def _deltas_of(base_location: Any, entries: list[Any], names_it: Callable[[Any, dict[str, Any]], bool],
               config: Config) -> list[Any]:
    """The ``entries`` (files or objects) that are deltas of ``base_location`` as it is now: their
    index records its content identity and ``names_it(entry, link)`` says the link leads to it."""
    try:
        with open_reader(base_location, config) as reader:
            identity = content_identity(reader)
    except (CheckpointError, OSError):
        return []  # not a readable checkpoint: no delta can load against it as it is
    found = []
    for entry in entries:
        # A delta written against the base as it is records its index digest: entries whose index
        # lacks it are passed over unparsed (parsing every index of a directory costs ~5 ms each).
        if not _index_mentions(entry, identity[0].encode(), config):
            continue
        try:
            base = inspect(entry, config=config).base
        except (CheckpointError, OSError):
            continue  # not a checkpoint, or unreadable: not a dependent we can know of
        if base is not None and (base["index_sha256"], base["file_length"]) == identity and names_it(entry, base):
            found.append(entry)
    return found


def _index_mentions(path: Path | str, text: bytes, config: Config) -> bool:
    """Whether ``path`` is a checkpoint whose index bytes contain ``text``: reads its trailer and
    index, parses neither (False for a file that is not a readable checkpoint)."""
    try:
        with open_reader(path, config) as reader:
            size = reader.size
            trailer = unpack_trailer(reader.read(size - TRAILER_SIZE, TRAILER_SIZE) if size >= TRAILER_SIZE
                                     else b"", size)
            return text in reader.read(trailer.index_offset, trailer.index_length)
    except (CheckpointError, OSError):
        return False


class _WindowSource:
    """An ``ArraySource`` over an array of a checkpoint, read in windows (``rebase``)."""

    on_device = False

    def __init__(self, data: BaseBytes, dtype: str):
        spec = dtype_spec(dtype)
        self.data = data
        self.nbytes = data.nbytes
        self.itemsize = spec.itemsize
        self.plane_width = spec.plane_width

    def host_bytes(self, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` of the resolved array."""
        return self.data.host(start, stop)

    def device_bytes(self, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` on the current CUDA device."""
        return self.data.device(start, stop)


def _save_engine(config: Config, flat: FlatState, codec: str, path: PathLike | StorageWriter,
                 gpu_device: int | None = None, weigh_cpu: bool = True,
                 learn: bool = False) -> tuple[Any, Any, str, dict[str, Any]]:
    """The engine and writer factory of a save, the codec it runs, and how ``auto`` chose them
    (``gpu_device``: the GPU to compress on when the arrays are not on one). ``path`` may be a
    ``StorageWriter`` (the null sink): ``auto`` then takes ``config.storage_gbps`` as its speed,
    or with none set treats the storage as never the bottleneck.

    ``codec="auto"`` on CUDA state with ``engine="auto"`` weighs the GPU engine's best codec against
    the CPU engine's portable one (``pipeline.autotune.choose_engine``; ``weigh_cpu=False``, as for
    a delta or a background save, keeps the GPU's choice) and records the figures in the report's ``auto``.
    On host state ``learn=True`` lets the process's earlier saves to the same storage decide
    whether ``auto`` compresses or stores as it is (``pipeline.host_auto``)."""
    device = cuda_device_of(flat) if gpu_device is None else gpu_device
    chosen, why = choose_save_engine(config, codec, device is not None, use_gpu(config, device is not None))
    auto: dict[str, Any] = {"engine": chosen, "engine_reason": why} if device is not None else {}
    holding = cuda_devices_of(flat)
    if holding:
        from ..codecs.device import synchronize_devices

        # Every queued update has landed on each GPU the arrays are on, before either engine
        # reads them (the GPU engine on a stream of its own, the CPU engine's threads on theirs).
        synchronize_devices(holding)
    if chosen == "gpu" and len(holding) > 1:
        # The GPU engine compresses on one GPU: arrays on the others go through host memory
        # (its kernels and nvCOMP would otherwise read another GPU's memory by address).
        for array in flat.arrays:
            if array.source is not None and array.source.on_device and device_index(array.device) != device:
                array.source.on_device = False
    if chosen == "gpu":
        if codec != "auto":
            versioned_name(codec)  # ValueError listing the valid names for an unknown one
        elif config.portable:
            # engine="gpu" and portable: nvCOMP's Zstd where the budget holds its scratch beside
            # enough slots, else its LZ4 (32 MiB of scratch; a lower ratio), rather than a refusal
            zstd_fits = "zstd" in runnable_candidates(config.max_staging_bytes, config.gpu_chunk_bytes)[0]
            codec = "zstd" if zstd_fits else "lz4"
            auto.update(chose=codec, portable=True)
            if not zstd_fits:
                auto["portable_reason"] = (f"max_staging_bytes={config.max_staging_bytes} cannot hold nvCOMP's Zstd "
                                           "scratch beside enough staging slots: nvCOMP's LZ4 instead")
        else:
            weigh = weigh_cpu and config.engine == "auto" and _logical_bytes(flat) >= WEIGH_MIN_BYTES
            codec, chosen = _gpu_auto(config, flat, path, device or 0, weigh, auto)
    if chosen == "gpu":
        from ..io.kvikio import KvikioWriter
        from ..pipeline.gpu import GpuEncoder

        engine = GpuEncoder([a.source for a in flat.arrays], codec=codec, byte_planes=config.byte_planes,
                            device_id=device or 0,
                            chunk_bytes=config.gpu_chunk_bytes, max_staging_bytes=config.max_staging_bytes,
                            timeout=config.timeout, fit_chunk=True)

        def make_writer(path: PathLike, cfg: Config) -> StorageWriter:
            if is_url(path):
                return posix_writer(path, cfg)  # an object: its writer copies the streams to host memory
            check_path(path)
            return KvikioWriter(path, threads=cfg.kvikio_threads, task_size=cfg.kvikio_task_size,
                                o_direct=cfg.o_direct, fsync=cfg.fsync, timeout=cfg.timeout)

        return engine, make_writer, codec, auto
    adaptive = codec == "auto"
    codec = resolve_host_codec(codec)
    if adaptive:
        auto = {**auto, "chose": codec, "adaptive": True}
        storage = storage_key(path) if device is None and learn else None
        if storage is not None:  # host state, a foreground full save to a file: can the codec keep up?
            key, directory = storage
            choice = HOST_AUTO_HISTORY.choose(key, _logical_bytes(flat), config.effective_codec_threads,
                                              lambda: storage_gbps(directory, config.storage_gbps, config.timeout))
            auto.update(stored="as it is" if choice.as_is else "compressed", stored_reason=choice.reason,
                        storage_key=key)
            if choice.codec_gbps is not None:
                auto.update(codec_gbps=choice.codec_gbps, storage_gbps=choice.storage_gbps)
            if choice.as_is:
                codec = auto["chose"] = "none"
                adaptive = False
    # A chunk stored as it is goes to the writer from the state's memory (``HostEngine.as_is_views``)
    # unless O_DIRECT was asked for, which needs the aligned copy.
    views = config.o_direct is not True
    return (host_engine(config, [a.source for a in flat.arrays], codec, adaptive=adaptive, as_is_views=views),
            posix_writer, codec, auto)


def _carried_lossy_keys(flat: FlatState) -> list[str]:
    """Keys of the arrays ``flat`` holds as already rounded (a rewrite's source's lossy records)
    and of the entries that alias them, in state order, as ``apply_policy`` reports them."""
    rounded = {i for i, a in enumerate(flat.arrays) if a.alias is None and a.lossy is not None}
    return [a.key for i, a in enumerate(flat.arrays) if i in rounded or a.alias in rounded]


def _logical_bytes(flat: FlatState) -> int:
    return sum(a.source.nbytes for a in flat.arrays if a.source is not None and a.alias is None)


def _gpu_auto(config: Config, flat: FlatState, path: PathLike | StorageWriter, device: int, weigh_cpu: bool,
              auto: dict[str, Any]) -> tuple[str, str]:
    """``codec="auto"`` for CUDA state: the GPU engine's codec by storage speed and sampled ratios
    (``pipeline.autotune``), then, with ``weigh_cpu``, the engine: ``("auto", "cpu")`` where the CPU
    engine's portable codec saves at least about as fast. Fills ``auto`` with what was measured."""
    from ..pipeline.autotune import (
        HOST_CODEC_CEILING_GBPS,
        choose_codec,
        choose_engine,
        cpu_could_win,
        measure_host_codec,
        runnable_candidates,
        sample_ratios,
    )

    candidates, left_out = runnable_candidates(config.max_staging_bytes, config.gpu_chunk_bytes)
    speed: float | None = None
    threads = config.effective_codec_threads
    if weigh_cpu:
        speed = _storage_speed(config, path)
        # ANS is always a candidate and stores no chunk larger than it is: with a ratio of 1 the GPU
        # is predicted at least min(its speed, the storage's), a bound the CPU's may not reach at all
        if not cpu_could_win(speed, "ans", 1.0, threads):
            weigh_cpu = False
            auto.update(engine_reason=(
                f"the GPU: the CPU engine could not reach its speed even at {HOST_CODEC_CEILING_GBPS:g} GB/s "
                f"per codec thread x {threads} (storage {speed:.2f} GB/s)"))
    if len(candidates) == 1 and not weigh_cpu:  # nothing to compare: no sample (and no probe unless weighed)
        auto.update(storage_gbps=speed, sampled_ratios={}, chose=candidates[0], left_out=left_out)
        return candidates[0], "gpu"
    if speed is None:
        speed = _storage_speed(config, path)
    sources = [a.source for a in flat.arrays]
    ratios = sample_ratios(sources, device, candidates)
    codec = choose_codec(speed, ratios)
    auto.update(storage_gbps=speed, sampled_ratios=ratios, chose=codec, left_out=left_out)
    if not weigh_cpu:
        return codec, "gpu"
    host = measure_host_codec(sources, "zstd", config.level, config.byte_planes)
    engine, figures = choose_engine(speed, codec, ratios[codec], host, threads)
    auto.update(figures, gpu_codec=codec)
    if engine == "cpu":
        predicted = figures["predicted_gbps"]
        auto.update(engine="cpu", engine_reason=(
            f"the CPU engine's portable zstd is predicted at {predicted['cpu:zstd']:.2f} GB/s against "
            f"{predicted[f'gpu:{codec}']:.2f} for the GPU's {codec} (storage {speed:.2f} GB/s): within "
            f"{figures['margin']:.0%}, so the file any machine reads"))
        return "auto", "cpu"
    return codec, "gpu"


def _storage_speed(config: Config, path: PathLike | StorageWriter) -> float:
    """The write speed ``auto`` weighs for ``path``: ``config.storage_gbps``, else the cached probe
    of its filesystem; unbounded for a storage writer object or an object URL, and where the probe
    could not run (a disk too full for it): the GPU's fastest codec then, as on a fast tier."""
    if isinstance(path, StorageWriter) or is_url(path):
        return config.storage_gbps if config.storage_gbps is not None else math.inf
    check_path(path)
    speed = storage_gbps(Path(path).parent, config.storage_gbps, config.timeout)
    return math.inf if speed is None else speed


@collector.paused()
def index_template(flat: FlatState, base: dict[str, Any] | None = None) -> Index:
    """The index of a file that will hold ``flat``, as known before any chunk is written: the
    tree, one record per array without segments, the writer, and a delta's ``base`` (format 1.1)
    or none (1.0). ``run_save`` fills in the chunks, chains and segments."""
    tensors = [TensorRecord(key=a.key, kind=a.kind, dtype=a.dtype, shape=a.shape, device=a.device, alias=a.alias,
                            extra=a.extra, lossy=a.lossy) for a in flat.arrays]
    return Index(chains=[], chunks=[], tensors=tensors, tree=flat.tree, writer=f"gdsckpt {__version__}",
                 minor=1 if base is not None else 0, base=base)
