"""``load_into``: restore a checkpoint into existing tensors, modules and optimizers, in place.

Every difference between the target and the file is found before anything is written; tensors
that share memory are restored in key order, so the last key wins, as in ``load_state_dict``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import collector
from ..config import Config
from ..errors import (
    StateMismatchError,
)
from ..format import TensorRecord
from ..io import StorageReader
from ..pipeline.load import OpenedFile, overlapping
from ..state import (
    KeyPaths,
    Selection,
    TorchTarget,
    decode_scalar,
    join_key,
    plain_key,
    torch_dtype_name,
    unflatten,
    writable,
)
from ..state.dtypes import numpy_dtype_name, torch_dtype
from .checkpoint import new_target, restore_arrays, stored_id, warn_lossy
from .reports import Progress
from .resolve import (
    Source,
    caller_level,
    lead_read,
    open_checked,
    open_data_reader,
    open_reader,
    resolve_config,
    restore_gpu_device,
)


def load_into(target: Any, path: Source, *, strict: bool | str = True, config: Config | None = None,
              progress: Progress | None = None) -> Any:
    """Copy a checkpoint into existing tensors, in place, and return ``target``.

    ``target`` is an ``nn.Module`` (its state_dict tensors are filled in place), an
    ``Optimizer`` (restored with ``optimizer.load_state_dict``, which also works on a fresh
    optimizer that has no state yet), a tensor-holding state dict, or a dict / list nesting any
    of these (``{"model": model, "optimizer": optimizer, "step": 0}``): key paths in ``target``
    correspond to key paths in the checkpoint. Plain values (ints, floats, ..., NumPy scalars) in a
    target dict or list are replaced by the checkpoint's. Tensors are filled in place (autograd's
    version counter advances, as with ``copy_``); a module's ``load_state_dict`` hooks and
    ``_load_from_state_dict`` overrides do not run (a ``UserWarning`` names the modules with hooks):
    give ``gdsckpt.load(...)`` to its ``load_state_dict`` where they matter. Any missing key, a
    shape or dtype that differs, or an optimizer whose parameter groups differ, raises
    ``StateMismatchError`` listing every difference before anything is written. Damage found while
    reading (a chunk that fails its checksum) raises ``CorruptCheckpointError`` with the targets
    partly written: tensors are filled in their own memory as chunks arrive, and the one being read
    may then hold neither its old values nor the checkpoint's. ``gdsckpt.verify`` first, where that
    matters (the ``CheckpointManager`` falls back to an older checkpoint, which overwrites them
    all).

    ``strict`` says which checkpoint entries ``target`` must hold too. ``True`` (the default):
    those that ``target`` asks for, the entries under the top-level keys a dict or list ``target``
    holds (everything, for a module, an optimizer or a tensor): ``load_into({"model": model},
    path)`` restores just the weights of a full training checkpoint, its ``optimizer`` and
    ``step`` left alone, and still refuses a ``model`` entry the module lacks, as
    ``load_state_dict`` would. ``"exact"``: every entry of the checkpoint (the state must match
    the file whole). ``False``: none (entries ``target`` does not hold are ignored anywhere).
    Entries ``target`` holds and the checkpoint lacks are an error whatever ``strict`` says.
    ``path``: anything ``gdsckpt.load`` reads. ``progress(done, total)``, if given, is called in
    the calling thread after each chunk (raw bytes so far, out of ``total``).

    Tensors of ``target`` that share memory (tied weights, views of one storage) are filled as
    ``load_state_dict`` fills them: key by key in ``target``'s order (a module's ``state_dict``
    order), so wherever two keys' memory overlaps, the later key's array is what it holds, for
    every byte. A key whose tensor a later key's covers exactly (same memory, shape, dtype and
    strides) is checked for shape and dtype but its array is not read.

    Refused with ``TypeError`` before anything is written: a tensor that cannot hold the
    checkpoint's values in its own memory (lazy, meta, sparse, lazily conjugated or negated, a
    view whose elements share memory such as ``expand`` / ``unfold`` views), and a module whose
    ``state_dict`` makes a new tensor each time it is asked (a copy: filling it would leave the
    module as it was; give the loaded state to its ``load_state_dict`` instead).
    """
    # not a decorator: its frame would be the one warnings name; the index sets the budget
    with collector.young_only():
        if strict not in (True, False, "exact"):
            raise ValueError(f"strict must be True, False or 'exact', got {strict!r}")
        cfg = resolve_config(config)
        existing: dict[str, Any] = {}
        delegates: list[_Delegate] = []
        plain_slots: list[tuple[Any, Any, int]] = []
        held: dict[int, Any] = {}
        paths = KeyPaths()  # plain values are matched by path identity: no key string per value
        _collect_targets(target, [], existing, delegates, plain_slots, paths, KeyPaths.ROOT, held)

        devices = {str(t.device) for t in existing.values()}
        device = devices.pop() if len(devices) == 1 else None
        gpu_device = restore_gpu_device(cfg, device)
        with open_reader(path, cfg, gpu_device is not None) as reader, contextlib.ExitStack() as stack:
            # tensors on one GPU: the reads start while the index is parsed
            lead = stack.enter_context(lead_read(path, cfg, reader, gpu_device, fills_device=True))
            opened = open_checked(reader)
            index = opened.index
            by_key = {record.key: i for i, record in enumerate(index.tensors)}
            delegate_nodes = {paths.of(delegate.path): delegate for delegate in delegates}
            plain_values, found, ambiguous = _plain_values(index.tree, paths, set(delegate_nodes))
            problems = []
            for key, tensor in existing.items():
                if key not in by_key:
                    problems.append(f"{key!r}: in target, missing from checkpoint")
                    continue
                record = index.tensors[by_key[key]]
                dtype = torch_dtype_name(tensor.dtype)
                if tuple(tensor.shape) != record.shape or dtype != record.dtype:
                    problems.append(f"{key!r}: target {dtype}{list(tensor.shape)} != checkpoint "
                                    f"{record.dtype}{list(record.shape)}")
            delegate_prefixes = [join_key(delegate.path) for delegate in delegates]
            for node in [*(node for _container, _slot, node in plain_slots), *held]:
                if node in ambiguous:
                    problems.append(f"{paths.key(node)!r}: the checkpoint holds two entries under this key "
                                    f"(keys of different types with one spelling): load it with gdsckpt.load")
                elif node not in plain_values:
                    problems.append(f"{paths.key(node)!r}: in target, missing from checkpoint")
                elif node in held and not _same_value(held[node], plain_values[node]):
                    problems.append(f"{paths.key(node)!r}: target {held[node]!r} != checkpoint "
                                    f"{plain_values[node]!r}, and a tuple cannot be filled in place (give a list)")
            if strict:
                scope = _asked_for(target) if strict is True else None
                for key in by_key:
                    if (key not in existing and not any(_under(key, p) for p in delegate_prefixes)
                            and _in_scope(key, scope)):
                        problems.append(f"{key!r}: in checkpoint, missing from target")
                slot_nodes = {node for _container, _slot, node in plain_slots} | set(held)
                # by identity, not key string: paths.key shortens long keys for messages
                scope_tops = None if scope is None else {paths.child(KeyPaths.ROOT, key) for key in _top_keys(target)}
                for node in plain_values:  # optimizer and extra state are left out of plain_values
                    if node not in slot_nodes and (scope_tops is None or paths.top(node) in scope_tops):
                        problems.append(f"{paths.key(node)!r}: in checkpoint, missing from target")
            delegate_ids = [i for i, record in enumerate(index.tensors)
                            if any(_under(record.key, p) for p in delegate_prefixes)]
            for node, delegate in delegate_nodes.items():
                if node not in found:
                    problems.append(f"{join_key(delegate.path)!r}: {delegate.what} missing from checkpoint")
                elif delegate.check_node is not None:
                    problem = delegate.check_node(found[node], index)
                    if problem is not None:
                        problems.append(f"{join_key(delegate.path)!r}: {problem}")
                elif delegate.check is not None:
                    problem = delegate.check(unflatten(found[node], _NO_ARRAYS))
                    if problem is not None:
                        problems.append(f"{join_key(delegate.path)!r}: {problem}")
            if problems:
                raise StateMismatchError("checkpoint does not match target:\n  " + "\n  ".join(problems))

            wanted = {by_key[key]: tensor for key, tensor in existing.items()}
            holding = {t.device.index or 0 for t in wanted.values() if t.device.type == "cuda"}
            if holding:
                from ..codecs.device import synchronize_devices

                # Work queued on the targets (an optimizer step before a rollback) lands before the
                # restore writes them, on every GPU they are on and whichever engine writes: the GPU
                # decoder waits only for its own device's current streams, the CPU engine's copies
                # run on its threads' default streams.
                synchronize_devices(holding)
            # Host targets and a file only a GPU decodes (a GPU save's default codec): decoded on the
            # GPU, its chunks read by a device reader, delivered to host memory.
            decode_on = gpu_device
            if decode_on is None:
                decode_on = restore_gpu_device(cfg, device, index, [*wanted, *delegate_ids])
            try:
                with open_data_reader(path, cfg, reader, decode_on) if decode_on != gpu_device else (
                        contextlib.nullcontext(reader)) as data_reader:
                    arrays = _restore_in_target_order(data_reader, opened, wanted, delegate_ids, cfg, decode_on,
                                                      progress, lead.read if lead is not None else None)
            finally:
                opened.close_base()
            warn_lossy(index, arrays)

        for i, tensor in wanted.items():
            if arrays[i] is not tensor:  # an alias whose data landed in another tensor
                with writable(tensor):
                    tensor.copy_(_as_torch(arrays[i]))  # or in a NumPy array: a numpy entry's alias
        for delegate in delegates:
            selection = Selection([join_key(delegate.path)] if delegate.path else None)
            subtree = unflatten(index.tree, arrays, selection)
            for part in delegate.path:
                subtree = subtree[part]
            try:
                delegate.apply(subtree)
            except (ValueError, KeyError, TypeError, RuntimeError) as err:
                raise StateMismatchError(f"{delegate.what} at {join_key(delegate.path)!r} rejected the checkpoint's "
                                         f"state: {err}") from err
        for container, slot, node in plain_slots:
            container[slot] = plain_values[node]
        return target


def _restore_in_target_order(reader: StorageReader, opened: OpenedFile, wanted: dict[int, Any],
                             delegate_ids: list[int], config: Config, gpu_device: int | None,
                             progress: Progress | None, lead: Any = None) -> dict[int, Any]:
    """Restore ``wanted`` (checkpoint id -> existing tensor, in the target's key order) in place,
    and ``delegate_ids`` (optimizer and extra state) into new arrays; return id -> finished object
    as ``restore_arrays`` does.
    ``lead``: a ``LeadRead`` of the file, for the first phase's decoder.

    Tensors that share memory are filled as ``load_state_dict`` fills them, key by key, the last
    key winning: a tensor overwritten whole by a later key's exact alias is not restored at all,
    and the others are restored in phases, one ``restore_arrays`` after another, each phase
    holding no two tensors that overlap (nor two destinations of one stored array). Without
    shared memory, everything is one phase, but for non-contiguous tensors: each is filled
    through a contiguous copy made before its phase reads anything, so they go in phases of their
    own of at most ``max_inflight_bytes`` of copies each (or one tensor), which bounds that memory
    by configuration, not by the model (a ``channels_last`` convnet is non-contiguous whole)."""
    index = opened.index

    shared = overlapping({i: span for i, tensor in wanted.items() if (span := _memory_span(tensor))})
    # Per phase: stored array id -> the tensor restored from it (None: a new array). As before,
    # a tensor that shares no memory is its stored array's destination when its key holds that
    # array, and the other keys of that array copy from it at the end; these arrays get no other
    # destination in the first phase, whose tensors later phases may overwrite.
    ids_of_phase: list[list[int]] = [list(delegate_ids) + [i for i in wanted if i not in shared]]
    phases: list[dict[int, Any]] = [{i: wanted[i] for i in ids_of_phase[0]
                                     if i in wanted and i == stored_id(index, i)}]
    for i in ids_of_phase[0]:
        phases[0].setdefault(stored_id(index, i), None)
    if shared:
        last_over_layout: dict[tuple[Any, ...], int] = {}  # exact aliases: the last key overwrites the rest
        for i, tensor in wanted.items():
            if i in shared:
                layout = (str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape),
                          tensor.stride())
                last_over_layout[layout] = i
        kept = set(last_over_layout.values())
        survivors = [i for i in wanted if i in kept]
        phase_of: dict[int, int] = {}
        for i, earlier in zip(survivors, _earlier_overlaps(survivors, wanted)):
            phase = max((phase_of[j] + 1 for j in earlier), default=0)
            while phase < len(phases) and stored_id(index, i) in phases[phase]:
                phase += 1  # one destination per stored array in each phase
            if phase == len(phases):
                phases.append({})
                ids_of_phase.append([])
            phase_of[i] = phase
            phases[phase][stored_id(index, i)] = wanted[i]
            ids_of_phase[phase].append(i)
    _separate_copied(phases, ids_of_phase, index, config.max_inflight_bytes, shared)

    arrays: dict[int, Any] = {}
    finished_bytes = 0  # raw bytes of the phases done, so that ``progress`` keeps counting up
    for destinations, ids in zip(phases, ids_of_phase):
        if not ids:
            continue
        phase_total = [0]

        def make_target(i: int, record: TensorRecord, destinations: dict[int, Any] = destinations) -> Any:
            tensor = destinations.get(i)
            if tensor is not None:
                return TorchTarget(record.shape, record.dtype, str(tensor.device), existing=tensor)
            return new_target(record, None)

        def phase_progress(done: int, total: int, before: int = finished_bytes,
                           phase_total: list[int] = phase_total) -> None:
            assert progress is not None
            phase_total[0] = total
            progress(before + done, before + total)

        restored = restore_arrays(reader, opened, ids, config, make_target, gpu_device,
                                   phase_progress if progress is not None else None, lead=lead)
        lead = None  # it serves one restore
        arrays.update((i, restored[i]) for i in ids)  # not the stored arrays of other phases' keys
        finished_bytes += phase_total[0]
    for i in shared:  # restored in place (or overwritten whole by a later key): nothing to copy
        arrays[i] = wanted[i]
    return arrays


def _separate_copied(phases: list[dict[int, Any]], ids_of_phase: list[list[int]], index: Any,
                     budget: int, shared: set[Any]) -> None:
    """Move the first phase's non-contiguous destinations (filled through a copy) into phases of
    their own, each holding at most ``budget`` bytes of them (or one). Only those that are their
    stored array's sole key (another key of that array copies from it at the end of phase 0)
    and share no memory with another target (``shared``): those are ordered among the tensors
    they overlap, and a later phase would let them overwrite a later key's values."""
    first, first_ids = phases[0], ids_of_phase[0]
    keys_of: dict[int, int] = {}
    for i in first_ids:
        keys_of[stored_id(index, i)] = keys_of.get(stored_id(index, i), 0) + 1
    # ``first`` is keyed by stored array: an entry moves only where that array is the key's own
    # (the key ids of a phase and the stored ids of its destinations then agree) and the key is
    # not ordered among tensors it overlaps
    own = set(first_ids) - set(shared)
    copied = {i: tensor for i, tensor in first.items()
              if tensor is not None and not tensor.is_contiguous() and keys_of.get(i) == 1 and i in own}
    if not copied:
        return
    ids_of_phase[0] = [i for i in first_ids if i not in copied]
    for i in copied:
        del first[i]
    held = budget  # start a new phase at the first tensor
    for i, tensor in copied.items():
        nbytes = tensor.numel() * tensor.element_size()
        if held + nbytes > budget:
            phases.append({})
            ids_of_phase.append([])
            held = 0
        phases[-1][i] = tensor
        ids_of_phase[-1].append(i)
        held += nbytes


def _memory_span(tensor: Any) -> tuple[int, int, int] | None:
    """``(device index, first byte address, end address)`` of the memory ``tensor`` covers (the
    CPU is device -1): for a non-contiguous view, from its first element to its last (what lies
    between counts as its); None when it has no elements."""
    start = tensor.data_ptr()
    if tensor.is_contiguous():  # the common case, kept cheap: load_into checks every tensor
        return (tensor.get_device(), start, start + tensor.nbytes) if tensor.nbytes else None
    if tensor.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.get_device(), start, start + (last + 1) * tensor.element_size()


def _earlier_overlaps(ids: list[int], tensors: dict[int, Any]) -> list[list[int]]:
    """For each of ``ids`` (in order), the earlier ones whose memory span overlaps its own: a sweep
    over the spans sorted by start, so the cost grows with the overlapping pairs, not all pairs."""
    position = {i: n for n, i in enumerate(ids)}
    earlier: list[list[int]] = [[] for _ in ids]
    spans = sorted((span, i) for i in ids if (span := _memory_span(tensors[i])) is not None)
    active: list[tuple[int, int, int]] = []  # (device, end, id) of the spans still open
    for (space, start, stop), i in spans:
        active = [entry for entry in active if entry[0] == space and entry[1] > start]
        for _space, _end, j in active:
            first, second = sorted((i, j), key=position.__getitem__)
            earlier[position[second]].append(first)
        active.append((space, stop, i))
    return earlier


def _under(key: str, prefix: str) -> bool:
    return prefix == "" or key == prefix or key.startswith(prefix + "/")


def _asked_for(target: Any) -> list[str] | None:
    """The key prefixes ``strict=True`` checks: one per top-level key of a dict, list or tuple
    ``target`` (a part of the checkpoint it asks for); None (everything) for any other target."""
    if isinstance(target, (dict, list, tuple)):
        return [join_key([key]) for key in _top_keys(target)]
    return None


def _top_keys(target: Any) -> list[Any]:
    """The top-level keys of a dict, list or tuple ``target`` (``_asked_for``'s, unjoined)."""
    return list(target) if isinstance(target, dict) else list(range(len(target)))


def _in_scope(key: str, scope: list[str] | None) -> bool:
    return scope is None or any(_under(key, prefix) for prefix in scope)


@dataclass
class _Delegate:
    """A part of a ``load_into`` target restored by handing it its subtree of the checkpoint:
    an optimizer (``load_state_dict``) or a module's extra state (``set_extra_state``)."""

    path: list[Any]
    apply: Callable[[Any], Any]
    what: str
    check: Callable[[Any], str | None] | None = None
    """Given the checkpoint's subtree with its arrays left out (None), why ``apply`` would refuse
    it, or None: run with the other checks, before anything is written."""
    check_node: Callable[[Any, Any], str | None] | None = None
    """Like ``check``, given the subtree's index node and the index (what its arrays are)."""


def _collect_targets(obj: Any, path: list[Any], existing: dict[str, Any], delegates: list[_Delegate],
                     plain_slots: list[tuple[Any, Any, int]], paths: KeyPaths, node: int,
                     held: dict[int, Any]) -> None:
    """Walk a ``load_into`` target: its tensors by key string into ``existing``, its optimizers and
    modules' extra state into ``delegates``, its plain values as (container, slot, ``paths``
    identity) into ``plain_slots``, and the plain values of tuples (which cannot be assigned into)
    as identity -> value into ``held``; ``node`` is the identity of ``path``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        _collect_module(obj, path, existing, delegates)
        return
    if torch is not None and isinstance(obj, torch.optim.Optimizer):
        delegates.append(_Delegate(list(path), obj.load_state_dict, "optimizer state",
                                   functools.partial(_optimizer_problem, obj)))
        return
    if torch is not None and isinstance(obj, torch.Tensor):
        _check_fillable(obj, join_key(path))
        existing[join_key(path)] = obj  # unique: its container refused two entries mapping to one key
        return
    if isinstance(obj, (dict, list, tuple)):
        # A plain value in a dict or list is a slot the checkpoint's value replaces; a tuple
        # cannot be assigned into, so its plain values must already equal the checkpoint's. Dict
        # keys are matched as a save stores them (``plain_key``: an IntEnum key as its int).
        slots = obj.items() if isinstance(obj, dict) else enumerate(obj)
        seen: set[int] = set()
        for key, value in slots:
            component = plain_key(key) if isinstance(obj, dict) else key
            identity = paths.child(node, component)
            if identity in seen:  # {1: a, "1": b}: one of them would silently stay unfilled
                raise ValueError(f"two entries of the load_into target map to the key "
                                 f"{join_key(path + [component])!r}")
            seen.add(identity)
            if isinstance(value, np.generic):
                # A NumPy scalar (np.float64 is a float too) is saved as an array, and cannot be
                # filled in place: its slot takes the checkpoint's value, after the tensors.
                if isinstance(obj, tuple):
                    raise TypeError(f"load_into cannot fill the NumPy scalar at {join_key(path + [component])!r} "
                                    f"in a tuple (a tuple cannot be assigned into): give a list")
                delegates.append(_Delegate(path + [component], functools.partial(obj.__setitem__, key),
                                           "NumPy scalar", check_node=_numpy_scalar_problem))
            elif not _is_plain(value):
                _collect_targets(value, path + [component], existing, delegates, plain_slots, paths, identity, held)
            elif isinstance(obj, tuple):
                held[identity] = value
            else:
                plain_slots.append((obj, key, identity))
        return
    if _is_plain(obj):
        return
    raise TypeError(f"load_into cannot fill {type(obj).__qualname__} at {join_key(path)!r}: give an "
                    f"nn.Module, an Optimizer, tensors, or dicts/lists of them")


def _collect_module(module: Any, path: list[Any], existing: dict[str, Any], delegates: list[_Delegate]) -> None:
    """A module's state_dict entries: its tensors into ``existing``, each submodule's extra state
    (``get_extra_state``, any value) as a delegate its ``set_extra_state`` restores, as
    ``load_state_dict`` does."""
    import torch

    # torch's name for the entry (a private constant, so read with its documented value as fallback)
    extra_state = getattr(torch.nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")
    entries = module.state_dict(keep_vars=True)
    # An entry in the memory of one of the module's parameters or buffers is theirs. For any
    # other, the state_dict is asked again while the first answer is held (its memory cannot be
    # reused): a tensor that is new each time is a copy the module makes when asked (a
    # ``_save_to_state_dict`` override or a state_dict hook that casts or clones), and filling it
    # would leave the module unchanged; one that is not (a tensor the module keeps as a plain
    # attribute) is filled. Only such modules pay for a second state_dict.
    registered = {_storage_of(tensor) for tensor in (*module.parameters(), *module.buffers())}
    unknown = [name for name, value in entries.items() if isinstance(value, torch.Tensor)
               and _storage_of(value) not in registered]
    again = module.state_dict(keep_vars=True) if unknown else {}
    for name, value in entries.items():
        key = join_key(path + [name])
        owner_name, _dot, leaf = name.rpartition(".")
        if leaf == extra_state:
            owner = module.get_submodule(owner_name)
            delegates.append(_Delegate(path + [name], owner.set_extra_state, "extra state"))
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"load_into cannot fill the {type(value).__qualname__} the module's state_dict "
                            f"holds at {key!r}: load the checkpoint with gdsckpt.load and pass it to "
                            f"load_state_dict")
        else:
            _check_fillable(value, key)
            if name in unknown and _made_anew(value, again.get(name)):
                raise TypeError(f"load_into cannot fill the tensor the module's state_dict holds at {key!r}: "
                                f"the module makes a new one each time it is asked (a _save_to_state_dict "
                                f"override or a state_dict hook that returns copies), so filling it would "
                                f"leave the module as it was; load the checkpoint with gdsckpt.load and pass "
                                f"it to the module's load_state_dict")
            existing[key] = value
    hooked = sorted({type(sub).__qualname__ for sub in module.modules()
                     if getattr(sub, "_load_state_dict_pre_hooks", None)
                     or getattr(sub, "_load_state_dict_post_hooks", None)})
    if hooked:
        # Filled in place, a module's load_state_dict hooks do not run: one that rebuilds a
        # derived buffer after a load would be left stale, silently.
        warnings.warn(f"load_into fills the tensors at {join_key(path) or 'the root'!r} in place, and does not run the "
                      f"load_state_dict hooks of {', '.join(hooked)}: where they matter, pass "
                      f"gdsckpt.load(...) to the module's load_state_dict instead", UserWarning,
                      stacklevel=caller_level()[0])


def _numpy_scalar_problem(node: Any, index: Any) -> str | None:
    """Why the checkpoint's entry ``node`` cannot fill a NumPy scalar slot: only a single value
    can (a 0-d array, as a save stores NumPy scalars, or a number), as for a plain slot."""
    if node["t"] == "tensor":
        record = index.tensors[node["id"]]
        if record.shape == ():
            return None
        return f"target NumPy scalar != checkpoint {record.dtype}{list(record.shape)} array"
    if node["t"] in ("int", "float", "bool"):
        return None
    return f"target NumPy scalar != checkpoint {node['t']}"


def _as_torch(array: Any) -> Any:
    """A torch view of a restored array, for copying into a target tensor: a NumPy array of an
    ml_dtypes type (bfloat16, float8), which ``torch.as_tensor`` refuses, through its bits."""
    import torch

    if isinstance(array, np.ndarray):
        name = numpy_dtype_name(array.dtype)
        if name is not None and array.dtype.kind not in "biufc":
            # reshaped back: ascontiguousarray makes a 0-d array one of shape (1,)
            bits = np.ascontiguousarray(array).view(f"u{array.dtype.itemsize}").reshape(array.shape)
            return torch.from_numpy(bits).view(torch_dtype(name))
    return torch.as_tensor(array)


def _storage_of(tensor: Any) -> tuple[str, int] | None:
    """(device, storage address) of a tensor's memory; None where it has none to compare (no
    elements, or a tensor subclass without a storage of its own)."""
    import torch

    if torch.nn.parameter.is_lazy(tensor) or tensor.is_nested or tensor.numel() == 0:
        return None  # nothing to compare; ``_check_fillable`` says why it cannot be filled
    try:
        return str(tensor.device), int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _made_anew(first: Any, second: Any) -> bool:
    """Whether two answers of one state_dict entry are different memory (not one tensor, nor views
    of one storage): the entry is a copy made per call. Empty tensors hold nothing to fill."""
    if second is first or first.numel() == 0:
        return False
    return second is None or _storage_of(second) != _storage_of(first)


def _check_fillable(tensor: Any, key: str) -> None:
    """Raise ``TypeError`` naming ``key`` for a tensor ``load_into`` cannot fill in place: found
    here, before anything is written, rather than by the copy halfway through a restore."""
    import torch

    why = None
    if tensor.is_nested:  # asked first: a nested tensor's layout may read "strided", its shape fails
        why = "a nested tensor: only dense (strided) tensors are filled in place"
    elif torch.nn.parameter.is_lazy(tensor):
        why = "an uninitialized (lazy) parameter: run a forward pass first, or load the checkpoint"
    elif tensor.is_meta:
        why = "a meta tensor, which holds no memory: materialize it first (e.g. module.to_empty())"
    elif tensor.layout != torch.strided:
        why = f"a {tensor.layout} tensor: only dense (strided) tensors are filled in place"
    elif tensor.is_conj() or tensor.is_neg():  # its memory holds the conjugate / negation of what it reads
        why = (f"a lazily {'conjugated' if tensor.is_conj() else 'negated'} view: pass the tensor it views "
               f"(or one made with .resolve_conj() / .resolve_neg())")
    elif any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride())):
        why = "an expanded view whose elements share memory: pass a tensor with memory of its own"
    elif not tensor.is_contiguous() and _overlaps_itself(tensor.shape, tensor.stride()):
        why = ("a view whose elements share memory (as unfold() or as_strided() can make): it cannot hold "
               "the checkpoint's values; pass a tensor with memory of its own")
    if why is not None:
        raise TypeError(f"load_into cannot fill the tensor at {key!r}: {why}")


OVERLAP_CHECK_ELEMENTS = 1 << 20
"""Up to this many elements, a view that fails the quick test of ``_overlaps_itself`` has its
element offsets compared one by one; a larger one is taken as it is (torch's own ``copy_`` does not
refuse such a target either)."""


def _overlaps_itself(shape: Any, strides: Any) -> bool:
    """Whether two elements of a strided view sit at one memory location. Quick test first: with
    the dimensions sorted by stride, each stride at least the reach of the smaller ones means no
    overlap (every ordinary and transposed layout); otherwise the offsets are compared."""
    dims = sorted((stride, size) for size, stride in zip(shape, strides) if size > 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    count = math.prod(size for _stride, size in dims)
    if count > OVERLAP_CHECK_ELEMENTS:
        return False
    offsets = np.zeros(1, dtype=np.int64)
    for stride, size in dims:
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    return bool(np.unique(offsets).size < offsets.size)


def _same_value(first: Any, second: Any) -> bool:
    """Whether two plain values are the same, bit for bit (a float by its bits: NaN equals its
    own payload, 0.0 differs from -0.0)."""
    if type(first) is not type(second):
        return False
    if isinstance(first, float):
        return struct.pack("<d", first) == struct.pack("<d", second)
    return bool(first == second)


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _optimizer_problem(optimizer: Any, saved: Any) -> str | None:
    """Why ``optimizer.load_state_dict`` would refuse ``saved`` (its arrays None): the checks it
    makes before it changes anything, made here before the model is written. Only for torch's own
    ``load_state_dict`` without pre-hooks (a hook may reshape the state it is given, an override
    may accept another layout): for others, None, and their own checks run when it is called."""
    import torch

    if (type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict
            or getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None)):
        return None
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, (list, tuple)) or "state" not in saved:
        return "the checkpoint's entry is no optimizer state_dict (it needs 'state' and 'param_groups')"
    if len(groups) != len(optimizer.param_groups):
        return (f"the checkpoint's optimizer has {len(groups)} parameter group(s), the target's "
                f"{len(optimizer.param_groups)}")
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, groups)):
        params = saved_group.get("params") if isinstance(saved_group, dict) else None
        if not isinstance(params, (list, tuple)) or len(params) != len(group["params"]):
            count = len(params) if isinstance(params, (list, tuple)) else "no"
            return (f"parameter group {i} holds {count} parameter(s) in the checkpoint, "
                    f"{len(group['params'])} in the target's optimizer")
    return None


class _NoArrays(dict[int, Any]):
    """``unflatten``'s arrays for a tree's values without its arrays: every array None (and,
    unlike a ``defaultdict``, nothing stored per lookup)."""

    def __missing__(self, key: int) -> None:
        return None


_NO_ARRAYS = _NoArrays()


def _plain_values(tree: Any, paths: KeyPaths, skip: set[int]) -> tuple[dict[int, Any], dict[int, Any], set[int]]:
    """``paths`` identity -> value of every plain (non-container, non-array) value in a tree,
    leaving out the subtrees at the identities in ``skip`` (optimizer and extra state); those of
    ``skip`` the tree holds, identity -> their node; and the identities two entries of one dict share (keys ``1`` and
    ``"1"``, which a path spells alike), which no target slot can be matched to."""
    values: dict[int, Any] = {}
    found: dict[int, Any] = {}
    ambiguous: set[int] = set()
    stack: list[tuple[dict[str, Any], int]] = [(tree, KeyPaths.ROOT)]
    while stack:
        node, identity = stack.pop()
        if identity in skip:
            found[identity] = node
        elif node["t"] in ("list", "tuple"):
            stack.extend((child, paths.child(identity, i)) for i, child in enumerate(node["items"]))
        elif node["t"] == "dict":
            children = [(child, paths.child(identity, decode_scalar(key))) for key, child in node["items"]]
            if len({child for _node, child in children}) < len(children):
                seen: set[int] = set()
                for _node, child in children:
                    (ambiguous if child in seen else seen).add(child)
            stack.extend(children)
        elif node["t"] != "tensor":
            values[identity] = decode_scalar(node)
    return values, found, ambiguous
