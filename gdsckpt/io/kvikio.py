"""kvikio / cuFile backend: writes and reads device buffers straight to and from the file.

Through GPUDirect Storage where the system has it (nvidia-fs), through kvikio's compat mode
(pinned bounce buffers and a POSIX thread pool) otherwise; ``name`` says which
(``"kvikio-gds"`` / ``"kvikio-compat"``). Host buffers and the index tail go through the POSIX
path this class inherits, as do the temporary file, fsync and atomic rename.
"""

from __future__ import annotations

import errno
import os
import re
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from .posix import PosixReader, PosixWriter


_POLL_SECONDS = 0.0005
"""How often a ``result(timeout=...)`` looks at an unfinished kvikio transfer (a 16 MiB chunk
takes ~8 ms at 2 GB/s: the poll adds at most a few percent of latency to the wait). A thread
polling like this beside a training loop did not slow it on the H200 (async_profile, run 9:
31.3 ms per step against 31.4 idle)."""



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
        except RuntimeError as err:
            self.set_exception(kvikio_error(err, self._what, self._expected))
        except BaseException as err:  # noqa: BLE001 - delivered through the future
            self.set_exception(err)


_KVIKIO_POSIX = re.compile(r"POSIX error on p(?:read|write):\s*(.*)")
_BY_STRERROR = {os.strerror(code): code for code in errno.errorcode}


def kvikio_error(err: RuntimeError, what: str, nbytes: int) -> BaseException:
    """kvikio reports a failed transfer as a bare ``RuntimeError`` ("KvikIO failure at ...: POSIX
    error on pread: EIO"), measured on the H200 host: turn it into what the POSIX path raises, so
    the pipeline names the chunk and tensor and the manager treats it as damage: an ``OSError``
    with the errno kvikio names (EIO when it names none), or ``CorruptCheckpointError`` when a
    read hit the end of the file (a file truncated after its index was read)."""
    message = str(err)
    match = _KVIKIO_POSIX.search(message)
    detail = match.group(1).strip() if match else ""
    if detail.startswith("EOF"):
        from ..errors import CorruptCheckpointError

        return CorruptCheckpointError(f"file ends inside a {nbytes}-byte {what} the index names ({message})")
    # kvikio names the error by its text ("File too large") or, in some versions, its symbol.
    code = next((c for text, c in _BY_STRERROR.items() if detail.startswith(text)), None)
    if code is None:
        symbol = getattr(errno, detail.split(" ")[0], None) if detail else None
        code = symbol if isinstance(symbol, int) else errno.EIO
    error = OSError(code, f"{os.strerror(code)} (kvikio {what} of {nbytes} bytes: {message})")
    error.__cause__ = err
    return error


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
        try:
            io_future = self._cufile.pwrite(data, data.nbytes, offset)
        except RuntimeError as err:
            raise kvikio_error(err, "write", data.nbytes) from err
        return _KvikioFuture(io_future, data.nbytes, "write")

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
        try:
            io_future = self._cufile.pread(out, out.nbytes, offset)
        except RuntimeError as err:
            raise kvikio_error(err, "read", out.nbytes) from err
        return _KvikioFuture(io_future, out.nbytes, "read", out)

    def close(self) -> None:
        cufile = getattr(self, "_cufile", None)
        if cufile is not None and not cufile.closed:
            cufile.close()
        super().close()
