"""Build the golden format-v1 files next to this script (docs/format.md, tests/format/test_golden.py).

    python3 tests/data/make_golden.py            # rewrites tests/data/golden_v1_*.gdsckpt

Regenerating a golden file is a deliberate act: ``tests/format/test_golden.py`` pins a fingerprint
of ``golden_v1_none.gdsckpt`` (header, every chunk byte, and the index with its ``writer`` field
blanked), so a changed writer fails the suite until that fingerprint is updated too, together with
a note in docs/format.md on why the bytes of format v1 changed (they should not: v1 is frozen).

The state is built from ``arange`` arithmetic whose every value is exactly representable in its
dtype (no rounding, no random generator), so its bits depend on no library version. It holds:
nested dict / list / tuple / OrderedDict (with ``_metadata``), dict keys of every scalar type
including one that needs JSON-Pointer escaping, ``nn.Parameter`` (both ``requires_grad``),
torch tensors of a dozen dtypes (bfloat16, float16, float32, float64, complex64, float8, int8,
uint8, int32, int64, bool), a tensor split over two chunks, one exactly ``chunk_bytes`` long, many
packed small tensors, a 0-d and a zero-size tensor, a non-contiguous view, a tied (aliased) tensor,
NumPy arrays and a NumPy scalar, and plain ints (big and negative), floats (-0.0, inf, nan), bools,
str (non-ASCII) and None.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHUNK_BYTES = 8192
GOLDEN_FILES = {
    # name: (codec, byte_planes). "none" stores the raw bytes, so the file is a function of the
    # state and the format alone; "zstd" depends on the zstd version and is only ever loaded.
    "golden_v1_none.gdsckpt": ("none", "never"),
    "golden_v1_zstd.gdsckpt": ("zstd", "always"),
}


def build_state() -> Any:
    """The fixed state of the golden files (a fresh object on every call)."""
    import numpy as np
    import torch

    def grid(n: int, step: int, div: int) -> torch.Tensor:
        # (i * step mod 511 - 255) / div: integers in [-255, 255] over a power of two, exact in
        # bfloat16 (8 significant bits), float16, float32 and float64.
        return ((torch.arange(n, dtype=torch.int64) * step) % 511 - 255).to(torch.float64) / div

    embed = grid(64 * 96, 7, 8).reshape(64, 96).to(torch.bfloat16)           # 12288 B: chunks 8192 + 4096
    layer = grid(32 * 80, 13, 16).reshape(32, 80).to(torch.float32)          # 10240 B: chunks 8192 + 2048
    positions = (torch.arange(2048, dtype=torch.int32) * 1_000_003) - (1 << 30)  # 8192 B = chunk_bytes
    model = collections.OrderedDict()
    model["embed.weight"] = torch.nn.Parameter(embed)
    model["layer.0.weight"] = torch.nn.Parameter(layer, requires_grad=False)
    model["layer.0.bias"] = grid(80, 3, 4).to(torch.float32)
    model["norm.weight"] = grid(48, 5, 2).to(torch.float16)
    model["positions"] = positions
    model["head.weight"] = model["embed.weight"]                             # tied: stored once
    model._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
        [("", {"version": 1}), ("layer.0", {"version": 2})])

    misc = {
        "step": torch.tensor(1234567, dtype=torch.int64),                   # 0-d
        "empty": torch.zeros((0, 3), dtype=torch.float32),                   # zero-size: no bytes
        "mask": torch.arange(50) % 3 == 0,                                   # bool
        "codes": (torch.arange(33, dtype=torch.int64) * 37 % 256 - 128).to(torch.int8),
        "bytes": (torch.arange(21, dtype=torch.int64) * 11 % 256).to(torch.uint8),
        "fp8": torch.arange(40, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "z": torch.complex(grid(16, 9, 4).to(torch.float32), grid(16, 17, 8).to(torch.float32)),
        "transposed": grid(15, 29, 32).reshape(3, 5).t(),                    # float64, non-contiguous
    }
    optimizer = {
        "state": {
            0: {"step": torch.tensor(10.0), "exp_avg": grid(96, 19, 64).to(torch.float32)},
            1: {"step": torch.tensor(10.0), "exp_avg": grid(20, 23, 64).to(torch.float32)},
        },
        "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01,
                          "amsgrad": False, "foreach": None, "params": [0, 1]}],
    }
    keys = {
        "a/b~c": torch.arange(6, dtype=torch.int16),                        # key "keys/a~1b~0c"
        -7: "negative int key",
        2.5: torch.arange(4, dtype=torch.float64) / 4,                       # key "keys/2.5"
        True: None,
        None: 0,
    }
    plain = [
        2 ** 100, -(2 ** 70) + 1, 0, -0.0, 0.1, float("inf"), float("-inf"), float("nan"),
        True, False, None, "h\u00e9llo \u2713 \U0001d11e", "", (1, (2.5, None), ()), [],
    ]
    arrays = {
        "ids": np.arange(10, dtype=np.int64) * 3 - 5,
        "weights": (np.arange(12, dtype=np.float32) / 8).reshape(3, 4),
        "half": np.arange(7, dtype=np.float16) / 2,
        "count": np.int16(7),                                                # NumPy scalar
    }
    return {"model": model, "optimizer": optimizer, "misc": misc, "keys": keys, "plain": plain,
            "arrays": arrays, "epoch": 3}


def config_for(name: str) -> Any:
    """The save configuration of one golden file (explicit in every field that shapes the bytes)."""
    import gdsckpt

    codec, byte_planes = GOLDEN_FILES[name]
    return gdsckpt.Config(codec=codec, chunk_bytes=CHUNK_BYTES, pack_below=1 << 20, byte_planes=byte_planes,
                          level=3, codec_threads=2, io_threads=2, o_direct=False, fsync=False)


def write_golden(name: str, path: Path) -> None:
    """Save the golden state as golden file ``name`` to ``path``."""
    import gdsckpt

    gdsckpt.save(build_state(), path, config=config_for(name))


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else HERE
    for name in GOLDEN_FILES:
        write_golden(name, out / name)
        print(f"wrote {out / name} ({(out / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))  # this checkout's gdsckpt, installed or not
    raise SystemExit(main(sys.argv))
