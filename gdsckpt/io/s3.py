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
The object appears only when the upload completes, and obstore completes it as soon as the
iterator ends; so the iterator ends only when ``commit`` decides to complete, and ``abort`` (or
any failure, or a ``commit`` that gives up) makes it raise instead, after which obstore aborts the
upload: a reader never sees a partial object, no parts are left behind, and a save that reports
failure never replaces the object (``S3Writer`` tells how). Memory: the parts in flight
(``concurrency`` x ``part_bytes``, within ``Config.max_inflight_bytes``: ``upload_concurrency``)
and copies of at most ``QUEUED_WRITES`` writes waiting for them.

Reading (``S3Reader``): the size from one HEAD; the header, trailer and index with ranged GETs;
the chunks with ranged GETs on ``threads`` threads, copied into the caller's buffers. A chunk read
that arrives while every thread is busy joins the queued GET that ends where it starts (up to
``join_bytes``), the way O_DIRECT writes are joined (``io.posix``): on an object store each
request has a cost of its own, and a local SeaweedFS served 64 MiB ranges faster than 16 MiB ones
(docs/performance.md, "Object storage"). A read never waits for a join while a thread is free.
A joined GET's buffer holds only bytes the pipeline's reads already asked for, and the reader is
opened with ``join_bytes`` at most ``Config.max_inflight_bytes`` over its threads
(``api.resolve.open_reader``), so the GET buffers stay within the in-flight bound.
Every GET asks for the version the HEAD saw (``If-Match`` its ETag): an object replaced while it
is read (a save to the same key, which is atomic) fails the read with ``ObjectChangedError``, not
with a checksum error that would call an intact checkpoint damaged (reading on would mix two
versions).

URLs and endpoints are checked before obstore sees them (``split_url``, ``split_prefix``,
``check_bucket``, ``check_endpoint``): a malformed one makes obstore's Rust code panic rather than
fail, and the panic would reach the caller as ``pyo3_runtime.PanicException``, which is not an
``Exception``. A panic from any other cause is still turned into a ``CheckpointError`` where
obstore is called (``_is_store_failure``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import re
import threading
import time
import urllib.parse
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError, ObjectChangedError
from .base import StorageReader, StorageWriter
from .memory import done_future, host_bytes
from .pools import Lane

if TYPE_CHECKING:
    from obstore import GetOptions

SCHEME = "s3://"
PART_BYTES = 16 << 20
"""Multipart part size (S3 needs at least 5 MiB for every part but the last)."""
CONCURRENCY = 8
"""The most parts uploaded at once; fewer where ``Config.max_inflight_bytes`` holds fewer parts
(``upload_concurrency``)."""
JOIN_READ_BYTES = 32 << 20
"""The largest ranged GET joined from adjacent chunk reads (``S3Reader``'s default ``join_bytes``).
No more than glibc's largest threshold for serving allocations from freed memory (32 MiB on 64-bit
hosts): the response buffer of a larger GET is new memory from the kernel every time, and
faulting it in made a restore on 2 cores slower with 64 MiB joins than with 32 MiB ones
(docs/performance.md, "Object storage")."""
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
FINISH_SLACK = 5.0
"""Seconds ``S3Writer.commit`` allows, beyond obstore's own request bounds, for an upload to
complete once obstore took its last byte (``S3Writer.finish_bound``)."""
_END = object()
_ABORT = object()

_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")
"""A bucket name passed on to obstore: AWS's rules (3 to 63 characters: lower-case letters,
digits, dots and hyphens, a letter or digit at each end) widened to what S3-compatible servers
still take from older rules (upper case, underscores, up to 255 characters as Ceph allows), and no
further: any other character (a space, ``:``, ``@``, ``%``, ...) makes a request URI that
obstore's signing code cannot build, and it panics."""
_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
"""A host name of an endpoint (underscores included: container service names have them)."""
_STOPPING = (KeyboardInterrupt, SystemExit, GeneratorExit)


def upload_concurrency(max_inflight_bytes: int, part_bytes: int = PART_BYTES) -> int:
    """Parts a save uploads at once: as many as ``max_inflight_bytes`` holds, at least one, at most
    ``CONCURRENCY``, so that the upload's buffers stay within the save's in-flight bound."""
    return max(1, min(CONCURRENCY, max_inflight_bytes // part_bytes))


class _Aborted(Exception):
    """Raised inside the upload's iterator so that obstore aborts the multipart upload."""


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object (``s3://bucket/key``) rather than a file."""
    return isinstance(path, str) and path.startswith(SCHEME)


def check_bucket(bucket: str, url: str | None = None) -> str:
    """``bucket`` if obstore can address a bucket of that name (``_BUCKET``), else ``ValueError``
    naming it and ``url``, the URL it came from."""
    if not _BUCKET.fullmatch(bucket):
        where = f" (in {url!r})" if url is not None else ""
        raise ValueError(f"{bucket!r}{where} is not a valid bucket name: 3 to 255 letters, digits, dots, hyphens "
                         f"or underscores, a letter or digit at each end (AWS: 3 to 63, lower case, no underscores)")
    return bucket


def check_endpoint(endpoint: str, source: str = "S3 endpoint") -> str:
    """``endpoint`` if obstore can send requests to it: ``http://`` or ``https://``, a host name or
    IP address, a port from 1 to 65535 if any, a path if any, and no whitespace, user name, query
    or fragment; else ``ValueError`` naming it and ``source`` (where it was set). A malformed
    endpoint would make obstore panic at the first request rather than fail."""
    problem = _endpoint_problem(endpoint)
    if problem is not None:
        raise ValueError(f"{source} {endpoint!r} is not a usable S3 endpoint: {problem} "
                         f"(expected http://host:port or https://host[:port])")
    return endpoint


def _endpoint_problem(endpoint: str) -> str | None:
    """What makes ``endpoint`` unusable (``check_endpoint``), or None."""
    if any(char.isspace() or not char.isprintable() for char in endpoint):
        return "it holds whitespace or a control character"
    try:
        parts = urllib.parse.urlsplit(endpoint)
    except ValueError as err:  # an unclosed IPv6 bracket
        return str(err)
    try:
        port = parts.port
    except ValueError:  # out of range, or not a number
        return "the port must be a number from 1 to 65535"
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http:// or https://"
    host = parts.hostname or ""
    if not host:
        return "it names no host"
    if not (_HOST.fullmatch(host) or _is_ip_address(host)):
        return f"{host!r} is not a host name or an IP address"
    if port == 0:
        return "the port must be 1 to 65535"
    if parts.username is not None:
        return "credentials go in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, not in the endpoint"
    if parts.query or parts.fragment:
        return "it has a query or a fragment"
    return None


def _is_ip_address(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (``urlsplit`` drops an IPv6 one's brackets)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://bucket/key``; ``ValueError`` naming the URL for one without both,
    or whose bucket name obstore cannot address (``check_bucket``)."""
    rest = url[len(SCHEME):]
    bucket, _slash, key = rest.partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"{url!r} is not an object URL: expected s3://bucket/key (a key, not a prefix)")
    if "" in key.split("/"):
        # obstore drops an empty segment: s3://b//k would be written to s3://b/k, another key
        raise ValueError(f"{url!r} has an empty path segment in its key ({key!r}): the client would address "
                         f"another key; write s3://bucket/key without '//'")
    _refuse_control_characters(url, key)
    return check_bucket(bucket, url), key


def _refuse_control_characters(url: str, key: str) -> None:
    """``ValueError`` for a key or prefix holding an ASCII control character (a tab, a newline,
    DEL): the client cannot address such a key, and refused it only at the first request (a
    manager's uploads failed at ``wait()``, its ``remote=`` taken)."""
    bad = next((char for char in key if ord(char) < 32 or ord(char) == 127), None)
    if bad is not None:
        raise ValueError(f"{url!r} holds the control character {bad!r} in its key, which the S3 client "
                         f"cannot address: name objects without control characters")


def split_prefix(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://bucket`` or ``s3://bucket/some/prefix``: the prefix is empty
    or ends with ``/`` (a "directory" of objects). ``ValueError`` naming the URL as ``split_url``."""
    if not is_url(url):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _slash, prefix = url[len(SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: expected s3://bucket/prefix")
    check_bucket(bucket, url)
    prefix = prefix.strip("/")
    _refuse_control_characters(url, prefix)
    bad = [segment for segment in prefix.split("/") if segment in ("", ".", "..")] if prefix else []
    if bad:
        # the client drops an empty segment and refuses "." / "..": every object under the
        # prefix would go to another key, or fail only when the first upload runs
        raise ValueError(f"{url!r} has a path segment {bad[0]!r} in its prefix: write s3://bucket/a/b "
                         f"without '//', '.' or '..'")
    return bucket, f"{prefix}/" if prefix else ""


def open_store(bucket: str, endpoint: str | None = None, timeout: float | None = None) -> Any:
    """An obstore ``S3Store`` for ``bucket`` configured from the AWS environment (module
    docstring); ``endpoint`` (``Config.s3_endpoint``) before ``AWS_ENDPOINT_URL``. ``timeout``
    (``Config.timeout``) bounds each request and its retries, where it is shorter than obstore's
    own defaults (``REQUEST_TIMEOUT``, ``RETRY_TIMEOUT``): a server that stops answering fails the
    operation within about that time. ``ValueError`` for a bucket name or an endpoint obstore
    cannot use (``check_bucket``, ``check_endpoint``, naming where the endpoint was set);
    ``ImportError`` naming the extra to install when obstore is missing."""
    check_bucket(bucket)
    if endpoint:
        check_endpoint(endpoint, "Config.s3_endpoint (GDSCKPT_S3_ENDPOINT)")
    else:
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            check_endpoint(endpoint, "AWS_ENDPOINT_URL")
    try:
        from obstore.store import S3Store
    except ImportError as err:
        raise ImportError("s3:// checkpoints need obstore: pip install 'gdsckpt[s3]'") from err
    options: dict[str, Any] = {}
    if endpoint:
        options["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    client_options: Any = {"allow_http": True} if endpoint and endpoint.startswith("http://") else {}
    if timeout is not None:
        client_options["timeout"] = datetime.timedelta(seconds=min(timeout, REQUEST_TIMEOUT))
        options["retry_config"] = {"retry_timeout": datetime.timedelta(seconds=min(timeout, RETRY_TIMEOUT))}
    try:
        return S3Store(bucket, client_options=client_options or None, **options)
    except BaseException as err:
        if not _is_store_failure(err):
            raise
        raise _storage_error(err, "cannot set up the client for", f"{SCHEME}{bucket}") from err


def _is_store_failure(err: BaseException) -> bool:
    """Whether ``err``, raised by an obstore call, is that call failing (reported as a
    ``CheckpointError``) rather than the process being stopped (raised as it is). A panic in
    obstore's Rust code arrives as pyo3's ``PanicException``, which derives from
    ``BaseException`` so that ``except Exception`` does not swallow it; here it means only that
    the call failed. It is known by its name: its module, ``pyo3_runtime``, is made at run time
    by the first extension that needs it and is no package to import."""
    if isinstance(err, Exception):
        return True
    return type(err).__name__ == "PanicException" and not isinstance(err, _STOPPING)


_DENIED_TYPES = ("PermissionDeniedError", "UnauthenticatedError")
_DENIED_STATUS = re.compile(r"\b40[13] (Forbidden|Unauthorized)\b")
DENIED_HINT = ("access denied: check that the bucket exists, the credentials (AWS_ACCESS_KEY_ID / "
               "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and what the bucket's policy allows them")
"""Said with every failure the server answered 401 or 403: obstore names the request that failed
(a save's first request is a HEAD of its target), not that the credentials are the cause. A
missing bucket is among the causes: servers answer 403 for a bucket the caller cannot list (AWS
for one another account owns, SeaweedFS for one that does not exist)."""


_ABORT_FAILED = re.compile(r"\bDELETE\b\S*\s+\S*[?&]uploadId=")
ABORT_FAILED_HINT = ("the upload failed, and so did aborting it: the server may keep its parts until the "
                     "bucket's lifecycle rule for incomplete multipart uploads removes them")
"""Said where obstore's error is the failed abort (a DELETE of the upload): it reports that
request, not the part or the completion that failed first and made it abort."""


def _storage_error(err: BaseException, what: str, url: str) -> CheckpointError:
    """An obstore failure as gdsckpt's error, naming the object and what was being done, and
    ``DENIED_HINT`` where the server refused the credentials."""
    text = str(err)
    lines = text.strip().splitlines()
    kind = "obstore panicked" if type(err).__name__ == "PanicException" else type(err).__name__
    denied = type(err).__name__ in _DENIED_TYPES or _DENIED_STATUS.search(text) is not None
    hint = f" ({DENIED_HINT})" if denied else ""
    if _ABORT_FAILED.search(text):
        hint += f" ({ABORT_FAILED_HINT})"
    return CheckpointError(f"{what} {url}{hint}: {kind}: {lines[0][:300] if lines else '(no message)'}")


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
        except BaseException as err:
            if not _is_store_failure(err):
                raise
            raise _storage_error(err, "cannot list", self.url) from err
        return found

    def size(self, name: str) -> int | None:
        """The size of object ``name`` (one HEAD), None if there is none."""
        try:
            return int(self._obstore.head(self.store, self.prefix + name)["size"])
        except FileNotFoundError:
            return None
        except BaseException as err:
            if not _is_store_failure(err):
                raise
            raise _storage_error(err, "cannot look up", self.url_of(name)) from err

    def upload(self, path: str | os.PathLike[str], name: str) -> None:
        """Upload the local file ``path`` as object ``name``: a multipart upload of ``part_bytes``
        parts, ``concurrency`` at once (the memory it holds); the object appears whole or not at
        all."""
        from pathlib import Path

        source = Path(path)
        try:
            self._obstore.put(self.store, self.prefix + name, source, use_multipart=True,
                              chunk_size=self.part_bytes, max_concurrency=self.concurrency)
        except FileNotFoundError as err:
            if not source.exists():
                raise  # the local file is gone (pruned): the caller's to judge
            # The server's "not found" (the bucket, or the multipart upload aborted under it by
            # a lifecycle rule): a failed upload, never to be taken for a pruned file.
            raise _storage_error(err, "upload of", self.url_of(name)) from err
        except BaseException as err:
            if not _is_store_failure(err):
                raise
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
        except BaseException as err:
            if not _is_store_failure(err):
                raise
            raise _storage_error(err, "cannot read", self.url_of(name)) from err

    def write_small(self, name: str, data: bytes) -> None:
        """Replace object ``name`` with ``data`` (one PUT: readers see the old or the new)."""
        try:
            self._obstore.put(self.store, self.prefix + name, data, use_multipart=False)
        except BaseException as err:
            if not _is_store_failure(err):
                raise
            raise _storage_error(err, "cannot write", self.url_of(name)) from err

    def remove(self, name: str) -> None:
        """Delete object ``name`` (no error if it is already gone)."""
        try:
            self._obstore.delete(self.store, self.prefix + name)
        except FileNotFoundError:
            pass
        except BaseException as err:
            if not _is_store_failure(err):
                raise
            raise _storage_error(err, "cannot delete", self.url_of(name)) from err


_UPLOADS: weakref.WeakSet[S3Writer] = weakref.WeakSet()
"""Every ``S3Writer`` of this process still referenced: ``settle_uploads`` waits for theirs."""


def settle_uploads(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the upload threads of this process's writers to end
    (an aborted upload's thread ends once the server acknowledged the abort); True if they all
    did. For a process about to exit without unwinding (``os._exit``): a save interrupted while
    it waited for its upload's abort has returned, but the abort is still on its way, and exiting
    before it arrives leaves the upload's parts on the server."""
    deadline = time.monotonic() + timeout
    for writer in list(_UPLOADS):
        writer._upload_ended.wait(max(0.0, deadline - time.monotonic()))
    return all(writer._upload_ended.is_set() for writer in list(_UPLOADS))


class S3Writer(StorageWriter):
    """One multipart upload of the checkpoint's bytes, in file order (module docstring).

    ``obstore.put`` completes the upload as soon as the iterator it reads ends, and nothing stops
    it after that: the last part goes up, then CompleteMultipartUpload. The end of the stream is
    therefore the commit point, and it is handed over under a lock (``_state``) that makes "obstore
    took the end" and "the save gave up" exclusive:

    - ``commit`` queues the end marker and waits for obstore to take it (obstore takes an item only
      once the parts in flight leave room). It waits while obstore keeps taking the writes queued
      before it; once obstore has taken nothing for ``timeout`` it gives up: the state becomes
      aborted, the iterator raises at its next item, obstore aborts the upload, and the save fails
      with the object at the key as it was, within about ``timeout`` of the upload's last progress.
    - Once obstore has taken the end, ``commit`` waits for the outcome and reports it: every
      request obstore makes is bounded by ``timeout`` and its retries (``open_store``), so this
      ends, normally once the parts still in flight are up. ``finish_bound`` is a backstop against
      obstore overrunning those bounds; past it ``commit`` raises, saying the outcome is unknown.
    - ``abort`` (any failure before ``commit``, or ``commit``'s own) makes the state aborted; the
      iterator raises at its next item.

    So a save that reports failure does not replace the object, except where the server completed
    the upload and its answer was lost (no client can tell that from a failure). An interruption
    that arrives while ``commit`` waits for the outcome cannot stop the upload from completing.
    """

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
        self._state_changed = threading.Condition()
        self._state = "writing"
        """"writing"; "ending" once ``commit`` queued the end marker; "ended" once the iterator
        handed the end to obstore (which then completes the upload); "aborted": the iterator raises
        at its next item (obstore then aborts the upload). Changed under ``_state_changed``."""
        self._taken = 0
        """Items the iterator handed to obstore: ``commit``'s sign that the upload progresses."""
        self._upload_ended = threading.Event()
        """Set when the upload thread ends. Not ``Thread.is_alive``: a ``join`` interrupted by a
        ^C marks a running thread stopped (``Thread._wait_for_tstate_lock`` in CPython 3.11)."""
        self._thread = threading.Thread(target=self._upload, name="gdsckpt-s3-upload", daemon=True,
                                        args=(obstore, part_bytes, concurrency))
        self._thread.start()
        _UPLOADS.add(self)

    def _parts(self) -> Any:
        """The upload's byte stream: each queued write's bytes in turn. It ends (and obstore then
        completes the upload) at ``commit``'s end marker, unless the save gave up first: once the
        state is "aborted" it raises instead, and obstore aborts the upload."""
        while True:
            item = self._queue.get()
            with self._state_changed:
                if self._state == "aborted":
                    raise _Aborted("checkpoint save aborted")
                self._taken += 1
                if item is _END:
                    self._state = "ended"
                self._state_changed.notify_all()
            if item is _END:
                return
            yield item

    def _upload(self, obstore: Any, part_bytes: int, concurrency: int) -> None:
        try:
            obstore.put(self.store, self.key, self._parts(), use_multipart=True, chunk_size=part_bytes,
                        max_concurrency=concurrency)
        except BaseException as err:  # noqa: BLE001 - reported by commit / the futures
            self._error = err
            self._drop_queued()
        finally:
            self._upload_ended.set()
            with self._state_changed:
                self._state_changed.notify_all()  # commit waits for this thread's end too

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

    def finish_bound(self) -> float:
        """Seconds ``commit`` waits for the upload to complete once obstore took its end: the parts
        still in flight and the last one (at once), then CompleteMultipartUpload, each a request
        obstore ends within its retry window (``timeout``, at most ``RETRY_TIMEOUT``) plus the
        backoff before its last attempt (at most about as long) and that attempt (``timeout``, at
        most ``REQUEST_TIMEOUT``), and ``FINISH_SLACK`` besides."""
        window, attempt = min(self.timeout, RETRY_TIMEOUT), min(self.timeout, REQUEST_TIMEOUT)
        return 2 * (2 * window + attempt) + FINISH_SLACK

    def commit(self) -> None:
        """Complete the upload: the object appears at its key, whole. Or raise, and the object at
        the key is as it was (the class docstring tells how, and the one case it cannot know):
        ``TimeoutError`` where the upload took no data for ``timeout`` before its end, a
        ``CheckpointError`` naming the object where the upload failed."""
        with self._state_changed:
            self._state = "ending"
        self._enqueue(_END)
        with self._state_changed:
            taken, deadline = self._taken, time.monotonic() + self.timeout
            while self._state == "ending" and self._error is None and self._thread.is_alive():
                if self._taken != taken:  # progress: the timeout counts from the latest item taken
                    taken, deadline = self._taken, time.monotonic() + self.timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._state = "aborted"
                    break
                self._state_changed.wait(min(remaining, 1.0))
            state = self._state
        self._finished = True
        if state == "aborted":
            self.stalled = True  # the upload is stuck on a part: nothing to wait for in abort
            raise TimeoutError(f"upload of {self.url} took no data for {self.timeout} s before its end; "
                               f"aborted, the object there is as it was")
        if state != "ended":  # the upload failed before its end: obstore is aborting it
            self._thread.join(self.timeout)
            error = self._error or RuntimeError("the upload stopped before its end")
            raise _storage_error(error, "upload of", self.url) from error
        bound = self.finish_bound()
        self._thread.join(bound)
        if self._thread.is_alive():
            raise CheckpointError(f"upload of {self.url} still completing {bound:.0f} s after its last byte, "
                                  f"beyond the client's request timeouts: whether it replaced the object is unknown")
        if self._error is not None:
            raise _storage_error(self._error, "upload of", self.url) from self._error

    def abort(self) -> None:
        """Abort the upload (no object appears, no parts are left); safe more than once. Waits up to
        ``timeout`` (not at all once ``stalled``) for obstore to abort it. After ``commit`` handed
        obstore the end (an interrupted ``commit``), the upload completes regardless."""
        if self._finished:
            return
        self._finished = True
        with self._state_changed:
            if self._state == "ended":
                return
            self._state = "aborted"
        if self._thread.is_alive():
            self._drop_queued()  # make room: the writes queued will not be sent
            try:
                self._queue.put_nowait(_ABORT)  # wakes the iterator where it waits for a write
            except queue.Full:
                pass  # the iterator is not waiting: it raises at the next item it takes
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
            meta = obstore.head(self.store, self.key)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no object at {url}") from err
        except BaseException as err:
            if not _is_store_failure(err):
                raise
            raise _storage_error(err, "cannot read", url) from err
        self.size = int(meta["size"])
        self.etag: str | None = meta.get("e_tag") or None
        """The ETag of the version the HEAD saw, which every GET asks for (``If-Match``): a GET of
        a version saved since fails with ``ObjectChangedError``. None where the server names none;
        the GETs then read whatever version is there."""
        from obstore.exceptions import PreconditionError

        self._changed: type[BaseException] = PreconditionError
        self._lane = Lane("io", threads)
        self.join_bytes = join_bytes
        self._lock = threading.Lock()
        self._queued: _ReadGroup | None = None
        """The latest GET not yet started, which an adjacent read may join."""

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the object by one ranged GET;
        ``CorruptCheckpointError`` past its end."""
        return bytes(self._get(offset, length))

    def _get(self, offset: int, length: int) -> Any:
        if offset + length > self.size:
            raise CorruptCheckpointError(f"range [{offset}, +{length}) runs past the end of the object")
        if length == 0:
            return b""
        options: GetOptions = {"range": (offset, offset + length)}
        if self.etag is not None:
            options["if_match"] = self.etag
        try:
            data = self._obstore.get(self.store, self.key, options=options).bytes()
        except FileNotFoundError as err:
            # Deleted after it was opened (a concurrent prune): gone, as a local file unlinked
            # under its reader is not, but never an I/O error to retry.
            raise FileNotFoundError(f"{self.url} was deleted while it was read") from err
        except self._changed as err:
            raise ObjectChangedError(f"{self.url} was replaced while it was read (the server no longer holds the "
                                     f"version with ETag {self.etag} this read opened): the read stopped rather "
                                     f"than mix two versions; load it again") from err
        except BaseException as err:
            if not _is_store_failure(err):
                raise
            raise _storage_error(err, "ranged GET of", self.url) from err
        if len(data) != length:
            raise CorruptCheckpointError(f"ranged GET of {self.url} returned {len(data)} of {length} bytes")
        return data

    def submit_read(self, offset: int, out: Any) -> Future[Any]:
        """Read ``out.nbytes`` bytes at ``offset`` into ``out`` on the reader's threads; a read
        continuing the one queued before it joins it in one ranged GET, up to ``join_bytes``."""
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
        """Wait (up to ``timeout``) for queued and running reads; ``TimeoutError`` where one still
        runs, unless the restore has already failed on it."""
        if not self._lane.close(0.0 if self.stalled else self.timeout) and not self.stalled:
            raise TimeoutError(f"reads of {self.url} still running {self.timeout} s after close")
