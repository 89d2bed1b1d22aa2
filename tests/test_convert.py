"""``gdsckpt.convert`` and ``gdsckpt convert``: every direction between torch pickles, safetensors
and gdsckpt, bit-exact; structure, ties and Parameters through safetensors; refusal of unsafe
pickles and of content a format cannot hold; atomic, non-clobbering destinations."""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.cli.main import main
from gdsckpt.integrations.convert import (
    STRUCTURE_KEY,
    ConvertError,
    UnsafePickleError,
    convert,
    detect_format,
)

safetensors_torch = pytest.importorskip("safetensors.torch")

FORMAT_SUFFIX = {"pt": ".pt", "safetensors": ".safetensors", "gdsckpt": ".gdsckpt"}


def from_bits(values: list[int], bits: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` holding exactly these bit patterns."""
    return torch.from_numpy(np.array(values, dtype=bits)).view(dtype)


def flat_tensors() -> dict[str, torch.Tensor]:
    """One tensor per interesting case: dtypes, NaN payloads, -0.0, layouts, sizes."""
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    grid[0, 0] = -0.0
    return {
        "f32": from_bits([0x7FC00001, 0xFFA00005, 0x80000000, 0x3F800000, 0x7F800000, 0x00000001],
                         np.uint32, torch.float32),
        "f64": from_bits([0x7FF8000000000123, 0x8000000000000000, 0xFFF0000000000000], np.uint64, torch.float64),
        "bf16": from_bits([0x7FC1, 0xFF81, 0x8000, 0x3F80, 0x0001], np.uint16, torch.bfloat16),
        "f16": from_bits([0x7E01, 0xFC01, 0x8000, 0x3C00], np.uint16, torch.float16),
        "e4m3": from_bits([0x7F, 0xFF, 0x80, 0x38, 0x01], np.uint8, torch.float8_e4m3fn),
        "e5m2": from_bits([0x7D, 0xFE, 0x80, 0x3C], np.uint8, torch.float8_e5m2),
        "i64": torch.tensor([-2**63, 2**63 - 1, 0]),
        "i32": torch.tensor([-2**31, 7], dtype=torch.int32),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "strided": grid[:, ::2],
        "transposed": torch.randn(3, 5, generator=g).t(),
        "big": torch.randn(3000, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.empty(0, dtype=torch.bfloat16),
        "scalar": torch.tensor(-0.0),
    }


def nested_state() -> dict[str, Any]:
    """A training-state-like nest: a state_dict (OrderedDict with _metadata), optimizer state with
    int keys, tied tensors, a Parameter, plain values with exact float bits."""
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    embed = torch.randn(6, 4, generator=g)
    tensors = flat_tensors()
    return {
        "model": model.state_dict(),
        "optimizer": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(3, 4, generator=g).t()},
                      1: {"step": torch.tensor(5.0), "exp_avg": tensors["bf16"]}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "name": None}],
        },
        "embed": embed,
        "lm_head": embed,
        "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "nan": np.frombuffer(np.array([0x7FF8000000000123], dtype=np.uint64).tobytes(), np.float64)[0].item(),
        "negzero": -0.0,
        "step": 10**20,
        "misc": [True, None, "text", {"fp8": tensors["e4m3"], "f32": tensors["f32"]}],
    }


def write_source(state: Any, path: Path, fmt: str, h: Any) -> None:
    """Write ``state`` in ``fmt`` with that format's own library (a safetensors source is a plain
    third-party file: contiguous tensors, no structure metadata)."""
    if fmt == "pt":
        torch.save(state, path)
    elif fmt == "gdsckpt":
        gdsckpt.save(state, path, config=h.small_config())
    else:
        safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def read_native(path: Path, fmt: str) -> Any:
    """A file read by its format's own library."""
    if fmt == "pt":
        return torch.load(path, weights_only=True)
    if fmt == "gdsckpt":
        return gdsckpt.load(path)
    return safetensors_torch.load_file(str(path))


def assert_same_tensors(expected: dict[str, torch.Tensor], actual: dict[str, Any], h: Any) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        h.assert_same(tensor, actual[key], key)


DIRECTIONS = [(a, b) for a in FORMAT_SUFFIX for b in FORMAT_SUFFIX if a != b]


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), DIRECTIONS, ids=[f"{a}-to-{b}" for a, b in DIRECTIONS])
def test_every_direction_is_bit_exact(tmp_path: Path, h: Any, src_fmt: str, dst_fmt: str) -> None:
    expected = flat_tensors()
    src, dst = tmp_path / f"src{FORMAT_SUFFIX[src_fmt]}", tmp_path / f"dst{FORMAT_SUFFIX[dst_fmt]}"
    write_source(expected, src, src_fmt, h)
    report = convert(src, dst, config=h.small_config())
    assert (report.src_format, report.dst_format) == (src_fmt, dst_fmt)
    assert report.tensors == len(expected)
    assert report.logical_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert report.dst_bytes == dst.stat().st_size
    assert_same_tensors(expected, read_native(dst, dst_fmt), h)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, dst.name]), "no temporaries left"


CHAINS = [("pt", "gdsckpt", "pt"), ("gdsckpt", "pt", "gdsckpt"), ("pt", "safetensors", "pt"),
          ("gdsckpt", "safetensors", "gdsckpt"), ("pt", "safetensors", "gdsckpt", "pt")]


@pytest.mark.parametrize("chain", CHAINS, ids=["-".join(c) for c in CHAINS])
def test_nested_state_round_trips_with_structure_ties_and_parameters(tmp_path: Path, h: Any,
                                                                     chain: tuple[str, ...]) -> None:
    state = nested_state()
    paths = [tmp_path / f"step{i}{FORMAT_SUFFIX[fmt]}" for i, fmt in enumerate(chain)]
    write_source(state, paths[0], chain[0], h)
    for src, dst in itertools.pairwise(paths):
        convert(src, dst, config=h.small_config())
    restored = read_native(paths[-1], chain[-1])
    h.assert_same(state, restored)
    assert restored["lm_head"] is restored["embed"], "the tie comes back as one tensor"
    assert isinstance(restored["model"], collections.OrderedDict)
    assert restored["model"]._metadata == state["model"]._metadata


def test_a_legacy_tar_pickle_is_refused_without_advice_to_trust_it(tmp_path: Path) -> None:
    """torch refuses the legacy .tar format under ``weights_only=True`` and advises loading it
    with ``weights_only=False``; convert passed that advice on."""
    import io
    import tarfile

    source = tmp_path / "old.pt"
    with tarfile.open(source, "w") as archive:
        for name in ("storages", "tensors", "pickle"):
            data = pickle.dumps({}, protocol=2)
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            archive.addfile(entry, io.BytesIO(data))
    with pytest.raises(UnsafePickleError, match="legacy .tar format") as caught:
        gdsckpt.convert(source, tmp_path / "out.gdsckpt")
    assert "weights_only" not in str(caught.value) and not (tmp_path / "out.gdsckpt").exists()


@pytest.mark.parametrize("dst_name", ["out.gdsckpt", "out.safetensors"])
def test_an_expanded_tensor_far_beyond_its_storage_is_refused_before_writing(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            dst_name: str) -> None:
    """A 1.5 KB pickle of ``torch.zeros(1).expand(2**40)`` made convert write until the disk was
    full (gdsckpt) or ask for 4 TiB of memory (safetensors). Here the limit is lowered to 1 MiB
    and the tensor is 16 MiB, so that the test stays cheap whether or not the guard holds."""
    from gdsckpt.integrations import convert as convert_module

    monkeypatch.setattr(convert_module, "EXPANSION_LIMIT", 1 << 20)
    source = tmp_path / "bomb.pt"
    torch.save({"model": {"big": torch.zeros(1).expand(1 << 22), "small": torch.ones(3).expand(2, 3)}}, source)
    with pytest.raises(ConvertError, match=r"tensor 'model/big' \(shape \[4194304\]\) is a view whose 16777216 bytes"):
        gdsckpt.convert(source, tmp_path / dst_name)
    assert sorted(os.listdir(tmp_path)) == ["bomb.pt"]
    monkeypatch.undo()
    gdsckpt.convert(source, tmp_path / dst_name)  # within the default limit: written in full


def test_safetensors_destination_is_flat_with_dotted_names(tmp_path: Path, h: Any) -> None:
    state = nested_state()
    src, dst = tmp_path / "state.pt", tmp_path / "state.safetensors"
    torch.save(state, src)
    report = convert(src, dst, config=h.small_config())
    flat = safetensors_torch.load_file(str(dst))
    assert "model.0.weight" in flat and "optimizer.state.0.exp_avg" in flat and "misc.3.fp8" in flat
    h.assert_same(state["optimizer"]["state"][1]["exp_avg"], flat["optimizer.state.1.exp_avg"])
    h.assert_same(state["embed"], flat["lm_head"])
    assert report.cloned == 1, "the tied tensor is written as its own copy"
    from safetensors import safe_open

    with safe_open(str(dst), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "pt" and STRUCTURE_KEY in metadata


def test_safetensors_clones_overlapping_views_and_keeps_values(tmp_path: Path, h: Any) -> None:
    base = torch.arange(20, dtype=torch.float32)
    state = {"whole": base, "head": base[:8], "tail": base[12:], "overlap": base[4:10],
             "grid": base.view(4, 5).t(), "nothing": base[3:3]}
    src, dst = tmp_path / "views.pt", tmp_path / "views.safetensors"
    torch.save(state, src)
    report = convert(src, dst, config=h.small_config())
    assert report.cloned == 3  # head, overlap and tail lie inside whole (grid is made contiguous)
    assert_same_tensors(state, safetensors_torch.load_file(str(dst)), h)
    back = tmp_path / "back.pt"
    convert(dst, back, config=h.small_config())
    h.assert_same(state, torch.load(back, weights_only=True))


def test_third_party_safetensors_metadata_is_kept_for_safetensors(tmp_path: Path, h: Any) -> None:
    src, dst = tmp_path / "hf.safetensors", tmp_path / "copy.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, str(src), metadata={"format": "pt", "origin": "hub"})
    convert(src, dst, config=h.small_config())
    from safetensors import safe_open

    with safe_open(str(dst), framework="pt") as handle:
        assert handle.metadata()["origin"] == "hub"


def test_numpy_arrays_of_a_gdsckpt_file_become_torch_tensors(tmp_path: Path, h: Any) -> None:
    arrays = {"f32": np.array([np.nan, -0.0, 1.5], dtype=np.float32), "i16": np.array([-3, 4], dtype=np.int16),
              "scalar": np.float64(-0.0), "empty": np.zeros((0, 2), dtype=np.uint8)}
    arrays["f32"].view(np.uint32)[0] = 0x7FC00042  # a NaN payload
    try:
        import ml_dtypes
    except ImportError:  # bfloat16 NumPy arrays need ml_dtypes; the rest is tested without it
        pass
    else:
        arrays["bf16"] = np.array([0x7FC1, 0x8000], dtype=np.uint16).view(ml_dtypes.bfloat16)
        arrays["e4m3"] = np.array([0x7F, 0x80], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    src = tmp_path / "np.gdsckpt"
    gdsckpt.save(arrays, src, config=h.small_config())
    for fmt in ("pt", "safetensors"):
        dst = tmp_path / f"np{FORMAT_SUFFIX[fmt]}"
        convert(src, dst, config=h.small_config())
        restored = read_native(dst, fmt)
        for key, array in arrays.items():
            tensor = restored[key]
            assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == np.shape(array), key
            assert h.tensor_bytes(tensor) == h.array_bytes(array), key


def test_gdsckpt_to_gdsckpt_recompresses_with_the_codec(tmp_path: Path, h: Any) -> None:
    expected = flat_tensors()
    src, dst = tmp_path / "zstd.gdsckpt", tmp_path / "plain.gdsckpt"
    gdsckpt.save(expected, src, codec="zstd", config=h.small_config())
    report = convert(src, dst, codec="none", config=h.small_config())
    assert report.codec == "none"
    assert set(gdsckpt.inspect(dst).codecs) == {"none/1"}
    assert_same_tensors(expected, gdsckpt.load(dst), h)


def test_gdsckpt_to_gdsckpt_streams_a_delta_into_a_full_file_with_empty_and_tied_arrays(tmp_path: Path,
                                                                                        h: Any) -> None:
    """The gdsckpt-to-gdsckpt path reads in windows (``api.saving.rewrite``): a delta source
    becomes a full file, and zero-size arrays, ties, parameters and plain values come through."""
    w = torch.nn.Parameter(torch.randn(64, 33))
    state = {"w": w, "tied": w, "empty": torch.empty(0, 5), "step": 3, "lr": [1e-3, None]}
    base, delta, out = tmp_path / "base.gdsckpt", tmp_path / "delta.gdsckpt", tmp_path / "out.gdsckpt"
    gdsckpt.save(state, base, config=h.small_config())
    with torch.no_grad():
        w[0, 0] += 1
    gdsckpt.save(state, delta, base=base, config=h.small_config())
    assert gdsckpt.inspect(delta).base is not None
    report = convert(delta, out, codec="lz4", config=h.small_config())
    assert report.src_format == report.dst_format == "gdsckpt" and report.codec == "lz4"
    assert report.tensors == 3 and report.logical_bytes == 64 * 33 * 4  # the tie counted once in bytes
    assert gdsckpt.inspect(out).base is None
    loaded = gdsckpt.load(out)
    h.assert_same(state, loaded)
    assert loaded["tied"] is loaded["w"] and isinstance(loaded["w"], torch.nn.Parameter)


def test_rebase_of_a_state_with_a_zero_size_array(tmp_path: Path, h: Any) -> None:
    state = {"w": torch.randn(100), "empty": torch.empty(0, dtype=torch.float16)}
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, path, config=h.small_config())
    gdsckpt.rebase(path, tmp_path / "b.gdsckpt", codec="none")
    h.assert_same(state, gdsckpt.load(tmp_path / "b.gdsckpt"))


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), [("pt", "safetensors"), ("gdsckpt", "pt"), ("pt", "gdsckpt")])
def test_progress_moves_forward_to_the_total(tmp_path: Path, h: Any, src_fmt: str, dst_fmt: str) -> None:
    calls: list[tuple[int, int]] = []
    src, dst = tmp_path / f"a{FORMAT_SUFFIX[src_fmt]}", tmp_path / f"b{FORMAT_SUFFIX[dst_fmt]}"
    write_source(flat_tensors(), src, src_fmt, h)
    convert(src, dst, config=h.small_config(), progress=lambda done, total: calls.append((done, total)))
    assert calls[-1][0] == calls[-1][1] > 0
    assert all(b[0] >= a[0] for a, b in itertools.pairwise(calls)), calls
    assert all(done <= total for done, total in calls), calls


# ---------------------------------------------------------------------------------------------
# unsafe pickles


class _RunsCommand:
    """Unpickles by running a shell command: the classic malicious checkpoint."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (os.system, (self.command,))


def _touch(marker: Path) -> _RunsCommand:
    return _RunsCommand(f"touch {shlex.quote(str(marker))}")


def test_the_malicious_payload_is_live(tmp_path: Path) -> None:
    """Control for the tests below: plain unpickling of the payload does run the command."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(_touch(marker), protocol=2))
    assert marker.exists()


@pytest.mark.parametrize("container", ["torch-zip", "raw-pickle"])
@pytest.mark.parametrize("dst_fmt", ["gdsckpt", "safetensors", "pt"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path, h: Any, container: str, dst_fmt: str) -> None:
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    payload = {"weight": torch.ones(3), "trap": _touch(marker)}
    if container == "torch-zip":
        torch.save(payload, src)
    else:
        with open(src, "wb") as handle:
            pickle.dump(payload, handle, protocol=2)
    dst = tmp_path / f"out{FORMAT_SUFFIX[dst_fmt]}"
    if dst_fmt == "pt":
        dst = tmp_path / "out.pth"
    with pytest.raises(UnsafePickleError, match="refused") as caught:
        convert(src, dst, config=h.small_config())
    assert "weights_only=False" not in str(caught.value), "never advise loading it unsafely"
    assert not marker.exists(), "the payload ran"
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt"]


# ---------------------------------------------------------------------------------------------
# content a format cannot hold; unreadable sources


def test_unsupported_content_is_refused_naming_the_key(tmp_path: Path, h: Any) -> None:
    src = tmp_path / "odd.pt"
    torch.save({"ok": torch.ones(2), "meta": {"shape": torch.Size([2, 3])}}, src)
    for dst in (tmp_path / "odd.safetensors", tmp_path / "odd.gdsckpt"):
        with pytest.raises(ConvertError, match="meta/shape"):
            convert(src, dst, config=h.small_config())
        assert not dst.exists()
    convert(src, tmp_path / "odd-copy.pt", config=h.small_config())  # a pickle holds it
    assert torch.load(tmp_path / "odd-copy.pt", weights_only=True)["meta"]["shape"] == torch.Size([2, 3])


def test_colliding_dotted_names_are_refused(tmp_path: Path, h: Any) -> None:
    src = tmp_path / "clash.pt"
    torch.save({"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}, src)
    with pytest.raises(ConvertError, match=r"'a/b' and 'a\.b'|'a\.b' and 'a/b'"):
        convert(src, tmp_path / "clash.safetensors", config=h.small_config())


def test_dtype_safetensors_lacks_is_refused_naming_the_key(tmp_path: Path, h: Any) -> None:
    src = tmp_path / "complex.pt"
    torch.save({"fine": torch.ones(1), "z": torch.ones(2, dtype=torch.complex128)}, src)
    with pytest.raises(ConvertError, match="'z'.*complex128"):
        convert(src, tmp_path / "complex.safetensors", config=h.small_config())
    convert(src, tmp_path / "complex.gdsckpt", config=h.small_config())  # gdsckpt holds it
    assert gdsckpt.load(tmp_path / "complex.gdsckpt")["z"].dtype == torch.complex128


@pytest.mark.parametrize("structure", ["not json", '{"version": 99}',
                                       '{"version": 1, "tree": {"t": "tensor", "id": 0}, '
                                       + '"tensors": [{"name": "missing"}]}',
                                       '{"version": 1, "tree": {"t": "list", "items": []}, "tensors": []}'])
def test_malformed_structure_metadata_is_an_error(tmp_path: Path, h: Any, structure: str) -> None:
    src = tmp_path / "bad.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, str(src), metadata={STRUCTURE_KEY: structure})
    with pytest.raises(ConvertError, match=STRUCTURE_KEY):
        convert(src, tmp_path / "bad.pt", config=h.small_config())
    assert not (tmp_path / "bad.pt").exists()


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "gdsckpt"])
def test_a_file_that_is_not_its_format_is_a_clear_error(tmp_path: Path, h: Any, fmt: str) -> None:
    src = tmp_path / f"junk{FORMAT_SUFFIX[fmt]}"
    src.write_bytes(b"this is not a checkpoint at all" * 4)
    with pytest.raises(gdsckpt.CheckpointError, match="junk"):
        convert(src, tmp_path / "out.gdsckpt" if fmt != "gdsckpt" else tmp_path / "out.pt",
                config=h.small_config())


# ---------------------------------------------------------------------------------------------
# destinations: no clobbering, no partial files


def test_existing_destination_needs_overwrite(tmp_path: Path, h: Any) -> None:
    src, dst = tmp_path / "a.pt", tmp_path / "a.gdsckpt"
    torch.save({"w": torch.ones(3)}, src)
    dst.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert(src, dst, config=h.small_config())
    assert dst.read_bytes() == b"precious"
    convert(src, dst, config=h.small_config(), overwrite=True)
    h.assert_same({"w": torch.ones(3)}, gdsckpt.load(dst))


@pytest.mark.parametrize("dst_fmt", ["pt", "safetensors", "gdsckpt"])
def test_a_destination_created_during_the_conversion_is_not_clobbered(tmp_path: Path, h: Any,
                                                                     dst_fmt: str) -> None:
    src, dst = tmp_path / "src.pt", tmp_path / f"dst{FORMAT_SUFFIX[dst_fmt]}"
    torch.save({"w": torch.ones(3)}, src)

    def another_writer_gets_there_first(done: int, _total: int) -> None:
        if done == 0:
            dst.write_bytes(b"someone else's file")

    with pytest.raises(FileExistsError, match="appeared during the conversion"):
        convert(src, dst, config=h.small_config(), progress=another_writer_gets_there_first)
    assert dst.read_bytes() == b"someone else's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, dst.name])


@pytest.mark.parametrize("dst_fmt", ["pt", "safetensors", "gdsckpt"])
def test_a_conversion_over_a_private_file_writes_it_privately(tmp_path: Path, h: Any, dst_fmt: str) -> None:
    """The temporaries a conversion over a 0o600 destination writes are 0o600 too (they took the
    umask's bits, 0o644, until the rename: the new content was readable by everyone meanwhile),
    and the result keeps the destination's bits, as a save over it does."""
    import stat

    src, dst = tmp_path / "src.pt", tmp_path / f"dst{FORMAT_SUFFIX[dst_fmt]}"
    torch.save({"w": torch.arange(5000, dtype=torch.float32)}, src)
    dst.write_bytes(b"private")
    os.chmod(dst, 0o600)
    seen: dict[str, int] = {}

    def look_at_the_temporaries(_done: int, _total: int) -> None:
        for path in tmp_path.iterdir():
            if path not in (src, dst):
                seen[path.name] = stat.S_IMODE(path.stat().st_mode)

    convert(src, dst, config=h.small_config(), overwrite=True, progress=look_at_the_temporaries)
    assert seen and set(seen.values()) == {0o600}, seen
    assert stat.S_IMODE(dst.stat().st_mode) == 0o600
    h.assert_same({"w": torch.arange(5000, dtype=torch.float32)}, gdsckpt.load(dst) if dst_fmt == "gdsckpt"
                  else convert_back(dst, tmp_path, h))


def convert_back(path: Path, tmp_path: Path, h: Any) -> Any:
    """``path`` read back through a conversion to gdsckpt."""
    back = tmp_path / "back.gdsckpt"
    convert(path, back, config=h.small_config())
    return gdsckpt.load(back)


@pytest.mark.parametrize("dst_fmt", ["pt", "safetensors"])
def test_a_write_that_fails_midway_leaves_the_old_destination(tmp_path: Path, h: Any, dst_fmt: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the format's writer dies after writing part of the file."""
    src, dst = tmp_path / "a.gdsckpt", tmp_path / f"a{FORMAT_SUFFIX[dst_fmt]}"
    gdsckpt.save({"w": torch.ones(1000)}, src, config=h.small_config())
    dst.write_bytes(b"previous good file")

    def dies_midway(_state: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        if hasattr(target, "write"):
            target.write(b"partial")
        else:
            Path(target).write_bytes(b"partial")
        raise OSError(28, "No space left on device (injected)")

    if dst_fmt == "pt":
        monkeypatch.setattr(torch, "save", dies_midway)
    else:
        monkeypatch.setattr(safetensors_torch, "save_file", dies_midway)
    with pytest.raises(OSError, match="injected"):
        convert(src, dst, config=h.small_config(), overwrite=True)
    assert dst.read_bytes() == b"previous good file"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, dst.name])


def test_missing_source_and_directory_destination(tmp_path: Path, h: Any) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(tmp_path / "none.pt", tmp_path / "x.gdsckpt")
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(1)}, src)
    (tmp_path / "dir.gdsckpt").mkdir()
    with pytest.raises(IsADirectoryError):
        convert(src, tmp_path / "dir.gdsckpt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(src, tmp_path / "no" / "such" / "x.gdsckpt")


def test_formats_from_extensions_and_overrides(tmp_path: Path, h: Any) -> None:
    assert detect_format("m.PTH") == "pt" and detect_format("m.bin") == "pt"
    assert detect_format("m.safetensors") == "safetensors" and detect_format("m.gdsckpt") == "gdsckpt"
    with pytest.raises(ValueError, match="--from/--to"):
        detect_format("model.ckpt")
    with pytest.raises(ValueError, match="unknown format"):
        detect_format("m.pt", "onnx")
    src, dst = tmp_path / "model.ckpt", tmp_path / "model.weights"
    torch.save({"w": torch.ones(2)}, src)
    convert(src, dst, src_format="pt", dst_format="safetensors", config=h.small_config())
    h.assert_same({"w": torch.ones(2)}, safetensors_torch.load_file(str(dst)))
    with pytest.raises(ValueError, match="gdsckpt destination"):
        convert(src, tmp_path / "x.safetensors", src_format="pt", codec="zstd")
    with pytest.raises(ValueError, match="unknown codec"):
        convert(src, tmp_path / "x.gdsckpt", src_format="pt", codec="brotli")


# ---------------------------------------------------------------------------------------------
# the command line


def cli(*argv: str) -> int:
    """``gdsckpt [--quiet] convert ...`` through the command's entry point, in this process."""
    return main(list(argv))


def test_cli_converts_and_reports(tmp_path: Path, h: Any, capsys: pytest.CaptureFixture[str]) -> None:
    expected = flat_tensors()
    src, dst = tmp_path / "a.pt", tmp_path / "a.gdsckpt"
    torch.save(expected, src)
    assert cli("convert", str(src), str(dst), "--codec", "lz4") == 0
    out = capsys.readouterr().out
    assert "(pt) -> " in out and "(gdsckpt)" in out and "codec lz4" in out and f"{len(expected)} tensors" in out
    assert_same_tensors(expected, gdsckpt.load(dst), h)
    assert cli("--quiet", "convert", str(dst), str(tmp_path / "b"), "--to", "safetensors") == 0
    assert capsys.readouterr().out == ""
    assert_same_tensors(expected, safetensors_torch.load_file(str(tmp_path / "b")), h)


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2)}, src)
    (tmp_path / "taken.gdsckpt").write_bytes(b"keep")
    cases = [
        (["convert", str(src), str(tmp_path / "x.unknown")], 2, "--from/--to"),
        (["convert", str(src), str(tmp_path / "x.gdsckpt"), "--codec", "brotli"], 2, "unknown codec"),
        (["convert", str(src), str(tmp_path / "x.pt"), "--codec", "zstd"], 2, "gdsckpt destination"),
        (["convert", str(src), str(tmp_path / "taken.gdsckpt")], 1, "--overwrite"),
        (["convert", str(tmp_path / "none.pt"), str(tmp_path / "y.gdsckpt")], 1, "does not exist"),
    ]
    for argv, code, message in cases:
        assert cli(*argv) == code, argv
        err = capsys.readouterr().err
        assert err.startswith("gdsckpt convert: error:") and message in err, err
        assert "Traceback" not in err
    assert (tmp_path / "taken.gdsckpt").read_bytes() == b"keep"
    assert cli("--quiet", "convert", str(src), str(tmp_path / "taken.gdsckpt"), "--overwrite") == 0


def test_cli_refuses_a_malicious_pickle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker, src = tmp_path / "pwned", tmp_path / "evil.bin"
    torch.save({"trap": _touch(marker)}, src)
    assert cli("convert", str(src), str(tmp_path / "out.safetensors")) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "weights_only=True" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# review of the conversions (2026-12-06): each failed before its fix


def test_a_truncated_torch_file_is_named_as_damaged(tmp_path: Path, h: Any) -> None:
    """torch's zip reader says EINVAL for a file cut short at many points; that came out as a bare
    ``[Errno 22] Invalid argument`` naming no file."""
    whole = tmp_path / "whole.pt"
    torch.save({"a": torch.randn(1000), "b": {"c": torch.arange(10)}}, whole)
    data = whole.read_bytes()
    damaged = tmp_path / "cut.pt"
    refused = 0
    for fraction in range(50, 100, 3):
        damaged.write_bytes(data[:len(data) * fraction // 100])
        with pytest.raises(ConvertError, match="cut.pt") as caught:
            convert(damaged, tmp_path / "out.gdsckpt", config=h.small_config())
        refused += "truncated" in str(caught.value)
        assert not (tmp_path / "out.gdsckpt").exists()
    assert refused  # the EINVAL case was among the cuts


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_from_pt_reads_the_file_as_a_torch_pickle_whatever_its_name(tmp_path: Path, h: Any, suffix: str) -> None:
    """torch.load hands a path ending in ".safetensors" to safetensors: ``--from pt`` on a
    safetensors file returned its tensors flattened (the structure and plain values gone, exit 0),
    and a real torch.save file so named could not be read at all."""
    state = {"model": {"w": torch.randn(4)}, "step": 5, "opt": [torch.ones(2)]}
    named = tmp_path / f"state{suffix}"
    torch.save(state, named)
    convert(named, tmp_path / "out.gdsckpt", src_format="pt", config=h.small_config())
    back = gdsckpt.load(tmp_path / "out.gdsckpt")
    assert back["step"] == 5
    h.assert_same(state["model"]["w"], back["model"]["w"], "model/w")
    flat = tmp_path / "real.safetensors"
    safetensors_torch.save_file({"model.w": torch.randn(4)}, str(flat))
    with pytest.raises(ConvertError, match="real.safetensors"):
        convert(flat, tmp_path / "other.gdsckpt", src_format="pt", config=h.small_config())
    assert not (tmp_path / "other.gdsckpt").exists()


def test_expanded_tensors_are_bounded_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound on bytes beyond storage held per tensor: N entries of just under it made N times
    the limit (4 GiB from a 2.3 KB pickle). Here four of 768 KiB against a 1 MiB limit."""
    from gdsckpt.integrations import convert as convert_module

    monkeypatch.setattr(convert_module, "EXPANSION_LIMIT", 1 << 20)
    source = tmp_path / "bombs.pt"
    torch.save({f"k{i}": torch.zeros(1).expand(3 << 16) for i in range(4)}, source)
    with pytest.raises(ConvertError, match=r"3 more such tensors, 3145712 bytes beyond their storage in all"):
        gdsckpt.convert(source, tmp_path / "out.gdsckpt")
    assert sorted(os.listdir(tmp_path)) == ["bombs.pt"]
    torch.save({"k0": torch.zeros(1).expand(3 << 16)}, source)
    gdsckpt.convert(source, tmp_path / "out.gdsckpt")  # one alone stays within the limit


def test_a_write_side_failure_does_not_blame_the_source(tmp_path: Path, h: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """gdsckpt to gdsckpt said "cannot read 'a.gdsckpt' as gdsckpt" for a codec this host cannot
    write (or any write-side ``CheckpointError``); a damaged source is still named as such."""
    from gdsckpt.api import saving
    from gdsckpt.errors import CodecUnavailableError

    src = tmp_path / "a.gdsckpt"
    gdsckpt.save({"w": torch.randn(1000)}, src, config=h.small_config())

    def no_codec(*_args: Any, **_kwargs: Any) -> None:
        raise CodecUnavailableError("codec 'ans' needs an NVIDIA GPU (injected)")

    monkeypatch.setattr(saving, "save_flat", no_codec)
    with pytest.raises(ConvertError, match="injected") as caught:
        convert(src, tmp_path / "b.gdsckpt", config=h.small_config())
    assert not str(caught.value).startswith("cannot read") and "b.gdsckpt" in str(caught.value)
    monkeypatch.undo()
    data = bytearray(src.read_bytes())
    data[4096 + 10] ^= 0xFF  # inside the first chunk
    src.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match=r"^cannot read .*a\.gdsckpt"):
        convert(src, tmp_path / "c.gdsckpt", config=h.small_config())


@pytest.mark.parametrize("dst_name", ["out.pt", "out.safetensors"])
def test_a_destination_over_its_size_limit_says_so(tmp_path: Path, h: Any, dst_name: str) -> None:
    """A full disk or a file-size limit while writing a .pt destination came out as torch's
    "[enforce fail at inline_container.cc] unexpected pos" and, for safetensors, as "safetensors
    refused the content of" the source. Run in a child under ``RLIMIT_FSIZE`` (EFBIG)."""
    src = tmp_path / "src.gdsckpt"
    gdsckpt.save({"a": torch.randn(30000)}, src, config=h.small_config())
    child = (
        "import resource, signal, sys, gdsckpt\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (50000, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    gdsckpt.convert({str(src)!r}, {str(tmp_path / dst_name)!r})\n"
        "except OSError as err:\n"
        "    print(err.errno, err); sys.exit(0)\n"
        "sys.exit(3)\n")
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                            env=h.subprocess_env(), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("27 ") and "File too large" in result.stdout, result.stdout
    assert "enforce fail" not in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["src.gdsckpt"]


def test_safetensors_without_pytorch_names_pytorch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where safetensors is installed but its torch API cannot import (no PyTorch), the error said
    "needs the safetensors package (pip install safetensors)", which is installed."""
    import sys

    gdsckpt.save({"w": np.arange(4, dtype=np.float32)}, tmp_path / "a.gdsckpt")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # what a missing torch makes of it
    with pytest.raises(ConvertError, match=r"needs PyTorch \(pip install torch\)"):
        convert(tmp_path / "a.gdsckpt", tmp_path / "a.safetensors")
