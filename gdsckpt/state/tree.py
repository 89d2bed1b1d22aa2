"""The structure tree: flattening a state into a JSON tree plus a list of arrays and back, key
paths, plain-value encodings, and key selections."""

from __future__ import annotations

import collections
import importlib
import re
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import collector
from ..format.dtypes import DTYPES
from ..format.index import shape_limit_error
from .arrays import CupySource, NumpySource, TorchSource
from .dtypes import numpy_dtype_name, torch_dtype_name

# ---------------------------------------------------------------------------------------------
# flattening

def escape_key(component: Any) -> str:
    """One key path component as text: JSON-Pointer escaping (``~`` -> ``~0``, ``/`` -> ``~1``);
    an int beyond the process's int-to-text limit as ``int_text`` writes it."""
    try:
        text = str(component)
    except ValueError:
        if not isinstance(component, int):
            raise
        text = int_text(component)
    return text.replace("~", "~0").replace("/", "~1")


def join_key(path: Iterable[Any]) -> str:
    """The key string of a path of container keys, e.g. ``["optimizer", "state", 0]`` ->
    ``"optimizer/state/0"``."""
    try:
        parts = [str(part) for part in path]
    except ValueError:  # an int beyond the process's int-to-text limit (``int_text``)
        parts = [int_text(part) if isinstance(part, int) else str(part) for part in path]
    joined = "/".join(parts)
    # Most keys need no escaping: one "/" per join and no "~" says so without a pass per part.
    if "~" not in joined and joined.count("/") == len(parts) - 1:
        return joined
    return "/".join(escape_key(part) for part in parts)


@dataclass
class FlatArray:
    """One array found in a state: what the index records and where its bytes come from."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    source: Any
    alias: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    lossy: dict[str, Any] | None = None
    """The index record's ``lossy`` member when ``gdsckpt.lossy`` rounded this array."""


@dataclass
class FlatState:
    """A flattened state: the structure tree (JSON) and its arrays, in tree order."""

    tree: Any
    arrays: list[FlatArray]


MAX_INT_DIGITS = 4300
"""Most decimal digits of an ``int`` in the structure (docs/format.md, scalar encodings)."""
_INT_LIMIT = 10 ** MAX_INT_DIGITS


def _float_bits(value: float) -> str:
    return struct.pack(">d", value).hex()


def float_from_bits(text: str) -> float:
    """Inverse of the float encoding: 16 hex digits of big-endian IEEE-754 binary64."""
    return float(struct.unpack(">d", bytes.fromhex(text))[0])


_PIECE_DIGITS = 500
"""Digits converted at a time where the process limits int <-> text conversion
(``sys.set_int_max_str_digits``): below 640, the lowest limit Python accepts."""


def int_text(value: int) -> str:
    """``str(value)`` whatever the process's int-to-text limit: a checkpoint holds ints of up to
    ``MAX_INT_DIGITS`` digits (docs/format.md §7.2), and a process that lowered the limit must
    still save and read them."""
    try:
        return str(value)
    except ValueError:
        pass
    sign, rest = ("-", -value) if value < 0 else ("", value)
    pieces = []
    while rest:
        rest, piece = divmod(rest, 10 ** _PIECE_DIGITS)
        pieces.append(piece)
    return sign + str(pieces[-1]) + "".join(f"{piece:0{_PIECE_DIGITS}d}" for piece in reversed(pieces[:-1]))


def int_from_text(text: str) -> int:
    """``int(text)`` of a decimal string whatever the process's int-to-text limit (``int_text``)."""
    try:
        return int(text)
    except ValueError:
        if not _DECIMAL.fullmatch(text):
            raise
    digits = text.lstrip("-")
    value = 0
    for start in range(0, len(digits), _PIECE_DIGITS):
        piece = digits[start:start + _PIECE_DIGITS]
        value = value * 10 ** len(piece) + int(piece)
    return -value if text.startswith("-") else value


_DECIMAL = re.compile(r"-?[0-9]+")


def encode_scalar(value: Any, path: list[Any]) -> dict[str, Any] | None:
    """The JSON node of a plain value, or None if ``value`` is not one."""
    if value is None:
        return {"t": "none"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if isinstance(value, int):
        if value.bit_length() > 3 * MAX_INT_DIGITS and abs(value) >= _INT_LIMIT:  # no str() of it
            raise ValueError(f"int at {join_key(path)!r} has more than {MAX_INT_DIGITS} decimal digits, "
                             f"the most a checkpoint holds")
        return {"t": "int", "v": int_text(int(value))}
    if isinstance(value, float):
        return {"t": "float", "v": _float_bits(float(value))}
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise TypeError(f"string at {join_key(path)!r} is not valid Unicode text") from None
        return {"t": "str", "v": value}
    return None


def plain_key(key: Any) -> Any:
    """A dict key as a checkpoint stores and loads it: its plain base type (``bool``, ``int``,
    ``float``, ``str`` or None), so that an ``IntEnum``, a ``str``-mixin ``Enum`` or a
    ``numpy.str_`` key gets the key string it comes back under (``str()`` of a ``str`` enum
    member is ``"Cls.NAME"``, its stored value ``"name"``: a file saved with one had index
    records keyed one way and its tree the other, and every load refused it as corrupt). Other
    keys are returned as they are."""
    if key is None or type(key) in (bool, int, float, str):
        return key
    if isinstance(key, int):  # bool cannot be subclassed: handled above
        return int(key)
    if isinstance(key, float):
        return float(key)
    if isinstance(key, str):
        return str.__str__(key)
    return key


def decode_scalar(node: dict[str, Any]) -> Any:
    """The plain value of a scalar JSON node."""
    kind = node["t"]
    if kind == "str":  # first: nearly every dict key of a state is a string
        return node["v"]
    if kind == "none":
        return None
    if kind == "bool":
        return bool(node["v"])
    if kind == "int":
        return int_from_text(node["v"])
    if kind == "float":
        return float_from_bits(node["v"])
    return node["v"]


def _instance_of(obj: Any, kind: Any) -> bool:
    """``isinstance(obj, kind)`` where ``kind`` is a type; False otherwise (None: not imported)."""
    return isinstance(kind, type) and isinstance(obj, kind)


class _Flattener:
    def __init__(self) -> None:
        self.arrays: list[FlatArray] = []
        self.keys: dict[str, tuple[Any, ...]] = {}
        self.views: dict[tuple[Any, ...], int] = {}
        self.torch = sys.modules.get("torch")
        # Read with getattr (cupy's and jax's array types too, in ``_array``): while another thread
        # runs ``import torch`` the module is in ``sys.modules`` half made (``Tensor`` early, ``nn``
        # late), and a state without tensors, or one of NumPy arrays, saves all the same.
        tensor = getattr(self.torch, "Tensor", None)
        parameter = getattr(getattr(self.torch, "nn", None), "Parameter", None)
        self.torch_tensor: type | None = tensor if isinstance(tensor, type) else None
        """``torch.Tensor`` where torch is imported (far enough), else None."""
        self.torch_tensor_types = tuple(kind for kind in (tensor, parameter) if isinstance(kind, type))
        """The exact types ``visit`` hands to ``_torch`` first: ``torch.Tensor`` and ``torch.nn.Parameter``."""
        self.cupy = sys.modules.get("cupy")
        self.jax = sys.modules.get("jax")
        self.open_containers: dict[int, int] = {}
        """id of each dict / list / tuple being visited -> its depth (finds reference cycles)."""
        self.good_shapes: set[tuple[tuple[int, ...], str]] = set()
        """(shape, dtype name) pairs ``_check_shape`` found within the format's bounds."""

    def visit(self, obj: Any, path: list[Any], depth: int = 0) -> dict[str, Any]:
        if depth > 256:
            raise TypeError(f"state nested deeper than 256 levels at {join_key(path)!r:.200}")
        if type(obj) in self.torch_tensor_types:  # the commonest leaf first: no scalar checks
            return self._torch(obj, path)
        if isinstance(obj, np.generic) and not isinstance(obj, (str, bytes)):
            return self._numpy(obj, path)  # before encode_scalar: np.float64 subclasses float
        scalar = encode_scalar(obj, path)
        if scalar is not None:
            return scalar
        if isinstance(obj, dict) or type(obj) in (list, tuple):
            return self._container(obj, path, depth)
        array = self._array(obj, path)
        if array is not None:
            return array
        raise TypeError(
            f"cannot save object of type {type(obj).__module__}.{type(obj).__qualname__} at key "
            f"{join_key(path)!r}: gdsckpt saves dicts, lists, tuples, tensors/arrays, int, float, "
            f"bool, str and None"
        )

    def _container(self, obj: Any, path: list[Any], depth: int) -> dict[str, Any]:
        if id(obj) in self.open_containers:
            raise TypeError(f"state contains a reference cycle: the {type(obj).__name__} at "
                            f"{join_key(path)!r:.200} is the one at "
                            f"{join_key(path[:self.open_containers[id(obj)]])!r:.200}, which contains it")
        self.open_containers[id(obj)] = depth
        try:
            if isinstance(obj, dict):
                return self._dict(obj, path, depth)
            return {"t": type(obj).__name__,
                    "items": [self.visit(item, path + [i], depth + 1) for i, item in enumerate(obj)]}
        finally:
            del self.open_containers[id(obj)]

    def _dict(self, obj: dict[Any, Any], path: list[Any], depth: int) -> dict[str, Any]:
        items = []
        nan_key = False
        plain_keys: set[tuple[type, Any]] = set()
        for key, value in obj.items():
            encoded = encode_scalar(key, path) if not isinstance(key, (dict, list, tuple)) else None
            if encoded is None:
                raise TypeError(f"dict key {key!r} of type {type(key).__name__} at {join_key(path)!r} "
                                f"is not supported (use str, int, float, bool or None keys)")
            if type(key) not in (str, int, float, bool) and key is not None:
                # stored, and keyed, as it comes back: a subclass's node is made from its plain value
                key = plain_key(key)
                encoded = encode_scalar(key, path)
            if isinstance(key, float) and key != key:
                # Two NaN objects are two keys of a Python dict but one key path: a reader could not
                # tell them apart, and refuses such a file (docs/format.md §7.1).
                if nan_key:
                    raise ValueError(f"the dict at {join_key(path)!r} has more than one NaN key; "
                                     f"a checkpoint keys every entry by its text, and these share 'nan'")
                nan_key = True
            elif (type(key), key) in plain_keys:
                # two keys Python told apart (a str subclass hashing its own way) that are one
                # plain key: every reader would refuse the file as repeating a key
                raise ValueError(f"the dict at {join_key(path)!r} has two keys that are both {key!r} as "
                                 f"plain {type(key).__name__}s, the only way a checkpoint stores keys")
            else:
                plain_keys.add((type(key), key))
            items.append([encoded, self.visit(value, path + [key], depth + 1)])
        node: dict[str, Any] = {"t": "dict", "items": items}
        if isinstance(obj, collections.OrderedDict):
            node["cls"] = "OrderedDict"
            metadata = getattr(obj, "_metadata", None)
            if isinstance(metadata, dict):
                before = len(self.arrays)
                node["meta"] = self.visit(metadata, path + ["_metadata"], depth + 1)
                if len(self.arrays) != before:
                    raise TypeError(f"_metadata of {join_key(path)!r} holds arrays")
        return node

    def _register(self, path: list[Any], kind: str, dtype: str, shape: tuple[int, ...], device: str,
                  source: Any, view_key: tuple[Any, ...] | None, extra: dict[str, Any]) -> dict[str, Any]:
        key = join_key(path)
        if key in self.keys:
            raise ValueError(f"two entries map to the key {key!r}: paths {list(self.keys[key])!r} and {path!r}")
        # A tuple: of strings and ints, the collector stops tracking it at its first pass (a list
        # per tensor stayed a tracked object for the whole save).
        self.keys[key] = tuple(path)
        alias = self.views.get(view_key) if view_key is not None else None
        array_id = len(self.arrays)
        self.arrays.append(FlatArray(key, kind, dtype, shape, device, None if alias is not None else source,
                                     alias, extra))
        if view_key is not None and alias is None:
            self.views[view_key] = array_id
        return {"t": "tensor", "id": array_id}

    def _array(self, obj: Any, path: list[Any]) -> dict[str, Any] | None:
        if self.torch_tensor is not None and isinstance(obj, self.torch_tensor):
            return self._torch(obj, path)
        if isinstance(obj, (np.ndarray, np.generic)):
            return self._numpy(obj, path)
        # (of a library half imported: as torch's in ``__init__``)
        if _instance_of(obj, getattr(self.cupy, "ndarray", None)):
            name = self._check_dtype(numpy_dtype_name(obj.dtype), obj.dtype, path)
            self._check_shape(tuple(obj.shape), name, path)
            # The dtype itself, not its .str: that is "<V1" for every ml_dtypes float8, so views of
            # one memory as two of them would become one alias record of a mismatched dtype.
            view_key = ("cupy", obj.data.ptr, obj.dtype, obj.shape, obj.strides) if obj.size else None
            return self._register(path, "cupy", name, tuple(obj.shape), f"cuda:{obj.device.id}",
                                  CupySource(obj, name), view_key, {})
        if _instance_of(obj, getattr(self.jax, "Array", None)):
            return self._jax(obj, path)
        return None

    def _check_dtype(self, name: str | None, dtype: Any, path: list[Any]) -> str:
        if name is None:
            raise TypeError(f"array dtype {dtype} at key {join_key(path)!r} is not supported "
                            f"(supported: {', '.join(DTYPES)})")
        return name

    def _check_shape(self, shape: tuple[int, ...], name: str, path: list[Any]) -> None:
        """Refuse a shape the reader refuses (``format.index.shape_limit_error``): saved, it would
        replace a good file with one every load refuses as corrupt. Checked before the array's
        source is made and before planning: an expanded (stride-0) tensor's logical size can be
        far beyond its memory, and planning its chunks would not end. A shape and dtype found
        good once are not checked again (a model's layers repeat a few shapes)."""
        if (shape, name) in self.good_shapes:
            return
        problem = shape_limit_error(shape, DTYPES[name].itemsize)
        if problem is not None:
            raise ValueError(f"array at key {join_key(path)!r:.200} of shape {list(shape)!r:.120} and dtype "
                             f"{name} cannot be saved: {problem}")
        self.good_shapes.add((shape, name))

    def _torch(self, tensor: Any, path: list[Any]) -> dict[str, Any]:
        torch = self.torch
        assert torch is not None
        # The key is spelled only in an error, and each torch attribute is read once: a state of
        # many small tensors pays both per tensor.
        if tensor.layout != torch.strided:
            raise TypeError(f"tensor at {join_key(path)!r} has layout {tensor.layout}; only dense (strided) "
                            f"tensors are saved: convert with .to_dense()")
        # ``is_cpu`` / ``is_cuda`` rather than ``device.type``, which makes a device object and a
        # string each time: several times the cost of either.
        if tensor.is_cpu:
            device = "cpu"
        elif tensor.is_cuda:
            device = f"cuda:{tensor.get_device()}"
        elif tensor.is_meta:
            raise TypeError(f"tensor at {join_key(path)!r} is on the meta device and has no data to save")
        else:
            raise TypeError(f"tensor at {join_key(path)!r} is on device {tensor.device}; gdsckpt saves CPU "
                            f"and CUDA tensors")
        if tensor.is_quantized or getattr(tensor, "is_nested", False):
            raise TypeError(f"tensor at {join_key(path)!r} is quantized or nested, which gdsckpt does not save")
        if type(tensor) not in self.torch_tensor_types:
            raise TypeError(f"tensor subclass {type(tensor).__qualname__} at {join_key(path)!r} is not "
                            f"supported; pass a plain tensor (e.g. DTensor.to_local()) or use gdsckpt.dcp")
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        name = self._check_dtype(torch_dtype_name(dtype), dtype, path)
        self._check_shape(shape, name, path)
        extra: dict[str, Any] = {}
        if type(tensor) is torch.nn.Parameter:
            extra["parameter"] = {"requires_grad": bool(tensor.requires_grad)}
        view_key = None
        if tensor.numel():
            # data_ptr() is the storage's address plus the offset: the same view, found without
            # making a storage object per tensor
            view_key = ("torch", device, tensor.data_ptr(), dtype, shape, tensor.stride(), tensor.is_conj(),
                        tensor.is_neg())
        return self._register(path, "torch", name, shape, device, TorchSource(tensor, name, device != "cpu"),
                              view_key, extra)

    def _numpy(self, obj: Any, path: list[Any]) -> dict[str, Any]:
        scalar = isinstance(obj, np.generic)
        # A subclass would come back as a plain ndarray (or scalar) without what it adds: a
        # MaskedArray its mask, np.matrix its 2-D semantics. A memmap's elements are all it holds.
        if type(obj) is not (obj.dtype.type if scalar else np.ndarray) and type(obj) is not np.memmap:
            remedy = (f"pass {obj.dtype.type.__module__}.{obj.dtype.type.__name__}(value)" if scalar else
                      "pass np.asarray(value), or save its parts (e.g. a MaskedArray's .data and .mask) as "
                      "separate entries")
            plain = obj.dtype.type.__name__ if scalar else "ndarray"
            raise TypeError(f"NumPy {'scalar' if scalar else 'array'} subclass {type(obj).__module__}."
                            f"{type(obj).__qualname__} at {join_key(path)!r:.200} is not supported: it would "
                            f"load as a plain {plain} without what the subclass adds; {remedy}")
        array = np.asarray(obj)
        name = self._check_dtype(numpy_dtype_name(array.dtype.newbyteorder("=")), array.dtype, path)
        self._check_shape(tuple(array.shape), name, path)
        view_key = None
        if array.size and not scalar:
            # The dtype itself, not its .str: that is "<V1" for every ml_dtypes float8 (and "<V2"
            # for bfloat16), so views of one memory as two of them would become one alias record
            # of a mismatched dtype, a file every load refuses. Dtypes of other byte orders differ.
            view_key = ("numpy", array.__array_interface__["data"][0], array.dtype, array.shape,
                        array.strides)
        return self._register(path, "numpy", name, tuple(array.shape), "cpu", NumpySource(array, name),
                              view_key, {"scalar": True} if scalar else {})

    def _jax(self, obj: Any, path: list[Any]) -> dict[str, Any]:
        devices = list(obj.devices())
        platform = devices[0].platform if devices else "cpu"
        if platform == "gpu" and self.cupy is None:
            importlib.import_module("cupy")
            self.cupy = sys.modules.get("cupy")
        if platform == "gpu":
            assert self.cupy is not None
            array = self.cupy.from_dlpack(obj)
            name = self._check_dtype(numpy_dtype_name(array.dtype), array.dtype, path)
            self._check_shape(tuple(array.shape), name, path)
            source: Any = CupySource(array, name)
            device = f"cuda:{devices[0].id}"
        else:
            array = np.from_dlpack(obj)
            name = self._check_dtype(numpy_dtype_name(array.dtype), array.dtype, path)
            self._check_shape(tuple(array.shape), name, path)
            source, device = NumpySource(array, name), "cpu"
        return self._register(path, "jax", name, tuple(array.shape), device, source, None, {})


@collector.paused()
def flatten(state: Any) -> FlatState:
    """Flatten a state into its structure tree and arrays; ``TypeError`` names unsupported values,
    ``ValueError`` an array whose shape the format cannot hold (more than 64 dimensions, a
    dimension or byte span of 2**60 or more: docs/format.md §6.5) and two entries of one key."""
    flattener = _Flattener()
    tree = flattener.visit(state, [])
    return FlatState(tree, flattener.arrays)


# ---------------------------------------------------------------------------------------------
# unflattening

class Selection:
    """Which key paths a partial load wants: each requested key selects itself and its subtree.

    ``keys``: None (everything), one key string, or an iterable of key strings. The empty string
    is the root's key path (docs/format.md §7.3), so ``keys=""`` (as ``keys=[""]``) selects the
    whole state; ``keys=[]`` selects nothing. ``TypeError`` for anything else, naming the entry
    (``bytes`` included: it would iterate to ints), before any file is opened."""

    def __init__(self, keys: Iterable[str] | None):
        self.keys = None if keys is None else checked_keys(keys)
        self._wanted = set(self.keys or ())
        self.matched: set[str] = set()

    def covers(self, key: str) -> bool:
        """True if ``key`` is requested or lies under a requested key; marks every requested key
        that covers it as matched (``"a"`` and ``"a/b"`` may both be asked for). The requested
        keys that cover ``key`` are its prefixes ending before a ``/`` (a component's own ``/`` is
        escaped), looked up in a set: the cost per record is its key's length, not the number
        of keys asked for (asking for each of 8,000 tensors by name took 10.5 s)."""
        if self.keys is None:
            return True
        wanted = self._wanted
        covering = [key] if key in wanted else []
        if "" in wanted:
            covering.append("")
        cut = key.find("/")
        while cut != -1:
            if key[:cut] in wanted:
                covering.append(key[:cut])
            cut = key.find("/", cut + 1)
        self.matched.update(covering)
        return bool(covering)

    def start(self) -> tuple[bool, Cursors]:
        """``(inside, cursors)`` of the root, for walking the tree with ``step`` instead of
        joining every node's key string: a key path string is as long as all its components
        together, so building one per node costs (depth x key length) per leaf."""
        assert self.keys is not None
        inside = "" in self._wanted
        if inside:
            self.matched.add("")
        return inside, _grouped((wanted, 0) for wanted in self._wanted if wanted)

    def step(self, cursors: Cursors, component: Any) -> tuple[bool, Cursors]:
        """For the child at ``component`` of a node with ``cursors``: whether a requested key
        names the child exactly (marked as matched), and the child's cursors. A node's cursors
        are the requested keys that go on below it, grouped by the component each names next
        (``_grouped``): a child looks up its own, so a node of thousands of children with
        thousands of keys asked for costs a lookup per child, not a pass over the keys."""
        reached = False
        following = []
        for wanted, end in cursors.get(escape_key(component), ()):
            if end == len(wanted):
                self.matched.add(wanted)
                reached = True
            else:  # wanted[end] is the "/" before the next component
                following.append((wanted, end + 1))
        return reached, _grouped(following)


Cursors = dict[str, list[tuple[str, int]]]
"""A node's requested keys that go on below it: the next component each names (escaped, as in the
key string) -> ``(wanted, end)``, where ``wanted[:end]`` is the key path down to that component."""


def _grouped(positions: Iterable[tuple[str, int]]) -> Cursors:
    """Cursors from ``(wanted, start)`` pairs, ``start`` where a node's child component begins in
    ``wanted``: grouped by that component's text, each with where it ends."""
    cursors: Cursors = {}
    for wanted, start in positions:
        end = wanted.find("/", start)
        if end == -1:
            end = len(wanted)
        cursors.setdefault(wanted[start:end], []).append((wanted, end))
    return cursors


def checked_keys(keys: Any) -> list[str]:
    """``keys`` of a partial load as a list of key strings: a lone ``str`` is one key
    (``keys="model"``), not the characters it iterates to; ``TypeError`` names a value that is no
    key string (an int index, None) or a ``keys`` that is no iterable of them (``bytes`` iterates
    to ints). A ``str`` subclass (``numpy.str_``, a ``str`` enum member) counts as its text."""
    if isinstance(keys, str):
        return [str.__str__(keys)]
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raise TypeError(f"keys must be a key string or an iterable of key strings, not "
                        f"{type(keys).__name__} ({bytes(keys[:80])!r}), which iterates to ints: "
                        f"pass its decoded text")
    try:
        entries = list(keys)
    except TypeError:
        raise TypeError(f"keys must be a key string or an iterable of key strings, not "
                        f"{type(keys).__name__} ({keys!r:.80})") from None
    for entry in entries:
        if not isinstance(entry, str):
            raise TypeError(f"keys entry {entry!r:.80} of type {type(entry).__name__} is not a key string: "
                            f"keys are strings such as 'model/layer.weight' or 'optimizer/state/0' "
                            f"(a list index or int dict key is written in decimal)")
    return [str.__str__(entry) for entry in entries]


_MISSING = object()


@collector.paused()
def unflatten(tree: Any, arrays: dict[int, Any], selection: Selection | None = None) -> Any:
    """Rebuild the state from its tree; ``arrays`` maps array ids to finished arrays.

    With a ``selection``, dict entries outside it are left out and list/tuple slots outside it
    become None, so every selected value keeps its position in the structure.
    """
    if selection is None or selection.keys is None:
        return _build_all(tree, arrays)
    inside, cursors = selection.start()
    value = _build(tree, selection, cursors, inside, arrays)
    return _unselected_root(tree, arrays) if value is _MISSING else value


def _unselected_root(tree: dict[str, Any], arrays: dict[int, Any]) -> Any:
    """The root when the selection holds nothing of it (``keys=[]``): a container keeps its type,
    as any other unselected level does (an empty dict, an OrderedDict with its ``_metadata``, list
    and tuple slots None); a lone value is None."""
    kind = tree["t"]
    if kind == "dict":
        return _build({**tree, "items": []}, None, None, True, arrays)
    if kind in ("list", "tuple"):
        slots = [None] * len(tree["items"])
        return slots if kind == "list" else tuple(slots)
    return None


def _build(node: dict[str, Any], selection: Selection | None, cursors: Cursors | None,
           inside: bool, arrays: dict[int, Any]) -> Any:
    """One node of ``unflatten``: ``inside`` the selection, or on the way to the requested keys
    that ``cursors`` still follow (None without a selection); ``_MISSING`` when neither. One
    Python frame per level: the format allows trees hundreds of levels deep."""
    if not inside and not cursors:
        return _MISSING
    kind = node["t"]
    if kind == "tensor":
        return arrays[node["id"]] if inside else _MISSING
    if kind in ("list", "tuple"):
        items = []
        for i, child in enumerate(node["items"]):
            child_cursors, child_inside = _descend(selection, cursors, inside, i)
            item = _build(child, selection, child_cursors, child_inside, arrays)
            items.append(None if item is _MISSING else item)
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        ordered = node.get("cls") == "OrderedDict"
        result: dict[Any, Any] = collections.OrderedDict() if ordered else {}
        for key_node, child in node["items"]:
            dict_key = decode_scalar(key_node)
            child_cursors, child_inside = _descend(selection, cursors, inside, dict_key)
            value = _build(child, selection, child_cursors, child_inside, arrays)
            if value is not _MISSING:
                result[dict_key] = value
        if ordered and "meta" in node:
            result._metadata = _build(node["meta"], None, None, True, arrays)  # type: ignore[attr-defined]
        return result
    return decode_scalar(node) if inside else _MISSING


def _build_all(node: dict[str, Any], arrays: dict[int, Any]) -> Any:
    """``_build`` of a node inside the selection and with no cursors (every node of a load without
    ``keys``): the same result without the selection bookkeeping per child. One Python frame per
    level, as ``_build`` (so no comprehensions, which would add one)."""
    kind = node["t"]
    if kind == "tensor":
        return arrays[node["id"]]
    if kind == "dict":
        ordered = node.get("cls") == "OrderedDict"
        result: dict[Any, Any] = collections.OrderedDict() if ordered else {}
        for key_node, child in node["items"]:
            result[decode_scalar(key_node)] = _build_all(child, arrays)
        if ordered and "meta" in node:
            result._metadata = _build_all(node["meta"], arrays)  # type: ignore[attr-defined]
        return result
    if kind == "list" or kind == "tuple":
        items = []
        for child in node["items"]:
            items.append(_build_all(child, arrays))
        return items if kind == "list" else tuple(items)
    return decode_scalar(node)


def _descend(selection: Selection | None, cursors: Cursors | None, inside: bool,
             component: Any) -> tuple[Cursors | None, bool]:
    """(cursors, inside) of the child at ``component``; the cursors advance only while some
    remain (requested keys below an already selected node are still marked as matched)."""
    if selection is None or not cursors:
        return None, inside
    reached, following = selection.step(cursors, component)
    return following, inside or reached


def walk_tree(tree: Any) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """Every node of a structure tree with its key path (container keys from the root), parents
    before children. One path list is kept for the open containers and copied per node yielded:
    a path per *pending* node would hold depth x breadth entries at once."""
    yield tree, []
    path: list[Any] = []
    stack = [_children(tree)]
    while stack:
        # resume the innermost open container where it stopped; a child container is entered at
        # once (break), and the container is closed when its children run out (else)
        for key, child in stack[-1]:
            yield child, path + [key]
            if child["t"] in _CONTAINERS:
                path.append(key)
                stack.append(_children(child))
                break
        else:
            stack.pop()
            if path:
                path.pop()


_CONTAINERS = frozenset(("list", "tuple", "dict"))


def _children(node: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(key, child) of each child of a structure node; none for a leaf."""
    if node["t"] in ("list", "tuple"):
        return enumerate(node["items"])
    if node["t"] == "dict":
        return ((decode_scalar(key), child) for key, child in node["items"])
    return iter(())


class KeyPaths:
    """Small integer identities of key paths, interned component by component: a path's identity
    is found from its parent's in the time of its last component, and holds no copy of the
    prefix, so matching every plain value of a target against a checkpoint costs time and memory
    linear in their size whatever the depth or key lengths. Paths compare by their escaped
    components (``join_key``'s spelling)."""

    ROOT = 0
    SHOWN = 200
    """Characters of a key string shown in a message."""

    def __init__(self) -> None:
        self._links: list[tuple[int, str]] = [(-1, "")]
        self._ids: dict[tuple[int, str], int] = {}
        self._summaries: dict[int, tuple[str, str, int]] = {}
        self._tops: dict[int, int] = {}

    def child(self, parent: int, component: Any) -> int:
        """The identity of ``component`` below the path ``parent``."""
        link = (parent, escape_key(component))
        node = self._ids.get(link)
        if node is None:
            node = self._ids[link] = len(self._links)
            self._links.append(link)
        return node

    def of(self, path: Iterable[Any]) -> int:
        """The identity of a path of container keys."""
        node = self.ROOT
        for component in path:
            node = self.child(node, component)
        return node

    def top(self, node: int) -> int:
        """The identity of the first component of ``node``'s path (``ROOT`` for the root).
        Kept for every node it passes, so asking it for every node of a tree costs linear time
        whatever the depth."""
        chain = []
        while node != self.ROOT and node not in self._tops:
            parent = self._links[node][0]
            if parent == self.ROOT:
                self._tops[node] = node
                break
            chain.append(node)
            node = parent
        top = self._tops.get(node, self.ROOT)
        for passed in chain:
            self._tops[passed] = top
        return top

    def key(self, node: int) -> str:
        """The key string of ``node`` (as ``join_key``) for a message: beyond ``SHOWN``
        characters, its start and end around ``...``. Built from its parent's summary, which is
        kept: the cost per key is bounded whatever the depth and the key lengths."""
        if node == self.ROOT:
            return ""
        parent, part = self._links[node]
        head, tail, length = self._extend(self._summary(parent), part, parent == self.ROOT)
        return head if length <= self.SHOWN else f"{head[:self.SHOWN // 2]}...{tail}"

    def _summary(self, node: int) -> tuple[str, str, int]:
        """(first ``SHOWN`` characters, last ``SHOWN // 2`` characters, length) of the key string
        of a container's path, kept for its other children."""
        chain = []
        while node != self.ROOT and node not in self._summaries:
            chain.append(node)
            node = self._links[node][0]
        summary = self._summaries.get(node, ("", "", 0))
        for node in reversed(chain):
            parent, part = self._links[node]
            summary = self._summaries[node] = self._extend(summary, part, parent == self.ROOT)
        return summary

    def _extend(self, summary: tuple[str, str, int], part: str, first: bool) -> tuple[str, str, int]:
        """The summary of a path from its parent's and its last escaped component."""
        head, tail, length = summary
        separator = "" if first else "/"
        if length < self.SHOWN:
            head = (head + separator + part[:self.SHOWN])[:self.SHOWN]
        tail = (tail + separator + part[-(self.SHOWN // 2):])[-(self.SHOWN // 2):]
        return head, tail, length + len(separator) + len(part)

