"""Resource bounds and misuse.

- 100,000 tiny tensors (1-37 floats each, in a nested dict) save and load bit-exact on the CPU
  engine; the seconds are printed, not asserted.
- Host memory of a save and of a load of a state 8x ``Config.max_inflight_bytes`` grows by at most
  a bound proportional to ``max_inflight_bytes`` (plus, for a load, the restored arrays
  themselves), measured in fresh processes (see ``RssSampler`` for what exactly is measured).
- Misuse: every value ``flatten`` cannot save raises ``TypeError`` (``ValueError`` for a key
  collision or an oversized int) naming its key path, the failed save leaves nothing behind, and
  every value it saves with a documented change of type or of what is kept comes back as
  documented (gdsckpt/state.py). ``MISUSE`` and ``DOCUMENTED`` are the table docs/reliability.md
  quotes.

Run as ``python -m reliability.test_bounds_and_misuse CHILD`` (cwd ``tests/``), this module is the
child process of the memory measurement.
"""

from __future__ import annotations

import collections
import contextlib
import decimal
import enum
import fractions
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.format import unpack_trailer

from .harness import record_figure
from .test_hostile_files import RssSampler

MIB = 1 << 20

# ---------------------------------------------------------------------------------------------
# 100,000 tiny tensors


def test_100k_tiny_tensors_round_trip_bit_exact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(100)
    sizes = torch.randint(1, 38, (100_000,), generator=g).tolist()
    values = torch.randn(sum(sizes), generator=g)
    specials = torch.tensor([0x7FC00001, 0x7F800001, -0x3EDCBA9, -(1 << 31)], dtype=torch.int32)
    values[[0, 40_000, 800_000, 1_500_000]] = specials.view(torch.float32)  # NaN payloads, -0.0
    state: dict[str, Any] = {}
    expected = []
    for i, piece in enumerate(torch.split(values, sizes)):
        tensor = piece.clone()
        state.setdefault(f"layer{i // 1000}", {}).setdefault(f"block{i // 100 % 10}", {})[f"p{i}"] = tensor
        expected.append(tensor)
    path = tmp_path / "tiny.gdsckpt"
    config = gdsckpt.Config(fsync=False, codec_threads=2, io_threads=2)
    started = time.perf_counter()
    report = gdsckpt.save(state, path, codec="zstd", config=config)
    saved = time.perf_counter()
    loaded = gdsckpt.load(path, config=config)
    restored = time.perf_counter()

    assert report.tensors == 100_000 and report.engine == "cpu"
    assert list(loaded) == list(state)
    got = []
    for layer, blocks in state.items():
        assert list(loaded[layer]) == list(blocks)
        for block, params in blocks.items():
            assert list(loaded[layer][block]) == list(params)
            for name, tensor in params.items():
                back = loaded[layer][block][name]
                assert type(back) is torch.Tensor and back.dtype == torch.float32 and back.shape == tensor.shape
                got.append(back)
    assert torch.equal(torch.cat(got).view(torch.int32), torch.cat(expected).view(torch.int32)), "bits differ"
    data = path.read_bytes()
    index_bytes = unpack_trailer(data[-64:], len(data)).index_length
    record_figure("100k tiny tensors",
                  f"100,000 float32 tensors of 1-37 elements ({values.numel() * 4 / MIB:.1f} MiB, nested dict "
                  f"100 x 10 x 100) on the CPU engine with zstd: save {saved - started:.1f} s, load "
                  f"{restored - saved:.1f} s, bit-exact; file {len(data) / MIB:.1f} MiB: {report.chunks} chunks "
                  f"and a {index_bytes / MIB:.1f} MiB JSON index")


# ---------------------------------------------------------------------------------------------
# host memory bound (fresh processes)

INFLIGHT = 8 * MIB
STATE_BYTES = 64 * MIB


def _bounded_config(max_inflight_bytes: int = INFLIGHT) -> gdsckpt.Config:
    return gdsckpt.Config(chunk_bytes=MIB, max_inflight_bytes=max_inflight_bytes, codec_threads=2, io_threads=2,
                          fsync=False)


def _big_state(nbytes: int = STATE_BYTES) -> dict[str, Any]:
    g = torch.Generator().manual_seed(64)
    count = nbytes // 4 // 8
    return {f"w{i}": torch.randn(count, generator=g) for i in range(8)}


def _memory_child(mode: str, directory: str, inflight: int) -> None:
    """Child process: one measured save or load; prints one JSON line."""
    root = Path(directory)
    config = _bounded_config(inflight)
    warm = root / f"warm-{mode}-{inflight}.gdsckpt"
    gdsckpt.save({"w": torch.randn(1 << 18)}, warm, codec="zstd", config=config)  # imports, pools
    gdsckpt.load(warm, config=config)
    path: Any = root / "big.gdsckpt"
    if mode.startswith("s3"):  # the object at the URL the parent names (the server is the parent's)
        path = os.environ["BOUNDS_TEST_URL"]
    state = _big_state() if mode == "save" else _big_state(S3_STATE_BYTES) if mode == "s3save" else None
    if mode == "dcpload":  # into tensors made (and touched) before the measure
        import torch.distributed.checkpoint as dcp

        from gdsckpt.dcp import GdsStorageReader

        warnings.simplefilter("ignore")  # DCP's, about running without a process group
        targets = {f"w{i}": torch.full((STATE_BYTES // 4 // 8,), -1.0) for i in range(8)}
    gc.collect()
    sampler = RssSampler()
    sampler.start()
    if mode == "dcpload":
        dcp.load(targets, storage_reader=GdsStorageReader(root / "dcp", config=config))
    elif mode in ("save", "s3save"):
        gdsckpt.save(state, path, codec="zstd", config=config)
    elif mode == "convert":
        gdsckpt.convert(path, root / "converted.gdsckpt", codec="lz4", config=config, overwrite=True)
    else:
        loaded = gdsckpt.load(path, config=config)
    sampler.stop()
    restored = sum(t.numel() * t.element_size() for t in loaded.values()) if mode in ("load", "s3load") else 0
    if mode == "dcpload":
        assert all(torch.equal(targets[key], tensor) for key, tensor in _big_state().items())
        path = next((root / "dcp").glob("*.gdsckpt"))
    print(json.dumps({"growth": sampler.growth, "sampled": sampler.sampled - sampler.baseline,
                      "maxrss_raised": sampler.maxrss_after > sampler.maxrss_before, "restored": restored,
                      "file": gdsckpt.inspect(path).file_bytes}))


def _measure(h: Any, mode: str, directory: Path, inflight: int = INFLIGHT) -> dict[str, Any]:
    child = h.run_python("-m", "reliability.test_bounds_and_misuse", "memory", mode, str(directory), str(inflight),
                         cwd=h.REPO_ROOT / "tests", timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_gdsckpt_to_gdsckpt_convert_streams_within_the_bounds(tmp_path: Path, h: Any) -> None:
    """A gdsckpt-to-gdsckpt conversion reads the arrays in windows (of ``max_inflight_bytes``)
    while the save pipeline writes: its memory is a multiple of the in-flight bound, not the
    state (64 MiB here)."""
    _measure(h, "save", tmp_path)
    inflight = 2 * MIB
    window = inflight
    converted = _measure(h, "convert", tmp_path, inflight)
    # the reading restore keeps up to 2 x max_inflight_bytes, the save as much again plus the
    # compressed copies; the window cache three windows (one read ahead), with one being filled
    # and one copied out
    bound = 6 * inflight + 5 * window + 16 * MIB
    record_figure("convert memory bound", f"gdsckpt -> gdsckpt (zstd -> lz4) of a {STATE_BYTES // MIB} MiB state: "
                  f"RSS growth {converted['growth'] / MIB:.1f} MiB, asserted <= {bound // MIB} MiB "
                  f"(6 x max_inflight_bytes of {inflight // MIB} MiB + 5 windows of {window // MIB} MiB "
                  f"+ 16 MiB)")
    assert converted["growth"] <= bound < STATE_BYTES, converted
    h.assert_same(gdsckpt.load(tmp_path / "big.gdsckpt"), gdsckpt.load(tmp_path / "converted.gdsckpt"))
    assert set(gdsckpt.inspect(tmp_path / "converted.gdsckpt").codecs) <= {"lz4/1", "byteplanes/1+lz4/1", "none/1"}


def test_host_memory_stays_within_the_inflight_bound(tmp_path: Path, h: Any) -> None:
    save = _measure(h, "save", tmp_path)
    load = _measure(h, "load", tmp_path)
    unbounded = _measure(h, "load", tmp_path, inflight=1 << 30)
    slack = 16 * MIB  # allocator arenas, codec contexts, thread stacks, the index and Python objects
    assert load["restored"] == STATE_BYTES
    record_figure("host memory bound",
                  f"state {STATE_BYTES // MIB} MiB float32 (file {load['file'] / MIB:.1f} MiB, zstd, 1 MiB "
                  f"chunks), max_inflight_bytes {INFLIGHT // MIB} MiB, 2 codec threads: save RSS growth "
                  f"{save['growth'] / MIB:.1f} MiB; load RSS growth {load['growth'] / MIB:.1f} MiB of which "
                  f"{load['restored'] / MIB:.0f} MiB are the restored arrays (overhead "
                  f"{(load['growth'] - load['restored']) / MIB:.1f} MiB); the same load with "
                  f"max_inflight_bytes 1 GiB: overhead {(unbounded['growth'] - unbounded['restored']) / MIB:.1f} "
                  f"MiB; asserted: save <= 2 x max_inflight_bytes + {slack // MIB} MiB, load <= restored + "
                  f"2 x max_inflight_bytes + {slack // MIB} MiB (fresh process each; peak of /proc/self/statm "
                  f"sampled every 1 ms, or ru_maxrss where "
                  f"the phase raised it: {save['maxrss_raised']}/{load['maxrss_raised']}/"
                  f"{unbounded['maxrss_raised']})")
    assert save["growth"] <= 2 * INFLIGHT + slack, save
    assert load["growth"] <= load["restored"] + 2 * INFLIGHT + slack, load
    # the measurement sees read buffers at all: without the bound they hold about the whole file
    assert unbounded["growth"] - unbounded["restored"] > load["growth"] - load["restored"] + INFLIGHT, unbounded


def test_dcp_load_fills_its_destinations_within_the_inflight_bound(tmp_path: Path, h: Any) -> None:
    """A DCP load through ``GdsStorageReader`` into tensors made before it: whole items are
    restored into them. It read up to 1 GiB of a rank file into new tensors, then copied them:
    memory grew with the state (64 MiB here) whatever ``max_inflight_bytes`` said."""
    import torch.distributed.checkpoint as dcp

    from gdsckpt.dcp import GdsStorageWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's, about running without a process group
        dcp.save(_big_state(), storage_writer=GdsStorageWriter(tmp_path / "dcp", config=_bounded_config(),
                                                                codec="zstd"))
    loaded = _measure(h, "dcpload", tmp_path)
    bound = 2 * INFLIGHT + 16 * MIB
    record_figure("DCP load memory bound", f"dcp.load of a {STATE_BYTES // MIB} MiB state (8 tensors) into "
                  f"preallocated tensors: RSS growth {loaded['growth'] / MIB:.1f} MiB, asserted <= "
                  f"{bound // MIB} MiB (2 x max_inflight_bytes of {INFLIGHT // MIB} MiB + 16 MiB)")
    assert loaded["growth"] <= bound < STATE_BYTES, loaded


S3_STATE_BYTES = 256 * MIB


def test_object_storage_memory_stays_within_the_bound(tmp_path: Path, h: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A save to ``s3://`` and a load from it, in fresh processes, of a state 32x
    ``max_inflight_bytes``: the upload holds its parts in flight (one 16 MiB part where the bound
    holds less than one, as S3 needs parts of at least 5 MiB; filled while the previous one
    goes) and a few queued chunk copies, the load its GET buffers; neither grows with the state."""
    seaweed = pytest.importorskip("seaweed")
    from gdsckpt.io.s3 import PART_BYTES, QUEUED_WRITES, READ_THREADS, upload_concurrency

    server = seaweed.SeaweedServer(tmp_path / "weed")
    endpoint = server.start()
    try:
        for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "test"),
                            ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1"),
                            ("BOUNDS_TEST_URL", "s3://bounds/big.gdsckpt")):
            monkeypatch.setenv(name, value)
        seaweed.create_bucket(endpoint, "bounds")
        env = h.subprocess_env()
        results = {}
        for mode in ("s3save", "s3load"):
            child = subprocess.run([sys.executable, "-m", "reliability.test_bounds_and_misuse", "memory", mode,
                                    str(tmp_path), str(INFLIGHT)], cwd=h.REPO_ROOT / "tests", env=env,
                                   capture_output=True, text=True, timeout=300)
            assert child.returncode == 0, child.stderr[-4000:]
            results[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        server.close()
    save, load = results["s3save"], results["s3load"]
    slack = 24 * MIB  # as the file bound's 16 MiB, and the S3 client's runtime (its threads, connections)
    parts = 2 * upload_concurrency(INFLIGHT) * PART_BYTES
    save_bound = 2 * INFLIGHT + parts + QUEUED_WRITES * MIB + slack
    load_bound = 2 * INFLIGHT + READ_THREADS * MIB + slack
    record_figure("object storage memory bound",
                  f"state {S3_STATE_BYTES // MIB} MiB float32 to and from s3:// (SeaweedFS), max_inflight_bytes "
                  f"{INFLIGHT // MIB} MiB, 1 MiB chunks: save RSS growth {save['growth'] / MIB:.1f} MiB (bound "
                  f"{save_bound // MIB}), load overhead beyond the {load['restored'] / MIB:.0f} MiB restored "
                  f"{(load['growth'] - load['restored']) / MIB:.1f} MiB (bound {load_bound // MIB})")
    assert load["restored"] == S3_STATE_BYTES
    assert save["growth"] <= save_bound < S3_STATE_BYTES // 2, save
    assert load["growth"] <= load["restored"] + load_bound, load


# ---------------------------------------------------------------------------------------------
# misuse


class _Custom:
    pass


class _Color(enum.IntEnum):
    RED = 1


class _TensorSubclass(torch.Tensor):
    pass


def _quiet(build: Callable[[], Any]) -> Callable[[], Any]:
    """Build a value whose constructor warns (sparse CSR, quantized and nested tensors are beta)."""
    def quietly() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build()
    return quietly


def _cycle_dict() -> Any:
    node: dict[str, Any] = {"x": torch.ones(1)}
    node["self"] = node
    return node


def _cycle_list() -> Any:
    node: list[Any] = [1]
    node.append([node])
    return node


def _deep(levels: int) -> Any:
    node: Any = torch.ones(1)
    for _ in range(levels):
        node = {"d": node}
    return node


# case -> (value at state["outer"]["inner"], exception, regex the message must match)
MISUSE: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "meta tensor": (lambda: torch.empty(3, device="meta"), TypeError, "meta device"),
    "sparse COO tensor": (lambda: torch.eye(3).to_sparse(), TypeError, r"layout torch\.sparse_coo.*to_dense"),
    "sparse CSR tensor": (_quiet(lambda: torch.eye(3).to_sparse_csr()), TypeError, r"layout torch\.sparse_csr"),
    "quantized tensor": (_quiet(lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)),
                         TypeError, "quantized"),
    "nested tensor": (_quiet(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])), TypeError,
                      "nested"),
    "tensor subclass": (lambda: torch.ones(2).as_subclass(_TensorSubclass), TypeError,
                        "tensor subclass _TensorSubclass"),
    "set": (lambda: {1, 2}, TypeError, "builtins.set"),
    "frozenset": (lambda: frozenset([1]), TypeError, "builtins.frozenset"),
    "custom class": (_Custom, TypeError, "_Custom"),
    "bytes": (lambda: b"abc", TypeError, "builtins.bytes"),
    "bytearray": (lambda: bytearray(b"abc"), TypeError, "builtins.bytearray"),
    "complex (Python)": (lambda: 1 + 2j, TypeError, "builtins.complex"),
    "Decimal": (lambda: decimal.Decimal("1.5"), TypeError, "decimal.Decimal"),
    "Fraction": (lambda: fractions.Fraction(1, 3), TypeError, "fractions.Fraction"),
    "range": (lambda: range(3), TypeError, "builtins.range"),
    "generator": (lambda: (i for i in range(3)), TypeError, "builtins.generator"),
    "namedtuple": (lambda: collections.namedtuple("Point", "x y")(1, 2), TypeError, "Point"),
    "torch.dtype": (lambda: torch.float32, TypeError, "torch.dtype"),
    "nn.Module (not its state_dict)": (lambda: torch.nn.Linear(2, 2), TypeError, "Linear"),
    "NumPy object array": (lambda: np.array([1, "a"], dtype=object), TypeError, "dtype object"),
    "NumPy datetime64 array": (lambda: np.array(["2024-01-01"], dtype="datetime64[D]"), TypeError,
                               "datetime64"),
    "NumPy structured array": (lambda: np.zeros(2, dtype=[("a", "<i4")]), TypeError, "dtype"),
    "dict key: tuple": (lambda: {(1, 2): 1}, TypeError, r"dict key \(1, 2\) of type tuple"),
    "dict key: bytes": (lambda: {b"k": 1}, TypeError, "dict key b'k' of type bytes"),
    "dict key: frozenset": (lambda: {frozenset(): 1}, TypeError, "of type frozenset"),
    "dict keys 1 and '1' (same key path)": (lambda: {1: torch.ones(1), "1": torch.ones(1)}, ValueError,
                                            "two entries map to the key 'outer/inner/1'"),
    "str with a lone surrogate": (lambda: "a\udcff", TypeError, "not valid Unicode"),
    "int over 4300 digits": (lambda: 10 ** 4300, ValueError, "more than 4300 decimal digits"),
    "dict containing itself": (_cycle_dict, TypeError,
                               r"reference cycle: the dict at 'outer/inner/self' is the one at 'outer/inner'"),
    "list containing itself": (_cycle_list, TypeError,
                               r"reference cycle: the list at 'outer/inner/1/0' is the one at 'outer/inner'"),
    "nesting 1000 deep": (lambda: _deep(1000), TypeError, r"nested deeper than 256 levels at 'outer/inner/d/d"),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_a_clear_error_naming_the_key_path(case: str, tmp_path: Path) -> None:
    build, error, pattern = MISUSE[case]
    path = tmp_path / "misuse.gdsckpt"
    with pytest.raises(error, match=pattern) as caught:
        gdsckpt.save({"outer": {"inner": build()}, "ok": torch.ones(3)}, path,
                     config=gdsckpt.Config(fsync=False))
    assert "'outer/inner" in str(caught.value), caught.value
    assert not isinstance(caught.value, RecursionError)
    assert list(tmp_path.iterdir()) == [], "a failed save leaves no file behind"
    record_figure(f"misuse | {case}", f"{type(caught.value).__name__}: {str(caught.value)[:140]}")


def test_cuda_tensor_on_another_device_than_the_load_device(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (this machine has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA)")
    tensor = torch.arange(8.0, device="cuda:1")  # pragma: no cover - GPU hosts only
    path = tmp_path / "cuda.gdsckpt"
    gdsckpt.save({"w": tensor}, path)
    back = gdsckpt.load(path, device="cuda:0")["w"]
    assert back.device == torch.device("cuda:0") and torch.equal(back.cpu(), tensor.cpu())


def _parameter_with_grad() -> Any:
    parameter = torch.nn.Parameter(torch.ones(3))
    parameter.grad = torch.full((3,), 2.0)
    return parameter


def _shared() -> Any:
    inner = {"w": 1}
    return {"a": inner, "b": inner}


# case -> (value, check of what load returns for it, what docs/reliability.md says)
DOCUMENTED: dict[str, tuple[Callable[[], Any], Callable[[Any, Any], bool], str]] = {
    "tensor that requires grad (not a leaf)": (
        lambda: torch.ones(3, requires_grad=True) * 2,
        lambda value, back: type(back) is torch.Tensor and not back.requires_grad and torch.equal(back, value),
        "saved; comes back detached (requires_grad=False)"),
    "nn.Parameter with .grad": (
        _parameter_with_grad,
        lambda value, back: isinstance(back, torch.nn.Parameter) and back.requires_grad and back.grad is None,
        "saved as a Parameter with requires_grad; .grad is not saved"),
    "IntEnum": (lambda: _Color.RED, lambda value, back: type(back) is int and back == 1, "comes back as int"),
    "defaultdict": (lambda: collections.defaultdict(int, a=1),
                    lambda value, back: type(back) is dict and back == {"a": 1}, "comes back as dict"),
    "numpy.str_": (lambda: np.str_("hi"), lambda value, back: type(back) is str and back == "hi",
                   "comes back as str"),
    "NumPy complex scalar": (lambda: np.complex128(1 + 2j),
                             lambda value, back: type(back) is np.complex128 and back == value,
                             "kept (a NumPy scalar)"),
    "None and 'None' keys": (lambda: {None: 1, "None": 2}, lambda value, back: back == value,
                             "both kept (distinct key types; 'None' is their common key path, used by no array)"),
    "one dict referenced twice": (_shared,
                                  lambda value, back: back == value and back["a"] is not back["b"],
                                  "saved twice; comes back as two equal dicts"),
    "nesting 256 deep": (lambda: _deep(254), lambda value, back: True, "kept (256 is the limit)"),
}


@pytest.mark.parametrize("case", list(DOCUMENTED))
def test_documented_behaviour_of_unusual_values(case: str, tmp_path: Path) -> None:
    build, check, behaviour = DOCUMENTED[case]
    value = build()
    path = tmp_path / "unusual.gdsckpt"
    gdsckpt.save({"outer": {"inner": value}}, path, config=gdsckpt.Config(fsync=False))
    back = gdsckpt.load(path, config=gdsckpt.Config(fsync=False))["outer"]["inner"]
    assert check(value, back), (case, back)
    record_figure(f"misuse | {case}", behaviour)


if __name__ == "__main__":
    if sys.argv[1] == "memory":
        _memory_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))


@pytest.mark.parametrize("how", ["load", "open"])
def test_a_load_whose_storage_hangs_fails_once_naming_the_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 how: str) -> None:
    """Fault injection: one chunk read of a real file hangs (the storage stops answering). The load
    (or ``Checkpoint.get``) fails with ``TimeoutError`` naming the chunk after its one wait;
    closing the reader (the checkpoint) does not wait a second timeout for the same read nor
    replace that error with its own (the reader keeps its file open while the read runs, as its
    ``close`` does after a timeout)."""
    import threading

    from gdsckpt.io.posix import PosixReader

    rng = np.random.default_rng(7)
    state = {"w": torch.from_numpy(rng.standard_normal(1 << 20).astype(np.float32))}
    path = tmp_path / "hung.gdsckpt"
    config = gdsckpt.Config(chunk_bytes="256KiB", timeout=0.3)
    gdsckpt.save(state, path, config=config)
    release = threading.Event()
    original = PosixReader._read_into
    hung: list[int] = []

    def read_into(self: PosixReader, fd: int, offset: int, out: np.ndarray) -> np.ndarray:
        if not hung and out.nbytes > 4096:  # the first chunk read, not the header or the index
            hung.append(offset)
            release.wait(30)
        return original(self, fd, offset, out)

    monkeypatch.setattr(PosixReader, "_read_into", read_into)
    try:
        with pytest.raises(TimeoutError, match=r"chunk \d+ \(tensor 'w'\) was not read and decoded within 0.3 s"):
            if how == "load":
                gdsckpt.load(path, config=config)
            else:
                with gdsckpt.open(path, config=config) as checkpoint:
                    checkpoint.get("w")
    finally:
        release.set()
    assert hung, "no chunk read was held"


def test_a_save_whose_codec_hangs_fails_once_naming_the_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: one chunk's compression never returns (a stuck codec thread). The save
    fails with ``TimeoutError`` naming the chunk after the driver's one wait; closing the CPU
    engine does not wait a second timeout for the stuck task nor replace that error with its own
    ("codec tasks still running"), and the file already at the path is kept."""
    import threading

    from gdsckpt.codecs.cpu import PlanesZstdCodec, ZstdCodec

    rng = np.random.default_rng(8)
    state = {"w": torch.from_numpy(rng.standard_normal(1 << 20).astype(np.float32))}
    path = tmp_path / "hung.gdsckpt"
    path.write_bytes(b"the previous checkpoint")
    release = threading.Event()
    stuck: list[int] = []

    def hang(original: Any) -> Any:
        def encode(self: Any, data: np.ndarray) -> Any:
            if not stuck:
                stuck.append(data.nbytes)
                release.wait(30)
            return original(self, data)
        return encode

    for codec in (ZstdCodec, PlanesZstdCodec):
        monkeypatch.setattr(codec, "encode", hang(codec.encode))
    config = gdsckpt.Config(chunk_bytes="256KiB", timeout=0.3, codec="zstd")
    try:
        with pytest.raises(TimeoutError, match=r"chunk \d+ \(of \d+ bytes\) was not encoded within 0.3 s"):
            gdsckpt.save(state, path, config=config)
    finally:
        release.set()
    assert stuck, "no chunk's compression was held"
    assert path.read_bytes() == b"the previous checkpoint"


def test_a_save_whose_fsync_hangs_fails_within_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the storage never completes the data file's fsync (an NFS server gone).
    The save fails with ``TimeoutError`` naming the fsync after ``Config.timeout``, while that
    fsync still runs, and the file already at the path is kept; before, the save waited for the
    fsync for ever (the docs bounded only waits on workers)."""
    import threading

    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    path = tmp_path / "hung.gdsckpt"
    path.write_bytes(b"the previous checkpoint")
    release = threading.Event()
    held: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if not held:  # the first: the data file's, before the rename
            held.append("running")
            release.wait(30)
            held.append("returned")
        real_fsync(fd)

    def open_on_temporaries() -> list[str]:
        """Descriptors of this process open on a temporary of ``path`` (deleted or not)."""
        names = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [name for name in names if ".gdsckpt-tmp-" in name]

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        with pytest.raises(TimeoutError, match=r"the fsync of .* did not complete within 0.3 s"):
            gdsckpt.save(state, path, config=gdsckpt.Config(timeout=0.3))
        assert held == ["running"], "the save waited for the fsync to return"
        assert open_on_temporaries(), "the running fsync's descriptor was closed under it"
    finally:
        release.set()
    assert path.read_bytes() == b"the previous checkpoint"
    # Once the fsync ends, the temporary's descriptors close (they stayed open for the process's
    # life, and the deleted file's storage with them).
    deadline = time.monotonic() + 10
    while open_on_temporaries() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not open_on_temporaries()


def test_closing_a_reader_after_a_failure_keeps_that_failure(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader closed by its ``with`` block after an error (a corrupt chunk found, say) while
    another of its reads hangs: the close times out waiting for that read (and keeps the file
    open), but the error raised is the block's, not the close's ``TimeoutError``."""
    import threading

    from gdsckpt.io.posix import PosixReader

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(1 << 16))
    release = threading.Event()
    original = PosixReader._read_into

    def read_into(self: PosixReader, fd: int, offset: int, out: np.ndarray) -> np.ndarray:
        release.wait(30)
        return original(self, fd, offset, out)

    monkeypatch.setattr(PosixReader, "_read_into", read_into)
    try:
        with (pytest.raises(gdsckpt.CorruptCheckpointError, match="chunk checksum mismatch"),
              PosixReader(path, timeout=0.2) as reader):
            reader.submit_read(0, np.empty(4096, dtype=np.uint8))
            raise gdsckpt.CorruptCheckpointError("chunk checksum mismatch")
        # without an error of its own, the block gets the close's
        with pytest.raises(TimeoutError, match="still running"), PosixReader(path, timeout=0.2) as reader:
            reader.submit_read(0, np.empty(4096, dtype=np.uint8))
    finally:
        release.set()


def _hanging_fsync(monkeypatch: pytest.MonkeyPatch, hangs: Callable[[int], bool]) -> Any:
    """Fault injection: ``os.fsync`` of a descriptor for which ``hangs(fd)`` holds blocks until
    the returned event is set (a storage that never completes it); others run as they are."""
    import threading

    release = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if hangs(fd):
            release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return release


def test_a_save_whose_directory_fsync_hangs_fails_within_the_timeout(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory's fsync after the rename (which makes the rename durable) ran unbounded:
    a storage that never completed it hung the save for ever. It now fails after
    ``Config.timeout`` with a ``TimeoutError`` saying the new file is in place (it is)."""
    import stat

    path = tmp_path / "hung.gdsckpt"
    state = {"w": torch.arange(1 << 12, dtype=torch.float32)}
    release = _hanging_fsync(monkeypatch, lambda fd: stat.S_ISDIR(os.fstat(fd).st_mode))
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"the fsync of directory .* \(after .*hung.gdsckpt.* was put in place\) "
                                               r"did not complete within 0.3 s"):
            gdsckpt.save(state, path, config=gdsckpt.Config(timeout=0.3))
        assert time.monotonic() - started < 10
    finally:
        release.set()
    assert torch.equal(gdsckpt.load(path)["w"], state["w"])


def test_a_manager_whose_pointer_fsync_hangs_fails_within_the_timeout(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``latest`` pointer's fsync ran unbounded: ``CheckpointManager.save`` (and a
    ``save_async`` handle's ``wait``) hung for ever on a storage that never completed it. It now
    fails after ``Config.timeout``; the checkpoint itself is complete, and ``latest`` still
    names the previous one."""
    from gdsckpt import CheckpointManager

    manager = CheckpointManager(tmp_path, keep_last=None, config=gdsckpt.Config(timeout=0.3))
    manager.save(1, {"w": torch.zeros(16)})

    def is_pointer_temporary(fd: int) -> bool:
        with contextlib.suppress(OSError):
            return ".latest.gdsckpt-tmp-" in os.readlink(f"/proc/self/fd/{fd}")
        return False

    release = _hanging_fsync(monkeypatch, is_pointer_temporary)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"the fsync of .*latest.* did not complete within 0.3 s"):
            manager.save(2, {"w": torch.ones(16)})
        with pytest.raises(TimeoutError, match=r"did not complete within 0.3 s"):
            manager.save_async(3, {"w": torch.full((16,), 3.0)}).wait(60)
        assert time.monotonic() - started < 10
    finally:
        release.set()
    assert (tmp_path / "latest").read_text().strip() == manager.path(1).name
    assert torch.equal(gdsckpt.load(manager.path(2))["w"], torch.ones(16))
    assert not list(tmp_path.glob(".latest*"))


def test_enum_dict_keys_save_and_load_as_their_values(tmp_path: Path) -> None:
    """A dict key that is a ``str`` enum member (``class Split(str, Enum)``) saved, and every load
    of the file then refused it as corrupt ("tensor 0 is keyed 'loader/Split.TRAIN' but sits at
    'loader/train'"): the index record's key came from ``str()`` of the member, the tree's from its
    value. ``restore_latest`` passed over that newest step as damaged and restored the one before.
    Keys are now stored, and keyed, as their plain value (``state.plain_key``), as an ``IntEnum``
    key already was: both come back as ``str`` / ``int``, and ``load_into`` a target keyed by the
    same members fills it."""
    import enum

    from gdsckpt import CheckpointManager

    class Split(str, enum.Enum):
        TRAIN = "train"

    class Slot(int, enum.Enum):
        FIRST = 7

    state = {"loader": {Split.TRAIN: torch.arange(4.0), Slot.FIRST: torch.ones(2)}, "step": 2}
    path = tmp_path / "enum.gdsckpt"
    gdsckpt.save(state, path)
    loaded = gdsckpt.load(path)
    assert set(loaded["loader"]) == {"train", 7}
    assert type(next(k for k in loaded["loader"] if isinstance(k, str))) is str
    assert torch.equal(loaded["loader"]["train"], torch.arange(4.0)) and torch.equal(loaded["loader"][7], torch.ones(2))
    target = {"loader": {Split.TRAIN: torch.zeros(4), Slot.FIRST: torch.zeros(2)}, "step": 0}
    gdsckpt.load_into(target, path, strict="exact")
    assert torch.equal(target["loader"][Split.TRAIN], torch.arange(4.0)) and target["step"] == 2

    manager = CheckpointManager(tmp_path / "run", keep_last=None)
    manager.save(1, {"loader": {"train": torch.zeros(4)}, "step": 1})
    manager.save(2, state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no checkpoint passed over as damaged
        step, extra = manager.restore_latest()
    assert step == 2 and extra["step"] == 2


def test_load_into_a_target_with_two_entries_for_one_key_is_refused(tmp_path: Path) -> None:
    """``load_into({1: a, "1": b}, ...)`` returned normally with ``a`` left unfilled, even with
    ``strict="exact"`` (both keys are the key string ``"1"``, which a save refuses). Such a target
    is now refused with the ``ValueError`` a save of it raises, and nothing is written."""
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"1": torch.ones(3), "v": {"1": 5}}, path)
    a, b = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="two entries of the load_into target map to the key '1'"):
        gdsckpt.load_into({1: a, "1": b}, path, strict="exact")
    with pytest.raises(ValueError, match="two entries of the load_into target map to the key 'v/1'"):
        gdsckpt.load_into({"1": a, "v": {1: 0, "1": 0}}, path)
    assert torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.zeros(3))
