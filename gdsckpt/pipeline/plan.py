"""Chunk planning: which bytes of which arrays go into which chunk.

The pipeline never sees torch, NumPy or CuPy types: arrays reach it through the small
``ArraySource`` (save) and ``ArrayTarget`` (restore) interfaces that ``gdsckpt.state`` implements
for each array library. Offsets are byte offsets into an array's element bytes in C order,
little-endian; they are always multiples of the array's itemsize.

Planning rules (docs/format.md, "Chunks"):
- an array of at least ``pack_below`` bytes gets chunks of its own, each ``chunk_bytes`` except
  the last;
- smaller arrays are packed, in order, into shared chunks of up to ``chunk_bytes``, one run of
  packs per byte-plane width, so a state with 10,000 tiny tensors makes a few chunks, not 10,000;
  a state whose arrays are all packed and fit in one page together gets one chunk (one page of
  padding, not one per width);
- aliases and zero-size arrays get no chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import collector
from ..format import ALIGNMENT


class ArraySource(Protocol):
    """Read access to one array's element bytes, for the save pipeline."""

    nbytes: int
    itemsize: int
    plane_width: int
    on_device: bool

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` as a contiguous host uint8 array (a view where possible)."""
        ...

    def device_bytes(self, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` as a contiguous CuPy uint8 array on the array's device."""
        ...


class ArrayTarget(Protocol):
    """Write access to one destination array's element bytes, for the restore pipeline."""

    nbytes: int
    on_device: bool

    def write_host(self, start: int, data: np.ndarray) -> None:
        """Copy host bytes into ``[start, start + len(data))``."""
        ...

    def write_device(self, start: int, data: Any) -> None:
        """Copy CuPy device bytes into ``[start, start + len(data))``."""
        ...

    def finish(self) -> Any:
        """Complete the array (copy back, convert) and return the finished object."""
        ...


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, stop)`` of array ``array``."""

    array: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        """Bytes of the part (``stop - start``)."""
        return self.stop - self.start


@dataclass
class ChunkPlan:
    """One planned chunk: the parts it concatenates and the byte-plane width that applies."""

    number: int
    parts: list[Part] = field(default_factory=list)
    plane_width: int = 0
    decision_group: int = -1
    """Chunks of one array share one transform decision; each pack chunk decides for itself."""
    delta: bool = False
    """The chunk's arrays are stored as the XOR with a base checkpoint (never mixed with others)."""

    @property
    def raw(self) -> int:
        """Uncompressed bytes of the chunk: its parts' lengths summed."""
        return sum(part.length for part in self.parts)


@collector.paused()
def plan_chunks(sizes: list[tuple[int, int, int]], *, chunk_bytes: int, pack_below: int,
                delta: set[int] | frozenset[int] = frozenset()) -> list[ChunkPlan]:
    """Plan chunks for arrays given as ``(nbytes, itemsize, plane_width)``; ``nbytes == 0``
    (including aliases, which the caller passes as 0) yields no chunk. Arrays in ``delta`` are
    packed only with each other (a chunk's chain says whether it holds XORs with a base).

    ``chunk_bytes`` must be a positive multiple of 4096 (so of every itemsize).
    """
    if chunk_bytes <= 0 or chunk_bytes % ALIGNMENT:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}")
    plans: list[ChunkPlan] = []
    packs: dict[tuple[bool, int], list[int]] = {}
    for index, (nbytes, _itemsize, width) in enumerate(sizes):
        if nbytes == 0:
            continue
        if nbytes < pack_below:
            packs.setdefault((index in delta, width), []).append(index)
            continue
        for start in range(0, nbytes, chunk_bytes):
            plans.append(ChunkPlan(len(plans), [Part(index, start, min(nbytes, start + chunk_bytes))],
                                   width, decision_group=index, delta=index in delta))
    if not plans:
        packs = _one_page_packs(packs, sizes)
    for (is_delta, width), members in sorted(packs.items()):
        current: ChunkPlan | None = None
        filled = 0  # current.raw, kept here: summing the parts per member is quadratic
        for index in members:
            nbytes = sizes[index][0]
            if current is None or filled + nbytes > chunk_bytes:
                current = ChunkPlan(len(plans), [], width, decision_group=-1 - len(plans), delta=is_delta)
                plans.append(current)
                filled = 0
            current.parts.append(Part(index, 0, nbytes))
            filled += nbytes
    return plans


def _one_page_packs(packs: dict[tuple[bool, int], list[int]],
                    sizes: list[tuple[int, int, int]]) -> dict[tuple[bool, int], list[int]]:
    """The packs of a state with no array of its own chunks, merged across plane widths where they
    fit in one page (``ALIGNMENT`` bytes) together: each chunk is padded to a page on disk, so a
    tiny state of three dtypes would otherwise take three pages for a few hundred bytes, and
    byte planes gain nothing on so few bytes. The merged chunk takes no byte planes unless its
    arrays share a width. Delta and full arrays stay apart (a chunk's chain says which it holds);
    states with larger arrays are planned as before."""
    merged: dict[tuple[bool, int], list[int]] = {}
    for is_delta in (False, True):
        keys = [key for key in packs if key[0] == is_delta]
        members = sorted(i for key in keys for i in packs[key])  # array order, as within one pack
        if len(keys) > 1 and sum(sizes[i][0] for i in members) <= ALIGNMENT:
            merged[(is_delta, 0)] = members
        else:
            merged.update((key, packs[key]) for key in keys)
    return merged
