"""``state.delta.BaseReader``: the windowed, cached reader that ``rewrite`` (``convert``,
``rebase``) and delta saves read a checkpoint's arrays through: one fetch per window whatever the
number of threads asking, one fetch at a time, a failed fetch retried by a thread that waited for
it, the next window read ahead where asked (a failed read ahead fetched again by the reader that
needs it), small arrays batched in file order so that a convert reads each byte once, and a
checkpoint reading windows keeps one decoding engine for all of them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.state import delta as delta_module
from gdsckpt.state.delta import BaseReader

WINDOW = 4096


class _Arrays:
    """A base of arrays whose bytes are their offsets mod 251; records each ``read_many``."""

    def __init__(self, sizes: dict[str, int], fail: set[tuple[str, int]] | None = None, delay: float = 0.0):
        self.sizes = sizes
        self.calls: list[tuple[str, list[tuple[str, int, int]]]] = []
        self.fail = fail or set()
        self.delay = delay
        self.lock = threading.Lock()

    def read_many(self, requests: list[tuple[str, int, int]], device: Any) -> list[Any]:
        assert device is None
        with self.lock:
            self.calls.append((threading.current_thread().name, list(requests)))
            failing = (requests[0][0], requests[0][1]) in self.fail
            self.fail.discard((requests[0][0], requests[0][1]))
        time.sleep(self.delay)
        if failing:
            raise OSError("injected read failure")
        return [(np.arange(start, stop) % 251).astype(np.uint8) for _key, start, stop in requests]


@pytest.fixture(autouse=True)
def _small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_module, "HOST_WINDOW_BYTES", WINDOW)


def _expected(start: int, stop: int) -> np.ndarray:
    return (np.arange(start, stop) % 251).astype(np.uint8)


def test_only_asked_windows_are_fetched_one_at_a_time() -> None:
    """Threads asking for different windows fetch them in turn (at most one restore at a time),
    each once, and nothing is read ahead."""
    arrays = _Arrays({"a": 4 * WINDOW}, delay=0.05)
    reader = BaseReader(arrays, arrays.sizes)
    active, most = [0], [0]
    original = arrays.read_many

    def counting(requests: list[tuple[str, int, int]], device: Any) -> list[Any]:
        with arrays.lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return original(requests, device)
        finally:
            with arrays.lock:
                active[0] -= 1

    arrays.read_many = counting  # type: ignore[method-assign]
    got: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda w=w: got.__setitem__(w, reader.read("a", w * WINDOW, w * WINDOW + 9,
                                                                                  None)))
               for w in (0, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert most[0] == 1
    assert sorted(requests[0][:2] for _name, requests in arrays.calls) == [("a", 0), ("a", 2 * WINDOW)]
    assert all(np.array_equal(got[w], _expected(w * WINDOW, w * WINDOW + 9)) for w in (0, 2))


def test_threads_asking_for_one_window_share_one_fetch() -> None:
    arrays = _Arrays({"a": 2 * WINDOW}, delay=0.2)
    reader = BaseReader(arrays, arrays.sizes)
    results: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda i=i: results.append(reader.read("a", i * 100, i * 100 + 64, None)))
               for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(arrays.calls) == 1 and len(results) == 8
    assert sorted(int(r[0]) for r in results) == sorted(int(_expected(i * 100, i * 100 + 1)[0]) for i in range(8))


def test_a_thread_whose_awaited_fetch_failed_fetches_the_window_itself() -> None:
    arrays = _Arrays({"a": 2 * WINDOW}, fail={("a", 0)}, delay=0.1)
    reader = BaseReader(arrays, arrays.sizes)
    outcome: list[Any] = []

    def first() -> None:
        try:
            reader.read("a", 0, 10, None)
        except OSError as err:
            outcome.append(err)

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(0.03)  # the first thread's fetch is under way
    assert np.array_equal(reader.read("a", 5, 20, None), _expected(5, 20))
    thread.join(timeout=30)
    assert len(outcome) == 1 and "injected" in str(outcome[0])
    assert [requests[0][:2] for _name, requests in arrays.calls] == [("a", 0), ("a", 0)]


def test_a_fetch_that_fails_for_its_caller_raises() -> None:
    arrays = _Arrays({"a": 2 * WINDOW}, fail={("a", 0)})
    reader = BaseReader(arrays, arrays.sizes)
    with pytest.raises(OSError, match="injected"):
        reader.read("a", 0, 10, None)
    assert np.array_equal(reader.read("a", 0, 10, None), _expected(0, 10))  # nothing cached the failure


def test_a_checkpoint_read_in_windows_keeps_one_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      h: Any) -> None:
    """A convert reads its source in many windows through one engine (and one data reader)."""
    from gdsckpt.api import checkpoint as checkpoint_module

    made: list[Any] = []
    original = checkpoint_module.restore_engine

    def counting(config: Any, gpu_device: Any, **options: Any) -> Any:
        engine = original(config, gpu_device, **options)
        made.append(engine)
        return engine

    monkeypatch.setattr(checkpoint_module, "restore_engine", counting)
    state = {f"w{i}": torch.randn(5000, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    source = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, source, codec="zstd", config=gdsckpt.Config(chunk_bytes=4096))
    made.clear()
    windows: list[Any] = []
    original_read_many = checkpoint_module.Checkpoint._read_many

    def reading(self: Any, requests: Any, device: Any = None) -> Any:
        windows.append(requests)
        return original_read_many(self, requests, device)

    monkeypatch.setattr(checkpoint_module.Checkpoint, "_read_many", reading)
    gdsckpt.convert(source, tmp_path / "b.gdsckpt", codec="lz4",
                    config=gdsckpt.Config(chunk_bytes=4096, max_inflight_bytes=4096))  # windows of 4 KiB
    assert len(windows) >= 20 and len(made) == 1, (len(windows), made)
    h.assert_same(state, gdsckpt.load(tmp_path / "b.gdsckpt"))


def test_a_failed_window_restore_closes_its_engine_and_the_next_gets_a_new_one(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from gdsckpt.api import checkpoint as checkpoint_module

    made: list[Any] = []
    original_engine = checkpoint_module.restore_engine
    original_restore = checkpoint_module.restore_arrays
    failures = [1]

    def counting(config: Any, gpu_device: Any, **options: Any) -> Any:
        engine = original_engine(config, gpu_device, **options)
        made.append(engine)
        return engine

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise OSError("injected restore failure")
        return original_restore(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "restore_engine", counting)
    monkeypatch.setattr(checkpoint_module, "restore_arrays", failing_once)
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"w": torch.arange(5000, dtype=torch.float32)}, path, codec="zstd")
    with gdsckpt.open(path) as checkpoint:
        with pytest.raises(OSError, match="injected"):
            checkpoint._read_many([("w", 0, 400)])
        (window,) = checkpoint._read_many([("w", 0, 400)])
    assert len(made) == 2
    assert np.array_equal(window, torch.arange(100, dtype=torch.float32).numpy().view(np.uint8))


def _read_all(reader: BaseReader, sizes: dict[str, int], step: int = 1024) -> None:
    for key, nbytes in sizes.items():
        for start in range(0, nbytes, step):
            assert np.array_equal(reader.read(key, start, min(nbytes, start + step), None),
                                  _expected(start, min(nbytes, start + step)))


def test_read_ahead_fetches_the_next_window_on_its_own_thread_once() -> None:
    """With ``read_ahead`` the window after the one being read is fetched on a thread of its own
    while the reader works on this one; reading every window in order fetches each once, one
    fetch at a time, and the reads of a read-ahead window start no fetch of their own."""
    sizes = {"a": 3 * WINDOW + 100, "b": 2 * WINDOW}
    arrays = _Arrays(sizes, delay=0.02)
    reader = BaseReader(arrays, sizes, read_ahead=True)
    reader.read("a", 0, 10, None)
    reader.close()  # waits for the read ahead of the second window
    assert [(name, requests[0][:2]) for name, requests in arrays.calls] == [
        (threading.current_thread().name, ("a", 0)), ("gdsckpt-read-ahead", ("a", WINDOW))]
    _read_all(reader, sizes)
    reader.close()
    fetched = [requests[0][:2] for _name, requests in arrays.calls]
    assert fetched == [("a", 0), ("a", WINDOW), ("a", 2 * WINDOW), ("a", 3 * WINDOW), ("b", 0), ("b", WINDOW)]
    assert sum(1 for name, _requests in arrays.calls if name == "gdsckpt-read-ahead") >= 4


def test_without_read_ahead_nothing_is_fetched_before_it_is_asked_for() -> None:
    sizes = {"a": 3 * WINDOW}
    arrays = _Arrays(sizes)
    reader = BaseReader(arrays, sizes)
    reader.read("a", 0, 10, None)
    time.sleep(0.05)
    assert [requests[0][:2] for _name, requests in arrays.calls] == [("a", 0)]


def test_a_failed_read_ahead_is_fetched_again_by_the_reader_that_needs_it() -> None:
    sizes = {"a": 3 * WINDOW}
    arrays = _Arrays(sizes, fail={("a", WINDOW)})
    reader = BaseReader(arrays, sizes, read_ahead=True)
    reader.read("a", 0, 10, None)
    reader.close()  # the read ahead of the second window failed; nobody asked for it yet
    assert np.array_equal(reader.read("a", WINDOW + 5, WINDOW + 50, None), _expected(WINDOW + 5, WINDOW + 50))
    reader.close()
    assert [requests[0][:2] for _name, requests in arrays.calls][:3] == [("a", 0), ("a", WINDOW), ("a", WINDOW)]


def test_read_ahead_of_small_arrays_batches_each_once() -> None:
    """Many arrays smaller than a quarter window are read ahead a batch at a time, each array in
    exactly one fetch (a read inside a batch already read ahead starts no other)."""
    sizes = {f"s{i}": 300 for i in range(60)}
    arrays = _Arrays(sizes)
    reader = BaseReader(arrays, sizes, read_ahead=True)
    _read_all(reader, sizes, step=300)
    reader.close()
    fetched = [key for _name, requests in arrays.calls for key, _start, _stop in requests]
    assert sorted(fetched) == sorted(sizes) and len(arrays.calls) == -(-60 * 300 // WINDOW)


def test_read_ahead_over_many_small_arrays_walks_the_cache_a_bounded_number_of_times() -> None:
    """Looking for the window after a batch of small arrays scans the cache once, not once per
    array: with the cache scanned for each array, 3,000 arrays in one batch cost millions of
    entry visits (a convert of 20,000 small arrays took 20 s instead of 1)."""
    from collections import OrderedDict

    visits = [0]

    class CountingCache(OrderedDict):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            for entry in super().__iter__():
                visits[0] += 1
                yield entry

        def items(self) -> Any:  # lazy, as OrderedDict's: a lookup that stops early visits few
            return ((key, self[key]) for key in self)

    count = 3000
    sizes = {f"s{i}": 8 for i in range(count)}
    arrays = _Arrays(sizes)
    reader = BaseReader(arrays, sizes, read_ahead=True, window_bytes=1 << 20)
    reader._cache = CountingCache()
    _read_all(reader, sizes, step=8)
    reader.close()
    assert len(arrays.calls) == 1
    assert visits[0] < 20 * count, visits[0]


def test_a_convert_reads_each_source_byte_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """Small arrays recorded between large ones are packed at the end of the file; the reader
    batches them in file order, so a convert fetches every byte of its source once. In record
    order each batch for a small array also pulled in the large arrays recorded after it, which
    the cache had dropped: the source was read about twice over."""
    from gdsckpt.api import checkpoint as checkpoint_module

    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {}
    for layer in range(32):
        state[f"layer{layer}.weight"] = torch.randn(2048, generator=g)  # 8 KiB: a chunk of its own
        state[f"layer{layer}.bias"] = torch.randn(64, generator=g)  # packed at the end of the file
    config = gdsckpt.Config(chunk_bytes=16 << 10, pack_below=4096, max_inflight_bytes=64 << 10, codec_threads=2)
    source = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, source, codec="zstd", config=config)
    fetched: list[int] = []
    original = checkpoint_module.Checkpoint._read_many

    def counting(self: Any, requests: Any, device: Any = None) -> Any:
        fetched.append(sum(stop - start for _key, start, stop in requests))
        return original(self, requests, device)

    monkeypatch.setattr(checkpoint_module.Checkpoint, "_read_many", counting)
    gdsckpt.convert(source, tmp_path / "b.gdsckpt", codec="lz4", config=config)
    assert sum(fetched) == sum(t.numel() * t.element_size() for t in state.values()), fetched
    h.assert_same(state, gdsckpt.load(tmp_path / "b.gdsckpt"))
