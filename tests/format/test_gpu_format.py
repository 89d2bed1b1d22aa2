"""Files written by the GPU engine follow docs/format.md too (skipped where CUDA is absent).

Run on a GPU host with:  python3 -m pytest -m gpu tests/format/test_gpu_format.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from . import spec

torch = pytest.importorskip("torch")
from gdsckpt.codecs.nvcomp import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs CUDA, CuPy and nvCOMP")]

import gdsckpt

from .test_golden import GOLDEN_NONE, _expected_arrays, assert_same, make_golden


def _to_cuda(obj: Any, memo: dict[int, Any]) -> Any:
    """The golden state with every torch tensor on the GPU (aliases and Parameters kept)."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.nn.Parameter):
        out: Any = torch.nn.Parameter(obj.detach().cuda(), requires_grad=obj.requires_grad)
    elif isinstance(obj, torch.Tensor):
        out = obj.cuda()
    elif isinstance(obj, dict):
        out = type(obj)((k, _to_cuda(v, memo)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
    elif isinstance(obj, (list, tuple)):
        out = type(obj)(_to_cuda(v, memo) for v in obj)
    else:
        out = obj
    memo[id(obj)] = out
    return out


def _save(tmp_path: Path, codec: str, byte_planes: str = "always") -> bytes:
    path = tmp_path / f"{codec}.gdsckpt"
    config = make_golden.config_for("golden_v1_none.gdsckpt").replace(engine="gpu", codec=codec,
                                                                       byte_planes=byte_planes)
    gdsckpt.save(_to_cuda(make_golden.build_state(), {}), path, config=config)
    return path.read_bytes()


@pytest.mark.parametrize("codec", ["zstd", "lz4", "deflate", "none"])
def test_gpu_portable_codecs_follow_the_spec(tmp_path: Path, codec: str) -> None:
    """GPU-written portable bitstreams decode with the spec reader's CPU libraries."""
    data = _save(tmp_path, codec)
    parsed = spec.parse_file(data)
    doc = parsed.index
    assert spec.violations(doc, parsed.trailer["index_offset"]) == []
    names = {stage["name"] for chain in doc["chains"] for stage in chain}
    assert names <= {"byteplanes/1", f"{codec}/1", "none/1"}
    position = 4096
    for offset, stored, *_ in doc["chunks"]:
        assert offset == position and data[offset + stored:spec.align_up(offset + stored)] == bytes(
            spec.align_up(offset + stored) - offset - stored)
        position = spec.align_up(offset + stored)
    assert parsed.trailer["index_offset"] == position
    assert spec.tensor_bytes(data, doc) == _expected_arrays(make_golden.build_state())
    path = tmp_path / "reload.gdsckpt"
    path.write_bytes(data)
    assert_same(make_golden.build_state(), gdsckpt.load(path, config=gdsckpt.Config(engine="cpu")))


def test_gpu_none_codec_writes_the_golden_chunks(tmp_path: Path) -> None:
    """Planning and layout do not depend on the engine: the GPU's codec-none chunks are the golden's."""
    data = _save(tmp_path, "none", "never")
    golden = GOLDEN_NONE.read_bytes()
    offset = spec.parse_trailer(golden)["index_offset"]
    assert spec.parse_trailer(data)["index_offset"] == offset
    assert data[:offset] == golden[:offset]
    mine, theirs = spec.parse_file(data).index, spec.parse_file(golden).index
    assert mine["chunks"] == theirs["chunks"] and mine["chains"] == theirs["chains"]


def test_gpu_only_codec_stages(tmp_path: Path) -> None:
    data = _save(tmp_path, "ans", "auto")
    parsed = spec.parse_file(data)
    assert spec.violations(parsed.index, parsed.trailer["index_offset"]) == []
    for chain in parsed.index["chains"]:
        assert chain[-1]["name"] in ("nvcomp.ans/1", "none/1")
        if chain[-1]["name"] == "nvcomp.ans/1":
            assert set(chain[-1]) <= {"name", "data_type"}
            assert chain[-1].get("data_type", "<f2") in ("<f2", "<f4", "|u1")
    path = tmp_path / "ans.gdsckpt"
    path.write_bytes(data)
    assert_same(make_golden.build_state(), gdsckpt.load(path))
    if any(chain[-1]["name"] == "nvcomp.ans/1" for chain in parsed.index["chains"]):
        with pytest.raises(gdsckpt.CodecUnavailableError):
            gdsckpt.load(path, config=gdsckpt.Config(engine="cpu"))


def test_gpu_crc32c_is_the_spec_checksum() -> None:
    import cupy

    from gdsckpt.codecs.nvcomp_c import crc32c_batch

    rng = np.random.default_rng(0)
    sizes = [1, 9, 4095, 4096, 65_537, 1 << 20]
    host = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    host.append(np.frombuffer(b"123456789", np.uint8))
    stream = cupy.cuda.Stream(non_blocking=True)
    got = crc32c_batch([cupy.asarray(h) for h in host], stream)
    assert [int(c) for c in got] == [spec.crc32c_fast(h.tobytes()) for h in host]
    assert int(got[-1]) == 0xE3069283
    blob = host[-2].tobytes()
    blocks = [blob[i:i + 65_536] for i in range(0, len(blob), 65_536)]
    block_crcs = crc32c_batch([cupy.asarray(np.frombuffer(b, np.uint8)) for b in blocks], stream)
    combined = int(block_crcs[0])
    for block, crc in zip(blocks[1:], block_crcs[1:]):
        combined = spec.crc32c_combine(combined, int(crc), len(block))
    assert combined == spec.crc32c_fast(blob)
