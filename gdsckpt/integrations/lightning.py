"""PyTorch Lightning ``CheckpointIO`` plugin: Lightning checkpoints written and read as gdsckpt files.

Usage::

    from gdsckpt.lightning import GdsCheckpointIO

    trainer = L.Trainer(plugins=[GdsCheckpointIO(codec="auto", async_save=True)],
                        callbacks=[ModelCheckpoint(dirpath="checkpoints/")])
    trainer.fit(model, ckpt_path=...)      # resumes from a gdsckpt file through the plugin

Every checkpoint Lightning writes (``ModelCheckpoint``, ``Trainer.save_checkpoint``) is then one
compressed, checksummed gdsckpt file (``gdsckpt.inspect`` / ``verify`` read it), and everything
Lightning reads back through its strategy (``fit/validate/test/predict(ckpt_path=...)``) is read
from one. ``LightningModule.load_from_checkpoint`` does not go through a ``CheckpointIO``: it
calls ``torch.load``. For weights alone, use ``GdsCheckpointIO().load_checkpoint(path)`` and
``model.load_state_dict(checkpoint["state_dict"])``.

What is stored, and the policy for what cannot be
------------------------------------------------
Lightning's checkpoint dict holds the model's and optimizers' state dicts, LR schedulers',
callbacks' and loops' state (nested dicts / lists / ints / floats / strings / None / tensors),
the hyperparameters, and whatever ``on_save_checkpoint`` hooks add. gdsckpt stores dicts (keys:
str, int, float, bool, None), lists, tuples, tensors and arrays, and int / float / bool / str /
None, and restores them with their exact types and bits. It never pickles, so loading a
checkpoint can never run code.

An entry that is none of these (a ``pathlib.Path`` or ``argparse.Namespace`` hyperparameter, a
namedtuple, a custom object added by a hook) is handled by ``convert``:

- ``convert=None`` (default): ``save_checkpoint`` raises ``TypeError`` listing the key path and
  type of every such entry, before anything is written.
- ``convert=callable``: each such entry is replaced, in the file only (Lightning's dict is not
  changed), by ``convert(entry)``, which must return something gdsckpt stores (``convert=str``
  keeps a readable text). Loading returns that converted value: the original object is never
  rebuilt, nothing is imported or unpickled. ``convert`` cannot fix dict keys of other types:
  those always raise.

Asynchronous saves
------------------
With ``async_save=True``, ``save_checkpoint`` returns once gdsckpt's ``save_async`` has copied
the state into reused snapshot buffers (training may then change its tensors); the file appears
atomically when the background save completes. At most ``max_inflight`` saves run at once (a
further save waits for one to end); saves to the same path run in order. An error of a background
save is raised by the next ``save_checkpoint`` or by ``teardown`` (which Lightning calls at the
end of ``fit``/``validate``/...), and ``teardown`` waits for every save in flight.
``load_checkpoint`` and ``remove_checkpoint`` of a path wait for its save in flight first.

Paths are local files; ``fsspec`` URLs (``s3://...``) are rejected. Both namespaces work: the
class subclasses ``lightning``'s ``CheckpointIO`` and, where ``pytorch_lightning`` is installed
too, is registered as a ``lightning_fabric`` ``CheckpointIO``; with only ``pytorch_lightning``
installed it subclasses that one.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import os
import shutil
import sys
from abc import ABCMeta
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from .. import api as _api
from ..api.resolve import check_portable
from ..background.async_save import AsyncSaver, SaveHandle
from ..codecs import versioned_name
from ..config import Config
from ..state import join_key

logger = logging.getLogger("gdsckpt")

_INSTALL_HINT = "gdsckpt.lightning needs PyTorch Lightning: pip install lightning"


def _checkpoint_io_bases() -> list[type]:
    """Lightning's ``CheckpointIO`` base classes of the namespaces installed here, ``lightning``
    first. Only a missing package counts as absent: a Lightning that fails to import for another
    reason raises its own error."""
    bases: list[type] = []
    for package, module in (("lightning", "lightning.fabric.plugins"),
                            ("lightning_fabric", "lightning_fabric.plugins")):
        try:
            bases.append(importlib.import_module(module).CheckpointIO)
        except ModuleNotFoundError as err:
            if not (err.name == package or str(err.name).startswith(package + ".")):
                raise
    if not bases:
        raise ImportError(_INSTALL_HINT)
    return bases


_BASES = _checkpoint_io_bases()

_MAX_LISTED = 20
"""Entries named in one unsupported-object error; the count of the others follows."""


class GdsCheckpointIO(_BASES[0]):  # type: ignore[misc, valid-type]
    """A Lightning ``CheckpointIO`` that saves and loads checkpoints as gdsckpt files.

    ``codec``: as for ``gdsckpt.save`` (``"auto"`` defers to ``config.codec``). ``config``: a
    ``gdsckpt.Config`` (None: ``Config.from_env()`` at each call). ``async_save``: save in the
    background through ``gdsckpt``'s ``save_async`` (see the module docstring);
    ``max_inflight``: background saves running at once. ``convert``: what to store in place of
    an entry gdsckpt cannot store (None: raise ``TypeError`` naming it; see the module docstring).
    """

    def __init__(self, codec: str = "auto", config: Config | None = None, async_save: bool = False, *,
                 max_inflight: int = 1, convert: Callable[[Any], Any] | None = None):
        super().__init__()
        _check_codec(codec)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a gdsckpt.Config, got {type(config).__qualname__}")
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if convert is not None and not callable(convert):
            raise TypeError(f"convert must be callable or None, got {type(convert).__qualname__}")
        if config is not None:
            check_portable(config, codec)
        self.codec = codec
        self.config = config
        self.async_save = bool(async_save)
        self.max_inflight = max_inflight
        self.convert = convert
        # A saver of its own, made at the first async save and dropped by teardown: teardown
        # waits for this plugin's saves only and frees their snapshot buffers, and a plugin that
        # has not saved yet pickles (spawn-based launchers pickle the Trainer).
        self._saver: AsyncSaver | None = None
        self._pending: list[tuple[str, SaveHandle]] = []
        """Background saves not yet reported, with the path each writes, oldest first."""
        self._removals: list[tuple[Path, list[SaveHandle]]] = []
        """Checkpoints Lightning asked to remove while background saves were in flight, each with
        those saves: removed once all of them have succeeded, kept if any failed."""

    # -----------------------------------------------------------------------------------------
    # CheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` to ``path`` as a gdsckpt file (in the background with
        ``async_save``), creating the directory if needed.

        ``storage_options``: None, or a mapping of ``codec`` and ``gdsckpt.Config`` fields that
        override this plugin's for this save only (``{"codec": "lz4", "fsync": False}``).
        Raises ``TypeError`` naming every entry gdsckpt cannot store when ``convert`` is None.
        """
        target = _local_path(path)
        codec, config = self._options(storage_options)
        state = self._storable(checkpoint)
        target.parent.mkdir(parents=True, exist_ok=True)
        # a removal still waiting for saves in flight must not remove what this save writes
        self._removals = [(removed, handles) for removed, handles in self._removals
                          if _path_key(removed) != _path_key(target)]
        if not self.async_save:
            _api.save(state, target, codec=codec, config=config)
            return
        if self._saver is None:
            self._saver = AsyncSaver()
        key = _path_key(target)
        # Wait here, not in save_async, for a free slot (the oldest saves) and for an earlier save
        # to the same path (which must not overtake this one): then every earlier save that has
        # ended by the time this one starts is reported below, deterministically.
        running = [(k, handle) for k, handle in self._pending if not handle.done()]
        for position, (earlier_key, earlier) in enumerate(running):
            if position <= len(running) - self.max_inflight or earlier_key == key:
                earlier.exception()  # waits; its error is raised below
        # save_async validates the state and copies its tensors before it returns. Like
        # Lightning's AsyncCheckpointIO, this save starts even when an earlier one failed (the
        # failure may have been transient, and this checkpoint is newer); that failure is raised
        # right after.
        handle = self._saver.save(state, target, codec=codec, config=config, max_inflight=self.max_inflight)
        self._pending.append((key, handle))
        self._report_where(lambda _key, pending: pending is not handle and pending.done())

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read the gdsckpt file at ``path`` into Lightning's checkpoint dict.

        ``map_location``: None or ``"cpu"`` (tensors on the CPU: Lightning then copies them into
        the model and moves optimizer state to the strategy's device), ``"cuda[:N]"`` or a
        ``torch.device``; the functions and dicts ``torch.load`` also takes are not supported.
        ``weights_only`` is accepted for Lightning's interface and has no effect: gdsckpt never
        unpickles, so every load is as safe as ``weights_only=True``.
        """
        target = _local_path(path)
        device = _device(map_location)
        self._wait_for(target)
        if not target.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {str(target)!r}")
        return _api.load(target, device=device, config=self.config)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (after its save in flight, if any); a directory is
        removed with its contents, as Lightning's ``TorchCheckpointIO`` does; a missing path is
        not an error.

        With background saves in flight (Lightning removes the checkpoint a new one supersedes
        right after asking for the new one), the removal waits for them without blocking: it
        happens once they have all succeeded (seen by a later ``save_checkpoint``, a
        ``remove_checkpoint`` or ``teardown``), and never if one failed, so that a failed save
        never leaves the run without its previous checkpoint."""
        target = _local_path(path)
        self._wait_for(target)
        in_flight = [handle for _key, handle in self._pending]
        if in_flight:
            self._removals.append((target, in_flight))
            self._run_removals()
        else:
            _remove(target)

    def _run_removals(self) -> None:
        """Carry out the waiting removals whose saves have all ended: each if they all succeeded;
        one that failed keeps the checkpoint (logged; the failure itself is raised by the
        plugin's next report)."""
        waiting = []
        for target, handles in self._removals:
            if not all(handle.done() for handle in handles):
                waiting.append((target, handles))
            elif any(handle.exception() is not None for handle in handles):
                logger.warning("gdsckpt: kept %s, which Lightning asked to remove, because a background "
                               "save in flight at the time failed", str(target))
            else:
                _remove(target)
        self._removals = waiting

    def teardown(self) -> None:
        """Wait for every background save of this plugin, free its snapshot buffers, and raise
        the first background error (the others are logged and counted in a note)."""
        try:
            self._report_where(lambda _key, _handle: True)
        finally:
            self._run_removals()
            if not self._pending:  # else a wait was interrupted: the saves are still this saver's
                self._saver = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without background saves (their threads and buffers stay in this process)."""
        if self._pending:
            raise RuntimeError("GdsCheckpointIO cannot be pickled while background saves are pending; "
                               "call teardown() first")
        return {**self.__dict__, "_saver": None}

    # -----------------------------------------------------------------------------------------
    # helpers

    def _options(self, storage_options: Any) -> tuple[str, Config | None]:
        """The codec and config of one save: the plugin's, with ``storage_options`` applied."""
        if storage_options is None:
            return self.codec, self.config
        if not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be None or a mapping of 'codec' and gdsckpt.Config "
                            f"fields, got {type(storage_options).__qualname__}")
        changes = dict(storage_options)
        codec = changes.pop("codec", self.codec)
        _check_codec(codec)
        known = {f.name for f in dataclasses.fields(Config)}
        unknown = sorted(str(name) for name in changes if name not in known)
        if unknown:
            raise TypeError(f"storage_options {', '.join(map(repr, unknown))} are not gdsckpt.Config fields "
                            f"(known: codec, {', '.join(sorted(known))})")
        if not changes:
            return codec, self.config
        base = self.config if self.config is not None else Config.from_env()
        return codec, base.replace(**changes)

    def _storable(self, checkpoint: Any) -> Any:
        """``checkpoint`` with each entry gdsckpt cannot store replaced by ``convert`` of it (copying
        only the containers on the way to one), or ``TypeError`` naming them all."""
        problems: list[str] = []
        state = _replace_unsupported(checkpoint, [], self.convert, problems, 0)
        if problems:
            listed = problems[:_MAX_LISTED]
            if len(problems) > _MAX_LISTED:
                listed.append(f"... and {len(problems) - _MAX_LISTED} more")
            raise TypeError(
                "GdsCheckpointIO cannot store these checkpoint entries (gdsckpt stores dicts, lists, "
                "tuples, tensors/arrays, int, float, bool, str and None, and never pickles):\n  "
                + "\n  ".join(listed)
                + "\nConvert them in LightningModule.on_save_checkpoint, leave them out of "
                  "save_hyperparameters(ignore=[...]), or pass GdsCheckpointIO(convert=...) (e.g. "
                  "convert=str) to store a plain value in their place."
            )
        return state

    def _report_where(self, chosen: Callable[[str, SaveHandle], bool]) -> None:
        """Take the pending saves ``chosen(path key, handle)`` selects, wait for them, and raise
        the first error; the others are logged, and counted in a note on the raised one."""
        # One call of chosen per save (done() may change meanwhile); taken off the list only once
        # all have ended, so an interrupted wait (KeyboardInterrupt) leaves them to wait for again.
        handles = [handle for key, handle in self._pending if chosen(key, handle)]
        errors = [error for error in (handle.exception() for handle in handles) if error is not None]
        taken = {id(handle) for handle in handles}
        self._pending = [(key, handle) for key, handle in self._pending if id(handle) not in taken]
        self._run_removals()
        if not errors:
            return
        for error in errors[1:]:
            logger.error("gdsckpt: background save of a Lightning checkpoint failed: %r", error,
                         exc_info=error)
        add_note = getattr(errors[0], "add_note", None)  # Python >= 3.11
        if add_note is not None and len(errors) > 1:
            add_note(f"gdsckpt: {len(errors) - 1} more background checkpoint save(s) failed too (logged)")
        raise errors[0]

    def _wait_for(self, target: Path) -> None:
        """Wait for the background save to ``target``, if one is pending, raising its error."""
        key = _path_key(target)
        self._report_where(lambda pending_key, _handle: pending_key == key)


def _remove(target: Path) -> None:
    """Remove a checkpoint file, or a directory with its contents; a missing one is no error."""
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()


def _check_codec(codec: Any) -> None:
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a str, got {type(codec).__qualname__}")
    if codec != "auto":
        versioned_name(codec)  # ValueError listing the valid names


def _local_path(path: Any) -> Path:
    """``path`` as a local filesystem path; gdsckpt writes local files, not fsspec URLs."""
    text = os.fspath(path)
    if "://" in text:
        raise ValueError(f"GdsCheckpointIO writes local files only, got {text!r}")
    return Path(text)


def _path_key(path: Path) -> str:
    return os.path.abspath(path)


def _device(map_location: Any) -> str | None:
    if map_location is None or isinstance(map_location, str):
        return map_location
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(map_location, torch.device):
        return str(map_location)
    raise TypeError(f"GdsCheckpointIO.load_checkpoint takes map_location None, 'cpu', 'cuda[:N]' or a "
                    f"torch.device, got {type(map_location).__qualname__}")


def _stored_as_is(obj: Any) -> bool:
    """Whether gdsckpt stores ``obj`` as a leaf (a plain value or an array); containers are walked
    separately. Arrays of a dtype gdsckpt lacks pass here and fail in ``gdsckpt.save``, which
    names them."""
    if obj is None or isinstance(obj, (bool, int, float, str, np.generic, np.ndarray)):
        return True
    for module, name in (("torch", "Tensor"), ("cupy", "ndarray"), ("jax", "Array")):
        library = sys.modules.get(module)
        if library is not None and isinstance(obj, getattr(library, name)):
            return True
    return False


def _valid_key(key: Any) -> bool:
    return key is None or isinstance(key, (bool, int, float, str))


_IN_PROGRESS = object()


def _replace_unsupported(obj: Any, path: list[Any], convert: Callable[[Any], Any] | None, problems: list[str],
                         depth: int, memo: dict[int, tuple[Any, Any]] | None = None) -> Any:
    """``obj`` with unsupported entries converted; the same object where nothing changed.

    Each container is walked once (``memo``, by identity): a checkpoint whose hyperparameters
    held a dict twice per level was walked 2**256 times, and one that held itself never ended.
    A container met again while it is being walked (a cycle) is left as it is: ``gdsckpt.save``
    refuses the cycle, naming the key."""
    if depth > 256:
        return obj  # gdsckpt.save rejects the nesting, naming the key
    if memo is None:
        memo = {}
    if isinstance(obj, (dict, list, tuple)):
        done = memo.get(id(obj))
        if done is not None:
            return obj if done[1] is _IN_PROGRESS else done[1]
        # The object is kept beside its result: its id cannot pass to another object meanwhile.
        memo[id(obj)] = (obj, _IN_PROGRESS)
        result = _replace_container(obj, path, convert, problems, depth, memo)
        memo[id(obj)] = (obj, result)
        return result
    return _replace_leaf(obj, path, convert, problems, depth, memo)


def _replace_container(obj: Any, path: list[Any], convert: Callable[[Any], Any] | None, problems: list[str],
                       depth: int, memo: dict[int, tuple[Any, Any]]) -> Any:
    if isinstance(obj, dict):
        changed = {}
        for key, value in obj.items():
            if not _valid_key(key):
                problems.append(f"{join_key(path)!r}: dict key {key!r} of type {_type_name(key)} (keys "
                                f"must be str, int, float, bool or None)")
                continue
            new = _replace_unsupported(value, path + [key], convert, problems, depth + 1, memo)
            if new is not value:
                changed[key] = new
        if not changed:
            return obj
        # A shallow copy keeps the dict's type and an OrderedDict's _metadata (module versions).
        result = copy.copy(obj)
        result.update(changed)
        return result
    if type(obj) in (list, tuple):
        items = [_replace_unsupported(item, path + [i], convert, problems, depth + 1, memo)
                 for i, item in enumerate(obj)]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        return type(obj)(items)
    return _replace_leaf(obj, path, convert, problems, depth, memo)


def _replace_leaf(obj: Any, path: list[Any], convert: Callable[[Any], Any] | None, problems: list[str],
                  depth: int, memo: dict[int, tuple[Any, Any]]) -> Any:
    if _stored_as_is(obj):
        return obj
    if convert is None:
        problems.append(f"{join_key(path)!r}: {_type_name(obj)}")
        return obj
    converted = convert(obj)
    before = len(problems)
    # The converted value must be storable as it is: no second conversion.
    result = _replace_unsupported(converted, path, None, problems, depth, memo)
    for i in range(before, len(problems)):
        problems[i] += f" (returned by convert for a {_type_name(obj)})"
    return result


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


for _other_base in _BASES[1:]:
    # The other namespace's Trainer checks isinstance(plugin, its CheckpointIO).
    cast(ABCMeta, _other_base).register(GdsCheckpointIO)

__all__ = ["GdsCheckpointIO"]
