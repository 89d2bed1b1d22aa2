"""The restore driver: open and validate a file, then read every needed chunk in parallel and
decode as reads land, within a memory bound.

Opening reads the trailer, the header and the index (checksummed), and validates the index
completely before anything is allocated from it (``format.parse_index``). Restoring issues chunk
reads in file order until ``max_inflight_bytes`` of read buffers and decoded bytes are
outstanding; each completed read is verified and decoded by the engine, which hands the raw bytes
to the destination arrays. Only the chunks that hold the wanted arrays are read.

Grouped reads: where the engine offers a read arena (the GPU decoder), a run of chunks that
follow each other in the file is read with one call into one piece of it (``Decoder.read_arena``),
each chunk decoded from its bytes there; a piece is reused once all its chunks are decoded. Every
read call hands the interpreter's lock back and forth, and taking it back beside a thread running
Python waits up to the switch interval: fewer, larger calls (docs/performance.md, "Fast tiers").
A grouped read that fails (an I/O error, the end of a truncated file) is not the end of the
restore: each of its chunks is read again on its own, so the error, if it recurs, names the chunk
whose bytes cannot be read, and chunks the failed call merely spanned are restored.

Direct reads: on the CPU engine, a chunk stored as ``none/1`` whose raw bytes all go to one
contiguous range of host memory (``target.host_view``) is read straight into that memory; the
engine then checks its CRC-32C there (``none/1`` decodes without copying) and nothing is copied.
A target whose host memory overlaps another target's gets no direct reads: another read could
write that memory between the read and the check of its CRC.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NoReturn, Protocol

from .. import collector
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import (
    HEADER_REGION,
    HEADER_SIZE,
    MAGIC,
    TRAILER_SIZE,
    Header,
    Index,
    Trailer,
    align_up,
    checksum,
    parse_index,
    unpack_header,
    unpack_trailer,
)
from ..io.base import StorageReader
from .engine import Engine
from .plan import ArrayTarget


class OpenBase(Protocol):
    """A delta's open base as this layer sees it: the API opens it (a checkpoint) and hands it
    down; the restore pipeline only keeps it with the file it serves and closes it."""

    def close(self) -> None:
        """Release the base's reader and, through it, the rest of its chain."""
        ...


@dataclass
class OpenedFile:
    """A validated checkpoint: its header, trailer and index."""

    header: Header
    trailer: Trailer
    index: Index
    index_sha256: str = ""
    """SHA-256 of the index bytes: the content identity a delta checkpoint records of its base
    (the index holds every chunk's CRC-32C, offset and size, so any change to the file shows)."""
    path: str | None = None
    """The file's path, where the reader has one (a delta's relative base path resolves from it)."""
    base: tuple[OpenBase, Any] | None = None
    """A delta's base, opened once by the first restore that needs it and kept for the next ones,
    with the reader of its bytes (and that reader's cache); closed by ``close_base``."""
    closed: bool = False
    """Set when the file is closed (``Checkpoint.close``): no restore opens the base again."""

    def close_base(self) -> None:
        """Close the base this file's restores opened (and, through it, the rest of the chain)."""
        if self.base is not None:
            checkpoint, self.base = self.base[0], None
            checkpoint.close()


def _path_of(reader: StorageReader) -> str | None:
    """The file's path where the reader has one (a delta's relative base path resolves from it)."""
    path = getattr(reader, "path", None)
    return None if path is None else str(path)


def open_file(reader: StorageReader) -> OpenedFile:
    """Read and validate header, trailer and index through ``reader``."""
    if reader.size < HEADER_REGION + TRAILER_SIZE:
        head = reader.read(0, min(reader.size, HEADER_SIZE))
        if len(head) == HEADER_SIZE or head[:len(MAGIC)] != MAGIC:
            unpack_header(head)  # a foreign file says so before "truncated" does
        raise CorruptCheckpointError(f"file is {reader.size} bytes: truncated")
    header = unpack_header(reader.read(0, HEADER_SIZE))
    trailer, index_bytes = _trailer_and_index(reader)
    # the objects a restore keeps alive scale with its index: its full collections wait for them
    collector.expect(len(index_bytes) // collector.INDEX_BYTES_PER_OBJECT)
    return OpenedFile(header, trailer, parse_index(index_bytes, index_offset=trailer.index_offset),
                      hashlib.sha256(index_bytes).hexdigest(),
                      _path_of(reader))


def content_identity(reader: StorageReader) -> tuple[str, int]:
    """(SHA-256 of the index bytes, file length): the identity a delta records of its base
    (``OpenedFile.index_sha256``), read without parsing the index (for a file with many tensors the
    parse is what costs: ~0.1 ms per tensor). Raises ``CorruptCheckpointError`` for a file whose
    trailer or index checksum is wrong."""
    if reader.size < HEADER_REGION + TRAILER_SIZE:
        raise CorruptCheckpointError(f"file is {reader.size} bytes: truncated")
    trailer, index_bytes = _trailer_and_index(reader)
    return hashlib.sha256(index_bytes).hexdigest(), trailer.file_length


def _trailer_and_index(reader: StorageReader) -> tuple[Trailer, bytes]:
    """The trailer and the index bytes it names, their checksum checked (the file is known to be
    long enough for a trailer)."""
    trailer = unpack_trailer(reader.read(reader.size - TRAILER_SIZE, TRAILER_SIZE), reader.size)
    index_bytes = reader.read(trailer.index_offset, trailer.index_length)
    if checksum(index_bytes) != trailer.index_crc:
        raise CorruptCheckpointError("index checksum mismatch")
    return trailer, index_bytes


Delivery = tuple[int, int, int, int]
"""(array id, offset in the chunk's raw bytes, length, offset in the array's bytes)."""


class DeferredTargets:
    """The targets of a restore, each made only when the restore first decodes a chunk holding its
    bytes: ``make(i)`` returns array ``i``'s target, for ``i`` in ``ids``. A decoder that writes
    device memory itself (the GPU decoder) needs a destination only when a chunk of it is decoded,
    so the storage reads, and the decoder works on the first chunks, while the rest of hundreds of
    destination arrays are made: made all at once before the first decode, they held the decoder
    back while the read arena filled (docs/performance.md, "Fast tiers"). ``take(ids)`` makes those
    of ``ids`` not made yet and returns them; ``resolve()`` makes every one left and returns all."""

    def __init__(self, ids: list[int], make: Callable[[int], ArrayTarget]):
        self.ids = ids
        self._make = make
        self._announced = set(ids)
        self._made: dict[int, ArrayTarget] = {}

    def take(self, ids: list[int]) -> dict[int, ArrayTarget]:
        """The targets of ``ids``, made where not made yet."""
        for array_id in ids:
            if array_id not in self._made:
                if array_id not in self._announced:
                    raise ValueError(f"deferred target {array_id} asked for but not announced")
                self._made[array_id] = self._make(array_id)
        return {array_id: self._made[array_id] for array_id in ids}

    def resolve(self) -> dict[int, ArrayTarget]:
        """Every target, made where not made yet."""
        self.take(self.ids)
        return dict(self._made)


def run_restore(reader: StorageReader, index: Index, engine: Engine,
                targets: dict[int, ArrayTarget] | DeferredTargets, *,
                max_inflight_bytes: int, timeout: float | None = None,
                progress: Callable[[int, int], None] | None = None,
                windows: dict[int, tuple[int, int]] | None = None) -> int:
    """Fill ``targets`` (array id -> target) from the file; returns the stored bytes read.

    ``targets`` may be ``DeferredTargets`` where the engine decodes on a device (not the CPU
    engine, which may read straight into a target's memory): each is made just before the first
    chunk holding its bytes is decoded. ``windows``: array id -> byte range ``[start, stop)`` of that array to
    restore (its target holds just those bytes); only the chunks overlapping the range are read."""
    deferred = targets if isinstance(targets, DeferredTargets) else None
    made: dict[int, ArrayTarget] = {} if isinstance(targets, DeferredTargets) else targets
    if deferred is not None and engine.name == "cpu":
        raise ValueError("the CPU engine needs its targets before the reads start")
    deliveries: dict[int, list[Delivery]] = {}
    for array_id in (deferred.ids if deferred is not None else list(made)):
        window = windows.get(array_id) if windows else None
        position = 0
        if window is None:
            # the whole array: its segments fill it in order from byte 0 (the index guarantees
            # that they add up to its size), so nothing is clipped
            for chunk, raw_offset, length in index.tensors[array_id].segments:
                deliveries.setdefault(chunk, []).append((array_id, raw_offset, length, position))
                position += length
            continue
        start, stop = window
        for segment in index.tensors[array_id].segments:
            low, high = max(position, start), min(position + segment.length, stop)
            if low < high:
                deliveries.setdefault(segment.chunk, []).append(
                    (array_id, segment.raw_offset + low - position, high - low, low - start))
            position += segment.length

    whole = {} if deferred is not None else _whole_chunk_views(index, engine, made, deliveries)
    # Stored as they are: read straight into the destination. Otherwise: decoded into it.
    direct = {chunk: view for chunk, view in whole.items() if _stored_as_is(index, chunk)}
    into = {chunk: view for chunk, view in whole.items() if chunk not in direct}
    host_only: set[int] = set()
    places: dict[int, list[tuple[int, int, int]]] = {}

    def know_destinations(chunks: dict[int, list[Delivery]]) -> None:
        """Fill ``host_only`` and ``places`` for ``chunks`` (chunk -> its deliveries), whose
        targets are in ``made``."""
        host_only.update(chunk for chunk, wanted in chunks.items()
                         if not any(getattr(made[array_id], "on_device", True) for array_id, *_rest in wanted))
        places.update(_device_places(engine, made, chunks))

    def know_chunk(chunk: int) -> None:
        """Make the deferred targets of ``chunk``'s arrays, then note where its bytes go (called
        before the chunk's decode)."""
        wanted = deliveries.get(chunk)
        if deferred is None or not wanted:
            return
        made.update(deferred.take([array_id for array_id, *_rest in wanted if array_id not in made]))
        know_destinations({chunk: wanted})

    def deliver_to_targets(chunk: int) -> Callable[[Any], None]:
        if chunk in direct:
            return _already_in_place

        def deliver(raw: Any) -> None:
            for array_id, raw_offset, length, position in deliveries[chunk]:
                target = made[array_id]
                piece = raw[raw_offset:raw_offset + length]
                if hasattr(piece, "__cuda_array_interface__"):  # decoded on a GPU
                    target.write_device(position, piece)
                else:
                    target.write_host(position, piece)
        return deliver

    if deferred is None:
        know_destinations(deliveries)
    stored = _stream_chunks(reader, index, engine, sorted(deliveries), deliver_to_targets,
                            max_inflight_bytes=max_inflight_bytes, timeout=timeout, direct=direct,
                            progress=progress, to_host=host_only, places=places, into=into,
                            before_decode=know_chunk if deferred is not None else None)
    if deferred is not None:
        deferred.resolve()  # arrays no chunk holds (empty ones) are made too
    return stored


def _device_places(engine: Engine, targets: dict[int, ArrayTarget],
                   deliveries: dict[int, list[Delivery]]) -> dict[int, list[tuple[int, int, int]]]:
    """Chunk -> its destinations as ``(raw offset, length, device address)``, for a decoder that
    writes device memory itself (``Decoder.device_places``): the chunks whose every destination is
    a target in that device's memory (``device_address``). The decoder then writes the decoded
    bytes where they belong (with byte planes undone on the way where one destination takes the
    whole chunk) instead of handing a view to ``write_device``, a copy and several array objects
    per destination."""
    device = engine.device_places
    if device is None:
        return {}
    places: dict[int, list[tuple[int, int, int]]] = {}
    for chunk, wanted in deliveries.items():
        chunk_places = []
        for array_id, raw_offset, length, position in wanted:
            device_address = getattr(targets[array_id], "device_address", None)
            found = device_address(position) if device_address is not None else None
            if found is None or found[0] != device:
                break
            chunk_places.append((raw_offset, length, found[1]))
        else:
            places[chunk] = chunk_places
    return places


NONE_CHAIN = [{"name": "none/1"}]


def _stored_as_is(index: Index, chunk: int) -> bool:
    """Whether ``chunk``'s stored bytes are its raw bytes (exactly ``none/1``)."""
    record = index.chunks[chunk]
    return index.chains[record.chain] == NONE_CHAIN and record.stored == record.raw


def _whole_chunk_views(index: Index, engine: Engine, targets: dict[int, ArrayTarget],
                       deliveries: dict[int, list[Delivery]]) -> dict[int, Any]:
    """Chunk -> the host memory that takes its whole raw bytes: chunks whose raw bytes all go to
    one contiguous host range of one target (that shares no memory with another). A chunk stored
    as it is is read straight into it; any other is decoded into it (``Decoder.submit_decode``'s
    ``into``), so neither needs a buffer of its own for its raw bytes nor a copy after. Only on
    the CPU engine, which decodes host buffers (a GPU engine is given device read buffers and
    writes device destinations itself)."""
    if engine.name != "cpu":
        return {}
    candidates: list[tuple[int, Delivery]] = []
    for chunk, wanted in deliveries.items():
        record = index.chunks[chunk]
        if len(wanted) == 1 and wanted[0][1] == 0 and wanted[0][2] == record.raw != 0:
            candidates.append((chunk, wanted[0]))
    shared = _targets_sharing_memory(targets) if candidates else set()
    views: dict[int, Any] = {}
    for chunk, (array_id, _raw_offset, length, position) in candidates:
        if array_id in shared:
            continue
        host_view = getattr(targets[array_id], "host_view", None)
        view = host_view(position, position + length) if host_view is not None else None
        if view is not None and view.nbytes == length:
            views[chunk] = view
    return views


def _targets_sharing_memory(targets: dict[int, ArrayTarget]) -> set[int]:
    """Ids of the targets whose host memory (``host_span``) overlaps another's. The targets
    without one offer no host view either (a delta's ``XorTarget``, ``CupyTarget``); the memory
    they write is their own, as ``load_into`` never restores tensors sharing memory together."""
    if len(targets) < 2:
        return set()
    spans: dict[int, tuple[int, int, int]] = {}
    for array_id, target in targets.items():
        if getattr(target, "private_memory", False):
            continue  # memory the target allocated itself: no other target's (and host_span costs ~1 us)
        host_span = getattr(target, "host_span", None)
        span = host_span() if host_span is not None else None
        if span is not None:
            spans[array_id] = (-1, *span)  # host memory: one address space
    return overlapping(spans)


def overlapping(spans: dict[Any, tuple[int, int, int]]) -> set[Any]:
    """The keys whose span ``(memory space, first byte address, end address)`` overlaps another
    key's span in the same space (spans that merely touch do not overlap); O(n log n).

    Sorted by start, a span overlaps an earlier one exactly when it starts before the furthest
    end reached so far, and then it overlaps the span that reached it too."""
    found: set[Any] = set()
    furthest: tuple[Any, int, int] | None = None  # (key, space, end) of the furthest-reaching span
    for key, (space, start, stop) in sorted(spans.items(), key=itemgetter(1)):
        if start >= stop:
            continue
        if furthest is not None and furthest[1] == space and start < furthest[2]:
            found.update((key, furthest[0]))
        if furthest is None or furthest[1] != space or stop > furthest[2]:
            furthest = (key, space, stop)
    return found


def _already_in_place(raw: Any) -> None:
    """The deliver step of a direct read: the bytes were read into the destination."""


def run_verify(reader: StorageReader, index: Index, engine: Engine, *, max_inflight_bytes: int,
               timeout: float | None = None, progress: Callable[[int, int], None] | None = None) -> int:
    """Read, checksum and decode every chunk, keeping nothing; returns the stored bytes read."""
    return _stream_chunks(reader, index, engine, list(range(len(index.chunks))),
                          lambda chunk: lambda raw: None, max_inflight_bytes=max_inflight_bytes,
                          timeout=timeout, progress=progress)


def chunk_owner(index: Index, chunk: int) -> str | None:
    """The key of the first array with bytes in ``chunk``, to name it in errors."""
    for record in index.tensors:
        if any(segment.chunk == chunk for segment in record.segments):
            return record.key
    return None


def _submit_read(reader: StorageReader, offset: int, out: Any) -> Future[Any]:
    """``reader.submit_read``, with a read the reader refuses at once (kvikio's reader checks the
    range against the file's size before it queues anything) delivered as that read's failure:
    the driver then handles it where it handles every failed read (a grouped read's chunks read
    again one by one, the error naming its chunk), not as an error of the whole restore."""
    try:
        return reader.submit_read(offset, out)
    except (OSError, CorruptCheckpointError) as err:
        failed: Future[Any] = Future()
        failed.set_exception(err)
        return failed


def _stream_chunks(reader: StorageReader, index: Index, engine: Engine, chunks: list[int],
                   make_deliver: Callable[[int], Callable[[Any], None]], *, max_inflight_bytes: int,
                   timeout: float | None, direct: dict[int, Any] | None = None,
                   progress: Callable[[int, int], None] | None = None, to_host: set[int] | None = None,
                   places: dict[int, list[tuple[int, int, int]]] | None = None,
                   into: dict[int, Any] | None = None,
                   before_decode: Callable[[int], None] | None = None) -> int:
    """Read ``chunks`` and decode each as its read lands; ``progress(done, total)`` (raw bytes
    decoded so far) is called in this thread. ``to_host``: the chunks whose every destination is
    host memory; ``places``: chunk -> its device destinations; ``into``: chunk -> the host memory
    taking its whole raw bytes (all three ``Decoder.submit_decode``'s; read at each decode).
    ``before_decode(chunk)``: called in this thread before each chunk is handed to the engine,
    while its read may still run (it may fill ``to_host`` and ``places`` for that chunk)."""
    reads: deque[tuple[int, Future[Any], Any]] = deque()
    decodes: deque[tuple[int, Future[None], int]] = deque()
    inflight = 0
    stored_total = 0
    raw_total = sum(index.chunks[c].raw for c in chunks)
    raw_done = 0
    # The engine may bound the chunks outstanding (the GPU engine's read ring has that many slots).
    reading = [index.chunks[c] for c in chunks if not direct or c not in direct]
    slot_limit = engine.reserve_reads(reading, sorted({index.chains[r.chain][-1]["name"] for r in reading}))
    # Grouped reads (``Decoder.read_arena``): runs of consecutive chunks read by one call each.
    arena = engine.read_arena() if reading else None
    lead = arena.lead if arena is not None else None
    # a lead read's pieces (the arena's first) are taken: by the chunks inside them, or draining
    free_pieces = list(range(lead.pieces if lead is not None else 0, arena.pieces)) if arena is not None else []
    grouped: dict[int, tuple[Any, Any, tuple[int, ...]]] = {}
    """Chunk -> (its group's read, its bytes in the arena, its pieces), until its decode finishes."""
    piece_users: dict[int, int] = {}
    """Piece -> chunks read into it whose decode has not finished; the piece is free at 0."""
    draining: deque[tuple[int, Future[Any]]] = deque()
    """Lead pieces no chunk to restore lies in, with their reads: free once the read is done."""

    def groupable(chunk: int) -> bool:
        return index.chunks[chunk].stored > 0 and not (direct and chunk in direct)

    if lead is not None:
        # The chunks inside the lead read are read already: each takes its bytes there, and waits
        # for the read of every piece it lies in.
        piece_users.update(dict.fromkeys(range(lead.pieces), 0))
        for chunk in chunks:
            record = index.chunks[chunk]
            end = record.offset + align_up(record.stored)
            if end > lead.start + lead.length:
                break  # chunks are in file order
            if record.offset < lead.start or not groupable(chunk):
                continue
            at = record.offset - lead.start
            pieces = tuple(range(at // lead.piece_bytes, (end - lead.start - 1) // lead.piece_bytes + 1))
            for number in pieces:
                piece_users[number] += 1
            futures = [lead.futures[number] for number in pieces]
            grouped[chunk] = (futures[0] if len(futures) == 1 else _AllReads(futures),
                              lead.buffer[at:end - lead.start], pieces)
        draining.extend((number, lead.futures[number]) for number in range(lead.pieces) if not piece_users[number])

    def drained(wait: bool) -> None:
        """Free the unused lead pieces whose reads are done (with ``wait``, the oldest at least)."""
        while draining and (wait or draining[0][1].done()):
            number, future = draining.popleft()
            try:
                future.result(timeout=timeout)
            except (TimeoutError, FutureTimeout) as err:
                reader.stalled = True  # a hung read may still fill the piece: no new read into it
                # the builtin TimeoutError, as ``named`` gives: on Python 3.10 a future's is another
                raise TimeoutError(f"piece {number} of the lead read was not read within {timeout} s") from err
            except (OSError, CorruptCheckpointError):
                pass  # no chunk needs its bytes
            free_pieces.append(number)
            wait = False

    def read_group(position: int) -> None:
        """Read ``chunks[position]`` and the chunks after it that follow it in the file and fit
        one piece with it, with one call into a free piece."""
        assert arena is not None
        start = end = index.chunks[chunks[position]].offset
        members: list[tuple[int, int, int]] = []  # chunk, start in the piece, padded length
        for chunk in chunks[position:]:
            record = index.chunks[chunk]
            padded = align_up(record.stored)
            if (not groupable(chunk) or record.offset != end
                    or record.offset + padded - start > arena.piece_bytes):
                break
            members.append((chunk, record.offset - start, padded))
            end = record.offset + padded
        piece = free_pieces.pop()
        view = arena.piece(piece)
        future = _submit_read(reader, start, view[:end - start])
        piece_users[piece] = len(members)
        for chunk, at, padded in members:
            grouped[chunk] = (future, view[at:at + padded], (piece,))

    def piece_done(chunk: int) -> None:
        entry = grouped.pop(chunk, None)
        if entry is not None:
            for piece in entry[2]:
                piece_users[piece] -= 1
                if not piece_users[piece]:
                    free_pieces.append(piece)

    def named(chunk: int, err: BaseException) -> BaseException:
        # (damage found in a delta's base names that file and its own place, not this chunk)
        if isinstance(err, CorruptCheckpointError) and err.chunk is None and err.base is None:
            return CorruptCheckpointError(err.reason, key=chunk_owner(index, chunk), chunk=chunk)
        if isinstance(err, (TimeoutError, FutureTimeout)):
            # a hung read stays a TimeoutError (docs/troubleshooting.md), on Python 3.10 too, where
            # a future's timeout is not the builtin one
            return TimeoutError(f"chunk {chunk} (tensor {chunk_owner(index, chunk)!r}) was not read and "
                                f"decoded within {timeout} s: {err}")
        if isinstance(err, FileNotFoundError):  # an object deleted under its reader: gone, no I/O error
            return FileNotFoundError(f"chunk {chunk} (tensor {chunk_owner(index, chunk)!r}): {err}")
        if isinstance(err, OSError):
            return CheckpointError(f"I/O error reading chunk {chunk} (tensor "
                                   f"{chunk_owner(index, chunk)!r}): {err}")
        return err

    def reraise(chunk: int, err: BaseException) -> NoReturn:
        """Raise ``named(chunk, err)``; an error passed through unchanged (MemoryError,
        KeyboardInterrupt, ...) is raised as it was, not as its own cause."""
        renamed = named(chunk, err)
        if renamed is err:
            raise err
        raise renamed from err

    def is_timeout(err: BaseException) -> bool:
        """Whether a read's ``err`` is its wait timing out: the reader is then ``stalled``, so that
        closing it does not wait for the hung read again."""
        if isinstance(err, (TimeoutError, FutureTimeout)):
            reader.stalled = True
            return True
        return False

    def start_decode() -> None:
        if before_decode is not None:
            before_decode(reads[0][0])  # while its read may still run
        chunk, future, buffer = reads.popleft()
        record = index.chunks[chunk]
        try:
            future.result(timeout=timeout)
        except (OSError, CorruptCheckpointError, FutureTimeout) as err:
            # A hung read (TimeoutError) may still fill the piece: no second read into it.
            if is_timeout(err) or chunk not in grouped:
                reraise(chunk, err)
            try:  # the group's call failed: this chunk alone (see the module docstring)
                reader.submit_read(record.offset, buffer).result(timeout=timeout)
            except BaseException as again:  # noqa: BLE001 - reraise names the chunk, then raises it
                is_timeout(again)
                reraise(chunk, again)
        except BaseException as err:  # noqa: BLE001 - reraise names the chunk, then raises it
            reraise(chunk, err)
        decodes.append((chunk, engine.submit_decode(record, index.chains[record.chain], buffer, make_deliver(chunk),
                                                    to_host=to_host is not None and chunk in to_host,
                                                    places=places.get(chunk) if places else None,
                                                    into=into.get(chunk) if into else None),
                        _cost(record)))

    def finish_decode(block: bool) -> None:
        nonlocal inflight, raw_done
        while decodes and (block or decodes[0][1].done()):
            chunk, future, cost = decodes.popleft()
            try:
                future.result(timeout=timeout)
            except BaseException as err:  # noqa: BLE001 - reraise names the chunk, then raises it
                if isinstance(err, (TimeoutError, FutureTimeout)):
                    engine.stalled = True  # its close then does not wait for the stuck decode again
                reraise(chunk, err)
            inflight -= cost
            piece_done(chunk)
            raw_done += index.chunks[chunk].raw
            if progress is not None:
                progress(raw_done, raw_total)
            block = False

    def advance_oldest() -> None:
        """Hand the oldest read to the engine, or else wait for the oldest decode; then collect
        whatever decodes have finished (there is a read or a decode outstanding)."""
        if reads:
            start_decode()
        else:
            finish_decode(block=True)
        finish_decode(block=False)

    try:
        for position, chunk in enumerate(chunks):
            record = index.chunks[chunk]
            cost = _cost(record)
            while reads and reads[0][1].done():
                start_decode()
            finish_decode(block=False)
            drained(wait=False)
            if arena is not None and chunk not in grouped and groupable(chunk):
                while not free_pieces:  # every piece holds chunks outstanding: finish the oldest
                    if draining:
                        drained(wait=True)
                    elif reads or decodes:
                        advance_oldest()
                    else:
                        raise RuntimeError("a read piece is held by no outstanding chunk")
                read_group(position)
            while ((inflight + cost > max_inflight_bytes
                    or (slot_limit is not None and len(reads) + len(decodes) >= slot_limit))
                   and (reads or decodes)):
                advance_oldest()
            buffer = direct.get(chunk) if direct else None
            if chunk in grouped:
                future, within, _piece = grouped[chunk]
                buffer = engine.read_buffer(align_up(record.stored), within=within)
                reads.append((chunk, future, buffer))
            else:
                if buffer is None:
                    buffer = engine.read_buffer(align_up(record.stored))
                reads.append((chunk, _submit_read(reader, record.offset, buffer), buffer))
            inflight += cost
            stored_total += record.stored
        while reads:
            start_decode()
        while decodes:
            finish_decode(block=True)
    except BaseException:
        for _chunk, future, _buffer in reads:
            future.cancel()
        for _chunk, future, _unused_cost in decodes:
            future.cancel()
        raise
    return stored_total


class _AllReads:
    """The reads of the lead pieces one chunk lies in, as one read: done when all are; ``result``
    waits for every one before it raises the first failure, so that none still writes the chunk's
    bytes when the driver reads them again on their own."""

    def __init__(self, futures: list[Future[Any]]):
        self.futures = futures

    def done(self) -> bool:
        return all(future.done() for future in self.futures)

    def result(self, timeout: float | None = None) -> None:
        failure: BaseException | None = None
        for future in self.futures:
            try:
                future.result(timeout=timeout)
            except (TimeoutError, FutureTimeout):
                raise
            except BaseException as err:  # noqa: BLE001 - raised below, once every read has ended
                failure = failure or err
        if failure is not None:
            raise failure

    def cancel(self) -> bool:
        return all([future.cancel() for future in self.futures])


def _cost(record: Any) -> int:
    return align_up(record.stored) + record.raw
