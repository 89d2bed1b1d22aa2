"""Codecs and transforms: the interface, the one registry, the host (CPU) implementations, and
the device twins of the transforms.

Every codec of the package is registered below, once, with the implementations it has: a CPU
class, an nvCOMP algorithm, or both (``CodecSpec``). The CPU engine, the GPU engines
(``gdsckpt.pipeline.gpu``) and ``codec="auto"`` all look codecs up here. GPU implementations
(``nvcomp``, ``nvcomp_c``, ``device.CudaDevice``) import nvCOMP and CuPy lazily.
"""

from . import cpu as _cpu
from .base import (
    CONVERT_TO_PORTABLE,
    PORTABLE_CODECS,
    Chain,
    Codec,
    CodecSpec,
    Transform,
    codec_spec,
    gpu_codec_by_versioned,
    gpu_codec_names,
    host_codec,
    known_codec_names,
    register_codec,
    register_transform,
    registered_codecs,
    transform,
    versioned_name,
)
from .cpu import (
    BYTE_PLANES,
    DEFAULT_ZSTD_LEVEL,
    HOST_ZSTD_LEVEL,
    ZstdCodec,
    host_encoder,
    host_planes_encoder,
)
from .nvcomp import BITCOMP_LOSSY, MAX_CHUNK_BYTES

for _spec in (
    CodecSpec("zstd/1", "zstd", host=_cpu.ZstdCodec, nvcomp_algorithm="Zstd"),
    CodecSpec("lz4/1", "lz4", host=_cpu.Lz4Codec, nvcomp_algorithm="LZ4"),
    CodecSpec("deflate/1", "deflate", host=_cpu.DeflateCodec, nvcomp_algorithm="Deflate"),
    CodecSpec("none/1", "none", host=_cpu.NoneCodec),
    CodecSpec("nvcomp.ans/1", "ans", nvcomp_algorithm="ANS"),
    CodecSpec("nvcomp.gdeflate/1", "gdeflate", nvcomp_algorithm="GDeflate"),
    CodecSpec("nvcomp.snappy/1", "snappy", nvcomp_algorithm="Snappy"),
    CodecSpec("nvcomp.bitcomp/1", "bitcomp", nvcomp_algorithm="Bitcomp"),
    CodecSpec("nvcomp.cascaded/1", "cascaded", nvcomp_algorithm="Cascaded"),
    # written for arrays rounded by save(lossy=...), never chosen by name
    CodecSpec(BITCOMP_LOSSY, None, nvcomp_algorithm="Bitcomp"),
):
    register_codec(_spec)
register_transform(BYTE_PLANES)
register_transform(_cpu.XorBase())

__all__ = [
    "BITCOMP_LOSSY", "BYTE_PLANES", "CONVERT_TO_PORTABLE", "DEFAULT_ZSTD_LEVEL", "HOST_ZSTD_LEVEL", "MAX_CHUNK_BYTES",
    "PORTABLE_CODECS",
    "Chain",
    "Codec", "CodecSpec", "Transform", "ZstdCodec", "codec_spec", "gpu_codec_by_versioned",
    "gpu_codec_names", "host_codec", "host_encoder", "host_planes_encoder", "known_codec_names", "registered_codecs",
    "transform", "versioned_name",
]
