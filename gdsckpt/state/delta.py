"""Delta checkpoints: arrays stored as the XOR of their bytes with a base checkpoint's.

Consecutive checkpoints of a training run differ little: the XOR of bf16 weights 10 AdamW steps
apart is mostly zero bits in the sign, exponent and high mantissa bytes, and compresses about twice
as well as the weights themselves on the GPU benchmark's state (docs/performance.md, "Delta
checkpoints"). ``save(..., base=PATH)`` stores every array whose
key, dtype and shape match an array of the base as that XOR (format 1.1: chunks whose chain begins
with ``xorbase/1``, and an index member ``base`` naming the base file and its content identity,
docs/format.md §6.8 and §9.5); ``load`` and every other read resolve the chain by themselves.

Memory stays bounded by configuration, not by the size of the arrays: the XOR is applied per
chunk as the save pipeline reads an array's bytes (``XorSource``) and as the restore pipeline
writes them (``XorTarget``), against windows of the base read on demand (``BaseBytes``), never
against a whole base array. A window is read through the base's own restore (its chunks only),
so a base that is itself a delta resolves recursively; ``max_chain`` bounds that recursion at
save time: a save whose base chain is already that deep writes a full checkpoint instead.

Why XOR and not a difference of values: it is exact for every dtype (NaN payloads, -0.0,
integers and bools included), costs one pass on either side, and unchanged bits come out as zero
bytes, which byte planes and any entropy coder compress to almost nothing.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError, DeltaBaseError

DEFAULT_MAX_CHAIN = 8
"""Deltas a load may have to resolve behind one checkpoint before a full one is written."""
HOST_WINDOW_BYTES = 64 << 20
DEVICE_WINDOW_BYTES = 64 << 20
"""Bytes of a base read at a time (host / GPU memory). Each window is one restore of the base
(engine, reads, decode): large enough to amortise that, small enough to stay a fixed cost. A
``BaseReader`` caches about two windows, and each link of a chain has one (kept while the file
that needs it is open, so that the next restore finds its cache): resolving a chain ``d`` deep
holds up to ``2 * d`` windows, 1 GiB at the default ``max_chain`` of 8."""


def base_link(delta_path: str | os.PathLike[str], base_path: str | os.PathLike[str], index_sha256: str,
              file_length: int, base_depth: int) -> dict[str, Any]:
    """The index's ``base`` member for a delta written at ``delta_path`` against ``base_path``.

    The path is stored relative to the delta's directory when the base lies beside it or below,
    so that a directory of checkpoints can be moved or copied as a whole; absolute otherwise. For
    objects (``s3://`` URLs) the same: relative where delta and base share a bucket and the base
    lies beside the delta or below, else the base's URL."""
    from ..io.s3 import is_url

    if is_url(delta_path) or is_url(base_path):
        return {"path": _object_link(str(delta_path), str(base_path)), "index_sha256": index_sha256,
                "file_length": file_length, "depth": base_depth + 1}
    delta_dir = Path(os.path.abspath(delta_path)).parent
    absolute = Path(os.path.abspath(base_path))
    try:
        stored = str(absolute.relative_to(delta_dir))
    except ValueError:
        stored = str(absolute)
    return {"path": stored, "index_sha256": index_sha256, "file_length": file_length, "depth": base_depth + 1}


def _object_link(delta_url: str, base: str) -> str:
    """``base_link``'s path where the delta or the base is an object."""
    from ..io.s3 import SCHEME, is_url

    if not is_url(base):
        return os.path.abspath(base)  # a local base of a delta object: its absolute path
    if not is_url(delta_url):
        return base
    delta_bucket, _slash, delta_key = delta_url[len(SCHEME):].partition("/")
    base_bucket, _slash, base_key = base[len(SCHEME):].partition("/")
    directory = posixpath.dirname(delta_key)
    if base_bucket == delta_bucket and (not directory or base_key.startswith(directory + "/")):
        return posixpath.relpath(base_key, directory or ".")
    return base


def base_path_of(delta_path: str | None, link: dict[str, Any]) -> Path:
    """Where the base named by ``link`` is, for a delta file at ``delta_path``."""
    path = Path(link["path"])
    if path.is_absolute():
        return path
    if delta_path is None:
        raise DeltaBaseError(f"the delta checkpoint names its base by the relative path "
                                  f"{link['path']!r}, but it was not opened from a path")
    # Relative to the directory the delta was written in: the real file's, which a symlink to
    # the delta elsewhere does not move (beside the link, an unrelated file of the base's name
    # may lie). Beside the link only where the real directory lacks it.
    real = Path(os.path.realpath(delta_path)).parent / path
    lexical = Path(os.path.abspath(delta_path)).parent / path
    return real if os.path.lexists(real) or not os.path.lexists(lexical) else lexical


def base_location_of(delta_location: str | None, link: dict[str, Any]) -> str | Path:
    """``base_path_of`` for a delta that may be an object: the base of a delta at
    ``s3://bucket/dir/key`` named by a relative path is the object at that path below
    ``s3://bucket/dir/`` (the manager's remote tier uploads a directory's files under their own
    names, so a delta finds its base beside it there as on disk). A relative path that climbs
    out of the bucket is refused with ``DeltaBaseError``."""
    from ..io.s3 import SCHEME, is_url

    if is_url(link["path"]):
        return str(link["path"])
    if delta_location is None or not is_url(delta_location) or Path(link["path"]).is_absolute():
        return base_path_of(delta_location, link)
    bucket, _slash, key = delta_location[len(SCHEME):].partition("/")
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(key), link["path"]))
    if joined.startswith("../") or joined in (".", ".."):
        raise DeltaBaseError(f"the delta {delta_location!r} names its base {link['path']!r} outside its bucket")
    return f"{SCHEME}{bucket}/{joined}"


def check_identity(base_path: Path | str, link: dict[str, Any], index_sha256: str, file_length: int) -> None:
    """Raise ``DeltaBaseError`` unless the opened base is the file the delta was written against."""
    if index_sha256 != link["index_sha256"] or file_length != link["file_length"]:
        raise DeltaBaseError(
            f"base checkpoint {str(base_path)!r} has changed since the delta was written against it "
            f"(index SHA-256 {index_sha256[:16]}..., {file_length} bytes; expected "
            f"{link['index_sha256'][:16]}..., {link['file_length']} bytes): restore the original base, "
            f"or load an older full checkpoint")


class BaseArrays(Protocol):
    """Where a delta's base bytes come from: the API hands a ``BaseReader`` one of these (an open
    base checkpoint), so this layer names only the protocol, never the API's classes."""

    def read_many(self, requests: list[tuple[str, int, int]], device: Any) -> list[Any]:
        """``[(key, start, stop), ...]`` and a device (None, or ``"cuda:N"``) -> the resolved bytes of
        each range of the base's arrays (distinct arrays) as flat uint8 arrays: NumPy for None,
        CuPy on that CUDA device otherwise; one restore of the base for the whole list."""
        ...


class BaseReader:
    """The resolved element bytes of a base checkpoint's arrays, fetched in batches and cached.

    A request for an array smaller than a quarter window fetches it together with the small
    arrays that follow it in ``sizes``' order (the order their bytes lie in the base file), up
    to one window, in a single restore; a larger
    array is read in windows at multiples of the window size. A read through a ``view`` with an
    ``extent`` (a window restore: ``get_rows``, a resharded DCP load) fetches no more than that
    extent of the array. Without batching, a state of many
    small arrays cost one restore (engine, reads, decode) per array and per link of a chain of
    deltas, which made a delta save many times slower than a full one. The cache keeps about two
    windows; thread-safe (the CPU engine asks from several threads): one window is fetched at a
    time, threads asking for another wait for that fetch,
    and threads asking for cached windows never wait for a fetch.

    ``read_ahead``: when a read reaches the window last read ahead (or is the first), the window
    after it is fetched on a thread of its own, while the codec threads work on this one; the
    cache then keeps about three windows (the one being read, one behind it that slower threads
    may still ask for, the one read ahead). For readers that go through the arrays once in
    ``sizes``' order (``rebase``, ``convert``); a delta's base is read where the delta's chunks
    need it and is not read ahead. ``close`` waits for a read ahead still running.
    ``window_bytes``: the window in host memory (default ``HOST_WINDOW_BYTES``)."""

    def __init__(self, source: BaseArrays, sizes: dict[str, int], *, timeout: float = 600.0,
                 read_ahead: bool = False, window_bytes: int | None = None):
        self._source = source
        self._sizes = sizes
        self._order = list(sizes)
        self._position = {key: i for i, key in enumerate(self._order)}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[Any, str, int, int], Any] = OrderedDict()
        self._cached_bytes = 0
        self._fetching: dict[tuple[Any, str, int], Future[dict[tuple[str, int, int], Any]]] = {}
        """(device, first key, first start) of each batch being fetched -> its outcome."""
        self._timeout = timeout
        self._read_ahead = read_ahead
        self._window_bytes = window_bytes
        self._ahead_mark: tuple[float, float] | None = None
        """(position, start) of the window last read ahead: a read before it starts no other."""
        self._ahead: Future[Any] | None = None

    def _window(self, device: Any) -> int:
        if device is None:
            return self._window_bytes or HOST_WINDOW_BYTES
        return DEVICE_WINDOW_BYTES

    def view(self, key: str, extent: tuple[int, int] | None = None) -> BaseBytes:
        """The bytes of one array (``key`` an array of the base). ``extent``: the only bytes of it
        the reads through this view ask for (a window restore's range), which bounds what is
        fetched for them."""
        return BaseBytes(self, key, self._sizes[key], extent)

    def read(self, key: str, start: int, stop: int, device: Any, extent: tuple[int, int] | None = None) -> Any:
        """Bytes ``[start, stop)`` of array ``key`` (host for ``device`` None, else ``"cuda:N"``).
        ``extent``: the range of the array the caller's reads stay in (``view``); None: any."""
        data = self._read(key, start, stop, device, extent)
        if self._read_ahead and stop > start:
            self._read_next(key, start, device)
        return data

    def _read(self, key: str, start: int, stop: int, device: Any, extent: tuple[int, int] | None) -> Any:
        if stop <= start:  # nothing to fetch (a zero-size array)
            if device is None:
                return np.empty(0, dtype=np.uint8)
            import cupy

            return cupy.empty(0, dtype=cupy.uint8)
        waited_failures = 0
        alone = False
        while True:
            with self._lock:
                hit = self._cached(key, start, stop, device)
                if hit is not None:
                    return hit
                batch = [(key, start, stop)] if alone else self._batch_for(key, start, stop, device, extent)
                future, owner = self._claim(batch, device)
            if owner:
                try:
                    fetched = self._fetch(batch, device, future)
                except CorruptCheckpointError:
                    if batch == [(key, start, stop)]:
                        raise
                    # A damaged chunk elsewhere in the batch (another small array, another part
                    # of a large one's window) says nothing of this range: fetched again alone
                    # (one fetch at a time, as ever), it fails only if its own chunks are damaged.
                    alone = True
                    continue
            else:
                try:
                    fetched = future.result(timeout=self._timeout)
                except FutureTimeout:
                    raise CheckpointError(f"reading {key!r} of the base waited more than {self._timeout} s for "
                                          f"another thread's read") from None
                except CorruptCheckpointError:
                    alone = True  # damage in another thread's batch: this range is fetched alone
                    continue
                except Exception:
                    # Another thread's fetch failed: fetch it here, and raise its error if that
                    # fails too.
                    waited_failures += 1
                    if waited_failures > 2:
                        raise
                    continue
            for (got_key, low, high), data in fetched.items():
                if got_key == key and low <= start and stop <= high:
                    return data[start - low:stop - low]
            # another thread's batch did not cover this range: look again

    def _read_next(self, key: str, start: int, device: Any) -> None:
        """Start fetching the window after the one holding ``(key, start)`` on a thread of its
        own, if this read reached the window last read ahead and no fetch runs (one at a time,
        as ever): O(1) for every other read, so a window of many small arrays is scanned once."""
        with self._lock:
            mark = (self._position[key], start)
            if self._fetching or (self._ahead_mark is not None and mark < self._ahead_mark):
                return
            following = self._following(key, start, device)
            if following is None:
                self._ahead_mark = (float("inf"), 0)
                return
            self._ahead_mark = (self._position[following[0]], following[1])
            if self._holds(following[0], following[1], device):
                return  # cached already: a read that reaches it looks further
            batch = self._batch_for(following[0], following[1], following[1] + 1, device)
            future, _owner = self._claim(batch, device)  # the owner: nothing else is fetching
            self._ahead = future

        def fetch() -> None:
            try:
                self._fetch(batch, device, future)
            except BaseException:  # noqa: BLE001 - the future holds it; a reader waiting on it fetches again
                pass
        threading.Thread(target=fetch, name="gdsckpt-read-ahead", daemon=True).start()

    def _following(self, key: str, start: int, device: Any) -> tuple[str, int] | None:
        """(key, start) of the window after the one holding ``(key, start)`` in ``sizes``' order
        (past the small arrays the cache holds); None at the end (caller holds the lock)."""
        size = self._window(device)
        if self._sizes[key] > size // 4:
            high = (start // size + 1) * size
            if high < self._sizes[key]:
                return key, high
        # One pass over the cache, then one over the keys: a batch of tens of thousands of small
        # arrays is walked once, not once per array against the whole cache.
        held = {cached_key for kind, cached_key, low, _high in self._cache if kind == device and low == 0}
        for position in range(self._position[key] + 1, len(self._order)):
            other = self._order[position]
            if self._sizes[other] and other not in held:
                return other, 0
        return None

    def _holds(self, key: str, start: int, device: Any) -> bool:
        return any(kind == device and cached_key == key and low <= start < high
                   for kind, cached_key, low, high in self._cache)

    def close(self) -> None:
        """Wait for a read ahead still running (its restore uses the base's open file)."""
        ahead = self._ahead
        if ahead is not None:
            try:
                ahead.result(timeout=self._timeout)
            except BaseException:  # noqa: BLE001 - a failed read ahead was nobody's read; a reader fetches again
                pass

    def _cached(self, key: str, start: int, stop: int, device: Any) -> Any:
        for entry, data in self._cache.items():
            kind, cached_key, low, high = entry
            if kind == device and cached_key == key and low <= start and stop <= high:
                self._cache.move_to_end(entry)
                return data[start - low:stop - low]
        return None

    def _batch_for(self, key: str, start: int, stop: int, device: Any,
                   extent: tuple[int, int] | None = None) -> list[tuple[str, int, int]]:
        """The ranges one restore fetches for a request (class docstring), within ``extent`` where
        the caller reads no other part of the array; caller holds the lock."""
        size = self._window(device)
        nbytes = self._sizes[key]
        lowest, highest = extent if extent is not None else (0, nbytes)
        if (lowest, highest) != (0, nbytes):
            # A window restore (``get_rows``, a resharded DCP read) asks for part of the array:
            # what it fetches of the base is bounded by that part, not by a window (a few rows
            # of a delta fetched 64 MiB of its base), nor joined by the small arrays after it.
            aligned = start // size * size
            return [(key, max(aligned, lowest), min(highest, max(stop, aligned + size)))]
        if nbytes <= size // 4:
            batch, total = [(key, 0, nbytes)], nbytes
            for other in self._order[self._position[key] + 1:]:
                other_bytes = self._sizes[other]
                if other_bytes > size // 4 or total + other_bytes > size:
                    break
                if other_bytes and not any(k == device and ck == other for k, ck, _l, _h in self._cache):
                    batch.append((other, 0, other_bytes))
                    total += other_bytes
            return batch
        # Windows at multiples of their size: chunks decoded out of order, and the windows a base
        # of a base is asked for, fall into the same few windows.
        low = start // size * size
        return [(key, low, min(nbytes, max(stop, low + size)))]

    def _claim(self, batch: list[tuple[str, int, int]], device: Any) -> tuple[Future[Any], bool]:
        """The future of ``batch``'s fetch, and whether the caller is to fetch it (caller holds
        the lock). One fetch runs at a time, which bounds the memory at the cache's windows and
        one being filled: while another batch is being fetched the caller waits for that one
        and then looks again."""
        ident = (device, batch[0][0], batch[0][1])
        future = self._fetching.get(ident)
        if future is not None:
            return future, False
        if self._fetching:
            return next(iter(self._fetching.values())), False
        future = Future()
        self._fetching[ident] = future
        return future, True

    def _fetch(self, batch: list[tuple[str, int, int]], device: Any,
               future: Future[dict[tuple[str, int, int], Any]]) -> dict[tuple[str, int, int], Any]:
        """Restore ``batch``, cache it and complete ``future`` (with the error, if it fails)."""
        size = self._window(device)
        kept = 3 * size if self._read_ahead else 2 * size
        ident = (device, batch[0][0], batch[0][1])
        try:
            data = self._source.read_many(batch, device)
        except BaseException as err:
            with self._lock:
                self._fetching.pop(ident, None)
            future.set_exception(err)
            raise
        fetched = dict(zip(batch, data))
        with self._lock:
            for (key, low, high), array in fetched.items():
                self._cache[(device, key, low, high)] = array
                self._cached_bytes += high - low
            while self._cached_bytes > kept and len(self._cache) > len(batch):
                (_kind, _key, low, high), _data = self._cache.popitem(last=False)
                self._cached_bytes -= high - low
            self._fetching.pop(ident, None)
        future.set_result(fetched)
        return fetched

class BaseBytes:
    """The resolved element bytes of one array of a base checkpoint (through a ``BaseReader``)."""

    def __init__(self, reader: BaseReader, key: str, nbytes: int, extent: tuple[int, int] | None = None):
        self.reader = reader
        self.key = key
        self.nbytes = nbytes
        self.extent = extent

    def host(self, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` in host memory."""
        return self.reader.read(self.key, start, stop, None, self.extent)

    def device(self, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` as a CuPy array on the current CUDA device."""
        import cupy

        return self.reader.read(self.key, start, stop, f"cuda:{cupy.cuda.runtime.getDevice()}", self.extent)


class XorSource:
    """An ``ArraySource`` whose bytes are the XOR of ``source``'s with the base's (save side)."""

    def __init__(self, source: Any, base: BaseBytes):
        self.source = source
        self.base = base
        self.nbytes = source.nbytes
        self.itemsize = source.itemsize
        self.plane_width = source.plane_width
        self.on_device = source.on_device

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        """The XOR of bytes ``[start, stop)``, in a new host array."""
        return np.bitwise_xor(self.source.host_bytes(start, stop), self.base.host(start, stop))

    def device_bytes(self, start: int, stop: int) -> Any:
        """The XOR of bytes ``[start, stop)``, in a new CuPy array on the source's device."""
        import cupy

        return cupy.bitwise_xor(self.source.device_bytes(start, stop), self.base.device(start, stop))

    def device_span(self, start: int, stop: int) -> None:
        """None: the XOR is computed, no range of device memory holds it (the encoder must not
        copy the unmodified source's bytes, which ``__getattr__`` would hand it)."""
        return None

    def __getattr__(self, name: str) -> Any:  # anything else the pipeline asks of a source
        return getattr(self.source, name)


class XorTarget:
    """An ``ArrayTarget`` that XORs delivered bytes with the base's before writing (load side).

    ``offset``: where the target's first byte lies in the array (a window restore). It offers no
    ``host_view``, so the restore never reads file bytes straight into the destination."""

    def __init__(self, target: Any, base: BaseBytes, offset: int = 0):
        self.target = target
        self.base = base
        self.offset = offset
        self.nbytes = target.nbytes
        self.on_device = target.on_device

    def write_host(self, start: int, data: np.ndarray) -> None:
        """XOR host bytes destined for ``[start, start + len(data))`` and write them."""
        position = self.offset + start
        self.target.write_host(start, np.bitwise_xor(data, self.base.host(position, position + data.nbytes)))

    def write_device(self, start: int, data: Any) -> None:
        """XOR device bytes (on the current device and stream) and write them."""
        import cupy

        position = self.offset + start
        with cupy.cuda.Device(data.device.id):
            base = self.base.device(position, position + data.nbytes)
            self.target.write_device(start, cupy.bitwise_xor(data, base))

    def finish(self) -> Any:
        """The finished destination."""
        return self.target.finish()
