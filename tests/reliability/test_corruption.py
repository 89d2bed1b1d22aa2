"""Random damage to a real checkpoint: seeded single-byte flips spread over every region of the
file, and truncations at random lengths.

Each flip's region is computed from the file's own index (chunk offsets and stored lengths, index
offset and length, header and trailer), which fixes the outcome it must have:

- a byte the format checksums (header fields, a chunk's stored bytes, the index, the trailer) makes
  ``gdsckpt.load`` and ``gdsckpt.verify`` raise the ``CheckpointError`` subclass docs/format.md
  prescribes; for a chunk's stored bytes, the error names that chunk and a tensor with bytes in it;
- a byte no checksum covers (header bytes [64, 4096), chunk padding) is ignored: the file loads
  bit-exact.

A load that returns anything other than the saved state, bit for bit, is a *silently wrong*
outcome; there must be none. ``verify`` must fail for exactly the flips ``load`` fails for, and a
lazy ``open().get`` of a tensor none of whose chunks was hit must still return it bit-exact.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.format import HEADER_REGION, TRAILER_SIZE, align_up, unpack_trailer

from .harness import record_figure

FLIPS_PER_CODEC = 600
TRUNCATIONS_PER_CODEC = 60
# Share of the flips each region group gets (offsets are uniform within a group).
REGION_WEIGHTS = {"header": 10, "header padding": 8, "chunk bytes": 42, "chunk padding": 15, "index": 15,
                  "trailer": 10}


def group_regions(regions: list[tuple[str, int, int, int | None]]) -> dict[str, list[tuple[int, int, int | None]]]:
    """Region name -> its (start, stop, chunk) spans, in ``REGION_WEIGHTS`` order."""
    groups: dict[str, list[tuple[int, int, int | None]]] = {}
    for group, start, stop, chunk in regions:
        groups.setdefault(group, []).append((start, stop, chunk))
    return {name: groups[name] for name in REGION_WEIGHTS if name in groups}


def pick_byte(rng: random.Random, groups: dict[str, list[tuple[int, int, int | None]]]) -> tuple[str, int, int | None]:
    """A random (region, file offset, chunk): the region by ``REGION_WEIGHTS``, then a byte in it."""
    names = list(groups)
    group = rng.choices(names, weights=[REGION_WEIGHTS[g] for g in names])[0]
    spans = groups[group]
    position = rng.randrange(sum(stop - start for start, stop, _ in spans))
    for start, stop, chunk in spans:
        if position < stop - start:
            return group, start + position, chunk
        position -= stop - start
    raise AssertionError("unreachable: position lies within the spans")


def _config() -> gdsckpt.Config:
    # 8 KiB chunks: the 60 KiB state spans about ten chunks, one of them a pack of small tensors.
    return gdsckpt.Config(chunk_bytes=8192, pack_below=1024, codec_threads=2, io_threads=2, fsync=False)


def _flat_state() -> dict[str, Any]:
    """Key path -> array (no key needs escaping, so the key paths split back on '/')."""
    g = torch.Generator().manual_seed(8)
    payload_nans = torch.tensor([0x7FC00001, 0x7F800001, -0x3EDCBA9, 0x7FFFFFFF], dtype=torch.int32)
    specials = torch.cat([payload_nans.view(torch.float32),
                          torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), 1e-45, -3.5])])
    return {
        "model/embed": (torch.randn(40, 131, generator=g) * 0.02).to(torch.bfloat16),  # 10480 B
        "model/w": torch.randn(3001, generator=g),                                     # 12004 B
        "model/ids": torch.randint(-(1 << 40), 1 << 40, (700,), generator=g),          # 5600 B
        "model/counts": torch.arange(1500, dtype=torch.int32) // 7,                    # 6000 B
        "model/master": np.random.default_rng(8).standard_normal(900).astype(np.float64),  # 7200 B
        "optimizer/exp_avg": torch.randn(50, generator=g),                             # packed below
        "optimizer/step": torch.tensor(7.0),
        "optimizer/mask": torch.rand(37, generator=g) > 0.5,
        "optimizer/bias": torch.randn(33, generator=g).to(torch.bfloat16),
        "optimizer/specials": specials,
        "optimizer/negzero": torch.full((5,), -0.0, dtype=torch.bfloat16),
    }


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {"step": 12, "lr": -0.0, "nan": float("nan")}
    for key, value in flat.items():
        node = state
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return state


def _raw_bytes(value: Any, h: Any) -> bytes:
    return h.tensor_bytes(value) if isinstance(value, torch.Tensor) else h.array_bytes(value)


def _same(expected: Any, actual: Any, h: Any) -> bool:
    """True when ``actual`` has the exact types, structure and bits of ``expected``."""
    try:
        h.assert_same(expected, actual)
    except AssertionError:
        return False
    return True


def _regions(data: bytes, index: Any) -> list[tuple[str, int, int, int | None]]:
    """(group, start, stop, chunk) ranges tiling the whole file, computed from the trailer and the
    index's chunk records."""
    size = len(data)
    trailer = size - TRAILER_SIZE
    index_offset = unpack_trailer(data[trailer:], size).index_offset
    regions: list[tuple[str, int, int, int | None]] = [("header", 0, 64, None),
                                                       ("header padding", 64, HEADER_REGION, None)]
    for number, chunk in enumerate(index.chunks):
        end = chunk.offset + chunk.stored
        regions.append(("chunk bytes", chunk.offset, end, number))
        regions.append(("chunk padding", end, align_up(end), number))
    regions += [("index", index_offset, trailer, None), ("trailer", trailer, size, None)]
    regions = [r for r in regions if r[2] > r[1]]
    position = 0
    for _group, start, stop, _chunk in regions:
        assert start == position, f"regions must tile the file: gap or overlap at {position}"
        position = stop
    assert position == size
    return regions


# What a flip in the magic number, the major version or any other byte of the header / trailer
# raises (docs/format.md sections 2 and 3: magic, then major, then CRC).
_STRUCTURE_ERRORS: dict[str, tuple[tuple[type[BaseException], str], ...]] = {
    "header": ((gdsckpt.UnsupportedFormatError, "not a gdsckpt checkpoint"),
               (gdsckpt.UnsupportedFormatError, r"version .* upgrade"),
               (gdsckpt.CorruptCheckpointError, "header")),
    "trailer": ((gdsckpt.CorruptCheckpointError, "no trailer"),
                (gdsckpt.UnsupportedFormatError, r"version .* upgrade"),
                (gdsckpt.CorruptCheckpointError, "trailer checksum mismatch")),
}


def _expected(group: str, offset: int, size: int) -> tuple[type[BaseException] | None, str]:
    """The error class a flip at ``offset`` must raise (None: it must load bit-exact) and a regex
    its message must match."""
    if group in ("header padding", "chunk padding"):
        return None, ""
    if group in _STRUCTURE_ERRORS:
        at = offset if group == "header" else offset - (size - TRAILER_SIZE)
        return _STRUCTURE_ERRORS[group][0 if at < 8 else 1 if at < 10 else 2]
    if group == "index":
        return gdsckpt.CorruptCheckpointError, "index checksum mismatch"
    return gdsckpt.CorruptCheckpointError, r"chunk (checksum mismatch|does not decode)"


def _attempt(operation: Any) -> tuple[Any, BaseException | None]:
    """Run ``operation``; a ``CheckpointError`` is an outcome, any other exception fails the test."""
    try:
        return operation(), None
    except gdsckpt.CheckpointError as err:
        return None, err


@pytest.fixture(scope="module", params=["zstd", "none"])
def damaged_target(request: Any, tmp_path_factory: Any) -> tuple[str, Path, dict[str, Any], str]:
    flat = _flat_state()
    path = tmp_path_factory.mktemp(f"corruption-{request.param}") / "ckpt.gdsckpt"
    report = gdsckpt.save(_nest(flat), path, codec=request.param, config=_config())
    if request.param == "zstd":
        assert any("zstd/1" in chain for chain in report.chains), report.chains
    assert report.chunks >= 6, report.chunks
    chains = ", ".join(f"{count} {chain}" for chain, count in sorted(report.chains.items()))
    return request.param, path, flat, chains


@dataclass
class FlipOutcome:
    """What a flip campaign (``flip_campaign``) saw."""

    outcomes: Counter[str] = field(default_factory=Counter)
    raised_by_load: set[int] = field(default_factory=set)
    raised_by_verify: set[int] = field(default_factory=set)
    lazy_untouched: int = 0
    lazy_damaged: int = 0
    groups: list[str] = field(default_factory=list)
    """The file's region groups (every one must be hit)."""

    def summary(self) -> str:
        return ", ".join(f"{name} {count}" for name, count in sorted(self.outcomes.items()))


def flip_campaign(path: Path, flat: dict[str, Any], h: Any, *, flips: int, seed: str,
                  load: Callable[[], Any], verify: Callable[[], Any], same: Callable[[Any], bool],
                  check_lazy: Callable[[int, list[str], list[str], random.Random, str], tuple[int, int]]
                  ) -> FlipOutcome:
    """``flips`` seeded single-byte flips of ``path`` (each undone before the next), spread over
    every region of the file its index names; after each, ``load()`` and ``verify()`` must both
    raise the error the region calls for (naming the chunk and a tensor it holds, for chunk
    bytes), or, for bytes nothing covers, both succeed and ``same(loaded)`` hold. After a chunk
    hit, ``check_lazy(chunk, untouched keys, damaged keys, rng, where)`` reads through
    ``gdsckpt.open`` and returns (untouched reads, damaged reads). Shared by the CPU campaign
    here and the GPU one (tests/gpu/test_gpu_reliability.py); ``assert_sound`` checks its result."""
    original = path.read_bytes()
    size = len(original)
    index = h.read_index(path)
    owners = {c: {t.key for t in index.tensors if any(s.chunk == c for s in t.segments)}
              for c in range(len(index.chunks))}
    assert all(owners.values())
    groups = group_regions(_regions(original, index))
    rng = random.Random(seed)
    seen = FlipOutcome(groups=list(groups))
    for flip in range(flips):
        group, offset, chunk = pick_byte(rng, groups)
        mask = rng.randrange(1, 256)
        where = f"flip {flip}: byte {offset} ^ {mask:#04x} in {group} (chunk {chunk})"
        error_class, pattern = _expected(group, offset, size)
        with path.open("r+b") as handle:
            handle.seek(offset)
            handle.write(bytes([original[offset] ^ mask]))
        try:
            loaded, load_error = _attempt(load)
            _, verify_error = _attempt(verify)
            if load_error is not None:
                seen.raised_by_load.add(flip)
            if verify_error is not None:
                seen.raised_by_verify.add(flip)
            if error_class is None:
                assert load_error is None, f"{where}: uncovered byte failed the load: {load_error!r}"
                assert verify_error is None, f"{where}: uncovered byte failed verify: {verify_error!r}"
                seen.outcomes[f"{group}: loaded bit-exact" if same(loaded) else "SILENTLY WRONG"] += 1
                continue
            if load_error is None:
                seen.outcomes["SILENTLY WRONG" if not same(loaded) else f"{group}: unnoticed"] += 1
                continue
            for err in (load_error, verify_error):
                assert type(err) is error_class, f"{where}: {err!r}, expected {error_class.__name__}"
                assert re.search(pattern, str(err)), f"{where}: {err}"
            if group == "chunk bytes":
                for err in (load_error, verify_error):
                    assert err.chunk == chunk and err.key in owners[chunk], f"{where}: {err!r}"
                    assert f"chunk {chunk}" in str(err) and repr(err.key) in str(err), f"{where}: {err}"
                untouched = sorted(key for key in flat if key not in owners[chunk])
                reads, raised = check_lazy(chunk, untouched, sorted(owners[chunk]), rng, where)
                seen.lazy_untouched += reads
                seen.lazy_damaged += raised
            seen.outcomes[f"{group}: raised {error_class.__name__}"] += 1
        finally:
            with path.open("r+b") as handle:
                handle.seek(offset)
                handle.write(original[offset:offset + 1])
    assert path.read_bytes() == original
    return seen


def assert_sound(seen: FlipOutcome, flips: int) -> None:
    """No flip went unnoticed or loaded wrong, ``verify`` failed exactly where ``load`` did, and
    every region of the file was hit."""
    assert seen.outcomes["SILENTLY WRONG"] == 0
    assert not [name for name in seen.outcomes if name.endswith("unnoticed")], seen.outcomes
    assert seen.raised_by_load == seen.raised_by_verify
    assert sum(seen.outcomes.values()) == flips
    for group in seen.groups:
        assert any(name.startswith(f"{group}:") for name in seen.outcomes), (group, seen.outcomes)


def test_random_byte_flips_raise_or_load_bit_exact(damaged_target: Any, h: Any) -> None:
    codec, path, flat, chains = damaged_target
    config = _config()
    state = _nest(flat)
    h.assert_same(state, gdsckpt.load(path, config=config))

    def check_lazy(chunk: int, untouched: list[str], damaged: list[str], rng: random.Random,
                   where: str) -> tuple[int, int]:
        key = rng.choice(untouched)
        with gdsckpt.open(path, config=config) as ckpt:
            assert _raw_bytes(ckpt.get(key), h) == _raw_bytes(flat[key], h), f"{where}: {key}"
            everything = ckpt.get_many(untouched)
            for other in untouched:
                h.assert_same(flat[other], everything[other], other)
            with pytest.raises(gdsckpt.CorruptCheckpointError) as caught:
                ckpt.get(rng.choice(damaged))
            assert caught.value.chunk == chunk, where
        return 1 + len(untouched), 1

    seen = flip_campaign(path, flat, h, flips=FLIPS_PER_CODEC, seed=f"flips-{codec}",
                         load=lambda: gdsckpt.load(path, config=config),
                         verify=lambda: gdsckpt.verify(path, config=config),
                         same=lambda loaded: _same(state, loaded, h), check_lazy=check_lazy)
    index = h.read_index(path)
    record_figure(f"corruption flips ({codec})",
                  f"{FLIPS_PER_CODEC} single-byte flips over a {path.stat().st_size}-byte file of "
                  f"{len(index.chunks)} chunks ({chains}) and {len(index.tensors)} tensors: {seen.summary()}; "
                  f"silently wrong {seen.outcomes['SILENTLY WRONG']}; verify raised for the same "
                  f"{len(seen.raised_by_verify)} flips as load; lazy get after a chunk hit: "
                  f"{seen.lazy_untouched} untouched-tensor reads bit-exact, {seen.lazy_damaged} "
                  f"damaged-tensor reads raised")
    assert_sound(seen, FLIPS_PER_CODEC)


def test_random_truncations_raise(damaged_target: Any, tmp_path: Path) -> None:
    codec, path, _flat, _chains = damaged_target
    config = _config()
    original = path.read_bytes()
    rng = random.Random(f"truncations-{codec}")
    lengths = sorted(rng.sample(range(len(original)), TRUNCATIONS_PER_CODEC - 4) + [0, 7, 63, 4159])
    short = tmp_path / "short.gdsckpt"
    outcomes: Counter[str] = Counter()
    for length in lengths:
        short.write_bytes(original[:length])
        expected = gdsckpt.UnsupportedFormatError if length < 8 else gdsckpt.CorruptCheckpointError
        for operation in (gdsckpt.load, gdsckpt.verify, gdsckpt.inspect, gdsckpt.open):
            with pytest.raises(gdsckpt.CheckpointError) as caught:
                operation(short, config=config)
            assert type(caught.value) is expected, (length, operation.__name__, caught.value)
        outcomes[expected.__name__] += 1
    record_figure(f"corruption truncations ({codec})",
                  f"{len(lengths)} truncations of a {len(original)}-byte file at random lengths: "
                  + ", ".join(f"{count} raised {name}" for name, count in sorted(outcomes.items()))
                  + " from each of load, verify, inspect and open; 0 loaded")
    assert sum(outcomes.values()) == len(lengths) == TRUNCATIONS_PER_CODEC
