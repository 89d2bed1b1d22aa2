"""``_KvikioFuture`` (the GPU writer's and reader's futures) honours timeouts and reports short
transfers; driven here by a stand-in for kvikio's ``IOFuture`` (fault injection: a transfer that
never finishes), since kvikio itself needs a GPU host."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

import gdsckpt
from gdsckpt.io.kvikio import _KvikioFuture, kvikio_error


class ManualTransfer:
    """An ``IOFuture`` look-alike that finishes when ``finish(count)`` is called. Like kvikio's
    (a ``std::future``), it is invalid once ``get`` was called: ``done`` and ``get`` then raise."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._count = 0
        self._error: BaseException | None = None
        self.taken = False

    def finish(self, count: int) -> None:
        self._count = count
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def done(self) -> bool:
        if self.taken:
            raise ValueError("The future object does not refer to a valid shared state.")
        return self._done.is_set()

    def get(self) -> int:
        if self.taken:
            raise ValueError("The future object does not refer to a valid shared state.")
        self._done.wait()
        self.taken = True
        if self._error is not None:
            raise self._error
        return self._count


class GatheredTasks:
    """What kvikio returns for a call it splits into tasks: a future of their gathered results.
    ``waits``: it ends only once every task has stopped, also when one failed (kvikio 26.10 on);
    else it ends at the first failed task while the tasks after it may still run (25.10-26.8)."""

    def __init__(self, tasks: list[ManualTransfer], waits: bool) -> None:
        self.tasks, self.waits = tasks, waits
        self.taken = False

    def done(self) -> bool:
        if self.taken:
            raise ValueError("The future object does not refer to a valid shared state.")
        for task in self.tasks:
            if not task.finished:
                return False
            if task._error is not None and not self.waits:
                return True
        return True

    def get(self) -> int:
        if self.taken:
            raise ValueError("The future object does not refer to a valid shared state.")
        self.taken = True
        if self.waits:
            for task in self.tasks:
                task._done.wait()
        return sum(task.get() for task in self.tasks)


def test_a_hung_transfer_times_out_instead_of_blocking() -> None:
    transfer = ManualTransfer()
    future = _KvikioFuture(transfer, 4096, "write")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="kvikio write of 4096 bytes still running"):
        future.result(timeout=0.05)
    assert time.monotonic() - started < 5
    transfer.finish(4096)  # it may still finish later: the future then settles normally
    assert future.result(timeout=1) is None and future.done()


def test_a_transfer_finishing_while_waited_for_returns_its_value() -> None:
    transfer = ManualTransfer()
    future = _KvikioFuture(transfer, 10, "read", value="buffer")
    threading.Timer(0.02, transfer.finish, args=(10,)).start()
    assert future.result(timeout=5) == "buffer"


def test_a_short_transfer_is_an_error() -> None:
    transfer = ManualTransfer()
    transfer.finish(3)
    future = _KvikioFuture(transfer, 10, "read")
    with pytest.raises(OSError, match="moved 3 of 10 bytes"):
        future.result(timeout=1)


@pytest.mark.parametrize("message, expected", [
    ("KvikIO failure at: /x/posix_io.hpp:173: POSIX error on pwrite: File too large", errno.EFBIG),
    ("KvikIO failure at: /x/posix_io.hpp:173: POSIX error on pwrite: No space left on device", errno.ENOSPC),
    ("KvikIO failure at: /x/posix_io.hpp:173: POSIX error on pread: EIO", errno.EIO),
    ("something kvikio said", errno.EIO),
])
def test_kvikio_runtime_errors_become_the_os_error_they_stand_for(message, expected):
    error = kvikio_error(RuntimeError(message), "write", 4096)
    assert isinstance(error, OSError) and error.errno == expected
    assert message in str(error) and os.strerror(expected) in str(error)


def test_kvikio_end_of_file_is_a_truncated_checkpoint():
    error = kvikio_error(RuntimeError("KvikIO failure at: posix_io.hpp:173: POSIX error on pread: EOF"), "read", 8)
    assert isinstance(error, gdsckpt.CorruptCheckpointError) and "file ends" in str(error)


def test_kvikio_future_delivers_the_converted_error():
    class Failing:
        def done(self):
            return True

        def get(self):
            raise RuntimeError("KvikIO failure at: x: POSIX error on pread: Input/output error")

    future = _KvikioFuture(Failing(), 10, "read")
    with pytest.raises(OSError) as caught:
        future.result(timeout=1)
    assert caught.value.errno == errno.EIO


class HungKvikio:
    """Fault injection: a stand-in ``kvikio`` module (installed in ``sys.modules``) whose
    ``CuFile`` transfers finish only when the test says so, recording every transfer still running
    when the file handle is closed. The real module is exercised in tests/gpu."""

    def __init__(self) -> None:
        self.transfers: list[ManualTransfer] = []
        """Every task of every call, in order."""
        self.calls: list[tuple[int, int, int | None]] = []
        """(file offset, size, task_size) of every call."""
        self.files: list[Any] = []
        self.settings: dict[str, Any] = {"thread_pool_nthreads": 1, "task_size": 4 << 20}
        fake = self

        class CuFile:
            def __init__(self, path: Any, mode: str) -> None:
                self.closed = False
                self.running_at_close: int | None = None
                fake.files.append(self)

            def _transfer(self, buffer: Any, size: int, offset: int, task_size: int | None = None) -> Any:
                """Tasks of ``task_size`` bytes (kvikio's default when None), as kvikio splits a call."""
                fake.calls.append((offset, size, task_size))
                task = task_size or fake.settings["task_size"]
                tasks = [ManualTransfer() for _ in range(max(1, -(-size // task)))]
                fake.transfers.extend(tasks)
                waits = tuple(int(part) for part in fake.module.__version__.split(".")[:2]) >= (26, 10)
                return tasks[0] if len(tasks) == 1 else GatheredTasks(tasks, waits)

            pread = pwrite = _transfer

            def close(self) -> None:
                self.running_at_close = sum(not t.finished for t in fake.transfers)
                self.closed = True

        self.module = types.ModuleType("kvikio")
        self.module.CuFile = CuFile  # type: ignore[attr-defined]
        self.module.__version__ = "26.10.00"  # type: ignore[attr-defined]
        defaults = types.ModuleType("kvikio.defaults")
        defaults.get = self.settings.__getitem__  # type: ignore[attr-defined]
        defaults.set = self.settings.__setitem__  # type: ignore[attr-defined]
        defaults.is_compat_mode_preferred = lambda: True  # type: ignore[attr-defined]
        self.module.defaults = defaults  # type: ignore[attr-defined]
        self.defaults = defaults


@pytest.fixture()
def hung_kvikio(monkeypatch: pytest.MonkeyPatch) -> HungKvikio:
    fake = HungKvikio()
    monkeypatch.setitem(sys.modules, "kvikio", fake.module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", fake.defaults)
    return fake


class DeviceBuffer:
    """What the kvikio paths take: anything but a host array, with ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def closing_in_a_thread(close: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            close()
        except BaseException as err:  # handed to the test
            errors.append(err)
    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def assert_closed_cleanly(thread: threading.Thread, errors: list[BaseException], fake: HungKvikio) -> None:
    """The close in ``thread`` returned without an error, having closed the first file with no
    transfer still running."""
    thread.join(10)
    assert not thread.is_alive() and errors == []
    assert fake.files[0].closed and fake.files[0].running_at_close == 0


def test_a_kvikio_reader_closes_its_file_only_after_its_reads_stop(hung_kvikio: HungKvikio, tmp_path: Path) -> None:
    """A restore that fails with reads still in flight (they were cancelled, but kvikio runs them
    on) closes the reader: the close waits for them, so the handle never outlives a transfer and
    the read buffers are not handed to the next restore while a read still fills them."""
    from gdsckpt.io.kvikio import KvikioReader

    path = tmp_path / "file.bin"
    path.write_bytes(bytes(64 << 10))
    reader = KvikioReader(path, threads=4, timeout=30)
    futures = [reader.submit_read(i * 4096, DeviceBuffer(4096)) for i in range(3)]
    for future in futures:
        assert not future.cancel()  # what the restore driver does on an error: the transfers go on
    hung_kvikio.transfers[0].finish(4096)
    thread, errors = closing_in_a_thread(reader.close)
    time.sleep(0.1)
    assert thread.is_alive() and not hung_kvikio.files[0].closed
    hung_kvikio.transfers[2].finish(4096)
    time.sleep(0.05)
    assert thread.is_alive() and not hung_kvikio.files[0].closed
    hung_kvikio.transfers[1].finish(4096)
    assert_closed_cleanly(thread, errors, hung_kvikio)
    assert hung_kvikio.settings["thread_pool_nthreads"] == 1  # the settings found are back


def test_a_kvikio_reader_with_a_hung_read_keeps_its_file_open(hung_kvikio: HungKvikio, tmp_path: Path) -> None:
    from gdsckpt.io.kvikio import KvikioReader

    path = tmp_path / "file.bin"
    path.write_bytes(bytes(8192))
    reader = KvikioReader(path, threads=4, timeout=0.05)
    reader.submit_read(0, DeviceBuffer(4096))
    with pytest.raises(TimeoutError, match="kvikio reads of .* still running"):
        reader.close()
    assert not hung_kvikio.files[0].closed  # the read may still fill its buffer through it
    hung_kvikio.transfers[0].finish(4096)
    reader.close()
    assert hung_kvikio.files[0].closed and hung_kvikio.files[0].running_at_close == 0


def test_a_kvikio_writer_aborts_only_after_its_writes_stop(hung_kvikio: HungKvikio, tmp_path: Path) -> None:
    """A failed save aborts its writer with writes still in flight: the handle (and the descriptor
    numbers under it) is closed only once they stopped, or kept where one hangs past the timeout."""
    from gdsckpt.io.kvikio import KvikioWriter

    target = tmp_path / "state.gdsckpt"
    writer = KvikioWriter(target, threads=4, fsync=False, timeout=30)
    assert not writer.submit_write(0, DeviceBuffer(4096)).cancel()
    thread, errors = closing_in_a_thread(writer.abort)
    time.sleep(0.1)
    assert thread.is_alive() and not hung_kvikio.files[0].closed
    hung_kvikio.transfers[0].finish(4096)
    assert_closed_cleanly(thread, errors, hung_kvikio)
    assert not target.exists() and list(tmp_path.iterdir()) == []

    hung = KvikioWriter(target, threads=4, fsync=False, timeout=0.05)
    hung.submit_write(0, DeviceBuffer(4096))
    hung_kvikio.settings["thread_pool_nthreads"] = 4  # as the first writer's acquire set it
    hung.abort()  # returns (the save's own error is what the caller sees), the handle kept
    assert not hung_kvikio.files[1].closed and not target.exists()
    assert hung_kvikio.settings["thread_pool_nthreads"] == 4  # the pool is not replaced under the write
    hung_kvikio.transfers[1].finish(4096)
    hung.abort()  # once it stopped, a second abort closes the handle and gives the settings back
    assert hung_kvikio.files[1].closed and hung_kvikio.settings["thread_pool_nthreads"] == 1


def test_kvikio_transfers_forget_the_finished_ones() -> None:
    from gdsckpt.io.kvikio import _Transfers

    transfers = _Transfers()
    for _ in range(1000):
        done = ManualTransfer()
        done.finish(1)
        transfers.add(_KvikioFuture(done, 1, "read"))
    assert len(transfers._pending) == 1  # the latest, until the next add or wait
    assert transfers.wait(0)
    assert len(transfers._pending) == 0


def test_a_kvikio_reader_closes_after_reads_whose_results_were_taken(hung_kvikio: HungKvikio,
                                                                     tmp_path: Path) -> None:
    """The usual restore: every read's result taken, then close (kvikio's future is invalid after
    its ``get``: nothing may ask it again), and a cancel of a finished, unsettled read."""
    from gdsckpt.io.kvikio import KvikioReader

    path = tmp_path / "file.bin"
    path.write_bytes(bytes(16384))
    reader = KvikioReader(path, threads=4, timeout=5)
    buffers = [DeviceBuffer(4096) for _ in range(3)]
    futures = [reader.submit_read(i * 4096, buffer) for i, buffer in enumerate(buffers)]
    for transfer in hung_kvikio.transfers:
        transfer.finish(4096)
    assert futures[0].result(timeout=1) is buffers[0]
    assert futures[1].done() and futures[1].result() is buffers[1]
    assert futures[2].cancel() and futures[2].cancelled()
    assert all(future.transfer_done() for future in futures)
    reader.submit_read(3 * 4096, DeviceBuffer(4096))  # pruning asks the taken ones nothing either
    hung_kvikio.transfers[3].finish(4096)
    reader.close()
    assert hung_kvikio.files[0].closed and hung_kvikio.files[0].running_at_close == 0


@pytest.mark.parametrize("version, calls", [("26.10.00", [(0, 16 << 10, None)]),
                                            ("26.08.00", [(0, 16 << 10, 16 << 10)])])
def test_a_read_failing_part_way_closes_its_file_only_after_every_task_stops(
        hung_kvikio: HungKvikio, tmp_path: Path, version: str, calls: list[Any]) -> None:
    """kvikio splits a call into tasks; before 26.10 it ended the call's future at the first
    failed task while the others still ran. Under such a kvikio each read is one task (its
    ``task_size`` its length), so the failed read's close still waits for all of it: else the file
    would be closed, and the failed restore's buffer reused, under the tasks still reading."""
    from gdsckpt.io.kvikio import KvikioReader

    hung_kvikio.module.__version__ = version  # type: ignore[attr-defined]
    hung_kvikio.settings["task_size"] = 4096
    path = tmp_path / "file.bin"
    path.write_bytes(bytes(64 << 10))
    reader = KvikioReader(path, threads=4, timeout=30)
    future = reader.submit_read(0, DeviceBuffer(16 << 10))
    assert hung_kvikio.calls == calls
    hung_kvikio.transfers[0].fail(RuntimeError("KvikIO failure at: x: POSIX error on pread: Input/output error"))
    thread, errors = closing_in_a_thread(reader.close)
    time.sleep(0.05)
    for task in hung_kvikio.transfers[1:]:  # any task kvikio still runs: close waits for it
        assert thread.is_alive() and not hung_kvikio.files[0].closed
        task.finish(4096)
    assert_closed_cleanly(thread, errors, hung_kvikio)
    with pytest.raises(OSError, match="Input/output error"):
        future.result(timeout=5)


@pytest.mark.parametrize("version", ["26.10.00", "26.08.00"])
def test_a_write_failing_part_way_aborts_only_after_every_task_stops(hung_kvikio: HungKvikio, tmp_path: Path,
                                                                      version: str) -> None:
    """The same for a failed save (ENOSPC in one task of a chunk's write): its temporary file is
    closed and removed only once nothing writes through its descriptors."""
    from gdsckpt.io.kvikio import KvikioWriter

    hung_kvikio.module.__version__ = version  # type: ignore[attr-defined]
    hung_kvikio.settings["task_size"] = 4096
    target = tmp_path / "state.gdsckpt"
    writer = KvikioWriter(target, threads=4, fsync=False, timeout=30)
    future = writer.submit_write(8192, DeviceBuffer(12 << 10))
    hung_kvikio.transfers[0].fail(RuntimeError("KvikIO failure at: x: POSIX error on pwrite: No space left on device"))
    thread, errors = closing_in_a_thread(writer.abort)
    time.sleep(0.05)
    for task in hung_kvikio.transfers[1:]:
        assert thread.is_alive() and not hung_kvikio.files[0].closed
        task.finish(4096)
    assert_closed_cleanly(thread, errors, hung_kvikio)
    assert not target.exists()
    with pytest.raises(OSError) as caught:
        future.result(timeout=5)
    assert caught.value.errno == errno.ENOSPC


@pytest.mark.parametrize("version, one_task", [("26.10.00", False), ("27.02.00", False), ("26.08.00", True),
                                               ("25.10.0", True), ("", True), ("unknown", True)])
def test_calls_are_one_task_each_under_a_kvikio_that_ends_split_calls_early(
        hung_kvikio: HungKvikio, version: str, one_task: bool) -> None:
    from gdsckpt.io.kvikio import _one_task_calls

    hung_kvikio.module.__version__ = version  # type: ignore[attr-defined]
    assert _one_task_calls() is one_task


def test_a_finished_read_leaves_its_buffer_to_the_caller(hung_kvikio: HungKvikio, tmp_path: Path) -> None:
    """Once a read's result is taken (or it is cancelled after it finished), the reader holds
    nothing of it: its buffer goes with the caller's last reference. A restore closes a lead read
    it cannot hold and allocates its ring next, from the memory the lead's pieces just gave back;
    the reader had kept those finished reads (and their buffers) until its next read."""
    import gc
    import weakref

    from gdsckpt.io.kvikio import KvikioReader

    path = tmp_path / "file.bin"
    path.write_bytes(bytes(16384))
    reader = KvikioReader(path, threads=4, timeout=5)
    buffers = [DeviceBuffer(4096) for _ in range(3)]
    futures = [reader.submit_read(i * 4096, buffer) for i, buffer in enumerate(buffers)]
    held = [weakref.ref(buffer) for buffer in buffers]
    for transfer in hung_kvikio.transfers:
        transfer.finish(4096)
    assert futures[0].result(timeout=1) is buffers[0]
    assert futures[1].done()
    assert futures[2].cancel()
    del futures, buffers
    gc.collect()
    assert [ref() for ref in held] == [None, None, None]
    reader.submit_read(0, DeviceBuffer(4096))  # dropped at once by the caller, still running:
    running = weakref.ref(reader._transfers._pending[-1])
    gc.collect()
    assert running() is not None and running()._value is not None  # its buffer is kept for kvikio
    hung_kvikio.transfers[3].finish(4096)
    reader.close()
    assert hung_kvikio.files[0].closed and hung_kvikio.files[0].running_at_close == 0
