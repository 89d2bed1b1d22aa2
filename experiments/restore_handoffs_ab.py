"""Whole GPU restores from the page cache under settings that change how often, and how long, the
restore's Python threads wait for each other, alternating in one process, next to a raw read.

Before grouped reads the restore's driver thread submitted one kvikio ``pread`` per chunk (2,123
for the 8.9 GB tier state); the decoder's worker thread runs Python between its device calls. ``pread`` releases
the GIL; taking it back waits while the other thread runs Python, up to the interpreter's switch
interval (5 ms). Where thread wake-ups are slow (some virtual machines) these hand-offs can
dominate: `experiments/pread_calls.py` measures the reads alone; this measures the restore:

- ``default``: the library's defaults (grouped reads: ``GROUP_READ_PIECES`` pieces of
  ``GROUP_READ_BYTES``; the first pieces read while the index is parsed, ``resolve.lead_read``);
- ``no lead read``: the defaults, with the chunk reads waiting for the index (the restore before
  lead reads; the arena-shape ways below run without one too);
- ``lead 16 x 64 MiB``: a lead read of 1 GiB instead of 512 MiB: on an H200 the setup before the
  chunk stream (14-17 ms) outlasted the 512 MiB lead's reads (about 12 ms at 44 GB/s), so reads
  paused; whether a lead sized from the free device memory would pay is what this measures;
- ``per-chunk reads``: no read arena, one ``pread`` per chunk (the restore before grouped reads);
- ``4 x 64 MiB`` / ``32 x 64 MiB`` / ``8 x 32 MiB``: other arena shapes (pieces x bytes per grouped read);
- ``switch 0.5 ms``: ``sys.setswitchinterval`` lowered for the restore
  (a bound on each wait for the GIL, process-wide);
- ``kvikio 8 threads`` (12, 14): fewer pool threads than the host's cores (``Config.kvikio_threads``);
- ``gds_threshold 0``: kvikio reads no small device buffer synchronously in the calling thread;
- ``gc off``: Python's garbage collector disabled for the restore;
- ``no collect before``: the defaults, without the full collection the other ways get before
  each restore (below), so a restore may collect what earlier ones left;
- ``blocking waits``: the decoder's waits for its stream sleep on an event made with
  ``cudaEventBlockingSync`` instead of ``cudaStreamSynchronize``, which spins a core while the
  device has fewer contexts than the host has cores (CUDA's default schedule), beside kvikio's
  pool threads that take every core;
- ``reads only``: the defaults with every decode skipped (its ring slot given back at once): the
  driver's grouped reads at their own pace, to tell the reads' pace from the decoder's cost
  (nothing is restored, so this way's result is not compared);
- ``raw read``: one kvikio read of the whole file (the limit, with the ratio).

``--ways`` picks some of them (comma-separated; ``raw read`` is always run). ``--profile`` times
every round of the restore ways with the tier benchmark's stage timer and prints, per round, where
its time went (before opening the file: the readers and the lead read's start; setup before the
chunk stream: opening the file and making the targets; the restore's time after the stream
ended; the load's after the restore: the lead read's end, closing the readers, rebuilding the
structure; when half and all of the reads had been issued, last
read landed, stream end, worker busy, worker waiting for its stream) and the time Python's cyclic garbage collector ran during it (all
collections, and the full ones), to tell a slow round's cause from the others'.

Builds the tier benchmark's trained state (``--size``), saves it into ``--dir`` with the GPU
engine (ANS, as the tier benchmark does: a 25-50 GB/s tier keeps ``codec="auto"`` on the GPU; on a
slow disk ``auto`` may write a portable zstd file, whose restore takes nvCOMP's Zstd path;
``--save-engine auto`` measures that one), reads it once into the page cache, then ``--rounds``
rounds of every way (each after a full collection, so that no restore collects what earlier
ones left; the library's restores run with the collector on, as callers have it); the first
restore of each way is checked bit for bit. Prints the thread wake-up round trip, then medians
(ms, GB/s of logical bytes, ratio x raw) and every round.

    python3 experiments/restore_handoffs_ab.py --size 8GiB --rounds 5 --dir /root/handoffs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
import tier_bench  # noqa: E402
from pread_calls import kvikio_default, switch_interval, wake_round_trip  # noqa: E402

from gdsckpt.pipeline.gpu.staging import GROUP_READ_BYTES  # noqa: E402


@contextlib.contextmanager
def read_arena(pieces: int, piece_bytes: int) -> Iterator[None]:
    """Restores made inside get a read arena of ``pieces`` x ``piece_bytes`` (0 pieces: none),
    within the same quarter of the staging budget (``staging.arena_pieces``)."""
    from gdsckpt.pipeline.gpu import decoder, staging

    defaults = decoder.GpuDecoder.__init__.__kwdefaults__
    saved = staging.GROUP_READ_PIECES, defaults["group_read_bytes"]
    staging.GROUP_READ_PIECES, defaults["group_read_bytes"] = pieces, piece_bytes
    try:
        with no_lead_read():  # its pieces would change the arena's shape
            yield
    finally:
        staging.GROUP_READ_PIECES, defaults["group_read_bytes"] = saved


@contextlib.contextmanager
def no_lead_read() -> Iterator[None]:
    """Restores made inside wait for the index before their first chunk read (``resolve.lead_read``)."""
    from gdsckpt.api import resolve

    saved, resolve.LEAD_READS = resolve.LEAD_READS, False
    try:
        yield
    finally:
        resolve.LEAD_READS = saved


@contextlib.contextmanager
def lead_pieces(pieces: int) -> Iterator[None]:
    """Restores made inside start a lead read of ``pieces`` x ``GROUP_READ_BYTES`` (the default
    takes half the least budget: 8 pieces at the 1 GiB ``max_staging_bytes``), which the decoder
    adopts where its arena has room for them (a restore budget of 4 GiB or more for 16)."""
    from gdsckpt.pipeline.gpu import staging

    saved = staging.lead_read_pieces
    staging.lead_read_pieces = lambda _floor, _piece_bytes: pieces
    try:
        yield
    finally:
        staging.lead_read_pieces = saved


WAYS = ("default", "no lead read", "lead 16 x 64 MiB", "lead 8 x 64 MiB", "switch 0.5 ms", "per-chunk reads", "4 x 64 MiB", "32 x 64 MiB", "8 x 32 MiB",
        "kvikio 8 threads", "kvikio 12 threads", "kvikio 14 threads", "gds_threshold 0", "gc off", "no collect before", "blocking waits", "reads only", "raw read")


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` for the block."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def blocking_waits() -> contextlib.AbstractContextManager[None]:
    """The decoder's stream waits made on a blocking-sync event (the thread sleeps until the
    device signals) instead of a stream synchronize (which spins under CUDA's default schedule)."""
    import cupy

    from gdsckpt.codecs.device import CudaDevice

    def synchronize(self: Any) -> None:
        event = cupy.cuda.Event(block=True, disable_timing=True)
        event.record(self.stream)
        event.synchronize()
    return replaced(CudaDevice, "synchronize", synchronize)


def reads_only() -> contextlib.AbstractContextManager[None]:
    """Every chunk's decode skipped: its ring slot is given back and its future finished at once."""
    from concurrent.futures import Future

    from gdsckpt.pipeline.gpu.decoder import GpuDecoder

    def skip(self: Any, record: Any, chain: Any, stored: Any, deliver: Any, **_kwargs: Any) -> Future[None]:
        slot = self._read_slots.pop(self.device.address(stored), None)
        if slot is not None:
            self.ring.release(slot)
        done: Future[None] = Future()
        done.set_result(None)
        return done
    return replaced(GpuDecoder, "submit_decode", skip)


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    """Python's garbage collector disabled for the block (re-enabled if it was on)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextlib.contextmanager
def collections() -> Iterator[dict[str, float]]:
    """Seconds the cyclic garbage collector ran during the block, in every thread: ``gc`` all
    collections, ``gc_full`` those of the oldest generation (filled in when the block ends)."""
    spent = {"gc": 0.0, "gc_full": 0.0}
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            took = time.perf_counter() - started.pop()
            spent["gc"] += took
            if info.get("generation") == 2:
                spent["gc_full"] += took

    gc.callbacks.append(callback)
    try:
        yield spent
    finally:
        gc.callbacks.remove(callback)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/restore-handoffs")
    parser.add_argument("--save-engine", default="gpu", choices=["gpu", "auto"])
    parser.add_argument("--ways", default="", help="comma-separated ways to run (default: all)")
    parser.add_argument("--profile", action="store_true", help="stage times of every restore round")
    args = parser.parse_args()
    wanted = set(WAYS)
    if args.ways:  # checked before the state is built
        wanted = {name.strip() for name in args.ways.split(",")} | {"raw read"}
        if wanted - set(WAYS):
            parser.error(f"unknown ways {sorted(wanted - set(WAYS))}; known: {list(WAYS)}")

    import torch

    import gdsckpt

    width, depth = benchlib.shape_for_bytes(benchlib.parse_size(args.size))
    state = benchlib.build_state(width, depth, 2, "cuda")
    logical = benchlib.logical_bytes(state)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "state.gdsckpt"
    report = gdsckpt.save(state, path, config=gdsckpt.Config(engine=args.save_engine))
    tier_bench.read_warm(path)
    defaults = gdsckpt.Config()
    print(f"state {logical / 1e9:.2f} GB, file {report.file_bytes / 1e9:.2f} GB, ratio {report.ratio:.3f} "
          f"({report.engine} engine, {report.codec}); "
          f"thread wake-up round trip {wake_round_trip() * 1e6:.1f} us")

    def restore(config: Any, context: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], Any]:
        def run() -> Any:
            with context():
                return gdsckpt.load(path, device="cuda", config=config)
        return run

    ways: dict[str, Callable[[], Any]] = {
        "default": restore(defaults),
        "no lead read": restore(defaults, no_lead_read),
        "lead 16 x 64 MiB": restore(defaults, lambda: lead_pieces(16)),
        "lead 8 x 64 MiB": restore(defaults, lambda: lead_pieces(8)),
        "switch 0.5 ms": restore(defaults, lambda: switch_interval(0.0005)),
        "per-chunk reads": restore(defaults, lambda: read_arena(0, GROUP_READ_BYTES)),
        "4 x 64 MiB": restore(defaults, lambda: read_arena(4, 64 << 20)),
        "32 x 64 MiB": restore(defaults, lambda: read_arena(32, 64 << 20)),
        "8 x 32 MiB": restore(defaults, lambda: read_arena(8, 32 << 20)),
        "kvikio 8 threads": restore(defaults.replace(kvikio_threads=8)),
        "kvikio 12 threads": restore(defaults.replace(kvikio_threads=12)),
        "kvikio 14 threads": restore(defaults.replace(kvikio_threads=14)),
        "gds_threshold 0": restore(defaults, lambda: kvikio_default("gds_threshold", 0)),
        "gc off": restore(defaults, gc_off),
        "no collect before": restore(defaults),
        "blocking waits": restore(defaults, blocking_waits),
        "reads only": restore(defaults, reads_only),
        "raw read": tier_bench.raw_device_read(path, defaults.kvikio_threads, defaults.kvikio_task_size),
    }
    assert set(ways) == set(WAYS)
    ways = {way: run for way, run in ways.items() if way in wanted}
    times: dict[str, list[float]] = {way: [] for way in ways}
    stages: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for round_number in range(args.rounds):
        for way, run in ways.items():
            profiled = args.profile and way != "raw read"
            timer = tier_bench.stage_timer("cuda") if profiled else contextlib.nullcontext({})
            if way != "no collect before":
                gc.collect()  # garbage of earlier rounds is not collected inside this one
            torch.cuda.synchronize()
            with timer as stage, collections() as collected:
                started = time.perf_counter()
                got = run()
                torch.cuda.synchronize()
                times[way].append(time.perf_counter() - started)
            if profiled:
                stages[way].append({**stage, **collected})
            if round_number == 0 and way not in ("raw read", "reads only"):
                problems = benchlib.differences(state, got)
                assert not problems, (way, problems)
            del got
    raw_seconds = statistics.median(times["raw read"])
    for way, values in times.items():
        median = statistics.median(values)
        moved = report.file_bytes if way == "raw read" else logical
        print(f"  {way:18s} median {median * 1e3:8.1f} ms  {moved / median / 1e9:6.2f} GB/s  "
              f"x raw {raw_seconds / median:5.2f}  ({', '.join(f'{v * 1e3:.0f}' for v in values)})")
    if args.profile:
        columns = ("before_open", "lead_start", "setup_open", "setup_targets", "setup_to_stream", "after_stream",
                   "after_restore", "lead_end", "unflatten", "t_first_read", "t_first_batch",
                   "t_issued_50", "t_issued_100", "t_last_read",
                   "t_stream_end", "worker_busy", "stream_waits", "worker_queue_checked", "gc", "gc_full")
        print("per round, ms: total | " + " | ".join(columns))
        for way, rounds in stages.items():
            for total, stage in zip(times[way], rounds):
                print(f"  {way:18s} {total * 1e3:7.1f} | "
                      + " | ".join(f"{stage.get(column, float('nan')) * 1e3:7.1f}" for column in columns))
    path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
