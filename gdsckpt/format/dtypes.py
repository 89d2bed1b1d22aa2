"""The dtype names persisted in the index, written out by hand.

Why a hand-written table instead of ``str(torch.dtype)`` or ``numpy.dtype.str``: the strings in
the index are part of the on-disk contract (docs/format.md, "Dtypes"). Deriving them from a
library's repr would let a library upgrade silently change the format; spelling them out here means
every persisted name is one we chose and test. This module is pure Python (no torch, no numpy).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DtypeSpec:
    """One persisted dtype: its name, the size of one element, and how byte planes treat it.

    ``plane_width`` is the width in bytes of the scalar whose bytes the byte-plane transform groups
    by significance (the component width for complex numbers), or 0 when the transform does not
    apply (integers, bool, 1-byte floats).
    """

    name: str
    itemsize: int
    plane_width: int


_SPECS = (
    DtypeSpec("bool", 1, 0),
    DtypeSpec("uint8", 1, 0),
    DtypeSpec("int8", 1, 0),
    DtypeSpec("uint16", 2, 0),
    DtypeSpec("int16", 2, 0),
    DtypeSpec("uint32", 4, 0),
    DtypeSpec("int32", 4, 0),
    DtypeSpec("uint64", 8, 0),
    DtypeSpec("int64", 8, 0),
    DtypeSpec("float8_e4m3fn", 1, 0),
    DtypeSpec("float8_e5m2", 1, 0),
    DtypeSpec("float8_e4m3fnuz", 1, 0),
    DtypeSpec("float8_e5m2fnuz", 1, 0),
    DtypeSpec("float8_e8m0fnu", 1, 0),
    DtypeSpec("float16", 2, 2),
    DtypeSpec("bfloat16", 2, 2),
    DtypeSpec("float32", 4, 4),
    DtypeSpec("float64", 8, 8),
    DtypeSpec("complex32", 4, 2),
    DtypeSpec("complex64", 8, 4),
    DtypeSpec("complex128", 16, 8),
)

DTYPES: dict[str, DtypeSpec] = {spec.name: spec for spec in _SPECS}
"""Every dtype name a v1 file may contain, keyed by name."""


def dtype_spec(name: str) -> DtypeSpec:
    """Return the spec of a persisted dtype name; ``KeyError`` names the valid choices."""
    try:
        return DTYPES[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r} (expected one of: {', '.join(DTYPES)})") from None
