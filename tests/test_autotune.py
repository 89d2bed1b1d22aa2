"""codec="auto" on the GPU: the choice rule and the cached storage measurement (CPU-testable parts)."""

from __future__ import annotations

import json

import pytest

from gdsckpt.pipeline import autotune


def test_slow_storage_picks_the_better_ratio():
    # 2 GB/s storage: both codecs outrun the disk, so bytes stored decide.
    assert autotune.choose_codec(2.0, {"ans": 1.25, "zstd": 1.30}) == "zstd"
    assert autotune.choose_codec(2.0, {"ans": 1.35, "zstd": 1.30}) == "ans"


def test_fast_storage_picks_the_codec_that_keeps_up():
    # 30 GB/s NVMe array: zstd (8 GB/s) is the bottleneck even with the better ratio.
    assert autotune.choose_codec(30.0, {"ans": 1.25, "zstd": 1.40}) == "ans"


def test_guide_thresholds_emerge_from_the_rule():
    ratios = {"ans": 1.20, "zstd": 1.35}
    assert autotune.choose_codec(5.0, ratios) == "zstd"   # ~5-10 GB/s: Zstd
    assert autotune.choose_codec(15.0, ratios) == "ans"   # >= ~15 GB/s: gANS


def test_choose_codec_needs_candidates():
    with pytest.raises(ValueError, match="no candidate"):
        autotune.choose_codec(1.0, {})


def test_storage_speed_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "PROBE_BYTES", 4 << 20)
    calls = []
    real = autotune.measure_storage_gbps
    monkeypatch.setattr(autotune, "measure_storage_gbps",
                        lambda d, n=None, timeout=600.0: calls.append(d) or real(d, n, timeout))
    first = autotune.storage_gbps(tmp_path)
    second = autotune.storage_gbps(tmp_path)
    assert first > 0 and second == first and len(calls) == 1
    cached = json.loads((tmp_path / "cache" / "gdsckpt" / "storage.json").read_text())
    assert next(iter(cached.values()))["gbps"] == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gdsckpt-storage-probe")]


def test_storage_speed_override_skips_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "measure_storage_gbps", lambda *a: pytest.fail("measured"))
    assert autotune.storage_gbps(tmp_path, 12.5) == 12.5


def test_zstd_is_left_out_where_its_scratch_leaves_no_batch():
    """nvCOMP's Zstd needs ~1.1 GiB of scratch for 16 MiB chunks: inside the default 1 GiB budget
    it would compress a chunk or two per call (0.05-0.07 GB/s on the H200), so auto must not pick
    it however well it compresses; with room for a batch it competes again."""
    from gdsckpt import Config

    default = Config()
    candidates, left_out = autotune.runnable_candidates(default.max_staging_bytes, default.gpu_chunk_bytes)
    assert candidates == ["ans"] and set(left_out) == {"zstd"}
    assert "max_staging_bytes" in left_out["zstd"]
    roomy, left_out = autotune.runnable_candidates(4 << 30, 16 << 20)
    assert roomy == ["ans", "zstd"] and left_out == {}
    slots = autotune.batch_slots(4 << 30, 16 << 20)
    assert slots["zstd"] >= autotune.MIN_BATCH_SLOTS and slots["ans"] > slots["zstd"]
    # ANS is never left out, even where nothing fits (the engine then runs its minimum ring).
    assert autotune.runnable_candidates(64 << 20, 16 << 20)[0] == ["ans"]


def test_a_storage_probe_whose_fsync_hangs_fails_within_the_timeout(tmp_path, monkeypatch):
    """Fault injection: the storage never completes the probe file's fsync. ``codec="auto"``
    (CUDA state on the GPU engine, host state deciding whether to compress) waited for it past
    ``Config.timeout`` and then cached the stalled figure for the filesystem. The probe now fails
    after ``timeout`` with ``TimeoutError``, caches nothing, and leaves no probe file once the
    fsync ends."""
    import os
    import threading
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "PROBE_BYTES", 1 << 20)
    release = threading.Event()
    real_fsync = os.fsync

    def fsync(fd):
        release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    directory = tmp_path / "disk"
    directory.mkdir()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"the fsync of the storage probe .* did not complete within 0.3 s"):
            autotune.storage_gbps(directory, timeout=0.3)
        assert time.monotonic() - started < 10
    finally:
        release.set()
    assert not (tmp_path / "cache" / "gdsckpt" / "storage.json").exists()
    assert list(directory.iterdir()) == []


def test_a_storage_probe_that_cannot_write_never_fails_the_save(tmp_path):
    """``codec="auto"`` (a host save of 16 MiB or more, its codec's pace known) probed the storage
    with a 256 MiB write: on a disk with less room, or under a file size limit, the save failed
    with the probe's bare ``OSError`` though its checkpoint fitted (and so did every later one).
    The probe's failure now leaves ``auto`` compressing, and the save succeeds."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, resource, signal
        os.environ["XDG_CACHE_HOME"] = {str(tmp_path / "cache")!r}
        import torch, gdsckpt
        from gdsckpt.pipeline import host_auto
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
        state = {{"w": torch.randn(5 << 20, generator=torch.Generator().manual_seed(0))}}
        path = {str(tmp_path / "ckpt.gdsckpt")!r}
        host_auto.HISTORY.record(f"dev:{{os.stat({str(tmp_path)!r}).st_dev}}", 32 << 20, 0.3)
        report = gdsckpt.save(state, path)
        assert report.auto["stored"] == "compressed", report.auto
        assert "could not be measured" in report.auto["stored_reason"], report.auto
        assert gdsckpt.load(path)["w"].view(torch.int32).equal(state["w"].view(torch.int32))
        assert not [p for p in os.listdir({str(tmp_path)!r}) if p.startswith(".gdsckpt-storage-probe")]
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_storage_too_full_for_a_probe_is_not_measured_and_a_failed_probe_runs_once(tmp_path, monkeypatch):
    """The probe takes at most a quarter of the free space (nothing where that is under
    ``MIN_PROBE_BYTES``); a probe that failed is not run again in the same process."""
    import errno
    import os

    class Free:
        f_bavail, f_frsize = 40, 1 << 20  # 40 MiB free: a quarter is under the 16 MiB minimum

    monkeypatch.setattr(os, "statvfs", lambda _d: Free())
    monkeypatch.setattr(autotune, "measure_storage_gbps", lambda *a, **k: pytest.fail("probed a full disk"))
    assert autotune.storage_gbps(tmp_path) is None

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other-cache"))  # a fresh process's view
    Free.f_bavail = 1 << 20  # 1 TiB free
    calls = []

    def failing(directory, nbytes=None, timeout=600.0):
        calls.append(nbytes)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(autotune, "measure_storage_gbps", failing)
    assert autotune.storage_gbps(tmp_path) is None and autotune.storage_gbps(tmp_path) is None
    assert calls == [autotune.PROBE_BYTES]


def test_two_first_saves_in_one_process_probe_the_storage_once(tmp_path, monkeypatch):
    """Two threads' first ``auto`` saves to one filesystem probed it at once, through one probe
    file (its name is the process's), each timing the other's writes too: one probe now, the
    other thread takes its figure."""
    import threading
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "PROBE_BYTES", 4 << 20)
    real = autotune.measure_storage_gbps
    running, most, calls = [0], [0], []
    lock = threading.Lock()

    def measuring(directory, nbytes=None, timeout=600.0):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            calls.append(nbytes)
        try:
            time.sleep(0.2)  # long enough for the other thread to arrive meanwhile
            return real(directory, nbytes, timeout)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(autotune, "measure_storage_gbps", measuring)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(autotune.storage_gbps(tmp_path))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most[0] == 1 and len(calls) == 1
    assert len(results) == 2 and results[0] == results[1] and results[0] > 0
