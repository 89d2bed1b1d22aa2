"""Host codecs, byte-compatible with nvCOMP's RAW bitstreams, and the byte-plane transform.

- ``zstd/1``: one standard zstd frame (python-zstandard; nvCOMP Zstd RAW reads and writes these).
- ``lz4/1``: one raw LZ4 block, no size prefix (``lz4.block`` with ``store_size=False``; nvCOMP
  LZ4 RAW).
- ``deflate/1``: raw deflate, RFC 1951, no zlib/gzip wrapper (``zlib`` with ``wbits=-15``;
  nvCOMP Deflate RAW).
- ``none/1``: the bytes as they are.

Every compressor object is per thread: python-zstandard's and zlib's objects are not safe to share
between threads, and the pipeline calls codecs from a pool.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

import lz4.block
import numpy as np
import zstandard

from ..format.index import XOR_BASE
from .base import Codec, Transform, host_codec

DEFAULT_ZSTD_LEVEL = 3
"""zstd level of ``ZstdCodec()`` (the library's default)."""
HOST_ZSTD_LEVEL = 1
"""zstd level of the CPU engine when ``Config.level`` is None. Measured on trained-model state:
after byte planes, level 1 compresses faster *and* smaller than level 3 (1.29 vs 1.27 on the mixed
bf16/fp32 state; level 3's extra match search finds little in mantissa noise and costs more in
literals than it saves)."""
PLANES_ZSTD_HASH_LOG = 6
"""Match-table size (log2 entries) of the zstd compressor for byte-planed chunks at the default
level: zstd's smallest. Byte planes of floats are mostly Huffman-coded mantissa noise, in which a
big match table only finds spurious short matches; measured on each part of a trained
mixed-precision state (4 MiB chunks), level 1 with hash_log 6 instead of 14 compresses 1.3-1.9x
faster and 0.5-3% smaller (bf16 weights 1.473 -> 1.513, fp32 master 1.191 -> 1.204), and on
structured data (zeros, repeats, quantized values) no worse. The frames are ordinary zstd."""


class ZstdCodec(Codec):
    """Zstandard frames; ``level`` only affects compression (decoders need no parameter)."""

    name = "zstd/1"

    def __init__(self, level: int = DEFAULT_ZSTD_LEVEL):
        self.level = level
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
            self._local.compressor = compressor
        return compressor

    def encode(self, data: np.ndarray) -> Any:
        """One zstd frame of ``data``'s bytes at this codec's level (one compressor per thread)."""
        return self._compressor().compress(data.data)

    def decode(self, data: Any, raw_length: int) -> Any:
        """The ``raw_length`` bytes of the zstd frame ``data``; ``ValueError`` where the frame
        declares or decodes to another length."""
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        # A frame that states its content size is decoded into that many bytes whatever
        # max_output_size says: refuse a size other than the chunk's before anything is allocated
        # (a 16 KiB hostile file could otherwise claim gigabytes).
        declared = zstandard.frame_content_size(data)
        if declared >= 0 and declared != raw_length:
            raise ValueError(f"zstd frame declares {declared} bytes, expected {raw_length}")
        # max_output_size covers frames without a content size (nvCOMP may omit it); 0 would mean
        # "no bound" and make an empty frame without a content size undecodable.
        out = decompressor.decompress(data, max_output_size=max(raw_length, 1))
        if len(out) != raw_length:
            raise ValueError(f"zstd frame decoded to {len(out)} bytes, expected {raw_length}")
        return out


class PlanesZstdCodec(ZstdCodec):
    """``zstd/1`` frames for byte-planed chunks: level ``HOST_ZSTD_LEVEL`` with a small match
    table (``PLANES_ZSTD_HASH_LOG``). Decoding is plain zstd, like every ``zstd/1`` frame."""

    def __init__(self) -> None:
        super().__init__(HOST_ZSTD_LEVEL)
        self._params = zstandard.ZstdCompressionParameters.from_level(
            HOST_ZSTD_LEVEL, hash_log=PLANES_ZSTD_HASH_LOG, write_content_size=1)

    def _compressor(self) -> zstandard.ZstdCompressor:
        # Overrides ZstdCodec's per-thread compressor factory (not ``encode``), so everything
        # that wraps ZstdCodec.encode also wraps this codec's encodes.
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(compression_params=self._params)
            self._local.compressor = compressor
        return compressor


class Lz4Codec(Codec):
    """Raw LZ4 blocks without a size prefix (the decoder is told the raw length)."""

    name = "lz4/1"

    def encode(self, data: np.ndarray) -> Any:
        """An LZ4 block of ``data`` without a size header (the index records the chunk's raw
        length)."""
        return lz4.block.compress(data, store_size=False)

    def decode(self, data: Any, raw_length: int) -> Any:
        """The ``raw_length`` bytes of the LZ4 block ``data``; ``ValueError`` where it is invalid or
        decodes to another length."""
        if raw_length == 0:
            return b""
        try:
            out = lz4.block.decompress(data, uncompressed_size=raw_length)
        except lz4.block.LZ4BlockError as err:
            raise ValueError(f"invalid LZ4 block: {err}") from err
        if len(out) != raw_length:
            raise ValueError(f"LZ4 block decoded to {len(out)} bytes, expected {raw_length}")
        return out


class DeflateCodec(Codec):
    """Raw deflate streams (RFC 1951)."""

    name = "deflate/1"

    def __init__(self, level: int = 6):
        self.level = level

    def encode(self, data: np.ndarray) -> Any:
        """A raw deflate stream of ``data`` (no zlib header or checksum) at this codec's level."""
        compressor = zlib.compressobj(self.level, zlib.DEFLATED, -15)
        return compressor.compress(data.data) + compressor.flush()

    def decode(self, data: Any, raw_length: int) -> Any:
        """The ``raw_length`` bytes of the raw deflate stream ``data``; ``ValueError`` unless it
        decodes to exactly that many bytes and ends there."""
        decompressor = zlib.decompressobj(-15)
        out = decompressor.decompress(data, raw_length)
        if len(out) != raw_length or not decompressor.eof or decompressor.unconsumed_tail:
            raise ValueError(f"deflate stream did not decode to exactly {raw_length} bytes")
        return out


class NoneCodec(Codec):
    """Stores the bytes unchanged; used when compression does not pay, and for ``codec="none"``."""

    name = "none/1"

    def encode(self, data: np.ndarray) -> Any:
        """``data`` itself: the chunk is stored as it is."""
        return data

    def decode(self, data: Any, raw_length: int) -> Any:
        """``data`` itself, once it is checked to hold ``raw_length`` bytes (``ValueError``
        otherwise)."""
        if len(memoryview(data).cast("B")) != raw_length:
            raise ValueError(f"stored chunk has {len(data)} bytes, expected {raw_length}")
        return data


class BytePlanes(Transform):
    """Groups the bytes of each ``width``-byte scalar by significance, most significant first.

    For little-endian element bytes ``b0 b1 .. b{w-1}`` (b{w-1} holding sign and exponent), the
    output is every element's ``b{w-1}``, then every ``b{w-2}``, ... then every ``b0``. Sign and
    exponent bytes of trained weights repeat a lot; separated from the noisy mantissa bytes they
    compress well, which is the point.

    ``forward`` and ``inverse`` are ``planes_forward`` and ``planes_inverse``, which compute
    exactly the bytes of the strided-copy definition (``planes_forward_reference``,
    ``planes_inverse_reference``) with whole-word shifts.
    """

    name = "byteplanes/1"

    def forward(self, data: np.ndarray, params: dict[str, Any]) -> np.ndarray:
        """``planes_forward`` of ``data`` at ``params["width"]``: the most significant byte of every
        element first."""
        return planes_forward(data, params.get("width"))

    def inverse(self, data: np.ndarray, params: dict[str, Any]) -> np.ndarray:
        """``planes_inverse`` of ``data`` at ``params["width"]``: the element bytes back in order,
        in a new array."""
        return planes_inverse(data, params.get("width"))

    def inverse_into(self, data: np.ndarray, params: dict[str, Any], out: np.ndarray) -> np.ndarray:
        """The words assembled straight in ``out`` (no array of its own, no copy after)."""
        return planes_inverse(data, params.get("width"), out)


def _width(data: np.ndarray, params: dict[str, Any]) -> int:
    width = params.get("width")
    if not isinstance(width, int) or width not in (2, 4, 8) or data.size % width:
        raise ValueError(f"byte planes of width {width!r} do not fit {data.size} bytes")
    return width


def planes_forward_reference(data: np.ndarray, width: Any) -> np.ndarray:
    """The definition of the forward transform: a strided byte copy (slow; tests compare to it)."""
    width = _width(data, {"width": width})
    return np.ascontiguousarray(data.reshape(-1, width)[:, ::-1].T).reshape(-1)


def planes_inverse_reference(data: np.ndarray, width: Any) -> np.ndarray:
    """The definition of the inverse transform: a strided byte copy (slow; tests compare to it)."""
    width = _width(data, {"width": width})
    return np.ascontiguousarray(data.reshape(width, -1)[::-1].T).reshape(-1)


_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
PLANES_BLOCK_BYTES = 1 << 20
"""Input bytes per block of the word-wise forward transform: a block's words and its shifted copy
stay in cache across the ``width`` passes. Smaller blocks pay numpy's per-call overhead, a whole
chunk at once pays several times over in the temporary's page faults (docs/performance.md,
"Save and load on the CPU", "Byte planes on the CPU")."""


def planes_forward(data: np.ndarray, width: Any) -> np.ndarray:
    """``planes_forward_reference`` (the same bytes), splitting whole little-endian words with
    shifts and truncating casts, one cache-sized block at a time, instead of a strided byte copy.
    Width 8 keeps the strided copy, which measured as fast. Invalid parameters raise the
    reference's ``ValueError``."""
    width = _width(data, {"width": width})
    if width == 8:
        return planes_forward_reference(data, width)
    data = np.ascontiguousarray(data).reshape(-1)
    count = data.size // width
    out = np.empty(data.size, dtype=np.uint8)
    if count == 0:
        return out
    planes = out.reshape(width, count)
    words = data.view(_WORDS[width])
    block = PLANES_BLOCK_BYTES // width
    scratch = np.empty(min(count, block), dtype=words.dtype)
    for start in range(0, count, block):
        stop = min(count, start + block)
        chunk, shifted = words[start:stop], scratch[:stop - start]
        for k in range(width - 1):  # plane k holds byte width-1-k of every word
            np.right_shift(chunk, 8 * (width - 1 - k), out=shifted)
            np.copyto(planes[k, start:stop], shifted, casting="unsafe")
        np.copyto(planes[width - 1, start:stop], chunk, casting="unsafe")
    return out


def planes_inverse(data: np.ndarray, width: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``planes_inverse_reference`` (the same bytes), assembling whole words with shifts and ors
    instead of a strided byte copy, which is several times slower at widths 2 and 4
    (docs/performance.md, "Byte planes on the CPU"). ``out``: a contiguous uint8 array of ``data``'s
    length to write into (a restore's destination) instead of a new one. Invalid parameters raise
    the reference's ``ValueError``, before anything is written."""
    width = _width(data, {"width": width})
    data = np.ascontiguousarray(data).reshape(-1)
    count = data.size // width
    if out is None:
        out = np.empty(data.size, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or out.size != data.size or not out.flags.c_contiguous:
        raise ValueError(f"byte planes of {data.size} bytes cannot fill a {out.dtype}{list(out.shape)} array")
    words = out.view(_WORDS[width])
    planes = data.reshape(width, count)
    np.copyto(words, planes[0], casting="unsafe")
    for k in range(1, width):
        words <<= 8
        words |= planes[k]
    return out


BYTE_PLANES = BytePlanes()


class XorBase(Transform):
    """``xorbase/1``: the chunk holds element bytes XORed with the base checkpoint's.

    Identity at the chunk level: undoing it needs the base's bytes of the arrays the chunk's
    segments map to, which a chunk does not know; the restore pipeline applies the XOR as it
    writes each array's bytes (``gdsckpt.state.delta.XorTarget``) and the save pipeline as it reads
    them (``XorSource``). Registered so that decoding a delta chunk (``verify``) knows the name.
    """

    name = XOR_BASE

    def forward(self, data: np.ndarray, params: dict[str, Any]) -> np.ndarray:
        """``data`` unchanged: the save pipeline XORs the bytes with the base as it reads them
        (``XorSource``)."""
        return data

    def inverse(self, data: np.ndarray, params: dict[str, Any]) -> np.ndarray:
        """``data`` unchanged: the restore pipeline XORs the bytes with the base as it writes them
        (``XorTarget``)."""
        return data


def host_encoder(name: str, level: int | None) -> Codec:
    """The CPU engine's compressor for a codec by user-facing name (from the registry), with the
    configured compression level where it has one (zstd without one: ``HOST_ZSTD_LEVEL``)."""
    if name == "zstd":
        return ZstdCodec(HOST_ZSTD_LEVEL if level is None else level)
    if name == "deflate" and level is not None:
        return DeflateCodec(min(9, max(0, level)))
    return host_codec(name)  # CodecUnavailableError for a GPU-only codec, naming the portable ones


def host_planes_encoder(name: str, level: int | None) -> Codec:
    """The CPU engine's compressor for byte-planed chunks: ``PlanesZstdCodec`` for zstd at the
    default level, else the same as ``host_encoder``."""
    return PlanesZstdCodec() if name == "zstd" and level is None else host_encoder(name, level)
