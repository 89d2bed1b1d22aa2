"""Child processes of the reliability tests, run as ``python tests/reliability/worker.py MODE ...``.

Only NumPy and gdsckpt are imported (no torch), so a child starts in about half a second. Every
line on stdout is one JSON event; a child that waits for its parent reads a line on stdin.

    save-loop TARGET              ready; on "go FIRST": saves versions FIRST, FIRST+1, ... to TARGET
                                  (events begin/saved), until killed or SAVE_LOOP_CAP saves
    manager-loop DIR              the same through a CheckpointManager (keep_last=2), steps FIRST,
                                  FIRST+1, ..., alternating save and save_async
    concurrent TARGET WRITER      ready; on each line "go ROUND": saves state_for(2*ROUND+WRITER)
                                  to TARGET and reports its start and end times; EOF: exits
    versions TARGET FIRST LAST    ready; on "go": saves versions FIRST..LAST in turn (20 ms apart),
                                  then done
    reader TARGET                 ready; on "go": loads TARGET in a loop until "stop", checks each
                                  load bit-exact against state_for(its version), then summary
    save-loop-cuda TARGET WARMDIR GPU host only: save-loop with the state as CUDA tensors, saved by
                                  the GPU engine (codec ans, ``cuda_config``); imports torch and
                                  runs one untimed save to WARMDIR before "ready" (CUDA context,
                                  nvCOMP, kvikio and CuPy kernels loaded)

The parent test imports this module for ``state_for``, ``config`` and the sizes.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

import gdsckpt

CRASH_ELEMENTS = 2_000_000  # float32 weights: one save takes ~50-150 ms on 2 CPU cores
MANAGER_ELEMENTS = 800_000
CONCURRENT_ELEMENTS = 1_500_000
READER_ELEMENTS = 300_000
SAVE_LOOP_CAP = 20  # a child the parent forgot to kill stops on its own
CUDA_CRASH_ELEMENTS = 4_000_000  # float32 weights on the GPU (tests/gpu/test_gpu_reliability.py)


def config() -> gdsckpt.Config:
    """Every save and load of these tests: real fsync, O_DIRECT where the filesystem takes it,
    enough chunks that a save has many writes to be killed between."""
    return gdsckpt.Config(chunk_bytes=256 << 10, codec_threads=2, io_threads=2, fsync=True)


def cuda_config() -> gdsckpt.Config:
    """Saves and loads of CUDA states (GPU engine): real fsync, 256 KiB chunks so a save has many
    kvikio writes to be killed between, a 64 MiB staging budget (several processes share the GPU)."""
    return gdsckpt.Config(gpu_chunk_bytes=256 << 10, pack_below=64 << 10, max_staging_bytes=64 << 20,
                          engine="gpu", fsync=True)


def state_for(version: int, elements: int) -> dict[str, Any]:
    """The state saved as ``version``: random weights (incompressible), a compressible array, the
    version as a 0-d array and as plain values."""
    rng = np.random.default_rng(version)
    return {
        "weights": rng.standard_normal(elements, dtype=np.float32),
        "counts": np.arange(elements // 4, dtype=np.int64) * (version + 1),
        "version": np.array(version, dtype=np.int64),
        "meta": {"version": version, "note": f"version {version}", "lr": 1e-3 * (version + 1)},
    }


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def wait_for_line() -> str:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the parent is gone or ended the test
    return line.strip()


def save_loop(target: Path) -> None:
    cfg = config()
    emit(event="ready", pid=os.getpid())
    first = int(wait_for_line().split()[1])
    state = state_for(first, CRASH_ELEMENTS)
    for version in range(first, first + SAVE_LOOP_CAP):
        emit(event="begin", version=version)
        started = time.perf_counter()
        gdsckpt.save(state, target, config=cfg)
        emit(event="saved", version=version, seconds=time.perf_counter() - started)
        state = state_for(version + 1, CRASH_ELEMENTS)  # "training" between two saves


def cuda_state_for(version: int, elements: int) -> dict[str, Any]:
    """``state_for`` with its arrays as CUDA tensors (the same bytes)."""
    import torch

    return {key: torch.from_numpy(value).to("cuda") if isinstance(value, np.ndarray) else value
            for key, value in state_for(version, elements).items()}


def save_loop_cuda(target: Path, warm_dir: Path) -> None:
    cfg = cuda_config()
    warm = warm_dir / f"warm-{os.getpid()}.gdsckpt"
    gdsckpt.save(cuda_state_for(0, CUDA_CRASH_ELEMENTS), warm, codec="ans", config=cfg)
    warm.unlink()
    emit(event="ready", pid=os.getpid())
    first = int(wait_for_line().split()[1])
    state = cuda_state_for(first, CUDA_CRASH_ELEMENTS)
    for version in range(first, first + SAVE_LOOP_CAP):
        emit(event="begin", version=version)
        started = time.perf_counter()
        gdsckpt.save(state, target, codec="ans", config=cfg)
        emit(event="saved", version=version, seconds=time.perf_counter() - started)
        state = cuda_state_for(version + 1, CUDA_CRASH_ELEMENTS)


def manager_loop(directory: Path) -> None:
    emit(event="ready", pid=os.getpid())
    first = int(wait_for_line().split()[1])
    manager = gdsckpt.CheckpointManager(directory, keep_last=2, config=config())  # as a restart does
    state = state_for(first, MANAGER_ELEMENTS)
    for step in range(first, first + SAVE_LOOP_CAP):
        emit(event="begin", version=step)
        started = time.perf_counter()
        if step % 2:
            handle = manager.save_async(step, state)
            state = state_for(step + 1, MANAGER_ELEMENTS)  # the next step's state, while it writes
            handle.wait(timeout=60)
        else:
            manager.save(step, state)
            state = state_for(step + 1, MANAGER_ELEMENTS)
        emit(event="saved", version=step, seconds=time.perf_counter() - started)


def concurrent(target: Path, writer: int) -> None:
    cfg = config()
    emit(event="ready", pid=os.getpid())
    while True:
        round_ = int(wait_for_line().split()[1])
        version = 2 * round_ + writer
        state = state_for(version, CONCURRENT_ELEMENTS)
        started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        gdsckpt.save(state, target, config=cfg)
        emit(event="done", version=version, started=started, ended=time.monotonic())


def versions(target: Path, first: int, last: int) -> None:
    cfg = config()
    state = state_for(first, READER_ELEMENTS)
    emit(event="ready", pid=os.getpid())
    wait_for_line()
    for version in range(first, last + 1):
        gdsckpt.save(state, target, config=cfg)
        state = state_for(version + 1, READER_ELEMENTS)
        time.sleep(0.02)  # "training": the reader gets some loads in whatever the machine's speed
    emit(event="done", version=last)


def _check(loaded: dict[str, Any], where: str) -> int:
    """The version of a loaded state, after checking every array and value bit for bit."""
    version = int(loaded["version"])
    expected = state_for(version, READER_ELEMENTS)
    for key in ("weights", "counts", "version"):
        got = loaded[key]
        if got.dtype != expected[key].dtype or got.shape != expected[key].shape \
                or got.tobytes() != expected[key].tobytes():
            raise AssertionError(f"{where}: {key!r} is not version {version}'s")
    if "meta" in loaded and loaded["meta"] != expected["meta"]:
        raise AssertionError(f"{where}: meta {loaded['meta']!r} is not version {version}'s")
    return version


def reader(target: Path) -> None:
    """Alternates ``gdsckpt.load`` and ``gdsckpt.open`` + ``get_many`` (the lazy reader keeps its
    file open while the writer renames new versions over the path)."""
    cfg = config()
    emit(event="ready", pid=os.getpid())
    wait_for_line()
    loads = raced = lazy = 0
    seen: list[int] = []
    errors: list[str] = []
    while not select.select([sys.stdin], [], [], 0)[0]:
        before = os.stat(target).st_ino
        try:
            if loads % 3 == 2:
                with gdsckpt.open(target, config=cfg) as ckpt:
                    time.sleep(0.01)  # give the writer time to replace the path under the open file
                    loaded = ckpt.get_many(["weights", "counts", "version"])
                lazy += 1
            else:
                loaded = gdsckpt.load(target, config=cfg)
            version = _check(loaded, f"load {loads}")
        except Exception:
            errors.append(traceback.format_exc(limit=3))
            version = -1
        raced += os.stat(target).st_ino != before
        if seen and 0 <= version < seen[-1]:
            errors.append(f"load {loads}: version {version} after version {seen[-1]} (went back)")
        if version >= 0:
            seen.append(version)
        loads += 1
    emit(event="summary", loads=loads, raced=raced, lazy=lazy, versions=sorted(set(seen)), errors=errors[:5],
         error_count=len(errors))


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "save-loop":
        save_loop(Path(args[0]))
    elif mode == "manager-loop":
        manager_loop(Path(args[0]))
    elif mode == "concurrent":
        concurrent(Path(args[0]), int(args[1]))
    elif mode == "versions":
        versions(Path(args[0]), int(args[1]), int(args[2]))
    elif mode == "reader":
        reader(Path(args[0]))
    elif mode == "save-loop-cuda":
        save_loop_cuda(Path(args[0]), Path(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
