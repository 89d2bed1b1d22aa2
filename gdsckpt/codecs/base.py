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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CodecUnavailableError, NewerFormatError

PORTABLE_CODECS = ("zstd", "lz4", "deflate", "none")
CONVERT_TO_PORTABLE = "gdsckpt convert FILE COPY.gdsckpt --codec zstd writes a copy any machine can read"
"""The command that turns a file only a GPU decodes into a portable one (named in errors)."""
"""User-facing codec names whose bitstreams both the CPU and the GPU decode."""


class Codec(ABC):
    """A lossless compressor of one chunk of bytes on the host (numpy uint8 arrays).

    ``name`` is the versioned bitstream name written to the index. GPU codecs are
    ``gdsckpt.codecs.nvcomp.DeviceCodec`` (a batched device interface); whether a codec has either
    implementation is its ``CodecSpec``'s business.
    """

    name: str

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

    def inverse_into(self, data: np.ndarray, params: dict[str, Any], out: np.ndarray) -> np.ndarray:
        """``inverse`` written into ``out`` (a contiguous uint8 array of ``data``'s length) and
        returned; ``ValueError`` before anything is written when the lengths differ. This default
        copies ``inverse``'s result; a transform that can write its output in place overrides it."""
        if out.nbytes != data.nbytes:
            raise ValueError(f"{self.name} of {data.nbytes} bytes cannot fill {out.nbytes} bytes")
        np.copyto(out, self.inverse(data, params))
        return out


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


@dataclass(frozen=True)
class CodecSpec:
    """One codec of the registry: its names and the implementations this package has of it.

    Both engines and ``codec="auto"`` look codecs up here: the CPU engine builds ``host``, the GPU
    engine builds an nvCOMP codec from ``nvcomp_algorithm``. ``requires_gpu`` and
    ``cpu_readable`` follow from which implementations exist and are what the error messages of
    ``host_codec`` and the GPU encoder's codec check are decided by."""

    versioned: str
    """The bitstream name written to the index (``"zstd/1"``, ``"nvcomp.ans/1"``)."""
    user_name: str | None
    """What ``codec=`` selects it by; None for a bitstream the writer picks itself
    (``nvcomp.bitcomp-lossy/1`` for rounded arrays)."""
    host: Callable[[], Codec] | None = None
    """Factory of the CPU implementation, None when there is none."""
    nvcomp_algorithm: str | None = None
    """nvCOMP's algorithm name of the GPU implementation (RAW bitstream), None when there is none
    (``none/1`` is handled by the GPU engine without a codec)."""

    @property
    def cpu_readable(self) -> bool:
        """Whether a machine without a GPU decodes this bitstream."""
        return self.host is not None

    @property
    def requires_gpu(self) -> bool:
        """Whether only the GPU (nvCOMP) encodes and decodes it."""
        return self.host is None


_SPECS: dict[str, CodecSpec] = {}
"""Versioned name -> spec."""
_USER_NAMES: dict[str, str] = {}
"""User-facing name -> versioned name."""
_TRANSFORMS: dict[str, Transform] = {}


def register_codec(spec: CodecSpec) -> None:
    """Add a codec to the registry (``codecs/__init__`` registers every codec of the package)."""
    _SPECS[spec.versioned] = spec
    if spec.user_name is not None:
        _USER_NAMES[spec.user_name] = spec.versioned


def codec_spec(name: str) -> CodecSpec:
    """The registered spec of a codec by user-facing or versioned name.

    Raises ``UnsupportedFormatError`` for a versioned name this version of gdsckpt does not know,
    and ``ValueError`` listing the valid choices for an unknown user-facing name."""
    spec = _SPECS.get(_USER_NAMES.get(name, name))
    if spec is not None:
        return spec
    if "/" in name:
        raise NewerFormatError(
            f"codec {name!r} is not known to this version of gdsckpt "
            f"(known: {', '.join(sorted(_SPECS))}); upgrade gdsckpt"
        )
    raise ValueError(f"unknown codec {name!r} (expected one of: {', '.join(known_codec_names())})")


def registered_codecs() -> list[CodecSpec]:
    """Every registered codec, in registration order."""
    return list(_SPECS.values())


def gpu_codec_names() -> list[str]:
    """User-facing names of the codecs the GPU engine compresses with (those with an nvCOMP
    implementation), in registration order."""
    return [spec.user_name for spec in _SPECS.values()
            if spec.user_name is not None and spec.nvcomp_algorithm is not None]


def gpu_codec_by_versioned(name: str) -> CodecSpec | None:
    """The spec of a bitstream the GPU decodes with nvCOMP, or None when it has no nvCOMP
    implementation (``none/1``, or a name this version does not know)."""
    spec = _SPECS.get(name)
    return spec if spec is not None and spec.nvcomp_algorithm is not None else None


def register_transform(transform: Transform) -> None:
    """Register a transform under its versioned name."""
    _TRANSFORMS[transform.name] = transform


def check_stage_names(chains: list[list[dict[str, Any]]], used: set[int]) -> None:
    """``NewerFormatError`` naming the first stage of the chains numbered ``used`` that this
    version knows as neither a codec nor a transform (a file a newer gdsckpt wrote). Reading
    checks each name only when a chunk that uses it is decoded (docs/format.md §9.4); this checks
    a whole file at once (``CheckpointManager`` deciding whether a checkpoint is this version's)."""
    for number in sorted(used):
        for stage in chains[number]:
            name = stage["name"]
            if name not in _SPECS and name not in _TRANSFORMS:
                raise NewerFormatError(f"chain {number} names {name!r}, which this version of gdsckpt does not "
                                       f"know; upgrade gdsckpt")


def known_codec_names() -> list[str]:
    """User-facing codec names this installation knows of (runnable here or not)."""
    return sorted(set(_USER_NAMES) | {"auto"})


def versioned_name(user_name: str) -> str:
    """Map a user-facing codec name (``"zstd"``) to its versioned bitstream name (``"zstd/1"``)."""
    if user_name in _USER_NAMES:
        return _USER_NAMES[user_name]
    raise ValueError(f"unknown codec {user_name!r} (expected one of: {', '.join(known_codec_names())})")


def host_codec(name: str) -> Codec:
    """The host implementation of a codec, by user-facing or versioned name.

    Raises ``CodecUnavailableError`` naming the portable alternatives when the codec is not
    ``cpu_readable`` (GPU-only bitstreams such as ``nvcomp.ans/1``), ``UnsupportedFormatError``
    for a versioned name this version of gdsckpt does not know, and ``ValueError`` for an unknown
    user-facing name.
    """
    spec = codec_spec(name)
    if spec.host is None:
        raise CodecUnavailableError(
            f"codec {name!r} ({spec.versioned}) needs an NVIDIA GPU with nvCOMP and has no CPU decoder; "
            f"portable codecs that run anywhere: {', '.join(PORTABLE_CODECS)}. For a file written "
            f"with it, on a machine with such a GPU: {CONVERT_TO_PORTABLE}"
        )
    return spec.host()


def transform(name: str) -> Transform:
    """The transform registered under a versioned name."""
    try:
        return _TRANSFORMS[name]
    except KeyError:
        raise NewerFormatError(
            f"transform {name!r} is not known to this version of gdsckpt "
            f"(known: {', '.join(sorted(_TRANSFORMS))}); upgrade gdsckpt"
        ) from None
