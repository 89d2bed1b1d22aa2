"""The GPU pipeline: an encoder (save) and a decoder (restore) over one staging-ring type.

- ``staging``: ``StagingRing`` (one device allocation of two-area slots) and its sizing against
  ``max_staging_bytes`` and nvCOMP's measured scratch;
- ``worker``: ``BatchWorker``, the thread that runs queued jobs in batches on the device;
- ``encoder``: ``GpuEncoder``, the ``Encoder`` the save driver uses with kvikio;
- ``decoder``: ``GpuDecoder``, the ``Decoder`` the restore driver uses with kvikio.

Both take a ``codecs.device.DeviceBackend``: ``CudaDevice`` (CuPy, nvCOMP, GPU CRC-32C) by
default, a NumPy stand-in in the CPU test suite. Importing this package imports neither CuPy nor
nvCOMP.
"""

from .decoder import GpuDecoder
from .encoder import GpuEncoder, RoundedArraySource
from .staging import (
    DECODE_SCRATCH,
    ENCODE_SCRATCH,
    STAGING_RING_SHARE,
    StagingRing,
    decode_scratch,
    encode_scratch,
    ring_slots,
)

__all__ = [
    "DECODE_SCRATCH", "ENCODE_SCRATCH", "STAGING_RING_SHARE", "GpuDecoder", "GpuEncoder", "RoundedArraySource",
    "StagingRing", "decode_scratch", "encode_scratch", "ring_slots",
]
