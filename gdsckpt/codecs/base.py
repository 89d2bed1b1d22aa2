"""The codec interface, codec chains, and the registry that maps names to implementations.

A chunk's bytes pass through a *chain*: zero or more transforms (byte planes, ...) and then one
codec. The index stores each chain as a list of stages, each a JSON object with a versioned
``name`` (``"byteplanes/1"``, ``"zstd/1"``, ``"nvcomp.ans/1"``) plus the parameters its decoder
needs. A versioned name identifies a *bitstream*, not an implementation: ``zstd/1`` is a standard
zstd frame whether the CPU (python-zstandard) or the GPU (nvCOMP) wrote it, which is what makes a
checkpoint written on the GPU readable without one.

Implementations register themselves here; GPU implementations (nvCOMP) import their libraries
lazily, so this module and the CPU codecs work on a machine without a GPU or its packages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import CodecUnavailableError, UnsupportedFormatError

PORTABLE_CODECS = ("zstd", "lz4", "deflate", "none")
"""User-facing codec names whose bitstreams both the CPU and the GPU decode."""


class Codec(ABC):
    """A lossless compressor of one chunk of bytes on the host (numpy uint8 arrays).

    ``name`` is the versioned bitstream name written to the index. GPU codecs subclass
    ``gdsckpt.codecs.nvcomp.DeviceCodec`` instead, which adds a batched device interface.
    """

    name: str
    requires_gpu: bool = False
    cpu_readable: bool = True

    @abstractmethod
    def encode(self, data: np.ndarray) -> Any:
        """Compress a contiguous uint8 array; returns a bytes-like object."""

    @abstractmethod
    def decode(self, data: Any, raw_length: int) -> Any:
        """Decompress a bytes-like object into exactly ``raw_length`` bytes (bytes-like).

        Raises ``ValueError`` (or the library's own error) when the input is not a valid stream
        of that length; the pipeline turns it into ``CorruptCheckpointError``.
        """

    def stage(self) -> dict[str, Any]:
        """The JSON stage that names this codec in a chain."""
        return {"name": self.name}


class Transform(ABC):
    """A reversible rearrangement of a chunk's bytes applied before the codec."""

    name: str

    @abstractmethod
    def forward(self, data: np.ndarray, params: dict[str, Any]) -> np.ndarray:
        """Apply to a uint8 array, returning a new contiguous uint8 array of the same length."""

    @abstractmethod
    def inverse(self, data: np.ndarray, params: dict[str, Any]) -> np.ndarray:
        """Undo ``forward``."""


@dataclass(frozen=True)
class Chain:
    """Transforms, then a codec: what the index's ``chains`` entries describe."""

    stages: tuple[tuple[tuple[str, Any], ...], ...]
    """Each stage as a sorted tuple of (field, value) pairs, so chains are hashable and comparable."""

    @classmethod
    def of(cls, *stages: dict[str, Any]) -> Chain:
        """Build a chain from JSON stage objects (the last one the codec)."""
        return cls(tuple(tuple(sorted(stage.items())) for stage in stages))

    def to_json(self) -> list[dict[str, Any]]:
        """The chain as it is written to the index."""
        return [dict(stage) for stage in self.stages]

    @property
    def codec_name(self) -> str:
        """The versioned name of the final (compressing) stage."""
        return str(dict(self.stages[-1])["name"])

    @property
    def transforms(self) -> list[dict[str, Any]]:
        """The transform stages, in the order the writer applied them."""
        return [dict(stage) for stage in self.stages[:-1]]


_CODECS: dict[str, Callable[[], Codec]] = {}
_TRANSFORMS: dict[str, Transform] = {}
_USER_NAMES: dict[str, str] = {}
_GPU_ONLY: dict[str, str] = {}
_GPU_ONLY_STREAMS: set[str] = set()
"""GPU-only bitstreams no user selects as a codec (the writer chooses them, as
``nvcomp.bitcomp-lossy/1`` for rounded arrays)."""


def register_codec(versioned_name: str, user_name: str, factory: Callable[[], Codec]) -> None:
    """Make ``factory`` the host implementation of ``versioned_name`` (``user_name`` selects it)."""
    _CODECS[versioned_name] = factory
    _USER_NAMES[user_name] = versioned_name


def register_gpu_only(user_name: str | None, versioned_name: str) -> None:
    """Record a codec that only has a GPU implementation, for clear errors on CPU-only machines;
    ``user_name`` None: a bitstream that is not a codec choice (``known_codec_names`` omits it)."""
    if user_name is None:
        _GPU_ONLY_STREAMS.add(versioned_name)
    else:
        _GPU_ONLY[user_name] = versioned_name


def register_transform(transform: Transform) -> None:
    """Register a transform under its versioned name."""
    _TRANSFORMS[transform.name] = transform


def known_codec_names() -> list[str]:
    """User-facing codec names this installation knows of (runnable here or not)."""
    return sorted(set(_USER_NAMES) | set(_GPU_ONLY) | {"auto"})


def versioned_name(user_name: str) -> str:
    """Map a user-facing codec name (``"zstd"``) to its versioned bitstream name (``"zstd/1"``)."""
    if user_name in _USER_NAMES:
        return _USER_NAMES[user_name]
    if user_name in _GPU_ONLY:
        return _GPU_ONLY[user_name]
    raise ValueError(f"unknown codec {user_name!r} (expected one of: {', '.join(known_codec_names())})")


def host_codec(name: str) -> Codec:
    """The host implementation of a codec, by user-facing or versioned name.

    Raises ``CodecUnavailableError`` naming the portable alternatives when the codec has no CPU
    implementation (GPU-only bitstreams such as ``nvcomp.ans/1``), and ``UnsupportedFormatError``
    for a versioned name this version of gdsckpt does not know.
    """
    versioned = _USER_NAMES.get(name, name)
    factory = _CODECS.get(versioned)
    if factory is not None:
        return factory()
    gpu_only = _GPU_ONLY.get(name) or (versioned if versioned in {*_GPU_ONLY.values(), *_GPU_ONLY_STREAMS}
                                       else None)
    if gpu_only is not None:
        raise CodecUnavailableError(
            f"codec {name!r} ({gpu_only}) needs an NVIDIA GPU with nvCOMP and has no CPU decoder; "
            f"portable codecs that run anywhere: {', '.join(PORTABLE_CODECS)}"
        )
    if "/" in name:
        raise UnsupportedFormatError(
            f"codec {name!r} is not known to this version of gdsckpt "
            f"(known: {', '.join(sorted(_CODECS) + sorted({*_GPU_ONLY.values(), *_GPU_ONLY_STREAMS}))}); "
            f"upgrade gdsckpt"
        )
    raise ValueError(f"unknown codec {name!r} (expected one of: {', '.join(known_codec_names())})")


def transform(name: str) -> Transform:
    """The transform registered under a versioned name."""
    try:
        return _TRANSFORMS[name]
    except KeyError:
        raise UnsupportedFormatError(
            f"transform {name!r} is not known to this version of gdsckpt "
            f"(known: {', '.join(sorted(_TRANSFORMS))}); upgrade gdsckpt"
        ) from None
