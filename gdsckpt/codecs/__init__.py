"""Codecs and transforms: the interface, the registry, and the host (CPU) implementations.

GPU implementations live in ``gdsckpt.codecs.nvcomp`` and import nvCOMP and CuPy lazily.
"""

from . import cpu as _cpu  # noqa: F401  (registers the host codecs)
from .base import (
    PORTABLE_CODECS, Chain, Codec, Transform, host_codec, known_codec_names, transform,
    versioned_name,
)
from .cpu import BYTE_PLANES, DEFAULT_ZSTD_LEVEL, ZstdCodec

__all__ = [
    "BYTE_PLANES", "DEFAULT_ZSTD_LEVEL", "PORTABLE_CODECS", "Chain", "Codec", "Transform",
    "ZstdCodec", "host_codec", "known_codec_names", "transform", "versioned_name",
]
