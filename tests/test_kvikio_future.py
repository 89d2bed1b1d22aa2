"""``_KvikioFuture`` (the GPU writer's and reader's futures) honours timeouts and reports short
transfers; driven here by a stand-in for kvikio's ``IOFuture`` (fault injection: a transfer that
never finishes), since kvikio itself needs a GPU host."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

import gdsckpt
from gdsckpt.io.kvikio import _KvikioFuture, kvikio_error


class ManualTransfer:
    """An ``IOFuture`` look-alike that finishes when ``finish(count)`` is called."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._count = 0

    def finish(self, count: int) -> None:
        self._count = count
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def get(self) -> int:
        self._done.wait()
        return self._count


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
