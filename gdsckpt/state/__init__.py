"""State flattening: nested containers of arrays and plain values <-> a JSON structure tree plus a
list of arrays, and the array adapters the pipeline reads from and writes into.

Supported, and restored as the same type:
- ``dict`` (with keys of type str, int, float, bool or None), ``collections.OrderedDict`` (its
  ``_metadata`` attribute, which ``nn.Module.state_dict`` uses for version info, is kept),
  ``list`` and ``tuple`` (kept distinct);
- ``torch.Tensor`` of every dtype in ``format.dtypes`` (``nn.Parameter`` comes back as a
  Parameter with its ``requires_grad``), NumPy arrays and scalars, CuPy arrays and JAX arrays (by
  DLPack), any shape including 0-d and zero-size, contiguous or not;
- ``int`` (any size), ``float`` (bit-exact: NaN payloads, -0.0, inf), ``bool``, ``str``, ``None``.

Tensors that share storage: two entries that are the *same view* (same storage, offset, shape,
strides and dtype, e.g. tied embedding weights) are stored once and come back as one shared
object, as ``torch.save`` does. Partially overlapping views are stored as independent copies and
come back as separate tensors.

Anything else raises ``TypeError`` naming its key path, and so do NumPy subclasses
(``MaskedArray``, ``matrix``, ``recarray``, ...: they would come back as plain arrays without
their mask or semantics; ``np.memmap``, whose elements are all it holds, is saved and comes back
as an ``ndarray``), a container that contains itself (a reference cycle) or a state nested deeper
than 256 containers; an ``int`` of more than 4300 decimal digits (the format's limit) raises
``ValueError``. Loading never unpickles anything: the structure is JSON.

What is not kept: subclasses of ``dict`` (other than ``OrderedDict``), ``int``, ``float`` and
``str`` (``defaultdict``, ``IntEnum``, a ``str`` enum, ``numpy.str_``; as dict keys too) come back
as the base type; a big-endian NumPy array comes back in the machine's byte order, with the same
values (the format stores little-endian elements); a container
referenced from two places (not a cycle) is saved twice and comes back as two copies; a tensor's
``.grad`` is not saved, and a plain tensor that requires grad comes back detached
(``requires_grad=False``; an ``nn.Parameter`` keeps its flag).

Array libraries are found through ``sys.modules`` when saving (a state can only hold a torch
tensor if torch is imported) and imported lazily when loading, so ``import gdsckpt`` pulls in
neither torch nor CuPy nor JAX.

Modules: ``dtypes`` (dtype names <-> torch / NumPy dtypes), ``arrays`` (the sources and targets
the pipeline reads from and writes into), ``tree`` (flatten / unflatten, key paths, scalars,
selections); ``delta`` (arrays as the XOR with a base) and ``lossy`` (opt-in rounding).
"""

from __future__ import annotations

from .arrays import (
    CupySource,
    CupyTarget,
    JaxTarget,
    NumpySource,
    NumpyTarget,
    TorchSource,
    TorchTarget,
    array_range,
    torch_range,
    writable,
)
from .dtypes import (
    numpy_dtype,
    numpy_dtype_name,
    torch_dtype,
    torch_dtype_name,
)
from .tree import (
    MAX_INT_DIGITS,
    FlatArray,
    FlatState,
    KeyPaths,
    Selection,
    decode_scalar,
    encode_scalar,
    escape_key,
    flatten,
    float_from_bits,
    join_key,
    plain_key,
    unflatten,
    walk_tree,
)

__all__ = [
    "MAX_INT_DIGITS",
    "CupySource",
    "CupyTarget",
    "FlatArray",
    "FlatState",
    "JaxTarget",
    "KeyPaths",
    "NumpySource",
    "NumpyTarget",
    "Selection",
    "TorchSource",
    "TorchTarget",
    "array_range",
    "decode_scalar",
    "encode_scalar",
    "escape_key",
    "flatten",
    "float_from_bits",
    "join_key",
    "numpy_dtype",
    "numpy_dtype_name",
    "plain_key",
    "torch_dtype",
    "torch_dtype_name",
    "torch_range",
    "unflatten",
    "walk_tree",
    "writable",
]
