"""The save driver: planned chunks -> engine -> storage writer, with bounded bytes in flight.

One thread drives it. Chunks are submitted to the engine in plan order, while at most
``max_inflight_bytes`` of raw chunk bytes are between "submitted for encoding" and "written";
encoded chunks are placed in plan order (so a file's layout is a function of the state and the
options alone, never of thread timing) and their writes run concurrently in the writer. Any
failure, including KeyboardInterrupt, aborts the writer: nothing appears at the target path.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..codecs import Chain
from ..errors import StateChangedError
from ..format import (
    ALIGNMENT,
    HEADER_REGION,
    TRAILER_SIZE,
    XOR_BASE,
    Index,
    align_up,
    checksum,
    layout,
    pack_header,
    pack_trailer,
)
from ..format.index import ChunkRecord, Segment
from ..io.base import StorageWriter
from .engine import EncodedChunk, Engine
from .plan import ChunkPlan


@dataclass
class SaveResult:
    """What the driver measured; the API turns it into a ``SaveReport``."""

    file_bytes: int
    raw_bytes: int
    seconds: float
    chunks: list[ChunkRecord]
    chains: list[Chain]
    segments: dict[int, list[Segment]] = field(default_factory=dict)


def run_save(plans: list[ChunkPlan], engine: Engine, writer: StorageWriter, *, max_inflight_bytes: int,
             index: Index, timeout: float | None = None,
             progress: Callable[[int, int], None] | None = None,
             before_commit: Callable[[], None] | None = None) -> SaveResult:
    """Encode and write every planned chunk, then the index, then commit.

    ``index`` is the file's index as the caller knows it before any chunk is written: the tree,
    one record per array (in the order of the arrays the plans index) without segments, the
    writer name and, for a delta, ``base`` and ``minor``; this driver fills in the chunks, the
    chains and each record's segments (in place: the records belong to this save). ``timeout``
    bounds every single wait on a worker (seconds).
    A plan marked ``delta`` (its sources yield the XOR with a base) gets ``xorbase/1`` in front of
    the chain the engine reports, so engines need not know about deltas. ``progress(done,
    total)`` is called in this thread with the raw bytes written so far. ``before_commit()`` runs
    just before the commit; its error aborts the save (nothing becomes visible).
    """
    total = sum(plan.raw for plan in plans)
    done = 0
    started = time.perf_counter()
    result = SaveResult(0, 0, 0.0, [], [])
    chain_ids: dict[Chain, int] = {}
    encodes: deque[tuple[ChunkPlan, Future[EncodedChunk]]] = deque()
    writes: deque[tuple[Future[None], int, EncodedChunk, int]] = deque()  # (write, raw bytes, chunk, its number)
    inflight = 0
    offset = HEADER_REGION
    written_from: dict[int, int] = {}  # chunk number -> the array whose own memory it is written from

    def place_oldest_encoded() -> None:
        nonlocal offset
        plan, future = encodes.popleft()
        try:
            encoded = future.result(timeout=timeout)
        except (TimeoutError, FutureTimeout):
            engine.stalled = True
            raise TimeoutError(f"chunk {len(result.chunks)} (of {plan.raw} bytes) was not encoded within "
                               f"{timeout} s") from None
        chain = Chain.of({"name": XOR_BASE}, *encoded.chain.to_json()) if plan.delta else encoded.chain
        chain_id = chain_ids.setdefault(chain, len(chain_ids))
        number = len(result.chunks)
        result.chunks.append(ChunkRecord(offset, encoded.stored, encoded.raw, encoded.crc, chain_id))
        if encoded.live:
            written_from[number] = plan.parts[0].array
        position = 0
        for part in plan.parts:
            result.segments.setdefault(part.array, []).append(Segment(number, position, part.length))
            position += part.length
        writes.append((writer.submit_write(offset, encoded.payload), plan.raw, encoded, number))
        offset += align_up(encoded.stored)
        result.raw_bytes += encoded.raw

    def written(future: Future[None], what: str) -> None:
        """Wait for a write; one that outlasts ``timeout`` marks the writer ``stalled`` (its abort
        then does not wait for that write again) and fails the save naming ``what``."""
        try:
            future.result(timeout=timeout)
        except (TimeoutError, FutureTimeout):
            writer.stalled = True
            raise TimeoutError(f"the write of {what} did not complete within {timeout} s") from None

    def retire_written(block: bool) -> None:
        nonlocal inflight, done
        while writes and (block or writes[0][0].done()):
            future, raw, encoded, number = writes.popleft()
            written(future, f"chunk {number} (of {encoded.stored} bytes)")
            if encoded.live and checksum(encoded.payload) != encoded.crc:
                # Written from the state's memory after its checksum was taken: another thread
                # changed it meanwhile. The file would fail every load; the save must not succeed
                # (a manager would then prune the checkpoint it replaces).
                raise StateChangedError(
                    f"{index.tensors[written_from[number]].key!r} changed while it was saved (chunk {number}): "
                    f"another thread wrote it during the save; nothing was saved, the file there is as it "
                    f"was. Save when no step is running, or save_async (which saves a snapshot)")
            if encoded.release is not None:
                encoded.release()
            inflight -= raw
            done += raw
            if progress is not None:
                progress(done, total)
            block = False

    engine.watch_storage(writer.backlog, writer.pace)
    try:
        written(writer.submit_write(0, pack_header(index.minor)), "the header")
        for plan in plans:
            while encodes and encodes[0][1].done():
                place_oldest_encoded()
            retire_written(block=False)
            while (inflight + plan.raw > max_inflight_bytes
                   or (engine.max_pending is not None and len(encodes) + len(writes) >= engine.max_pending)) \
                    and (encodes or writes):
                if encodes:
                    place_oldest_encoded()
                else:
                    retire_written(block=True)
                retire_written(block=False)
            encodes.append((plan, engine.submit_encode(plan)))
            inflight += plan.raw
        while encodes:
            place_oldest_encoded()
        while writes:
            retire_written(block=True)
        result.chains = list(chain_ids)
        # The template's records are filled in place: a copy per record costs ~10 us each, which a
        # state of many small tensors feels.
        for i, record in enumerate(index.tensors):
            record.segments = result.segments.get(i, [])
        index = dataclasses.replace(index, chains=[chain.to_json() for chain in result.chains],
                                    chunks=result.chunks)
        index_bytes = index.to_json_bytes()
        if len(index_bytes) > layout.MAX_INDEX_BYTES:  # every reader refuses such a file as corrupt
            raise ValueError(f"the checkpoint's index would be {len(index_bytes)} bytes, over the format's "
                             f"{layout.MAX_INDEX_BYTES}-byte cap: the state's plain values (strings, ints, "
                             f"keys) are too large; store large text or lists of numbers as arrays, or outside "
                             f"the checkpoint")
        index_offset = align_up(offset, ALIGNMENT)
        writer.write_tail(index_offset, index_bytes + pack_trailer(index_offset, len(index_bytes),
                                                                   checksum(index_bytes), index.minor))
        result.file_bytes = index_offset + len(index_bytes) + TRAILER_SIZE
        if before_commit is not None:
            before_commit()
        writer.commit()
    except BaseException:
        for _plan, future in encodes:
            future.cancel()
        writer.abort()
        raise
    result.seconds = time.perf_counter() - started
    return result
