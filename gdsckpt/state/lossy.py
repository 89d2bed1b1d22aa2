"""Opt-in lossy compression: error-bounded rounding of chosen floating tensors before a save.

``gdsckpt.save(state, path, lossy={"*.exp_avg_sq": 1e-2, "*.exp_avg": 1e-3})`` rounds every
floating array whose key matches a pattern to a grid, then stores the rounded values through the
normal lossless pipeline (byte planes + zstd / ANS / ...), where their zeroed low mantissa bits
compress well. Lossless is the default and stays so: without ``lossy=`` every array is bit-exact.

The rule (mode ``"grid"``), per array:

- ``abs_bound = rel * max(|x|)`` over the array's finite elements (``rel``: the pattern's relative
  bound), computed in float64;
- ``step`` = the largest power of two ``<= 2 * abs_bound``; each finite ``x`` becomes
  ``round(x / step) * step`` (round half to even), so ``|error| <= step / 2 <= abs_bound``. This
  is the quantizer of nvCOMP Bitcomp's lossy floating-point mode ("delta is rounded down to the
  nearest power of two ... the maximum error is <= delta/2", with delta = 2 * abs_bound), here
  computed with torch (on the tensor's own device) or NumPy ops so any codec can follow it;
- NaN and +-inf keep their exact bit patterns (NaN payloads included), a zero keeps its sign and a
  negative value that rounds to zero becomes -0.0; an element whose rounded value would overflow
  the dtype keeps its original value;
- the error of every finite element is measured in float64 (exact: the difference of two nearby
  floats); should it exceed ``abs_bound`` anywhere, the array is stored losslessly instead.

The rule of mode ``"mantissa"`` (a rule ``("mantissa", rel)``), per element: round to nearest
(ties to even) keeping ``m = ceil(log2(1/rel)) - 1`` mantissa bits, on the bit pattern, so
``|error| <= 2**-(m+1) * |x| <= rel * |x|``: every element keeps ``rel`` of its own magnitude, zeros
stay zeros and small entries stay nonzero. Elements where that would not hold (subnormals, a
carry into infinity), NaN and inf keep their bits. The record's ``abs_bound`` is then
``rel * max(|x|)`` (a bound on the absolute error too). Meant for arrays spanning many orders of
magnitude, Adam's ``exp_avg_sq`` first (below); its ratio is lower than the grid's (the exponent
bits stay).

Which arrays: torch tensors (CPU or CUDA) and NumPy arrays of dtype float16, bfloat16, float32 or
float64. Other dtypes, CuPy and JAX arrays and an array with no finite nonzero element are stored
losslessly. An entry that aliases another array (the same memory, e.g. a tied weight) follows the
array it aliases whether a rule names it or not: rounded with it, and then listed in
``SaveReport.lossy`` and counted by the load warning too, or stored losslessly with it. The rounded
values are computed as the save pipeline reads each chunk (the caller's array is never
modified, and no rounded copy of it is held: a pass for its largest magnitude and a pass checking
every element's error come first, ``CHUNK_ELEMENTS`` at a time, so memory stays bounded whatever
the array's size).

On the GPU engine with a GPU-only codec (ANS, the GPU default), the grid-rounded float32 and
float16 arrays are stored as nvCOMP Bitcomp lossy streams (``nvcomp.bitcomp-lossy/1``, with
``delta`` = ``step``): Bitcomp's quantizer is this grid, and its coder of the quantized integers
beats byte planes + ANS on the rounded floats by about 2x and Zstd by 12-20% (AdamW moments:
6.64x against 3.39x at 1e-2, 4.13x against 2.36x at 1e-3; docs/performance.md). Every
stream is decoded again before it is written and must give the rounded values bit for bit,
except that zeros come back +0.0; a chunk that fails takes the codec's own path. Such files need
a GPU to load (as ANS files do); ``LossyPolicy(..., bitcomp=False)`` keeps the codec's streams,
and a portable codec (``codec="zstd"``) is never replaced.

A lossy array's index record carries an informative ``lossy`` member (``{"mode": "grid",
"rel_bound": ..., "abs_bound": ..., "max_error": ...}``, docs/format.md section 6.5); decoding is
unchanged (the stored bytes are the rounded values), so every reader loads these files. Loading
one warns (``LossyWarning``) with the number of lossy entries loaded; ``gdsckpt.inspect`` and
``gdsckpt inspect`` show each one's bound and measured error.

Caution with Adam's second moment in mode ``grid``: the bound is relative to the array's largest magnitude, and
``exp_avg_sq`` spans many orders of magnitude, so its small entries round to zero and the next
update ``m / (sqrt(v) + eps)`` of those entries explodes. Measured on TinyGPT (width 256, depth 4,
AdamW, 5 and 20 steps): rounding ``exp_avg_sq`` at 1e-2 or 1e-3 zeroed 7-31% of its nonzero
entries and changed the update by 5e3-1.3e4 times its norm; rounding only ``exp_avg`` changed it
by 15-35% (1e-2) and 2-5% (1e-3). Check a policy on your own state (``grid_quantize`` and a
simulated step) before relying on it for resuming; mode ``mantissa`` keeps every entry within
``rel`` of itself and is the one to use for ``exp_avg_sq``.

Also here: ``compare_modes`` (an in-memory estimate of grid rounding against blockwise 8-bit
quantization, which no file stores) and ``sensitivity`` (how a model's loss moves when groups of
its tensors are rounded).
"""

from __future__ import annotations

import fnmatch
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from ..errors import LossyWarning
from . import FlatState, NumpySource, TorchSource
from .arrays import read_on_cupy_stream

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""Dtypes a policy rounds; arrays of other dtypes are stored losslessly whatever their key."""
MODES = ("grid", "mantissa")
"""Lossy modes a save can use: ``grid`` (error bounded by ``rel`` times the array's largest
magnitude) and ``mantissa`` (error bounded by ``rel`` times each element's own magnitude)."""
_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}
CHUNK_ELEMENTS = 1 << 21
"""Elements rounded per step: the float64 temporaries of one step (~40 bytes per element) stay
near 80 MB on the host or the device, whatever the array's size."""



def key_matches(pattern: str, key: str) -> bool:
    """Whether a lossy policy's key pattern selects ``key`` (``fnmatch``, with ``/`` or ``.``)."""
    # Key strings separate containers with "/" ("optimizer/state/0/exp_avg"); users think of them
    # dotted, as torch names them ("optimizer.state.*.exp_avg"): either spelling matches.
    return fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key.replace("/", "."), pattern)


def checked_rel(rel: Any, pattern: str) -> float:
    """``rel`` as a float, or ``ValueError`` unless it is a relative bound in (0, 1)."""
    # any real number (a NumPy float32 too), not a bool
    if isinstance(rel, bool) or not isinstance(rel, numbers.Real) or not 0 < float(rel) < 1:
        raise ValueError(f"relative error bound of {pattern!r} must be a number in (0, 1), got {rel!r}")
    return float(rel)


def _check_rule(value: Any, pattern: str, default_mode: str) -> tuple[str, float]:
    """A rule's (mode, relative bound): a bare bound takes the policy's mode; ``(mode, bound)``
    chooses one for this pattern."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        if value[0] not in MODES:
            raise ValueError(f"lossy mode {value[0]!r} of {pattern!r} is not one of {MODES}")
        return value[0], checked_rel(value[1], pattern)
    return default_mode, checked_rel(value, pattern)


@dataclass(frozen=True)
class LossyPolicy:
    """Which arrays a save rounds, and how far: ``rules`` maps key patterns to relative bounds.

    ``LossyPolicy({"*.exp_avg_sq": 1e-2, "optimizer.state.*.exp_avg": 1e-3})``. A pattern is an
    ``fnmatch`` pattern (``*``, ``?``, ``[...]``; case-sensitive; ``*`` also crosses separators)
    matched against the key string (``"optimizer/state/0/exp_avg"``) and against its dotted
    spelling (``"optimizer.state.0.exp_avg"``); the first matching pattern, in ``rules`` order,
    sets the bound. A bound ``rel`` in (0, 1) means ``abs_bound = rel * max(|finite x|)`` for
    each array (mode ``"grid"``), or ``|error| <= rel * |x|`` for each element (mode
    ``"mantissa"``). ``mode`` is the policy's default; a rule's value may also be a pair
    ``(mode, rel)``: ``{"*.exp_avg": 1e-2, "*.exp_avg_sq": ("mantissa", 1e-2)}``.

    ``bitcomp`` (default True): where the GPU engine saves with a GPU-only codec (ANS, the GPU
    default, or another nvCOMP-only one), store the grid-rounded float32 / float16 arrays as
    nvCOMP Bitcomp lossy streams (``nvcomp.bitcomp-lossy/1``, 12-20% smaller than Zstd on the
    rounded values and about twice ANS's ratio on AdamW moments), each chunk decoded again
    on the GPU and checked to return the grid's values before it is written (else it is stored
    as the codec would). False keeps the codec's own streams. Portable codecs are never replaced.
    """

    rules: Mapping[str, float] | Sequence[tuple[str, float]]
    mode: str = "grid"
    bitcomp: bool = True

    def __post_init__(self) -> None:
        pairs = list(self.rules.items()) if isinstance(self.rules, Mapping) else list(self.rules)
        checked = []
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str):
                raise TypeError(f"a lossy rule must be a (pattern, relative bound) pair, got {pair!r}")
            if self.mode not in MODES:
                raise ValueError(f"lossy mode {self.mode!r} is not one of {MODES}")
            checked.append((pair[0], _check_rule(pair[1], pair[0], self.mode)))
        if self.mode not in MODES:
            raise ValueError(f"lossy mode {self.mode!r} is not one of {MODES}")
        if not isinstance(self.bitcomp, bool):
            raise TypeError(f"bitcomp must be True or False, got {self.bitcomp!r}")
        object.__setattr__(self, "rules", tuple(checked))  # frozen: a tuple, hashable and ordered

    @classmethod
    def of(cls, value: LossyPolicy | Mapping[str, float]) -> LossyPolicy:
        """``value`` as a policy: a ``LossyPolicy`` itself, or a dict of pattern -> relative bound."""
        if isinstance(value, LossyPolicy):
            return value
        if isinstance(value, Mapping):
            return cls(value)
        raise TypeError(f"lossy must be a LossyPolicy or a dict of pattern -> relative bound, "
                        f"got {type(value).__qualname__}")

    def bound_for(self, key: str) -> float | None:
        """The relative bound of the first pattern matching ``key``, or None (lossless)."""
        rule = self.rule_for(key)
        return rule[1] if rule is not None else None

    def checked_rules(self) -> tuple[tuple[str, tuple[str, float]], ...]:
        """The rules as ``__post_init__`` stored them: (pattern, (mode, relative bound)) pairs."""
        return cast("tuple[tuple[str, tuple[str, float]], ...]", self.rules)

    def rule_for(self, key: str) -> tuple[str, float] | None:
        """(mode, relative bound) of the first pattern matching ``key``, or None (lossless)."""
        for pattern, rule in self.checked_rules():
            if key_matches(pattern, key):
                return rule
        return None


@dataclass(frozen=True)
class GridResult:
    """An array rounded to a grid (``grid_quantize``): the new values and what bounds them."""

    values: Any
    """A new C-contiguous array of the input's type, dtype (native byte order), shape and device."""
    rel_bound: float
    abs_bound: float
    step: float
    max_error: float
    """The largest ``|rounded - original|`` over the finite elements, measured in float64."""
    mode: str = "grid"

    def record(self) -> dict[str, Any]:
        """The index record's ``lossy`` member."""
        return {"mode": self.mode, "rel_bound": self.rel_bound, "abs_bound": self.abs_bound,
                "max_error": self.max_error}


def _grid_step(amax: float, rel: float) -> tuple[float, float] | None:
    """(abs_bound, step) for an array whose largest finite magnitude is ``amax``; None when the
    bound is zero (nothing to round)."""
    abs_bound = rel * amax
    if not abs_bound > 0 or not math.isfinite(abs_bound):
        return None
    # abs_bound = m * 2**e with m in [0.5, 1): the largest power of two <= 2 * abs_bound is 2**e.
    # Capped at 2**1023 (float64's largest power of two) rather than computing 2 * abs_bound,
    # which overflows for bounds near float64's maximum.
    _mantissa, exponent = math.frexp(abs_bound)
    return abs_bound, math.ldexp(1.0, min(exponent, 1023))


_TORCH_INT = {2: "int16", 4: "int32", 8: "int64"}
_NUMPY_INT = {2: np.int16, 4: np.int32, 8: np.int64}


# Per-part rounding: pure functions of one 1-D run of elements (a chunk), so that a save can
# round each chunk as the pipeline reads it (``RoundedSource``) and hold no rounded copy of the
# array, and ``grid_quantize`` can build the whole rounded array from the same code.

def _grid_part_torch(part: Any, step: float) -> tuple[Any, Any]:
    """(rounded copy of ``part``, largest error as a 0-d float64 tensor) under the grid rule."""
    import torch

    x = part.to(torch.float64)  # exact for every float dtype here
    # x / step and * step are exact (step is a power of two); copysign keeps -0.0 and makes a
    # negative value that rounds to zero -0.0.
    rounded = torch.copysign(torch.round(x / step) * step, x).to(part.dtype)
    back = rounded.to(torch.float64)
    # Non-finite inputs keep their bits; so does a finite one whose rounding overflowed.
    keep = torch.isfinite(x) & torch.isfinite(back)
    worst = torch.where(keep, (back - x).abs(), 0).amax() if part.numel() else x.new_zeros(())
    # Selected as integers: a float select could canonicalise a NaN's payload.
    ints = getattr(torch, _TORCH_INT[part.element_size()])
    out = torch.where(keep, rounded.view(ints), part.view(ints)).view(part.dtype)
    return out, worst


def _mantissa_part_torch(part: Any, rel: float, drop: int) -> tuple[Any, Any]:
    """(rounded copy of ``part``, largest error) under the mantissa rule: each finite element
    rounded to nearest (ties to even) at ``drop`` fewer mantissa bits, as integers on its bit
    pattern, on its device. Elements whose rounding would leave the bound (subnormals, which have
    fewer significant bits, or a carry into infinity) keep their bits, as do NaN and inf."""
    import torch

    width = part.element_size()
    ints = part.view(getattr(torch, _TORCH_INT[width]))
    sign = -(1 << (8 * width - 1))  # the sign bit as a signed integer of that width
    wide = ints.to(torch.int64)  # sign-extended; the masks below fit int64 at every width
    magnitude = wide & (-sign - 1)
    half, lsb = 1 << (drop - 1), (magnitude >> drop) & 1
    rounded = ((magnitude + half - 1 + lsb) >> drop) << drop
    candidate = ((wide & sign) | rounded).to(ints.dtype)
    x = part.to(torch.float64)
    back = candidate.view(part.dtype).to(torch.float64)
    error = (back - x).abs()
    keep = torch.isfinite(x) & torch.isfinite(back) & (error <= rel * x.abs())
    worst = torch.where(keep, error, 0).amax() if part.numel() else x.new_zeros(())
    return torch.where(keep, candidate, ints).view(part.dtype), worst


def _grid_part_numpy(part: np.ndarray, step: float) -> tuple[np.ndarray, float]:
    """``_grid_part_torch`` for a native-order NumPy run of elements."""
    with np.errstate(all="ignore"):  # overflow to inf is expected and handled
        x = part.astype(np.float64)
        rounded = np.copysign(np.round(x / step) * step, x).astype(part.dtype)
        back = rounded.astype(np.float64)
        keep = np.isfinite(x) & np.isfinite(back)
        worst = float(np.max(np.abs(back - x), where=keep, initial=0.0))
    ints = _NUMPY_INT[part.dtype.itemsize]
    out = part.copy()
    np.copyto(out.view(ints), rounded.view(ints), where=keep)
    return out, worst


def _mantissa_part_numpy(part: np.ndarray, rel: float, drop: int) -> tuple[np.ndarray, float]:
    """``_mantissa_part_torch`` for a native-order NumPy run of elements."""
    unsigned = {2: np.uint16, 4: np.uint32, 8: np.uint64}[part.dtype.itemsize]
    bits = part.view(unsigned)
    sign = unsigned(1) << unsigned(8 * part.dtype.itemsize - 1)
    with np.errstate(all="ignore"):  # overflow and signalling NaNs are expected and handled
        magnitude = (bits & ~sign).astype(np.uint64)
        half, lsb = np.uint64(1 << (drop - 1)), (magnitude >> np.uint64(drop)) & np.uint64(1)
        rounded = ((magnitude + half - np.uint64(1) + lsb) >> np.uint64(drop)) << np.uint64(drop)
        candidate = (bits & sign) | rounded.astype(unsigned)
        x = part.astype(np.float64)
        back = candidate.view(part.dtype).astype(np.float64)
        error = np.abs(back - x)
        keep = np.isfinite(x) & np.isfinite(back) & (error <= rel * np.abs(x))
        worst = float(np.max(error, where=keep, initial=0.0))
    out = part.copy()
    np.copyto(out.view(unsigned), candidate, where=keep)
    return out, worst


@dataclass(frozen=True)
class Rounding:
    """How one array is rounded: the record, and the per-part function a ``RoundedSource`` runs."""

    mode: str
    rel_bound: float
    abs_bound: float
    step: float
    max_error: float
    round_part: Callable[[Any], Any]
    """A 1-D run of the array's elements (torch tensor or native-order NumPy array) -> rounded copy."""
    bitcomp: bool = True
    """Whether the GPU engine may store the rounded values as Bitcomp lossy streams
    (``LossyPolicy.bitcomp``; mode ``grid`` only)."""

    def record(self) -> dict[str, Any]:
        """The index record's ``lossy`` member."""
        return {"mode": self.mode, "rel_bound": self.rel_bound, "abs_bound": self.abs_bound,
                "max_error": self.max_error}


def _parts(array: Any, torch_kind: bool) -> Iterable[Any]:
    """The array's elements in C order, ``CHUNK_ELEMENTS`` at a time (1-D runs; native order)."""
    from . import array_range, torch_range

    n = array.numel() if torch_kind else array.size
    for start in range(0, n, CHUNK_ELEMENTS):
        stop = min(n, start + CHUNK_ELEMENTS)
        if torch_kind:
            yield torch_range(array.detach(), start, stop)
        else:
            part = array_range(array, start, stop, np)
            yield part if part.dtype.isnative else part.astype(part.dtype.newbyteorder("="))


def plan_rounding(array: Any, mode: str, rel: float) -> Rounding | None:
    """Measure how ``array`` (a torch tensor on any device, or a NumPy array) rounds under
    ``mode`` at ``rel`` without keeping a rounded copy: one pass for the largest magnitude, one
    computing every part's error and discarding it. None where a save stores the array losslessly
    (other dtypes, nothing to round, a bound the measurement breaks)."""
    rel = checked_rel(rel, "plan_rounding")
    dtype_name = float_dtype_name(array)
    if dtype_name not in FLOAT_DTYPES or mode not in MODES:
        return None
    torch_kind = not isinstance(array, np.ndarray)
    amax = 0.0
    for part in _parts(array, torch_kind):
        if torch_kind:
            import torch

            finite = torch.where(torch.isfinite(part), part.abs(), 0)
            amax = max(amax, float(finite.amax().double())) if part.numel() else amax
        else:
            with np.errstate(invalid="ignore"):  # a signalling NaN raises the flag when converted
                x = part.astype(np.float64)
            amax = max(amax, float(np.max(np.abs(x), where=np.isfinite(x), initial=0.0)))
    if mode == "grid":
        bound = _grid_step(amax, rel)
        if bound is None:
            return None
        abs_bound, step = bound
        function = _grid_part_torch if torch_kind else _grid_part_numpy
        round_part: Callable[[Any], Any] = lambda part: function(part, step)[0]  # noqa: E731
        errors = (function(part, step)[1] for part in _parts(array, torch_kind))
    else:
        drop = _mantissa_drop(dtype_name, rel)
        if drop == 0 or amax == 0:
            return None
        abs_bound, step = rel * amax, 0.0
        mantissa_part = _mantissa_part_torch if torch_kind else _mantissa_part_numpy
        round_part = lambda part: mantissa_part(part, rel, drop)[0]  # noqa: E731
        errors = (mantissa_part(part, rel, drop)[1] for part in _parts(array, torch_kind))
    max_error = max((float(e) for e in errors), default=0.0)
    if not max_error <= abs_bound:
        return None
    return Rounding(mode, rel, abs_bound, step, max_error, round_part)


def _round_whole(array: Any, rounding: Rounding) -> Any:
    """The whole rounded array (new, C-contiguous, native order, same device)."""
    torch_kind = not isinstance(array, np.ndarray)
    parts = [rounding.round_part(part) for part in _parts(array, torch_kind)]
    if torch_kind:
        import torch

        flat = torch.cat(parts) if parts else array.detach().reshape(-1).clone()
        return flat.reshape(array.shape)
    dtype = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    return flat.reshape(array.shape)


def quantize_whole(array: Any, rel: float, mode: str) -> GridResult | None:
    """The whole array rounded under ``mode`` (``plan_rounding``'s rules), or None."""
    rounding = plan_rounding(array, mode, rel)
    if rounding is None:
        return None
    return GridResult(_round_whole(array, rounding), rounding.rel_bound, rounding.abs_bound, rounding.step,
                      rounding.max_error, mode=mode)


def _mantissa_drop(dtype_name: str, rel: float) -> int:
    """Low mantissa bits to clear so that rounding to nearest errs by at most ``rel`` relative:
    keeping ``m`` bits bounds the error by 2**-(m+1) of the value, so m = ceil(log2(1/rel)) - 1."""
    keep = max(0, math.ceil(-math.log2(rel)) - 1)
    return max(0, _MANTISSA_BITS[dtype_name] - keep)


class RoundedSource:
    """An ``ArraySource`` yielding an array's elements rounded by a ``Rounding``, computed range by
    range as the save pipeline reads them: the save holds no rounded copy of the array."""

    def __init__(self, source: Any, rounding: Rounding):
        self.source = source
        self.rounding = rounding
        dtype = float_dtype_name(source.tensor if isinstance(source, TorchSource) else source.array)
        if dtype is None:
            raise TypeError(f"only torch and NumPy float arrays are rounded, not {type(source).__name__}")
        self.dtype: str = dtype
        """The array's dtype name (``"float32"``)."""
        self.nbytes, self.itemsize = source.nbytes, source.itemsize
        self.plane_width, self.on_device = source.plane_width, source.on_device

    def _rounded(self, start: int, stop: int) -> Any:
        from . import array_range, torch_range

        first, last = start // self.itemsize, stop // self.itemsize
        if isinstance(self.source, TorchSource):
            return self.rounding.round_part(torch_range(self.source.tensor, first, last))
        part = array_range(self.source.array, first, last, np)
        return self.rounding.round_part(part if part.dtype.isnative else part.astype(part.dtype.newbyteorder("=")))

    def _steps(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``[start, stop)`` in ranges of at most ``CHUNK_ELEMENTS`` elements: rounding a whole
        chunk at once made float64 temporaries of 20-60 bytes per element beside it, per codec
        thread (about 1 GiB more than a lossless save for 64 MiB chunks), outside every bound."""
        step = CHUNK_ELEMENTS * self.itemsize
        return [(low, min(stop, low + step)) for low in range(start, stop, step)] or [(start, stop)]

    def _stepped(self, start: int, stop: int, step: Callable[[int, int], Any], empty: Callable[[int], Any]) -> Any:
        """``step(low, high)`` over ``_steps``, joined into ``empty(stop - start)``."""
        steps = self._steps(start, stop)
        if len(steps) == 1:
            return step(start, stop)
        out = empty(stop - start)
        for low, high in steps:
            out[low - start:high - start] = step(low, high)
        return out

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        """Rounded bytes ``[start, stop)`` in host memory (little-endian)."""
        return cast(np.ndarray, self._stepped(start, stop, self._host_step,
                                              lambda n: np.empty(n, dtype=np.uint8)))

    def _host_step(self, start: int, stop: int) -> np.ndarray:
        rounded = self._rounded(start, stop)
        if isinstance(rounded, np.ndarray):
            return NumpySource(rounded, self.dtype).host_bytes(0, stop - start)
        return TorchSource(rounded, self.dtype).host_bytes(0, stop - start)

    def device_bytes(self, start: int, stop: int) -> Any:
        """Rounded bytes ``[start, stop)`` on the array's device (CuPy)."""

        def empty(n: int) -> Any:
            import cupy

            return cupy.empty(n, dtype=cupy.uint8)

        return self._stepped(start, stop, self._device_step, empty)

    def _device_step(self, start: int, stop: int) -> Any:
        rounded = self._rounded(start, stop)
        if isinstance(rounded, np.ndarray):
            import cupy

            return cupy.asarray(NumpySource(rounded, self.dtype).host_bytes(0, stop - start))
        if rounded.is_cuda:
            # torch rounded on its own current stream; the GPU engine reads on another one, and
            # ``rounded`` is dropped once that read is queued
            read_on_cupy_stream(rounded, made=True)
        return TorchSource(rounded, self.dtype).device_bytes(0, stop - start)


def float_dtype_name(array: Any) -> str | None:
    """The dtype name of a torch tensor or NumPy array (``"bfloat16"``), None for other arrays."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        return str(array.dtype).removeprefix("torch.")
    if isinstance(array, np.ndarray):
        return array.dtype.name
    return None


def grid_quantize(array: Any, rel: float) -> GridResult | None:
    """Round a torch tensor (CPU or CUDA, on its own device) or NumPy array to the grid of
    relative bound ``rel`` (module docstring) into a new array.

    Returns None where a save would store the array losslessly: a dtype other than float16,
    bfloat16, float32 and float64, no finite nonzero element, or a measured error above the bound.
    """
    rel = checked_rel(rel, "grid_quantize")
    if float_dtype_name(array) not in FLOAT_DTYPES:
        return None
    return quantize_whole(array, rel, "grid")


def apply_policy(flat: FlatState, policy: LossyPolicy | Mapping[str, float]) -> list[str]:
    """Round the arrays of a flattened state that ``policy`` selects (``save(lossy=...)``): their
    sources now yield rounded bytes, computed chunk by chunk as the pipeline reads them
    (``RoundedSource``: no rounded copy of an array is held), and their ``lossy`` holds the
    record member. Returns the keys of the arrays rounded and of the entries that alias them,
    in state order: an alias is the same memory as its array and loads rounded too, whether a
    rule names it or not."""
    policy = LossyPolicy.of(policy)
    rounded: set[int] = set()
    for number, array in enumerate(flat.arrays):
        if array.alias is not None or array.source is None or array.dtype not in FLOAT_DTYPES:
            continue
        rule = policy.rule_for(array.key)
        if rule is None:
            continue
        mode, rel = rule
        if isinstance(array.source, TorchSource):
            rounding = plan_rounding(array.source.tensor, mode, rel)
        elif isinstance(array.source, NumpySource) and array.kind == "numpy":
            rounding = plan_rounding(np.asarray(array.source.array), mode, rel)
        else:
            continue  # CuPy and JAX arrays: lossless
        if rounding is not None:
            rounding = replace(rounding, bitcomp=policy.bitcomp)
            array.source = RoundedSource(array.source, rounding)
            array.lossy = rounding.record()
            rounded.add(number)
    if not rounded:
        return []
    return [array.key for number, array in enumerate(flat.arrays)
            if number in rounded or array.alias in rounded]


__all__ = [
    "FLOAT_DTYPES", "GridResult", "LossyPolicy", "LossyWarning", "apply_policy", "grid_quantize",
]
