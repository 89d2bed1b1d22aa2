"""``codec="auto"`` on the GPU: pick the codec by measured storage speed against codec speed.

The nvCOMP checkpointing guide's rule of thumb (Zstd for storage of ~5-10 GB/s, gANS above
~15 GB/s) is the special case of one comparison: a save cannot run faster than the codec
compresses, nor faster than storage speed times the compression ratio, so the codec with the
larger ``min(codec_speed, storage_speed * ratio)`` wins. gdsckpt evaluates that comparison with
numbers measured where it runs instead of the rule's fixed thresholds:

- storage speed: one durable write of ``PROBE_BYTES`` into the checkpoint's directory, cached per
  filesystem (``$XDG_CACHE_HOME/gdsckpt/storage.json``, keyed by device number) so it is paid once;
  ``Config.storage_gbps`` overrides it;
- ratios: each candidate compresses a sample of the state (the first MiBs of its largest arrays)
  on the GPU, in the mode the engine would use (typed ANS; byte planes for Zstd where they help);
- codec speeds: nvCOMP compression throughput measured on a data-centre GPU (``CODEC_GBPS``, the
  lower end of the measured ranges in docs/performance.md).

On storage of ~2 GB/s (a virtual disk) the comparison picks whichever codec compresses the state
more; on a 25-50 GB/s NVMe array it picks ANS, which Zstd (8-14 GB/s) cannot keep up with.

The codec speeds hold only when the engine can batch: a candidate whose nvCOMP scratch leaves the
staging budget (``Config.max_staging_bytes``) fewer than ``MIN_BATCH_SLOTS`` ring slots is left
out before anything is sampled (``runnable_candidates``). nvCOMP's Zstd holds ~1.1 GiB of
scratch for 16 MiB chunks, so inside the default 1 GiB budget it compresses one or two chunks per
call and saves at 0.05-0.07 GB/s (measured with ``gdsckpt bench`` and on a 0.94 GB state where
``auto`` had picked it by its ratio: 13.9 s for a save ANS makes in 0.5 s). With one candidate
left there is nothing to compare: no storage probe, no sample.

The same comparison also weighs the engines (``choose_engine``). For CUDA state of at least
``WEIGH_MIN_BYTES`` the CPU engine's portable codec (byte planes + zstd on the codec threads) is a
candidate beside the GPU's best: its speed is ``min(measured host speed, storage speed x its
ratio)``, where the host speed is one codec thread's measured pace on the sample (reading the bytes
to host memory, byte planes and zstd, as the engine runs them) times the codec threads the host
has, times ``CPU_PARALLEL_EFFICIENCY``. The portable file wins whenever it is within
``PORTABLE_MARGIN`` of the GPU's speed: on a disk that holds both back it costs nothing and any
machine reads it; on a fast tier only the GPU keeps up and ANS stays. Below ``WEIGH_MIN_BYTES``
the save is fixed costs, which the storage probe and the sample would outweigh, and the GPU
engine's choice stands; so it does for a delta (its XOR sources are read on the GPU) and for a
background save (``save_async``: the CPU engine's threads would compete with training).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..format import align_up
from ..io import posix
from ..io.pools import DRAIN_TIMEOUT

logger = logging.getLogger(__name__)

CODEC_GBPS = {"ans": 160.0, "zstd": 8.0}
"""nvCOMP compression throughput (GB/s of input), lower end of the ranges measured on a
data-centre GPU (docs/performance.md)."""
CANDIDATES = ("ans", "zstd")
MIN_BATCH_SLOTS = 8
"""Ring slots a candidate's compression batches need for its ``CODEC_GBPS`` to hold."""
PROBE_BYTES = 256 << 20
PROBE_FREE_SHARE = 4
"""A probe takes at most 1/this of the filesystem's free space (a nearly full disk is measured
with a smaller probe instead of being filled)."""
MIN_PROBE_BYTES = 16 << 20
"""The smallest probe worth timing: where the free space allows less, the speed is not measured."""
SAMPLE_BYTES_PER_ARRAY = 2 << 20
SAMPLE_ARRAYS = 4


def _zstd_host(data: Any) -> bytes:
    import zstandard

    from ..codecs.cpu import DEFAULT_ZSTD_LEVEL

    return zstandard.ZstdCompressor(level=DEFAULT_ZSTD_LEVEL).compress(data)


HOST_SAMPLED = {"zstd": _zstd_host}
"""Candidates whose ratio is sampled with the CPU library of the same bitstream instead of
nvCOMP: nvCOMP's Zstd holds 1.1-1.4 GiB of scratch for any batch (``ENCODE_SCRATCH``), and
sampling it on the GPU made an 8.76 GiB benchmark save peak at 1108 MiB beyond the state against
a 1 GiB budget (the ring itself: 874 MiB + 34 MiB). The CPU ratio at the default level is close
to nvCOMP's (same format, similar match finding) and the sample is 8 MiB at most."""


def choose_codec(storage_gbps: float, ratios: dict[str, float],
                 codec_gbps: dict[str, float] | None = None) -> str:
    """The candidate with the highest ``min(codec speed, storage speed x ratio)``; ties go to
    the better ratio (fewer bytes stored)."""
    speeds = codec_gbps or CODEC_GBPS
    if not ratios:
        raise ValueError("no candidate codecs to choose from")
    return max(ratios, key=lambda name: (min(speeds[name], storage_gbps * ratios[name]), ratios[name]))


PORTABLE_MARGIN = 0.05
"""The portable CPU engine is chosen when its predicted speed is at least ``1 - PORTABLE_MARGIN``
of the GPU engine's: a file any machine reads is worth that much."""
CPU_PARALLEL_EFFICIENCY = 0.8
"""Fraction of ``threads x one thread's pace`` the CPU engine is predicted to reach (memory
bandwidth and the device-to-host copies are shared by its threads)."""
WEIGH_MIN_BYTES = 256 << 20
"""CUDA states smaller than this keep the GPU engine's choice without weighing the CPU engine."""


@dataclass(frozen=True)
class HostCodecPace:
    """The CPU engine's ``codec`` measured on a sample: one thread's raw bytes per second
    (reading the bytes to host memory included) and the ratio it reached."""

    codec: str
    gbps_per_thread: float
    ratio: float


def measure_host_codec(sources: list[Any], codec: str = "zstd", level: int | None = None,
                       byte_planes: str = "auto") -> HostCodecPace:
    """Run the CPU engine's compressors on the sample ``sample_ratios`` takes (the first MiBs of
    the largest arrays) on this thread, timing what one codec thread does per chunk: read the
    bytes to host memory (``host_bytes``: a device-to-host copy for CUDA state), byte planes where
    ``byte_planes`` and a smaller result call for them, compress."""
    from ..codecs.cpu import BYTE_PLANES, host_encoder, host_planes_encoder

    plain_codec, planes_codec = host_encoder(codec, level), host_planes_encoder(codec, level)
    raw = stored = 0
    seconds = 0.0
    for source, take in _sample_spans(sources):
        started = time.perf_counter()
        data = np.ascontiguousarray(source.host_bytes(0, take))
        read = time.perf_counter() - started
        variants = []
        width = source.plane_width
        if byte_planes != "always" or width not in (2, 4, 8):
            started = time.perf_counter()
            variants.append((len(plain_codec.encode(data)), time.perf_counter() - started))
        if byte_planes != "never" and width in (2, 4, 8):
            started = time.perf_counter()
            size = len(planes_codec.encode(BYTE_PLANES.forward(data, {"width": width})))
            variants.append((size, time.perf_counter() - started))
        size, spent = min(variants)
        raw += take
        stored += min(size, take)
        seconds += read + spent
    if not raw:
        return HostCodecPace(codec, math.inf, 1.0)
    return HostCodecPace(codec, raw / max(seconds, 1e-9) / 1e9, raw / max(stored, 1))


HOST_CODEC_CEILING_GBPS = 2.0
"""An upper bound on one CPU codec thread's pace for the CPU engine's portable zstd (byte planes
and zstd level 1, device-to-host copy included): about twice the fastest measured (docs/performance.md)."""


def cpu_could_win(storage_gbps: float, gpu_codec: str, gpu_ratio: float, threads: int) -> bool:
    """Whether the CPU engine could be chosen at all, before its pace is measured: at
    ``HOST_CODEC_CEILING_GBPS`` per thread it would still have to reach ``1 - PORTABLE_MARGIN`` of
    the GPU's predicted speed. On a null sink or a tier far faster than the CPU compresses it
    cannot, and the sample that measures it (tens of milliseconds) is skipped."""
    gpu = min(CODEC_GBPS[gpu_codec], storage_gbps * gpu_ratio)
    return threads * HOST_CODEC_CEILING_GBPS * CPU_PARALLEL_EFFICIENCY >= (1 - PORTABLE_MARGIN) * gpu


def choose_engine(storage_gbps: float, gpu_codec: str, gpu_ratio: float, host: HostCodecPace,
                  threads: int) -> tuple[str, dict[str, Any]]:
    """``"gpu"`` or ``"cpu"`` and the figures behind it (module docstring): each engine's
    predicted save speed, ``min(codec speed, storage speed x ratio)``, the CPU engine's codec
    speed being ``host.gbps_per_thread x threads x CPU_PARALLEL_EFFICIENCY``; the CPU engine wins
    at ``1 - PORTABLE_MARGIN`` of the GPU's speed or more."""
    gpu = min(CODEC_GBPS[gpu_codec], storage_gbps * gpu_ratio)
    cpu_codec = host.gbps_per_thread * threads * CPU_PARALLEL_EFFICIENCY
    cpu = min(cpu_codec, storage_gbps * host.ratio)
    chosen = "cpu" if cpu >= (1 - PORTABLE_MARGIN) * gpu else "gpu"
    return chosen, {
        "predicted_gbps": {f"gpu:{gpu_codec}": gpu, f"cpu:{host.codec}": cpu},
        "cpu_codec_gbps": cpu_codec, "cpu_threads": threads, "cpu_ratio": host.ratio,
        "margin": PORTABLE_MARGIN,
    }


def batch_slots(max_staging_bytes: int, chunk_bytes: int) -> dict[str, int]:
    """Each candidate -> the staging ring slots the GPU engine would give it beside its nvCOMP
    scratch within ``max_staging_bytes`` for ``chunk_bytes`` chunks (``gpu.ring_slots``, at
    least its minimum of 2; a slot holds a chunk and its stream, about two chunks)."""
    from .gpu.staging import encode_scratch, ring_slots

    return {name: ring_slots(max_staging_bytes, 2 * chunk_bytes, encode_scratch([name], chunk_bytes))
            for name in CANDIDATES}


def runnable_candidates(max_staging_bytes: int, chunk_bytes: int) -> tuple[list[str], dict[str, str]]:
    """The candidates ``auto`` may choose under this staging budget, and why each other one was
    left out (module docstring); ANS, whose scratch is 32 MiB, is always kept."""
    keep, left_out = [], {}
    for name, slots in batch_slots(max_staging_bytes, chunk_bytes).items():
        if slots >= MIN_BATCH_SLOTS or name == "ans":
            keep.append(name)
        else:
            left_out[name] = (f"its nvCOMP scratch leaves {slots} staging slots of {MIN_BATCH_SLOTS} needed within "
                              f"max_staging_bytes={max_staging_bytes} (raise it to let auto consider {name})")
    return keep, left_out


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdsckpt" / "storage.json"


def measure_storage_gbps(directory: Path, nbytes: int | None = None, timeout: float = DRAIN_TIMEOUT) -> float:
    """Durable write speed into ``directory`` (GB/s): aligned host writes with O_DIRECT where the
    filesystem allows it, fsync included (waited for at most ``timeout`` seconds:
    ``TimeoutError``, and nothing is cached); the probe file is removed afterwards."""
    from ..io.base import aligned_empty

    size = align_up(PROBE_BYTES if nbytes is None else nbytes)
    buffer = aligned_empty(size)
    # Incompressible within any block a filesystem compresses (ZFS, btrfs: up to 1 MiB), so it
    # is measured on the bytes it writes; one random 4 MiB block repeated, because drawing 256 MiB
    # of random bytes took longer than writing them.
    block = np.random.default_rng(0).integers(0, 256, min(size, 4 << 20), dtype=np.uint8)
    for start in range(0, size, block.size):
        piece = buffer[start:start + block.size]
        piece[:] = block[:piece.size]
    path = directory / f".gdsckpt-storage-probe-{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        try:
            fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            fd = os.open(path, flags, 0o600)
        started = time.perf_counter()
        try:
            posix.pwrite_all(fd, buffer, 0)
            posix.fsync_within(fd, timeout, f"the storage probe {str(path)!r}")
        except TimeoutError:
            raise  # the descriptor is the running fsync's
        except BaseException:
            os.close(fd)
            raise
        seconds = time.perf_counter() - started
        os.close(fd)
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    return size / max(seconds, 1e-9) / 1e9


def read_cache() -> dict[str, Any]:
    """The measurement cache (``$XDG_CACHE_HOME/gdsckpt/storage.json``); empty where it is missing
    or unreadable (a cache that is not a small JSON object is measured anew)."""
    try:
        known = json.loads(posix.read_small_file(_cache_file(), 1 << 20))
    except (OSError, ValueError, CheckpointError):
        return {}
    return known if isinstance(known, dict) else {}


def update_cache(key: str, entry: dict[str, Any]) -> None:
    """Set ``key`` in the measurement cache (read, modified and replaced whole; an unwritable cache
    only costs a new measurement next time)."""
    known = read_cache()
    known[key] = {**entry, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    cache = _cache_file()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        posix.write_atomically(cache, json.dumps(known, indent=1).encode("utf-8"), fsync=False)
    except OSError:
        pass


_MEASURED: dict[tuple[str, str], float | None] = {}
"""(cache file, device number) -> this process's measurement, None where the probe could not run:
a cache that cannot be written (a read-only home) must not cost a 256 MiB probe per save, nor a
disk too full for the probe one failed probe per save."""
_MEASURED_LOCK = threading.Lock()
_PROBING: dict[tuple[str, str], threading.Lock] = {}
"""One lock per storage, held for its probe."""


def _new_locks_after_fork() -> None:
    """In a forked child, the locks start free: one another thread held at the fork (a probe
    running) would never be released there, and the child's next ``auto`` save waited for good."""
    global _MEASURED_LOCK, _PROBING
    _MEASURED_LOCK, _PROBING = threading.Lock(), {}


os.register_at_fork(after_in_child=_new_locks_after_fork)


def storage_gbps(directory: Path, override: float | None = None, timeout: float = DRAIN_TIMEOUT) -> float | None:
    """The storage speed of ``directory``: ``override``, else this process's, the cached or a new
    measurement (``measure_storage_gbps``, its fsync waited for at most ``timeout`` seconds).

    None where it cannot be measured: the free space holds no probe of ``MIN_PROBE_BYTES`` within
    ``1 / PROBE_FREE_SHARE`` of it, or the probe's write failed (a full disk, a file size limit, a
    quota). A save never fails for its probe: ``auto`` then decides without the storage's speed
    (callers). The failure is remembered for this process only: a later one measures again. None
    too where another thread's probe of the same storage runs past ``timeout``."""
    if override is not None:
        return float(override)
    key = str(os.stat(directory).st_dev)
    memo = (str(_cache_file()), key)
    with _MEASURED_LOCK:
        if memo in _MEASURED:
            return _MEASURED[memo]
        probing = _PROBING.setdefault(memo, threading.Lock())
    # One probe per storage at a time: two first saves in one process wrote one probe file (its
    # name is the process's) at once, and each timed the other's writes too. Another thread's
    # probe is waited for as long as the save's own would be.
    if not probing.acquire(timeout=timeout):
        logger.info("another thread's storage probe in %s ran past %s s: codec='auto' goes on without "
                    "the storage's speed", directory, timeout)
        return None
    try:
        with _MEASURED_LOCK:
            if memo in _MEASURED:
                return _MEASURED[memo]
        return _measure_once(directory, key, memo, timeout)
    finally:
        probing.release()


def _measure_once(directory: Path, key: str, memo: tuple[str, str], timeout: float) -> float | None:
    """``storage_gbps``'s cached figure or new probe, under the storage's probe lock."""
    entry = read_cache().get(key)
    if isinstance(entry, dict) and isinstance(entry.get("gbps"), (int, float)) and entry["gbps"] > 0:
        return float(entry["gbps"])
    speed: float | None = None
    try:
        free = os.statvfs(directory)
        size = min(PROBE_BYTES, free.f_bavail * free.f_frsize // PROBE_FREE_SHARE)
        if size >= min(MIN_PROBE_BYTES, PROBE_BYTES):
            speed = measure_storage_gbps(directory, size, timeout=timeout)
    except TimeoutError:
        raise  # a storage that does not complete an fsync will not complete the save's either
    except OSError as err:
        logger.info("the storage probe in %s failed (%s): codec='auto' goes on without its speed", directory, err)
    with _MEASURED_LOCK:
        _MEASURED[memo] = speed
    if speed is not None:
        update_cache(key, {"gbps": speed, "path": str(directory)})
    return speed


def _sample_spans(sources: list[Any]) -> list[tuple[Any, int]]:
    """(source, bytes) of the sample: the first ``SAMPLE_BYTES_PER_ARRAY`` (whole elements) of each
    of the ``SAMPLE_ARRAYS`` largest arrays."""
    largest = sorted((s for s in sources if s is not None and s.nbytes), key=lambda s: -s.nbytes)[:SAMPLE_ARRAYS]
    spans = []
    for source in largest:
        width = max(source.itemsize, 1)
        take = min(source.nbytes, SAMPLE_BYTES_PER_ARRAY) // width * width
        if take:
            spans.append((source, take))
    return spans


def sample_ratios(sources: list[Any], device_id: int,
                  candidates: tuple[str, ...] | list[str] = CANDIDATES) -> dict[str, float]:
    """Compression ratio of each of ``candidates`` on a sample of the largest arrays (GPU), in
    the mode the encoder would use: typed ANS (``codecs.device.ans_data_type``); the others as
    they are or as byte planes (``codecs.device.planes_forward_into``), whichever is smaller.

    The samples live in a private CuPy memory pool that is emptied before returning: the save's
    staging ring is allocated next, and sample memory left cached in the default pool would sit
    beside it, past the staging budget (measured: 187 MiB over a 921 MiB ring). The sample runs
    on a stream of its own, on ``device_id``."""
    import cupy

    from ..codecs.device import CudaDevice

    pool = cupy.cuda.MemoryPool()
    device = None
    try:
        with cupy.cuda.Device(device_id), cupy.cuda.using_allocator(pool.malloc):
            device = CudaDevice(device_id)
            return sample_ratios_on(device, sources, candidates)
    finally:
        if device is not None:
            device.close()
        pool.free_all_blocks()


def sample_ratios_on(device: Any, sources: list[Any],
                     candidates: tuple[str, ...] | list[str] = CANDIDATES) -> dict[str, float]:
    """``sample_ratios`` on a ``codecs.device.DeviceBackend`` (the GPU's, or the tests' stand-in)."""
    from ..codecs.device import ans_data_type, planes_forward_into

    spans = _sample_spans(sources)
    if not spans:
        return {name: 1.0 for name in candidates}
    samples = [(source.device_bytes(0, take), source.plane_width) for source, take in spans]
    raw = sum(s.nbytes for s, _ in samples)
    ratios = {}
    with device.on_stream():
        for name in candidates:
            stored = 0
            for data, width in samples:
                variants = [data]
                if name != "ans" and width in (2, 4, 8):
                    variants.append(planes_forward_into(data, device.empty(data.nbytes), width))
                if name in HOST_SAMPLED:
                    stored += min(min(len(HOST_SAMPLED[name](device.to_host(v))) for v in variants), data.nbytes)
                    continue
                codec = device.codec(name, ans_data_type(width) if name == "ans" else None)
                bound = codec.max_compressed_bytes(data)
                out = device.empty(bound * len(variants))
                sizes = codec.encode_into(variants, out, [i * bound for i in range(len(variants))], bound)
                stored += min(min(sizes), data.nbytes)
            ratios[name] = raw / max(stored, 1)
        device.synchronize()
    return ratios
