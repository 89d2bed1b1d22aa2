"""The GPU decoder: the restore direction of the GPU pipeline, nvCOMP batches on one stream.

A ``StagingRing`` is allocated once per restore (``reserve_reads``) within the restore's staging
budget (``restore_staging_budget``: from the device memory free when the decoder is made, unless
configured) and sized from the index: one slot holds the largest stored chunk (its first area,
which kvikio reads into) and the largest raw chunk (its second area). The worker
(``BatchWorker``) checks each batch's CRC-32C on the device, decodes the batch with nvCOMP into
the slots' output areas, undoes byte planes on the device (into the read area, whose stream is
spent) and hands the bytes to the destination on the same stream, then synchronizes once per
batch and returns the slots. Where every destination of a chunk is memory on this device (a
job's ``places``), the worker writes there itself: byte planes undone straight into a
destination that takes the whole chunk, a device copy per destination otherwise; a restore of
hundreds of tensors then makes no array object per destination (docs/performance.md, "Fast
tiers"). The restore driver keeps no more chunks outstanding than there are
slots, so device memory beyond the destination arrays is the ring plus nvCOMP's scratch, whatever
the checkpoint's size.

Grouped reads: beside the ring, a restore gets a ``ReadArena`` (a quarter of its staging budget at
most, ``arena_pieces``) into which the driver reads runs of consecutive chunks with one storage
call per ``group_read_bytes``; a chunk read that way is decoded from its view there, and its slot's
read area serves only as the scratch the chain's transforms need. One call per chunk cost a
restore up to the interpreter's switch interval per call (docs/performance.md, "Fast tiers").
A restore whose reads began before its index was parsed (a ``LeadRead``, given to the decoder)
gets the lead's pieces as its arena's first ones.

Host destinations (``load(device="cpu")`` of a file only a GPU decodes): a copy from device memory
into pageable host memory runs at a small fraction of one into pinned memory (docs/performance.md,
"Fast tiers"), so decoded chunks bound for host memory are copied into a pinned
bounce buffer of ``HOST_BOUNCE_BYTES`` (allocated on the first such chunk), and from there into
the destinations by ``HOST_COPY_THREADS`` threads at once, a bounce-full at a time.

Errors: a checksum mismatch, a stage parameter that does not fit, a stream nvCOMP reports
undecodable (``nvcomp.reports_undecodable``) or one that decodes to the wrong size is damage
(``CorruptCheckpointError`` for that chunk). Anything else the device raises (out of memory, an
illegal memory access, a CUDA error) is no proof of damage: it reaches every chunk of the batch
as itself, so that a restore stops instead of passing over an intact checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ...codecs import BYTE_PLANES
from ...codecs.device import DeviceBackend, backend_or_cuda, planes_inverse_into
from ...codecs.nvcomp import DecoderKey, decoder_key, device_decoder_name, reports_undecodable
from ...errors import CorruptCheckpointError, UnsupportedFormatError
from ...format import XOR_BASE, align_up
from ...format.index import ChunkRecord
from ...io.pools import Lane
from ..engine import Decoder
from .staging import (
    GROUP_READ_BYTES,
    STAGING_RING_SHARE,
    LeadRead,
    ReadArena,
    StagingRing,
    arena_pieces,
    decode_scratch,
    restore_staging_budget,
    slots_that_fit,
)
from .worker import BATCH_CHUNKS, BatchWorker, WorkerOwner

_QUEUED_CODECS = frozenset({"nvcomp.ans/1", "none/1"})
"""Bitstreams whose batches go on the stream whole (``_decode_queued``): nvCOMP's ANS decoder
validates every stream (a damaged one gets an error status, never a fault), and a stored chunk
needs no decoder. Others decode only after their checksums are known on the host: a garbled Zstd,
GDeflate or Snappy stream faulted the device."""
HOST_BOUNCE_BYTES = 256 << 20
"""Pinned host memory a decoder holds, once a chunk goes to host memory, to copy decoded chunks
out of the device (grown to the largest raw chunk where one is larger)."""
HOST_COPY_THREADS = 8
"""Threads copying from the bounce buffer into host destinations at once (first-touch page
faults of new host memory run in parallel too)."""


@dataclass
class DecodeJob:
    """One stored chunk queued for the worker."""

    record: ChunkRecord
    chain: list[dict[str, Any]]
    stored: Any
    """The padded bytes read (a view of a slot's read area, or a buffer of its own)."""
    deliver: Callable[[Any], None]
    future: Future[None]
    to_host: bool = False
    places: list[tuple[int, int, int]] | None = None
    """Where the raw bytes go on this device, ``(raw offset, length, address)``: written by the
    decoder itself (``_place``) instead of through ``deliver``."""


@dataclass
class _Live:
    """A job whose checksum matched, with the two areas it may use."""

    job: DecodeJob
    body: Any
    read_area: Any
    out_area: Any


class GpuDecoder(WorkerOwner, Decoder):
    """nvCOMP on one device (see the module docstring). ``device``: the backend (default
    ``CudaDevice(device_id)``; tests pass a NumPy stand-in)."""

    name = "gpu"
    device_places: int | None

    def __init__(self, *, device_id: int, max_staging_bytes: int, restore_staging_bytes: int | None = None,
                 batch_chunks: int = BATCH_CHUNKS, timeout: float = 600.0, device: DeviceBackend | None = None,
                 reserved_bytes: int = 0, group_read_bytes: int = GROUP_READ_BYTES, lead: LeadRead | None = None,
                 share: float = 1.0):
        if device is None and lead is not None:
            device = lead.device  # the backend the lead's buffer came from
        self.device = device = backend_or_cuda(device, device_id)
        self.device_id = device_id
        self.device_places = device_id
        held = 0 if lead is None else lead.nbytes  # allocated already, and part of the budget
        budget = restore_staging_budget(max(device.free_bytes() + held - reserved_bytes, 0), max_staging_bytes,
                                        restore_staging_bytes)
        self.max_staging_bytes = int(budget * share)
        """The staging budget of this decoder's restores (``restore_staging_budget``, from the device
        memory free now less ``reserved_bytes``: destination arrays a restore makes after the
        decoder, ``pipeline.load.DeferredTargets``), times ``share``: the part of the restore's
        budget this decoder has where others restore beside it (a delta's base reads)."""
        self.share = share
        self.lead = lead
        """A ``LeadRead`` of the file the next restore reads: its pieces become that restore's first
        arena pieces (``reserve_reads``); it serves one restore."""
        self.timeout = timeout
        self.ring: StagingRing | None = None
        self.group_read_bytes = group_read_bytes
        self.arena: ReadArena | None = None
        """The restore's grouped-read pieces (``reserve_reads``), None where they do not fit."""
        self.staging_bytes = 0
        self._read_slots: dict[int, int] = {}
        """Device address of a handed-out read buffer -> its slot."""
        self._worker = BatchWorker("gdsckpt-gpu-decode", device.use_in_thread, self._decode_batch,
                                   batch_size=batch_chunks, timeout=timeout)
        self._closed = False
        self._bounce: Any = None
        """Pinned host buffer for host destinations (``HOST_BOUNCE_BYTES``), made on first use."""
        self._host_copies: Lane | None = None

    # -- interface ---------------------------------------------------------------------------
    def reserve_reads(self, records: list[ChunkRecord], codecs: Any = ()) -> int | None:
        """Allocate the restore ring for ``records`` and return its slot count (see the module
        docstring). A slot holds the largest padded stored chunk (then, after decoding, a chunk's
        byte-planed raw bytes) and the largest raw chunk; there are as many slots as fit with
        nvCOMP's decode scratch for ``codecs`` (bitstream names) in the ring's share of
        ``max_staging_bytes``, at most one per chunk. The read arena (a lead read's pieces among
        them) takes its share only where the ring keeps room for two slots beside it: a lead that
        would leave less is closed before the ring is allocated, an arena that would is left out
        (one read per chunk). A budget that holds one slot only gets one (each chunk read after
        the one before it is decoded: slow, but within the budget); one that holds none is a
        ``ValueError`` naming the least budget that would do (the chunks' sizes are the file's, so
        the budget cannot be kept by cutting them smaller, as a save does)."""
        if not records:
            return None
        # The destinations may still be in use by work the caller queued on its own streams (an
        # optimizer step writing the parameters a load_into restores): none is written before it.
        self.device.wait_for_current_streams()
        largest_raw = align_up(max(r.raw for r in records))
        largest_stored = align_up(max(r.stored for r in records))
        read_area = max(largest_stored, largest_raw)
        scratch = decode_scratch(codecs, largest_raw)

        def ring_fits(pieces: int) -> bool:
            left = self.max_staging_bytes - pieces * self.group_read_bytes
            return slots_that_fit(left, read_area + largest_raw, scratch) >= min(2, len(records))

        pieces = arena_pieces(self.max_staging_bytes, self.group_read_bytes, largest_stored) if len(records) > 1 else 0
        # Never more pieces than the bytes to read fill, and one more (a group across a boundary);
        # none where they fill less than two (the ring's slots read ahead as far): a restore of a
        # few MiB took 16 pieces of 64 MiB under a large budget.
        to_read = sum(align_up(r.stored) for r in records)
        pieces = 0 if to_read < 2 * self.group_read_bytes else min(pieces, -(-to_read // self.group_read_bytes) + 1)
        lead, self.lead = self.lead, None
        if (lead is not None and pieces and lead.piece_bytes == self.group_read_bytes
                and ring_fits(max(pieces, lead.pieces))):
            # ``lead_read_pieces`` keeps it within half of the least budget: the ring keeps the rest
            pieces = max(pieces, lead.pieces)
        elif lead is not None:
            # No arena to hold it (or no room for the ring beside it): every chunk is read as
            # usual. Its buffer is not part of the ring sized next, so it goes first (once its
            # reads end): the two never exceed the budget.
            lead.close()
            lead = None
        if pieces and lead is None and not ring_fits(pieces):
            pieces = 0
        arena_bytes = pieces * self.group_read_bytes
        slot_bytes = read_area + largest_raw
        slots = min(len(records), slots_that_fit(self.max_staging_bytes - arena_bytes, slot_bytes, scratch))
        if slots < 1:
            needed = math.ceil((scratch[0] + slot_bytes + scratch[1]) / STAGING_RING_SHARE)
            least = math.ceil(needed / self.share)  # the budget the user sets: this decoder has ``share`` of it
            while int(least * self.share) < needed:  # as ``__init__`` rounds its share down
                least += 1
            raise ValueError(
                f"a restore staging budget of {self.max_staging_bytes} bytes holds no slot for this file's chunks "
                f"(largest stored {largest_stored}, raw {largest_raw} bytes, with nvCOMP's decode scratch): it "
                f"needs Config.restore_staging_bytes of at least {least}")
        self._drop_staging()  # a restore's ring and arena replace any earlier ones
        self.ring = StagingRing(self.device, slots, read_area, largest_raw, timeout=self.timeout)
        self.arena = ReadArena(self.device, pieces, self.group_read_bytes, lead) if pieces else None
        self.staging_bytes = self.ring.nbytes + arena_bytes
        self._read_slots = {}
        return slots

    def read_arena(self) -> ReadArena | None:
        """The restore's grouped-read pieces (see the module docstring), or None."""
        return self.arena

    def release_staging(self) -> None:
        """Drop the restore's ring and read arena (``Decoder.release_staging``); the worker and
        its streams stay for the next restore."""
        self._drop_staging()
        self._read_slots = {}
        self.staging_bytes = 0

    def _drop_staging(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def read_buffer(self, nbytes: int, within: Any = None) -> Any:
        """A device buffer for a chunk read (kvikio fills it): the read area of a free slot of the
        restore ring (waiting at most ``timeout`` for one), or (no ring reserved) a new array.
        ``within``: the chunk's bytes in the read arena (a grouped read fills them): a slot is
        still taken (its areas are the decode's output and scratch) and ``within`` returned."""
        if self.ring is None:
            return self.device.empty(nbytes) if within is None else within
        if nbytes > self.ring.first_bytes:
            raise ValueError(f"read of {nbytes} bytes exceeds the restore slot ({self.ring.first_bytes})")
        slot = self.ring.acquire()
        buffer = self.ring.first(slot, nbytes) if within is None else within
        self._read_slots[self.device.address(buffer)] = slot
        return buffer

    def submit_decode(self, record: ChunkRecord, chain: list[dict[str, Any]], stored: Any,
                      deliver: Callable[[Any], None], *, to_host: bool = False,
                      places: list[tuple[int, int, int]] | None = None,
                      into: Any = None) -> Future[None]:
        """Queue a stored chunk for the worker (see ``Decoder.submit_decode``; ``into`` is not
        used: host destinations get their bytes through ``deliver``)."""
        future: Future[None] = Future()
        self._worker.submit(DecodeJob(record, chain, stored, deliver, future, to_host, places))
        return future

    def close(self) -> None:
        """Stop the worker and release the ring (``WorkerOwner.close``), the read arena, the bounce
        buffer and its copy threads."""
        super().close()
        arena, self.arena = self.arena, None  # the ring stays readable after close, as the encoder's does
        try:
            if arena is not None:
                arena.close()  # waits for a lead read's last reads: it may raise TimeoutError
        finally:
            self._bounce = None
            if self._host_copies is not None:
                self._host_copies.close(self.timeout)
                self._host_copies = None

    # -- the worker's batch --------------------------------------------------------------------
    def _decode_batch(self, jobs: list[DecodeJob]) -> None:
        slots = [self._read_slots.pop(self.device.address(job.stored), None) for job in jobs]
        delivered: list[Future[None]] = []
        try:
            with self.device.on_stream():
                delivered = self._decode_on_stream(jobs, slots)
        finally:
            # The stream is idle (or the batch failed before queueing work on it): the slots'
            # bytes are no longer needed. Returned before any future completes, so a driver that
            # sees a finished decode always finds its slot free.
            with contextlib.suppress(Exception):  # a broken device: the batch's own error is raised
                self.device.synchronize()
            for slot in slots:
                if slot is not None:
                    self.ring.release(slot)  # type: ignore[union-attr]  # slots come from the ring
            for job in jobs:  # nor the views of them: the driver may reserve the next ring at once
                job.stored = None
        for future in delivered:
            future.set_result(None)

    def _slot_areas(self, slot: int | None, raw: int) -> tuple[Any, Any]:
        """(read area, output area) of a restore slot, or new arrays without a ring."""
        if slot is None or self.ring is None:
            return self.device.empty(align_up(raw)), self.device.empty(align_up(raw))
        return self.ring.first(slot), self.ring.second(slot)

    def _undo_transforms(self, job: DecodeJob, raw: Any, read_area: Any, out_area: Any) -> Any:
        """Undo the chain's transforms before its codec on the device (byte planes; a delta's XOR
        is applied per array as the bytes are delivered, ``gdsckpt.state.delta``)."""
        for stage in reversed(job.chain[:-1]):
            if stage["name"] == XOR_BASE:
                continue
            if stage["name"] != BYTE_PLANES.name:
                raise UnsupportedFormatError(f"transform {stage['name']!r} is not known here")
            # into whichever area does not hold the planes (a decoded stream is in the output
            # area; a stored ``none/1`` one is still in the read area)
            holds_read = self.device.address(raw) == self.device.address(read_area)
            raw = planes_inverse_into(raw, out_area if holds_read else read_area, int(stage["width"]))
        return raw

    def _decode_on_stream(self, jobs: list[DecodeJob], slots: list[int | None]) -> list[Future[None]]:
        """Verify, decode and deliver a batch on the stream; returns the futures to complete once
        the stream has finished."""
        if all(job.chain[-1]["name"] in _QUEUED_CODECS for job in jobs):
            return self._decode_queued(jobs, slots)
        bodies = [job.stored[:job.record.stored] for job in jobs]
        crcs = self.device.crc32c(bodies)
        live: list[_Live] = []
        for job, body, crc, slot in zip(jobs, bodies, crcs, slots):
            if int(crc) != job.record.crc:
                job.future.set_exception(CorruptCheckpointError("chunk checksum mismatch"))
            else:
                live.append(_Live(job, body, *self._slot_areas(slot, job.record.raw)))
        groups: dict[DecoderKey, list[int]] = {}
        for i, entry in enumerate(live):
            try:
                key = decoder_key(entry.job.chain[-1])
            except ValueError as err:
                entry.job.future.set_exception(CorruptCheckpointError(f"invalid codec stage: {err}"))
                continue
            groups.setdefault(key, []).append(i)
        raws: list[Any] = [None] * len(live)
        to_host: list[tuple[DecodeJob, Any]] = []
        in_ring = bool(slots) and all(slot is not None for slot in slots)
        for (name, data_type, delta), members in groups.items():
            if name == "none/1":
                for i in members:
                    raws[i] = live[i].body
                continue
            self._decode_group(live, members, raws, device_decoder_name(name), data_type, delta, in_ring)
        delivered = []
        for entry, raw in zip(live, raws):
            if raw is None:
                continue
            job = entry.job
            if raw.nbytes != job.record.raw:
                job.future.set_exception(CorruptCheckpointError(
                    f"chunk decoded to {raw.nbytes} bytes, expected {job.record.raw}"))
                continue
            self._hand_over(job, raw, entry.read_area, entry.out_area, to_host)
            delivered.append(job.future)
        self._deliver_to_host(to_host)
        return delivered

    def _hand_over(self, job: DecodeJob, raw: Any, read_area: Any, out_area: Any,
                   to_host: list[tuple[DecodeJob, Any]]) -> None:
        """Send a decoded chunk (transforms not yet undone) to its destinations: written to its
        ``places`` where it has them, else, transforms undone, to ``deliver`` (host destinations
        through the bounce buffer: queued in ``to_host``)."""
        if job.places is not None and self._place(job, raw, read_area, out_area):
            return
        raw = self._undo_transforms(job, raw, read_area, out_area)
        if job.to_host:
            to_host.append((job, raw))
        else:
            job.deliver(raw)

    def _place(self, job: DecodeJob, raw: Any, read_area: Any, out_area: Any) -> bool:
        """Write a decoded chunk to its device ``places`` on the stream; False (nothing done) for
        a chain with transforms other than byte planes. A chunk whose one destination takes all
        of it has its byte planes undone straight into the destination; otherwise the planes are
        undone in the slot and each destination gets a copy of its range."""
        places = job.places
        assert places is not None
        transforms = job.chain[:-1]
        if any(stage["name"] != BYTE_PLANES.name for stage in transforms):
            return False
        if len(transforms) == 1 and len(places) == 1:
            offset, length, address = places[0]
            width = int(transforms[0]["width"])
            if offset == 0 and length == job.record.raw and address % width == 0:
                self.device.planes_inverse_to(raw, address, width)
                return True
        self.device.copy_out(self._undo_transforms(job, raw, read_area, out_area), places)
        return True

    def _decode_queued(self, jobs: list[DecodeJob], slots: list[int | None]) -> list[Future[None]]:
        """A batch of ANS and stored chunks, queued whole and waited for once: checksums and
        decoding (``verified_ans_decode``), byte planes and deliveries go on the stream, then the
        stream is synchronized and every chunk's checksum, status and size is looked at. The
        bytes of a damaged chunk may have reached its destination by then; its future fails, so
        the restore does (as when any chunk of a restore is damaged, a ``load_into`` target holds
        what was delivered before the error)."""
        valid: list[tuple[DecodeJob, int | None]] = []
        for job, slot in zip(jobs, slots):
            try:
                decoder_key(job.chain[-1])  # its parameters checked, though ANS reads its type from the stream
            except ValueError as err:
                job.future.set_exception(CorruptCheckpointError(f"invalid codec stage: {err}"))
                continue
            valid.append((job, slot))
        if not valid:
            return []
        jobs = [job for job, _slot in valid]
        areas = [self._slot_areas(slot, job.record.raw) for job, slot in valid]
        bodies = [job.stored[:job.record.stored] for job in jobs]
        stored_as_is = [job.chain[-1]["name"] == "none/1" for job in jobs]
        outputs = [None if as_is else out_area[:job.record.raw]
                   for job, as_is, (_read_area, out_area) in zip(jobs, stored_as_is, areas)]
        checked = self.device.verified_ans_decode(bodies, [job.record.crc for job in jobs], outputs)
        to_host: list[tuple[DecodeJob, Any]] = []
        wrong_size: dict[int, str] = {}
        for i, (job, body, out, (read_area, out_area)) in enumerate(zip(jobs, bodies, outputs, areas)):
            raw = body if out is None else out
            if raw.nbytes != job.record.raw:  # a stored chunk whose index sizes disagree
                wrong_size[i] = f"chunk decoded to {raw.nbytes} bytes, expected {job.record.raw}"
                continue
            self._hand_over(job, raw, read_area, out_area, to_host)
        self._deliver_to_host(to_host)
        self.device.synchronize()
        delivered = []
        for i, job in enumerate(jobs):
            problem = checked.problem(i, job.record.crc, job.record.raw) or wrong_size.get(i)
            if problem is not None:
                job.future.set_exception(CorruptCheckpointError(problem))
            else:
                delivered.append(job.future)
        return delivered

    def _deliver_to_host(self, jobs: list[tuple[DecodeJob, Any]]) -> None:
        """Hand decoded chunks (device arrays) to host destinations through the pinned bounce
        buffer: copy as many as fit into it on the stream, wait, deliver them on the copy threads,
        repeat (see the module docstring)."""
        if not jobs:
            return
        largest = max(raw.nbytes for _job, raw in jobs)
        if self._bounce is None or self._bounce.nbytes < largest:
            self._bounce = self.device.pinned_empty(max(HOST_BOUNCE_BYTES, align_up(largest)))
        if self._host_copies is None:
            self._host_copies = Lane("host-copy", HOST_COPY_THREADS)
        lane, bounce = self._host_copies, self._bounce
        start = 0
        while start < len(jobs):
            round_jobs, used = [], 0
            while start < len(jobs) and used + jobs[start][1].nbytes <= bounce.nbytes:
                job, raw = jobs[start]
                self.device.download(bounce[used:used + raw.nbytes], raw)
                round_jobs.append((job, bounce[used:used + raw.nbytes]))
                used += align_up(raw.nbytes)
                start += 1
            self.device.synchronize()
            copies = [lane.submit(job.deliver, host) for job, host in round_jobs]
            for copy in copies:
                copy.result(timeout=self.timeout)

    def _decode_group(self, live: list[_Live], members: list[int], raws: list[Any], user_name: str,
                      data_type: str | None, delta: float | None, in_ring: bool) -> None:
        """Decode the streams of ``live[i] for i in members`` (one decoder) in one nvCOMP call,
        setting ``raws[i]``; a damaged stream fails its chunks, any other error propagates."""
        raw_sizes = [live[i].job.record.raw for i in members]
        # Every output area is a view of one buffer (the ring, or a batch buffer without one):
        # nvCOMP's batches are carved from a single allocation at offsets.
        if in_ring and self.ring is not None:
            buffer = self.ring.buffer
            base = self.device.address(buffer)
            offsets = [self.device.address(live[i].out_area) - base for i in members]
        else:
            offsets = [0]
            for size in raw_sizes[:-1]:
                offsets.append(offsets[-1] + align_up(size))
            buffer = self.device.empty(offsets[-1] + align_up(raw_sizes[-1]))
        try:
            got = self.device.codec(user_name, data_type, delta).decode_into(
                [live[i].body for i in members], buffer, offsets, raw_sizes)
        except (ValueError, RuntimeError) as err:
            # nvCOMP raises RuntimeError for everything. Measured with nvCOMP 6.0: Zstd short of
            # scratch memory says "Could not determine the decompressed size", a garbled Zstd /
            # GDeflate / Snappy stream gives "an illegal memory access" and leaves the CUDA
            # context unusable. Neither proves the file damaged (its CRC matched): only a
            # ValueError (a stream claiming more bytes than its chunk) or a status naming an
            # undecodable stream does.
            if not isinstance(err, ValueError) and not reports_undecodable(err):
                raise
            for i in members:
                live[i].job.future.set_exception(CorruptCheckpointError(f"chunk does not decode ({err})"))
            return
        for i, offset, size in zip(members, offsets, got):
            raws[i] = buffer[offset:offset + size]
