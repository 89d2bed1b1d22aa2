"""``save_async`` with ``Config(async_worker="process")``: the background save runs in a worker
process that maps the snapshot's buffers (``gdsckpt.background.worker``). Real processes, real files: the
snapshot is taken at call time, buffers and the worker are reused, the worker's errors and its
death surface on ``wait()``, the training process alone renames the file (so its death never
leaves a checkpoint written from freed memory), and the caller's script is not re-run."""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.background import async_save
from gdsckpt.background.async_save import AsyncSaver

TEMP_GLOB = ".*.gdsckpt-tmp-*"
PROCESS = gdsckpt.Config(async_worker="process", chunk_bytes=65536, max_inflight_bytes=1 << 20, timeout=120)


@pytest.fixture
def saver() -> Any:
    """A saver of its own, whose worker is stopped after the test."""
    own = AsyncSaver()
    yield own
    own.close_worker()
    async_save._unobserved[:] = [job for job in async_save._unobserved if job.saver is not own]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    tied = torch.nn.Parameter(torch.randn(64, 16, generator=g))
    model = collections.OrderedDict([("w", torch.randn(300, 40, generator=g)),
                                     ("b", torch.randn(40, generator=g).to(torch.bfloat16))])
    model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {"model": model, "embed": tied, "head": tied, "strided": torch.randn(30, 20, generator=g).t()[::2],
            "ints": torch.arange(1000), "empty": torch.empty(0, 4), "numpy": np.arange(500, dtype=np.float32),
            "list": [torch.ones(3), 1, "text", None], "step": 10}


def _clone(state: Any) -> Any:
    if isinstance(state, torch.nn.Parameter):
        return torch.nn.Parameter(state.detach().clone(), requires_grad=state.requires_grad)
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def test_process_save_round_trips_and_the_snapshot_is_taken_at_call_time(tmp_path: Path, saver: Any,
                                                                          h: Any) -> None:
    state = _state()
    expected = _clone(state)
    path = tmp_path / "a.gdsckpt"
    handle = saver.save(state, path, codec="zstd", config=PROCESS)
    with torch.no_grad():  # changed right after the call: the file must hold the old values
        state["model"]["w"].add_(1.0)
        state["embed"].mul_(2.0)
        state["numpy"] += 1
    report = handle.wait(120)
    assert report.path == str(path) and report.tensors == len(gdsckpt.inspect(path).tensors)
    loaded = gdsckpt.load(path)
    h.assert_same({k: v for k, v in expected.items() if k != "model"}, {k: v for k, v in loaded.items() if k != "model"})
    h.assert_same(dict(expected["model"]), dict(loaded["model"]))
    assert loaded["model"]._metadata == {"": {"version": 1}}
    aliases = [t for t in gdsckpt.inspect(path).tensors if t.alias_of is not None]
    assert [t.key for t in aliases] == ["head"], "tied weights are stored once, as in gdsckpt.save"
    assert not list(tmp_path.glob(TEMP_GLOB))


def test_worker_and_buffers_are_reused_across_saves(tmp_path: Path, saver: Any, h: Any) -> None:
    state = _state()
    saver.prepare(state, config=PROCESS)
    pid = saver.worker().pid
    assert pid is not None, "prepare starts the worker"
    allocations = saver.pool.stats().allocations
    for step in range(3):
        state["step"] = step
        with torch.no_grad():
            state["model"]["w"].fill_(step)
        saver.save(state, tmp_path / f"s{step}.gdsckpt", config=PROCESS).wait(120)
    assert saver.worker().pid == pid
    assert saver.pool.stats().allocations == allocations, "the snapshot buffers are the prepared ones"
    for step in range(3):
        loaded = gdsckpt.load(tmp_path / f"s{step}.gdsckpt")
        assert loaded["step"] == step and torch.equal(loaded["model"]["w"], torch.full((300, 40), float(step)))


def test_a_changed_state_gets_new_buffers_and_the_worker_forgets_dropped_ones(tmp_path: Path, saver: Any) -> None:
    for size in (1000, 5000, 1000, 7000):
        state = {"x": torch.arange(size, dtype=torch.float32)}
        saver.save(state, tmp_path / f"{size}.gdsckpt", config=PROCESS).wait(120)
        assert torch.equal(gdsckpt.load(tmp_path / f"{size}.gdsckpt")["x"], state["x"])
    assert saver.pool.stats().held_bytes <= 7000 * 4, "the pool keeps one snapshot's bytes"


def test_an_error_in_the_worker_surfaces_on_wait_with_its_type(tmp_path: Path, saver: Any) -> None:
    path = tmp_path / "delta.gdsckpt"
    base = tmp_path / "base.gdsckpt"
    gdsckpt.save({"x": torch.zeros(10)}, base)
    handle = saver.save({"x": torch.ones(10)}, path, config=PROCESS, base=base)
    base.unlink()  # gone before the worker resolves it (the worker takes a second to start)
    error = handle.exception(120)
    assert isinstance(error, gdsckpt.BaseCheckpointError), repr(error)
    assert any("save worker process" in note for note in getattr(error, "__notes__", []))
    assert not path.exists() and not list(tmp_path.glob(TEMP_GLOB))
    # The worker survives its save's error.
    saver.save({"x": torch.ones(10)}, path, config=PROCESS).wait(120)
    assert torch.equal(gdsckpt.load(path)["x"], torch.ones(10))


def test_a_killed_worker_fails_that_save_and_is_replaced(tmp_path: Path, saver: Any) -> None:
    path = tmp_path / "k.gdsckpt"
    gdsckpt.save({"x": torch.zeros(1 << 16)}, path)  # the previous content
    pid = saver.worker().start(120)
    handle = saver.save({"x": torch.ones(1 << 16)}, path, config=PROCESS)
    os.kill(pid, signal.SIGKILL)
    error = handle.exception(120)
    assert isinstance(error, gdsckpt.SaveWorkerError), repr(error)
    assert "exited with code" in str(error)
    assert torch.equal(gdsckpt.load(path)["x"], torch.zeros(1 << 16)), "the path keeps its previous content"
    saver.save({"x": torch.full((1 << 16,), 2.0)}, path, config=PROCESS).wait(120)
    assert saver.worker().pid not in (None, pid)
    assert torch.equal(gdsckpt.load(path)["x"], torch.full((1 << 16,), 2.0))
    assert not list(tmp_path.glob(TEMP_GLOB)), "the dead worker's temporary file is removed by the next save"


_PARENT_DIES = """
import os, signal, sys, time
import torch, gdsckpt
from gdsckpt.background.async_save import AsyncSaver
from gdsckpt.io import posix

path = sys.argv[1]
gdsckpt.save({"x": torch.zeros(1 << 20)}, path)  # the previous content
config = gdsckpt.Config(async_worker="process", chunk_bytes=65536, timeout=120)
saver = AsyncSaver()
print(saver.worker().start(120), flush=True)
state = {"x": torch.ones(1 << 20)}
saver.save(state, path, config=config)
time.sleep(float(sys.argv[2]))
os.kill(os.getpid(), signal.SIGKILL)  # the training process dies while (or after) the worker writes
"""


@pytest.mark.parametrize("delay", [0.0, 0.3, 3.0])
def test_the_training_process_dying_never_publishes_a_file_and_stops_the_worker(tmp_path: Path, h: Any,
                                                                               delay: float) -> None:
    path = tmp_path / "p.gdsckpt"
    result = h.run_python("-c", _PARENT_DIES, str(path), str(delay), timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    worker = int(result.stdout.split()[0])
    deadline = time.monotonic() + 20
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        status = Path(f"/proc/{worker}/status").read_text() if Path(f"/proc/{worker}/status").exists() else ""
        if "zombie" in status:
            break
        time.sleep(0.1)
    status = Path(f"/proc/{worker}/status").read_text() if Path(f"/proc/{worker}/status").exists() else ""
    assert not status or "zombie" in status, "the worker exits when the training process dies"
    # Only the training process renames, once the worker's file is complete: the path holds the
    # previous content or the new one, bit-exact; killed at once, the previous one.
    loaded = gdsckpt.load(path)["x"]
    assert torch.equal(loaded, torch.zeros(1 << 20)) or (delay > 0 and torch.equal(loaded, torch.ones(1 << 20)))
    gdsckpt.save({"x": torch.ones(3)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name], "leftovers are removed by the next save"


_NO_MAIN_GUARD = """
import sys, torch, gdsckpt
print("module body ran", flush=True)  # a script without `if __name__ == "__main__":`
config = gdsckpt.Config(async_worker="process")
gdsckpt.save_async({"x": torch.arange(10)}, sys.argv[1], config=config).wait(120)
print("saved", flush=True)
"""


def test_the_callers_script_is_not_run_again_by_the_worker(tmp_path: Path, h: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(_NO_MAIN_GUARD)
    path = tmp_path / "x.gdsckpt"
    result = h.run_python(str(script), str(path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("module body ran") == 1 and "saved" in result.stdout
    assert torch.equal(gdsckpt.load(path)["x"], torch.arange(10))


def test_manager_saves_through_a_worker_process(tmp_path: Path) -> None:
    manager = gdsckpt.CheckpointManager(tmp_path / "ckpts", keep_last=2, config=PROCESS)
    try:
        for step in (1, 2, 3):
            manager.save_async(step, {"w": torch.full((100,), float(step))}).wait(120)
        target = {"w": torch.zeros(100)}
        restored = manager.restore_latest(state=target)
        assert restored is not None and restored[0] == 3
        assert torch.equal(target["w"], torch.full((100,), 3.0))
        assert len(list((tmp_path / "ckpts").glob("*.gdsckpt"))) == 2
    finally:
        manager._saver.close_worker()


def test_async_worker_config_is_validated_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="async_worker"):
        gdsckpt.Config(async_worker="fork")
    monkeypatch.setenv("GDSCKPT_ASYNC_WORKER", "process")
    assert gdsckpt.Config.from_env().async_worker == "process"
    with pytest.raises(ValueError, match="async_engine"):
        gdsckpt.Config(async_engine="fast")
    monkeypatch.setenv("GDSCKPT_ASYNC_ENGINE", "cpu")
    assert gdsckpt.Config.from_env().async_engine == "cpu"


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_async_engine_sets_the_engine_of_background_saves_only(tmp_path: Path, saver: Any, h: Any,
                                                               worker: str) -> None:
    """``async_engine`` replaces ``engine`` for the background save, in a thread or the worker,
    and nowhere else: the same config's blocking save keeps ``engine``."""
    from gdsckpt.codecs.nvcomp import gpu_available

    state = _state()
    expected = _clone(state)
    config = PROCESS.replace(async_worker=worker, engine="gpu", async_engine="cpu")
    report = saver.save(state, tmp_path / "cpu.gdsckpt", codec="zstd", config=config).wait(120)
    assert report.engine == "cpu"
    h.assert_same(expected["embed"], gdsckpt.load(tmp_path / "cpu.gdsckpt")["embed"])
    if gpu_available():
        return  # the other direction needs a machine where the GPU engine cannot run
    with pytest.raises(gdsckpt.CodecUnavailableError, match="engine='gpu'"):
        gdsckpt.save(state, tmp_path / "blocking.gdsckpt", config=config)
    handle = saver.save(state, tmp_path / "gpu.gdsckpt", config=config.replace(engine="cpu", async_engine="gpu"))
    with pytest.raises(gdsckpt.CodecUnavailableError, match="engine='gpu'"):
        handle.wait(120)
    assert not (tmp_path / "gpu.gdsckpt").exists()


def test_a_state_of_many_arrays_goes_through(tmp_path: Path, saver: Any) -> None:
    """Each new host buffer's descriptor crosses its own socket message: 600 of them once
    deadlocked (the descriptors, sent before the message, filled the socket's buffer)."""
    state = {f"t{i}": torch.full((300,), float(i)) for i in range(600)}
    saver.save(state, tmp_path / "many.gdsckpt", config=PROCESS).wait(60)
    loaded = gdsckpt.load(tmp_path / "many.gdsckpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


_CTRL_C = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell running the tests in the background ignores SIGINT
import torch, gdsckpt
from gdsckpt.background.async_save import AsyncSaver

path = sys.argv[1]
config = gdsckpt.Config(async_worker="process", timeout=120)
saver = AsyncSaver()
saver.worker().start(120)
handle = saver.save({"x": torch.arange(1 << 20, dtype=torch.float32)}, path, config=config)
try:
    os.killpg(os.getpgid(0), signal.SIGINT)  # Ctrl-C at the terminal: the whole foreground group
    time.sleep(5)
except KeyboardInterrupt:
    print("interrupted", flush=True)
print(handle.wait(120).path, flush=True)
"""


def test_ctrl_c_interrupts_the_training_process_not_the_save(tmp_path: Path, h: Any) -> None:
    import subprocess
    import sys

    path = tmp_path / "c.gdsckpt"
    # In a group of its own, so that the SIGINT reaches nothing but the script (and its worker,
    # were the worker in the script's group).
    result = subprocess.run([sys.executable, "-c", _CTRL_C, str(path)], capture_output=True, text=True,
                            timeout=120, env=h.subprocess_env(), start_new_session=True)
    assert result.returncode == 0, result.stderr
    assert "interrupted" in result.stdout and str(path) in result.stdout
    assert torch.equal(gdsckpt.load(path)["x"], torch.arange(1 << 20, dtype=torch.float32))


_MANY_SMALL = """
import resource, sys
import torch, gdsckpt
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
state = {f"t{i}": torch.full((10,), float(i)) for i in range(3000)}
config = gdsckpt.Config(async_worker="process", timeout=120)
gdsckpt.save_async(state, sys.argv[1], config=config).wait(120)
loaded = gdsckpt.load(sys.argv[1])
print(all(torch.equal(loaded[k], v) for k, v in state.items()), flush=True)
"""


def test_small_arrays_share_slabs_within_a_low_descriptor_limit(tmp_path: Path, h: Any) -> None:
    """3,000 small tensors under a limit of 256 open files: small host buffers are carved from
    shared slabs, so the snapshot needs a handful of descriptors, not one per tensor."""
    path = tmp_path / "small.gdsckpt"
    result = h.run_python("-c", _MANY_SMALL, str(path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_a_save_the_worker_could_not_map_leaves_later_saves_working(tmp_path: Path, saver: Any) -> None:
    """A worker that fails to map a save's new shared buffer (its address space is limited here)
    and the parent agree afterwards on which buffers it knows: the next saves, reusing the pooled
    buffer, go through (they failed with a bare KeyError for the life of the worker)."""
    import resource

    saver.save({"w": torch.randn(10)}, tmp_path / "a.gdsckpt", config=PROCESS).wait(120)
    pid = saver.worker().pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    size = int(Path(f"/proc/{pid}/status").read_text().split("VmSize:")[1].split()[0]) * 1024
    resource.prlimit(pid, resource.RLIMIT_AS, (size + (8 << 20), hard))  # 8 MiB more address space only
    state = {"big": torch.randn(4 << 20)}  # 16 MiB: a shared buffer of its own
    error = saver.save(state, tmp_path / "b.gdsckpt", config=PROCESS).exception(120)
    assert error is not None, "the limit makes the worker's mapping fail"
    assert not (tmp_path / "b.gdsckpt").exists()
    if saver.worker().pid == pid:
        resource.prlimit(pid, resource.RLIMIT_AS, (soft, hard))
    for step in range(3):
        state["big"].fill_(step)
        saver.save(state, tmp_path / "b.gdsckpt", config=PROCESS).wait(120)
        assert torch.equal(gdsckpt.load(tmp_path / "b.gdsckpt")["big"], torch.full((4 << 20,), float(step)))


def test_enum_keys_and_values_defined_in_the_callers_code_save_as_gdsckpt_save_does(tmp_path: Path,
                                                                                  saver: Any) -> None:
    """A worker process cannot import a class defined inside a function or in the training
    script: enum members travel as the plain values the file stores for them."""
    import enum

    class Phase(enum.IntEnum):
        WARMUP = 1

    class Split(str, enum.Enum):
        TRAIN = "train"

    model = collections.OrderedDict(w=torch.ones(2))
    model._metadata = {"": {"phase": Phase.WARMUP}}  # type: ignore[attr-defined]
    state = {Split.TRAIN: {"w": torch.ones(3)}, "phase": Phase.WARMUP, Phase.WARMUP: Split.TRAIN, "model": model}
    gdsckpt.save(state, tmp_path / "sync.gdsckpt")
    saver.save(state, tmp_path / "worker.gdsckpt", config=PROCESS).wait(120)
    expected, loaded = gdsckpt.load(tmp_path / "sync.gdsckpt"), gdsckpt.load(tmp_path / "worker.gdsckpt")
    assert loaded.keys() == expected.keys() == {"train", "phase", 1, "model"}
    assert loaded["model"]._metadata == expected["model"]._metadata == {"": {"phase": 1}}
    assert type(loaded["phase"]) is int and type(loaded[1]) is str and loaded[1] == expected[1]
    assert torch.equal(loaded["train"]["w"], torch.ones(3))


def test_a_save_longer_than_the_timeout_goes_on_while_the_worker_is_alive(tmp_path: Path, saver: Any) -> None:
    """``Config.timeout`` bounds a silence of the worker (its heartbeats), not a whole save, as it
    bounds single waits in ``gdsckpt.save``: a save that runs for several timeouts completes. The
    worker is held back by stopping it for 0.6 s at a time (well within the timeout, which also
    bounds each wait inside the worker: hence small chunks), so the save lasts long whatever the
    machine's speed."""
    config = gdsckpt.Config(async_worker="process", codec="zstd", level=19, codec_threads=1,
                            chunk_bytes=64 << 10, timeout=2.0)
    state = {"w": torch.randn(6 << 20, generator=torch.Generator().manual_seed(5))}  # 24 MiB
    pid = saver.worker().start(120)
    handle = saver.save(state, tmp_path / "slow.gdsckpt", config=config)
    held_until = time.monotonic() + 3 * config.timeout
    try:
        while time.monotonic() < held_until and not handle.done():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.6)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not handle.done(), "the save ended before it had run for three timeouts: give it more work"
    report = handle.wait(120)
    assert report.path == str(tmp_path / "slow.gdsckpt") and saver.worker().pid == pid
    assert torch.equal(gdsckpt.load(tmp_path / "slow.gdsckpt")["w"], state["w"])


def test_a_stopped_worker_fails_a_save_after_the_timeout_and_is_replaced(tmp_path: Path, saver: Any) -> None:
    """A worker that takes no message (stopped here) must not block the save's thread for ever in
    its send: NumPy arrays travel in the message, and 8 MiB do not fit the socket's buffer."""
    config = gdsckpt.Config(async_worker="process", timeout=2.0)
    pid = saver.worker().start(120)
    os.kill(pid, signal.SIGSTOP)
    try:
        error = saver.save({"opt": np.ones(8 << 20, dtype=np.uint8)}, tmp_path / "s.gdsckpt",
                           config=config).exception(60)
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    assert isinstance(error, gdsckpt.SaveWorkerError) and "within 2.0 s" in str(error), repr(error)
    assert not (tmp_path / "s.gdsckpt").exists()
    saver.save({"opt": np.ones(8 << 20, dtype=np.uint8)}, tmp_path / "s.gdsckpt", config=config).wait(120)
    assert saver.worker().pid != pid
    assert np.array_equal(gdsckpt.load(tmp_path / "s.gdsckpt")["opt"], np.ones(8 << 20, dtype=np.uint8))


_FORKED_CHILD_SAVES = """
import os, signal, sys
import torch, gdsckpt
from gdsckpt.background import async_save

directory = sys.argv[1]
config = gdsckpt.Config(async_worker="process", timeout=120)
shape = (1000,)
gdsckpt.save_async({"w": torch.zeros(shape)}, f"{directory}/warm.gdsckpt", config=config).wait(120)
worker = async_save._default_saver.worker().pid
os.kill(worker, signal.SIGSTOP)  # the parent's save waits until the child's is done
handle = gdsckpt.save_async({"w": torch.full(shape, 1.0)}, f"{directory}/parent.gdsckpt", config=config)
child = os.fork()
if child == 0:
    code = 0
    try:
        handle.wait(5)  # the parent's save: only the parent can wait for it
        code = 3
    except RuntimeError as error:
        code = 0 if "forked" in str(error) else 4
    except TimeoutError:
        code = 5
    gdsckpt.save_async({"w": torch.full(shape, 2.0)}, f"{directory}/child.gdsckpt", config=config).wait(120)
    os._exit(code)
_, status = os.waitpid(child, 0)
os.kill(worker, signal.SIGCONT)
handle.wait(120)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_neither_writes_into_the_parents_snapshot_nor_waits_for_its_saves(
        tmp_path: Path, h: Any) -> None:
    """The worker's snapshot buffers are memory shared with it (``MAP_SHARED``), which a fork
    shares with the child as well: the child's save copied its state into the parent's snapshot
    in flight, and the parent's file held the child's values."""
    result = h.run_python("-c", _FORKED_CHILD_SAVES, str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "0", f"the child's wait of the parent's handle: {result.stdout}"
    assert torch.equal(gdsckpt.load(tmp_path / "parent.gdsckpt")["w"], torch.full((1000,), 1.0))
    assert torch.equal(gdsckpt.load(tmp_path / "child.gdsckpt")["w"], torch.full((1000,), 2.0))


_GONE_WORKING_DIRECTORY = """
import os, sys, torch, gdsckpt
os.makedirs(sys.argv[1] + "/gone"); os.chdir(sys.argv[1] + "/gone"); os.rmdir(sys.argv[1] + "/gone")
config = gdsckpt.Config(async_worker="process")
gdsckpt.save_async({"w": torch.ones(3)}, sys.argv[1] + "/x.gdsckpt", config=config).wait(120)
gdsckpt.async_save.prepare({"w": torch.ones(3)}, config=config)  # the documented path after import gdsckpt
"""


def test_a_worker_starts_from_a_removed_working_directory(tmp_path: Path, h: Any) -> None:
    result = h.run_python("-c", _GONE_WORKING_DIRECTORY, str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert torch.equal(gdsckpt.load(tmp_path / "x.gdsckpt")["w"], torch.ones(3))
