"""Configuration: every knob of a save or load, with its default.

Precedence, highest first: an argument of ``save``/``load`` > a config file (``Config.from_toml``,
the CLI's ``--config``) or a ``Config`` passed as ``config=`` > a ``GDSCKPT_<FIELD>`` environment
variable (e.g. ``GDSCKPT_CHUNK_BYTES=8MiB``) > the default. A config file is applied over the
environment (``from_toml`` starts from ``from_env``), whereas ``Config(...)`` built in code starts
from the defaults alone. ``docs/configuration.md`` has the same field table, the file format and
the presets shipped in the package (``Config.preset("fast-nvme")``, ``gdsckpt --config fast-nvme``).

| field | default | meaning |
|---|---|---|
| codec | ``"auto"`` | ``auto`` (CPU: byte planes + zstd; a save of host state of 16 MiB or more to a local file stores every chunk as it is when the codec threads, at the pace its earlier saves measured, would write slower than the storage, and otherwise a chunk whose turn comes while the storage has nothing left to write is stored as it is: compression never holds back storage faster than the cores; GPU: ANS or Zstd, whichever saves faster on the measured storage; Zstd only where ``max_staging_bytes`` leaves room for its ~1.1 GiB of nvCOMP scratch, so ANS under the default 1 GiB), ``zstd``, ``lz4``, ``deflate``, ``none``; GPU only, no CPU decoder: ``ans``, ``gdeflate``, ``snappy``, ``bitcomp``, ``cascaded`` |
| chunk_bytes | 4 MiB | uncompressed bytes per chunk on the CPU engine (multiple of 4096, at most 1 GiB) |
| gpu_chunk_bytes | 16 MiB | the same on the GPU engine (at most 16 MiB, nvCOMP's largest chunk; the GPU pipeline into a null sink runs about twice as fast with 16 MiB chunks as with 4 MiB: docs/performance.md); halved, down to 64 KiB, where two staging slots and the codec's nvCOMP scratch do not fit ``max_staging_bytes`` otherwise (``SaveReport.auto["chunk_bytes"]`` says so), and a budget too small even then is a ``ValueError`` (nvCOMP's Zstd under the default budget: its ~1.1 GiB of scratch is the same for any chunk size) |
| pack_below | 1 MiB | arrays smaller than this share chunks |
| byte_planes | ``"auto"`` | ``auto`` (per array, kept where it compresses better), ``always``, ``never`` |
| level | ``None`` | compression level for zstd/deflate (None: the engine's default; CPU: zstd 1, deflate 6) |
| codec_threads | 0 | CPU threads for codecs (0: one per core) |
| io_threads | min(8, cores) | threads issuing reads and writes (POSIX I/O: the CPU engine, loads into host memory); small hosts' virtual disks read slower with more threads than cores, and a file of at most 256 MiB that is not in the page cache is read by one thread (``io.posix.ONE_READER_BYTES``: the kernel's readahead does better) (docs/performance.md, "Save and load on the CPU") |
| max_inflight_bytes | 256 MiB | bound on chunk bytes between read/encode and write/decode (at least ``chunk_bytes``); a convert or rebase also reads its source in windows of this size, up to five at a time |
| o_direct | ``"auto"`` | O_DIRECT for aligned (compressed) chunk writes: ``auto`` (where the filesystem allows), true, false. A chunk stored as it is goes to the writer from the state's memory and is written buffered, its write-back started at once; ``true`` copies it into an aligned buffer to write it with O_DIRECT too. Reads stay buffered: measured, O_DIRECT reads did not speed cold loads and slowed warm ones |
| fsync | True | fsync the file and its directory before a save returns |
| timeout | 600 | seconds any single wait on a worker may take before failing the operation (every fsync included: the file's, after which the previous file stays in place; its directory's after the rename, when the new file is in place already; the manager's `latest` pointer's) |
| engine | ``"auto"`` | ``auto`` (GPU when the state has CUDA arrays and nvCOMP is usable), ``cpu``, ``gpu`` (every save, failing where no GPU is usable) |
| max_staging_bytes | 1 GiB | GPU memory of a save: the staging ring (chunks being compressed), nvCOMP's scratch and the byte-plane trial's buffer, allocated once per save; the least a restore's ring may have |
| restore_staging_bytes | ``None`` | GPU staging ring of a restore (chunks being read and decoded). None: sized when the restore starts, a quarter of the device memory free then, at least ``max_staging_bytes`` and at most 8 GiB (``RESTORE_STAGING_CAP``); never more than the chunks to read fill; a delta checkpoint's restore gives half to its own decoder and half to its base's (halved again for each further link), so the decoders alive together keep it. A restore into a GPU named before the index is read starts with a lead read of up to half the least budget (``max_staging_bytes``, or this where set; 512 MiB by default) that becomes part of this budget, or is released before the restore allocates where the restore cannot use it |
| snapshot_gpu_bytes | 1 GiB | ``save_async``: a state whose CUDA tensors hold at most this many bytes is snapshotted by a copy on its GPU (kept in the snapshot pool between saves); a larger one into pinned host memory |
| async_worker | ``"thread"`` | ``save_async`` / ``CheckpointManager.save_async``: where the background save runs: ``thread`` (a thread of the training process) or ``process`` (a spawned worker process reading the snapshot through shared memory: the training process's GIL stays free; see ``gdsckpt.background.worker``) |
| async_engine | ``"auto"`` | ``save_async``: the engine of the background save: ``auto`` (as ``engine``), ``cpu``, ``gpu``. With ``async_worker="process"``, ``cpu`` leaves the GPU and the training process to training, which is what kept a training loop closest to its speed without checkpoints (docs/performance.md, "Async saves") (preset ``async-training``) |
| kvikio_threads | 16 | kvikio thread pool size (GPU engine) |
| kvikio_task_size | ``None`` | kvikio task size in bytes (None: kvikio's default; in compat mode, 8 MiB for writes and 16 MiB for reads of a file not in the page cache) |
| storage_gbps | ``None`` | storage write speed for ``codec="auto"`` (None: measured once per filesystem and cached) |
| s3_endpoint | ``None`` | the S3 server of ``s3://`` checkpoints (e.g. ``http://minio:9000``; None: ``AWS_ENDPOINT_URL``, else AWS itself); credentials and region from the AWS environment (docs/object-storage.md) |
| portable | False | write only codecs with a CPU decoder (``zstd``, ``lz4``, ``deflate``, ``none``), so that any machine reads the file: ``codec="auto"`` chooses among them and a GPU-only codec is refused; CUDA state is then compressed by the CPU engine unless ``engine="gpu"`` (see ``gdsckpt.save``) |
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, fields
from typing import Any

from .codecs.nvcomp import MAX_CHUNK_BYTES
from .format import ALIGNMENT

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """Parse a byte size: an int, or a string like ``"4MiB"``, ``"512k"``, ``"1G"`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"not a byte size: {value!r} (examples: 4194304, '4MiB', '512k')")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


_MAX_SHOWN_BITS = 2000
"""Integers a ``Config`` field's message may print (about 600 digits, below any limit Python's
``sys.set_int_max_str_digits`` takes, 640 at least)."""

_CHOICES = {
    "byte_planes": ("auto", "always", "never"),
    "engine": ("auto", "cpu", "gpu"),
    "async_worker": ("thread", "process"),
    "async_engine": ("auto", "cpu", "gpu"),
}

# The kind of value each field takes, which decides how its text (an environment variable, a
# string in a config file) is read and which native TOML types a config file may use for it.
# Spelled out by hand rather than read from the annotations (strings under ``from __future__``)
# so that a new field without an entry fails the tests instead of being read as text.
_KINDS = {
    "codec": "text", "chunk_bytes": "size", "gpu_chunk_bytes": "size", "pack_below": "size",
    "byte_planes": "text", "level": "int", "codec_threads": "int", "io_threads": "int",
    "max_inflight_bytes": "size", "o_direct": "switch", "fsync": "bool", "timeout": "float",
    "engine": "text", "max_staging_bytes": "size", "restore_staging_bytes": "size", "snapshot_gpu_bytes": "size", "async_worker": "text",
    "async_engine": "text", "kvikio_threads": "int",
    "kvikio_task_size": "size", "storage_gbps": "float", "s3_endpoint": "text", "portable": "bool",
}
_OPTIONAL = frozenset({"level", "kvikio_task_size", "storage_gbps", "restore_staging_bytes", "s3_endpoint"})
"""Fields that may be None, written ``none`` (or empty) as text: TOML itself has no null."""
_SIZE_FIELDS = tuple(name for name, kind in _KINDS.items() if kind == "size" and name not in _OPTIONAL)
_EXPECTED = {
    "size": 'an integer number of bytes or a size string such as "4MiB"',
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "switch": 'true, false or "auto"',
    "text": "a string",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


IO_THREADS_MOST = 8
"""The default ``io_threads`` on a host of that many cores or more."""


def available_cores() -> int:
    """Cores this process may run on (its affinity where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_io_threads() -> int:
    """``io_threads`` unless configured: one per core, at most ``IO_THREADS_MOST``. Fast NVMe
    wants several requests in flight; the small virtual disks of small hosts did worse with more
    threads than cores (docs/performance.md, "Save and load on the CPU")."""
    return max(1, min(IO_THREADS_MOST, available_cores()))


MAX_THREADS = 1024
"""The most threads a thread-count field takes: each is an OS thread kept for the process's life."""
CONFIG_FILE_LIMIT = 1 << 20
"""The most bytes ``Config.from_toml`` reads: a configuration is a few lines."""


def check_level(codec: str, level: Any) -> None:
    """``ValueError`` unless ``level`` is None or an integer the CPU engine's codec for ``codec``
    takes (zstd for ``"auto"``; deflate; other codecs take any integer): what ``Config`` and the
    DCP writer (whose codec may differ from its configuration's) check before a save begins."""
    if level is None:
        return
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"level must be an integer or None, got {level!r}")
    host_name = "zstd" if codec == "auto" else codec
    if host_name == "deflate" and not 0 <= level <= 9:  # the encoder clamped others silently (-5: stored)
        raise ValueError(f"level={level} is not a valid deflate compression level: 0 to 9")
    if host_name in ("zstd", "deflate"):
        import numpy as np

        from .codecs import host_encoder

        try:
            host_encoder(host_name, level).encode(np.zeros(64, dtype=np.uint8))
        except (ValueError, OverflowError) as err:  # zstandard's "level must be less than 23", 10**30 ...
            raise ValueError(f"level={level} is not a valid {host_name} compression level: {err}") from None


@dataclass(frozen=True)
class Config:
    """Options of save and load. Immutable; ``replace(**changes)`` derives a modified copy."""

    codec: str = "auto"
    chunk_bytes: int = 4 << 20
    gpu_chunk_bytes: int = MAX_CHUNK_BYTES
    pack_below: int = 1 << 20
    byte_planes: str = "auto"
    level: int | None = None
    codec_threads: int = 0
    io_threads: int = dataclasses.field(default_factory=lambda: default_io_threads())
    max_inflight_bytes: int = 256 << 20
    o_direct: bool | str = "auto"
    fsync: bool = True
    timeout: float = 600.0
    engine: str = "auto"
    max_staging_bytes: int = 1 << 30
    restore_staging_bytes: int | None = None
    snapshot_gpu_bytes: int = 1 << 30
    async_worker: str = "thread"
    async_engine: str = "auto"
    kvikio_threads: int = 16
    kvikio_task_size: int | None = None
    storage_gbps: float | None = None
    s3_endpoint: str | None = None
    portable: bool = False

    def __post_init__(self) -> None:
        for name in (*_SIZE_FIELDS, *(n for n in _OPTIONAL if _KINDS[n] == "size")):
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            try:
                object.__setattr__(self, name, parse_size(value))
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # The messages below would fail to print a number past Python's 4,300-digit limit
            # (sys.set_int_max_str_digits), not naming the field; no setting means anything near it.
            if isinstance(value, int) and value.bit_length() > _MAX_SHOWN_BITS:
                raise ValueError(f"{field.name} is out of range: an integer of {value.bit_length()} bits")
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGNMENT or self.chunk_bytes > 1 << 30:
            raise ValueError(f"chunk_bytes must be a multiple of 4096 between 4 KiB and 1 GiB, "
                             f"got {self.chunk_bytes}")
        if (self.gpu_chunk_bytes <= 0 or self.gpu_chunk_bytes % ALIGNMENT
                or self.gpu_chunk_bytes > MAX_CHUNK_BYTES):
            raise ValueError(f"gpu_chunk_bytes must be a multiple of 4096 between 4 KiB and 16 MiB "
                             f"(nvCOMP's largest chunk), got {self.gpu_chunk_bytes}")
        if self.max_inflight_bytes < self.chunk_bytes:
            raise ValueError(f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least "
                             f"chunk_bytes ({self.chunk_bytes})")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid (expected one of: "
                                 f"{', '.join(choices)})")
        if not (self.o_direct is True or self.o_direct is False or self.o_direct == "auto"):
            raise ValueError(f"o_direct={self.o_direct!r} is invalid (expected one of: auto, True, False)")
        if self.max_staging_bytes <= 0 or self.snapshot_gpu_bytes < 0:
            raise ValueError(f"max_staging_bytes must be > 0 and snapshot_gpu_bytes >= 0, got "
                             f"{self.max_staging_bytes} and {self.snapshot_gpu_bytes}")
        if self.restore_staging_bytes is not None and self.restore_staging_bytes <= 0:
            raise ValueError(f"restore_staging_bytes must be > 0 or None (sized from free device memory), "
                             f"got {self.restore_staging_bytes}")
        # Checked here, not where a save first uses them: a value that fails half-way through a
        # save (a level the codec refuses, a thread count the OS cannot start, a timeout beyond
        # what a lock can wait) left a file object truncated or a process without threads.
        for name, least in (("io_threads", 1), ("codec_threads", 0), ("kvikio_threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_THREADS:
                raise ValueError(f"{name} must be an integer from {least} to {MAX_THREADS}, got {value!r}")
        if isinstance(self.pack_below, bool) or not isinstance(self.pack_below, int) or self.pack_below < 0:
            raise ValueError(f"pack_below must be a size >= 0, got {self.pack_below!r}")
        if self.kvikio_task_size is not None and self.kvikio_task_size <= 0:
            raise ValueError(f"kvikio_task_size must be > 0 or None (kvikio's default), got {self.kvikio_task_size!r}")
        if self.storage_gbps is not None and (isinstance(self.storage_gbps, bool)
                                              or not isinstance(self.storage_gbps, (int, float))
                                              or not 0 < self.storage_gbps < math.inf):
            raise ValueError(f"storage_gbps must be a positive number of GB/s or None (measured), "
                             f"got {self.storage_gbps!r}")
        if self.s3_endpoint is not None and not isinstance(self.s3_endpoint, str):
            raise ValueError(f"s3_endpoint must be a URL string or None, got {self.s3_endpoint!r}")
        self._check_codec()
        for name in ("fsync", "portable"):  # a truthy string such as "no" must not read as True
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                or not 0 < self.timeout <= threading.TIMEOUT_MAX):
            raise ValueError(f"timeout must be a positive number of seconds of at most "
                             f"{threading.TIMEOUT_MAX:.0f}, got {self.timeout!r}")

    def _check_codec(self) -> None:
        """A codec name this installation knows (``ValueError`` listing them), and a ``level``
        that is an integer the CPU engine's codec takes (zstd for ``"auto"``, deflate)."""
        from .codecs import versioned_name

        if not isinstance(self.codec, str):
            raise ValueError(f"codec must be a codec name, got {self.codec!r}")
        if self.codec != "auto":
            versioned_name(self.codec)
        check_level(self.codec, self.level)

    @property
    def effective_codec_threads(self) -> int:
        """``codec_threads``, with 0 meaning one per available core."""
        return self.codec_threads or available_cores()

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Config:
        """Defaults overridden by ``GDSCKPT_<FIELD>`` environment variables."""
        environ = dict(os.environ if environ is None else environ)
        changes: dict[str, Any] = {}
        for f in fields(cls):
            variable = f"GDSCKPT_{f.name.upper()}"
            text = environ.get(variable)
            if text is None:
                continue
            try:
                changes[f.name] = _coerce(f.name, text)
            except (ValueError, KeyError, OverflowError) as err:
                raise ValueError(f"environment variable {variable}: {err}") from err
        try:
            return cls(**changes)
        except (ValueError, OverflowError) as err:  # a value that parsed but Config refuses: say where it came from
            variables = ", ".join(f"GDSCKPT_{name.upper()}" for name in changes)
            raise ValueError(f"{err} (from the environment: {variables})") from err

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], *, base: Config | None = None) -> Config:
        """``base`` (default: ``Config.from_env()``) with the values of the TOML file ``path``.

        The file holds top-level ``field = value`` pairs, one per ``Config`` field it sets, and
        nothing else (no tables). A value is either the field's native TOML type (an integer
        for sizes and thread counts, a number for ``timeout``/``storage_gbps``, true/false for
        ``fsync``/``o_direct``, a string for ``codec``/``engine``/``byte_planes``/``async_worker``) or a string
        read like the ``GDSCKPT_<FIELD>`` environment variable (``"4MiB"``, ``"none"``,
        ``"auto"``). Raises ``ValueError`` naming the file and the key for an unknown key, a
        value of the wrong type, or a value the field does not allow (listing what it does),
        for a file that is not valid TOML, and for a path that is not a regular file or holds
        more than ``CONFIG_FILE_LIMIT`` bytes; ``FileNotFoundError`` for a missing file.

        A relative ``path`` is relative to the current directory, as ``open`` takes it; the
        presets shipped with gdsckpt are read by name from anywhere with ``Config.preset``.
        """
        from .errors import CheckpointError, UnsupportedFormatError
        from .io.posix import read_small_file

        where = os.fspath(path)
        try:
            # a regular file of at most CONFIG_FILE_LIMIT bytes: a FIFO would block the read for
            # ever, a device or a checkpoint given by mistake be read whole
            data = read_small_file(where, CONFIG_FILE_LIMIT)
        except UnsupportedFormatError:
            kind = "a directory" if os.path.isdir(where) else "a FIFO, a device or a socket"
            raise ValueError(f"configuration file {where!r} is not a regular file ({kind})") from None
        except CheckpointError:  # more bytes than any configuration
            raise ValueError(f"configuration file {where!r} holds more than {CONFIG_FILE_LIMIT} bytes: "
                             f"not a configuration") from None
        except FileNotFoundError as err:
            stem = os.path.splitext(os.path.basename(where))[0]
            if stem in preset_names():
                # The presets once lived in the repository's configs/ folder: an old path learns the name.
                raise FileNotFoundError(err.errno, f"{err.strerror} (the preset {stem!r} ships inside "
                                                   f"gdsckpt: Config.preset({stem!r}), --config {stem})",
                                        where) from err
            raise
        return cls._from_document(where, data, base)

    @classmethod
    def preset(cls, name: str, *, base: Config | None = None) -> Config:
        """``base`` (default: ``Config.from_env()``) with the values of the preset ``name``, one of
        the commented TOML files shipped inside the package (``preset_names()``: ``fast-nvme``,
        ``shared-filesystem``, ``portable``, ``async-training``; docs/configuration.md says what
        each sets and why). Works from any directory and in a wheel install. Raises ``ValueError``
        listing the presets for an unknown name, ``TypeError`` for a name that is not a ``str``
        (a TOML file's path goes to ``Config.from_toml``)."""
        names = preset_names()
        if not isinstance(name, str):
            also = " (a TOML file's path goes to Config.from_toml)" if isinstance(name, os.PathLike) else ""
            raise TypeError(f"Config.preset takes a preset's name, one of: {', '.join(names)}; "
                            f"got {type(name).__qualname__}{also}")
        if name not in names:
            guess = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise ValueError(f"preset {name!r} is unknown ({hint}expected one of: {', '.join(names)})")
        resource = _presets_folder().joinpath(f"{name}{PRESET_SUFFIX}")
        return cls._from_document(f"preset {name}", resource.read_bytes(), base)

    @classmethod
    def _from_document(cls, where: str, data: bytes, base: Config | None) -> Config:
        """``base`` (default: ``from_env()``) with the TOML document ``data``; ``where`` names it in errors."""
        try:
            document = _toml_module().loads(data.decode("utf-8"))
        except ValueError as err:  # TOMLDecodeError and UnicodeDecodeError both are
            raise ValueError(f"{where}: not valid TOML: {err}") from err
        changes = {key: _file_value(where, key, value) for key, value in document.items()}
        start = base if base is not None else cls.from_env()
        try:
            return start.replace(**changes)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err


PRESET_SUFFIX = ".toml"
"""The presets are ``gdsckpt/presets/<name>.toml``, package data of the wheel."""


def _presets_folder() -> Any:
    """The presets' folder as an ``importlib.resources`` traversable (a plain folder, or inside a zip)."""
    from importlib.resources import files

    return files(__package__ or "gdsckpt").joinpath("presets")


def preset_names() -> tuple[str, ...]:
    """The names ``Config.preset`` and ``--config`` take, sorted (each a TOML file shipped in the package)."""
    return tuple(sorted(entry.name[: -len(PRESET_SUFFIX)] for entry in _presets_folder().iterdir()
                        if entry.name.endswith(PRESET_SUFFIX)))


def resolve_config(path: str | os.PathLike[str] | None) -> Config:
    """The configuration of a command that takes ``--config PATH|PRESET``: with nothing, the
    environment alone (``from_env``); a path to an existing file, or anything that looks like a
    path (a folder in it, a ``.toml`` suffix), is read with ``Config.from_toml``; otherwise a
    preset's name (``Config.preset``). Raises ``ValueError`` for a name that is neither."""
    if path is None:
        return Config.from_env()
    text = os.fspath(path)
    looks_like_path = os.sep in text or "/" in text or text.endswith(PRESET_SUFFIX)
    # a directory of the preset's name (a project's "portable/") does not hide the preset
    shadowing_directory = os.path.isdir(text) and text in preset_names()
    if looks_like_path or (os.path.exists(text) and not shadowing_directory):
        return Config.from_toml(text)
    if text in preset_names():
        return Config.preset(text)
    guess = difflib.get_close_matches(text, preset_names(), n=1)
    hint = f"did you mean {guess[0]!r}? " if guess else ""
    raise ValueError(f"{text!r} is neither a file nor a preset ({hint}presets: {', '.join(preset_names())})")


def _toml_module() -> Any:
    """The TOML parser: the standard library's from Python 3.11, the ``tomli`` backport before."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli

    return tomli


def _file_value(where: str, key: str, value: Any) -> Any:
    """The value of ``key`` in config file ``where``, checked against the field's kind."""
    kind = _KINDS.get(key)
    if kind is None:
        valid = list(_KINDS)
        guess = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        nested = " (keys go at the top level: no tables)" if isinstance(value, dict) else ""
        raise ValueError(f"{where}: unknown key {key!r}{nested} ({hint}valid keys: {', '.join(valid)})")
    if isinstance(value, str):
        try:
            coerced = _coerce(key, value)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
    elif _native_fits(kind, value):
        try:
            coerced = float(value) if kind == "float" else value
        except OverflowError:  # an integer of 400 digits
            raise ValueError(f"{where}: {key} = {value!r:.40} is too large for a number of its kind") from None
    else:
        raise ValueError(f"{where}: {key} = {value!r} has the wrong type (expected {_expected(key)})")
    if key == "codec":
        # Config checks codec names when it is built too; here a typo in a file is reported
        # with the file's name and line, as the other values are.
        from .codecs import known_codec_names

        if coerced not in known_codec_names():
            raise ValueError(f"{where}: codec={coerced!r} is invalid (expected one of: "
                             f"{', '.join(known_codec_names())})")
    return coerced


def _native_fits(kind: str, value: Any) -> bool:
    """Whether a non-string TOML value has the type a field of ``kind`` takes (bool is not a
    number here, though Python makes it an int)."""
    if isinstance(value, bool):
        return kind in ("bool", "switch")
    if kind in ("size", "int"):
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    return False


def _expected(name: str) -> str:
    """What field ``name`` accepts, in words, for error messages."""
    expected = _EXPECTED[_KINDS[name]]
    if name in _CHOICES:
        expected = f"one of: {', '.join(_CHOICES[name])}"
    return f"{expected} or \"none\"" if name in _OPTIONAL else expected


def _coerce(name: str, text: str) -> Any:
    """The value of field ``name`` from its text form: an environment variable's value, or a
    string in a config file. Raises ``ValueError`` naming the field and what it accepts."""
    kind = _KINDS[name]
    lowered = text.strip().lower()
    if name in _OPTIONAL and lowered in ("", "none"):
        return None
    try:
        if kind == "size":
            return parse_size(text)
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is invalid (expected {_expected(name)})") from None
    if kind in ("bool", "switch"):
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        if kind == "switch" and lowered == "auto":
            return "auto"
        raise ValueError(f"{name}={text!r} is invalid (expected {_expected(name)}, or as text one of: "
                         f"{', '.join(_TRUE + _FALSE)}{', auto' if kind == 'switch' else ''})")
    return text
