"""Dtype names: the format's persisted names (``gdsckpt.format.dtypes``) <-> torch and NumPy
dtypes, and which of them this machine's libraries can hold."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ..format.dtypes import DTYPES

# ---------------------------------------------------------------------------------------------
# dtype tables (names are the persisted ones of format.dtypes)

_TORCH_DTYPE_ATTRS = {
    "bool": "bool", "uint8": "uint8", "int8": "int8", "uint16": "uint16", "int16": "int16",
    "uint32": "uint32", "int32": "int32", "uint64": "uint64", "int64": "int64",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu", "float16": "float16", "bfloat16": "bfloat16",
    "float32": "float32", "float64": "float64", "complex32": "complex32", "complex64": "complex64",
    "complex128": "complex128",
}
_NUMPY_NATIVE = {
    "bool": "bool", "uint8": "uint8", "int8": "int8", "uint16": "uint16", "int16": "int16",
    "uint32": "uint32", "int32": "int32", "uint64": "uint64", "int64": "int64",
    "float16": "float16", "float32": "float32", "float64": "float64", "complex64": "complex64",
    "complex128": "complex128",
}
_ML_DTYPES = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
              "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz",
              "float8_e8m0fnu": "float8_e8m0fnu"}


def torch_dtype(name: str) -> Any:
    """The torch dtype of a persisted dtype name."""
    import torch

    dtype = getattr(torch, _TORCH_DTYPE_ATTRS[name], None)
    if dtype is None:
        raise TypeError(f"dtype {name!r} is not available in torch {torch.__version__}")
    return dtype


_torch_dtype_names: dict[Any, str | None] = {}
"""``torch_dtype_name``'s answers so far: a state of many small tensors asks once per tensor, and
``str(dtype)`` is a call into torch each time."""


def torch_dtype_name(dtype: Any) -> str | None:
    """The format's dtype name of a ``torch.dtype`` (``"bfloat16"``), None for one it cannot hold."""
    try:
        return _torch_dtype_names[dtype]
    except (KeyError, TypeError):  # not asked yet, or not hashable (not a torch.dtype)
        pass
    text = str(dtype)
    name = text[len("torch."):] if text.startswith("torch.") else text
    found = name if _TORCH_DTYPE_ATTRS.get(name) == name else None
    if type(dtype).__name__ == "dtype":
        _torch_dtype_names[dtype] = found
    return found


_NUMPY_NATIVE_DTYPES = {name: np.dtype(native).newbyteorder("<") for name, native in _NUMPY_NATIVE.items()}
"""Made once (dtypes are immutable): a restore asks for one per array."""


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a persisted dtype name (bfloat16 and float8 through ml_dtypes)."""
    native = _NUMPY_NATIVE_DTYPES.get(name)
    if native is not None:
        return native
    if name in _ML_DTYPES:
        try:
            ml_dtypes = importlib.import_module("ml_dtypes")
        except ImportError:
            raise TypeError(f"loading a NumPy array of dtype {name!r} needs the ml_dtypes package") from None
        return np.dtype(getattr(ml_dtypes, _ML_DTYPES[name]))
    raise TypeError(f"dtype {name!r} has no NumPy equivalent")


def numpy_dtype_name(dtype: np.dtype) -> str | None:
    """The format's dtype name of a native-order NumPy dtype (ml_dtypes' included), None for one
    it cannot hold."""
    if dtype.kind in "biufc" and dtype.name in _NUMPY_NATIVE:
        return dtype.name
    # ml_dtypes' types report kind 'V', except some that report 'f' (float8_e5m2 in ml_dtypes
    # 0.5): their name and itemsize say which format dtype they are.
    if dtype.kind in "Vf" and dtype.name in _ML_DTYPES and dtype.itemsize == DTYPES[dtype.name].itemsize:
        return dtype.name
    return None

