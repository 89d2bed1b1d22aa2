"""From a call's arguments to the parts that run it: the configuration, the codec, the storage
reader or writer, the engine and the device.

Every public call of ``gdsckpt.api`` goes through these, so that a path, a device string or a
``Config`` means the same thing to ``save``, ``load``, ``open``, ``verify`` and the integrations.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..codecs import PORTABLE_CODECS, versioned_name
from ..config import Config
from ..errors import (
    CheckpointError,
    CodecUnavailableError,
    CorruptCheckpointError,
)
from ..format import Index
from ..io import PosixReader, PosixWriter, StorageReader, StorageWriter
from ..io.s3 import S3Reader, S3Writer, is_url, split_url, upload_concurrency
from ..pipeline.engine import HostEngine
from ..pipeline.load import OpenedFile, open_file
from ..state import (
    FlatState,
    decode_scalar,
    join_key,
    walk_tree,
)

PathLike = str | os.PathLike[str]


def resolve_config(config: Config | None, **overrides: Any) -> Config:
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


def check_target(path: Any) -> None:
    """The checks a save makes of its path before writing anything: a file path whose directory
    exists (made in the caller by ``save_async``, so that a bad path fails there and not in the
    background). Anything but a path (a storage writer) passes."""
    if not isinstance(path, (str, os.PathLike)):
        return
    if is_url(path):
        split_url(str(path))  # ValueError for a URL without a bucket and a key
        return
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"checkpoint path {str(target)!r} is a directory; give a file path")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"directory {str(target.parent)!r} of checkpoint path does not exist")


def posix_writer(path: PathLike, config: Config) -> StorageWriter:
    """The writer of a save on the CPU engine: a POSIX file, or an object for an ``s3://`` URL."""
    check_target(path)
    if is_url(path):
        return S3Writer(str(path), timeout=config.timeout, endpoint=config.s3_endpoint,
                        concurrency=upload_concurrency(config.max_inflight_bytes))
    return PosixWriter(path, threads=config.io_threads, o_direct=config.o_direct, fsync=config.fsync,
                       timeout=config.timeout)


def open_reader(path: PathLike, config: Config, gpu: bool = False) -> StorageReader:
    if isinstance(path, StorageReader):
        return path
    if is_url(path):
        return S3Reader(str(path), threads=config.io_threads, timeout=config.timeout, endpoint=config.s3_endpoint)
    if gpu:
        from ..io.kvikio import KvikioReader

        return KvikioReader(path, threads=config.kvikio_threads, task_size=config.kvikio_task_size)
    return PosixReader(path, threads=config.io_threads, timeout=config.timeout)


def restore_engine(config: Config, gpu_device: int | None) -> Any:
    if gpu_device is None:
        return host_engine(config)
    from ..pipeline.gpu import GpuDecoder

    return GpuDecoder(device_id=gpu_device, max_staging_bytes=config.max_staging_bytes,
                      restore_staging_bytes=config.restore_staging_bytes, timeout=config.timeout)


def host_engine(config: Config, sources: list[Any] | None = None, codec: str = "none",
                adaptive: bool = False) -> HostEngine:
    return HostEngine(sources or [], codec=codec, byte_planes=config.byte_planes,
                      threads=config.effective_codec_threads, level=config.level, timeout=config.timeout,
                      adaptive=adaptive)


def device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def cuda_device_of(flat: FlatState) -> int | None:
    for array in flat.arrays:
        if array.source is not None and array.source.on_device:
            return device_index(array.device)
    return None


HOST_ROUTED_CODECS = ("zstd", "lz4", "deflate")
"""Portable codecs that a ``portable`` save of CUDA state runs on the CPU engine unless
``engine="gpu"``: within the default staging budget nvCOMP's Zstd (about 1.1 GiB of scratch)
compresses one or two chunks per call, and its LZ4 and Deflate are slow on 16 MiB chunks, so the
CPU engine's codec threads save such state faster (docs/performance.md measures both: "nvCOMP
codecs" and the ``gdsckpt bench`` section)."""


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
    refuses a codec without a CPU decoder (``ValueError``) and keeps CUDA state on the CPU engine
    for ``auto`` and the compressing portable codecs, unless ``engine="gpu"``."""
    check_portable(config, codec)
    if config.engine == "cpu":
        return "cpu", "engine='cpu'"
    if config.engine == "gpu":
        return "gpu", "engine='gpu'"
    if not on_gpu:
        return "cpu", "no array is on a GPU"
    if not gpu_usable:
        return "cpu", "the GPU engine is not usable here (CuPy, nvCOMP or kvikio missing)"
    if config.portable and codec in ("auto", *HOST_ROUTED_CODECS):
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


def parse_device(device: Any) -> str | None:
    if device is None:
        return None
    text = str(device)
    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r} requested but CUDA is not available on this machine")
        index = int(text[5:]) if ":" in text else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {text!r} requested but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        return f"cuda:{index}"
    raise ValueError(f"device {text!r} is invalid (expected None, 'cpu', 'cuda' or 'cuda:N')")


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
def open_data_reader(path: PathLike, config: Config, reader: StorageReader,
                     gpu_device: int | None) -> Iterator[StorageReader]:
    """The reader chunk reads go through: ``reader`` itself (left open) for the CPU engine, a
    kvikio reader (device buffers, closed on exit) for the GPU engine."""
    if gpu_device is None or not isinstance(path, (str, os.PathLike)) or is_url(path):
        yield reader  # an object's reader fills device buffers through host memory itself
        return
    device_reader = open_reader(path, config, gpu=True)
    try:
        # kvikio opens the path again: a save that renamed a new file over it since the index was
        # read would otherwise make the chunks look corrupt. Same inode, or a clear error.
        if device_reader.file_identity() != reader.file_identity():
            raise CheckpointError(f"{str(path)!r} was replaced by another file while being loaded; "
                                  f"load it again")
        yield device_reader
    finally:
        device_reader.close()
