"""Object storage: checkpoints at ``s3://bucket/key`` URLs (AWS S3 and compatible servers).

Through obstore (Rust's ``object_store``), which moved checkpoint bytes faster than boto3 on the
same server (docs/performance.md, "Object storage clients"). Credentials, region and endpoint
come from the standard AWS environment: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and
``AWS_SESSION_TOKEN``), ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), ``AWS_ENDPOINT_URL`` (or
``Config.s3_endpoint``) for a server other than AWS (MinIO, SeaweedFS, Ceph; ``http://``
endpoints are allowed).

Writing (``S3Writer``): the pipeline's writes arrive in file order (the header, then each chunk
at its placed offset, then the index and trailer), so they form one stream: the alignment gaps
between chunks are filled with zeros and the stream is one multipart upload (``obstore.put`` over
an iterator, parts of ``part_bytes``, ``concurrency`` at once). Nothing is kept on local disk.
The object appears only when ``commit`` completes the upload; ``abort`` (or any failure) makes
the iterator raise, and obstore then aborts the upload, so a reader never sees a partial object
and no parts are left behind. Memory: the parts in flight (``concurrency`` x ``part_bytes``, within
``Config.max_inflight_bytes``: ``upload_concurrency``) and copies of at most ``QUEUED_WRITES``
writes waiting for them.

Reading (``S3Reader``): the size from one HEAD; the header, trailer and index with ranged GETs;
the chunks with ranged GETs on ``threads`` threads, copied into the caller's buffers. A chunk read
that arrives while every thread is busy joins the queued GET that ends where it starts (up to
``join_bytes``), the way O_DIRECT writes are joined (``io.posix``): on an object store each
request has a cost of its own, and a local SeaweedFS served 64 MiB ranges faster than 16 MiB ones
(docs/performance.md, "Object storage"). A read never waits for a join while a thread is free.
A joined GET's buffer holds only bytes the pipeline's reads already asked for, and the reader is
opened with ``join_bytes`` at most ``Config.max_inflight_bytes`` over its threads
(``api.resolve.open_reader``), so the GET buffers stay within the in-flight bound.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError
from .base import StorageReader, StorageWriter
from .memory import done_future, host_bytes
from .pools import Lane

SCHEME = "s3://"
PART_BYTES = 16 << 20
"""Multipart part size (S3 needs at least 5 MiB for every part but the last)."""
CONCURRENCY = 8
"""The most parts uploaded at once; fewer where ``Config.max_inflight_bytes`` holds fewer parts
(``upload_concurrency``)."""
JOIN_READ_BYTES = 64 << 20
"""The largest ranged GET joined from adjacent chunk reads (``S3Reader``'s default ``join_bytes``)."""
READ_THREADS = 8
"""The fewest ranged GETs a reader keeps in flight, whatever ``Config.io_threads`` says: a GET
waits on the network and the server, not on a local core, so a 2-core host still needs several
at once (``Config.io_threads`` sizes local disk reads by cores)."""
REQUEST_TIMEOUT = 30.0
RETRY_TIMEOUT = 180.0
"""obstore's defaults (seconds): one request, and the retries of one since it began (``open_store``
shortens them to ``Config.timeout``)."""
QUEUED_WRITES = 4
"""Writes waiting for the upload's iterator; a further ``submit_write`` waits for room."""
_END = object()
_ABORT = object()


def upload_concurrency(max_inflight_bytes: int, part_bytes: int = PART_BYTES) -> int:
    """Parts a save uploads at once: as many as ``max_inflight_bytes`` holds, at least one, at most
    ``CONCURRENCY``, so that the upload's buffers stay within the save's in-flight bound."""
    return max(1, min(CONCURRENCY, max_inflight_bytes // part_bytes))


class _Aborted(Exception):
    """Raised inside the upload's iterator so that obstore aborts the multipart upload."""


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object (``s3://bucket/key``) rather than a file."""
    return isinstance(path, str) and path.startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://bucket/key``; ``ValueError`` for a URL without both."""
    rest = url[len(SCHEME):]
    bucket, _slash, key = rest.partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"{url!r} is not an object URL: expected s3://bucket/key (a key, not a prefix)")
    return bucket, key


def split_prefix(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://bucket`` or ``s3://bucket/some/prefix``: the prefix is empty
    or ends with ``/`` (a "directory" of objects)."""
    if not is_url(url):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _slash, prefix = url[len(SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: expected s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def open_store(bucket: str, endpoint: str | None = None, timeout: float | None = None) -> Any:
    """An obstore ``S3Store`` for ``bucket`` configured from the AWS environment (module
    docstring); ``endpoint`` (``Config.s3_endpoint``) before ``AWS_ENDPOINT_URL``. ``timeout``
    (``Config.timeout``) bounds each request and its retries, where it is shorter than obstore's
    own defaults (``REQUEST_TIMEOUT``, ``RETRY_TIMEOUT``): a server that stops answering fails the
    operation within about that time. ``ImportError`` naming the extra to install when obstore
    is missing."""
    try:
        from obstore.store import S3Store
    except ImportError as err:
        raise ImportError("s3:// checkpoints need obstore: pip install 'gdsckpt[s3]'") from err
    options: dict[str, Any] = {}
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    client_options: Any = {"allow_http": True} if endpoint and endpoint.startswith("http://") else {}
    if timeout is not None:
        client_options["timeout"] = datetime.timedelta(seconds=min(timeout, REQUEST_TIMEOUT))
        options["retry_config"] = {"retry_timeout": datetime.timedelta(seconds=min(timeout, RETRY_TIMEOUT))}
    return S3Store(bucket, client_options=client_options or None, **options)


def _storage_error(err: BaseException, what: str, url: str) -> CheckpointError:
    """An obstore failure as gdsckpt's error, naming the object and what was being done."""
    return CheckpointError(f"{what} {url}: {type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")


class ObjectDirectory:
    """The objects below one prefix (``s3://bucket/prefix/``) as a flat directory: list, upload a
    local file under a name, read and write small objects, delete. What the manager's remote tier
    needs; every failure is a ``CheckpointError`` naming the object (a missing one
    ``FileNotFoundError``)."""

    def __init__(self, url: str, *, endpoint: str | None = None, part_bytes: int = PART_BYTES,
                 concurrency: int = CONCURRENCY, timeout: float | None = None):
        import obstore

        self._obstore = obstore
        bucket, self.prefix = split_prefix(url)
        self.url = f"{SCHEME}{bucket}/{self.prefix}"
        self.store = open_store(bucket, endpoint, timeout)
        self.part_bytes = part_bytes
        self.concurrency = concurrency

    def url_of(self, name: str) -> str:
        """The URL of object ``name`` in this directory."""
        return self.url + name

    def names(self) -> dict[str, int]:
        """Name -> size of every object directly in this directory (not below a further ``/``)."""
        found: dict[str, int] = {}
        try:
            for batch in self._obstore.list(self.store, self.prefix or None, chunk_size=1000):
                for meta in batch:
                    name = str(meta["path"])[len(self.prefix):]
                    if name and "/" not in name:
                        found[name] = int(meta["size"])
        except Exception as err:
            raise _storage_error(err, "cannot list", self.url) from err
        return found

    def size(self, name: str) -> int | None:
        """The size of object ``name`` (one HEAD), None if there is none."""
        try:
            return int(self._obstore.head(self.store, self.prefix + name)["size"])
        except FileNotFoundError:
            return None
        except Exception as err:
            raise _storage_error(err, "cannot read", self.url_of(name)) from err

    def upload(self, path: str | os.PathLike[str], name: str) -> None:
        """Upload the local file ``path`` as object ``name``: a multipart upload of ``part_bytes``
        parts, ``concurrency`` at once (the memory it holds); the object appears whole or not at
        all."""
        from pathlib import Path

        try:
            self._obstore.put(self.store, self.prefix + name, Path(path), use_multipart=True,
                              chunk_size=self.part_bytes, max_concurrency=self.concurrency)
        except FileNotFoundError:
            raise
        except Exception as err:
            raise _storage_error(err, "upload of", self.url_of(name)) from err

    def read_small(self, name: str, limit: int) -> bytes:
        """The content of object ``name``, at most ``limit`` bytes (``CorruptCheckpointError`` if
        larger); ``FileNotFoundError`` if there is none."""
        key = self.prefix + name
        try:
            size = int(self._obstore.head(self.store, key)["size"])
            if size > limit:
                raise CorruptCheckpointError(f"{self.url_of(name)} holds {size} bytes, more than {limit}")
            return bytes(self._obstore.get(self.store, key).bytes()) if size else b""
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as err:
            raise _storage_error(err, "cannot read", self.url_of(name)) from err

    def write_small(self, name: str, data: bytes) -> None:
        """Replace object ``name`` with ``data`` (one PUT: readers see the old or the new)."""
        try:
            self._obstore.put(self.store, self.prefix + name, data, use_multipart=False)
        except Exception as err:
            raise _storage_error(err, "cannot write", self.url_of(name)) from err

    def remove(self, name: str) -> None:
        """Delete object ``name`` (no error if it is already gone)."""
        try:
            self._obstore.delete(self.store, self.prefix + name)
        except FileNotFoundError:
            pass
        except Exception as err:
            raise _storage_error(err, "cannot delete", self.url_of(name)) from err


class S3Writer(StorageWriter):
    """One multipart upload of the checkpoint's bytes, in file order (module docstring)."""

    name = "s3"

    def __init__(self, url: str, *, part_bytes: int = PART_BYTES, concurrency: int = CONCURRENCY,
                 timeout: float = 600.0, endpoint: str | None = None):
        import obstore

        self.url = url
        bucket, self.key = split_url(url)
        self.store = open_store(bucket, endpoint, timeout)
        self.timeout = timeout
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUED_WRITES)
        self._position = 0
        self._error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._upload, name="gdsckpt-s3-upload", daemon=True,
                                        args=(obstore, part_bytes, concurrency))
        self._thread.start()

    def _parts(self) -> Any:
        """The upload's byte stream: each queued write's bytes in turn, until ``commit``'s end
        marker (or ``abort``'s, which raises: obstore then aborts the upload)."""
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if item is _ABORT:
                raise _Aborted("checkpoint save aborted")
            yield item

    def _upload(self, obstore: Any, part_bytes: int, concurrency: int) -> None:
        try:
            obstore.put(self.store, self.key, self._parts(), use_multipart=True, chunk_size=part_bytes,
                        max_concurrency=concurrency)
        except BaseException as err:  # noqa: BLE001 - reported by commit / the futures
            self._error = err
            self._drop_queued()

    def _drop_queued(self) -> None:
        """Drop the writes still queued (the upload stopped taking them, or was aborted)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _enqueue(self, item: Any) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if self._error is not None or not self._thread.is_alive():
                raise _storage_error(self._error or RuntimeError("upload stopped"), "upload of", self.url)
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if time.monotonic() > deadline:  # the upload took nothing for a whole timeout
                    self.stalled = True
                    raise TimeoutError(f"upload of {self.url} took no data for {self.timeout} s") from None

    def submit_write(self, offset: int, data: Any) -> Future[None]:
        """Queue a copy of ``data`` at ``offset`` (at or after the end of the previous write: the
        gap is zeros) and return a completed future: the pipeline's buffer is free at once (the
        upload takes the copy in its own time; the header's write, which the pipeline waits for
        before any chunk, could otherwise never complete). Waits while ``QUEUED_WRITES`` copies
        are queued. Device buffers are copied to host memory."""
        if offset < self._position:
            raise ValueError(f"object writes must come in file order: {offset} after {self._position}")
        if offset > self._position:
            self._enqueue(bytes(offset - self._position))
        copy = data if isinstance(data, bytes) else bytes(host_bytes(data))
        self._enqueue(copy)
        self._position = offset + len(copy)
        return done_future()

    def write_tail(self, offset: int, data: bytes) -> None:
        """Queue the index and trailer (the last bytes of the object)."""
        self.submit_write(offset, data)

    def commit(self) -> None:
        """Complete the upload: the object appears at its key, whole."""
        self._enqueue(_END)
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"upload of {self.url} still running after {self.timeout} s")
        self._finished = True
        if self._error is not None:
            raise _storage_error(self._error, "upload of", self.url) from self._error

    def abort(self) -> None:
        """Abort the upload (no object appears, no parts are left); safe more than once."""
        if self._finished:
            return
        self._finished = True
        if self._thread.is_alive():
            self._drop_queued()  # make room: the writes queued will not be sent
            self._queue.put(_ABORT)
            self._thread.join(0.0 if self.stalled else self.timeout)


class _ReadGroup:
    """Adjacent reads served by one ranged GET: ``[offset, end)`` and each read's buffer and future."""

    def __init__(self, offset: int, end: int, reads: list[tuple[Any, Future[Any]]]):
        self.offset, self.end, self.reads = offset, end, reads


def _deliver(data: np.ndarray, out: Any) -> None:
    """Copy ``data`` into ``out``, a host array or a CuPy array."""
    if hasattr(out, "__cuda_array_interface__"):
        import cupy

        # this is a pool thread: it makes the buffer's device current before touching it
        with cupy.cuda.Device(out.device.id):
            out.set(data)
            cupy.cuda.get_current_stream().synchronize()
    else:
        out[...] = data


class S3Reader(StorageReader):
    """Ranged GETs of one object (module docstring)."""

    name = "s3"

    def __init__(self, url: str, *, threads: int = READ_THREADS, timeout: float = 600.0,
                 endpoint: str | None = None, join_bytes: int = JOIN_READ_BYTES):
        import obstore

        self._obstore = obstore
        self.url = url
        self.path = url
        """Where a delta read through this reader finds its base (``base_location_of``)."""
        bucket, self.key = split_url(url)
        self.store = open_store(bucket, endpoint, timeout)
        self.timeout = timeout
        try:
            self.size = int(obstore.head(self.store, self.key)["size"])
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no object at {url}") from err
        except Exception as err:
            raise _storage_error(err, "cannot read", url) from err
        self._lane = Lane("io", threads)
        self.join_bytes = join_bytes
        self._lock = threading.Lock()
        self._queued: _ReadGroup | None = None
        """The latest GET not yet started, which an adjacent read may join."""

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._get(offset, length))

    def _get(self, offset: int, length: int) -> Any:
        if offset + length > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{length}) runs past the end of the object")
        if length == 0:
            return b""
        try:
            data = self._obstore.get_range(self.store, self.key, start=offset, length=length)
        except Exception as err:
            raise _storage_error(err, "ranged GET of", self.url) from err
        if len(data) != length:
            raise CorruptCheckpointError(f"ranged GET of {self.url} returned {len(data)} of {length} bytes")
        return data

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            group = self._queued
            if (group is not None and group.end == offset
                    and group.end - group.offset + out.nbytes <= self.join_bytes):
                group.reads.append((out, future))
                group.end += out.nbytes
                return future
            group = self._queued = _ReadGroup(offset, offset + out.nbytes, [(out, future)])
        try:
            self._lane.submit(self._fetch, group)
        except BaseException:
            with self._lock:
                if self._queued is group:
                    self._queued = None
            raise
        return future

    def _fetch(self, group: _ReadGroup) -> None:
        """One ranged GET for every read of ``group`` (on a lane thread), each copied into its
        buffer; a read cancelled meanwhile is skipped, a failure fails every read of the group."""
        with self._lock:
            if self._queued is group:
                self._queued = None  # started: no read joins it any more
        reads, start = [], 0
        for out, future in group.reads:
            if future.set_running_or_notify_cancel():
                reads.append((out, start, future))
            start += out.nbytes
        try:
            data = np.frombuffer(memoryview(self._get(group.offset, group.end - group.offset)), dtype=np.uint8)
        except BaseException as err:
            for _out, _start, future in reads:
                future.set_exception(err)
            if not isinstance(err, Exception):
                raise
            return
        for out, start, future in reads:
            try:
                _deliver(data[start:start + out.nbytes], out)
            except BaseException as err:
                future.set_exception(err)
                if not isinstance(err, Exception):
                    raise
            else:
                future.set_result(out)

    def close(self) -> None:
        if not self._lane.close(0.0 if self.stalled else self.timeout) and not self.stalled:
            raise TimeoutError(f"reads of {self.url} still running {self.timeout} s after close")
