"""Fast tiers: gdsckpt where the storage is not the limit, each figure next to the raw speed of the
same tier, the same file, in the same run.

The state (``benchlib.build_state``, about ``--size``) is saved once with the library's defaults,
on the GPU with ``engine="gpu"``: a tier that reads at 25-50 GB/s also writes far faster than the
CPU engine compresses, where ``codec="auto"`` keeps the GPU engine, while /dev/shm in a virtual
machine writes at a few GB/s and would let ``auto`` weigh in the portable CPU engine
(``benchmarks/portable_bench.py`` measures that choice). Then, round-robin for ``--repeat``
rounds (the tiers' reads and restores ``--restores`` times in each), on the GPU (``--device cuda``,
the GPU engine):

- ``page_cache``: the file on ``--dir``, read once untimed, then timed warm: ``gdsckpt.load(...,
  device=)`` against a raw kvikio read of the same file into device memory (``--kvikio-threads``
  threads, kvikio's default task size, 16 MiB tasks and each of ``--task-sizes``: the fastest is
  the limit);
- ``tmpfs``: the same with the file in ``--shm-dir`` (/dev/shm);
- ``null_source``: the file held in pinned host memory (``gdsckpt.io.PreloadedReader``): the
  restore pipeline alone, against one host-to-device copy of the file's bytes;
- ``null_sink``: ``gdsckpt.save`` into ``gdsckpt.io.NullWriter`` (the save pipeline alone);
- ``save_tmpfs``: ``gdsckpt.save`` to ``--shm-dir`` against a raw kvikio write of the state's bytes
  (each side writing a new file);
- ``--task-sizes``: the restores and the tmpfs save again with each kvikio task size given, and
  the raw reads and the raw write too (the fastest raw side is the limit);
- ``to_host``: ``load(device="cpu")`` and ``load_into`` a CPU copy of the state from the tmpfs
  file, against ``torch.load(map_location="cpu")`` of a ``torch.save`` file in the same tmpfs (warm)
  and a raw read of the gdsckpt file into newly allocated host memory;
- ``small_N``: N tensors of 1-37 floats on the device (``--small``), ``gdsckpt.save`` / ``load``
  against ``torch.save`` / ``torch.load`` of the same dict, files in ``--shm-dir``.

Every timed call runs with Python's cyclic garbage collector off (collected before), for less
noise, unless ``--keep-gc``: then it runs as in a user's process, where a call that builds many
objects pays for its full collections (those of many small tensors most).

With ``--device cpu`` the same tiers run on the CPU engine (raw reads with ``readinto``).
``--profile`` also records where a restore's time goes, from one extra restore per tier with the
stages timed (slower than the timed rounds): the setup (``setup_open``: reading and validating the
index; ``setup_targets``: making the destination arrays; ``setup_to_stream``: from opening to the
first chunk read), the chunk stream's timeline (``t_*``: seconds from its start to the first and
last read seen landed, the worker's first batch and last batch end, the stream's end), what
follows it (``after_stream``), and the decoder worker's time per stage (queueing a checked ANS
batch, waiting for the stream, other codecs' checksums and decoding, copies to host memory);
The null sink's save gets a timeline as well (seconds from the start of ``save_flat``, after
flattening: ``save_flatten``, ``save_save_engine`` choosing and starting the encoder,
``save_plan``, ``save_run_save`` the chunk stream, ``save_encoder_close``, and
``t_save_first_encode`` / ``t_save_last_encode_end`` / ``t_save_run_end`` / ``t_save_end``).
``--cprofile`` adds a cProfile of the workers' batches.

GB/s are logical tensor bytes (10**9) over wall seconds; every restore is compared bit for bit.
``limits`` gives each figure as a fraction of ratio x raw of its tier.

    python3 benchmarks/tier_bench.py --device cuda --size 8GiB --dir /root/tier --shm-dir /dev/shm --out tier.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import pstats
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import benchlib
import numpy as np

GB = 1e9


KEEP_GC = False
"""``--keep-gc``: time with the cyclic garbage collector running, as in a user's process."""


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """(seconds, result) of ``fn`` with the device synchronized on both sides, no GC inside
    (unless ``KEEP_GC``: collected before, running inside)."""
    gc.collect()
    collecting = gc.isenabled()
    if not KEEP_GC:
        gc.disable()
    try:
        benchlib.sync(device)
        started = time.perf_counter()
        result = fn()
        benchlib.sync(device)
        return time.perf_counter() - started, result
    finally:
        if collecting:
            gc.enable()


def read_warm(path: Path) -> None:
    """Read ``path`` once so the page cache holds it."""
    with open(path, "rb", buffering=0) as handle:
        while handle.read(64 << 20):
            pass


def raw_device_read(path: Path, threads: int, task_size: int | None) -> Callable[[], Any]:
    """A kvikio read of the whole file into one new device buffer."""
    import cupy
    import kvikio
    import kvikio.defaults

    size = path.stat().st_size

    def read() -> Any:
        saved = {key: kvikio.defaults.get(key) for key in ("thread_pool_nthreads", "task_size")}
        kvikio.defaults.set("thread_pool_nthreads", threads)
        if task_size is not None:
            kvikio.defaults.set("task_size", task_size)
        try:
            out = cupy.empty(size, dtype=cupy.uint8)
            with kvikio.CuFile(path, "r") as handle:
                got = handle.pread(out, size, 0).get()
            assert got == size, (got, size)
            return out
        finally:
            for key, value in saved.items():
                kvikio.defaults.set(key, value)
    return read


def raw_host_read(path: Path) -> Callable[[], Any]:
    """The file read into newly allocated host memory (one ``readinto``)."""
    size = path.stat().st_size

    def read() -> Any:
        out = np.empty(size, dtype=np.uint8)
        with open(path, "rb", buffering=0) as handle:
            view, done = memoryview(out), 0
            while done < size:
                done += handle.readinto(view[done:])
        return out
    return read


def raw_device_write(state: Any, path: Path, threads: int, task_size: int | None = None) -> Callable[[], None]:
    """kvikio writes of every tensor's bytes back to back (``task_size``: kvikio's, None for its
    default), then fsync."""
    import kvikio
    import kvikio.defaults
    import torch

    views = [t.detach().reshape(-1).view(torch.uint8) for t in benchlib.flatten(state)[0].values()]

    def write() -> None:
        saved = {key: kvikio.defaults.get(key) for key in ("thread_pool_nthreads", "task_size")}
        kvikio.defaults.set("thread_pool_nthreads", threads)
        if task_size is not None:
            kvikio.defaults.set("task_size", task_size)
        try:
            with kvikio.CuFile(path, "w") as handle:
                offset, futures = 0, []
                for view in views:
                    futures.append(handle.pwrite(view, view.numel(), offset))
                    offset += view.numel()
                for future in futures:
                    future.get()
        finally:
            for key, value in saved.items():
                kvikio.defaults.set(key, value)
        benchlib.fsync_tree(path)
    return write


def small_state(count: int, device: str) -> dict[str, Any]:
    """``count`` float32 tensors of 1-37 elements, in one dict."""
    import torch

    generator = torch.Generator().manual_seed(count)
    sizes = torch.randint(1, 38, (count,), generator=generator).tolist()
    return {f"t{i}": torch.randn(n, generator=generator).to(device) for i, n in enumerate(sizes)}


# ---------------------------------------------------------------------------------------------
# where a restore's time goes

@contextlib.contextmanager
def stage_timer(device: str, cprofile: bool = False) -> Iterator[dict[str, float]]:
    """Time the GPU workers' stages by wrapping them for the block: the decoder's whole batches,
    the queued ANS batches (launches only: ``verified_ans_decode``), the waits for its stream,
    the checksums and nvCOMP calls of other codecs, the host copies; the encoder's batches.
    ``cprofile``: a cProfile of the batches too. Since Python 3.12 cProfile sees every thread
    while it is enabled (it is built on ``sys.monitoring``) and slows them all, so it is a separate
    choice."""
    totals: dict[str, float] = {}
    if device != "cuda":
        yield totals
        return
    import cupy

    from gdsckpt.codecs import device as device_module
    from gdsckpt.pipeline.gpu import decoder as decoder_module
    from gdsckpt.pipeline.gpu import encoder as encoder_module

    def wrap(owner: Any, name: str, label: str, sync: bool) -> tuple[Any, str, Any]:
        original = getattr(owner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if sync:
                    cupy.cuda.get_current_stream().synchronize()
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - started
                totals[label + "_calls"] = totals.get(label + "_calls", 0) + 1
        setattr(owner, name, timed_call)
        return owner, name, original

    profilers = {"decode": cProfile.Profile(), "encode": cProfile.Profile()}

    def profile(owner: Any, name: str, profiler: cProfile.Profile) -> tuple[Any, str, Any]:
        original = getattr(owner, name)

        def profiled(self: Any, jobs: list[Any]) -> None:
            profiler.enable()
            try:
                original(self, jobs)
            finally:
                profiler.disable()
        setattr(owner, name, profiled)
        return owner, name, original

    # A timeline of the restore (seconds from the start of its chunk stream): when the driver saw
    # the first and last read land (each ``submit_decode``), when the worker's batches ran, when
    # the stream ended; and the setup before it: opening the file (reading and validating the
    # index), making the destination tensors, starting the decoder.
    marks: dict[str, list[float]] = {"stream": [], "submits": [], "batches": [], "open": [], "restore": [],
                                     "load": [], "lead": [], "unflatten": [],
                                     "engine": [], "flatten": [], "save": [], "save_engine": [], "plan": [],
                                     "run_save": [], "encoder_close": [], "encodes": []}
    sizes: list[int] = []
    issued: list[tuple[float, int]] = []
    """(time, bytes) of every storage read the restore submitted (the lead's before its stream):
    whether the driver issues reads at the storage's pace or behind it."""

    def mark_read(original: Any) -> Any:
        def submit_read(self: Any, offset: int, out: Any) -> Any:
            issued.append((time.perf_counter(), int(out.nbytes)))
            return original(self, offset, out)
        return submit_read

    def mark_submit(original: Any) -> Any:
        def submitted(*args: Any, **kwargs: Any) -> Any:
            marks["submits"].append(time.perf_counter())
            return original(*args, **kwargs)
        return submitted

    def mark_batch(original: Any) -> Any:
        def batch(self: Any, jobs: list[Any]) -> None:
            started = time.perf_counter()
            try:
                original(self, jobs)
            finally:
                marks["batches"] += [started, time.perf_counter()]
                sizes.append(len(jobs))
        return batch

    def mark_context(label: str) -> Callable[[Any], Any]:
        """Marks a context manager's enter (start, end) and exit (start, end)."""
        def wrapper(original: Any) -> Any:
            @contextlib.contextmanager
            def spanned(*args: Any, **kwargs: Any) -> Iterator[Any]:
                marks[label].append(time.perf_counter())
                with original(*args, **kwargs) as value:
                    marks[label].append(time.perf_counter())
                    try:
                        yield value
                    finally:
                        marks[label].append(time.perf_counter())
                marks[label].append(time.perf_counter())
            return spanned
        return wrapper

    def mark_span(label: str) -> Callable[[Any], Any]:
        def wrapper(original: Any) -> Any:
            def spanned(*args: Any, **kwargs: Any) -> Any:
                marks[label].append(time.perf_counter())
                try:
                    return original(*args, **kwargs)
                finally:
                    marks[label].append(time.perf_counter())
            return spanned
        return wrapper

    import gdsckpt
    from gdsckpt.api import checkpoint as checkpoint_module
    from gdsckpt.api import reading as reading_module
    from gdsckpt.api import saving as saving_module
    from gdsckpt.io import PreloadedReader
    from gdsckpt.io.kvikio import KvikioReader
    from gdsckpt.pipeline import load as load_module

    patches = []
    for owner, name, wrapper in ((gdsckpt, "load", mark_span("load")),
                                 (reading_module, "lead_read", mark_context("lead")),
                                 (reading_module, "unflatten", mark_span("unflatten")),
                                 (reading_module, "open_checked", mark_span("open")),
                                 (reading_module, "restore_arrays", mark_span("restore")),
                                 (checkpoint_module, "restore_engine", mark_span("engine")),
                                 (load_module, "_stream_chunks", mark_span("stream")),
                                 (decoder_module.GpuDecoder, "submit_decode", mark_submit),
                                 (decoder_module.GpuDecoder, "_decode_batch", mark_batch),
                                 (KvikioReader, "submit_read", mark_read),
                                 (PreloadedReader, "submit_read", mark_read),
                                 # a save's timeline: flattening, choosing and starting the engine,
                                 # planning, the chunk stream, closing the encoder; its batches
                                 (saving_module, "flatten", mark_span("flatten")),
                                 (saving_module, "save_flat", mark_span("save")),
                                 (saving_module, "_save_engine", mark_span("save_engine")),
                                 (saving_module, "plan_chunks", mark_span("plan")),
                                 (saving_module, "run_save", mark_span("run_save")),
                                 (encoder_module.GpuEncoder, "close", mark_span("encoder_close")),
                                 (encoder_module.GpuEncoder, "_encode_batch", mark_span("encodes"))):
        original = getattr(owner, name)
        setattr(owner, name, wrapper(original))
        patches.append((owner, name, original))
    if cprofile:
        patches += [profile(decoder_module.GpuDecoder, "_decode_batch", profilers["decode"]),
                    profile(encoder_module.GpuEncoder, "_encode_batch", profilers["encode"])]
    patches += [
        wrap(encoder_module.GpuEncoder, "_encode_batch", "encoder_batches", False),
        wrap(decoder_module.GpuDecoder, "_decode_batch", "worker_batches", False),
        wrap(device_module.CudaDevice, "verified_ans_decode", "worker_queue_checked", False),
        wrap(device_module.CudaDevice, "synchronize", "stream_waits", False),
        wrap(device_module.CudaDevice, "crc32c", "worker_crc32c", False),  # returns host ints: synchronous
        wrap(decoder_module.GpuDecoder, "_decode_group", "worker_decode", True),
        wrap(decoder_module.GpuDecoder, "_deliver_to_host", "worker_host_copies", False),
    ]
    try:
        yield totals
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
        if len(marks["stream"]) >= 2 and marks["submits"] and marks["batches"]:
            zero, batches = marks["stream"][0], marks["batches"]
            busy = sum(batches[i + 1] - batches[i] for i in range(0, len(batches), 2))
            totals.update(t_first_read=marks["submits"][0] - zero, t_last_read=marks["submits"][-1] - zero,
                          t_first_batch=batches[0] - zero, t_last_batch_end=batches[-1] - zero,
                          t_stream_end=marks["stream"][1] - zero, worker_busy=busy,
                          setup_open=marks["open"][1] - marks["open"][0] if marks["open"] else float("nan"),
                          setup_targets=(marks["engine"][0] - marks["restore"][0]) if marks["engine"] else float("nan"),
                          setup_to_stream=zero - marks["open"][0] if marks["open"] else float("nan"),
                          after_stream=(marks["restore"][1] - marks["stream"][1]) if marks["restore"] else float("nan"),
                          batch_chunks_mean=float(np.mean(sizes)), batch_chunks_max=float(max(sizes)))
            if len(marks["load"]) >= 2 and marks["open"] and marks["restore"]:
                # the load's own time outside opening the file and the restore: before the open
                # (the reader, the lead read's start), after the restore (the lead's end and the
                # readers' closes, rebuilding the structure)
                load = marks["load"]
                totals.update(before_open=marks["open"][0] - load[0], after_restore=load[-1] - marks["restore"][1],
                              unflatten=(marks["unflatten"][1] - marks["unflatten"][0]) if marks["unflatten"]
                              else float("nan"))
                if len(marks["lead"]) >= 4:
                    lead = marks["lead"]
                    totals.update(lead_start=lead[1] - lead[0], lead_end=lead[3] - lead[2])
            if issued:
                # when a quarter, half, three quarters and all of the read bytes had been issued
                at, issued_bytes = np.array([t for t, _n in issued]), np.cumsum([n for _t, n in issued])
                for percent in (25, 50, 75, 100):
                    first = int(np.searchsorted(issued_bytes, issued_bytes[-1] * percent / 100))
                    totals[f"t_issued_{percent}"] = float(at[first]) - zero
                totals["reads_issued"] = len(issued)
        if len(marks["save"]) >= 2 and marks["run_save"] and marks["encodes"]:
            # seconds from the start of save_flat (flattening comes before it)
            zero, encodes = marks["save"][0], marks["encodes"]
            span = {label: marks[label][1] - marks[label][0] for label in
                    ("flatten", "save_engine", "plan", "run_save", "encoder_close") if len(marks[label]) >= 2}
            totals.update({f"save_{label}": seconds for label, seconds in span.items()},
                          t_save_first_encode=encodes[0] - zero, t_save_last_encode_end=encodes[-1] - zero,
                          t_save_run_end=marks["run_save"][1] - zero, t_save_end=marks["save"][1] - zero,
                          save_encoder_busy=sum(encodes[i + 1] - encodes[i] for i in range(0, len(encodes), 2)))
        if cprofile:
            for direction, profiler in profilers.items():
                text = io.StringIO()
                with contextlib.suppress(TypeError):  # no data: nothing ran in that direction
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                totals[f"{direction}_worker_profile"] = text.getvalue()  # type: ignore[assignment]


def small_tensors(report: benchlib.Report, count: int, directory: Path, repeat: int,
                  record: Callable[..., None], times: dict[str, list[float]]) -> None:
    """``count`` small tensors: gdsckpt's save and load against torch.save / torch.load."""
    import torch

    import gdsckpt

    device = report["device"]
    small = small_state(count, device)
    nbytes = sum(t.numel() * t.element_size() for t in small.values())
    gd_file, pt_file = directory / f"small{count}.gdsckpt", directory / f"small{count}.pt"
    got = None
    for _ in range(repeat):
        seconds, _ = timed(lambda: benchlib.durable_torch_save(small, pt_file), device)
        record(f"small_{count}/torch_save", seconds, nbytes)
        seconds, _ = timed(lambda: gdsckpt.save(small, gd_file), device)
        record(f"small_{count}/gdsckpt_save", seconds, nbytes)
        seconds, got = timed(lambda: torch.load(pt_file, map_location=device, weights_only=True), device)
        record(f"small_{count}/torch_load", seconds, nbytes)
        seconds, got = timed(lambda: gdsckpt.load(gd_file, device=device), device)
        record(f"small_{count}/gdsckpt_load", seconds, nbytes)
    report.check(f"small_{count}", benchlib.differences(small, got, tensors_only=True))
    for side in ("save", "load"):
        mine = benchlib.median(times[f"small_{count}/gdsckpt_{side}"])
        theirs = benchlib.median(times[f"small_{count}/torch_{side}"])
        report["limits"][f"small_{count}/{side}_seconds_vs_torch"] = {"gdsckpt": mine, "torch": theirs,
                                                                      "met": mine <= theirs}


# ---------------------------------------------------------------------------------------------
# the run

def run(report: benchlib.Report, directory: Path, args: argparse.Namespace) -> None:
    import torch

    import gdsckpt
    from gdsckpt.io import NullWriter, PreloadedReader

    device = args.device
    gpu = device == "cuda"
    state, logical = benchlib.sized_state(report, args.size, args.steps, device)
    shm = Path(args.shm_dir) / f"gdsckpt-tier-{os.getpid()}"
    shm.mkdir(parents=True, exist_ok=False)
    results, limits = report["results"], report["limits"]
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float, nbytes: int = logical) -> None:
        times.setdefault(name, []).append(seconds)
        results[name] = {"gbps": nbytes / benchlib.median(times[name]) / GB, "runs": len(times[name]),
                         "seconds": times[name]}
        report.write()  # a run cut short by its time limit keeps what it measured

    def gbps(name: str) -> float:
        return float(results[name]["gbps"]) if name in results else float("nan")

    try:
        benchlib.warm_up(directory, device)
        disk_file, shm_file = directory / "state.gdsckpt", shm / "state.gdsckpt"
        config = gdsckpt.Config(engine="gpu") if gpu else gdsckpt.Config()
        seconds, saved = timed(lambda: gdsckpt.save(state, shm_file, config=config), device)
        ratio = saved.ratio
        report["state"].update(ratio=ratio, file_bytes=saved.file_bytes, codec=saved.codec, engine=saved.engine)
        record("save_tmpfs/gdsckpt", seconds)
        shutil.copyfile(shm_file, disk_file)
        read_warm(disk_file)
        files = {"page_cache": disk_file, "tmpfs": shm_file}
        before = config.replace(restore_staging_bytes=config.max_staging_bytes)  # the fixed ring of before
        tasks = [(f"gdsckpt_task{size >> 20}MiB", config.replace(kvikio_task_size=size)) for size in args.task_sizes]
        raw_read_tasks = [("raw_default_task", None), *((f"raw_{size >> 20}MiB_task", size)
                                                        for size in sorted({16 << 20, *args.task_sizes}))]

        def check(name: str, got: Any) -> None:
            report.check(name, benchlib.differences(state, got, tensors_only=True))

        preloaded = PreloadedReader(shm_file, pinned=gpu)
        for round_number in range(args.repeat):
            print(f"round {round_number + 1}", flush=True)
            for restore_number, (tier, path) in enumerate(list(files.items()) * args.restores):
                if gpu:
                    for label, task in raw_read_tasks:
                        seconds, out = timed(raw_device_read(path, args.kvikio_threads, task), device)
                        record(f"{tier}/{label}", seconds, path.stat().st_size)
                        del out
                else:
                    seconds, out = timed(raw_host_read(path), device)
                    record(f"{tier}/raw", seconds, path.stat().st_size)
                    del out
                for label, cfg in (("gdsckpt", config), ("gdsckpt_1GiB_ring", before), *tasks) if gpu else (
                        ("gdsckpt", config),):
                    seconds, got = timed(lambda p=path, c=cfg: gdsckpt.load(p, device=device, config=c), device)
                    record(f"{tier}/{label}", seconds)
                    if round_number == 0 and restore_number < len(files):
                        check(f"{tier}/{label}", got)
                    del got
            seconds, got = timed(lambda r=preloaded: gdsckpt.load(r, device=device), device)
            record("null_source/gdsckpt", seconds)
            if round_number == 0:
                check("null_source/gdsckpt", got)
            del got
            if gpu:
                import cupy

                host = preloaded.data  # the pinned bytes: one host-to-device copy is the limit
                seconds, out = timed(lambda h=host: cupy.asarray(h), device)
                record("null_source/raw_h2d", seconds, host.nbytes)
                del out
            seconds, _ = timed(lambda: gdsckpt.save(state, NullWriter()), device)
            record("null_sink/gdsckpt", seconds)
            if gpu:
                raw_file = shm / "raw.bin"
                for label, task in (("raw_write", None), *((f"raw_write_task{size >> 20}MiB", size)
                                                             for size in args.task_sizes)):
                    seconds, _ = timed(raw_device_write(state, raw_file, args.kvikio_threads, task), device)
                    record(f"save_tmpfs/{label}", seconds)
                    raw_file.unlink()
                # Both sides write a new file: replacing the round's earlier one would add freeing
                # its pages (a kernel cost of the old file, not of writing) to gdsckpt's side only.
                for label, cfg in (("gdsckpt", config), *tasks):
                    shm_file.unlink()
                    seconds, _ = timed(lambda c=cfg: gdsckpt.save(state, shm_file, config=c), device)
                    record(f"save_tmpfs/{label}", seconds)
        preloaded.close()

        if args.profile:
            for tier, path in (*files.items(), ("null_source", None)):
                source = PreloadedReader(shm_file, pinned=gpu) if path is None else path
                with stage_timer(device, args.cprofile) as stages:
                    seconds, got = timed(lambda s=source: gdsckpt.load(s, device=device), device)
                del got
                report.setdefault("profile", {})[tier] = {"seconds": seconds, **stages}
            with stage_timer(device, args.cprofile) as stages:
                seconds, _ = timed(lambda: gdsckpt.save(state, NullWriter()), device)
            report.setdefault("profile", {})["null_sink"] = {"seconds": seconds, **stages}

        if gpu and args.to_host:
            torch_file = shm / "state.pt"
            torch.save(state, torch_file)
            read_warm(torch_file)
            template = gdsckpt.load(shm_file, device="cpu")
            check("to_host/load", template)
            for _ in range(args.repeat):
                seconds, got = timed(lambda: torch.load(torch_file, map_location="cpu", weights_only=True), device)
                record("to_host/torch_load", seconds)
                del got
                seconds, got = timed(raw_host_read(shm_file), device)
                record("to_host/raw_read", seconds, shm_file.stat().st_size)
                del got
                seconds, got = timed(lambda: gdsckpt.load(shm_file, device="cpu"), device)
                record("to_host/load", seconds)
                del got
                seconds, _ = timed(lambda: gdsckpt.load_into(template, shm_file), device)
                record("to_host/load_into", seconds)
            check("to_host/load_into", template)
            del template
            torch_file.unlink()

        for count in args.small:
            small_tensors(report, count, shm, args.repeat, record, times)
    finally:
        shutil.rmtree(shm, ignore_errors=True)

    def limit(name: str, mine: str, raws: list[str], scale: float, target: float) -> None:
        raw = max(gbps(r) for r in raws)
        value = gbps(mine)
        limits[name] = {"gbps": value, "raw_gbps": raw, "limit_gbps": scale * raw,
                        "fraction": value / (scale * raw), "target_fraction": target,
                        "met": value >= target * scale * raw}

    raw_reads = (lambda tier: [f"{tier}/{label}" for label, _task in raw_read_tasks]) if gpu else (
        lambda tier: [f"{tier}/raw"])
    for tier in ("page_cache", "tmpfs"):
        limit(f"{tier}/gdsckpt", f"{tier}/gdsckpt", raw_reads(tier), ratio, 0.9)
        if gpu:
            for label in ("gdsckpt_1GiB_ring", *(f"gdsckpt_task{size >> 20}MiB" for size in args.task_sizes)):
                limit(f"{tier}/{label}", f"{tier}/{label}", raw_reads(tier), ratio, 0.9)
    if gpu:
        limit("null_source/gdsckpt", "null_source/gdsckpt", ["null_source/raw_h2d"], ratio, 0.9)
        raw_writes = ["save_tmpfs/raw_write",
                      *(f"save_tmpfs/raw_write_task{size >> 20}MiB" for size in args.task_sizes)]
        for label in ("gdsckpt", *(f"gdsckpt_task{size >> 20}MiB" for size in args.task_sizes)):
            limit(f"save_tmpfs/{label}", f"save_tmpfs/{label}", raw_writes, ratio, 0.9)
    limits["null_source/60GBps"] = {"gbps": gbps("null_source/gdsckpt"), "met": gbps("null_source/gdsckpt") >= 60}
    limits["null_sink/60GBps"] = {"gbps": gbps("null_sink/gdsckpt"), "met": gbps("null_sink/gdsckpt") >= 60}
    if "to_host/load" in results:
        limit("to_host/load_vs_raw", "to_host/load", ["to_host/raw_read"], ratio, 0.9)
        limit("to_host/load_into_vs_raw", "to_host/load_into", ["to_host/raw_read"], ratio, 0.9)
        for name in ("load", "load_into"):
            limits[f"to_host/{name}_vs_torch_load"] = {
                "gbps": gbps(f"to_host/{name}"), "torch_gbps": gbps("to_host/torch_load"),
                "met": gbps(f"to_host/{name}") >= gbps("to_host/torch_load")}


def show(report: benchlib.Report) -> None:
    print(f"state {report['state'].get('logical_bytes', 0) / 2**30:.2f} GiB, ratio "
          f"{report['state'].get('ratio', float('nan')):.3f}, on {report['device']}")
    print(f"  {'measure':34s} {'GB/s':>8s}")
    for name, result in report["results"].items():
        print(f"  {name:34s} {result['gbps']:8.2f}")
    for name, entry in report["limits"].items():
        if "fraction" in entry:
            print(f"  {name}: {entry['gbps']:.2f} GB/s = {entry['fraction']:.2f} of ratio x raw "
                  f"({entry['limit_gbps']:.2f}); target {entry['target_fraction']}: "
                  f"{'met' if entry['met'] else 'NOT met'}")
        else:
            print(f"  {name}: {'met' if entry['met'] else 'NOT met'} "
                  f"({', '.join(f'{k}={v:.3g}' for k, v in entry.items() if isinstance(v, float))})")
    for tier, stages in report.get("profile", {}).items():
        print(f"  profile {tier}: " + ", ".join(f"{k}={v:.3f}" for k, v in stages.items()
                                                 if isinstance(v, float) and not k.endswith("_calls")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if benchlib.cuda_available() else "cpu")
    parser.add_argument("--size", default="8GiB", help="state size (e.g. 8GiB)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps before saving")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (round-robin; medians)")
    parser.add_argument("--restores", type=int, default=1,
                        help="passes over the page-cache and tmpfs reads and restores in each round "
                             "(restores take a fraction of a second, saves seconds: more restore samples "
                             "for the same time)")
    parser.add_argument("--kvikio-threads", type=int, default=16)
    parser.add_argument("--small", type=lambda text: [int(n) for n in text.split(",") if n], default=[20_000, 100_000],
                        help="counts of small tensors (comma-separated; empty: none)")
    parser.add_argument("--no-to-host", dest="to_host", action="store_false",
                        help="skip load(device='cpu') / load_into of the GPU-written file")
    parser.add_argument("--profile", action="store_true", help="time the restore's stages too")
    parser.add_argument("--cprofile", action="store_true", help="with --profile: a cProfile of the GPU workers' "
                        "batches (it slows every thread)")
    parser.add_argument("--task-sizes", type=lambda text: [benchlib.parse_size(n) for n in text.split(",") if n],
                        default=[], help="GPU: also restore, save and read raw with these kvikio task sizes "
                        "(e.g. 8MiB,16MiB); labels gdsckpt_task<N>MiB, raw_<N>MiB_task")
    parser.add_argument("--keep-gc", action="store_true",
                        help="keep Python's cyclic garbage collector running inside the timed calls, as a "
                             "user's process does (by default it is off there: less noise)")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--dir", default="/tmp/gdsckpt-tier")
    parser.add_argument("--out", default="tier-bench.json")
    args = parser.parse_args()
    global KEEP_GC
    KEEP_GC = args.keep_gc
    if args.repeat < 1 or args.restores < 1:
        parser.error("--repeat and --restores must be at least 1")
    return benchlib.run_benchmark("tier_bench", args, lambda report, directory: run(report, directory, args), show)


if __name__ == "__main__":
    sys.exit(main())
