"""The public API: save, load, load_into, open, inspect, verify.

Each call flattens or rebuilds the state (``state.py``), plans chunks, and runs the one pipeline
(``pipeline/``) with an engine and a storage backend chosen from the configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..version import __version__
from ..codecs import Chain, PORTABLE_CODECS, known_codec_names, versioned_name
from ..config import Config
from ..state.delta import DEFAULT_MAX_CHAIN, BaseBytes, BaseReader, XorSource, XorTarget, base_link, base_path_of, check_identity
from ..errors import (
    BaseCheckpointError, CheckpointError, CodecUnavailableError, CorruptCheckpointError, StateMismatchError,
)
from ..format import Index, TensorRecord, dtype_spec
from ..format.layout import TRAILER_SIZE, unpack_trailer
from ..io import PosixReader, PosixWriter, StorageReader, StorageWriter
from ..state.lossy import LossyPolicy, LossyWarning, apply_policy
from ..pipeline.engine import HostEngine
from ..pipeline.load import OpenedFile, open_file, overlapping, run_restore, run_verify
from ..pipeline.plan import plan_chunks
from ..pipeline.save import SaveResult, run_save
from ..state import (
    CupyTarget, FlatArray, FlatState, JaxTarget, KeyPaths, NumpyTarget, Selection, TorchTarget, decode_scalar,
    escape_key,
    _torch_dtype_name, flatten, join_key, unflatten, walk_tree,
)

PathLike = str | os.PathLike[str]
log = logging.getLogger(__name__)
_BASE_LOCK = threading.Lock()
MAX_RESOLVE_DEPTH = 64
"""Deltas a load resolves behind one file (each link is a nested restore, a few stack frames
deep): far beyond ``max_chain``'s default of 8, short of Python's recursion limit."""


# ---------------------------------------------------------------------------------------------
# reports

@dataclass(frozen=True)
class SaveReport:
    """What a save did. ``ratio`` is logical bytes over bytes on disk (the whole file)."""

    path: str
    logical_bytes: int
    stored_bytes: int
    ratio: float
    seconds: float
    codec: str
    backend: str
    engine: str
    tensors: int
    chunks: int
    chains: dict[str, int] = field(default_factory=dict)
    """How many chunks used each codec chain, e.g. ``{"byteplanes/1+zstd/1": 12, "none/1": 1}``."""
    auto: dict[str, Any] = field(default_factory=dict)
    """For ``codec="auto"`` on the GPU: ``storage_gbps`` and ``sampled_ratios`` the choice used,
    ``chose``, and ``left_out`` (candidate -> why the staging budget ruled it out; with a single
    candidate left nothing is measured and ``storage_gbps`` is None)."""
    base: str | None = None
    """The base checkpoint of a delta save (as the index records it), None for a full one."""
    delta_tensors: int = 0
    """Arrays stored as the XOR with the base."""
    lossy: tuple[str, ...] = ()
    """Keys of the arrays stored rounded to their error bound (``save(lossy=...)``)."""

    @property
    def throughput(self) -> float:
        """Logical bytes per second of wall time, durable writes included."""
        return self.logical_bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class TensorInfo:
    """One array in a checkpoint, as ``inspect`` and ``open().info`` describe it."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    nbytes: int
    stored_bytes: int
    chunks: int
    codecs: tuple[str, ...]
    alias_of: str | None = None
    delta: bool = False
    """Stored as the XOR with the same array of the base checkpoint."""
    lossy: dict[str, Any] | None = None
    """For an array saved with ``save(lossy=...)``: ``{"mode", "rel_bound", "abs_bound",
    "max_error"}`` (its values are within ``abs_bound`` of the saved ones, not bit-exact)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """Summary of a checkpoint file (``inspect``)."""

    path: str
    format_version: tuple[int, int]
    writer: str
    file_bytes: int
    logical_bytes: int
    ratio: float
    tensors: tuple[TensorInfo, ...]
    codecs: dict[str, int]
    base: dict[str, Any] | None = None
    """A delta checkpoint's base (path, index SHA-256, file length, chain depth); None if full."""


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of ``verify``: every chunk was read, checksummed and decoded."""

    path: str
    chunks: int
    stored_bytes: int
    logical_bytes: int
    seconds: float
    bases: tuple[str, ...] = ()
    """A delta's chain of bases, nearest first, each checked to be present and unchanged (and,
    with ``verify(chain=True)``, verified chunk by chunk too)."""


def chain_label(chain: list[dict[str, Any]]) -> str:
    """A chain as text: stage names joined by ``+`` (``"byteplanes/1+zstd/1"``)."""
    return "+".join(stage["name"] for stage in chain)


# ---------------------------------------------------------------------------------------------
# configuration and backends

def _config(config: Config | None, **overrides: Any) -> Config:
    base = config if config is not None else Config.from_env()
    changes = {name: value for name, value in overrides.items() if value is not None}
    return base.replace(**changes) if changes else base


def _resolve_codec(name: str) -> str:
    """The user-facing codec a save runs with on the CPU engine."""
    if name == "auto":
        return "zstd"
    versioned_name(name)  # raises ValueError listing the valid names for an unknown one
    if name not in PORTABLE_CODECS:
        from ..codecs import host_codec

        host_codec(name)  # raises CodecUnavailableError naming the portable alternatives
    return name


def _open_checked(reader: StorageReader) -> OpenedFile:
    """``open_file`` plus the checks that need the state layer: every tensor's key is the key
    path of its place in the structure, and no dict holds the same key twice (a file that breaks
    either would load a tensor under the wrong name or silently drop one)."""
    opened = open_file(reader)
    index = opened.index
    for node, path in walk_tree(index.tree):
        if node["t"] == "tensor":
            expected = join_key(path)
            if index.tensors[node["id"]].key != expected:
                raise CorruptCheckpointError(f"invalid index: tensor {node['id']} is keyed "
                                             f"{index.tensors[node['id']].key!r} but sits at {expected!r}")
        elif node["t"] == "dict":
            keys = [decode_scalar(key) for key, _value in node["items"]]
            # by == (as the dict will hold them: True == 1, 0.0 == -0.0) and by repr (NaN != NaN)
            if len(set(keys)) != len(keys) or len(set(map(repr, keys))) != len(keys):
                raise CorruptCheckpointError(f"invalid index: a dict at {join_key(path)!r} repeats a key")
    return opened


def _check_target(path: PathLike) -> None:
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"checkpoint path {str(target)!r} is a directory; give a file path")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"directory {str(target.parent)!r} of checkpoint path does not exist")


def _writer(path: PathLike, config: Config) -> StorageWriter:
    _check_target(path)
    return PosixWriter(path, threads=config.io_threads, o_direct=config.o_direct, fsync=config.fsync,
                       timeout=config.timeout)


def _reader(path: PathLike, config: Config, gpu: bool = False) -> StorageReader:
    if isinstance(path, StorageReader):
        return path
    if gpu:
        from ..io.kvikio import KvikioReader

        return KvikioReader(path, threads=config.kvikio_threads, task_size=config.kvikio_task_size)
    return PosixReader(path, threads=config.io_threads, timeout=config.timeout)


def _restore_engine(config: Config, gpu_device: int | None) -> Any:
    if gpu_device is None:
        return _host_engine(config)
    from ..pipeline.gpu import GpuDecoder

    return GpuDecoder(device_id=gpu_device, max_staging_bytes=config.max_staging_bytes, timeout=config.timeout)


def _host_engine(config: Config, sources: list[Any] | None = None, codec: str = "none") -> HostEngine:
    return HostEngine(sources or [], codec=codec, byte_planes=config.byte_planes,
                      threads=config.effective_codec_threads, level=config.level, timeout=config.timeout)


# ---------------------------------------------------------------------------------------------
# save

Progress = Callable[[int, int], None]
"""``progress(done, total)``: raw bytes written (save) or decoded (load, verify) so far, out of
``total``; called in the calling thread after each chunk."""


def save(state: Any, path: PathLike, *, codec: str = "auto", chunk_bytes: int | str | None = None,
         config: Config | None = None, progress: Progress | None = None, base: PathLike | None = None,
         max_chain: int = DEFAULT_MAX_CHAIN,
         lossy: LossyPolicy | dict[str, float] | None = None, force: bool = False) -> SaveReport:
    """Save ``state`` (nested dicts/lists/tuples of tensors, arrays and plain values) to ``path``.

    The file appears at ``path`` atomically and durably (fsync of file and directory) when this
    returns; on any error before the rename ``path`` keeps its previous content and no temporary
    file remains. (Should the directory's fsync after the rename fail, ``path`` already holds the
    new, complete checkpoint and the ``OSError`` is raised: its entry may not be durable yet.)
    ``codec``: ``"auto"`` (byte planes where they help + zstd on the CPU), ``"zstd"``,
    ``"lz4"``, ``"deflate"``, ``"none"``; ``"auto"`` defers to ``config.codec``.
    ``chunk_bytes`` overrides ``config.chunk_bytes`` and ``config.gpu_chunk_bytes``. Raises ``TypeError`` naming the key path of
    any value that cannot be saved. ``progress``: see ``Progress``.

    ``base``: a checkpoint to write a *delta* against: arrays with the same key, dtype and shape as
    in ``base`` are stored as the XOR of their bytes with it (lossless; small where little
    changed), the others in full. The index records the base's path (relative when it lies in
    the same directory tree) and content identity, and loading resolves the chain by itself;
    a load whose base is missing or was changed raises ``BaseCheckpointError``. When ``base`` is
    already a delta ``max_chain`` deep, a full checkpoint is written instead (see
    ``SaveReport.base``). ``base`` must not be ``path`` itself.

    Replacing a checkpoint that deltas use as their base would leave them unloadable for good:
    when ``path`` exists and a delta checkpoint in its directory names it as its base (and still
    matches its content), ``BaseCheckpointError`` lists those deltas and nothing is written;
    ``gdsckpt rebase`` them first, save elsewhere, or pass ``force=True``. Deltas in other
    directories are not searched for.

    ``lossy`` (default None: every array bit-exact): a ``gdsckpt.lossy.LossyPolicy`` or a dict of
    key pattern -> relative error bound, e.g. ``{"*.exp_avg_sq": 1e-2}``; matching float16 /
    bfloat16 / float32 / float64 torch and NumPy arrays are stored rounded to within
    ``rel * max(|finite x|)`` of their values (NaN and inf kept), see ``gdsckpt.lossy``;
    ``SaveReport.lossy`` lists them and loading them warns (``LossyWarning``).
    """
    if not force:
        _refuse_replacing_base(path, config)
    return _save(state, path, codec=codec, chunk_bytes=chunk_bytes, config=config, progress=progress,
                 base=base, max_chain=max_chain, lossy=lossy)


def _save(state: Any, path: PathLike, *, codec: str, chunk_bytes: int | str | None, config: Config | None,
          devices: list[str] | None = None, progress: Progress | None = None, base: PathLike | None = None,
          max_chain: int = DEFAULT_MAX_CHAIN, lossy: LossyPolicy | dict[str, float] | None = None,
          flat: FlatState | None = None, rename: bool = True) -> SaveReport:
    """``save``; ``devices`` (one per array, in flatten order) overrides the device each array's
    index entry records, and a ``cuda:N`` among them runs the GPU engine on device N (where
    usable) whatever memory the arrays live in: ``save_async`` passes the devices of the CUDA
    tensors it snapshotted into pinned host memory. ``flat``: an already flattened state (then
    ``state`` is ignored), as ``rebase`` builds from a checkpoint's index. ``rename=False``: the
    complete, fsynced file is left at a temporary path beside ``path``, given as the report's
    ``path``; the caller renames it (``gdsckpt.background.worker``)."""
    started = time.perf_counter()
    cfg = _config(config, chunk_bytes=chunk_bytes, gpu_chunk_bytes=chunk_bytes,
                  codec=None if codec == "auto" else codec)
    flat = flatten(state) if flat is None else flat
    gpu_device = None
    if devices is not None:
        if len(devices) != len(flat.arrays):
            raise ValueError(f"{len(devices)} devices given for {len(flat.arrays)} arrays")
        for array, device in zip(flat.arrays, devices):
            array.device = device
        gpu_device = next((_device_index(d) for d in devices if d.startswith("cuda")), None)
    # Rounded before anything reads the sources (a delta then XORs the rounded values).
    lossy_keys = apply_policy(flat, lossy) if lossy is not None else []
    with contextlib.ExitStack() as stack:
        link, delta = None, set()
        if base is not None:
            link, delta = _delta_sources(flat, path, base, max_chain, cfg, stack)
        engine, make_writer, codec_name, auto = _save_engine(cfg, flat, cfg.codec, Path(path), gpu_device)
        chunk = cfg.gpu_chunk_bytes if engine.name == "gpu" else cfg.chunk_bytes
        plans = plan_chunks(
            [(0 if a.alias is not None else a.source.nbytes, a.source.itemsize if a.source else 1,
              a.source.plane_width if a.source else 0) for a in flat.arrays],
            chunk_bytes=chunk, pack_below=min(cfg.pack_below, chunk), delta=delta,
        )
        try:
            writer = make_writer(path, cfg)
            if not rename:
                if not isinstance(writer, PosixWriter):
                    writer.abort()
                    raise ValueError(f"a save in a worker process needs a file path, not {path!r}")
                writer.keep_temporary = True
            result = run_save(plans, engine, writer, progress=progress,
                              max_inflight_bytes=_inflight_budget(cfg, engine.name == "gpu"),
                              build_index=lambda r: _build_index(flat, r, link), timeout=cfg.timeout,
                              minor=1 if link is not None else 0)
        finally:
            engine.close()
    logical = sum(a.source.nbytes for a in flat.arrays if a.alias is None)
    chains: dict[str, int] = {}
    for chunk in result.chunks:
        label = chain_label(result.chains[chunk.chain].to_json())
        chains[label] = chains.get(label, 0) + 1
    return SaveReport(
        path=str(path if rename else writer.temp), logical_bytes=logical, stored_bytes=result.file_bytes,
        ratio=logical / result.file_bytes if result.file_bytes else 0.0,
        seconds=time.perf_counter() - started, codec=codec_name, backend=writer.name,
        engine=engine.name, tensors=len(flat.arrays), chunks=len(result.chunks), chains=chains, auto=auto,
        base=link["path"] if link is not None else None, delta_tensors=len(delta), lossy=tuple(lossy_keys),
    )


def _delta_sources(flat: FlatState, path: PathLike, base: PathLike, max_chain: int, config: Config,
                   stack: contextlib.ExitStack) -> tuple[dict[str, Any] | None, set[int]]:
    """Turn the sources of arrays that ``base`` also holds (same key, dtype, shape) into XORs
    with it; returns the index's ``base`` member and the ids of those arrays, or (None, empty)
    when the base's chain is already ``max_chain`` deep (a full save then)."""
    if isinstance(max_chain, bool) or not isinstance(max_chain, int) or max_chain < 0:
        raise ValueError(f"max_chain must be a non-negative integer, got {max_chain!r}")
    base_path = Path(base)
    if not base_path.is_file():
        raise BaseCheckpointError(f"base checkpoint {str(base_path)!r} does not exist")
    if Path(path).exists() and os.path.samefile(base_path, path):
        raise ValueError(f"a delta cannot replace its own base {str(base_path)!r}: save it to another path")
    checkpoint = stack.enter_context(Checkpoint(base_path, config))
    opened = checkpoint._opened
    depth = opened.index.base["depth"] if opened.index.base is not None else 0
    if depth >= min(max_chain, MAX_RESOLVE_DEPTH):  # never write what a load would refuse
        log.info("base %s is a delta %d deep (max_chain=%d): writing a full checkpoint", base_path, depth,
                 max_chain)
        return None, set()
    link = base_link(path, base_path, opened.index_sha256, opened.trailer.file_length, depth)
    reader = checkpoint._base_reader()
    delta = set()
    for i, array in enumerate(flat.arrays):
        if array.alias is not None or array.source is None or not array.source.nbytes or array.key not in checkpoint:
            continue
        record = checkpoint._data_record(array.key)
        if (record.dtype, record.shape) == (array.dtype, tuple(array.shape)):
            array.source = XorSource(array.source, reader.view(record.key))
            delta.add(i)
    return link, delta


def rebase(path: PathLike, output: PathLike | None = None, *, codec: str = "auto", config: Config | None = None,
           force: bool = False) -> SaveReport:
    """Turn a delta checkpoint into a full one: every array resolved through its chain of bases
    and written in full to ``output`` (default: ``path`` itself, replaced atomically).

    Memory stays bounded: arrays are read and written in windows, never whole. Replacing
    ``path`` changes its content identity, so deltas written against it would no longer load:
    when other checkpoints in its directory name it as their base, an in-place rebase raises
    ``BaseCheckpointError`` listing them, unless ``force=True``; so does an existing ``output``
    that deltas use as their base. A full checkpoint is copied as
    it is (re-encoded with ``codec``).
    """
    cfg = _config(config)
    output = path if output is None else output
    in_place = Path(output).exists() and os.path.samefile(path, output)
    if in_place and not force:
        dependents = _dependents(Path(path), cfg)
        if dependents:
            raise BaseCheckpointError(
                f"{str(path)!r} is the base of {', '.join(repr(str(d)) for d in dependents)}: rebasing it in "
                f"place would make them unloadable; rebase those first, write to another output, or pass "
                f"force=True")
    elif not force:
        _refuse_replacing_base(output, cfg)  # an existing output may be another delta's base
    with Checkpoint(path, cfg) as checkpoint:
        index = checkpoint._opened.index
        reader = checkpoint._base_reader()
        arrays = []
        for record in index.tensors:
            source = None
            if record.alias is None:
                source = _WindowSource(reader.view(record.key), record.dtype)
            arrays.append(FlatArray(record.key, record.kind, record.dtype, record.shape, record.device, source,
                                    record.alias, dict(record.extra), lossy=record.lossy))
        return _save(None, output, codec=codec, chunk_bytes=None, config=cfg,
                     flat=FlatState(index.tree, arrays))


def _refuse_replacing_base(path: PathLike, config: Config | None) -> None:
    """Raise ``BaseCheckpointError`` when ``path`` exists and delta checkpoints in its directory
    depend on it as it is (``_dependents``): replacing it would make them unloadable. Costs
    nothing when ``path`` does not exist; else it reads the index of each file beside it."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return
    dependents = _dependents(Path(path), _config(config))
    if dependents:
        raise BaseCheckpointError(
            f"{str(path)!r} is the base of {', '.join(repr(str(d)) for d in dependents)}: replacing it "
            f"would make them unloadable; rebase those first (gdsckpt rebase), write to another path, "
            f"or pass force=True (--force)")


def _dependents(path: Path, config: Config) -> list[Path]:
    """Checkpoint files beside ``path`` whose index names ``path`` as their base and records its
    present content identity: the deltas that load now and would not once ``path`` changes.

    Only ``path``'s directory is searched (where ``CheckpointManager`` and most runs keep their
    deltas): a delta in another directory (naming ``path`` by an absolute path, or from a parent
    directory by a relative one) is not found."""
    try:
        with _reader(path, config) as reader:
            opened = _open_checked(reader)
    except (CheckpointError, OSError):
        return []  # not a readable checkpoint: no delta can load against it as it is
    identity = (opened.index_sha256, opened.trailer.file_length)
    found = []
    for entry in sorted(path.parent.iterdir()):
        if entry.name.startswith(".") or not entry.is_file() or os.path.samefile(entry, path):
            continue
        # A delta written against ``path`` as it is records its index digest: files whose index
        # lacks it are passed over unparsed (parsing every index of a directory costs ~5 ms each).
        if not _index_mentions(entry, opened.index_sha256.encode(), config):
            continue
        try:
            base = inspect(entry, config=config).base
        except (CheckpointError, OSError):
            continue  # not a checkpoint, or unreadable: not a dependent we can know of
        if base is not None and (base["index_sha256"], base["file_length"]) == identity:
            candidate = base_path_of(str(entry), base)
            if candidate.exists() and os.path.samefile(candidate, path):
                found.append(entry)
    return found


def _index_mentions(path: Path, text: bytes, config: Config) -> bool:
    """Whether ``path`` is a checkpoint whose index bytes contain ``text``: reads its trailer and
    index, parses neither (False for a file that is not a readable checkpoint)."""
    try:
        with _reader(path, config) as reader:
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


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def _cuda_device_of(flat: FlatState) -> int | None:
    for array in flat.arrays:
        if array.source is not None and array.source.on_device:
            return _device_index(array.device)
    return None


def _use_gpu(config: Config, wants_gpu: bool) -> bool:
    """Whether the GPU engine runs: ``engine="gpu"`` demands it, ``"auto"`` takes it when the data
    is on a GPU and nvCOMP, CuPy and kvikio are usable."""
    if config.engine == "cpu" or (config.engine == "auto" and not wants_gpu):
        return False
    from ..codecs.nvcomp import gpu_available

    available = gpu_available()
    if not available and config.engine == "gpu":
        raise CodecUnavailableError("engine='gpu' needs an NVIDIA GPU with CuPy, nvCOMP and kvikio "
                                    "(pip install 'gdsckpt[cu13]' or '[cu12]')")
    return available


def _save_engine(config: Config, flat: FlatState, codec: str, path: Path,
                 gpu_device: int | None = None) -> tuple[Any, Any, str, dict[str, Any]]:
    """The engine and writer factory of a save, the codec it runs, and how ``auto`` chose it
    (``gpu_device``: the GPU to compress on when the arrays are not on one)."""
    device = _cuda_device_of(flat) if gpu_device is None else gpu_device
    if _use_gpu(config, device is not None):
        from ..io.kvikio import KvikioWriter
        from ..pipeline.gpu import GpuEncoder

        if codec != "auto":
            versioned_name(codec)  # ValueError listing the valid names for an unknown one
        torch = sys.modules.get("torch")
        if torch is not None and device is not None:
            torch.cuda.synchronize(device)  # the snapshot: every queued update has landed
        auto: dict[str, Any] = {}
        if codec == "auto":
            import cupy

            from ..pipeline.autotune import choose_codec, runnable_candidates, sample_ratios, storage_gbps

            _check_target(path)
            candidates, left_out = runnable_candidates(config.max_staging_bytes, config.gpu_chunk_bytes)
            if len(candidates) == 1:  # nothing to compare: no storage probe, no sample
                codec = candidates[0]
                auto = {"storage_gbps": None, "sampled_ratios": {}, "chose": codec, "left_out": left_out}
            else:
                with cupy.cuda.Device(device or 0):
                    stream = cupy.cuda.Stream(non_blocking=True)
                speed = storage_gbps(path.parent, config.storage_gbps)
                ratios = sample_ratios([a.source for a in flat.arrays], device or 0, stream, candidates)
                codec = choose_codec(speed, ratios)
                auto = {"storage_gbps": speed, "sampled_ratios": ratios, "chose": codec, "left_out": left_out}
        engine = GpuEncoder([a.source for a in flat.arrays], codec=codec, byte_planes=config.byte_planes, device_id=device or 0,
                            chunk_bytes=config.gpu_chunk_bytes, max_staging_bytes=config.max_staging_bytes,
                            timeout=config.timeout)

        def make_writer(path: PathLike, cfg: Config) -> StorageWriter:
            _check_target(path)
            return KvikioWriter(path, threads=cfg.kvikio_threads, task_size=cfg.kvikio_task_size,
                                o_direct=cfg.o_direct, fsync=cfg.fsync)

        return engine, make_writer, codec, auto
    codec = _resolve_codec(codec)
    return _host_engine(config, [a.source for a in flat.arrays], codec), _writer, codec, {}


def _build_index(flat: FlatState, result: SaveResult, base: dict[str, Any] | None = None) -> Index:
    tensors = [
        TensorRecord(key=a.key, kind=a.kind, dtype=a.dtype, shape=a.shape, device=a.device,
                     segments=result.segments.get(i, []), alias=a.alias, extra=a.extra, lossy=a.lossy)
        for i, a in enumerate(flat.arrays)
    ]
    chains: list[Chain] = result.chains
    return Index(chains=[c.to_json() for c in chains], chunks=result.chunks, tensors=tensors, tree=flat.tree,
                 writer=f"gdsckpt {__version__}", minor=1 if base is not None else 0, base=base)


# ---------------------------------------------------------------------------------------------
# load

def _parse_device(device: Any) -> str | None:
    if device is None:
        return None
    text = str(device)
    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        torch = sys.modules.get("torch")
        if torch is None:
            import torch
        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r} requested but CUDA is not available on this machine")
        index = int(text[5:]) if ":" in text else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {text!r} requested but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        return f"cuda:{index}"
    raise ValueError(f"device {text!r} is invalid (expected None, 'cpu', 'cuda' or 'cuda:N')")


_KIND_PACKAGES = {"torch": "torch", "numpy": "numpy", "cupy": "cupy", "jax": "jax"}


def _new_target(record: TensorRecord, device: str | None) -> Any:
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


def _requires_grad(record: TensorRecord) -> bool | None:
    """A torch record's ``parameter`` member: the Parameter's ``requires_grad``, or None for a
    plain tensor. ``CorruptCheckpointError`` for a dtype that cannot require grad."""
    parameter = record.extra.get("parameter")
    requires_grad = bool(parameter.get("requires_grad")) if isinstance(parameter, dict) else None
    if requires_grad and not (record.dtype.startswith(("float", "bfloat", "complex"))):
        raise CorruptCheckpointError(f"a {record.dtype} tensor cannot be a Parameter that requires "
                                     f"grad", key=record.key)
    return requires_grad


def _make_target(record: TensorRecord, device: str | None) -> Any:
    if record.kind == "torch":
        return TorchTarget(record.shape, record.dtype, device or "cpu", parameter=_requires_grad(record))
    if record.kind == "numpy":
        return NumpyTarget(record.shape, record.dtype, scalar=bool(record.extra.get("scalar")))
    if record.kind == "cupy":
        chosen = device if device and device.startswith("cuda") else record.device
        match = re.fullmatch(r"cuda(?::(\d{1,4}))?", chosen)
        if match is None:
            raise CorruptCheckpointError(f"a CuPy array's device is {record.device!r}, not 'cuda:N'",
                                         key=record.key)
        return CupyTarget(record.shape, record.dtype, int(match.group(1) or 0))
    return JaxTarget(record.shape, record.dtype, device)


def _inflight_budget(config: Config, gpu: bool) -> int:
    """Bytes of chunks a save or restore keeps in flight: the staging budget (device memory) on
    the GPU engine, the host budget on the CPU engine."""
    return max(config.max_inflight_bytes, config.max_staging_bytes) if gpu else config.max_inflight_bytes


def _restore_arrays(reader: StorageReader, opened: OpenedFile, ids: Iterable[int], config: Config,
                    make_target: Any, gpu_device: int | None = None,
                    progress: Progress | None = None,
                    windows: dict[int, tuple[int, int]] | None = None) -> dict[int, Any]:
    """Restore the arrays ``ids`` (aliases resolved) and return id -> finished object.
    ``windows``: data array id -> the byte range of it to restore (``run_restore``)."""
    index = opened.index
    ids = list(ids)
    data_ids = sorted({index.tensors[i].alias if index.tensors[i].alias is not None else i for i in ids})
    targets = {i: make_target(i, index.tensors[i]) for i in data_ids}
    delta = set(index.delta_ids()).intersection(data_ids) if index.base is not None else set()
    if delta:
        with _BASE_LOCK:  # restores of one open Checkpoint may run in several threads
            if opened.base is None:  # kept for the next restore of this file: its cache with it
                checkpoint = _open_base(opened, config)
                opened.base = (checkpoint, checkpoint._base_reader())
        base, base_reader = opened.base
        for i in delta:
            record = index.tensors[i]
            base_record = base._data_record(record.key) if record.key in base else None
            if base_record is None or (base_record.dtype, base_record.shape) != (record.dtype, record.shape):
                raise BaseCheckpointError(f"base checkpoint {base.path!r} holds no {record.dtype}"
                                          f"{list(record.shape)} array {record.key!r}, which the delta needs")
            start = (windows or {}).get(i, (0, 0))[0]
            targets[i] = XorTarget(targets[i], base_reader.view(base_record.key), start)
    engine = _restore_engine(config, gpu_device)
    try:
        run_restore(reader, index, engine, targets, timeout=config.timeout, progress=progress,
                    windows=windows, max_inflight_bytes=_inflight_budget(config, gpu_device is not None))
    finally:
        engine.close()
    finished = {i: target.finish() for i, target in targets.items()}
    for i in ids:
        alias = index.tensors[i].alias
        if alias is not None:
            finished[i] = _alias_object(finished[alias], index.tensors[i], index.tensors[alias])
    return finished


def _open_base(opened: OpenedFile, config: Config) -> Checkpoint:
    """The base of a delta checkpoint, opened and checked to be the file the delta was written
    against (``BaseCheckpointError`` otherwise)."""
    link = opened.index.base
    assert link is not None
    path = base_path_of(opened.path, link)
    if not path.is_file():
        raise BaseCheckpointError(f"base checkpoint {str(path)!r} of delta {opened.path!r} is missing "
                                  f"(recorded as {link['path']!r})")
    try:
        base = Checkpoint(path, config)
    except CheckpointError as err:
        raise BaseCheckpointError(f"base checkpoint {str(path)!r} of delta {opened.path!r} cannot be "
                                  f"read: {err}") from err
    try:
        check_identity(path, link, base._opened.index_sha256, base._opened.trailer.file_length)
        # The recorded depth must be the base's own plus one: with the identity check this bounds
        # the recursion of a resolve by what the writer recorded, never by a crafted loop.
        base_depth = base._opened.index.base["depth"] if base._opened.index.base is not None else 0
        if link["depth"] != base_depth + 1:
            raise BaseCheckpointError(f"delta {opened.path!r} records chain depth {link['depth']} but its base "
                                      f"{str(path)!r} is {base_depth} deep")
        if link["depth"] > MAX_RESOLVE_DEPTH:
            raise BaseCheckpointError(f"delta {opened.path!r} is {link['depth']} deltas deep, more than the "
                                      f"{MAX_RESOLVE_DEPTH} a load resolves: rebase an older link of the chain "
                                      f"('gdsckpt rebase')")
    except BaseException:
        base.close()
        raise
    return base


def _data_of(index: Index, i: int) -> TensorRecord:
    """The record holding tensor ``i``'s bytes: itself, or the target of an alias."""
    record = index.tensors[i]
    return index.tensors[record.alias] if record.alias is not None else record


def _warn_lossy(index: Index, ids: Iterable[int]) -> None:
    """One ``LossyWarning`` per load call that returns arrays saved with ``save(lossy=...)``."""
    arrays = {index.tensors[i].alias if index.tensors[i].alias is not None else i for i in ids}
    lossy = sum(1 for i in arrays if index.tensors[i].lossy is not None)  # an alias is the same array
    if lossy:
        warnings.warn(f"{lossy} loaded array(s) were saved lossily (within their recorded error bounds, "
                      f"not bit-exact); gdsckpt.inspect shows each bound", LossyWarning, stacklevel=3)


def _alias_object(shared: Any, record: TensorRecord, source: TensorRecord) -> Any:
    """What an alias entry comes back as: the shared object itself, or, where the two entries were
    of different types (a Parameter and a plain tensor of the same view), that type over the same
    memory. The index guarantees that both records are of one kind (``parse_index``); an alias's
    ``parameter`` member obeys the rules of a data record's."""
    if record.kind != "torch" or record.extra.get("parameter") == source.extra.get("parameter"):
        return shared
    import torch

    requires_grad = _requires_grad(record)
    if requires_grad is not None:
        return torch.nn.Parameter(shared.detach(), requires_grad=requires_grad)
    return shared.detach()


def load(path: PathLike, *, device: Any = None, keys: Iterable[str] | None = None,
         config: Config | None = None, progress: Progress | None = None) -> Any:
    """Load a checkpoint into the same nested structure and types it was saved from.

    ``device``: None or ``"cpu"`` puts torch tensors on the CPU; ``"cuda[:N]"`` on that GPU
    (NumPy arrays stay NumPy; CuPy arrays go to that GPU or, with None, the GPU they were saved
    from). ``keys``: key strings (``"model/layer.weight"``) or prefixes of subtrees
    (``"optimizer"``) to load; only the chunks holding them are read. Dict entries outside the
    selection are left out, list and tuple slots outside it are None. Unknown keys raise
    ``KeyError``. ``progress``: see ``Progress``.
    """
    cfg = _config(config)
    target_device = _parse_device(device)
    selection = Selection(keys)
    with _reader(path, cfg) as reader:
        opened = _open_checked(reader)
        index = opened.index
        wanted = [i for i, record in enumerate(index.tensors) if selection.covers(record.key)]
        gpu_device = _gpu_device(cfg, target_device, index, wanted)
        try:
            with _data_reader(path, cfg, reader, gpu_device) as data_reader:
                arrays = _restore_arrays(data_reader, opened, wanted, cfg,
                                         lambda _i, record: _new_target(record, target_device), gpu_device,
                                         progress)
        finally:
            opened.close_base()
    _warn_lossy(index, wanted)
    state = unflatten(index.tree, arrays, selection)
    _check_selection(selection, index)
    return state


def _gpu_device(config: Config, device: str | None, index: Index | None = None,
                ids: Iterable[int] | None = None) -> int | None:
    """The CUDA device whose GPU engine decodes a restore, or None for the CPU engine.

    The GPU decodes when the destination is a GPU, or when the chunks to read use a GPU-only
    codec or hold CuPy arrays and a GPU is usable here (device 0 unless ``device`` names one).
    """
    on_gpu = device is not None and device.startswith("cuda")
    if index is not None and not on_gpu:
        chosen = range(len(index.tensors)) if ids is None else ids
        for i in chosen:
            record = index.tensors[i]
            chains = {index.chunks[s.chunk].chain for s in record.segments}
            if record.kind == "cupy" or any(index.chains[c][-1]["name"].startswith("nvcomp.") for c in chains):
                on_gpu = True
                break
    if not _use_gpu(config, on_gpu) or not on_gpu:
        return None
    return int(device.split(":")[1]) if device is not None and ":" in device else 0


@contextlib.contextmanager
def _data_reader(path: PathLike, config: Config, reader: StorageReader,
                 gpu_device: int | None) -> Iterator[StorageReader]:
    """The reader chunk reads go through: ``reader`` itself (left open) for the CPU engine, a
    kvikio reader (device buffers, closed on exit) for the GPU engine."""
    if gpu_device is None or not isinstance(path, (str, os.PathLike)):
        yield reader
        return
    device_reader = _reader(path, config, gpu=True)
    try:
        # kvikio opens the path again: a save that renamed a new file over it since the index was
        # read would otherwise make the chunks look corrupt. Same inode, or a clear error.
        if _file_identity(device_reader) != _file_identity(reader):
            raise CheckpointError(f"{str(path)!r} was replaced by another file while being loaded; "
                                  f"load it again")
        yield device_reader
    finally:
        device_reader.close()


def _file_identity(reader: StorageReader) -> tuple[int, int] | None:
    """(device, inode) of the file a POSIX-based reader holds open, None for other readers."""
    fd = getattr(reader, "_fd", None)
    if not isinstance(fd, int) or fd < 0:
        return None
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


def _check_selection(selection: Selection, index: Index) -> None:
    if selection.keys is None:
        return
    unknown = [key for key in selection.keys if key not in selection.matched]
    if unknown:
        sample = ", ".join(repr(t.key) for t in index.tensors[:8])
        raise KeyError(f"keys not in checkpoint: {', '.join(map(repr, unknown))} "
                       f"(tensor keys include: {sample}{', ...' if len(index.tensors) > 8 else ''})")


# ---------------------------------------------------------------------------------------------
# load_into

def load_into(target: Any, path: PathLike, *, strict: bool = True, config: Config | None = None,
              progress: Progress | None = None) -> Any:
    """Copy a checkpoint into existing tensors, in place, and return ``target``.

    ``target`` is an ``nn.Module`` (its state_dict tensors are filled in place), an
    ``Optimizer`` (restored with ``optimizer.load_state_dict``, which also works on a fresh
    optimizer that has no state yet), a tensor-holding state dict, or a dict / list nesting any
    of these (``{"model": model, "optimizer": optimizer, "step": 0}``): key paths in ``target``
    correspond to key paths in the checkpoint. Plain values (ints, floats, ...) in a target dict
    are replaced by the checkpoint's. Any missing key, or a shape or dtype that differs, raises
    ``StateMismatchError`` listing every difference before anything is written. With
    ``strict=False``, checkpoint entries that ``target`` does not hold are ignored.
    ``progress``: see ``Progress``.

    Tensors of ``target`` that share memory (tied weights, views of one storage) are filled as
    ``load_state_dict`` fills them: key by key in ``target``'s order (a module's ``state_dict``
    order), so wherever two keys' memory overlaps, the later key's array is what it holds, for
    every byte. A key whose tensor a later key's covers exactly (same memory, shape, dtype and
    strides) is checked for shape and dtype but its array is not read.
    """
    cfg = _config(config)
    existing: dict[str, Any] = {}
    optimizers: list[tuple[list[Any], Any]] = []
    plain_slots: list[tuple[Any, Any, int]] = []
    paths = KeyPaths()  # plain values are matched by path identity: no key string per value
    _collect_targets(target, [], existing, optimizers, plain_slots, paths, KeyPaths.ROOT)

    devices = {str(t.device) for t in existing.values()}
    gpu_device = _gpu_device(cfg, devices.pop() if len(devices) == 1 else None)
    with _reader(path, cfg, gpu_device is not None) as reader:
        opened = _open_checked(reader)
        index = opened.index
        by_key = {record.key: i for i, record in enumerate(index.tensors)}
        optimizer_nodes = {paths.of(prefix): join_key(prefix) for prefix, _ in optimizers}
        plain_values, found = _plain_values(index.tree, paths, set(optimizer_nodes))
        problems = []
        for key, tensor in existing.items():
            if key not in by_key:
                problems.append(f"{key!r}: in target, missing from checkpoint")
                continue
            record = index.tensors[by_key[key]]
            dtype = _torch_dtype_name(tensor.dtype)
            if tuple(tensor.shape) != record.shape or dtype != record.dtype:
                problems.append(f"{key!r}: target {dtype}{list(tensor.shape)} != checkpoint "
                                f"{record.dtype}{list(record.shape)}")
        optimizer_prefixes = [join_key(prefix) for prefix, _ in optimizers]
        for _container, _slot, node in plain_slots:
            if node not in plain_values:
                problems.append(f"{paths.key(node)!r}: in target, missing from checkpoint")
        if strict:
            for key in by_key:
                if key not in existing and not any(_under(key, p) for p in optimizer_prefixes):
                    problems.append(f"{key!r}: in checkpoint, missing from target")
            slot_nodes = {node for _container, _slot, node in plain_slots}
            for node in plain_values:  # optimizer state is left out of plain_values
                if node not in slot_nodes:
                    problems.append(f"{paths.key(node)!r}: in checkpoint, missing from target")
        optimizer_ids = [i for i, record in enumerate(index.tensors)
                         if any(_under(record.key, p) for p in optimizer_prefixes)]
        for node, prefix in optimizer_nodes.items():
            if node not in found:
                problems.append(f"{prefix!r}: optimizer state missing from checkpoint")
        if problems:
            raise StateMismatchError("checkpoint does not match target:\n  " + "\n  ".join(problems))

        wanted = {by_key[key]: tensor for key, tensor in existing.items()}
        try:
            arrays = _restore_in_target_order(reader, opened, wanted, optimizer_ids, cfg, gpu_device,
                                              progress)
        finally:
            opened.close_base()
        _warn_lossy(index, arrays)

    import torch

    with torch.no_grad():
        for i, tensor in wanted.items():
            if arrays[i] is not tensor:  # an alias whose data landed in another tensor
                tensor.copy_(torch.as_tensor(arrays[i]))  # or in a NumPy array: a numpy entry's alias
    for prefix, optimizer in optimizers:
        selection = Selection([join_key(prefix)] if prefix else None)
        subtree = unflatten(index.tree, arrays, selection)
        for part in prefix:
            subtree = subtree[part]
        try:
            optimizer.load_state_dict(subtree)
        except (ValueError, KeyError, RuntimeError) as err:
            raise StateMismatchError(f"optimizer at {join_key(prefix)!r} rejected the checkpoint's "
                                     f"state: {err}") from err
    for container, slot, node in plain_slots:
        container[slot] = plain_values[node]
    return target


def _restore_in_target_order(reader: StorageReader, opened: OpenedFile, wanted: dict[int, Any],
                             optimizer_ids: list[int], config: Config, gpu_device: int | None,
                             progress: Progress | None) -> dict[int, Any]:
    """Restore ``wanted`` (checkpoint id -> existing tensor, in the target's key order) in place,
    and ``optimizer_ids`` into new arrays; return id -> finished object as ``_restore_arrays`` does.

    Tensors that share memory are filled as ``load_state_dict`` fills them, key by key, the last
    key winning: a tensor overwritten whole by a later key's exact alias is not restored at all,
    and the others are restored in phases, one ``_restore_arrays`` after another, each phase
    holding no two tensors that overlap (nor two destinations of one stored array). Without
    shared memory, everything is one phase."""
    index = opened.index

    def stored_array(i: int) -> int:
        return index.tensors[i].alias if index.tensors[i].alias is not None else i

    shared = overlapping({i: span for i, tensor in wanted.items() if (span := _memory_span(tensor))})
    # Per phase: stored array id -> the tensor restored from it (None: a new array). As before,
    # a tensor that shares no memory is its stored array's destination when its key holds that
    # array, and the other keys of that array copy from it at the end; these arrays get no other
    # destination in the first phase, whose tensors later phases may overwrite.
    ids_of_phase: list[list[int]] = [list(optimizer_ids) + [i for i in wanted if i not in shared]]
    phases: list[dict[int, Any]] = [{i: wanted[i] for i in ids_of_phase[0]
                                     if i in wanted and i == stored_array(i)}]
    for i in ids_of_phase[0]:
        phases[0].setdefault(stored_array(i), None)
    if shared:
        last_over_layout: dict[tuple[Any, ...], int] = {}  # exact aliases: the last key overwrites the rest
        for i, tensor in wanted.items():
            if i in shared:
                layout = (str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape),
                          tensor.stride())
                last_over_layout[layout] = i
        kept = set(last_over_layout.values())
        survivors = [i for i in wanted if i in kept]
        phase_of: dict[int, int] = {}
        for i, earlier in zip(survivors, _earlier_overlaps(survivors, wanted)):
            phase = max((phase_of[j] + 1 for j in earlier), default=0)
            while phase < len(phases) and stored_array(i) in phases[phase]:
                phase += 1  # one destination per stored array in each phase
            if phase == len(phases):
                phases.append({})
                ids_of_phase.append([])
            phase_of[i] = phase
            phases[phase][stored_array(i)] = wanted[i]
            ids_of_phase[phase].append(i)

    arrays: dict[int, Any] = {}
    finished_bytes = 0  # raw bytes of the phases done, so that ``progress`` keeps counting up
    for destinations, ids in zip(phases, ids_of_phase):
        if not ids:
            continue
        phase_total = [0]

        def make_target(i: int, record: TensorRecord, destinations: dict[int, Any] = destinations) -> Any:
            tensor = destinations.get(i)
            if tensor is not None:
                return TorchTarget(record.shape, record.dtype, str(tensor.device), existing=tensor)
            return _new_target(record, None)

        def phase_progress(done: int, total: int, before: int = finished_bytes,
                           phase_total: list[int] = phase_total) -> None:
            assert progress is not None
            phase_total[0] = total
            progress(before + done, before + total)

        restored = _restore_arrays(reader, opened, ids, config, make_target, gpu_device,
                                   phase_progress if progress is not None else None)
        arrays.update((i, restored[i]) for i in ids)  # not the stored arrays of other phases' keys
        finished_bytes += phase_total[0]
    for i in shared:  # restored in place (or overwritten whole by a later key): nothing to copy
        arrays[i] = wanted[i]
    return arrays


def _memory_span(tensor: Any) -> tuple[int, int, int] | None:
    """``(device index, first byte address, end address)`` of the memory ``tensor`` covers (the
    CPU is device -1): for a non-contiguous view, from its first element to its last (what lies
    between counts as its); None when it has no elements."""
    start = tensor.data_ptr()
    if tensor.is_contiguous():  # the common case, kept cheap: load_into checks every tensor
        return (tensor.get_device(), start, start + tensor.nbytes) if tensor.nbytes else None
    if tensor.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.get_device(), start, start + (last + 1) * tensor.element_size()


def _earlier_overlaps(ids: list[int], tensors: dict[int, Any]) -> list[list[int]]:
    """For each of ``ids`` (in order), the earlier ones whose memory span overlaps its own: a sweep
    over the spans sorted by start, so the cost grows with the overlapping pairs, not all pairs."""
    position = {i: n for n, i in enumerate(ids)}
    earlier: list[list[int]] = [[] for _ in ids]
    spans = sorted((span, i) for i in ids if (span := _memory_span(tensors[i])) is not None)
    active: list[tuple[int, int, int]] = []  # (device, end, id) of the spans still open
    for (space, start, stop), i in spans:
        active = [entry for entry in active if entry[0] == space and entry[1] > start]
        for _space, _end, j in active:
            first, second = sorted((i, j), key=position.__getitem__)
            earlier[position[second]].append(first)
        active.append((space, stop, i))
    return earlier


def _under(key: str, prefix: str) -> bool:
    return prefix == "" or key == prefix or key.startswith(prefix + "/")


def _collect_targets(obj: Any, path: list[Any], existing: dict[str, Any],
                     optimizers: list[tuple[list[Any], Any]], plain_slots: list[tuple[Any, Any, int]],
                     paths: KeyPaths, node: int) -> None:
    """Walk a ``load_into`` target: its tensors by key string into ``existing``, its optimizers with
    their paths, and its plain values as (container, slot, ``paths`` identity) into ``plain_slots``;
    ``node`` is the identity of ``path``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        for name, tensor in obj.state_dict(keep_vars=True).items():
            existing[join_key(path + [name])] = tensor
        return
    if torch is not None and isinstance(obj, torch.optim.Optimizer):
        optimizers.append((list(path), obj))
        return
    if torch is not None and isinstance(obj, torch.Tensor):
        existing[join_key(path)] = obj
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if _is_plain(value):
                plain_slots.append((obj, key, paths.child(node, key)))
            else:
                _collect_targets(value, path + [key], existing, optimizers, plain_slots, paths,
                                 paths.child(node, key))
        return
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            if _is_plain(value):
                plain_slots.append((obj, i, paths.child(node, i)))
            else:
                _collect_targets(value, path + [i], existing, optimizers, plain_slots, paths,
                                 paths.child(node, i))
        return
    if isinstance(obj, tuple):
        for i, value in enumerate(obj):
            _collect_targets(value, path + [i], existing, optimizers, plain_slots, paths,
                             paths.child(node, i))
        return
    if _is_plain(obj):
        return
    raise TypeError(f"load_into cannot fill {type(obj).__qualname__} at {join_key(path)!r}: give an "
                    f"nn.Module, an Optimizer, tensors, or dicts/lists of them")


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _plain_values(tree: Any, paths: KeyPaths, skip: set[int]) -> tuple[dict[int, Any], set[int]]:
    """``paths`` identity -> value of every plain (non-container, non-array) value in a tree,
    leaving out the subtrees at the identities in ``skip`` (optimizer state); and which of
    ``skip`` the tree holds."""
    values: dict[int, Any] = {}
    found: set[int] = set()
    stack: list[tuple[dict[str, Any], int]] = [(tree, KeyPaths.ROOT)]
    while stack:
        node, identity = stack.pop()
        if identity in skip:
            found.add(identity)
        elif node["t"] in ("list", "tuple"):
            stack.extend((child, paths.child(identity, i)) for i, child in enumerate(node["items"]))
        elif node["t"] == "dict":
            stack.extend((child, paths.child(identity, decode_scalar(key))) for key, child in node["items"])
        elif node["t"] != "tensor":
            values[identity] = decode_scalar(node)
    return values, found


# ---------------------------------------------------------------------------------------------
# open / inspect / verify

class Checkpoint:
    """A lazily read checkpoint (``gdsckpt.open``): the index is read once, arrays on demand."""

    def __init__(self, path: PathLike, config: Config | None = None):
        self.path = str(path)
        self._config = _config(config)
        self._reader = _reader(path, self._config)
        try:
            self._opened = _open_checked(self._reader)
        except BaseException:
            self._reader.close()
            raise
        self._by_key = {record.key: i for i, record in enumerate(self._opened.index.tensors)}

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
        return _tensor_infos(self._opened.index)[self._id(key)]

    def get(self, key: str, device: Any = None) -> Any:
        """Read one array (only its chunks), as the type it was saved as."""
        return self.get_many([key], device=device)[key]

    def get_many(self, keys: Iterable[str], device: Any = None) -> dict[str, Any]:
        """Read several arrays in one restore (their chunks read in parallel, each once);
        returns key -> array, as ``get`` would return each."""
        keys = list(dict.fromkeys(keys))
        ids = [self._id(key) for key in keys]
        target_device = _parse_device(device)
        gpu_device = _gpu_device(self._config, target_device, self._opened.index, ids)
        with _data_reader(self.path, self._config, self._reader, gpu_device) as data_reader:
            arrays = _restore_arrays(data_reader, self._opened, ids, self._config,
                                     lambda _i, record: _new_target(record, target_device), gpu_device)
        _warn_lossy(self._opened.index, ids)
        return {key: arrays[i] for key, i in zip(keys, ids)}

    def get_rows(self, key: str, start: int, stop: int, device: Any = None) -> Any:
        """Rows ``[start, stop)`` of an array of at least one dimension (``array[start:stop]``),
        reading only the chunks that hold them: how a rank of a resharded DCP load reads its
        slice of a larger tensor."""
        i = self._id(key)
        index = self._opened.index
        record = index.tensors[i]
        data_id = record.alias if record.alias is not None else i
        data = index.tensors[data_id]
        if not data.shape or not 0 <= start <= stop <= data.shape[0]:
            raise IndexError(f"rows [{start}, {stop}) of {key!r} (shape {list(data.shape)}) are out of range")
        row_bytes = data.nbytes // data.shape[0] if data.shape[0] else 0
        target_device = _parse_device(device)
        gpu_device = _gpu_device(self._config, target_device, index, [data_id])
        with _data_reader(self.path, self._config, self._reader, gpu_device) as data_reader:
            def rows_target(_i: int, data_record: TensorRecord) -> Any:
                window = dataclasses.replace(data_record, shape=(stop - start, *data_record.shape[1:]))
                return _new_target(window, target_device)

            arrays = _restore_arrays(data_reader, self._opened, [i], self._config, rows_target, gpu_device,
                                     windows={data_id: (start * row_bytes, stop * row_bytes)})
        _warn_lossy(index, [i])
        return arrays[i]

    def _data_record(self, key: str) -> TensorRecord:
        """The record holding ``key``'s bytes (an alias's target)."""
        record = self._opened.index.tensors[self._id(key)]
        return self._opened.index.tensors[record.alias] if record.alias is not None else record

    def _base_reader(self) -> BaseReader:
        """A ``BaseReader`` of this checkpoint's arrays (deltas resolved): what a delta built on it
        XORs with, and what ``rebase`` writes out."""
        sizes = {record.key: record.nbytes for record in self._opened.index.tensors
                 if record.alias is None and record.nbytes}
        return BaseReader(self._read_many, sizes)

    def _read_many(self, requests: list[tuple[str, int, int]], device: Any = None) -> list[Any]:
        """Bytes ``[start, stop)`` of each named array (distinct, not aliases) as flat uint8 arrays
        (NumPy, or CuPy on ``device`` ``"cuda:N"``), deltas resolved, in one restore."""
        index = self._opened.index
        target_device = _parse_device(device)
        ids, windows, records = [], {}, {}
        for key, start, stop in requests:
            i = self._id(key)
            window = TensorRecord(key=key, kind="numpy", dtype="uint8", shape=(stop - start,))
            if target_device is not None and target_device.startswith("cuda"):
                window.kind, window.device = "cupy", target_device
            ids.append(i)
            windows[i] = (start, stop)
            records[i] = window
        gpu_device = _gpu_device(self._config, target_device, index, ids)
        with _data_reader(self.path, self._config, self._reader, gpu_device) as data_reader:
            arrays = _restore_arrays(data_reader, self._opened, ids, self._config,
                                     lambda i, _record: _new_target(records[i], target_device), gpu_device,
                                     windows=windows)
        return [arrays[i] for i in ids]

    def close(self) -> None:
        """Close the file (and the base a delta's reads opened)."""
        self._opened.close_base()
        self._reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(path: PathLike, *, config: Config | None = None) -> Checkpoint:  # noqa: A001 - public name
    """Open a checkpoint for lazy access: ``.keys()``, ``.info(key)``, ``.get(key, device=None)``.

    Use as a context manager (``with gdsckpt.open(p) as ckpt: ...``) or call ``.close()``.
    """
    return Checkpoint(path, config)


def _tensor_infos(index: Index) -> list[TensorInfo]:
    infos = []
    delta = set(index.delta_ids())
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
                                i in delta, lossy=_data_of(index, i).lossy))
    return infos


def inspect(path: PathLike, *, config: Config | None = None) -> CheckpointInfo:
    """Describe a checkpoint from its index alone (no chunk is read)."""
    cfg = _config(config)
    with _reader(path, cfg) as reader:
        opened = _open_checked(reader)
        size = reader.size
    index = opened.index
    logical = sum(record.nbytes for record in index.tensors if record.alias is None)
    codecs: dict[str, int] = {}
    for chunk in index.chunks:
        label = chain_label(index.chains[chunk.chain])
        codecs[label] = codecs.get(label, 0) + 1
    return CheckpointInfo(str(path), (opened.header.major, index.minor), index.writer, size, logical,
                          logical / size if size else 0.0, tuple(_tensor_infos(index)), codecs, index.base)


def verify(path: PathLike, *, config: Config | None = None, progress: Progress | None = None,
           chain: bool = False) -> VerifyReport:
    """Read every chunk, check every checksum and decode every stream.

    Returns a ``VerifyReport`` when the file is sound; raises ``CorruptCheckpointError`` naming
    the first bad tensor and chunk otherwise. ``progress``: see ``Progress``. For a delta
    checkpoint, every base down its chain must also be present, unchanged and of the recorded
    depth (``BaseCheckpointError`` otherwise: the delta would not load); ``chain=True`` verifies
    their chunks too.
    """
    cfg = _config(config)
    started = time.perf_counter()
    opened, stored = _verify_chunks(path, cfg, progress)
    bases: list[str] = []
    checkpoints: list[Checkpoint] = []
    try:
        current = opened
        while current.index.base is not None:
            base = _open_base(current, cfg)  # present, unchanged, of the recorded depth
            checkpoints.append(base)
            bases.append(base.path)
            if chain:
                _verify_chunks(base.path, cfg, None)
            current = base._opened
    finally:
        for checkpoint in checkpoints:
            checkpoint.close()
    index = opened.index
    logical = sum(record.nbytes for record in index.tensors if record.alias is None)
    return VerifyReport(str(path), len(index.chunks), stored, logical, time.perf_counter() - started,
                        tuple(bases))


def _verify_chunks(path: PathLike, config: Config, progress: Progress | None) -> tuple[OpenedFile, int]:
    """Open ``path`` and read, check and decode every chunk; returns the file and its stored bytes."""
    with _reader(path, config) as reader:
        opened = _open_checked(reader)
        gpu_device = _gpu_device(config, None, opened.index)
        engine = _restore_engine(config, gpu_device)
        try:
            with _data_reader(path, config, reader, gpu_device) as data_reader:
                stored = run_verify(data_reader, opened.index, engine, max_inflight_bytes=config.max_inflight_bytes,
                                    timeout=config.timeout, progress=progress)
        finally:
            engine.close()
    return opened, stored


__all__ = [
    "CheckpointError", "CheckpointInfo", "Progress", "SaveReport", "TensorInfo", "VerifyReport", "escape_key",
    "inspect", "known_codec_names", "load", "load_into", "open", "rebase", "save", "verify",
]
