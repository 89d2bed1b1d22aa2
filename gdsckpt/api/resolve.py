"""From a call's arguments to the parts that run it: the configuration, the codec, the storage
reader or writer, the engine and the device.

Every public call of ``gdsckpt.api`` goes through these, so that a path, a device string or a
``Config`` means the same thing to ``save``, ``load``, ``open``, ``verify`` and the integrations.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .. import collector
from ..codecs import PORTABLE_CODECS, versioned_name
from ..config import Config
from ..errors import (
    CheckpointError,
    CodecUnavailableError,
    CorruptCheckpointError,
    ForeignExtensionWarning,
    UnsupportedFormatError,
)
from ..format import MAGIC, Index
from ..io import PosixReader, PosixWriter, StorageReader, StorageWriter
from ..io.fileobj import FileObjectReader, is_file_object
from ..io.posix import refuse_special_target
from ..io.s3 import JOIN_READ_BYTES, READ_THREADS, S3Reader, S3Writer, is_url, split_url, upload_concurrency
from ..pipeline.engine import HostEngine
from ..pipeline.load import OpenedFile, open_file
from ..state import (
    FlatState,
    decode_scalar,
    escape_key,
)

PathLike = str | os.PathLike[str]

Source = PathLike | bytes | bytearray | memoryview | BinaryIO | StorageReader
"""What a load reads: a path, an ``s3://`` URL, a checkpoint's bytes, a seekable binary file
object, or a ``StorageReader``."""


def source_name(source: Any) -> str:
    """How reports and messages name a load's source: the path, or ``<bytes>``, the name of a file
    object opened from a path, ``<BytesIO>``, ``<preloaded>``."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, StorageReader):
        return f"<{source.name}>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "<bytes>"
    name = getattr(source, "name", None)
    return name if isinstance(name, str) else f"<{type(source).__name__}>"


def resolve_config(config: Config | None, **overrides: Any) -> Config:
    """``config`` (else the environment's), with the ``overrides`` that are not None applied;
    ``TypeError`` for a ``config`` that is no ``Config`` (a preset's name, a dict)."""
    if config is not None and not isinstance(config, Config):
        hint = f"Config.preset({config!r})" if isinstance(config, str) else "Config(**settings)"
        raise TypeError(f"config= takes a gdsckpt.Config, got {type(config).__qualname__} {config!r:.60}: "
                        f"pass {hint}")
    base = config if config is not None else Config.from_env()
    changes = {name: value for name, value in overrides.items() if value is not None}
    return base.replace(**changes) if changes else base


def resolve_host_codec(name: str) -> str:
    """The user-facing codec a save runs with on the CPU engine."""
    if name == "auto":
        return "zstd"
    versioned_name(name)  # raises ValueError listing the valid names for an unknown one
    if name not in PORTABLE_CODECS:
        from ..codecs import host_codec

        host_codec(name)  # raises CodecUnavailableError naming the portable alternatives
    return name


def open_checked(reader: StorageReader) -> OpenedFile:
    """``open_file`` plus the checks that need the state layer: every tensor's key is the key
    path of its place in the structure, and no dict holds the same key twice (a file that breaks
    either would load a tensor under the wrong name or silently drop one)."""
    opened = open_file(reader)
    check_tree_keys(opened.index)
    return opened


@collector.paused()
def check_tree_keys(index: Index) -> None:
    """``CorruptCheckpointError`` where a tensor's recorded key is not the key path of its place
    in ``index.tree``, or a dict repeats a key (by ``==``, as the dict will hold them: True == 1,
    0.0 == -0.0; and two NaN keys, which share one key path).

    The tree was validated by ``parse_index`` (node kinds, scalar keys, depth), so this walk
    trusts its shape. It carries each container's escaped key path as one string and extends it
    per child (``join_key`` of a path list per node cost a third of opening a file of 600
    tensors); a restore from a fast tier waits for it before its first read."""
    keys = [record.key for record in index.tensors]
    tree = index.tree
    if tree["t"] == "tensor" and keys[tree["id"]] != "":
        raise CorruptCheckpointError(f"invalid index: tensor {tree['id']} is keyed {keys[tree['id']]!r} "
                                     f"but sits at ''")
    stack: list[tuple[dict[str, Any], str | None]] = [(tree, None)]  # (container, its path; None: the root)
    while stack:
        node, prefix = stack.pop()
        kind = node["t"]
        children: Iterable[tuple[Any, dict[str, Any]]]
        if kind == "dict":
            pairs = node["items"]
            components = [decode_scalar(key) for key, _value in pairs]
            if len(set(components)) != len(components) or sum(1 for key in components if key != key) > 1:
                raise CorruptCheckpointError(f"invalid index: a dict at {prefix or ''!r} repeats a key")
            children = zip(components, [value for _key, value in pairs])
        elif kind == "list" or kind == "tuple":
            children = enumerate(node["items"])
        else:
            continue
        for component, child in children:
            if type(component) is str and "~" not in component and "/" not in component:
                text = component
            else:
                text = escape_key(component)
            path = text if prefix is None else prefix + "/" + text
            child_kind = child["t"]
            if child_kind == "tensor":
                if keys[child["id"]] != path:
                    raise CorruptCheckpointError(f"invalid index: tensor {child['id']} is keyed "
                                                 f"{keys[child['id']]!r} but sits at {path!r}")
            elif child_kind in _CONTAINER_KINDS:
                stack.append((child, path))


_CONTAINER_KINDS = frozenset(("dict", "list", "tuple"))


FOREIGN_EXTENSIONS = {
    ".pt": "torch.save", ".pth": "torch.save", ".bin": "torch.save (Hugging Face)", ".ckpt": "torch.save (Lightning)",
    ".tar": "torch.save (tar)", ".safetensors": "safetensors", ".npz": "numpy.savez", ".npy": "numpy.save",
    ".pkl": "pickle", ".pickle": "pickle", ".h5": "HDF5", ".hdf5": "HDF5", ".msgpack": "msgpack (Flax)",
    ".gguf": "GGUF", ".onnx": "ONNX", ".distcp": "torch.distributed.checkpoint",
}
"""Extensions that name another checkpoint format, and the format: a save to such a path warns
(``ForeignExtensionWarning``), since the tools of that format cannot read the file."""


def warn_foreign_extension(path: Any) -> None:
    """``ForeignExtensionWarning`` when a save's path (or URL) ends in an extension another format
    owns (``FOREIGN_EXTENSIONS``); the save goes ahead. Saves made through an integration do not
    warn: the Lightning plugin writes the ``.ckpt`` paths Lightning names."""
    if not isinstance(path, (str, os.PathLike)):
        return
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in FOREIGN_EXTENSIONS:
        return
    level, modules = caller_level()
    if any(module.startswith("gdsckpt.integrations.") for module in modules):
        return  # an integration writes the names its framework gives (Lightning's are all .ckpt)
    warnings.warn(f"saving a gdsckpt checkpoint to {os.fspath(path)!r}, whose extension {suffix!r} names "
                  f"{FOREIGN_EXTENSIONS[suffix]}'s format, which cannot read it: name it '.gdsckpt', or "
                  f"write that format from a checkpoint with 'gdsckpt convert'", ForeignExtensionWarning,
                  stacklevel=level)


def caller_level() -> tuple[int, list[str]]:
    """The ``stacklevel`` of the first frame outside this package (a warning points at the user's
    line whichever public call, ``save`` or ``save_async``, led to it), and the modules of the
    package's frames on the way there."""
    frame, level, modules = sys._getframe(2), 2, []
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "gdsckpt":
        modules.append(frame.f_globals["__name__"])
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level, modules


def check_target(path: Any) -> None:
    """The checks a save makes of its path before writing anything: a target of a kind a save
    writes to (a path, an ``s3://`` URL, a ``StorageWriter`` or a binary file object; anything
    else, ``None`` or ``bytes`` included, is a ``TypeError``), a file path whose directory exists
    (made in the caller by ``save_async``, so that a bad path fails there and not in the
    background), and a ``ForeignExtensionWarning`` for a name another format owns."""
    if not isinstance(path, (str, os.PathLike, StorageWriter)) and not is_file_object(path):
        raise TypeError(f"a checkpoint is saved to a path (str or os.PathLike), an s3:// URL, a StorageWriter "
                        f"or a binary file object, got {type(path).__qualname__}: {path!r:.80}")
    warn_foreign_extension(path)
    check_path(path)


def check_path(path: Any) -> None:
    """``check_target`` without the warning: what the writers check again (the call that led to
    them has warned already)."""
    if not isinstance(path, (str, os.PathLike)):
        return
    if is_url(path):
        split_url(str(path))  # ValueError for a URL without a bucket and a key
        return
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"checkpoint path {str(target)!r} is a directory; give a file path")
    if os.path.basename(os.fspath(path)) in ("", "."):  # pathlib drops them: a file "exp1" for "exp1/"
        raise IsADirectoryError(f"checkpoint path {os.fspath(path)!r} ends with {os.sep!r} or {os.sep}., as a "
                                f"directory does, and there is none; give a file path")
    if not target.parent.is_dir():
        if target.parent.exists():
            raise NotADirectoryError(f"{str(target.parent)!r}, the directory of checkpoint path {str(target)!r}, "
                                     f"is a file, not a directory")
        raise FileNotFoundError(f"directory {str(target.parent)!r} of checkpoint path does not exist")
    refuse_special_target(target)


def posix_writer(path: PathLike, config: Config) -> StorageWriter:
    """The writer of a save on the CPU engine: a POSIX file, or an object for an ``s3://`` URL."""
    check_path(path)
    if is_url(path):
        return S3Writer(str(path), timeout=config.timeout, endpoint=config.s3_endpoint,
                        concurrency=upload_concurrency(config.max_inflight_bytes))
    return PosixWriter(path, threads=config.io_threads, o_direct=config.o_direct, fsync=config.fsync,
                       timeout=config.timeout)


def open_reader(path: Source, config: Config, gpu: bool = False) -> StorageReader:
    """The reader of a load's source: a ``StorageReader`` as it is; ``bytes`` or a seekable binary
    file object (``FileObjectReader``); an ``s3://`` URL; a path (kvikio with ``gpu``, else POSIX)."""
    if isinstance(path, StorageReader):
        return path
    if not isinstance(path, (str, os.PathLike)):
        _check_not_a_path(path)
        return FileObjectReader(path)  # TypeError for anything but bytes or a binary file object
    if is_url(path):
        threads = max(config.io_threads, READ_THREADS)
        return S3Reader(str(path), threads=threads, timeout=config.timeout, endpoint=config.s3_endpoint,
                        join_bytes=min(JOIN_READ_BYTES, config.max_inflight_bytes // threads))
    if gpu:
        from ..io.kvikio import KvikioReader

        return KvikioReader(path, threads=config.kvikio_threads, task_size=config.kvikio_task_size,
                            timeout=config.timeout)
    return PosixReader(path, threads=config.io_threads, timeout=config.timeout)


def _check_not_a_path(source: Any) -> None:
    """``UnsupportedFormatError`` for ``bytes`` that name an existing file (``b"/ckpt/x.gdsckpt"``):
    bytes are read as a checkpoint's contents, and the magic-number error alone would not say
    that a path was meant."""
    if not isinstance(source, bytes) or not source or len(source) > 4096 or source.startswith(MAGIC):
        return
    try:
        exists = b"\0" not in source and os.path.exists(os.fsdecode(source))
    except (OSError, ValueError):
        return
    if exists:
        raise UnsupportedFormatError(f"not a gdsckpt checkpoint: the bytes given are read as a checkpoint's "
                                     f"contents, and these name a file ({os.fsdecode(source)!r}): pass the "
                                     f"path as a str or a pathlib.Path")


def restore_engine(config: Config, gpu_device: int | None, reserved_bytes: int = 0, lead: Any = None,
                   share: float = 1.0) -> Any:
    """The decoding engine of a restore: the CPU engine, or the GPU decoder on ``gpu_device``, whose
    staging budget leaves out ``reserved_bytes`` of the device memory free now (destination
    arrays still to be made), takes in ``lead`` (a ``LeadRead`` of the file, ``lead_read``) and
    is ``share`` of the restore's (``GpuDecoder``; a delta's restore halves it with its base)."""
    if gpu_device is None:
        return host_engine(config)
    from ..pipeline.gpu import GpuDecoder

    return GpuDecoder(device_id=gpu_device, max_staging_bytes=config.max_staging_bytes,
                      restore_staging_bytes=config.restore_staging_bytes, timeout=config.timeout,
                      reserved_bytes=reserved_bytes, lead=lead, share=share)


@dataclass
class Lead:
    """A lead read under way (``lead_read``): the GPU it reads into, the reader of chunk reads it
    opened (the restore's own, ``open_data_reader``) and the ``LeadRead``."""

    gpu_device: int
    reader: StorageReader
    read: Any


LEAD_READS = True
"""Whether a restore into a named GPU reads ahead while the index is parsed (``lead_read``);
experiments turn it off to measure what it brings."""


@contextlib.contextmanager
def lead_read(path: Source, config: Config, reader: StorageReader, gpu_device: int | None, *,
              fills_device: bool = False) -> Iterator[Lead | None]:
    """Start reading the first bytes of a file's data region into memory of GPU ``gpu_device``
    before its index is parsed, for a restore whose GPU is known before the index (a load into a
    named GPU, a ``load_into`` of tensors on one GPU) of a local file or a ``PreloadedReader``
    (the file in host memory); yields the ``Lead`` (None
    where it does not apply) and, on exit, waits for its reads and releases its buffer, then
    closes the device reader it opened. ``fills_device``: ``reader`` reads into device buffers
    itself (a kvikio reader), so the lead reads through it.

    Why: on a fast tier the index of a trained model's state (hundreds of tensor records) takes
    longer to read and parse than the storage takes to deliver hundreds of MiB; without a lead the
    chunk reads wait for it (docs/performance.md, "Fast tiers"). The lead takes
    ``lead_read_pieces`` of ``GROUP_READ_BYTES``: at most half of the least staging budget the
    restore can get (``max_staging_bytes``, or ``restore_staging_bytes`` where set), so it fits the
    budget sized after the index, of which it becomes the first arena pieces. Nothing is allocated
    from the unvalidated index: the lead's size comes from the configuration and the file's size."""
    from ..io.memory import PreloadedReader

    held = isinstance(path, PreloadedReader)  # copies into device buffers itself: the null source
    if not LEAD_READS or gpu_device is None or not (held or isinstance(path, (str, os.PathLike))) or is_url(path):
        yield None
        return
    from ..format import HEADER_REGION, TRAILER_SIZE
    from ..pipeline.gpu.staging import GROUP_READ_BYTES, LeadRead, lead_read_pieces

    floor = config.restore_staging_bytes if config.restore_staging_bytes is not None else config.max_staging_bytes
    length = min(lead_read_pieces(floor, GROUP_READ_BYTES) * GROUP_READ_BYTES,
                 reader.size - HEADER_REGION - TRAILER_SIZE)
    if length <= 0:
        yield None
        return
    from ..codecs.device import backend_or_cuda

    with contextlib.nullcontext(reader) if fills_device or held else open_data_reader(
            path, config, reader, gpu_device) as data_reader:
        read = LeadRead(backend_or_cuda(None, gpu_device), data_reader, HEADER_REGION, length, GROUP_READ_BYTES,
                        timeout=config.timeout)
        try:
            yield Lead(gpu_device, data_reader, read)
        except BaseException:
            # the restore's own error (it names the chunk) is the one raised; a lead read still
            # running keeps its buffer (``LeadRead.close``)
            with contextlib.suppress(TimeoutError):
                read.close()
            raise
        read.close()


def host_engine(config: Config, sources: list[Any] | None = None, codec: str = "none",
                adaptive: bool = False, as_is_views: bool = False) -> HostEngine:
    """The CPU engine for ``config`` (``as_is_views``: see ``HostEngine.as_is_views``)."""
    return HostEngine(sources or [], codec=codec, byte_planes=config.byte_planes,
                      threads=config.effective_codec_threads, level=config.level, timeout=config.timeout,
                      adaptive=adaptive, as_is_views=as_is_views)


def device_index(device: str) -> int:
    """The index in a ``"cuda:N"`` device string; 0 for a string without one (``"cuda"``)."""
    return int(device.split(":")[1]) if ":" in device else 0


def cuda_devices_of(flat: FlatState) -> set[int]:
    """The CUDA devices ``flat``'s arrays are on (those the save reads in device memory)."""
    return {device_index(array.device) for array in flat.arrays
            if array.source is not None and array.source.on_device}


def cuda_device_of(flat: FlatState) -> int | None:
    """The CUDA device of the first array the save reads in device memory; None where it reads none
    there."""
    for array in flat.arrays:
        if array.source is not None and array.source.on_device:
            return device_index(array.device)
    return None


HOST_ROUTED_CODECS = ("zstd", "lz4", "deflate")
"""Portable codecs that a save of CUDA state runs on the CPU engine unless ``engine="gpu"``: the
CPU engine's codec threads saved such state faster (docs/performance.md measures both: "nvCOMP
codecs", "Portable files from CUDA state" and the ``gdsckpt bench`` section): nvCOMP's Zstd
costs tens of milliseconds a call and needs about 1.1 GiB of scratch whatever the chunk size (the
default budget refuses it), its LZ4 and Deflate are slow on 16 MiB chunks."""


def check_portable(config: Config, codec: str) -> None:
    """``ValueError`` when ``config.portable`` asks for a file any machine reads and ``codec``
    (``"auto"`` or a name; ``"auto"`` defers to ``config.codec``) has no CPU decoder."""
    name = config.codec if codec == "auto" else codec
    if config.portable and name != "auto" and name not in PORTABLE_CODECS:
        raise ValueError(f"codec {name!r} has no CPU decoder, but portable=True asks for a file any machine "
                         f"reads: choose one of {', '.join(PORTABLE_CODECS)} (or codec='auto')")


def choose_save_engine(config: Config, codec: str, on_gpu: bool, gpu_usable: bool) -> tuple[str, str]:
    """(``"gpu"`` or ``"cpu"``, why) for a save of ``codec`` (``"auto"`` or a name) whose arrays
    are on a GPU (``on_gpu``) or not, with the GPU engine usable here or not. ``Config.portable``
    refuses a codec without a CPU decoder (``ValueError``). CUDA state goes to the CPU engine for
    the compressing portable codecs (``HOST_ROUTED_CODECS``), and for ``auto`` with ``portable``,
    unless ``engine="gpu"``; ``auto`` without ``portable`` may still move it there after weighing
    both engines (``api.saving._save_engine``)."""
    check_portable(config, codec)
    if config.engine == "cpu":
        return "cpu", "engine='cpu'"
    if config.engine == "gpu":
        return "gpu", "engine='gpu'"
    if not on_gpu:
        return "cpu", "no array is on a GPU"
    if not gpu_usable:
        return "cpu", "the GPU engine is not usable here (CuPy, nvCOMP or kvikio missing)"
    if codec in HOST_ROUTED_CODECS:
        return "cpu", (f"codec={codec!r}: the CPU engine compresses CUDA state with it faster than nvCOMP does "
                       "(docs/performance.md)")
    if config.portable and codec == "auto":
        return "cpu", ("portable=True: the CPU engine compresses CUDA state with the portable codecs faster "
                       "than nvCOMP does (docs/performance.md)")
    return "gpu", "arrays on a GPU"


def use_gpu(config: Config, wants_gpu: bool) -> bool:
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


def _device_syntax(device: Any) -> str | None:
    """``device`` as text when it names a device gdsckpt loads to (None, ``cpu``, ``cpu:N``,
    ``cuda``, ``cuda:N``), without asking whether this machine has it; else ``ValueError``."""
    if device is None:
        return None
    text = str(device)
    if not re.fullmatch(r"cpu(:\d+)?|cuda(:\d+)?", text):
        raise ValueError(f"device {text!r} is invalid (expected None, 'cpu', 'cuda' or 'cuda:N')")
    return text


def parse_device(device: Any) -> str | None:
    """The device ``device`` names, normalised (``"cpu"`` or ``"cuda:N"``; None stays None), or
    ``ValueError`` when it is invalid or names a GPU this machine does not have."""
    text = _device_syntax(device)
    if text is None:
        return None
    if text.startswith("cpu"):  # torch's "cpu:0" is the CPU
        return "cpu"
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r} requested but CUDA is not available on this machine")
        index = int(text[5:]) if ":" in text else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {text!r} requested but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        return f"cuda:{index}"
    raise AssertionError(text)  # _device_syntax admits nothing else


DeviceMap = dict[str, str | None]
"""A ``map_location`` dict as ``resolve_location`` returns it: saved device -> destination."""


def resolve_location(device: Any, map_location: Any) -> str | DeviceMap | None:
    """Where a load puts its arrays, from its ``device`` or its ``map_location`` (torch's name and
    meanings; give one of the two, else ``TypeError``): None, a device or a device string for every
    array (``parse_device``), or a dict mapping the device an array was saved from to the one it
    loads to (``{"cuda:1": "cuda:0"}``; arrays from other devices load to the device they were
    saved from, as with ``torch.load``). A callable is ``TypeError``: torch calls it with
    storages, which a gdsckpt file does not have."""
    if map_location is None:
        return parse_device(device)
    if device is not None:
        raise TypeError(f"give device= or map_location=, not both (got device={device!r}, "
                        f"map_location={map_location!r})")
    if isinstance(map_location, dict):
        mapped: DeviceMap = {}
        named: dict[str, str] = {}
        for saved, wanted in map_location.items():
            key = str(saved)
            if not re.fullmatch(r"cpu|cuda(:\d+)?", key):
                raise ValueError(f"map_location key {saved!r} is not a device ('cpu', 'cuda' or 'cuda:N')")
            device = "cuda:0" if key == "cuda" else key
            if device in named and named[device] != str(wanted):  # {"cuda": ..., "cuda:0": ...}
                raise ValueError(f"map_location maps {device!r} twice, to {named[device]!r} and "
                                 f"{str(wanted)!r} ('cuda' is 'cuda:0')")
            named[device] = str(wanted)
            # Checked for this machine only where an array maps there (``destination``), as
            # torch.load does: {"cuda:1": "cuda:0"} loads a CPU-saved file on a host without GPUs.
            mapped[device] = _device_syntax(wanted)
        return mapped
    if callable(map_location):
        raise TypeError("map_location as a function is not supported (torch passes it storages, which a gdsckpt "
                        "file has none of): give a device, a device string such as 'cpu' or 'cuda:0', or a dict "
                        "such as {'cuda:1': 'cuda:0'}")
    return parse_device(map_location)


def destination(location: str | DeviceMap | None, record: Any) -> str | None:
    """The device an array (an index record) loads to under ``resolve_location``'s result."""
    if not isinstance(location, dict):
        return location
    if record.device in location:
        try:
            return parse_device(location[record.device])
        except ValueError as err:
            raise ValueError(f"array {record.key!r} was saved from {record.device!r}, which map_location maps to "
                             f"{location[record.device]!r}: {err}") from err
    try:
        return parse_device(record.device)
    except ValueError as err:
        raise ValueError(f"array {record.key!r} was saved from {record.device!r}, which map_location does not "
                         f"map: {err}") from err


def single_destination(location: str | DeviceMap | None, records: Iterable[Any]) -> str | None:
    """The one device all ``records`` load to, or None when they go to several (or to the CPU):
    the device whose GPU engine decodes a restore (``restore_gpu_device``)."""
    if not isinstance(location, dict):
        return location
    devices = {destination(location, record) for record in records}
    return devices.pop() if len(devices) == 1 else None


def restore_gpu_device(config: Config, device: str | None, index: Index | None = None,
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
    if not use_gpu(config, on_gpu) or not on_gpu:
        return None
    return int(device.split(":")[1]) if device is not None and ":" in device else 0


def inflight_budget(config: Config, engine: Any) -> int:
    """Bytes of chunks a save or restore keeps in flight: the engine's staging budget (device
    memory: ``max_staging_bytes`` of a save, the sized budget of a restore) on the GPU engine, the
    host budget on the CPU engine."""
    if engine.name == "gpu":
        return max(config.max_inflight_bytes, engine.max_staging_bytes)
    return config.max_inflight_bytes


@contextlib.contextmanager
def open_data_reader(path: Source, config: Config, reader: StorageReader,
                     gpu_device: int | None) -> Iterator[StorageReader]:
    """The reader chunk reads go through: ``reader`` itself (left open) for the CPU engine, a
    kvikio reader (device buffers, closed on exit) for the GPU engine."""
    if gpu_device is None or not isinstance(path, (str, os.PathLike)) or is_url(path):
        yield reader  # an object's reader fills device buffers through host memory itself
        return
    with open_reader(path, config, gpu=True) as device_reader:
        # kvikio opens the path again: a save that renamed a new file over it since the index was
        # read would otherwise make the chunks look corrupt. Same inode, or a clear error.
        if device_reader.file_identity() != reader.file_identity():
            raise CheckpointError(f"{str(path)!r} was replaced by another file while being loaded; "
                                  f"load it again")
        yield device_reader
