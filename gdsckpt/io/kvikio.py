"""kvikio / cuFile backend: writes and reads device buffers straight to and from the file.

Through GPUDirect Storage where the system has it (nvidia-fs), through kvikio's compat mode
(pinned bounce buffers and a POSIX thread pool) otherwise; ``name`` says which
(``"kvikio-gds"`` / ``"kvikio-compat"``). Host buffers and the index tail go through the POSIX
path this class inherits, as do the temporary file, fsync and atomic rename.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from .posix import PosixReader, PosixWriter


_POLL_SECONDS = 0.0005
"""How often a ``result(timeout=...)`` looks at an unfinished kvikio transfer (a 16 MiB chunk
takes ~8 ms at 2 GB/s: the poll adds at most a few percent of latency to the wait)."""


class _KvikioFuture(Future):  # type: ignore[type-arg]
    """A ``concurrent.futures.Future`` view of a kvikio ``IOFuture`` (polled; kvikio has no callbacks)."""

    def __init__(self, io_future: Any, expected: int, what: str, value: Any = None):
        super().__init__()
        self._io, self._expected, self._what, self._value = io_future, expected, what, value

    def done(self) -> bool:
        if not super().done() and self._io.done():
            self._settle()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        if not super().done():
            if timeout is not None:
                # kvikio's get() cannot time out: poll (it releases the GIL meanwhile) so that a
                # hung transfer fails the operation after ``timeout`` instead of blocking forever.
                deadline = time.monotonic() + timeout
                while not self._io.done():
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"kvikio {self._what} of {self._expected} bytes still running "
                                           f"after {timeout} s")
                    time.sleep(_POLL_SECONDS)
            self._settle()
        return super().result(timeout)

    def _settle(self) -> None:
        try:
            count = self._io.get()
            if count != self._expected:
                raise OSError(f"kvikio {self._what} moved {count} of {self._expected} bytes")
            self.set_result(self._value)
        except BaseException as err:  # noqa: BLE001 - delivered through the future
            self.set_exception(err)


def _configure(threads: int, task_size: int | None) -> None:
    import kvikio.defaults

    if kvikio.defaults.get("thread_pool_nthreads") != threads:
        kvikio.defaults.set("thread_pool_nthreads", threads)
    if task_size is not None:
        kvikio.defaults.set("task_size", task_size)


def kvikio_mode() -> str:
    """``"gds"`` when kvikio will use GPUDirect Storage, else ``"compat"``."""
    import kvikio.defaults

    return "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"


class KvikioWriter(PosixWriter):
    """``PosixWriter`` whose device-buffer writes go through ``kvikio.CuFile.pwrite``."""

    def __init__(self, target: str | os.PathLike[str], *, threads: int = 16, task_size: int | None = None,
                 o_direct: bool | str = "auto", fsync: bool = True):
        import kvikio

        super().__init__(target, threads=threads, o_direct=o_direct, fsync=fsync)
        try:
            _configure(threads, task_size)
            self._cufile = kvikio.CuFile(self.temp, "r+")
        except BaseException:
            self.abort()
            raise
        self.name = f"kvikio-{kvikio_mode()}"

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        if isinstance(data, (np.ndarray, bytes, bytearray, memoryview)):
            return super().submit_write(offset, data)
        return _KvikioFuture(self._cufile.pwrite(data, data.nbytes, offset), data.nbytes, "write")

    def commit(self) -> None:
        self._cufile.close()
        super().commit()

    def abort(self) -> None:
        cufile = getattr(self, "_cufile", None)
        if cufile is not None and not cufile.closed:
            cufile.close()
        super().abort()


class KvikioReader(PosixReader):
    """``PosixReader`` that reads into device buffers with ``kvikio.CuFile.pread``."""

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 16, task_size: int | None = None):
        import kvikio

        super().__init__(path, threads=threads)
        _configure(threads, task_size)
        self._cufile = kvikio.CuFile(self.path, "r")
        self.name = f"kvikio-{kvikio_mode()}"

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        if isinstance(out, np.ndarray):
            return super().submit_read(offset, out)
        if offset + out.nbytes > self.size:
            from ..errors import CorruptCheckpointError

            raise CorruptCheckpointError(f"range [{offset}, +{out.nbytes}) runs past the end of the file")
        return _KvikioFuture(self._cufile.pread(out, out.nbytes, offset), out.nbytes, "read", out)

    def close(self) -> None:
        cufile = getattr(self, "_cufile", None)
        if cufile is not None and not cufile.closed:
            cufile.close()
        super().close()
