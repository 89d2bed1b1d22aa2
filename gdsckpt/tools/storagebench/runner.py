"""Running the benchmark: one timed measurement, what runs on each side (raw I/O, gdsckpt, the
baselines), and the round-robin run over every target.
"""

from __future__ import annotations

import datetime as _dt
import gc
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...codecs import PORTABLE_CODECS
from ...config import Config
from ...format import align_up
from ...io import PosixReader, PosixWriter, aligned_empty
from ...io.posix import fsync_directory
from .data import describe_data, flat_tensors, logical_bytes_for, same_bits, synthetic_state
from .host import available_memory, check_target, filesystem_of, host_info, space_needed
from .results import (
    GB,
    GPU_MAX_CHUNK_BYTES,
    WORKDIR_PREFIX,
    BenchReport,
    BenchSettings,
    Measurement,
    TargetResult,
    format_size,
    human_size,
)

logger = logging.getLogger("gdsckpt")



# ---------------------------------------------------------------------------------------------
# one measurement

def fsync_file(path: Path, *, drop_cache: bool = False) -> None:
    """fsync ``path``; with ``drop_cache`` also ask the kernel to drop its cached pages (clean after
    the fsync, so they can go), so the next read goes to storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class _Case:
    """A measurement and the three steps of one repeat: save (timed), load (timed), check."""

    measurement: Measurement
    suffix: str
    save: Callable[[Path], dict[str, Any]] | None = None
    load: Callable[[Path], Any] | None = None
    check: Callable[[Any], bool] | None = None
    after_save: Callable[[Path], None] | None = None
    """Untimed, between the save and the loads (the null case writes the file its loads need)."""


INTERRUPTED = threading.Event()
"""Set by the ``bench`` command's SIGINT / SIGTERM handler before it raises ``KeyboardInterrupt``:
a library that turns the interrupt into an error of its own (torch.save's zip writer raised
``RuntimeError: ... unexpected pos`` for a Ctrl-C inside its write) would otherwise fail that one
configuration, and the run go on for seconds and exit 1 instead of 130."""


def _run_once(case: _Case, path: Path, sync: Callable[[], None]) -> None:
    """One durable save, one cold load and one warm load (the file in the page cache) of ``case``
    at ``path``; the file is removed after."""
    m = case.measurement
    assert case.save is not None and case.load is not None and case.check is not None
    loaded = None
    # No garbage-collector pass inside a timed call (memory is freed by reference counting; a full
    # gc.collect() before each call would cost ~0.2 s with torch loaded, each time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        sync()
        started = time.perf_counter()
        details = case.save(path)
        sync()
        save_seconds = time.perf_counter() - started
        if case.after_save is not None:
            case.after_save(path)
        file_bytes = path.stat().st_size
        fsync_file(path, drop_cache=True)
        sync()
        started = time.perf_counter()
        loaded = case.load(path)
        sync()
        load_seconds = time.perf_counter() - started
        exact = case.check(loaded)
        # The same file again, now in the page cache: the warm tier (a fast NVMe array stands in
        # for it where the page cache is what a restore after a save reads from).
        loaded = None
        sync()
        started = time.perf_counter()
        loaded = case.load(path)
        sync()
        warm_seconds = time.perf_counter() - started
        exact = exact and case.check(loaded)
    # one configuration failing (a codec, memory, a baseline) ends only that configuration
    except Exception as err:
        if INTERRUPTED.is_set():  # the interrupt, whatever the library made of it
            raise KeyboardInterrupt from err
        m.status, m.reason = "failed", f"{type(err).__name__}: {err}"
        logger.warning("%s failed: %s", m.label, m.reason)
        return
    finally:
        if collecting:
            gc.enable()
        del loaded
        path.unlink(missing_ok=True)
    m.save_seconds.append(save_seconds)
    m.load_seconds.append(load_seconds)
    m.warm_load_seconds.append(warm_seconds)
    m.file_bytes = file_bytes
    m.bit_exact = exact and m.bit_exact is not False
    m.backend = details.pop("backend", m.backend)
    m.details.update(details)
    fitted = (details.get("auto") or {}).get("chunk_bytes")
    if fitted is not None:  # the GPU engine saved smaller chunks than asked: its staging fits only then
        m.chunk_bytes = fitted
    if not exact:
        logger.warning("%s: the load was not bit-exact", m.label)


# ---------------------------------------------------------------------------------------------
# what runs on each side

@dataclass
class _Side:
    """The data on one device and how to wait for that device."""

    device: str
    engine: str
    state: dict[str, Any]
    tensors: dict[str, Any]
    raw: Any
    """The state's bytes, concatenated and padded to 4 KiB: host (aligned) or device memory."""
    sync: Callable[[], None]


def _host_side(state: dict[str, Any]) -> _Side:
    import torch

    tensors = flat_tensors(state)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    raw = aligned_empty(align_up(total))  # O_DIRECT wants 4 KiB-aligned buffers and lengths
    raw[total:] = 0
    offset = 0
    for tensor in tensors.values():
        count = tensor.numel() * tensor.element_size()
        raw[offset:offset + count] = tensor.reshape(-1).view(torch.uint8).numpy()
        offset += count
    return _Side("cpu", "cpu", state, tensors, raw, lambda: None)


def _gpu_side(host: _Side) -> _Side:
    import torch

    def to_cuda(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: to_cuda(value) for key, value in node.items()}
        return node.to("cuda") if isinstance(node, torch.Tensor) else node

    state = to_cuda(host.state)
    raw = torch.from_numpy(host.raw).to("cuda")
    torch.cuda.synchronize()
    return _Side("cuda", "gpu", state, flat_tensors(state), raw, torch.cuda.synchronize)


def _raw_case(side: _Side, chunk: int, threads: int, config: Config, logical: int) -> _Case:
    """Raw I/O of the state's bytes through gdsckpt's backends: blocks of ``chunk`` bytes, all
    submitted at once to ``threads`` threads, then fsync (and the atomic rename gdsckpt does)."""
    gpu = side.device == "cuda"
    m = Measurement("raw-kvikio" if gpu else "raw-posix", "raw", side.device, chunk_bytes=chunk,
                    threads=threads, logical_bytes=logical)
    size = side.raw.nbytes if not gpu else side.raw.numel()
    offsets = range(0, size, chunk)

    def save(path: Path) -> dict[str, Any]:
        if gpu:
            from ...io.kvikio import KvikioWriter

            writer: PosixWriter = KvikioWriter(path, threads=threads, task_size=config.kvikio_task_size,
                                               o_direct=config.o_direct, fsync=True)
        else:
            writer = PosixWriter(path, threads=threads, o_direct=config.o_direct, fsync=True)
        try:
            futures = [writer.submit_write(offset, side.raw[offset:offset + chunk]) for offset in offsets]
            for future in futures:
                future.result()
            writer.write_tail(size, b"")
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        return {"backend": writer.name}

    def load(path: Path) -> Any:
        if gpu:
            import torch

            from ...io.kvikio import KvikioReader

            out: Any = torch.empty(size, dtype=torch.uint8, device="cuda")
            reader: PosixReader = KvikioReader(path, threads=threads, task_size=config.kvikio_task_size)
        else:
            out = aligned_empty(size)
            reader = PosixReader(path, threads=threads)
        try:
            futures = [reader.submit_read(offset, out[offset:offset + chunk]) for offset in offsets]
            for future in futures:
                future.result()
        finally:
            reader.close()
        return out

    def check(out: Any) -> bool:
        if gpu:
            import torch

            return bool(torch.equal(out, side.raw))
        import numpy as np

        return bool(np.array_equal(out, side.raw))

    return _Case(m, ".bin", save, load, check)


def _gdsckpt_case(side: _Side, codec: str, chunk: int, threads: int, depth: int | None, base: Config,
                  logical: int) -> _Case:
    """``gdsckpt.save`` / ``gdsckpt.load`` with one configuration (durable, engine pinned)."""
    m = Measurement("gdsckpt", "gdsckpt", side.device, engine=side.engine, codec=codec, chunk_bytes=chunk,
                    threads=threads, depth=depth, logical_bytes=logical)
    case = _Case(m, ".gdsckpt")
    gpu = side.engine == "gpu"
    if not gpu and codec != "auto" and codec not in PORTABLE_CODECS:
        m.status, m.reason = "skipped", f"codec {codec!r} runs on the GPU engine only"
        return case
    if gpu and chunk > GPU_MAX_CHUNK_BYTES:
        m.status, m.reason = "skipped", (f"the GPU engine's chunks are at most "
                                         f"{format_size(GPU_MAX_CHUNK_BYTES)} (nvCOMP)")
        return case
    if gpu:
        budget = depth * chunk if depth is not None else base.max_staging_bytes
        from ...pipeline.gpu.staging import STAGING_RING_SHARE, encode_scratch

        # auto takes ANS where nothing else fits (``autotune.runnable_candidates``): its scratch decides
        nvcomp_codec = "ans" if codec == "auto" else codec
        scratch, _per_chunk = encode_scratch([nvcomp_codec], chunk)
        if scratch >= budget * STAGING_RING_SHARE:  # the save would refuse it (GpuEncoder._fit)
            m.status, m.reason = "skipped", (f"nvCOMP's {nvcomp_codec} holds {format_size(scratch)} of scratch, "
                                             f"more than the staging budget of {format_size(budget)} leaves it")
            return case
        config = base.replace(codec=codec, engine="gpu", gpu_chunk_bytes=chunk, io_threads=threads,
                              kvikio_threads=threads, max_staging_bytes=budget, fsync=True)
    else:
        budget = depth * chunk if depth is not None else max(base.max_inflight_bytes, chunk)
        config = base.replace(codec=codec, engine="cpu", chunk_bytes=chunk, io_threads=threads,
                              max_inflight_bytes=budget, fsync=True)
    m.inflight_bytes = budget

    def save(path: Path) -> dict[str, Any]:
        from ...api import save as gdsckpt_save

        report = gdsckpt_save(side.state, path, codec=codec, config=config)
        return {"backend": report.backend, "codec_ran": report.codec, "chunks": report.chunks,
                "chains": report.chains, "auto": report.auto}

    def load(path: Path) -> Any:
        from ...api import load as gdsckpt_load

        return gdsckpt_load(path, device=side.device, config=config)

    case.save, case.load = save, load
    case.check = lambda loaded: same_bits(side.tensors, flat_tensors(loaded))
    return case


def _null_case(side: _Side, codec: str, base: Config, logical: int) -> _Case:
    """The pipeline alone, storage taken out: ``gdsckpt.save`` into the null sink
    (``io.NullWriter``), ``gdsckpt.load`` from the null source (``io.PreloadedReader``: the file
    held in host memory, pinned for the GPU engine), with the default configuration of the engine
    and ``codec``. Its "cold" and "warm" loads are the same: no storage is read."""
    m = Measurement("gdsckpt-null", "null", side.device, engine=side.engine, codec=codec, logical_bytes=logical)
    case = _Case(m, ".gdsckpt")
    gpu = side.engine == "gpu"
    if not gpu and codec != "auto" and codec not in PORTABLE_CODECS:
        m.status, m.reason = "skipped", f"codec {codec!r} runs on the GPU engine only"
        return case
    config = base.replace(codec=codec, engine=side.engine, fsync=True)
    source: list[Any] = []

    def save(path: Path) -> dict[str, Any]:
        from ...api import save as gdsckpt_save
        from ...io import NullWriter

        report = gdsckpt_save(side.state, NullWriter(), codec=codec, config=config)
        return {"backend": report.backend, "codec_ran": report.codec, "chunks": report.chunks}

    def after_save(path: Path) -> None:
        from ...api import save as gdsckpt_save
        from ...io import PreloadedReader

        gdsckpt_save(side.state, path, codec=codec, config=config)
        source[:] = [PreloadedReader(path, pinned=gpu)]

    def load(path: Path) -> Any:
        from ...api import load as gdsckpt_load

        return gdsckpt_load(source[0], device=side.device, config=config)

    case.save, case.after_save, case.load = save, after_save, load
    case.check = lambda loaded: same_bits(side.tensors, flat_tensors(loaded))
    return case


def _baseline_case(side: _Side, name: str, logical: int) -> _Case:
    """``torch.save`` + fsync / ``torch.load``, or safetensors ``save_file`` + fsync / ``load_file``.
    A save fsyncs the file and its directory, as gdsckpt's does: a new file is durable only once
    its name is."""
    import torch

    m = Measurement(name, "baseline", side.device, logical_bytes=logical)
    if name == "torch":
        def save(path: Path) -> dict[str, Any]:
            with path.open("wb") as handle:
                torch.save(side.state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            fsync_directory(path.parent)  # the new file's name, as gdsckpt's save makes durable
            return {"backend": "torch.save"}

        def load(path: Path) -> Any:
            return flat_tensors(torch.load(path, map_location=side.device, weights_only=True))

        return _Case(m, ".pt", save, load, lambda loaded: same_bits(side.tensors, loaded))
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        m.status, m.reason = "skipped", "safetensors is not installed (pip install 'gdsckpt[bench]')"
        return _Case(m, ".safetensors")

    def save_st(path: Path) -> dict[str, Any]:
        save_file(side.tensors, str(path))
        fsync_file(path)
        fsync_directory(path.parent)
        return {"backend": "safetensors.save_file"}

    def load_st(path: Path) -> Any:
        loaded = load_file(str(path), device="cuda" if side.device == "cuda" else "cpu")
        if side.device == "cpu":
            # load_file maps the file on the CPU: touch one byte of every page so the timed load
            # reads what the other sides read
            for tensor in loaded.values():
                if tensor.numel():
                    int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())
        return loaded

    return _Case(m, ".safetensors", save_st, load_st, lambda loaded: same_bits(side.tensors, loaded))


def _cases(side: _Side, settings: BenchSettings, logical: int) -> list[_Case]:
    cases = [_raw_case(side, chunk, threads, settings.config, logical)
             for chunk in settings.chunk_sizes for threads in settings.threads]
    cases += [_gdsckpt_case(side, codec, chunk, threads, depth, settings.config, logical)
              for codec in settings.codecs for chunk in settings.chunk_sizes
              for threads in settings.threads for depth in settings.depths]
    if settings.codecs:
        cases.append(_null_case(side, settings.codecs[0], settings.config, logical))
    cases += [_baseline_case(side, name, logical) for name in settings.baselines]
    return cases


# ---------------------------------------------------------------------------------------------
# the run

@contextmanager
def bench_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A private directory inside ``target`` for the benchmark's files, removed with everything in
    it when the block ends, however it ends."""
    path = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=target))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _warm_up(side: _Side, directory: Path, settings: BenchSettings) -> None:
    """One small save and load first (untimed), as any process that has checkpointed once has
    done: codec libraries, nvCOMP kernels and thread pools start on first use. For codec auto,
    the storage probe runs here (it is cached per filesystem), not inside a timed save, and on the
    CPU engine the warm-up save is large enough (``MEASURED_MIN_BYTES``, where the state is) for
    auto to learn its codec's pace, as an earlier save of the process would have."""
    import torch

    from ...api import load as gdsckpt_load
    from ...api import save as gdsckpt_save
    from ...pipeline.host_auto import MEASURED_MIN_BYTES

    runnable = [c for c in settings.codecs if side.engine == "gpu" or c == "auto" or c in PORTABLE_CODECS]
    if not runnable:
        return
    first = next(iter(side.tensors.values()))
    small = {"w": first.reshape(-1)[: 1 << 20].clone()}
    config = settings.config.replace(engine=side.engine, fsync=True)
    if "auto" in settings.codecs:
        from ...pipeline.autotune import storage_gbps

        storage_gbps(directory, config.storage_gbps)
    path = directory / "warm-up.gdsckpt"
    for codec in runnable:
        sample = _leading_bytes(side.tensors, MEASURED_MIN_BYTES) if (
            codec == "auto" and side.engine == "cpu") else small
        try:
            # the codec asked for, whatever the configuration names (save's codec="auto" argument
            # defers to a configuration's codec)
            gdsckpt_save(sample, path, codec=codec, config=config.replace(codec=codec))
            gdsckpt_load(path, device=side.device, config=config)
        except Exception as err:  # noqa: BLE001 - the measurement of this codec records the failure
            logger.warning("warm-up of codec %r on the %s engine failed: %s", codec, side.engine, err)
        finally:
            path.unlink(missing_ok=True)
    if side.device == "cuda":
        torch.cuda.synchronize()


def _leading_bytes(tensors: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """Copies of the first ``nbytes`` of the state's tensors, in order (all of them where the state
    is smaller), as one sample state."""
    sample: dict[str, Any] = {}
    for key, tensor in tensors.items():
        if nbytes <= 0:
            break
        flat = tensor.reshape(-1)[: max(nbytes // tensor.element_size(), 1)]
        sample[key] = flat.clone()
        nbytes -= flat.numel() * flat.element_size()
    return sample


def run_benchmark(settings: BenchSettings, targets: list[str | os.PathLike[str]], *,
                  advance: Callable[[int], None] | None = None) -> BenchReport:
    """Measure every configuration of ``settings`` on every target; see the module docstring.

    Targets are checked (``check_target``) before any data is made. After each save+load (and for
    each skipped one) ``advance(n)`` is called with the state's logical bytes, up to
    ``progress_total`` in all. Every file written is removed before this returns or raises
    (KeyboardInterrupt included)."""
    import torch

    started = time.perf_counter()
    need = space_needed(settings)
    free = {str(target): check_target(target, need) for target in targets}
    memory = available_memory()
    if memory is not None and memory < 3 * settings.size_bytes:
        logger.warning("only %s of memory is available; the benchmark holds about three copies of the "
                       "%s state (data, raw buffer, what a load returns)", human_size(memory),
                       human_size(settings.size_bytes))
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    host_state = synthetic_state(settings.size_bytes, seed=settings.seed)
    data = describe_data(host_state, settings.seed)
    logical = data["logical_bytes"]
    sides = [_host_side(host_state)]
    if settings.device == "cuda":
        sides.append(_gpu_side(sides[0]))
    report = BenchReport(settings, host_info(settings.device), data, [], date)
    tick = advance or (lambda _n: None)
    try:
        for number, target in enumerate(targets):
            result = TargetResult(str(Path(target).resolve()), filesystem_of(target), free[str(target)])
            report.targets.append(result)
            deadline = None
            if settings.max_seconds is not None:
                left = settings.max_seconds - (time.perf_counter() - started)
                deadline = time.perf_counter() + left / (len(targets) - number)
            with bench_directory(target) as directory:
                _measure_target(result, sides, settings, logical, directory, tick, deadline)
    finally:
        del sides
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    report.seconds = time.perf_counter() - started
    return report


def progress_total(settings: BenchSettings, targets: int) -> int:
    """The sum of what ``run_benchmark`` passes to ``advance``: the state's logical bytes once per
    configuration, repeat and target (skipped configurations included)."""
    sides = 2 if settings.device == "cuda" else 1
    per_side = (len(settings.chunk_sizes) * len(settings.threads)
                * (1 + len(settings.codecs) * len(settings.depths)) + len(settings.baselines)
                + (1 if settings.codecs else 0))  # the null sink and source
    return per_side * sides * settings.repeats * targets * logical_bytes_for(settings.size_bytes)


def _out_of_time(m: Measurement, repeats: int) -> None:
    """Mark a measurement the time budget cut short: skipped if never run, else how many of its
    repeats ran."""
    if m.status == "pending":
        m.status, m.reason = "skipped", "the time budget (--max-seconds) was spent first"
    elif m.status == "ok" and len(m.save_seconds) < repeats:
        m.reason = (f"{len(m.save_seconds)} of {repeats} repeats: the time budget "
                    f"(--max-seconds) was spent")


def _measure_target(result: TargetResult, sides: list[_Side], settings: BenchSettings, logical: int,
                    directory: Path, tick: Callable[[int], None], deadline: float | None = None) -> None:
    cases = [(side, case) for side in sides for case in _cases(side, settings, logical)]
    result.measurements = [case.measurement for _side, case in cases]
    for side in sides:
        _warm_up(side, directory, settings)
    # Round-robin: every configuration once per round, so a slow phase of the storage (a noisy
    # neighbour, a cache flush) hits all of them rather than one configuration's repeats.
    for round_number in range(settings.repeats):
        if deadline is not None and time.perf_counter() > deadline:
            # The budget is spent: every case says so, the rounds left count as done at once
            # (without this, each of --repeats rounds still ran, a million of them for ever).
            for _side, case in cases:
                _out_of_time(case.measurement, settings.repeats)
            tick(logical * len(cases) * (settings.repeats - round_number))
            break
        gc.collect()  # once a round: garbage of earlier rounds is not collected inside a timing
        for number, (side, case) in enumerate(cases):
            m = case.measurement
            if deadline is not None and time.perf_counter() > deadline and m.status in ("pending", "ok"):
                _out_of_time(m, settings.repeats)
                tick(logical)
                continue
            if m.status in ("pending", "ok"):
                _run_once(case, directory / f"case-{number}{case.suffix}", side.sync)
                if m.status != "failed":
                    m.status = "ok"
                    logger.info("%s round %d/%d: %s: save %.3f GB/s, load %.3f GB/s, ratio %.3f",
                                result.path, round_number + 1, settings.repeats, m.label,
                                logical / m.save_seconds[-1] / GB, logical / m.load_seconds[-1] / GB,
                                m.ratio or 0.0)
            tick(logical)
