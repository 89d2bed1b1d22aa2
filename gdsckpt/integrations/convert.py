"""Convert checkpoints between torch pickles, safetensors and gdsckpt, bit-exact.

Formats, told from the file extension unless given explicitly (``src_format`` / ``dst_format``):

- ``pt`` (``.pt``, ``.pth``, ``.bin``): a ``torch.save`` file. Read **only** with
  ``torch.load(weights_only=True)``, which rebuilds tensors and plain containers and refuses any
  other object, so a pickle that would run code when loaded is rejected (``UnsafePickleError``)
  before anything in it runs. Written with ``torch.save``.
- ``safetensors`` (``.safetensors``): a flat dict of named tensors plus string metadata.
- ``gdsckpt`` (``.gdsckpt``): through ``gdsckpt.load`` / ``gdsckpt.save`` (``codec`` applies here
  only; converting gdsckpt to gdsckpt recompresses with another codec).

What survives each direction, bit for bit (NaN payloads and -0.0 included):

- Every tensor's dtype, shape and element bytes. Non-contiguous tensors are written contiguous;
  their values are unchanged.
- A nested state (dicts, ``OrderedDict`` with its ``_metadata``, lists, tuples, ints, floats,
  bools, strings, None; ``nn.Parameter`` with its ``requires_grad``) survives pt <-> gdsckpt as
  is. Written as safetensors it is flattened: each tensor is named by its key path joined with
  ``.`` (``{"model": {"fc.weight": w}}`` -> ``model.fc.weight``), and the whole structure (plain
  values included) is recorded as JSON in the metadata entry ``gdsckpt.structure``, from which a
  conversion back to pt or gdsckpt rebuilds the original. Other safetensors readers see the flat
  tensors; the file also carries ``"format": "pt"``, which Hugging Face loaders expect. Two key
  paths that would join to the same name, or content no format can hold (a ``torch.Size``, a
  set, a dtype safetensors lacks), are refused with an error naming the key.
- Tensors that share memory: safetensors refuses them, so every entry whose bytes overlap
  another's is written as its own copy (``ConvertReport.cloned`` counts them). Entries that were
  the same view (tied weights) are recorded as such in ``gdsckpt.structure`` and come back as one
  shared tensor, as from ``torch.load``; gdsckpt itself stores a tie once (see ``gdsckpt.state``).
- A safetensors source's own metadata is kept when the destination is safetensors and dropped
  (logged) otherwise: pt and gdsckpt files have no place for it.
- Arrays that a gdsckpt file holds as NumPy (or JAX) arrays become CPU torch tensors of the same
  dtype and bytes in a pt or safetensors file; CUDA tensors are read to the CPU.

The destination appears atomically: everything is written to a temporary file beside it, which is
fsynced (``Config.fsync``) and renamed into place, so a failure at any point leaves no partial
file and an existing destination untouched. An existing destination is refused unless
``overwrite=True`` (and ``force=True`` where deltas beside it use it as their base); without it
the final step is a hard link, which also refuses a destination created during the conversion.
A conversion between gdsckpt files streams the arrays in windows (``api.saving.rewrite``: memory
bounded whatever the size; a delta becomes a full file); the other directions hold the whole
state in host memory.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..api import SaveReport, inflight
from ..api import load as _load_gdsckpt
from ..api import save as _save_gdsckpt
from ..api.resolve import open_reader, resolve_config
from ..api.saving import refuse_replacing_base, rewrite
from ..codecs import known_codec_names
from ..config import Config
from ..errors import (
    CheckpointError,
    ConvertError,
    CorruptCheckpointError,
    DeltaBaseError,
    ObjectChangedError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from ..io.posix import (
    fsync_path,
    publish,
    refuse_special_target,
    remove_stale_temporaries,
    temporary_mode,
    temporary_path,
)
from ..io.s3 import ObjectDirectory, is_url
from ..state import numpy_dtype_name, torch_dtype
from .safetensors_structure import STRUCTURE_KEY, flatten_for_safetensors, rebuild_state

logger = logging.getLogger("gdsckpt")

PathLike = str | os.PathLike[str]
Progress = Callable[[int, int], None]

FORMATS = ("pt", "safetensors", "gdsckpt")
"""The format names ``convert`` and ``--from`` / ``--to`` accept."""

EXTENSIONS = {".pt": "pt", ".pth": "pt", ".bin": "pt", ".safetensors": "safetensors", ".gdsckpt": "gdsckpt"}
"""File extension (lower case) -> format."""


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion did."""

    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: int
    """Tensor (array) entries in the state; one tensor held at two keys counts twice."""
    logical_bytes: int
    """Element bytes of the distinct tensors."""
    src_bytes: int
    dst_bytes: int
    seconds: float
    codec: str | None = None
    """The codec a gdsckpt destination was written with; None for other formats."""
    cloned: int = 0
    """safetensors destination: entries written as copies because they shared memory with another."""
    save_report: SaveReport | None = field(default=None, repr=False)
    """The ``SaveReport`` of a gdsckpt destination."""


# ---------------------------------------------------------------------------------------------
# arguments

def detect_format(path: PathLike, override: str | None = None) -> str:
    """The format of ``path``: ``override`` when given, else told from the extension.

    Raises ``ValueError`` for an unknown ``override`` or extension, listing the valid ones.
    """
    if override is not None:
        if override not in FORMATS:
            raise ValueError(f"unknown format {override!r} (expected one of: {', '.join(FORMATS)})")
        return override
    suffix = Path(path).suffix.lower()
    if suffix not in EXTENSIONS:
        raise ValueError(f"cannot tell the format of {str(path)!r} from its extension "
                         f"(known: {', '.join(EXTENSIONS)}); name it with --from/--to "
                         f"({', '.join(FORMATS)})")
    return EXTENSIONS[suffix]


def check_codec(codec: str, dst_format: str) -> None:
    """Raise ``ValueError`` unless ``codec`` is a known codec name usable for ``dst_format``
    (only a gdsckpt destination takes a codec other than ``"auto"``)."""
    names = known_codec_names()
    if codec not in names:
        raise ValueError(f"unknown codec {codec!r} (expected one of: {', '.join(names)})")
    if codec != "auto" and dst_format != "gdsckpt":
        raise ValueError(f"a codec applies only to a gdsckpt destination, not to {dst_format}")


# ---------------------------------------------------------------------------------------------
# the conversion

def convert(src: PathLike, dst: PathLike, *, codec: str = "auto", config: Config | None = None,
            src_format: str | None = None, dst_format: str | None = None, overwrite: bool = False,
            progress: Progress | None = None, force: bool = False) -> ConvertReport:
    """Convert the checkpoint ``src`` into ``dst``, bit-exact (see the module docstring for what
    each format keeps).

    ``src_format`` / ``dst_format`` (``"pt"``, ``"safetensors"``, ``"gdsckpt"``) override the
    format told from the extension. ``codec`` and ``config`` apply to reading and writing gdsckpt
    files (``config.fsync`` to every destination). An existing ``dst`` raises ``FileExistsError``
    unless ``overwrite``; one that delta checkpoints beside it use as their base raises
    ``DeltaBaseError`` (replacing it would make them unloadable) unless ``force`` too.
    ``progress(done_bytes, total_bytes)`` is called as a gdsckpt source is read and as the
    destination is written (see ``_Phases``). Raises ``ValueError`` for bad arguments,
    ``UnsafePickleError`` for a pickle that is not plain tensor data, ``ConvertError`` (a
    ``CheckpointError``) for content the destination cannot hold or a source that is not of its
    format; ``dst`` is then left as it was.
    """
    started = time.perf_counter()
    src_kind = detect_format(src, src_format)
    dst_kind = detect_format(dst, dst_format)
    check_codec(codec, dst_kind)
    cfg = resolve_config(config)
    src_path, dst_path = _location(src), _location(dst)
    _check_paths(src_path, dst_path, src_kind, dst_kind, overwrite, cfg)
    # after saves of either file still in flight (a save_async of the source, say)
    with inflight.exclusive(dst_path, src_path, cfg.timeout, what="convert"):
        if overwrite and not force:
            refuse_replacing_base(dst_path, cfg)
        return _convert(src_path, dst_path, src_kind, dst_kind, codec, cfg, overwrite, progress, started)


def _convert(src_path: Any, dst_path: Any, src_kind: str, dst_kind: str, codec: str, cfg: Config, overwrite: bool,
             progress: Progress | None, started: float) -> ConvertReport:
    if src_kind == dst_kind == "gdsckpt":
        return _recompress(src_path, dst_path, codec, cfg, overwrite, progress, started)
    phases = _Phases(progress)
    state, metadata = _READERS[src_kind](src_path, cfg, phases.reading)
    if src_kind == "gdsckpt" and dst_kind != "gdsckpt":
        state = _torch_state(state)
    dropped = sorted(set(metadata) - {"format"})  # "format" is the safetensors convention, re-added
    if dropped and dst_kind != "safetensors":
        logger.info("convert: the metadata of %s (%s) has no place in a %s file and is dropped",
                    src_path, ", ".join(dropped), dst_kind)
    tensors, logical = _tensor_stats(state)

    save_report: SaveReport | None = None
    cloned = 0
    with _destination(dst_path, overwrite, cfg.fsync, cfg.timeout) as target:
        phases.writing(0, logical)
        if dst_kind == "gdsckpt":
            save_report = _write_gdsckpt(state, target, codec, cfg, src_path, phases.writing)
        elif dst_kind == "pt":
            _write_pt(state, target, cfg)
        else:
            cloned = _write_safetensors(state, target, metadata, cfg, src_path)
        phases.writing(logical, logical)
    return ConvertReport(
        src=str(src_path), dst=str(dst_path), src_format=src_kind, dst_format=dst_kind, tensors=tensors,
        logical_bytes=logical, src_bytes=_stored_size(src_path, cfg), dst_bytes=_stored_size(dst_path, cfg),
        seconds=time.perf_counter() - started, codec=save_report.codec if save_report else None,
        cloned=cloned, save_report=save_report,
    )


def _location(path: PathLike) -> Any:
    """A local path as a ``Path``; an ``s3://`` URL kept as text (``Path`` would fold its ``//``).
    A path ending in ``/`` names a directory, as for ``cp``: ``Path`` would drop the slash and
    write a file of that name, so one that is no directory is a ``NotADirectoryError``."""
    if is_url(path):
        return str(path)
    text = os.fspath(path)
    if isinstance(text, str) and text.endswith(os.sep) and not os.path.isdir(text):
        raise NotADirectoryError(f"{text!r} ends in {os.sep!r} but is not a directory; give a file path")
    return Path(path)


def _stored_size(location: Any, config: Config) -> int:
    """The size of the file or object at ``location`` (which exists)."""
    if not is_url(location):
        return os.stat(location).st_size
    with open_reader(location, config) as reader:
        return reader.size


@contextlib.contextmanager
def _destination(dst: Any, overwrite: bool, fsync: bool, timeout: float) -> Iterator[Any]:
    """Where a conversion writes ``dst``: a temporary file beside it, published over it when the
    block ends without an error (``_temporary_beside``, ``_publish``); an object is written in
    place, since it appears only whole (its upload completes or is aborted)."""
    if is_url(dst):
        yield dst
        return
    with _temporary_beside(dst) as temp:
        yield temp
        _publish(temp, dst, overwrite=overwrite, fsync=fsync, timeout=timeout)


@contextlib.contextmanager
def _temporary_beside(dst: Path) -> Iterator[Path]:
    """A temporary file beside ``dst`` (earlier runs' stale ones removed first), gone on exit
    whether or not it was published. It is created here, empty, with ``temporary_mode``'s bits
    (private where ``dst`` exists, which it takes the bits of at ``publish``), and each writer
    writes into it: created by the writer, it took the umask's bits, so a conversion over a
    private checkpoint left its new content readable by everyone until the rename."""
    remove_stale_temporaries(dst)
    temp = temporary_path(dst)
    os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     temporary_mode(dst)))
    try:
        yield temp
    finally:
        try:
            temp.unlink()
        except FileNotFoundError:
            pass


_READ_FAILURES = (CorruptCheckpointError, UnsupportedFormatError, DeltaBaseError, ObjectChangedError)
"""What only the source's reading raises: a gdsckpt-to-gdsckpt conversion says the source cannot
be read. Other failures (a codec this host cannot run, which may be the destination's, a failed
upload) are not blamed on the source."""


def _recompress(src: Any, dst: Any, codec: str, config: Config, overwrite: bool, progress: Progress | None,
                started: float) -> ConvertReport:
    """gdsckpt to gdsckpt: the arrays streamed from ``src`` into a new file in windows
    (``api.saving.rewrite``), never the whole state in memory: a file only a GPU decodes becomes a
    portable copy (``codec="zstd"``) on a GPU host chunk by chunk. A delta becomes a full file.
    Either side may be an object."""
    with _destination(dst, overwrite, config.fsync, config.timeout) as target:
        try:
            report = rewrite(src, target, codec=codec, config=config, progress=progress)
        except (TypeError, ValueError) as err:  # a codec the configuration refuses (portable=True)
            raise ConvertError(f"{str(src)!r} cannot be written as gdsckpt: {err}") from err
        except _READ_FAILURES as err:  # say which file (the original is the cause)
            raise ConvertError(f"cannot read {str(src)!r} as gdsckpt: {err}") from err
        except CheckpointError as err:  # a codec this host lacks (either side's), a failed upload, ...
            raise ConvertError(f"cannot convert {str(src)!r} to {str(dst)!r}: {err}") from err
    return ConvertReport(
        src=str(src), dst=str(dst), src_format="gdsckpt", dst_format="gdsckpt", tensors=report.tensors,
        logical_bytes=report.logical_bytes, src_bytes=_stored_size(src, config),
        dst_bytes=_stored_size(dst, config), seconds=time.perf_counter() - started, codec=report.codec, cloned=0,
        save_report=report,
    )


def _check_paths(src: Any, dst: Any, src_kind: str, dst_kind: str, overwrite: bool, config: Config) -> None:
    """Fail before any work on a missing source, an unusable destination or one that exists.
    Objects (``s3://`` URLs) are gdsckpt files only, since the other formats' readers and writers
    take local files; a missing source object is found by the first read."""
    for location, kind in ((src, src_kind), (dst, dst_kind)):
        if is_url(location) and kind != "gdsckpt":
            raise ValueError(f"{location!r}: s3:// URLs are converted from and to gdsckpt only; copy the "
                             f"{kind} file to local storage first")
    if not is_url(src):
        if not src.exists():
            raise FileNotFoundError(f"source {str(src)!r} does not exist")
        if src.is_dir():
            raise IsADirectoryError(f"source {str(src)!r} is a directory; give a file")
        if not src.is_file():  # a FIFO would stall the reader, a device be read without end
            raise ConvertError(f"source {str(src)!r} is not a regular file (a FIFO, a device or a socket)")
    if is_url(dst):
        prefix, _slash, name = dst.rpartition("/")
        exists = ObjectDirectory(prefix, endpoint=config.s3_endpoint, timeout=config.timeout).size(name) is not None
    else:
        if dst.is_dir():
            raise IsADirectoryError(f"destination {str(dst)!r} is a directory; give a file path")
        if not dst.parent.is_dir():
            raise FileNotFoundError(f"directory {str(dst.parent)!r} of destination {str(dst)!r} does not exist")
        refuse_special_target(dst)  # a FIFO or device is never replaced, --overwrite or not
        exists = os.path.lexists(dst)
    if exists and not overwrite:
        raise FileExistsError(f"destination {str(dst)!r} exists; pass overwrite=True (--overwrite) "
                              f"to replace it")


def _publish(temp: Path, dst: Path, *, overwrite: bool, fsync: bool, timeout: float) -> None:
    """Move the finished ``temp`` to ``dst`` in one atomic step (``io.posix.publish``, its
    directory's fsync waited for at most ``timeout`` seconds); without ``overwrite`` a destination
    that appeared during the conversion is not clobbered either."""
    try:
        publish(temp, dst, fsync=fsync, replace=overwrite, timeout=timeout)
    except FileExistsError:
        if overwrite:
            raise  # a FIFO or device there (``refuse_special_target``)
        raise FileExistsError(f"destination {str(dst)!r} appeared during the conversion; "
                              f"pass overwrite=True (--overwrite) to replace it") from None


class _Phases:
    """One ``progress(done, total)`` over reading the source and writing the destination.

    Only a gdsckpt source reports its reading; the writing then moves as many bytes again, so
    the reading counts against twice its total until the writing reports its own."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.read_total = 0

    def reading(self, done: int, total: int) -> None:
        """Progress of the read phase."""
        self.read_total = total
        if self.progress is not None:
            self.progress(done, 2 * total)

    def writing(self, done: int, total: int) -> None:
        """Progress of the write phase."""
        if self.progress is not None:
            self.progress(self.read_total + done, self.read_total + total)


def _call_with_progress(function: Callable[..., Any], *args: Any, progress: Progress | None,
                        **kwargs: Any) -> Any:
    """Call ``function``, passing ``progress`` on only where its signature takes it (older
    versions of ``gdsckpt.save`` / ``load`` do not)."""
    if progress is not None and "progress" in inspect.signature(function).parameters:
        kwargs["progress"] = progress
    return function(*args, **kwargs)


def _import_torch(why: str) -> Any:
    try:
        import torch
    except ImportError as err:
        raise ConvertError(f"{why} needs torch (pip install torch): {err}") from err
    return torch


def _import_safetensors(why: str) -> Any:
    try:
        import safetensors
    except ImportError as err:
        raise ConvertError(f"{why} needs the safetensors package (pip install safetensors): {err}") from err
    try:
        import safetensors.torch
    except ImportError as err:  # safetensors is there; its torch API needs PyTorch
        raise ConvertError(f"{why} needs PyTorch (pip install torch) for safetensors' torch API: {err}") from err
    return safetensors


# ---------------------------------------------------------------------------------------------
# readers: path -> (state, safetensors metadata other than ours)

def _read_pt(path: Path, config: Config, progress: Progress) -> tuple[Any, dict[str, str]]:
    import pickle

    torch = _import_torch(f"reading the torch pickle {str(path)!r}")
    # An open file, not the path: torch.load hands a path ending in ".safetensors" to safetensors
    # (``--from pt`` then read a safetensors file flattened, without a word).
    with open(path, "rb") as handle:
        try:
            state = torch.load(handle, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            text = str(err)
            if "Unsupported operand" in text:  # no pickle opcode: random bytes or a damaged file
                raise ConvertError(f"cannot read {str(path)!r} as a torch pickle: it is no torch.save file, or "
                                   f"a damaged one (an invalid pickle opcode)") from None
            if "weights only" in text.lower() or "WeightsUnpickler" in text:
                raise UnsafePickleError(
                    f"refused {str(path)!r}: it holds objects other than tensors and plain containers "
                    f"({_weights_only_reason(text)}); convert reads torch pickles only with "
                    f"torch.load(weights_only=True) and never runs code from a checkpoint") from None
            raise ConvertError(f"cannot read {str(path)!r} as a torch pickle: {text}") from err
        except OSError as err:
            if err.errno != errno.EINVAL:  # the file's own read failed (EIO): as it is
                raise
            # torch's zip reader says EINVAL for a file cut short (a seek past its end)
            raise ConvertError(f"cannot read {str(path)!r} as a torch pickle: it is no torch.save file, or "
                               f"a damaged (truncated?) one ({err})") from err
        except MemoryError:
            raise
        except Exception as err:  # torch reports a malformed file as any of many exception types
            text = str(err)
            if "legacy .tar format" in text:  # torch's message goes on to advise weights_only=False
                raise UnsafePickleError(f"refused {str(path)!r}: a torch pickle in the legacy .tar format, "
                                        f"which torch reads only without its weights-only safeguard (running any "
                                        f"code the file names); convert never does. Re-save it with a current "
                                        f"torch.save in a process you trust") from None
            raise ConvertError(f"cannot read {str(path)!r} as a torch pickle "
                               f"({type(err).__name__}: {text})") from err
    _refuse_expanded(state, torch, path)
    return state, {}


EXPANSION_LIMIT = 1 << 30
"""Bytes by which the tensors of a torch pickle may together outgrow their storages before convert
refuses them."""


def _refuse_expanded(state: Any, torch: Any, path: Path) -> None:
    """Refuse tensors whose elements overlap in their storage (``expand``, stride 0) and stand, all
    together, for more than ``EXPANSION_LIMIT`` bytes beyond it: a checkpoint stores every element,
    so a 1.5 KB pickle of ``torch.zeros(1).expand(2**40)`` became a 4 TiB write that filled the
    disk, and four entries of ``expand(2**28 - 1)`` (each under the limit) a 4 GiB one. A
    ``ConvertError`` naming the largest, before anything is written."""
    pending: list[tuple[str, Any]] = [("", state)]
    excess: list[tuple[int, str, Any, int]] = []  # bytes beyond the storage, key, tensor, storage bytes
    while pending:
        name, obj = pending.pop()
        if isinstance(obj, dict):
            pending.extend((f"{name}/{key}", value) for key, value in obj.items())
        elif isinstance(obj, (list, tuple)):
            pending.extend((f"{name}/{i}", value) for i, value in enumerate(obj))
        elif isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            logical = obj.numel() * obj.element_size()
            stored = obj.untyped_storage().nbytes()
            if logical > stored:
                excess.append((logical - stored, name.lstrip("/") or "(the root)", obj, stored))
    total = sum(beyond for beyond, *_rest in excess)
    if total > EXPANSION_LIMIT:
        beyond, key, tensor, stored = max(excess, key=lambda entry: entry[0])
        logical = beyond + stored
        others = f" ({len(excess) - 1} more such tensors, {total} bytes beyond their storage in all)" \
            if len(excess) > 1 else ""
        raise ConvertError(
            f"{str(path)!r}: tensor {key!r} (shape {list(tensor.shape)}) is a view whose {logical} bytes of "
            f"elements overlap in {stored} bytes of storage (expand, stride 0){others}; a checkpoint stores "
            f"every element, so converting would write {total} bytes more than the file holds: make them "
            f"contiguous yourself first if that is meant")


def _weights_only_reason(message: str) -> str:
    """What torch's weights-only refusal says was refused, without its advice to load with
    ``weights_only=False`` or to allowlist globals (either would trust the file)."""
    marker = "WeightsUnpickler error:"
    text = message.split(marker, 1)[1] if marker in message else message
    reasons = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Weights only load failed", "Check the documentation", "Please file",
                                         "(1)", "(2)", "In PyTorch")):
            reasons.append(line.split(" Please use ", 1)[0])
    return " ".join(reasons) or "torch's weights-only unpickler refused it"


def _read_safetensors(path: Path, config: Config, progress: Progress) -> tuple[Any, dict[str, str]]:
    safetensors = _import_safetensors(f"reading {str(path)!r}")
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            names = handle.keys()
            tensors = {name: _own_storage_if_empty(handle.get_tensor(name)) for name in names}
    except (OSError, MemoryError):
        raise
    except Exception as err:  # SafetensorError and the errors of a malformed header
        raise ConvertError(f"cannot read {str(path)!r} as safetensors ({type(err).__name__}: {err})") from err
    structure = metadata.pop(STRUCTURE_KEY, None)
    if structure is None:
        return tensors, metadata
    return rebuild_state(structure, tensors, path), metadata


def _own_storage_if_empty(tensor: Any) -> Any:
    """``tensor``, or for a zero-size one a copy: safetensors hands out zero-size tensors whose
    storage points at a neighbour's bytes, which ``torch.save`` refuses as one memory viewed with
    two dtypes."""
    return tensor.clone() if tensor.numel() == 0 else tensor


def _read_gdsckpt(path: Path, config: Config, progress: Progress) -> tuple[Any, dict[str, str]]:
    try:
        return _call_with_progress(_load_gdsckpt, path, device="cpu", config=config, progress=progress), {}
    except CheckpointError as err:  # e.g. corrupt: say which file (the original is the cause)
        raise ConvertError(f"cannot read {str(path)!r} as gdsckpt: {err}") from err


_READERS: dict[str, Callable[[Path, Config, Progress], tuple[Any, dict[str, str]]]] = {
    "pt": _read_pt, "safetensors": _read_safetensors, "gdsckpt": _read_gdsckpt,
}


# ---------------------------------------------------------------------------------------------
# writers

class _WriteErrorKept:
    """A binary file's ``write`` and ``flush`` that keep the first ``OSError`` they raise: torch's
    zip writer swallows it and fails later with a position mismatch of its own
    ("unexpected pos ..."), which would hide a full disk (ENOSPC) or a size limit (EFBIG)."""

    def __init__(self, handle: Any):
        self._handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._handle.write(data))
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self._handle.flush()
        except OSError as err:
            self.error = self.error or err
            raise


def _write_pt(state: Any, temp: Path, config: Config) -> None:
    torch = _import_torch("writing a torch pickle")
    with open(temp, "wb") as handle:
        kept = _WriteErrorKept(handle)
        try:
            torch.save(state, kept)
        except Exception as err:
            if kept.error is not None:  # the disk's own error, not torch's account of it
                raise kept.error from err
            raise
    if config.fsync:
        fsync_path(temp, timeout=config.timeout)


def _write_gdsckpt(state: Any, temp: Path, codec: str, config: Config, src: Path,
                   progress: Progress | None) -> SaveReport:
    try:
        return _call_with_progress(_save_gdsckpt, state, temp, codec=codec, config=config, progress=progress)
    except (TypeError, ValueError) as err:  # content gdsckpt cannot hold, named by key path
        raise ConvertError(f"{str(src)!r} cannot be written as gdsckpt: {err}") from err


_SAFETENSORS_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
"""How safetensors' Rust writer names the errno of a failed write ("I/O error: File too large (os
error 27)"; ``IoError(Os { code: 28, ...`` in other versions)."""


def _write_safetensors(state: Any, temp: Path, metadata: dict[str, str], config: Config, src: Path) -> int:
    """Write ``state`` flattened, with its structure in the metadata; returns how many entries
    were copied because they shared memory with another."""
    safetensors = _import_safetensors("writing safetensors")
    tensors, structure, cloned = flatten_for_safetensors(state, src)
    header = {"format": "pt", **metadata, STRUCTURE_KEY: json.dumps(structure, separators=(",", ":"))}
    # safetensors creates its file private (0600); ``temp`` keeps the bits it was created with
    # (``_temporary_beside``), as torch.save's and gdsckpt's files do.
    mode = os.stat(temp).st_mode & 0o777
    try:
        safetensors.torch.save_file(tensors, str(temp), metadata=header)
        os.chmod(temp, mode)
    except (OSError, MemoryError):
        raise
    except Exception as err:
        written = _SAFETENSORS_OS_ERROR.search(str(err))
        if written:  # safetensors reports its write's failure (ENOSPC, EFBIG) as its own error
            code = int(written.group(1) or written.group(2))
            raise OSError(code, f"{os.strerror(code)} (writing {str(temp)!r}: {err})") from err
        raise ConvertError(f"safetensors refused the content of {str(src)!r} "
                           f"({type(err).__name__}: {err})") from err
    if config.fsync:
        fsync_path(temp, timeout=config.timeout)
    return cloned


# ---------------------------------------------------------------------------------------------
# state helpers

def _torch_state(state: Any) -> Any:
    """``state`` with every NumPy / JAX array replaced by a CPU torch tensor of the same dtype and
    bytes (pt and safetensors hold torch tensors only); one array held twice stays one tensor."""
    torch = _import_torch("writing arrays as torch tensors")
    memo: dict[int, Any] = {}

    def convert_node(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) or obj is None:
            return obj
        if isinstance(obj, (bool, int, float, str)) and not isinstance(obj, np.generic):
            return obj  # np.float64 is a float, but gdsckpt keeps it as an array: converted below
        if isinstance(obj, dict):
            result = type(obj)((key, convert_node(value)) for key, value in obj.items())
            if hasattr(obj, "_metadata"):
                result._metadata = obj._metadata  # type: ignore[attr-defined]
            return result
        if isinstance(obj, (list, tuple)):
            return type(obj)(convert_node(item) for item in obj)
        if id(obj) not in memo:
            memo[id(obj)] = (obj, _array_to_torch(obj, torch))  # keep obj alive: ids stay unique
        return memo[id(obj)][1]

    return convert_node(state)


def _array_to_torch(array: Any, torch: Any) -> Any:
    """A NumPy array or scalar (or anything ``np.asarray`` takes, e.g. a JAX array) as a CPU torch
    tensor with the same bits, bfloat16 and float8 (ml_dtypes) included."""
    host = np.asarray(array)
    name = numpy_dtype_name(host.dtype.newbyteorder("="))
    if name is None:
        raise ConvertError(f"an array of dtype {host.dtype} has no torch equivalent")
    if host.dtype.byteorder == ">" or (host.dtype.byteorder == "=" and sys.byteorder == "big"):
        host = host.astype(host.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(host).reshape(-1)
    if not flat.flags.writeable:
        flat = flat.copy()  # torch.from_numpy warns about, and would share, read-only memory
    return torch.from_numpy(flat.view(np.uint8)).view(torch_dtype(name)).reshape(host.shape)


def _tensor_stats(state: Any) -> tuple[int, int]:
    """(tensor entries, element bytes of the distinct tensors) of a state."""
    torch = sys.modules.get("torch")
    entries = 0
    seen: dict[int, int] = {}
    pending = [state]
    while pending:
        obj = pending.pop()
        if isinstance(obj, dict):
            pending.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
        elif torch is not None and isinstance(obj, torch.Tensor):
            entries += 1
            seen[id(obj)] = obj.numel() * obj.element_size()
        elif isinstance(obj, (np.ndarray, np.generic)):
            entries += 1
            seen[id(obj)] = int(obj.nbytes)
    return entries, sum(seen.values())


__all__ = [
    "EXTENSIONS", "FORMATS", "STRUCTURE_KEY", "ConvertError", "ConvertReport", "UnsafePickleError",
    "check_codec", "convert", "detect_format",
]
