"""The staging ring both GPU directions share, and how many slots fit a staging budget.

A ``StagingRing`` is one device allocation of equal slots, each split into two areas, allocated
once per encoder or per restore (never per chunk). The GPU encoder gathers a chunk into a slot's
first area (its input) and writes the compressed stream into the second (its output); the GPU
decoder has kvikio read a stored chunk into the first area and decodes into the second. A slot is
handed out by ``acquire`` (a bounded wait) and comes back by ``release``; the drivers never keep
more chunks outstanding than there are slots, so an ``acquire`` always finds one coming back.

Sizing: the ring and nvCOMP's own scratch share ``STAGING_RING_SHARE`` of the staging budget
(``ring_slots``), with the scratch taken from the measured tables ``ENCODE_SCRATCH`` /
``DECODE_SCRATCH`` (``encode_scratch``, ``decode_scratch``). A save's budget is
``Config.max_staging_bytes``. A restore's is sized when it starts (``restore_staging_budget``):
restores run when a job starts or resumes, when most of the device's memory is still free, and
on a fast tier (page cache, tmpfs, NVMe arrays at tens of GB/s) the number of chunks in flight is
what keeps reads, decodes and deliveries overlapped (a 1 GiB ring held an 8 GiB restore from
/dev/shm to about half the read speed, docs/performance.md).
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ...codecs.nvcomp import MAX_CHUNK_BYTES

STAGING_RING_SHARE = 0.9
"""Share of ``max_staging_bytes`` for the ring and nvCOMP's scratch; the rest covers CRC buffers,
batch descriptors and allocator rounding."""
ENCODE_SCRATCH = {  # codec: (bytes held whatever the batch, bytes per chunk in a batch), 16 MiB chunks
    "ans": (32 << 20, 0), "lz4": (32 << 20, 0), "snappy": (32 << 20, 0), "bitcomp": (32 << 20, 0),
    "cascaded": (32 << 20, 0), "zstd": (1120 << 20, 24 << 20), "deflate": (16 << 20, 146 << 20),
    "gdeflate": (16 << 20, 146 << 20),
}
"""Device memory nvCOMP 6.0 holds beyond our buffers while compressing a batch of chunks of
``MAX_CHUNK_BYTES`` (measured by recording the device pool around batches, docs/performance.md):
the encoder subtracts it from the staging budget before sizing its ring, so the ring plus the
scratch stay within ``max_staging_bytes``. The part per chunk is scaled to smaller chunks (it
grows with the bytes in a batch); the fixed part is not: for chunks from 64 KiB to 16 MiB nvCOMP
held the same scratch for a batch of the same bytes (Zstd about 1.2 GiB for 64 MiB, ANS 32 MiB).
So nvCOMP's Zstd alone needs more than the 1 GiB default whatever the chunk size, and smaller
chunks do not bring it within a budget (``GpuEncoder._fit`` refuses it)."""
DECODE_SCRATCH = {"zstd/1": (96 << 20, 48 << 20)}
"""The same for decompression, by bitstream name (the others hold none). nvCOMP's Zstd decode
scratch grows with the bytes in a batch, not with its chunk size: 256 MiB for a batch of 64 MiB
and 832 MiB for 256 MiB with chunks from 256 KiB to 16 MiB, 32 MiB more with 64 KiB chunks
(``experiments/nvcomp_scratch_probe.py --chunk-scan zstd``, docs/performance.md "GPU memory").
So, as for ``ENCODE_SCRATCH``, the fixed part holds for every chunk size and the part per chunk
(three bytes per byte of the batch) is scaled to the chunk."""


RESTORE_FREE_SHARE = 0.25
"""Share of the device memory free when a restore starts that its staging ring may take: the
restore's own destination arrays and whatever the job allocates next need the rest."""
RESTORE_STAGING_CAP = 8 << 30
"""The most a restore's ring takes unless ``Config.restore_staging_bytes`` says otherwise: beyond
a few GiB more chunks in flight stop paying (the reads and the decoder are already overlapped)."""


GROUP_READ_BYTES = 64 << 20
"""Bytes of one grouped read of a restore: consecutive chunks read by one storage call into one
piece of a ``ReadArena``. Each read call hands the interpreter's lock back and forth; beside the
decoder's worker thread running Python, taking it back waits up to the switch interval (5 ms),
so thousands of chunk-sized reads held a restore to a fraction of the storage speed while a few
large ones did not (``experiments/pread_calls.py``, docs/performance.md "Fast tiers")."""
GROUP_READ_PIECES = 16
"""The most pieces a restore's ``ReadArena`` gets (fewer where its share of the staging budget
holds fewer): the pieces are how far reads run ahead of the decoder. An 8.9 GB restore from the
page cache ran at 0.47 of its limit with 4 pieces of 64 MiB and 0.82 with 16, one read per chunk
(ring slots as read-ahead) 0.75 (``experiments/restore_handoffs_ab.py``, docs/performance.md
"Fast tiers")."""
GROUP_READ_SHARE = 4
"""A restore's arena takes at most ``1 / GROUP_READ_SHARE`` of its staging budget; the slots take
the rest."""


def arena_pieces(budget: int, piece_bytes: int, largest_stored: int) -> int:
    """Pieces of ``piece_bytes`` a restore's ``ReadArena`` gets from its staging ``budget``: up to
    ``GROUP_READ_PIECES`` within ``1 / GROUP_READ_SHARE`` of it, or 0 (one read per chunk) where
    fewer than two fit or a piece cannot hold two of the largest stored chunks (grouping would not
    cut the calls)."""
    pieces = min(GROUP_READ_PIECES, budget // GROUP_READ_SHARE // max(piece_bytes, 1))
    return pieces if pieces >= 2 and piece_bytes >= 2 * largest_stored else 0


LEAD_READ_SHARE = 2
"""A lead read (``LeadRead``) takes at most ``1 / LEAD_READ_SHARE`` of the least staging budget
the restore can get (``lead_read_pieces``); it becomes the first pieces of the restore's arena,
which may then exceed its usual ``1 / GROUP_READ_SHARE`` share, never the budget."""


def lead_read_pieces(floor: int, piece_bytes: int) -> int:
    """Pieces of ``piece_bytes`` a lead read gets when the restore's staging budget will be at least
    ``floor`` (``Config.max_staging_bytes``, or ``restore_staging_bytes`` where configured; the
    budget is sized only after the index is read, ``restore_staging_budget``): up to
    ``GROUP_READ_PIECES`` within ``1 / LEAD_READ_SHARE`` of it, or 0 where fewer than two fit."""
    pieces = min(GROUP_READ_PIECES, floor // LEAD_READ_SHARE // max(piece_bytes, 1))
    return pieces if pieces >= 2 else 0


class LeadRead:
    """The first ``length`` bytes of a file from ``start`` (its data region), read into device memory
    in pieces of ``piece_bytes`` (one storage call each) while the file's index is still being read
    and parsed, so that a restore's reads need not wait for it.

    The bytes are a guess made before the index is known: the restore driver takes from them
    every chunk to restore that lies wholly inside ``[start, start + length)`` (a chunk crossing
    two pieces waits for both reads) and reads the others as usual; the pieces then serve as its
    read arena's first pieces (``ReadArena``), and the arena closes the lead with itself. A decoder
    that cannot hold the lead closes it before allocating its own staging, so the lead never adds to
    a budget it is not part of. Whoever started the lead read closes it after the restore too (a
    second ``close`` does nothing): ``close`` waits for its reads (a buffer is never released under
    a running read)."""

    def __init__(self, device: Any, reader: Any, start: int, length: int, piece_bytes: int, *,
                 timeout: float | None):
        if length < 1 or piece_bytes < 1:
            raise ValueError(f"a lead read needs bytes, got {length} in pieces of {piece_bytes}")
        self.device = device
        self.start = start
        self.length = length
        self.piece_bytes = piece_bytes
        self.pieces = -(-length // piece_bytes)
        self.nbytes = self.pieces * piece_bytes
        self.timeout = timeout
        self.reader = reader
        self.buffer: Any = device.empty(self.nbytes)
        self._views: dict[int, tuple[Any, Any]] = {}
        self.futures: list[Any] = []
        self._hung = False
        """A ``close`` timed out: a read still runs, and later closes do not wait for it again."""
        try:
            for number in range(self.pieces):
                at = number * piece_bytes
                count = min(piece_bytes, length - at)
                self.futures.append(reader.submit_read(start + at, self.buffer[at:at + count]))
        except BaseException:
            self.close()  # the reads already submitted finish before their buffer goes
            raise

    def piece(self, number: int) -> Any:
        """Piece ``number``'s bytes (the last piece's tail past ``length`` is never read)."""
        at = number * self.piece_bytes
        return self.buffer[at:at + self.piece_bytes]

    def close(self) -> None:
        """Wait for every read (at most ``timeout`` each; a failed one is no error here: the
        restore read its chunks again), then drop the buffer. ``TimeoutError`` where a read is
        still running: the buffer stays referenced then. Where the restore's own wait on a read
        already timed out (the reader is ``stalled``), no wait and no error: the restore's error
        names the chunk, as a stalled reader's ``close`` does."""
        stalled = self.reader.stalled
        for future in self.futures:
            try:
                future.result(timeout=0.0 if self._hung or stalled else self.timeout)
            except (TimeoutError, FutureTimeout):
                if stalled:
                    return  # the running read keeps its buffer
                self._hung = True  # one wait of ``timeout`` per lead, not one per close
                raise TimeoutError(f"a lead read still running {self.timeout} s after its restore") from None
            except Exception:  # noqa: BLE001 - the restore read these chunks again, or failed on its own
                pass
        self.futures = []
        self.buffer = None


class ReadArena:
    """``pieces`` device buffers of ``piece_bytes``, for grouped reads: the restore driver reads a
    run of consecutive chunks into one piece with one storage call and hands each chunk's decode a
    view of its bytes there; a piece is reused once every chunk read into it has finished decoding
    (the driver tracks that: it sees every decode finish). With a ``lead`` (``LeadRead``), its
    pieces are the arena's first ``lead.pieces`` and one allocation holds the rest; otherwise one
    allocation holds them all."""

    def __init__(self, device: Any, pieces: int, piece_bytes: int, lead: LeadRead | None = None):
        if pieces < 1 or piece_bytes < 1:
            raise ValueError(f"a read arena needs pieces and bytes, got {pieces} x {piece_bytes}")
        if lead is not None and (lead.piece_bytes != piece_bytes or lead.pieces > pieces):
            raise ValueError(f"a lead read of {lead.pieces} x {lead.piece_bytes} bytes does not fit an arena "
                             f"of {pieces} x {piece_bytes}")
        self.pieces = pieces
        self.piece_bytes = piece_bytes
        self.nbytes = pieces * piece_bytes
        self.lead = lead
        self._first = 0 if lead is None else lead.pieces
        """The pieces before this are the lead's."""
        rest = (pieces - self._first) * piece_bytes
        self.buffer: Any = device.empty(rest) if rest else None

    def piece(self, number: int) -> Any:
        """Piece ``number``'s bytes."""
        if number < self._first:
            assert self.lead is not None
            return self.lead.piece(number)
        start = (number - self._first) * self.piece_bytes
        return self.buffer[start:start + self.piece_bytes]

    def close(self) -> None:
        """Drop the device buffer (views handed out keep it alive until they go) and close the
        lead read (``LeadRead.close``: it waits for the lead's reads), whose pieces were this
        arena's: a restore that follows on the same device (the next phase of a ``load_into``)
        then has the whole budget without the lead still holding part of it."""
        self.buffer = None
        lead, self.lead = self.lead, None
        if lead is not None:
            lead.close()


def restore_staging_budget(free_bytes: int, floor: int, explicit: int | None = None) -> int:
    """Staging bytes of a restore: ``explicit`` (``Config.restore_staging_bytes``) when given, else
    ``RESTORE_FREE_SHARE`` of ``free_bytes`` (device memory free now), at least ``floor``
    (``Config.max_staging_bytes``) and otherwise at most ``RESTORE_STAGING_CAP``. The ring never
    takes more slots than the restore has chunks (``ring_slots``' ``most``), so a small restore
    allocates what it needs whatever the budget."""
    if explicit is not None:
        return explicit
    return max(floor, min(RESTORE_STAGING_CAP, int(free_bytes * RESTORE_FREE_SHARE)))


def _worst(table: dict[str, tuple[int, int]], names: Iterable[str], chunk_bytes: int) -> tuple[int, int]:
    """(fixed, per chunk) scratch of the worst of ``names`` in ``table`` for chunks of
    ``chunk_bytes``: the part per chunk scaled to the chunk size (the table's is for
    ``MAX_CHUNK_BYTES``; it grows with the bytes in a batch, so a larger chunk, which only a CPU
    engine's file has, counts in proportion), the fixed part as it is (nvCOMP holds it whatever
    the chunk size)."""
    entries = [table.get(name, (0, 0)) for name in names]
    fixed = max((e[0] for e in entries), default=0)
    per_chunk = max((e[1] for e in entries), default=0)
    return fixed, int(per_chunk * chunk_bytes / MAX_CHUNK_BYTES)


def encode_scratch(names: Iterable[str], chunk_bytes: int) -> tuple[int, int]:
    """(fixed, per chunk) nvCOMP compression scratch of the worst of ``names`` (codec names) for
    chunks of ``chunk_bytes`` (``ENCODE_SCRATCH``)."""
    return _worst(ENCODE_SCRATCH, names, chunk_bytes)


def decode_scratch(names: Iterable[str], chunk_bytes: int) -> tuple[int, int]:
    """(fixed, per chunk) nvCOMP decompression scratch of the worst of ``names`` (bitstream
    names) for chunks of ``chunk_bytes`` (``DECODE_SCRATCH``)."""
    return _worst(DECODE_SCRATCH, names, chunk_bytes)


def slots_that_fit(budget: int, slot_bytes: int, scratch: tuple[int, int]) -> int:
    """Slots of ``slot_bytes`` that fit with ``scratch`` (fixed, per slot) in the ring's share of
    ``budget`` (0 or 1 where the budget is too small for a ring)."""
    fixed, per_slot = scratch
    return max(0, (int(budget * STAGING_RING_SHARE) - fixed) // (slot_bytes + per_slot))


def ring_slots(budget: int, slot_bytes: int, scratch: tuple[int, int], *, most: int | None = None) -> int:
    """``slots_that_fit``, but at least 2 (one filling, one draining) and at most ``most``."""
    slots = max(2, slots_that_fit(budget, slot_bytes, scratch))
    return slots if most is None else max(1, min(most, slots))


class StagingRing:
    """``slots`` slots of ``first_bytes + second_bytes`` in one device buffer (``buffer``).

    Thread-safe: ``acquire`` and ``release`` may be called from any thread. ``acquire`` waits at
    most ``timeout`` seconds (``TimeoutError``): a slot that never comes back means a stuck or
    dead worker, which must fail the operation instead of hanging it."""

    def __init__(self, device: Any, slots: int, first_bytes: int, second_bytes: int, *, timeout: float):
        if slots < 1:
            raise ValueError(f"a staging ring needs at least one slot, got {slots}")
        self.slots = slots
        self.first_bytes = first_bytes
        self.slot_bytes = first_bytes + second_bytes
        self.nbytes = slots * self.slot_bytes
        self.timeout = timeout
        self.buffer: Any = device.empty(self.nbytes)
        self._views: dict[int, tuple[Any, Any]] = {}
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self._free.put(slot)

    def acquire(self) -> int:
        """A free slot's number, waiting at most ``timeout`` for one."""
        try:
            return self._free.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"no staging slot came back within {self.timeout} s "
                               f"(all {self.slots} held)") from None

    def release(self, slot: int) -> None:
        """Return a slot acquired before."""
        self._free.put(slot)

    def free_slots(self) -> int:
        """Slots not handed out now."""
        return self._free.qsize()

    def first(self, slot: int, nbytes: int | None = None) -> Any:
        """The slot's first area (its first ``nbytes`` bytes when given)."""
        if nbytes is None:
            return self._areas(slot)[0]
        base = slot * self.slot_bytes
        return self.buffer[base:base + nbytes]

    def second_offset(self, slot: int) -> int:
        """Where the slot's second area starts in ``buffer``."""
        return slot * self.slot_bytes + self.first_bytes

    def second(self, slot: int) -> Any:
        """The slot's second area."""
        return self._areas(slot)[1]

    def _areas(self, slot: int) -> tuple[Any, Any]:
        """The slot's two areas as views of ``buffer``, made on first use and kept: a worker
        asks for them several times per chunk, and each slice of a CuPy array costs
        microseconds."""
        areas = self._views.get(slot)
        if areas is None:
            base, start = slot * self.slot_bytes, self.second_offset(slot)
            areas = self._views[slot] = (self.buffer[base:base + self.first_bytes],
                                         self.buffer[start:(slot + 1) * self.slot_bytes])
        return areas

    def close(self) -> None:
        """Drop the device buffer (views handed out keep it alive until they go)."""
        self.buffer = None
        self._views = {}
