"""GPU variants of the reliability suite (``tests/reliability/``), at small sizes, on a GPU host.

- Crash consistency: spawned worker processes (``tests/reliability/worker.py save-loop-cuda``)
  save CUDA tensors with the GPU engine (nvCOMP ANS, kvikio) to one path and are killed with
  SIGKILL at random moments; after every kill the path holds the previous or the new complete
  checkpoint (``verify`` passes, ``load(device="cuda")`` bit-exact), and the temporary file a
  kill leaves does not break the next save, which removes it.
- Corruption: seeded single-byte flips over every region of a GPU-written (ANS) checkpoint and
  truncations at random lengths: each load with ``device="cuda"`` raises the error the region
  prescribes (``CorruptCheckpointError`` naming tensor and chunk for a chunk's bytes) or, for
  bytes no checksum covers, loads bit-exact; ``verify`` fails for exactly the same flips.
- I/O errors on the GPU path: ENOSPC / EIO injected into the ``kvikio.CuFile`` that
  ``gdsckpt/io/kvikio.py`` writes and reads device buffers through, raised as an ``OSError`` or as
  kvikio itself reports a failed transfer (a ``RuntimeError``), a real EFBIG (``RLIMIT_FSIZE``)
  under kvikio, and ENOSPC at the POSIX calls the kvikio writer inherits (temporary file, tail,
  truncate, fsync, rename): the save raises that error, the target keeps its bytes, no temporary
  file remains and every CuFile is closed. A read error during a GPU load raises a
  ``CheckpointError`` naming the chunk and the tensor, also when kvikio reports it as its own
  ``RuntimeError`` (``gdsckpt.io.kvikio.kvikio_error`` turns that into the ``OSError`` it stands
  for), and a file truncated during the load raises ``CorruptCheckpointError`` naming them.
- Resource bounds: 100,000 tiny CUDA tensors round trip bit-exact (the seconds are printed; the
  memory bounds are ``test_gpu_memory.py``'s).
- Misuse: sparse and meta tensors among CUDA tensors raise the CPU suite's ``TypeError`` naming the
  key path and leave no file; a device index this machine lacks is a ``ValueError``; a checkpoint
  of tensors on GPU 1 loads onto GPU 0 (two GPUs only).

Every subprocess wait has a timeout. ``RELIABILITY_SEED`` chooses the kill moments (as in the CPU
suite); ``GPU_RELIABILITY_KILLS`` the number of kills (default 20).

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu/test_gpu_reliability.py -s
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

# The CPU suite's helpers (``tests/`` is on sys.path: pytest's rootdir-relative import of this
# package, ``gpu``, puts it there, as it does for ``reliability``).
from reliability.harness import Child, record_figure
from reliability.test_corruption import (
    _flat_state,
    _nest,
    assert_sound,
    flip_campaign,
)
from reliability.test_crash import Tally, _seed, _temporaries
from reliability.test_io_errors import SAVE_STAGES, Fault
from reliability.worker import (
    CUDA_CRASH_ELEMENTS,
    SAVE_LOOP_CAP,
    cuda_config,
    cuda_state_for,
    state_for,
)

import gdsckpt
from gdsckpt.pipeline.load import chunk_owner


def _to_cpu(tree: Any, where: str = "") -> Any:
    """``tree`` with every torch tensor, which must be a CUDA tensor, copied to the CPU."""
    if isinstance(tree, torch.Tensor):
        assert tree.is_cuda, f"{where or '<root>'}: {tree.device}, expected a CUDA tensor"
        return tree.cpu()
    if isinstance(tree, dict):
        return {key: _to_cpu(value, f"{where}/{key}") for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(value, f"{where}/{i}") for i, value in enumerate(tree))
    return tree


def _cpu_tensors(tree: Any) -> Any:
    """``tree`` with NumPy arrays as CPU torch tensors (what ``cuda_state_for`` saves, on the CPU)."""
    import numpy as np

    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {key: _cpu_tensors(value) for key, value in tree.items()}
    return tree


def _to_cuda(tree: Any) -> Any:
    """``tree`` with every torch tensor moved to the GPU (NumPy arrays stay on the host)."""
    if isinstance(tree, torch.Tensor):
        return tree.to("cuda")
    if isinstance(tree, dict):
        return {key: _to_cuda(value) for key, value in tree.items()}
    return tree


def _names_beside(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


# ---------------------------------------------------------------------------------------------
# crash consistency

KILLS = int(os.environ.get("GPU_RELIABILITY_KILLS", "20"))
STANDBYS = 4  # children starting torch + CUDA + a warm-up save while the current one saves


def test_sigkill_during_gpu_save_leaves_the_previous_or_the_new_checkpoint(tmp_path: Path, h: Any) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    warm_dir = tmp_path / "warm"
    warm_dir.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    target = directory / "state.gdsckpt"
    config = cuda_config()
    env = h.subprocess_env()
    spawned = 0

    def spawn() -> Child:
        nonlocal spawned
        spawned += 1
        return Child(env, logs / f"save-loop-cuda-{spawned}.err", "save-loop-cuda", str(target), str(warm_dir))

    standbys = deque(spawn() for _ in range(min(STANDBYS, KILLS)))  # they start while the parent saves
    child = None
    try:
        gdsckpt.save(cuda_state_for(0, CUDA_CRASH_ELEMENTS), target, codec="ans", config=config)  # warm-up
        started = time.perf_counter()
        report = gdsckpt.save(cuda_state_for(0, CUDA_CRASH_ELEMENTS), target, codec="ans", config=config)
        cuda_state_for(1, CUDA_CRASH_ELEMENTS)
        estimate = time.perf_counter() - started  # the target holds version 0
        assert report.engine == "gpu" and report.backend.startswith("kvikio-") and report.chunks >= 40, report
        assert any("nvcomp.ans/1" in chain for chain in report.chains), report.chains

        rng = random.Random(_seed())
        tally = Tally()
        held, first = 0, 1
        left_before: set[str] = set()
        durations: list[float] = []
        span = 2.2 * estimate
        for _ in range(KILLS):
            child = standbys.popleft()
            if spawned < KILLS:
                standbys.append(spawn())
            child.expect("ready", timeout=240)
            child.send(f"go {first}")
            child.expect("begin", timeout=120)
            if len(durations) >= 3:
                span = 2.2 * sorted(durations)[len(durations) // 2]
            time.sleep(rng.uniform(0.0, span))
            events = child.kill()
            child = None
            finished = [e["seconds"] for e in events if e["event"] == "saved"]
            assert len(finished) < SAVE_LOOP_CAP, "the child ran out of saves before the kill"
            if not finished and len(durations) < 3:
                span *= 1.3
            durations += finished

            acknowledged, in_flight = tally.outcome(first, held, events)
            temporaries = _temporaries(directory)
            # The target: verify passes and the content is one of the two candidates, bit for bit.
            gdsckpt.verify(target, config=config)
            loaded = gdsckpt.load(target, device="cuda", config=config)
            version = loaded["meta"]["version"]
            assert version in {acknowledged, in_flight}, (version, acknowledged, in_flight, events)
            h.assert_same(_cpu_tensors(state_for(version, CUDA_CRASH_ELEMENTS)), _to_cpu(loaded))
            assert len(temporaries) <= 1, temporaries
            if in_flight is None:
                tally.landed["between saves"] += 1
            elif version == in_flight:
                tally.landed["mid-save after the rename: new checkpoint"] += 1
            elif temporaries - left_before:
                tally.landed["mid-save with a half-written temporary file: previous checkpoint"] += 1
            else:
                tally.landed["mid-save before the temporary file existed: previous checkpoint"] += 1
            if finished:  # this child's saves removed the temporary the previous one left
                assert not left_before & temporaries, "a dead writer's temporary file survived a save"
            tally.temporaries |= temporaries
            left_before = temporaries
            held = version
            first = max([first] + [e["version"] for e in events if e["event"] == "begin"]) + 1
    finally:
        if child is not None and child.proc.poll() is None:  # a check failed while it saved
            child.proc.kill()
            child.close()
        for standby in standbys:
            standby.close()

    # The next save (another state) removes what the kills left and lands complete.
    small = {"w": torch.arange(1000, dtype=torch.float32, device="cuda")}
    gdsckpt.save(small, target, codec="ans", config=config)
    assert _names_beside(target) == [target.name]
    assert torch.equal(gdsckpt.load(target, device="cuda", config=config)["w"], small["w"])
    assert sum(tally.landed.values()) == KILLS
    # The kills exercised the write window: a good share landed inside a save, some of them
    # half-way through a temporary file.
    assert tally.mid_save() >= KILLS // 3, tally.landed
    assert tally.landed["mid-save with a half-written temporary file: previous checkpoint"] >= 2, tally.landed
    record_figure("sigkill during gdsckpt.save (GPU engine, ans)", (
        f"{KILLS} kills: {KILLS} previous-or-new complete checkpoints, 0 partial (seed {_seed()}, kills "
        f"0-{span * 1000:.0f} ms after a save began; {report.chunks} chunks of 256 KiB, "
        f"{report.logical_bytes / 2**20:.0f} MiB of CUDA tensors); " + tally.summary()))


# ---------------------------------------------------------------------------------------------
# corruption

FLIPS = 240
TRUNCATIONS = 40


def _corruption_config() -> gdsckpt.Config:
    # 8 KiB chunks: the 60 KiB state spans about ten chunks, one of them a pack of small tensors.
    # A small budget that still holds nvCOMP's ANS scratch (32 MiB whatever the chunk size).
    return gdsckpt.Config(gpu_chunk_bytes=8192, pack_below=1024, max_staging_bytes=64 << 20, engine="gpu",
                          fsync=False)


@pytest.fixture(scope="module")
def gpu_written(tmp_path_factory: Any) -> tuple[Path, dict[str, Any], str]:
    """A GPU-written ANS checkpoint of the CPU corruption test's state, its tensors on the GPU
    (the NumPy array stays a host array)."""
    flat = _flat_state()
    path = tmp_path_factory.mktemp("gpu-corruption") / "ckpt.gdsckpt"
    report = gdsckpt.save(_nest(_to_cuda(flat)), path, codec="ans", config=_corruption_config())
    assert report.engine == "gpu" and report.chunks >= 6, report
    assert any("nvcomp.ans/1" in chain for chain in report.chains), report.chains
    chains = ", ".join(f"{count} {chain}" for chain, count in sorted(report.chains.items()))
    return path, flat, chains


def _same(expected: Any, loaded: Any, h: Any) -> bool:
    try:
        h.assert_same(expected, _to_cpu(loaded))
    except AssertionError:
        return False
    return True


def test_random_byte_flips_raise_or_load_bit_exact_on_the_gpu(gpu_written: Any, h: Any) -> None:
    path, flat, chains = gpu_written
    config = _corruption_config()
    state = _nest(flat)
    assert _same(state, gdsckpt.load(path, device="cuda", config=config), h)

    def check_lazy(chunk: int, untouched: list[str], damaged: list[str], rng: random.Random,
                   where: str) -> tuple[int, int]:
        with gdsckpt.open(path, config=config) as ckpt:
            everything = ckpt.get_many(untouched, device="cuda")
            assert _same({key: flat[key] for key in untouched}, everything, h), where
            with pytest.raises(gdsckpt.CorruptCheckpointError) as caught:
                ckpt.get(rng.choice(damaged), device="cuda")
            assert caught.value.chunk == chunk, where
        return len(untouched), 1

    seen = flip_campaign(path, flat, h, flips=FLIPS, seed="gpu-flips",
                         load=lambda: gdsckpt.load(path, device="cuda", config=config),
                         verify=lambda: gdsckpt.verify(path, config=config),
                         same=lambda loaded: _same(state, loaded, h), check_lazy=check_lazy)
    index = h.read_index(path)
    record_figure("corruption flips (GPU, ans)",
                  f"{FLIPS} single-byte flips over a {path.stat().st_size}-byte GPU-written file of "
                  f"{len(index.chunks)} chunks ({chains}) and {len(index.tensors)} tensors, loaded with "
                  f"device='cuda': {seen.summary()}; silently wrong {seen.outcomes['SILENTLY WRONG']}; verify "
                  f"raised for the same {len(seen.raised_by_verify)} flips as load; lazy get_many after a chunk "
                  f"hit: {seen.lazy_untouched} untouched-tensor reads bit-exact, {seen.lazy_damaged} "
                  f"damaged-tensor reads raised")
    assert_sound(seen, FLIPS)
    assert seen.outcomes["chunk bytes: raised CorruptCheckpointError"] >= FLIPS // 4, seen.outcomes


def test_random_truncations_of_a_gpu_written_file_raise(gpu_written: Any, tmp_path: Path) -> None:
    path, _flat, _chains = gpu_written
    config = _corruption_config()
    original = path.read_bytes()
    rng = random.Random("gpu-truncations")
    lengths = sorted(rng.sample(range(len(original)), TRUNCATIONS - 4) + [0, 7, 63, 4159])
    short = tmp_path / "short.gdsckpt"
    operations = {"load(device='cuda')": lambda p: gdsckpt.load(p, device="cuda", config=config),
                  "verify": lambda p: gdsckpt.verify(p, config=config),
                  "inspect": lambda p: gdsckpt.inspect(p, config=config),
                  "open().get_many(device='cuda')": lambda p: _get_all(p, config)}
    outcomes: Counter[str] = Counter()
    for length in lengths:
        short.write_bytes(original[:length])
        expected = gdsckpt.UnsupportedFormatError if length < 8 else gdsckpt.CorruptCheckpointError
        for name, operation in operations.items():
            with pytest.raises(gdsckpt.CheckpointError) as caught:
                operation(short)
            assert type(caught.value) is expected, (length, name, caught.value)
        outcomes[expected.__name__] += 1
    record_figure("corruption truncations (GPU, ans)",
                  f"{len(lengths)} truncations of a {len(original)}-byte GPU-written file: "
                  + ", ".join(f"{count} raised {name}" for name, count in sorted(outcomes.items()))
                  + " from each of " + ", ".join(operations) + "; 0 loaded")
    assert sum(outcomes.values()) == len(lengths) == TRUNCATIONS


def _get_all(path: Path, config: gdsckpt.Config) -> Any:
    with gdsckpt.open(path, config=config) as ckpt:
        return ckpt.get_many(ckpt.keys(), device="cuda")


# ---------------------------------------------------------------------------------------------
# I/O errors on the GPU path

IO_ELEMENTS = 1 << 18  # float32 weights: with 64 KiB chunks, 24 chunks written through kvikio
CODES = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}
# How the injected error is raised: as an ``OSError`` with its errno, or as kvikio 26.10 reports a
# failed POSIX transfer (seen on the H200 host with a real EFBIG and a real EOF): a ``RuntimeError``
# "KvikIO failure at: .../posix_io.hpp:N: POSIX error on pwrite: <strerror>", without an errno.
FORMS = ["OSError", "kvikio RuntimeError"]


def _io_config() -> gdsckpt.Config:
    return gdsckpt.Config(gpu_chunk_bytes=64 << 10, pack_below=4096, max_staging_bytes=64 << 20, engine="gpu",
                          fsync=True, timeout=60)


def _injected(code: int, method: str, form: str) -> Exception:
    if form == "OSError":
        return OSError(code, f"{os.strerror(code)} (injected into kvikio CuFile.{method})")
    return RuntimeError(f"KvikIO failure at: posix_io.hpp:0: POSIX error on {method}: {os.strerror(code)} "
                        f"(injected into kvikio CuFile.{method})")


class _FailingIO:
    """A kvikio ``IOFuture`` whose transfer ran but whose ``get`` reports an error."""

    def __init__(self, real: Any, error: Exception):
        self._real, self._error = real, error

    def done(self) -> bool:
        return self._real.done()

    def get(self) -> int:
        self._real.get()
        raise self._error


class KvikioFault:
    """Replaces ``kvikio.CuFile``, which ``gdsckpt/io/kvikio.py`` opens for device-buffer writes
    and reads, with the real class wrapped: the ``method`` calls (``"pwrite"`` / ``"pread"``) that
    ``matches(offset, size)`` selects fail with ``code`` (raised as ``form``, see ``FORMS``) from the
    ``after``-th of them on, either at submission (``when="submit"``: the call raises) or at
    completion (``when="complete"``: the transfer runs, its future's ``get`` raises, as kvikio
    reports a failed transfer). Every file it opened is remembered, to check it was closed."""

    def __init__(self, method: str, code: int, *, form: str = "OSError", after: int = 0, when: str = "complete",
                 matches: Any = lambda offset, size: True):
        self.method, self.code, self.form, self.after, self.when = method, code, form, after, when
        self.matches = matches
        self.selected = self.raised = 0
        self.opened: list[Any] = []
        self._lock = threading.Lock()

    def _call(self, name: str, real: Any, buf: Any, size: Any = None, file_offset: int = 0, *rest: Any) -> Any:
        if name == self.method and self.matches(file_offset, size):
            with self._lock:
                number = self.selected
                self.selected += 1
            if number >= self.after:
                self.raised += 1
                error = _injected(self.code, name, self.form)
                if self.when == "submit":
                    raise error
                return _FailingIO(real(buf, size, file_offset, *rest), error)
        return real(buf, size, file_offset, *rest)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> KvikioFault:
        import kvikio

        real_class = kvikio.CuFile
        fault = self

        class FaultyCuFile:
            def __init__(self, *args: Any, **kwargs: Any):
                self._real = real_class(*args, **kwargs)
                fault.opened.append(self)

            def pwrite(self, *args: Any) -> Any:
                return fault._call("pwrite", self._real.pwrite, *args)

            def pread(self, *args: Any) -> Any:
                return fault._call("pread", self._real.pread, *args)

            def __getattr__(self, name: str) -> Any:  # closed, close, fileno, ...
                if name == "_real":  # the real constructor raised
                    raise AttributeError(name)
                return getattr(self._real, name)

        monkeypatch.setattr(kvikio, "CuFile", FaultyCuFile)
        return self

    def all_closed(self) -> bool:
        return all(bool(wrapper._real.closed) for wrapper in self.opened)  # a property in kvikio 26.10


def _io_state(version: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(version)
    return {"weights": torch.randn(IO_ELEMENTS, device="cuda", generator=g),
            "half": torch.randn(IO_ELEMENTS // 2, device="cuda", generator=g).to(torch.bfloat16),
            "step": torch.tensor(version, device="cuda"), "meta": {"version": version}}


@pytest.fixture
def previous(ckpt_path: Path) -> bytes:
    """The target's content (version 1, GPU-written) before the failing save."""
    report = gdsckpt.save(_io_state(1), ckpt_path, codec="ans", config=_io_config())
    assert report.engine == "gpu" and report.backend.startswith("kvikio-") and report.chunks >= 10, report
    return ckpt_path.read_bytes()


def _check_untouched_and_saved_again(ckpt_path: Path, previous: bytes, h: Any) -> None:
    """The target kept its bytes and nothing is beside it; once the disk works again the same
    save lands complete, bit-exact."""
    assert ckpt_path.read_bytes() == previous
    assert _names_beside(ckpt_path) == [ckpt_path.name], "a temporary file was left behind"
    gdsckpt.save(_io_state(2), ckpt_path, codec="ans", config=_io_config())
    loaded = gdsckpt.load(ckpt_path, device="cuda", config=_io_config())
    h.assert_same(_to_cpu(_io_state(2)), _to_cpu(loaded))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("when", ["complete", "submit"])
@pytest.mark.parametrize("code", CODES)
def test_kvikio_write_error_keeps_the_target_and_removes_the_temporary(
        code: str, when: str, form: str, ckpt_path: Path, previous: bytes, monkeypatch: pytest.MonkeyPatch,
        h: Any) -> None:
    expected = OSError  # kvikio's RuntimeError is turned into the OSError it stands for
    with monkeypatch.context() as m:
        fault = KvikioFault("pwrite", CODES[code], form=form, after=3, when=when).install(m)
        with pytest.raises(expected) as caught:
            gdsckpt.save(_io_state(2), ckpt_path, codec="ans", config=_io_config())
    assert fault.raised >= 1, "the fault never fired: the save wrote no chunk through kvikio.CuFile.pwrite"
    assert "injected" in str(caught.value) and os.strerror(CODES[code]) in str(caught.value), repr(caught.value)
    assert caught.value.errno == CODES[code], repr(caught.value)
    assert fault.opened and fault.all_closed(), "a kvikio CuFile was left open"
    _check_untouched_and_saved_again(ckpt_path, previous, h)
    record_figure(f"GPU save error: {code} from kvikio pwrite at {when} ({form})",
                  f"{type(caught.value).__name__}: {caught.value}; target bytes unchanged, temporary removed, "
                  f"CuFile closed")


def test_real_file_size_error_through_kvikio_keeps_the_target(ckpt_path: Path, previous: bytes, h: Any) -> None:
    """Not injected: ``RLIMIT_FSIZE`` makes the kernel refuse the writes past 196 KiB with EFBIG
    (SIGXFSZ ignored meanwhile), which kvikio's writer meets first (chunks are device buffers)."""
    import resource
    import signal

    limit = 4096 + 3 * (64 << 10)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip(f"the hard RLIMIT_FSIZE is {hard} bytes")
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        with pytest.raises((OSError, RuntimeError)) as caught:
            gdsckpt.save(_io_state(2), ckpt_path, codec="ans", config=_io_config())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert (getattr(caught.value, "errno", None) == errno.EFBIG
            or os.strerror(errno.EFBIG) in str(caught.value)), repr(caught.value)
    _check_untouched_and_saved_again(ckpt_path, previous, h)
    record_figure("GPU save error: real EFBIG (RLIMIT_FSIZE) under kvikio",
                  f"{type(caught.value).__name__}: {caught.value}; target bytes unchanged, temporary removed")


# The POSIX calls the kvikio writer inherits (header, temporary file, tail, truncate, fsync,
# rename); chunk payloads are device buffers and go through kvikio instead (above).
POSIX_STAGES = [stage for stage in SAVE_STAGES if stage != "chunk write"]


@pytest.mark.parametrize("stage", POSIX_STAGES)
def test_posix_error_on_the_gpu_save_path_keeps_the_target(
        stage: str, ckpt_path: Path, previous: bytes, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    name, matches, after = SAVE_STAGES[stage]
    with monkeypatch.context() as m:
        fault = Fault(name, matches, errno.ENOSPC, after).install(m)
        with pytest.raises(OSError) as caught:
            gdsckpt.save(_io_state(2), ckpt_path, codec="ans", config=_io_config())
    assert fault.raised >= 1, f"the fault at {stage} never fired: the GPU save does not call os.{name} there"
    assert caught.value.errno == errno.ENOSPC and "injected" in str(caught.value), repr(caught.value)
    _check_untouched_and_saved_again(ckpt_path, previous, h)


def _load_cuda(path: Path) -> Any:
    return gdsckpt.load(path, device="cuda", config=_io_config())


def _get_many_cuda(path: Path) -> Any:
    with gdsckpt.open(path, config=_io_config()) as ckpt:
        return ckpt.get_many(ckpt.keys(), device="cuda")


def _verify(path: Path) -> Any:
    return gdsckpt.verify(path, config=_io_config())


GPU_READERS = {"load(device='cuda')": _load_cuda, "open().get_many(device='cuda')": _get_many_cuda,
               "verify": _verify}


@pytest.mark.parametrize("form", [
    "OSError",
    "kvikio RuntimeError",
])
@pytest.mark.parametrize("reader", GPU_READERS)
def test_kvikio_read_error_names_the_chunk_and_tensor(reader: str, form: str, ckpt_path: Path, previous: bytes,
                                                      monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    index = h.read_index(ckpt_path)
    chunk = len(index.chunks) // 2
    owner = chunk_owner(index, chunk)
    offset = index.chunks[chunk].offset
    with monkeypatch.context() as m:
        # every read of the chunk's bytes: a grouped read spanning it, then its own read (the
        # restore reads a failed group's chunks again one by one, pipeline/load.py)
        fault = KvikioFault("pread", errno.EIO, form=form,
                            matches=lambda at, size: at <= offset < at + size).install(m)
        with pytest.raises(gdsckpt.CheckpointError) as caught:
            GPU_READERS[reader](ckpt_path)  # raises: no state is returned
    assert fault.raised >= 1, "the fault never fired: the GPU load read no chunk through kvikio.CuFile.pread"
    message = str(caught.value)
    assert f"chunk {chunk}" in message and repr(owner) in message, message
    assert os.strerror(errno.EIO) in message, message
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.EIO
    assert fault.opened and fault.all_closed(), "a kvikio CuFile was left open"
    assert ckpt_path.read_bytes() == previous
    h.assert_same(_to_cpu(_io_state(1)), _to_cpu(_load_cuda(ckpt_path)))  # a good read loads again
    record_figure(f"GPU read error: EIO from kvikio pread during {reader} ({form})",
                  f"{type(caught.value).__name__}: {message}")


def test_file_truncated_during_gpu_load_names_the_chunk_and_tensor(ckpt_path: Path, previous: bytes,
                                                                   monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """Not injected: the file is cut half-way through chunk ``cut`` when the first chunk read into
    device memory starts (after the index was read), as in the CPU suite's test of that name; the
    CPU path raises ``CorruptCheckpointError`` naming the chunk and its tensor."""
    from gdsckpt.io import kvikio as kvikio_backend

    index = h.read_index(ckpt_path)
    cut = len(index.chunks) // 2
    record = index.chunks[cut]
    original = kvikio_backend.KvikioReader.submit_read
    truncated: list[int] = []

    def submit_read(self: Any, offset: int, out: Any) -> Any:
        if not truncated and hasattr(out, "__cuda_array_interface__"):
            os.truncate(ckpt_path, record.offset + record.stored // 2)
            truncated.append(offset)
        return original(self, offset, out)

    with monkeypatch.context() as m:
        m.setattr(kvikio_backend.KvikioReader, "submit_read", submit_read)
        with pytest.raises(gdsckpt.CorruptCheckpointError) as caught:
            _load_cuda(ckpt_path)
    assert truncated, "the file was never cut"
    assert (caught.value.chunk, caught.value.key) == (cut, chunk_owner(index, cut)), str(caught.value)


# ---------------------------------------------------------------------------------------------
# resource bounds

TINY = 100_000


def test_100k_tiny_cuda_tensors_round_trip_bit_exact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(100)
    sizes = torch.randint(1, 38, (TINY,), generator=g).tolist()
    values = torch.randn(sum(sizes), generator=g)
    specials = torch.tensor([0x7FC00001, 0x7F800001, -0x3EDCBA9, -(1 << 31)], dtype=torch.int32)
    values[[0, 40_000, 800_000, 1_500_000]] = specials.view(torch.float32)  # NaN payloads, -0.0
    on_gpu = values.to("cuda")
    state: dict[str, Any] = {}
    expected = []
    for i, piece in enumerate(torch.split(on_gpu, sizes)):
        tensor = piece.to(torch.bfloat16) if i % 3 == 2 else piece.clone()  # separate CUDA tensors
        state.setdefault(f"layer{i // 1000}", {}).setdefault(f"block{i // 100 % 10}", {})[f"p{i}"] = tensor
        expected.append(tensor)
    path = tmp_path / "tiny.gdsckpt"
    config = gdsckpt.Config(engine="gpu", fsync=False)
    gdsckpt.save({"w": on_gpu[:1000]}, tmp_path / "warm.gdsckpt", codec="ans", config=config)  # kernels load
    torch.cuda.synchronize()
    started = time.perf_counter()
    report = gdsckpt.save(state, path, codec="ans", config=config)
    saved = time.perf_counter()
    loaded = gdsckpt.load(path, device="cuda", config=config)
    torch.cuda.synchronize()
    restored = time.perf_counter()

    assert report.tensors == TINY and report.engine == "gpu", report
    assert list(loaded) == list(state)
    got = []
    for layer, blocks in state.items():
        assert list(loaded[layer]) == list(blocks)
        for block, params in blocks.items():
            assert list(loaded[layer][block]) == list(params)
            for name, tensor in params.items():
                back = loaded[layer][block][name]
                assert type(back) is torch.Tensor and back.is_cuda, (name, back.device)
                assert back.dtype == tensor.dtype and back.shape == tensor.shape, name
                got.append(back)
    as_bytes = [t.reshape(-1).view(torch.uint8) for t in got]
    assert torch.equal(torch.cat(as_bytes), torch.cat([t.reshape(-1).view(torch.uint8) for t in expected])), \
        "bits differ"
    message = (f"100,000 CUDA tensors of 1-37 elements (fp32 and bf16, {report.logical_bytes / 2**20:.1f} MiB, "
               f"nested dict 100 x 10 x 100) on the GPU engine with ans: save {saved - started:.1f} s, load "
               f"{restored - saved:.1f} s (device='cuda'), bit-exact; {report.chunks} chunks")
    print(f"\n{message}")
    record_figure("100k tiny CUDA tensors", message)


# ---------------------------------------------------------------------------------------------
# misuse

CUDA_MISUSE: dict[str, tuple[Any, type[Exception], str]] = {
    # case -> (value at state["outer"]["inner"], beside a CUDA tensor; exception; message regex),
    # as tests/reliability/test_bounds_and_misuse.py expects of the CPU values
    "meta tensor among CUDA tensors": (lambda: torch.empty(3, device="meta"), TypeError, "meta device"),
    "sparse COO CUDA tensor": (lambda: torch.eye(3, device="cuda").to_sparse(), TypeError,
                               r"layout torch\.sparse_coo.*to_dense"),
    "sparse CSR CUDA tensor": (lambda: torch.eye(3, device="cuda").to_sparse_csr(), TypeError,
                               r"layout torch\.sparse_csr"),
}


@pytest.mark.parametrize("case", list(CUDA_MISUSE))
def test_cuda_misuse_raises_a_clear_error_naming_the_key_path(case: str, tmp_path: Path) -> None:
    import warnings

    build, error, pattern = CUDA_MISUSE[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR is beta and says so
        value = build()
    path = tmp_path / "misuse.gdsckpt"
    with pytest.raises(error, match=pattern) as caught:
        gdsckpt.save({"outer": {"inner": value}, "ok": torch.ones(3, device="cuda")}, path, codec="ans",
                     config=gdsckpt.Config(fsync=False))
    assert "'outer/inner" in str(caught.value), caught.value
    assert list(tmp_path.iterdir()) == [], "a failed save leaves no file behind"
    record_figure(f"misuse (GPU) | {case}", f"{type(caught.value).__name__}: {str(caught.value)[:140]}")


def test_load_onto_a_cuda_device_this_machine_lacks_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "w.gdsckpt"
    gdsckpt.save({"w": torch.arange(8.0, device="cuda")}, path, codec="ans")
    missing = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"'cuda:{missing}' requested but this machine has {missing} CUDA"):
        gdsckpt.load(path, device=f"cuda:{missing}")


def test_cuda_tensor_on_another_gpu_than_the_load_device(tmp_path: Path) -> None:
    """Mirrors the CPU suite's test of the same name: saved from GPU 1, loaded onto GPU 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices (this machine has {torch.cuda.device_count()})")
    tensor = torch.randn(100_000, device="cuda:1")
    path = tmp_path / "cuda.gdsckpt"
    report = gdsckpt.save({"w": tensor}, path, codec="ans")
    assert report.engine == "gpu"
    back = gdsckpt.load(path, device="cuda:0")["w"]
    assert back.device == torch.device("cuda:0")
    assert torch.equal(back.cpu().view(torch.int32), tensor.cpu().view(torch.int32))
    again = gdsckpt.load(path, device="cuda:1")["w"]
    assert again.device == torch.device("cuda:1") and torch.equal(again.view(torch.int32), tensor.view(torch.int32))


# ---------------------------------------------------------------------------------------------
# streams


@pytest.mark.parametrize("other_thread", ["queues work on torch's stream", "reuses torch's freed memory"])
def test_non_contiguous_cuda_tensors_save_bit_exact_beside_other_torch_work(tmp_path: Path, other_thread: str) -> None:
    """The GPU encoder reads on a non-blocking stream of its own; a non-contiguous CUDA tensor's
    bytes are first copied by torch, on torch's current stream, into a tensor dropped once the
    encoder's read is queued. Another thread either keeps torch's stream busy (the copies queue
    behind its matrix products) or keeps allocating tensors of the copies' sizes and filling them
    (it gets a dropped copy's memory as soon as torch's allocator hands it out): every saved byte
    must still be the tensor's, in packed chunks (small views) and in chunks of one large view,
    with the ANS and the Zstd path. (``state.arrays.read_on_cupy_stream`` guards both; this test
    also passed on the GPU host with the guard disabled.)"""
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"small{i}": torch.randn(300, 257, device="cuda", generator=g).t() for i in range(24)}
    state["large"] = torch.randn(4096, 2304, device="cuda", generator=g).t()  # 36 MiB: several chunks
    assert not any(t.is_contiguous() for t in state.values())
    square = torch.randn(2048, 2048, device="cuda", generator=g)
    stop = threading.Event()

    def queue_work() -> None:
        torch.cuda.set_device(square.device)  # a thread sets its device before touching it
        while not stop.is_set():
            for _ in range(4):
                torch.mm(square, square)  # on the default stream, which every thread shares
            time.sleep(0.002)

    def reuse_memory() -> None:
        torch.cuda.set_device(square.device)
        sizes = [300 * 257, 4096 * 1024, 2304 * 1024]  # a small view's copy, pieces of the large one's
        value = 0.0
        while not stop.is_set():
            for size in sizes:
                value += 1.0
                torch.empty(size, device="cuda").fill_(value)  # dropped at once: the block goes back

    other = threading.Thread(target=queue_work if other_thread.startswith("queues") else reuse_memory, daemon=True)
    other.start()
    wrong: list[str] = []
    try:
        for round_number, codec in enumerate(["ans", "zstd", "ans", "zstd"]):
            path = tmp_path / f"views{round_number}.gdsckpt"
            report = gdsckpt.save(state, path, codec=codec,
                                  config=gdsckpt.Config(engine="gpu", max_staging_bytes=2 << 30))
            assert report.engine == "gpu", report
            loaded = gdsckpt.load(path, device="cuda")
            torch.cuda.synchronize()
            wrong += [f"{codec} {key}" for key, tensor in state.items()
                      if not torch.equal(loaded[key].view(torch.int32), tensor.contiguous().view(torch.int32))]
    finally:
        stop.set()
        other.join(timeout=60)
    assert not wrong, wrong
