"""Storage-throughput benchmark: what a storage target does with checkpoint-sized writes and reads.

For each target directory (local NVMe, a shared filesystem, tmpfs, ...) and one synthetic training
state, this measures, on the same bytes and in one run:

- raw I/O through gdsckpt's own storage backends, without compression or pipeline: host memory to
  file and back (``PosixWriter`` / ``PosixReader``: O_DIRECT writes where the filesystem allows,
  buffered reads, as gdsckpt does) and, with CUDA, GPU memory to file and back (kvikio);
- ``gdsckpt.save`` / ``gdsckpt.load`` for every combination of codec, chunk size, I/O thread count
  and pipeline depth asked for (CPU engine on host memory; with CUDA also the GPU engine on GPU
  memory);
- the pipeline alone (``gdsckpt-null``): the first codec's save into ``io.NullWriter`` and load
  from ``io.PreloadedReader`` (the file in host memory), per engine;
- the baselines ``torch.save`` / ``torch.load`` and safetensors ``save_file`` / ``load_file``.

Method (the same for every side): every save is durable (fsync of the file and of its directory
inside the timing); every load is
cold as far as this host can make it (the file is fsynced and dropped from the page cache with
``posix_fadvise(DONTNEED)`` right before the read; a remote or virtual disk may still serve it from
its own cache), then repeated warm (the file now in the page cache: the tier a fast NVMe array
or a restore right after a save reads at); each configuration runs ``repeats`` times,
round-robin with the others so a slow phase of the storage hits all of them, and the median is
reported; every load is checked bit for bit against the original. GB/s are logical tensor bytes
(10**9) over wall seconds.

Every file the benchmark writes lives in a private directory inside the target
(``.gdsckpt-bench-*``), removed when the run ends, fails or is interrupted. ``recommend`` picks the
fastest lossless gdsckpt configuration of a target and ``preset_toml`` writes it as a preset of
``gdsckpt.Config`` fields.

Modules: ``results`` (settings, results, sizes), ``data`` (the synthetic state), ``host``
(targets and host facts), ``runner`` (measurements and the run), ``report`` (recommendation,
preset, plots).
"""

from __future__ import annotations

from ...errors import InsufficientSpaceError
from .data import (
    describe_data,
    flat_tensors,
    logical_bytes_for,
    same_bits,
    synthetic_state,
)
from .host import (
    available_memory,
    check_target,
    filesystem_of,
    host_info,
    resolve_device,
    space_needed,
)
from .report import (
    limit_fractions,
    preset_toml,
    recommend,
    target_slug,
    write_plots,
)
from .results import (
    BASELINES,
    COLD_READ_METHOD,
    COLD_READ_NOTE,
    DATA_DESCRIPTION,
    DEFAULT_CODECS,
    GB,
    GIB,
    GPU_MAX_CHUNK_BYTES,
    MIB,
    RATIO_TIE,
    SAVE_TIE,
    SCHEMA,
    WORKDIR_PREFIX,
    BenchReport,
    BenchSettings,
    Measurement,
    Recommendation,
    TargetResult,
    default_thread_counts,
    format_size,
    human_size,
)
from .runner import (
    INTERRUPTED,
    bench_directory,
    fsync_file,
    progress_total,
    run_benchmark,
)

__all__ = [
    "BASELINES",
    "COLD_READ_METHOD",
    "COLD_READ_NOTE",
    "DATA_DESCRIPTION",
    "DEFAULT_CODECS",
    "GB",
    "GIB",
    "GPU_MAX_CHUNK_BYTES",
    "INTERRUPTED",
    "MIB",
    "RATIO_TIE",
    "SAVE_TIE",
    "SCHEMA",
    "WORKDIR_PREFIX",
    "BenchReport",
    "BenchSettings",
    "InsufficientSpaceError",
    "Measurement",
    "Recommendation",
    "TargetResult",
    "available_memory",
    "bench_directory",
    "check_target",
    "default_thread_counts",
    "describe_data",
    "filesystem_of",
    "flat_tensors",
    "format_size",
    "fsync_file",
    "host_info",
    "human_size",
    "limit_fractions",
    "logical_bytes_for",
    "preset_toml",
    "progress_total",
    "recommend",
    "resolve_device",
    "run_benchmark",
    "same_bits",
    "space_needed",
    "synthetic_state",
    "target_slug",
    "write_plots",
]
