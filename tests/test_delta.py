"""Delta checkpoints (issue 7): ``save(..., base=)``, chains, rebase, the manager's schedule."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gdsckpt
from gdsckpt.demo import bit_equal
from gdsckpt.state import delta as delta_module


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 300, generator=g)
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-45])
    special = torch.cat([special, torch.tensor([0], dtype=torch.int32).view(torch.float32)])
    payload_nan = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)
    return {
        "model": {"w": weight.to(torch.bfloat16), "tied": None, "b": torch.randn(300, generator=g),
                  "special": torch.cat([special, payload_nan]), "count": torch.arange(17),
                  "mask": torch.rand(33, generator=g) > 0.5,
                  "tiny": [torch.randn(3, generator=g) for _ in range(5)]},
        "optimizer": {"exp_avg": torch.randn(64, 300, generator=g) * 1e-3,
                      "array": np.arange(40, dtype=np.float64)},
        "step": seed,
    }


def _tie(state: dict) -> dict:
    state["model"]["tied"] = state["model"]["w"]
    return state


def _step(state: dict, seed: int) -> dict:
    """The next training state: small updates of the float tensors, everything else kept."""
    g = torch.Generator().manual_seed(1000 + seed)
    new = {"model": {}, "optimizer": {}, "step": seed}
    for group in ("model", "optimizer"):
        for key, value in state[group].items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "special":
                noise = torch.randn(value.shape, generator=g) * 1e-3
                new[group][key] = (value.float() + noise).to(value.dtype)
            elif isinstance(value, list):
                new[group][key] = [t + 1e-3 for t in value]
            elif isinstance(value, np.ndarray):
                new[group][key] = value + 0.5
            else:
                new[group][key] = value.clone() if isinstance(value, torch.Tensor) else value
    return _tie(new)


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bit_equal(a, b)
    return a == b


def test_delta_chain_round_trips_bit_exact_up_to_max_chain(tmp_path):
    states = [_tie(_state())]
    for i in range(1, 6):
        states.append(_step(states[-1], i))
    paths = [tmp_path / f"c{i}.gdsckpt" for i in range(6)]
    reports = [gdsckpt.save(states[0], paths[0], codec="zstd")]
    for i in range(1, 6):
        reports.append(gdsckpt.save(states[i], paths[i], codec="zstd", base=paths[i - 1], max_chain=3))
    depths = [None if (b := gdsckpt.inspect(p).base) is None else b["depth"] for p in paths]
    assert depths == [None, 1, 2, 3, None, 1]  # the 4th would be 4 deep: written in full
    assert [r.base for r in reports] == [None, "c0.gdsckpt", "c1.gdsckpt", "c2.gdsckpt", None, "c4.gdsckpt"]
    assert reports[1].delta_tensors > 0 and reports[4].delta_tensors == 0
    for state, path in zip(states, paths):
        assert _equal(gdsckpt.load(path), state)
    loaded = gdsckpt.load(paths[3])
    assert loaded["model"]["tied"] is loaded["model"]["w"]
    info = gdsckpt.inspect(paths[3])
    assert info.format_version == (1, 1) and gdsckpt.inspect(paths[0]).format_version == (1, 0)
    assert {t.key for t in info.tensors if t.delta} >= {"model/w", "model/count", "optimizer/exp_avg"}
    assert all(label.startswith("xorbase/1+") for t in info.tensors if t.delta for label in t.codecs)
    gdsckpt.verify(paths[3])


def test_every_read_path_resolves_the_chain(tmp_path):
    base_state, state = _tie(_state()), None
    gdsckpt.save(base_state, tmp_path / "a.gdsckpt")
    state = _step(base_state, 1)
    gdsckpt.save(state, tmp_path / "b.gdsckpt", base=tmp_path / "a.gdsckpt")
    path = tmp_path / "b.gdsckpt"
    assert _equal(gdsckpt.load(path, keys=["model/w", "optimizer"]),
                  {"model": {"w": state["model"]["w"]}, "optimizer": state["optimizer"]})
    with gdsckpt.open(path) as checkpoint:
        assert bit_equal(checkpoint.get("model/b"), state["model"]["b"])
        assert bit_equal(checkpoint.get_rows("optimizer/exp_avg", 5, 9), state["optimizer"]["exp_avg"][5:9])
    model = {k: torch.zeros_like(v) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    gdsckpt.load_into({"model": model}, path, strict=False)
    assert all(bit_equal(model[k], state["model"][k]) for k in model)


def test_windows_smaller_than_the_arrays(tmp_path, monkeypatch):
    """Base bytes are read in windows; arrays many windows long, chunks across window edges."""
    monkeypatch.setattr(delta_module, "HOST_WINDOW_BYTES", 12288)
    g = torch.Generator().manual_seed(7)
    base = {"x": torch.randn(50_000, generator=g), "y": torch.randn(3_001, generator=g).to(torch.float16)}
    new = {"x": base["x"] + 1e-4, "y": base["y"] * 2}
    config = gdsckpt.Config(chunk_bytes=8192, io_threads=4)
    gdsckpt.save(base, tmp_path / "a.gdsckpt", config=config)
    gdsckpt.save(new, tmp_path / "b.gdsckpt", base=tmp_path / "a.gdsckpt", config=config)
    assert _equal(gdsckpt.load(tmp_path / "b.gdsckpt", config=config), new)
    with gdsckpt.open(tmp_path / "b.gdsckpt", config=config) as checkpoint:
        assert bit_equal(checkpoint.get_rows("x", 1_000, 45_000), new["x"][1_000:45_000])


def test_rows_of_a_delta_fetch_only_those_rows_of_the_base(tmp_path, monkeypatch):
    """``get_rows`` of a delta read a whole window of the base (64 MiB by default) for a few rows,
    and for a small array the small arrays after it as well; the base's fetches are now bounded by
    the rows asked for, through a chain of two bases too."""
    from gdsckpt.api import checkpoint as checkpoint_module

    monkeypatch.setattr(delta_module, "HOST_WINDOW_BYTES", 256 << 10)
    g = torch.Generator().manual_seed(3)
    base = {"big": torch.randn(4096, 64, generator=g), "small": torch.randn(64, 64, generator=g),
            "after": torch.randn(64, 64, generator=g)}
    config = gdsckpt.Config(chunk_bytes=16384)
    gdsckpt.save(base, tmp_path / "a.gdsckpt", config=config)
    middle = {key: value + 1e-3 for key, value in base.items()}
    gdsckpt.save(middle, tmp_path / "b.gdsckpt", base=tmp_path / "a.gdsckpt", config=config)
    new = {key: value * 2 for key, value in middle.items()}
    gdsckpt.save(new, tmp_path / "c.gdsckpt", base=tmp_path / "b.gdsckpt", config=config)
    fetched: list[tuple[str, int, int]] = []
    original = checkpoint_module.Checkpoint._read_many

    def recording(self, requests, device=None):
        fetched.extend(requests)
        return original(self, requests, device)

    monkeypatch.setattr(checkpoint_module.Checkpoint, "_read_many", recording)
    row_bytes = 64 * 4
    with gdsckpt.open(tmp_path / "c.gdsckpt", config=config) as checkpoint:
        for key, start, stop in (("big", 2000, 2003), ("small", 10, 12)):
            fetched.clear()
            assert bit_equal(checkpoint.get_rows(key, start, stop), new[key][start:stop])
            assert fetched and all(got == key and (low, high) == (start * row_bytes, stop * row_bytes)
                                   for got, low, high in fetched), (key, fetched)
        fetched.clear()
        assert bit_equal(checkpoint.get("big"), new["big"])  # a whole array still reads in windows
        assert max(high - low for _key, low, high in fetched) == 256 << 10


def test_only_matching_arrays_are_deltas(tmp_path):
    base = {"same": torch.ones(1000), "reshaped": torch.ones(10, 100), "retyped": torch.ones(1000),
            "gone": torch.ones(5)}
    gdsckpt.save(base, tmp_path / "a.gdsckpt")
    new = {"same": torch.ones(1000) * 2, "reshaped": torch.ones(100, 10), "retyped": torch.ones(1000).double(),
           "added": torch.zeros(3)}
    report = gdsckpt.save(new, tmp_path / "b.gdsckpt", base=tmp_path / "a.gdsckpt")
    assert report.delta_tensors == 1
    assert {t.key for t in gdsckpt.inspect(tmp_path / "b.gdsckpt").tensors if t.delta} == {"same"}
    assert _equal(gdsckpt.load(tmp_path / "b.gdsckpt"), new)


def test_small_changes_make_small_deltas(tmp_path):
    base = _state()
    gdsckpt.save(base, tmp_path / "a.gdsckpt", codec="zstd")
    full = gdsckpt.save(_step(base, 1), tmp_path / "full.gdsckpt", codec="zstd")
    unchanged = gdsckpt.save(base, tmp_path / "same.gdsckpt", codec="zstd", base=tmp_path / "a.gdsckpt")
    def payload(report):  # chunk bytes, without the file's fixed header, padding and index
        return sum(t.stored_bytes for t in gdsckpt.inspect(report.path).tensors)

    assert unchanged.delta_tensors == 12
    assert payload(unchanged) < payload(full) / 50  # all-zero XORs


def test_missing_or_changed_base_is_a_clear_error(tmp_path):
    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    state = _state()
    gdsckpt.save(state, a)
    gdsckpt.save(_step(state, 1), b, base=a)
    moved = tmp_path / "moved.gdsckpt"
    os.rename(a, moved)
    with pytest.raises(gdsckpt.BaseCheckpointError, match="missing"):
        gdsckpt.load(b)
    os.rename(moved, a)
    gdsckpt.save(_step(state, 2), a, force=True)  # another checkpoint under the base's name
    with pytest.raises(gdsckpt.BaseCheckpointError, match="changed"):
        gdsckpt.load(b)
    with gdsckpt.open(b) as checkpoint, pytest.raises(gdsckpt.BaseCheckpointError, match="changed"):
        checkpoint.get("model/w")
    with pytest.raises(gdsckpt.BaseCheckpointError, match="does not exist"):
        gdsckpt.save(state, tmp_path / "c.gdsckpt", base=tmp_path / "nope.gdsckpt")
    with pytest.raises(ValueError, match="its own base"):
        gdsckpt.save(state, a, base=a)
    with pytest.raises(ValueError, match="max_chain"):
        gdsckpt.save(state, tmp_path / "c.gdsckpt", base=a, max_chain=-1)


@pytest.mark.parametrize("layout", ["base below the delta's directory", "one directory, force=True"])
def test_a_delta_is_never_saved_over_a_link_of_its_own_chain(tmp_path, layout):
    """``save(s3, x, base=y)`` where ``y`` is a delta on ``x``: the save reported success, the
    new ``x`` (a delta on ``y``) could never load, and ``y`` lost its base. The guard against
    replacing a delta's base searches only ``x``'s directory (and ``force=True`` passes it);
    a save over any link of its base's chain is now refused either way."""
    if layout.startswith("base below"):
        (tmp_path / "sub").mkdir()
        x, y, force = tmp_path / "sub" / "x.gdsckpt", tmp_path / "y.gdsckpt", False
    else:
        x, y, force = tmp_path / "x.gdsckpt", tmp_path / "y.gdsckpt", True
    state = _state()
    gdsckpt.save(state, x)
    gdsckpt.save(_step(state, 1), y, base=x)
    before = x.read_bytes()
    with pytest.raises(ValueError, match="is a base of .*its chain of deltas"):
        gdsckpt.save(_step(state, 2), x, base=y, force=force)
    assert x.read_bytes() == before
    loaded, saved = gdsckpt.load(y), _step(state, 1)
    assert all(bit_equal(loaded["model"][k], v) for k, v in saved["model"].items() if isinstance(v, torch.Tensor))


def test_a_directory_of_checkpoints_moves_as_a_whole(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    state = _state()
    gdsckpt.save(state, run / "a.gdsckpt")
    new = _step(state, 1)
    gdsckpt.save(new, run / "b.gdsckpt", base=run / "a.gdsckpt")
    shutil.move(run, tmp_path / "elsewhere")
    assert _equal(gdsckpt.load(tmp_path / "elsewhere" / "b.gdsckpt"), new)


def test_rebase_writes_a_full_checkpoint_and_guards_dependents(tmp_path):
    a, b, c = (tmp_path / f"{n}.gdsckpt" for n in "abc")
    s0 = _tie(_state())
    s1, s2 = _step(s0, 1), _step(_step(s0, 1), 2)
    gdsckpt.save(s0, a)
    gdsckpt.save(s1, b, base=a)
    gdsckpt.save(s2, c, base=b)
    with pytest.raises(gdsckpt.BaseCheckpointError, match="c.gdsckpt"):
        gdsckpt.rebase(b)  # c needs b as it is
    report = gdsckpt.rebase(c, tmp_path / "c-full.gdsckpt")
    assert report.base is None and gdsckpt.inspect(tmp_path / "c-full.gdsckpt").base is None
    gdsckpt.rebase(c)  # in place: nothing depends on c
    assert gdsckpt.inspect(c).base is None
    a.unlink()
    b.unlink()
    assert _equal(gdsckpt.load(c), s2) and _equal(gdsckpt.load(tmp_path / "c-full.gdsckpt"), s2)


def test_rebase_and_inspect_commands(tmp_path):
    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    state = _state()
    gdsckpt.save(state, a)
    gdsckpt.save(_step(state, 1), b, base=a)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "gdsckpt", *args], capture_output=True, text=True, timeout=120)

    shown = cli("inspect", str(b), "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["base"]["path"] == "a.gdsckpt" and any(t["delta"] for t in doc["tensors"])
    assert "delta checkpoint" in cli("inspect", str(b)).stdout
    refused = cli("rebase", str(a))  # b is a delta on a
    assert refused.returncode == 1 and "b.gdsckpt" in refused.stderr
    assert "--force" in refused.stderr  # the command line's name for force=True
    done = cli("rebase", str(b))
    assert done.returncode == 0, done.stderr
    assert gdsckpt.inspect(b).base is None
    assert cli("rebase").returncode == 2


def test_index_rules_for_deltas(tmp_path):
    from gdsckpt.format import parse_index

    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    gdsckpt.save({"x": torch.ones(100), "y": torch.ones(7)}, a, codec="none")
    gdsckpt.save({"x": torch.ones(100) * 2, "y": torch.ones(7)}, b, base=a, codec="none")
    raw = b.read_bytes()
    with gdsckpt.open(b) as checkpoint:
        trailer = checkpoint._opened.trailer
    doc = json.loads(raw[trailer.index_offset:trailer.index_offset + trailer.index_length])

    def parse(document):
        return parse_index(json.dumps(document).encode(), index_offset=trailer.index_offset)

    assert parse(doc).base["depth"] == 1
    for mutate, message in [
        (lambda d: d.pop("base"), "names no base"),
        (lambda d: d["base"].__setitem__("index_sha256", "xyz"), "index_sha256"),
        (lambda d: d["base"].__setitem__("depth", 0), "depth"),
        (lambda d: d["base"].__setitem__("path", ""), "path"),
        (lambda d: d.__setitem__("base", [1]), "base must be an object"),
        (lambda d: d["chains"].append([{"name": "zstd/1"}, {"name": "xorbase/1"}]), "last stage"),
        (lambda d: d["chains"].append([{"name": "byteplanes/1", "width": 2}, {"name": "xorbase/1"}, {"name": "zstd/1"}]),
         "first stage"),
        (lambda d: d["chains"].append([{"name": "xorbase/1"}]), "first stage"),
    ]:
        changed = json.loads(json.dumps(doc))
        mutate(changed)
        with pytest.raises(gdsckpt.CorruptCheckpointError, match=message):
            parse(changed)


def test_manager_schedule_pruning_and_restore(tmp_path):
    manager = gdsckpt.CheckpointManager(tmp_path, keep_last=2, delta_every=10, full_every=40, max_chain=8)
    assert [s for s in range(0, 90) if manager.should_save(s)] == list(range(0, 90, 10))
    state = _state()
    states = {}
    for step in range(0, 90, 10):
        state = _step(state, step)
        states[step] = state
        manager.save(step, state)
    kinds = {step: gdsckpt.inspect(manager.path(step)).base for step in manager.steps()}
    # kept: the 2 newest (70, 80: full, a multiple of 40) and the chain 70 -> 60 -> 50 -> 40 (full)
    assert sorted(kinds) == [40, 50, 60, 70, 80]
    assert kinds[40] is None and kinds[80] is None
    assert all(kinds[s]["path"] == manager.path(s - 10).name for s in (50, 60, 70))
    for step in kinds:
        assert _equal(gdsckpt.load(manager.path(step)), states[step])
    model = {k: torch.zeros_like(v) for k, v in states[80]["model"].items() if isinstance(v, torch.Tensor)}
    step, _extra = manager.restore_latest(state={"model": model})
    assert step == 80 and all(bit_equal(model[k], states[80]["model"][k]) for k in model)


def test_manager_star_bases_every_delta_on_the_newest_full(tmp_path):
    """``delta_base="full"``: each delta's base is the newest complete full checkpoint (depth 1,
    one base file to read), pruning keeps that full while kept deltas need it, ``save_async``
    follows the same rule, and a damaged newest full makes the next save a full one."""
    manager = gdsckpt.CheckpointManager(tmp_path, keep_last=2, delta_every=10, full_every=40, delta_base="full")
    state = _state()
    states = {}
    for step in range(0, 70, 10):
        state = _step(state, step)
        states[step] = state
        if step == 60:
            manager.save_async(step, state).wait(timeout=120)
        else:
            manager.save(step, state)
    bases = {step: gdsckpt.inspect(manager.path(step)).base for step in manager.steps()}
    # kept: the 2 newest (50, 60, deltas on 40) and their base 40 (full, a multiple of 40)
    assert sorted(bases) == [40, 50, 60] and bases[40] is None
    assert all(bases[s]["path"] == manager.path(40).name and bases[s]["depth"] == 1 for s in (50, 60))
    for step in bases:
        assert _equal(gdsckpt.load(manager.path(step)), states[step])
    manager.path(40).write_bytes(b"garbage")  # the only full one: the next save must be full
    report = manager.save(70, _step(state, 70))
    assert report.base is None and report.delta_tensors == 0
    with pytest.raises(ValueError, match="delta_base"):
        gdsckpt.CheckpointManager(tmp_path / "x", delta_every=1, delta_base="newest")


def test_manager_skips_a_delta_whose_base_was_lost(tmp_path):
    manager = gdsckpt.CheckpointManager(tmp_path, keep_last=None, delta_every=1, full_every=2)
    state = _state()
    manager.save(0, state)          # full
    manager.save(1, _step(state, 1))  # delta on 0
    manager.save(2, _step(state, 2))  # full
    manager.save(3, _step(state, 3))  # delta on 2
    assert gdsckpt.inspect(manager.path(3)).base["path"] == manager.path(2).name
    manager.path(2).write_bytes(b"garbage")
    with pytest.warns(gdsckpt.SkippedCheckpointWarning):
        restored = manager.restore_latest()
    assert restored is not None and restored[0] == 1


def test_manager_save_async_writes_deltas(tmp_path):
    manager = gdsckpt.CheckpointManager(tmp_path, keep_last=3, delta_every=1)
    state = _state()
    manager.save(0, state)
    new = _step(state, 1)
    handle = manager.save_async(1, new)
    report = handle.wait(timeout=120)
    assert report.base == manager.path(0).name and report.delta_tensors > 0
    assert _equal(gdsckpt.load(manager.path(1)), new)


def test_crafted_base_links_are_refused(tmp_path):
    """A delta whose recorded depth disagrees with its base, or whose chain is deeper than a load
    resolves, is refused with a clear error (no recursion without bound); a base that is not a
    regular file (a FIFO would block an open) counts as missing."""
    from gdsckpt.api import checkpoint as api_checkpoint

    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    gdsckpt.save({"x": torch.ones(10)}, a)
    gdsckpt.save({"x": torch.ones(10) * 2}, b, base=a)
    raw = bytearray(b.read_bytes())
    with gdsckpt.open(b) as checkpoint:
        trailer = checkpoint._opened.trailer
    index = bytes(raw[trailer.index_offset:trailer.index_offset + trailer.index_length])
    assert b'"depth":1' in index
    forged = tmp_path / "forged.gdsckpt"
    body = raw[:trailer.index_offset] + index.replace(b'"depth":1', b'"depth":2')
    from gdsckpt.format import checksum, pack_trailer

    new_index = index.replace(b'"depth":1', b'"depth":2')
    forged.write_bytes(bytes(body) + pack_trailer(trailer.index_offset, len(new_index), checksum(new_index), 1))
    with pytest.raises(gdsckpt.BaseCheckpointError, match="depth"):
        gdsckpt.load(forged)
    deep = tmp_path / "deep.gdsckpt"
    deep_index = index.replace(b'"depth":1', f'"depth":{api_checkpoint.MAX_RESOLVE_DEPTH + 1}'.encode())
    deep.write_bytes(bytes(raw[:trailer.index_offset]) + deep_index
                     + pack_trailer(trailer.index_offset, len(deep_index), checksum(deep_index), 1))
    with pytest.raises(gdsckpt.BaseCheckpointError, match="depth"):
        gdsckpt.load(deep)
    a.unlink()
    os.mkfifo(a)
    with pytest.raises(gdsckpt.BaseCheckpointError, match="missing"):
        gdsckpt.load(b)


def test_chains_stop_at_what_a_load_resolves(tmp_path, monkeypatch):
    from gdsckpt.api import checkpoint

    monkeypatch.setattr(checkpoint, "MAX_RESOLVE_DEPTH", 3)
    paths, previous = [], None
    for i in range(5):
        paths.append(tmp_path / f"c{i}.gdsckpt")
        gdsckpt.save({"x": torch.full((100,), float(i))}, paths[-1], base=previous, max_chain=100)
        previous = paths[-1]
    depths = [(gdsckpt.inspect(p).base or {}).get("depth", 0) for p in paths]
    assert depths == [0, 1, 2, 3, 0]  # the fifth would be 4 deep: written in full
    assert gdsckpt.load(paths[3])["x"][0].item() == 3.0
    monkeypatch.setattr(checkpoint, "MAX_RESOLVE_DEPTH", 2)
    with pytest.raises(gdsckpt.BaseCheckpointError, match="3 deltas deep"):
        gdsckpt.load(paths[3])


def test_manager_never_prunes_the_base_of_a_save_in_flight(tmp_path, monkeypatch):
    """keep_last=1: while a delta is written against step 1, step 2 (full) completes and prunes;
    step 1 must survive until the delta is done, so that the delta loads."""
    manager = gdsckpt.CheckpointManager(tmp_path, keep_last=1, delta_every=1, full_every=2)
    state = _state()
    manager.save(1, state)                      # full (no base yet)
    new = _step(state, 3)
    started, release = threading.Event(), threading.Event()
    original = gdsckpt.api.saving.save_flat

    def held_save(*args, **kwargs):
        if kwargs.get("base") is not None:      # the delta at step 3: wait inside the save
            started.set()
            assert release.wait(60)
        return original(*args, **kwargs)

    monkeypatch.setattr(gdsckpt.api.saving, "save_flat", held_save)
    handle = manager.save_async(3, new)         # delta on step 1
    try:
        assert started.wait(60)
        manager.save(2, _step(state, 2))        # full (a multiple of full_every), prunes
        assert manager.path(1).exists(), "the in-flight delta's base was pruned"
    finally:
        release.set()
    report = handle.wait(timeout=60)
    assert report.base == manager.path(1).name
    assert _equal(gdsckpt.load(manager.path(3)), new)


def test_verify_checks_the_chain_of_bases(tmp_path):
    a, b, c = (tmp_path / f"{n}.gdsckpt" for n in "abc")
    state = _state()
    gdsckpt.save(state, a, codec="zstd")
    gdsckpt.save(_step(state, 1), b, codec="zstd", base=a)
    gdsckpt.save(_step(state, 2), c, codec="zstd", base=b)
    report = gdsckpt.verify(c)
    assert report.bases == (str(b), str(a))
    assert gdsckpt.verify(c, chain=True).bases == (str(b), str(a))
    # a damaged chunk in the oldest base: only --chain reads it
    raw = bytearray(a.read_bytes())
    index = gdsckpt.inspect(a)
    with gdsckpt.open(a) as checkpoint:
        first = checkpoint._opened.index.chunks[0]
        first_key = next(record.key for record in checkpoint._opened.index.tensors
                         if any(segment.chunk == 0 for segment in record.segments))
    raw[first.offset] ^= 0xFF
    a.write_bytes(bytes(raw))
    assert index.file_bytes == len(raw)
    gdsckpt.verify(c)  # present and unchanged index: the chunk is not read
    # The damage names the base it is in: it read as damage of the delta (whose own chunk 0 is
    # intact), pointing the user at the wrong file.
    named = f"in base checkpoint {str(a)!r}"
    with pytest.raises(gdsckpt.CorruptCheckpointError, match=re.escape(named)) as caught:
        gdsckpt.verify(c, chain=True)
    assert caught.value.base == str(a) and caught.value.chunk == 0
    with pytest.raises(gdsckpt.CorruptCheckpointError, match=re.escape(named)):
        gdsckpt.load(c)
    with gdsckpt.open(c) as checkpoint, pytest.raises(gdsckpt.CorruptCheckpointError, match=re.escape(named)):
        checkpoint.get(first_key)
    cli = subprocess.run([sys.executable, "-m", "gdsckpt", "verify", "--chain", str(c)], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 1 and "chunk 0" in cli.stderr and named in cli.stderr
    # a file read for itself (a rebase of the damaged full checkpoint) is not named as a base
    with pytest.raises(gdsckpt.CorruptCheckpointError) as caught:
        gdsckpt.rebase(a, tmp_path / "a-full.gdsckpt")
    assert caught.value.base is None and "base checkpoint" not in str(caught.value)
    b.unlink()
    with pytest.raises(gdsckpt.BaseCheckpointError, match="missing"):
        gdsckpt.verify(c)


def test_a_delta_source_offers_no_device_range_to_copy() -> None:
    # The GPU encoder copies small device ranges by address (``device_span``); a delta's bytes
    # are the XOR with the base, which no range holds: the source it wraps must not answer.
    from gdsckpt.state.delta import XorSource

    class Spanned:
        nbytes, itemsize, plane_width, on_device = 16, 4, 4, True

        def device_span(self, start: int, stop: int) -> int:
            return 1234 + start

    assert Spanned().device_span(0, 16) == 1234
    assert XorSource(Spanned(), object()).device_span(0, 16) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [None, 8192])
def test_a_damaged_chunk_of_the_base_fails_only_the_arrays_that_use_it(tmp_path, monkeypatch, window, h):
    """A delta's base is read in windows (small arrays fetched with the ones after them, a large
    one 64 MiB at a time): one damaged chunk of the base, holding only ``w5``, failed the reads of
    ``w0``..``w4`` (and named ``w5`` to them), as a full checkpoint never does. With a window of
    8 KiB, each 16 KiB array is a large one read in two windows: the intact chunk in the damaged
one's window reads too."""
    from gdsckpt.state import delta as delta_module

    if window is not None:
        monkeypatch.setattr(delta_module, "HOST_WINDOW_BYTES", window)
    base_path, delta_path = tmp_path / "base.gdsckpt", tmp_path / "delta.gdsckpt"
    g = torch.Generator().manual_seed(0)
    base = {f"w{i}": torch.randn(4096, generator=g) for i in range(8)}
    config = gdsckpt.Config(chunk_bytes=4096, pack_below=0, fsync=False)
    gdsckpt.save(base, base_path, codec="zstd", config=config)
    new = {key: value.clone() for key, value in base.items()}
    for value in new.values():
        value[:10] += 1
    assert gdsckpt.save(new, delta_path, codec="zstd", config=config, base=base_path).delta_tensors == 8
    chunk = [c for c in gdsckpt.inspect(base_path).chunks if [k for k, _ in c.arrays] == ["w5"]][-1]
    data = bytearray(base_path.read_bytes())
    data[chunk.offset + chunk.stored_bytes // 2] ^= 0xFF
    base_path.write_bytes(bytes(data))
    with gdsckpt.open(delta_path, config=config) as ckpt:
        for key in ("w0", "w3", "w4", "w6"):
            h.assert_same(new[key], ckpt.get(key), key)
        # rows 2048-3071 of w5 lie in its third chunk, beside the damaged fourth (one 8 KiB window)
        h.assert_same(new["w5"][2048:3072], ckpt.get_rows("w5", 2048, 3072), "w5 rows in an intact chunk")
        with pytest.raises(gdsckpt.CorruptCheckpointError):
            ckpt.get("w5")
    h.assert_same(new["w0"], gdsckpt.load(delta_path, keys=["w0"], config=config)["w0"], "w0")


def test_a_delta_whose_first_chunk_base_is_damaged_fails_at_once(tmp_path, monkeypatch):
    """The first chunk of an array decides byte planes for the array's other chunks, which wait
    for it. Its base bytes damaged (the array's later windows intact): it raised before deciding,
    and the other chunks waited out ``Config.timeout``, then the save failed with a
    ``TimeoutError`` instead of the damage."""
    from gdsckpt.state import delta as delta_module

    monkeypatch.setattr(delta_module, "HOST_WINDOW_BYTES", 8192)
    base_path = tmp_path / "base.gdsckpt"
    w = torch.randn(16384, generator=torch.Generator().manual_seed(1))
    config = gdsckpt.Config(chunk_bytes=4096, pack_below=0, fsync=False, timeout=30)
    gdsckpt.save({"w": w}, base_path, codec="zstd", config=config)
    first = gdsckpt.inspect(base_path).chunks[0]
    data = bytearray(base_path.read_bytes())
    data[first.offset + first.stored_bytes // 2] ^= 0xFF
    base_path.write_bytes(bytes(data))
    changed = w.clone()
    changed[::7] += 1
    with pytest.raises(gdsckpt.CorruptCheckpointError):
        gdsckpt.save({"w": changed}, tmp_path / "delta.gdsckpt", codec="zstd", config=config, base=base_path)
    assert not (tmp_path / "delta.gdsckpt").exists()
