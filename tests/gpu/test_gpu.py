"""GPU suite: real nvCOMP, kvikio and CUDA on a GPU host (skipped where CUDA is absent).

Run on a GPU host with:  python3 -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt
from gdsckpt.demo import bit_equal, train_steps, training_state

GPU_CODECS = ["ans", "zstd", "lz4", "deflate", "gdeflate", "snappy", "bitcomp", "cascaded", "none"]
PORTABLE = ["zstd", "lz4", "deflate", "none"]
ZSTD_BUDGET = 2 << 30
"""A staging budget that holds nvCOMP Zstd's compression scratch (about 1.1 GiB)."""
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def _state(device: str = "cuda") -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    state: dict = {"weights": {}, "small": [], "meta": {"step": 7, "lr": 1e-3, "name": "x"}}
    for dtype in DTYPES:
        base = torch.randn(300, 257, generator=g) * 0.02
        if dtype == torch.bool:
            t = base > 0
        elif dtype.is_floating_point or dtype.is_complex:
            t = base.to(dtype)
        else:
            t = (base * 1000).to(dtype)
        state["weights"][str(dtype)] = t.to(device)
    nan = torch.tensor([0x7FC0_1234, 0x8000_0000, 0xFF80_0000], dtype=torch.int64).to(torch.int32)
    state["weights"]["nan_payloads"] = nan.view(torch.float32).to(device)
    state["weights"]["transposed"] = state["weights"]["torch.float32"].t()
    state["small"] = [torch.arange(i + 1, dtype=torch.float32, device=device) for i in range(50)]
    state["zero"] = torch.empty(0, 5, device=device)
    state["scalar"] = torch.tensor(3.5, device=device)
    return state


def _assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert bit_equal(a, b), f"{a.dtype} {tuple(a.shape)}"
    else:
        assert a == b


def test_gpu_crc32c_matches_cpu():
    import cupy

    from gdsckpt.codecs.nvcomp_c import crc32c_batch
    from gdsckpt.format import checksum

    rng = np.random.default_rng(1)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 7, 4096, 65537, (4 << 20) + 3)]
    stream = cupy.cuda.Stream(non_blocking=True)
    got = crc32c_batch([cupy.asarray(b) for b in buffers], stream)
    assert [int(x) for x in got] == [checksum(b) for b in buffers]


@pytest.mark.parametrize("data_type", [None, "<f2", "<f4"])
def test_ans_through_the_c_api_matches_the_python_api(data_type):
    """``nvcomp_c.AnsCodec`` (the C API) and ``nvcomp.DeviceCodec`` (the Python API) on the same
    chunks: each decodes the other's streams bit-exact and the stream sizes agree within 0.5 %;
    a stream of garbage is never taken for the chunk (undecodable, or decoded to another size)."""
    import cupy

    from gdsckpt.codecs.nvcomp import DeviceCodec, reports_undecodable
    from gdsckpt.codecs.nvcomp_c import AnsCodec

    g = torch.Generator(device="cpu").manual_seed(11)
    values = (torch.randn(3 << 19, generator=g) * 0.02)
    raw = values.to(torch.bfloat16) if data_type == "<f2" else values
    host = raw.view(torch.uint8).numpy()
    pieces = [cupy.asarray(host[:1 << 20]), cupy.asarray(host[1 << 20:(1 << 20) + 65536])]
    stream = cupy.cuda.Stream(non_blocking=True)
    ours = AnsCodec(stream=stream, device_id=0, data_type=data_type)
    theirs = DeviceCodec("ans", stream=stream, device_id=0, data_type=data_type)
    try:
        assert ours.stage() == theirs.stage()
        room = max(ours.max_compressed_bytes(p) for p in pieces)
        room += -room % 4096
        streams = {}
        for name, codec in (("c", ours), ("python", theirs)):
            out = cupy.zeros(2 * room, dtype=cupy.uint8)
            with stream:
                sizes = codec.encode_into(pieces, out, [0, room], room)
            stream.synchronize()
            streams[name] = [out[i * room:i * room + size] for i, size in enumerate(sizes)]
        for a, b in zip(streams["c"], streams["python"]):
            assert abs(a.nbytes - b.nbytes) <= 0.005 * b.nbytes, (a.nbytes, b.nbytes)
        for writer, reader in (("c", theirs), ("python", ours), ("c", ours)):
            out = cupy.zeros(2 * (1 << 20), dtype=cupy.uint8)
            with stream:
                got = reader.decode_into(streams[writer], out, [0, 1 << 20], [p.nbytes for p in pieces])
            stream.synchronize()
            assert got == [p.nbytes for p in pieces]
            for i, p in enumerate(pieces):
                assert cupy.asnumpy(out[i << 20:(i << 20) + p.nbytes]).tobytes() == cupy.asnumpy(p).tobytes()
        garbage = cupy.full(4096, 0xFF, dtype=cupy.uint8)
        try:
            with stream:
                got = ours.decode_into([garbage], cupy.zeros(1 << 20, dtype=cupy.uint8), [0], [1 << 20])
        except RuntimeError as err:
            assert reports_undecodable(err), str(err)
        else:
            assert got != [1 << 20]  # the decoder's size check then calls it damage
    finally:
        ours.close()
        theirs.close()


def test_verified_ans_decode_checks_gates_and_decodes_in_one_queued_batch():
    """The C API path: intact ANS streams of three data types decode bit-exact in one batch; a
    stream whose checksum fails is not decoded (its output keeps its sentinel bytes); a stream
    of garbage whose expected checksum is its own gets nvCOMP's error status; a stored chunk is
    only checksummed; the device stays usable afterwards."""
    import cupy

    from gdsckpt.codecs.device import CudaDevice
    from gdsckpt.format import checksum

    device = CudaDevice(0)
    try:
        g = torch.Generator(device="cpu").manual_seed(3)
        raws = [(torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8),
                torch.randn(300_001, generator=g).view(torch.uint8),
                torch.randint(0, 7, (777_777,), generator=g, dtype=torch.uint8)]
        data_types = ["<f2", "<f4", "|u1"]
        bodies, expected = [], []
        for raw, data_type in zip(raws, data_types):
            codec = device.codec("ans", data_type)
            source = cupy.asarray(raw.cuda())
            room = codec.max_compressed_bytes(source)
            out = cupy.empty(room + 4096, dtype=cupy.uint8)
            with device.on_stream():
                size = codec.encode_into([source], out, [0], room)[0]
            device.synchronize()
            bodies.append(out[:size])
            expected.append(checksum(cupy.asnumpy(out[:size])))
        damaged = bodies[0].copy()
        damaged[5] ^= 1
        garbage = cupy.full(bodies[1].nbytes, 0xFF, dtype=cupy.uint8)
        stored = cupy.asarray(raws[2].numpy()[:4099].copy())
        all_bodies = [*bodies, damaged, garbage, stored]
        all_expected = [*expected, expected[0], checksum(np.full(garbage.nbytes, 0xFF, np.uint8)),
                        checksum(raws[2].numpy()[:4099])]
        outputs = [cupy.full(r.numel(), 0xA5, dtype=cupy.uint8) for r in raws]
        outputs += [cupy.full(raws[0].numel(), 0xA5, dtype=cupy.uint8),
                    cupy.full(raws[1].numel(), 0xA5, dtype=cupy.uint8), None]
        with device.on_stream():
            checked = device.verified_ans_decode(all_bodies, all_expected, outputs)
        device.synchronize()
        raw_sizes = [r.numel() for r in raws] + [raws[0].numel(), raws[1].numel(), 4099]
        problems = [checked.problem(i, crc, n) for i, (crc, n) in enumerate(zip(all_expected, raw_sizes))]
        assert problems[:3] == [None, None, None] and problems[5] is None
        assert problems[3] == "chunk checksum mismatch"
        assert problems[4] is not None and problems[4].startswith("chunk does not decode")
        for raw, out in zip(raws, outputs):
            assert cupy.asnumpy(out).tobytes() == raw.numpy().tobytes()
        assert bool((outputs[3] == 0xA5).all())
        assert float(cupy.asarray(torch.ones(4, device="cuda")).sum()) == 4.0
    finally:
        device.close()


@pytest.mark.parametrize("codec", ["zstd", "lz4", "deflate"])
def test_nvcomp_raw_streams_interoperate_with_cpu_libraries(codec):
    import cupy

    from gdsckpt.codecs import host_codec
    from gdsckpt.codecs.nvcomp import DeviceCodec

    data = (np.random.default_rng(2).standard_normal(1 << 20).astype(np.float16)).view(np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    gpu = DeviceCodec(codec, stream=stream, device_id=0)
    cpu = host_codec(codec)
    device_data = cupy.asarray(data)
    out = cupy.zeros(gpu.max_compressed_bytes(device_data), dtype=cupy.uint8)
    (size,) = gpu.encode_into([device_data], out, [0], out.nbytes)
    on_gpu = out[:size].get(stream=stream)
    stream.synchronize()
    assert bytes(cpu.decode(on_gpu.tobytes(), data.nbytes)) == data.tobytes()
    from_cpu = np.frombuffer(bytes(cpu.encode(data)), dtype=np.uint8)
    decoded = cupy.zeros(data.nbytes, dtype=cupy.uint8)
    (got,) = gpu.decode_into([cupy.asarray(from_cpu)], decoded, [0], [data.nbytes])
    stream.synchronize()
    gpu.close()
    assert got == data.nbytes and decoded.get().tobytes() == data.tobytes()


@pytest.mark.parametrize("codec", GPU_CODECS)
def test_gpu_round_trip_every_codec(tmp_path, codec):
    state = _state()
    path = tmp_path / f"{codec}.gdsckpt"
    # zstd, lz4, deflate: nvCOMP too; nvCOMP's Zstd holds ~1.1 GiB of scratch, beyond the default budget
    config = gdsckpt.Config(pack_below=16 << 10, engine="gpu", max_staging_bytes=ZSTD_BUDGET)
    report = gdsckpt.save(state, path, codec=codec, chunk_bytes=64 << 10, config=config)
    assert report.chunks > 10
    assert report.engine == "gpu" and report.backend.startswith("kvikio-")
    _assert_same(state, gdsckpt.load(path, device="cuda"))
    on_host = gdsckpt.load(path)  # decoded on the GPU when the codec needs it, delivered to the CPU
    assert on_host["weights"]["torch.float32"].device.type == "cpu"
    _assert_same(state, on_host)
    gdsckpt.verify(path)


@pytest.mark.parametrize("engine", ["auto", "gpu"])
@pytest.mark.parametrize("codec", PORTABLE)
def test_gpu_written_portable_codecs_load_on_cpu_engine(tmp_path, codec, engine):
    """A portable codec named for CUDA state runs the CPU engine (``none``: kvikio writes the raw
    bytes), or nvCOMP with ``engine="gpu"``; either file loads on the CPU engine."""
    state = _state()
    path = tmp_path / "g.gdsckpt"
    report = gdsckpt.save(state, path, codec=codec, chunk_bytes=64 << 10,
                          config=gdsckpt.Config(engine=engine, max_staging_bytes=ZSTD_BUDGET))
    assert report.engine == ("gpu" if engine == "gpu" or codec == "none" else "cpu"), report
    cpu = gdsckpt.load(path, config=gdsckpt.Config(engine="cpu"))
    _assert_same(state, cpu)


@pytest.mark.parametrize("engine", ["auto", "gpu"])
def test_portable_save_of_cuda_state(tmp_path, engine):
    """``portable=True`` on CUDA state: the CPU engine compresses it (``engine="auto"``) or nvCOMP
    does (``engine="gpu"``: its LZ4 under the default budget, which cannot hold Zstd's scratch);
    either file is portable and loads bit-exact on both engines."""
    state = _state()
    path = tmp_path / "p.gdsckpt"
    report = gdsckpt.save(state, path, portable=True, config=gdsckpt.Config(engine=engine, gpu_chunk_bytes=4 << 20))
    assert report.engine == ("cpu" if engine == "auto" else "gpu")
    assert report.codec == ("zstd" if engine == "auto" else "lz4"), report.auto
    assert report.auto["engine"] == report.engine and report.auto["engine_reason"]
    assert gdsckpt.inspect(path).portable
    _assert_same(state, gdsckpt.load(path, device="cuda"))
    _assert_same(state, gdsckpt.load(path, config=gdsckpt.Config(engine="cpu")))
    with pytest.raises(ValueError, match="no CPU decoder"):
        gdsckpt.save(state, tmp_path / "q.gdsckpt", codec="ans", portable=True)


@pytest.mark.parametrize("codec", PORTABLE)
def test_cpu_written_checkpoint_loads_on_gpu(tmp_path, codec):
    state = _state("cpu")
    path = tmp_path / "c.gdsckpt"
    report = gdsckpt.save(state, path, codec=codec, config=gdsckpt.Config(engine="cpu", chunk_bytes=64 << 10))
    assert report.engine == "cpu"
    _assert_same(_state("cuda"), gdsckpt.load(path, device="cuda"))


def test_gpu_only_codec_needs_gpu_on_cpu_engine(tmp_path):
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save(_state(), path, codec="ans")
    with pytest.raises(gdsckpt.CodecUnavailableError, match="zstd"):
        gdsckpt.load(path, config=gdsckpt.Config(engine="cpu"))


def test_gpu_flipped_byte_names_tensor_and_chunk(tmp_path):
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save({"w": torch.randn(1 << 16, device="cuda")}, path, codec="ans")
    with gdsckpt.open(path) as ckpt:
        assert ckpt.keys() == ["w"]
    with open(path, "r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="'w'") as info:
        gdsckpt.load(path, device="cuda")
    assert info.value.chunk == 0


def test_gpu_load_into_training_continues_identically(tmp_path):
    model, opt = training_state(width=64, depth=2, steps=3, device="cuda")
    path = tmp_path / "m.gdsckpt"
    gdsckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    fresh, _ = training_state(width=64, depth=2, steps=0, device="cuda", seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    gdsckpt.load_into({"model": fresh, "optimizer": fresh_opt}, path)
    train_steps(model, opt, 3, seed=9)
    train_steps(fresh, fresh_opt, 3, seed=9)
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert bit_equal(a, b), k


def test_cupy_arrays_round_trip(tmp_path):
    import cupy

    state = {"a": cupy.arange(100000, dtype=cupy.float32) * 0.5, "b": cupy.zeros((3, 0))}
    path = tmp_path / "cp.gdsckpt"
    gdsckpt.save(state, path)
    back = gdsckpt.load(path)
    assert isinstance(back["a"], cupy.ndarray) and bool((back["a"] == state["a"]).all())
    assert back["b"].shape == (3, 0)


@pytest.mark.skipif(os.environ.get("GDSCKPT_TEST_JAX") != "1", reason="set GDSCKPT_TEST_JAX=1 to test JAX")
def test_jax_arrays_round_trip(tmp_path):
    jax = pytest.importorskip("jax")
    state = {"x": jax.numpy.arange(1000, dtype=jax.numpy.float32)}
    path = tmp_path / "j.gdsckpt"
    gdsckpt.save(state, path)
    back = gdsckpt.load(path)
    assert isinstance(back["x"], jax.Array)
    assert bool((np.asarray(back["x"]) == np.asarray(state["x"])).all())


def test_auto_codec_chooses_by_storage_speed_and_sampled_ratio(tmp_path):
    # Under the default 1 GiB staging budget Zstd's scratch leaves no batch: ANS, nothing measured.
    default = gdsckpt.save(_state(), tmp_path / "d.gdsckpt")
    assert default.codec == "ans" and default.auto["chose"] == "ans" and set(default.auto["left_out"]) == {"zstd"}
    assert default.auto["storage_gbps"] is None and default.auto["sampled_ratios"] == {}
    roomy = gdsckpt.Config(max_staging_bytes=4 << 30)
    report = gdsckpt.save(_state(), tmp_path / "a.gdsckpt", config=roomy)
    assert report.codec in ("ans", "zstd") and report.auto["chose"] == report.codec
    assert report.auto["storage_gbps"] > 0 and set(report.auto["sampled_ratios"]) == {"ans", "zstd"}
    fast = gdsckpt.save(_state(), tmp_path / "b.gdsckpt", config=roomy.replace(storage_gbps=1000.0))
    assert fast.codec == "ans"  # no storage is slow enough for zstd's 8 GB/s to win
    _assert_same(_state(), gdsckpt.load(tmp_path / "a.gdsckpt", device="cuda"))
    _assert_same(_state(), gdsckpt.load(tmp_path / "d.gdsckpt", device="cuda"))


@pytest.mark.parametrize(("storage", "engine"), [(1.0, "cpu"), (1000.0, "gpu")])
def test_auto_weighs_the_portable_cpu_engine_against_the_gpu(tmp_path, monkeypatch, storage, engine):
    """``codec="auto"`` on CUDA state above ``WEIGH_MIN_BYTES`` (lowered here): on storage of 1 GB/s
    both engines are held by the disk and the portable CPU engine is taken; at 1000 GB/s only
    the GPU keeps up. The figures behind the choice are in the report."""
    from gdsckpt.api import saving

    monkeypatch.setattr(saving, "WEIGH_MIN_BYTES", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(9)
    state = {"w": torch.randn(1 << 21, device="cuda", generator=g) * 0.02,
             "h": (torch.randn(1 << 21, device="cuda", generator=g) * 0.02).to(torch.bfloat16)}
    path = tmp_path / "w.gdsckpt"
    report = gdsckpt.save(state, path, config=gdsckpt.Config(storage_gbps=storage))
    assert report.engine == engine and report.auto["engine"] == engine, report.auto
    if engine == "cpu":
        predicted = report.auto["predicted_gbps"]
        assert set(predicted) == {"gpu:ans", "cpu:zstd"} and all(v > 0 for v in predicted.values())
        assert report.auto["cpu_threads"] > 0 and report.auto["cpu_ratio"] > 1.0
        assert report.auto["gpu_codec"] == "ans"
    else:  # no pace the CPU engine has could reach the GPU's speed there: it is not measured
        assert "predicted_gbps" not in report.auto and "could not reach" in report.auto["engine_reason"]
    assert report.auto["chose"] == report.codec
    assert gdsckpt.inspect(path).portable == (engine == "cpu")
    _assert_same(state, gdsckpt.load(path, device="cuda"))
    small = gdsckpt.save({"w": state["w"][:1000]}, tmp_path / "s.gdsckpt", config=gdsckpt.Config(storage_gbps=storage))
    assert small.engine == "gpu" and "predicted_gbps" not in small.auto  # below the bound: not weighed


_ALLOCATOR_CHILD = """
import torch, gdsckpt
from gdsckpt.demo import bit_equal
state = {"w": torch.randn(1 << 22, device="cuda").to(torch.bfloat16), "b": torch.randn(1000, device="cuda")}
for codec in ("ans", "zstd"):
    gdsckpt.save(state, f"{DIR}/{codec}.gdsckpt", codec=codec)
    back = gdsckpt.load(f"{DIR}/{codec}.gdsckpt", device="cuda")
    assert all(bit_equal(state[k], back[k]) for k in state)
from gdsckpt.codecs.nvcomp import nvcomp_allocator_installed
assert nvcomp_allocator_installed()
print("ok")
"""


def test_nvcomp_allocator_routing_exits_cleanly(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, GDSCKPT_NVCOMP_ALLOCATOR="1")
    done = subprocess.run([sys.executable, "-c", _ALLOCATOR_CHILD.replace("{DIR}", str(tmp_path))],
                          check=False, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_gpu_byte_plane_trial_keeps_the_smaller_form(tmp_path, codec):
    """``byte_planes="auto"`` on the GPU engine codes a sample both ways and keeps the smaller:
    its file is never meaningfully larger than forcing either form, and for bf16 weights (where
    planes separate the predictable high bytes) it takes planes."""
    g = torch.Generator(device="cuda").manual_seed(5)
    state = {"w": (torch.randn(6 << 20, device="cuda", generator=g) * 0.02).to(torch.bfloat16)}
    sizes = {}
    for planes in ("auto", "always", "never"):
        config = gdsckpt.Config(byte_planes=planes, engine="gpu", max_staging_bytes=ZSTD_BUDGET)
        report = gdsckpt.save(state, tmp_path / f"{planes}.gdsckpt", codec=codec, config=config)
        sizes[planes] = report.file_bytes
        assert bit_equal(gdsckpt.load(tmp_path / f"{planes}.gdsckpt", device="cuda")["w"].cpu(), state["w"].cpu())
    assert sizes["auto"] <= 1.01 * min(sizes["always"], sizes["never"]), sizes
    codecs = gdsckpt.inspect(tmp_path / "auto.gdsckpt").tensors[0].codecs
    assert any("byteplanes" in c for c in codecs) == (sizes["always"] < sizes["never"]), (codecs, sizes)


def test_gpu_only_file_loads_into_host_memory_through_the_pinned_bounce(tmp_path, monkeypatch):
    # Several bounce rounds per batch: the bounce is smaller than a batch of chunks.
    from gdsckpt.pipeline.gpu import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "HOST_BOUNCE_BYTES", 1 << 20)
    state = _state()
    state["big"] = torch.randn(3 << 20, device="cuda").bfloat16()  # 6 MiB: several chunks
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, path, codec="ans", chunk_bytes=1 << 20)
    on_host = gdsckpt.load(path, device="cpu")
    assert on_host["big"].device.type == "cpu"
    _assert_same(state, on_host)
    template = gdsckpt.load(path, device="cpu")  # a CPU model to restore into
    for tensor in [*template["weights"].values(), template["big"]]:
        tensor.zero_()
    gdsckpt.load_into(template, path)
    _assert_same(state, template)


def test_restore_from_the_pinned_null_source_and_a_staging_budget_from_free_memory(tmp_path):
    from gdsckpt.io import PreloadedReader
    from gdsckpt.pipeline.gpu import GpuDecoder

    state = _state()
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, path, codec="ans")
    reader = PreloadedReader(path, pinned=True)
    for _ in range(2):
        _assert_same(state, gdsckpt.load(reader, device="cuda"))
    free, _total = torch.cuda.mem_get_info()
    decoder = GpuDecoder(device_id=0, max_staging_bytes=1 << 20)
    try:
        # a quarter of the free memory (measured just before), within the 8 GiB cap
        assert 1 << 20 <= decoder.max_staging_bytes <= 8 << 30
        assert decoder.max_staging_bytes >= min(8 << 30, free // 4) * 0.9
    finally:
        decoder.close()


@pytest.mark.parametrize("width", [2, 4, 8])
def test_device_byte_planes_kernel_matches_the_cpu_reference(width):
    import cupy

    from gdsckpt.codecs.cpu import planes_forward_reference, planes_inverse_reference
    from gdsckpt.codecs.device import planes_forward_into, planes_inverse_into

    host = np.random.default_rng(width).integers(0, 256, size=width * 100_003 + 2 * width, dtype=np.uint8)
    on_device = cupy.asarray(host)
    for start in (0, 1, width):  # aligned (the kernel) and misaligned (the array-API fallback)
        data = host[start:start + width * 100_003]
        device = on_device[start:start + width * 100_003]
        planes = planes_forward_into(device, cupy.empty(data.nbytes + 16, dtype=cupy.uint8), width)
        assert planes.get().tobytes() == planes_forward_reference(data, width).tobytes()
        back = planes_inverse_into(planes, cupy.empty(data.nbytes, dtype=cupy.uint8), width)
        assert back.get().tobytes() == data.tobytes()
        assert planes_inverse_reference(planes.get(), width).tobytes() == data.tobytes()


def test_load_into_waits_for_work_queued_on_torchs_stream_before_it(tmp_path):
    """A kernel queued on torch's current stream before ``load_into`` (a long sleep, then a fill of
    the destination) has run before the restore writes the destination: the tensor ends up with
    the checkpoint's values, not the fill's (the decoder's own stream does not wait for torch's
    by itself)."""
    saved = {"w": (torch.randn(4 << 20, generator=torch.Generator().manual_seed(3)) * 0.02).cuda()}
    path = tmp_path / "w.gdsckpt"
    gdsckpt.save(saved, path, config=gdsckpt.Config(engine="gpu"))
    target = {"w": torch.zeros(4 << 20, device="cuda")}
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of the GPU's clock, on torch's stream
    target["w"].fill_(7.0)  # queued behind the sleep
    gdsckpt.load_into(target, path)
    torch.cuda.synchronize()
    assert bit_equal(target["w"], saved["w"])



def test_gpu_save_waits_for_work_queued_on_torchs_current_stream(tmp_path):
    """A GPU save of a multi-chunk tensor while a side stream is torch's current one, with a long
    sleep and then a fill queued there: the file holds the filled values in every chunk. The
    encoder imports a contiguous tensor into CuPy once and reads each chunk as a slice of it,
    so the ordering rests on the save's synchronization, not on an event per chunk."""
    tensor = torch.zeros(12 << 20, device="cuda")  # 48 MiB: three 16 MiB chunks
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        tensor.fill_(7.0)
        gdsckpt.save({"t": tensor}, tmp_path / "t.gdsckpt", config=gdsckpt.Config(engine="gpu"))
    back = gdsckpt.load(tmp_path / "t.gdsckpt", device="cpu")["t"]
    assert bool((back == 7.0).all())


@pytest.mark.parametrize("config", [{}, {"engine": "cpu"}], ids=["zstd-routed-to-cpu", "engine-cpu"])
def test_cpu_engine_save_of_cuda_state_waits_for_work_on_the_callers_side_stream(tmp_path, config):
    """The CPU engine reads CUDA tensors with ``.cpu()`` on its threads' default streams: a fill
    queued behind a sleep on the caller's side stream used to be missed (stale bytes, valid
    checksums). The save now synchronizes every GPU the arrays are on, whichever engine runs."""
    tensor = torch.zeros(12 << 20, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        tensor.fill_(7.0)
        report = gdsckpt.save({"t": tensor}, tmp_path / "t.gdsckpt", codec="zstd", config=gdsckpt.Config(**config))
    assert report.engine == "cpu"
    assert bool((gdsckpt.load(tmp_path / "t.gdsckpt", device="cpu")["t"] == 7.0).all())


@pytest.mark.parametrize("engine", ["cpu", "auto"])
def test_load_into_cuda_targets_waits_for_work_on_the_callers_side_stream(tmp_path, engine):
    """Work queued on the targets on the caller's side stream (a fill behind a sleep, as an
    optimizer step before a rollback) lands before the restore writes them, not after."""
    saved = torch.randn(4 << 20)
    gdsckpt.save({"w": saved}, tmp_path / "w.gdsckpt", codec="zstd")
    target = {"w": torch.zeros(4 << 20, device="cuda")}
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        target["w"].fill_(-1.0)
        gdsckpt.load_into(target, tmp_path / "w.gdsckpt", config=gdsckpt.Config(engine=engine))
    torch.cuda.synchronize()
    assert bit_equal(target["w"].cpu(), saved)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("size", [1000, 4 << 20], ids=["small-packed", "large"])
def test_gpu_save_of_state_on_two_gpus_reads_the_second_after_its_queued_work(tmp_path, size):
    """State on cuda:0 and cuda:1 (a model split by hand): the GPU engine compresses on cuda:0
    and reads cuda:1's arrays through host memory, after cuda:1's queued work."""
    state = {"a": torch.ones(1024, device="cuda:0"), "b": [torch.zeros(size, device="cuda:1") for _ in range(8)]}
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        torch.cuda._sleep(1_000_000_000)
        for tensor in state["b"]:
            tensor.fill_(7.0)
    gdsckpt.save(state, tmp_path / "s.gdsckpt", codec="ans", config=gdsckpt.Config(engine="gpu"))
    back = gdsckpt.load(tmp_path / "s.gdsckpt", device="cpu")
    assert all(bool((tensor == 7.0).all()) for tensor in back["b"])
    assert bool((back["a"] == 1.0).all())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_load_into_targets_on_two_gpus_waits_for_each_gpus_queued_work(tmp_path):
    g = torch.Generator().manual_seed(0)
    saved = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(4 << 20, generator=g)}
    gdsckpt.save({k: v.cuda(0) for k, v in saved.items()}, tmp_path / "w.gdsckpt", codec="ans")
    target = {"a": torch.zeros(1 << 20, device="cuda:0"), "b": torch.zeros(4 << 20, device="cuda:1")}
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        torch.cuda._sleep(1_000_000_000)
        target["b"].fill_(-1.0)
    gdsckpt.load_into(target, tmp_path / "w.gdsckpt")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert bit_equal(target["a"].cpu(), saved["a"]) and bit_equal(target["b"].cpu(), saved["b"])


def test_gpu_source_ranges_are_views_of_one_import_of_the_tensor():
    """``TorchSource.device_bytes`` of a contiguous CUDA tensor: every range aliases the tensor's
    memory at its offset (no copy) and holds its bytes; a non-contiguous tensor's range is a
    copy with the right bytes."""
    from gdsckpt.state.arrays import TorchSource

    tensor = torch.randn(3, 1 << 20, device="cuda")
    source = TorchSource(tensor, "float32")
    expected = tensor.reshape(-1).view(torch.uint8).cpu().numpy()
    for start, stop in ((0, 4096), (8 << 20, (8 << 20) + 12), (source.nbytes - 4, source.nbytes)):
        part = source.device_bytes(start, stop)
        assert int(part.data.ptr) == tensor.data_ptr() + start
        assert np.array_equal(part.get(), expected[start:stop])
    transposed = TorchSource(tensor.t(), "float32")
    wanted = tensor.t().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    part = transposed.device_bytes(40, 4000)
    assert int(part.data.ptr) != tensor.data_ptr() + 40
    assert np.array_equal(part.get(), wanted[40:4000])


_CUPY_ONLY_CHILD = """
import sys
import cupy, numpy as np, gdsckpt
spin = cupy.RawKernel(r'''
extern "C" __global__ void spin_then_fill(float* out, long long n, long long cycles, float value) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = value;
}''', "spin_then_fill")
n = 1 << 22
array = cupy.zeros(n, dtype=cupy.float32)
cupy.cuda.Device().synchronize()
spin((64,), (256,), (array, np.int64(n), np.int64(1_000_000_000), np.float32(7.0)))  # on CuPy's current stream
gdsckpt.save({"a": array}, "{DIR}/a.gdsckpt", codec="ans", config=gdsckpt.Config(engine="gpu"))
assert "torch" not in sys.modules, "torch was imported: this child tests a process without it"
back = gdsckpt.load("{DIR}/a.gdsckpt")
assert bool((back["a"] == 7.0).all()), "the save read the array before the kernel queued before it had run"
print("ok")
"""


def test_a_cupy_save_without_torch_waits_for_work_queued_before_it(tmp_path):
    """In a process without torch, a GPU save of a CuPy array waits for the kernel queued on
    CuPy's current stream before it (a long spin, then a fill): the file holds the filled values.
    The encoder's own stream is non-blocking and would not wait by itself."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CUPY_ONLY_CHILD.replace("{DIR}", str(tmp_path))],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("codec", ["ans", "zstd", "none"])
def test_gpu_restore_reads_runs_of_chunks_with_one_kvikio_call(tmp_path, monkeypatch, codec):
    """A GPU restore reads consecutive chunks into its read arena with one kvikio ``pread`` per
    piece (``pipeline.gpu.staging.GROUP_READ_BYTES``), bit-exact, and a byte flipped in a chunk
    read that way still names that chunk."""
    from gdsckpt.io.kvikio import KvikioReader

    calls = []
    submit = KvikioReader.submit_read

    def counted(self, offset, out):
        calls.append((offset, out.nbytes))
        return submit(self, offset, out)

    monkeypatch.setattr(KvikioReader, "submit_read", counted)
    state = _state()
    state["big"] = torch.randn(40 << 20, device="cuda") * 0.02  # 160 MiB: tens of chunks
    state["big"][:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, path, codec=codec)
    with gdsckpt.open(path) as ckpt:
        chunks = len(ckpt._opened.index.chunks)
    calls.clear()
    _assert_same(gdsckpt.load(path, device="cuda"), state)
    assert 1 <= len(calls) < chunks / 2, (len(calls), chunks)
    with gdsckpt.open(path) as ckpt:
        victim = ckpt._opened.index.chunks[len(ckpt._opened.index.chunks) // 2]
    with open(path, "r+b") as f:
        f.seek(victim.offset + victim.stored // 2)
        byte = f.read(1)
        f.seek(victim.offset + victim.stored // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(gdsckpt.CorruptCheckpointError) as info:
        gdsckpt.load(path, device="cuda")
    assert info.value.chunk == chunks // 2


def test_gpu_load_reads_ahead_while_the_index_is_parsed(tmp_path, monkeypatch):
    """``load(device="cuda")`` (and ``load_into`` CUDA tensors) of a local file starts reading the
    data region into the read arena's first pieces before it parses the index
    (``api.resolve.lead_read``): a file that fits the lead needs no read after the index, and loads
    bit-exact; a partial load reads no lead; a lead piece
    whose read fails (EIO, once) only makes its chunks be read again on their own."""
    from concurrent.futures import Future

    from gdsckpt.api import in_place, reading
    from gdsckpt.format import HEADER_REGION, TRAILER_SIZE
    from gdsckpt.io import PreloadedReader
    from gdsckpt.io.kvikio import KvikioReader
    from gdsckpt.pipeline.gpu.staging import GROUP_READ_BYTES

    events = []
    failing = []
    submit = KvikioReader.submit_read
    open_checked = reading.open_checked

    def counted(self, offset, out):
        events.append(("read", offset, out.nbytes))
        if failing and offset == failing[0]:
            failing.clear()
            failed = Future()
            failed.set_exception(OSError(5, "Input/output error (injected)"))
            return failed
        return submit(self, offset, out)

    def marked(reader):
        events.append(("index",))
        return open_checked(reader)

    monkeypatch.setattr(KvikioReader, "submit_read", counted)
    monkeypatch.setattr(reading, "open_checked", marked)
    monkeypatch.setattr(in_place, "open_checked", marked)
    state = _state()
    state["big"] = torch.randn(60 << 20, device="cuda") * 0.02  # 240 MiB: a few lead pieces
    state["big"][:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    path = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, path, codec="ans")
    size = path.stat().st_size
    assert size - HEADER_REGION - TRAILER_SIZE <= 8 * GROUP_READ_BYTES  # the lead holds it all
    with gdsckpt.open(path) as ckpt:
        chunks = list(ckpt._opened.index.chunks)

    events.clear()
    _assert_same(gdsckpt.load(path, device="cuda"), state)
    parsed = events.index(("index",))
    lead = events[:parsed]
    pieces = -(-(size - HEADER_REGION - TRAILER_SIZE) // GROUP_READ_BYTES)
    assert len(lead) == pieces >= 3, events
    assert [offset for _read, offset, _nbytes in lead] == [HEADER_REGION + i * GROUP_READ_BYTES for i in range(pieces)]
    assert events[parsed + 1:] == [], "a chunk inside the lead was read again"

    events.clear()  # load_into tensors on one GPU: the same lead, through its one kvikio reader
    target = {"big": torch.zeros_like(state["big"])}
    gdsckpt.load_into(target, path, strict=False)
    assert bit_equal(target["big"], state["big"])
    parsed = events.index(("index",))
    assert len(events[:parsed]) == pieces and events[parsed + 1:] == []

    events.clear()
    got = gdsckpt.load(path, device="cuda", keys=["big"])
    assert bit_equal(got["big"], state["big"])
    assert events[0] == ("index",) and len(events) > 1

    preloaded_submit = PreloadedReader.submit_read

    def copied(self, offset, out):
        events.append(("copy", offset, out.nbytes))
        return preloaded_submit(self, offset, out)

    monkeypatch.setattr(PreloadedReader, "submit_read", copied)
    events.clear()  # the null source: the file held in pinned host memory, the lead copied from it
    _assert_same(gdsckpt.load(PreloadedReader(path, pinned=True), device="cuda"), state)
    parsed = events.index(("index",))
    assert [entry[0] for entry in events[:parsed]] == ["copy"] * pieces and events[parsed + 1:] == [], events

    first_piece = [c for c in chunks if c.offset + c.stored <= HEADER_REGION + GROUP_READ_BYTES]
    assert len(first_piece) >= 2
    events.clear()
    failing.append(HEADER_REGION)
    _assert_same(gdsckpt.load(path, device="cuda"), state)
    again = {offset for _read, offset, _nbytes in events[events.index(("index",)) + 1:]}
    assert {c.offset for c in first_piece} <= again


def test_gpu_kvikio_reader_close_waits_for_cancelled_reads(tmp_path):
    """Reads cancelled by a failing restore still run in kvikio's pool: ``KvikioReader.close``
    returns only after every one of them has finished (their bytes all landed)."""
    import cupy

    from gdsckpt.io.kvikio import KvikioReader

    data = np.random.default_rng(5).integers(0, 256, 256 << 20, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    out = cupy.zeros(data.nbytes, dtype=cupy.uint8)
    piece = 4 << 20
    reader = KvikioReader(path, threads=16, timeout=120)
    futures = [reader.submit_read(start, out[start:start + piece]) for start in range(0, data.nbytes, piece)]
    for future in futures:
        future.cancel()
    reader.close()
    assert all(future.transfer_done() for future in futures)
    assert np.array_equal(cupy.asnumpy(out), data)


def test_gpu_a_restore_after_a_failed_one_is_bit_exact(tmp_path):
    """A restore that fails on a damaged chunk early, with many reads in flight behind it, then a
    restore of an intact file in the same process (a manager falling back to the checkpoint
    before): the second is bit-exact, whatever the first's stale reads did."""
    state = {"w": torch.randn(96 << 20, device="cuda") * 0.02}  # 384 MiB
    damaged, intact = tmp_path / "damaged.gdsckpt", tmp_path / "intact.gdsckpt"
    gdsckpt.save(state, damaged, codec="ans")
    gdsckpt.save(state, intact, codec="ans")
    with gdsckpt.open(damaged) as ckpt:
        victim = ckpt._opened.index.chunks[1]
    with open(damaged, "r+b") as f:
        f.seek(victim.offset + 10)
        byte = f.read(1)
        f.seek(victim.offset + 10)
        f.write(bytes([byte[0] ^ 0x01]))
    for _round in range(3):
        with pytest.raises(gdsckpt.CorruptCheckpointError):
            gdsckpt.load(damaged, device="cuda")
        _assert_same(gdsckpt.load(intact, device="cuda"), state)
