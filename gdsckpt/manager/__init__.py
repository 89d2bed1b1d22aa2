"""``CheckpointManager``: numbered checkpoints in one directory, a ``latest`` pointer, pruning, and
restore-on-restart.

Layout of ``directory`` (one manager, one prefix per directory)::

    step-0000000100.gdsckpt     checkpoints, "<prefix>-<step:010d>.gdsckpt"
    step-0000000200.gdsckpt
    latest                      text: the file name of the newest completed checkpoint

Guarantees
----------
- A checkpoint file appears under its final name only complete (``gdsckpt.save`` writes a
  temporary file and renames it), so a crash at any moment leaves every ``<prefix>-*.gdsckpt``
  complete; temporaries of dead processes are removed when a manager opens the directory.
- ``latest`` is replaced atomically (temporary file, fsync, ``os.replace``, fsync of the
  directory; the fsyncs follow ``config.fsync`` like the checkpoint's own) after each completed
  save, and only ever moves to a higher step than this manager last wrote to it (saves that
  finish out of order never move it back).
- Pruning runs only after a save completed and keeps: the ``keep_last`` highest readable steps,
  the step ``latest`` names, every step being written, and every base a kept delta checkpoint
  needs, transitively. Everything else with this prefix goes.

Delta checkpoints
-----------------
With ``delta_every`` (in steps) set, ``save(step, ...)`` writes a delta against the newest
complete checkpoint (``gdsckpt.save(..., base=...)``), except at multiples of ``full_every``
steps, when there is no complete checkpoint yet, or when that one's chain of deltas is already
``max_chain`` deep: then it writes a full one. A checkpoint is a base only if its whole chain
resolves (each base there the file its delta was written against): a step saved again under a
later delta, or a base deleted, makes the next save a full one rather than a failure. A base whose
chunks prove damaged only as the delta reads them makes that step a full save too, with a
``SkippedCheckpointWarning`` (``save_async``: that save fails, its handle says why), and is not
used as a base again until its step is saved anew.
``should_save(step)`` says whether a step is due (a multiple of ``delta_every`` or of
``full_every``), for loops that ask every step.

``delta_base="full"`` bases every delta on the newest complete *full* checkpoint instead (a star
rather than a chain): a delta save then reads one base file, whatever how many deltas came
before it, and a load reads two, where a chain makes the d-th delta's save and load resolve d
files, so its saves slow down link by link. The price is size: a delta is as far from its base
as the last full checkpoint is old, and farther weights XOR less well, so pair it with
``full_every``. docs/performance.md, "Delta checkpoints", measures both shapes.

Remote tier
-----------
With ``remote="s3://bucket/prefix"`` each completed checkpoint file is then uploaded, as it is,
below that prefix in the background (``gdsckpt.manager.remote``), and a ``latest`` object there
names the newest one uploaded. Guarantees on that tier:

- an object appears only whole (one multipart upload), and ``latest`` moves only after the object
  it names and every base that object needs are there;
- an upload that fails is reported (``RemoteUploadWarning``) and retried by the next save and by
  ``wait()``, which raises ``RemoteUploadError`` if the remote tier still lacks a checkpoint; a
  new manager's first upload round sends the checkpoint the local ``latest`` names if the remote
  tier lacks it (a process that died with that upload pending), or, where the remote tier has it
  but its ``latest`` names an older step (a process that died before moving it), moves the
  remote ``latest`` up to it (never down: another node may have moved it further); other
  uploads a dead process left pending are not resent;
- ``latest`` there moves to the newest checkpoint uploaded even when a later upload of the same
  round fails;
- every request is bounded by ``Config.timeout`` (``gdsckpt.io.s3.open_store``): a server that
  stops answering fails the operation instead of holding it;
- local pruning keeps every checkpoint the remote tier still lacks, except those that
  ``keep_last_remote`` newer ones already supersede (the remote tier would prune them at once),
  so the local tier holds at most ``keep_last + keep_last_remote`` checkpoints and their bases
  while the remote is down;
- a step saved again while (or after) an older file of it went up is uploaded again: a version
  of a step counts as sent only once that version went up, and a delta's base goes up before it
  wherever the remote tier lacks the base or holds an older file of its step;
- remote pruning keeps ``keep_last_remote`` checkpoints there in the order restore tries them
  (below), the highest step besides, the one its ``latest`` names and every base a kept delta
  needs, and removes only objects named like this manager's checkpoints. While the remote tier is
  down, the checkpoints still to upload are the ``keep_last_remote`` first in that order (a run
  that went back to an older step uploads its own, not the steps it abandoned).

``restore_latest`` restores from the local tier when it holds a usable checkpoint, else from the
remote tier (a replacement node after a failure): the one its ``latest`` names, then the lower
steps, descending, then the higher ones (a run that went back to an older step abandoned them),
read straight from the objects (ranged GETs, nothing copied to local disk). A
local checkpoint found damaged is followed by the remote tier's copy of the same step, where
there is one, before any older local one: a disk fault does not cost the progress the remote
copy kept.

``CheckpointManager("s3://bucket/prefix")`` keeps its checkpoints on object storage only: each save
goes straight into its object (``gdsckpt.io.s3.S3Writer``, which appears whole), then ``latest``
moves and pruning runs as on the remote tier above (``keep_last`` applies there). Deltas work
there too: a delta's save reads its base object (ranged GETs of the arrays it XORs against), and
the delta names its base by its name, beside it.

Contract of ``restore_latest``
-------------------------------
What is saved: ``save``/``save_async`` take a dict, by convention ``{"model":
model.state_dict(), "optimizer": optimizer.state_dict(), ...extra}``, where extra entries (a
data-loader position, ``torch.get_rng_state()``, an epoch counter, ...) are further top-level
keys. The step is the file name's; the manager adds nothing to the state.

Which checkpoint: the newest complete one. That is the one ``latest`` names, provided its file
passes the cheap check (header, trailer and index, as ``gdsckpt.open`` reads them; with
``verify=True``, ``gdsckpt.verify`` of every chunk); else the highest lower step that passes,
and only then the higher steps written before ``latest`` (an abandoned run's). A
``SkippedCheckpointWarning`` names each file passed over and why. One refinement: a checkpoint
with a higher step than ``latest`` names that appeared after ``latest`` was written (the process
died between that save's rename and its pointer update; with saves in flight together its
writes may have ended before) is newer, and is tried first. ``latest`` records the higher
checkpoints on disk when it is written (an abandoned run's, after a run restarted from an older
step), each by size, trailer and modification time, so it still wins over those whatever
happened to their change times (a ``chmod``, a ``cp -a`` of the run); a pointer without such
records (none was above it, or an older version wrote it) leaves it to the files' change times.
And pruning never removes the checkpoint ``latest`` names, whichever process wrote it. Pruning keeps
``keep_last`` checkpoints in the order restore tries them (so a restarted run keeps its own) and
the highest step besides. Within one process, a save that begins below the step ``latest``
names is a rollback (a run gone back to an older step): ``latest`` then follows it and the saves
begun after it, never again a step the run went back from, whatever order saves in flight
together finish in (``_moves_latest``); the remote tier's ``latest`` follows the local one.

How: in place, with ``gdsckpt.load_into`` (``strict=False``): ``model`` into the checkpoint's
top-level key ``"model"``, ``optimizer`` into ``"optimizer"``, and every key of ``state`` (a dict
of tensors, modules, optimizers, nested dicts and plain values) into the same key; top-level
plain values of ``state`` are replaced. A target key the checkpoint lacks, or a shape / dtype
that differs, raises ``StateMismatchError``.

Returns ``(step, extra)``: ``extra`` is a dict of the checkpoint's top-level entries that were
not restored in place, loaded (tensors on the CPU); with no targets at all it is the whole
checkpoint. Returns ``None`` when there is no usable checkpoint (a fresh start).

A checkpoint is passed over only on proof that it is unusable: a checksum or structural check
failed (``CorruptCheckpointError``, ``UnsupportedFormatError``), its delta base is missing,
changed or damaged (``DeltaBaseError``), or its file vanished (``FileNotFoundError``: a
concurrent prune). It is skipped with a warning and the next older one is restored; that one
overwrites whatever the failed one wrote. A newer gdsckpt's checkpoint (``NewerFormatError``: a
format version, codec or transform this version does not know, its checksums intact) is no such
proof: it is raised (upgrade gdsckpt, or move the file away to restore an older step), never
pruned (pruning is skipped with a warning while one is there), and never a delta's base. Where
none is usable after one failed while loading (its checks passed, so part of it may be in the
targets already), that error is raised rather than ``None`` returned: the targets are no longer
the fresh start ``None`` stands for. Every other error is raised and nothing else is tried, since
the newest checkpoint may well be intact and restarting from an older one loses progress:
running out of memory (``MemoryError``; CuPy's and torch's out-of-memory errors on the GPU), I/O
errors (``OSError``, and the ``CheckpointError`` "I/O error reading chunk N" the reader raises
for one), device faults, ``KeyboardInterrupt``, a target that does not match
(``StateMismatchError``), a codec or array library this machine lacks (``CodecUnavailableError``
and other ``CheckpointError``). The targets may then hold part of that checkpoint; nothing on
disk is changed.

Why one module of about 800 lines: it is one class, ``CheckpointManager``, whose saving,
pruning, uploading and restoring share the invariants above on both tiers (which files are
complete, which base a delta needs, what each ``latest`` may name, what is not uploaded yet);
split apart, each piece would re-derive them. The upload thread's mechanics, which need none of
them, live in ``gdsckpt.manager.remote``.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from .. import api as _api
from ..api import inflight
from ..api import saving as _saving
from ..api.checkpoint import base_chain
from ..api.resolve import open_reader, resolve_config
from ..background.async_save import AsyncSaver, SaveHandle
from ..codecs.base import check_stage_names
from ..config import Config
from ..errors import (
    CorruptCheckpointError,
    DeltaBaseError,
    NewerFormatError,
    ObjectChangedError,
    RemoteUploadError,
    RemoteUploadWarning,
    SkippedCheckpointWarning,
    StateMismatchError,
    UnsupportedFormatError,
)
from ..format.layout import TRAILER_SIZE
from ..io.pools import refuse_reentry
from ..io.posix import (
    open_regular,
    read_small_file,
    refuse_read_only,
    remove_if_stale,
    temporary_target,
    write_atomically,
)
from ..io.release import remove_releasing
from ..pipeline.load import open_file
from ..state import decode_scalar, escape_key, flatten
from ..state.delta import DEFAULT_MAX_CHAIN, base_path_of
from .remote import Uploader

DELTA_BASES = ("previous", "full")
"""What a ``CheckpointManager`` delta is based on: the newest checkpoint (a chain) or the newest
full one (a star)."""

PathLike = str | os.PathLike[str]

POINTER = "latest"

MAX_POINTER_BYTES = 1 << 20
"""``latest`` holds one file name (at most 255 bytes), and after a rollback a line per higher
checkpoint it supersedes (``_write_pointer``); a larger pointer is ignored unread."""

SUPERSEDED = "superseded"
"""The word that starts each of ``latest``'s lines after the first, ``superseded <fingerprint>
<name>``: a checkpoint of a higher step that was on disk when ``latest`` was written (an
abandoned run's), and its ``_fingerprint``."""


_MANAGER_LOCK = "a CheckpointManager moving 'latest' or pruning"
"""What a manager's lock guards, for ``refuse_reentry``'s message."""
_MANAGERS: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
"""The process's managers, whose locks a forked child gets free."""


def _free_locks_after_fork() -> None:
    """A manager's lock held by another thread at a fork (a background save writing ``latest``
    or pruning) was never released in the child: its next save waited for good."""
    for manager in list(_MANAGERS):
        manager._lock = threading.RLock()
        manager._saver.end_locks = [(manager._lock, _MANAGER_LOCK)]
        uploader = getattr(manager, "_uploader", None)
        if uploader is not None:
            uploader.after_fork_in_child()


os.register_at_fork(after_in_child=_free_locks_after_fork)


class _Pointer(NamedTuple):
    """The local ``latest``: the step it names, its mtime (ns) and the higher checkpoints it
    supersedes (step -> ``_fingerprint``; None for a one-line pointer, which records none)."""

    step: int
    mtime_ns: int
    superseded: dict[int, str] | None


RELISTS = 3
"""How many times ``restore_latest`` lists a tier again when every checkpoint it listed vanished;
beyond that it goes on while each listing brings new checkpoints, until ``Config.timeout``."""

_DAMAGE = (CorruptCheckpointError, UnsupportedFormatError, DeltaBaseError, FileNotFoundError)
"""What makes ``restore_latest`` pass over a checkpoint: proof that the file is damaged or not a
checkpoint (a checksum or structural check failed), a delta whose base is missing, changed or
damaged, or a file that vanished (a concurrent prune). Anything else is raised (module
docstring): an I/O error, running out of memory or an interruption says nothing about the file,
which may be intact, and silently restarting from an old state is worse than an error."""


def _is_damage(err: BaseException) -> bool:
    """Whether ``err`` proves the checkpoint unusable (one of ``_DAMAGE``). An ``OSError`` other
    than ``FileNotFoundError``, and the ``CheckpointError`` the reader raises for one ("I/O error
    reading chunk N"), are not: the next read may well succeed."""
    return isinstance(err, _DAMAGE) and not isinstance(err, NewerFormatError)



class CheckpointManager:
    """Numbered checkpoints of one training run in ``directory`` (created if missing; an
    ``s3://bucket/prefix`` URL keeps them as objects there, module docstring).

    ``keep_last``: how many of the newest checkpoints to keep (None: all). ``prefix``: the file
    name prefix. ``config``: the ``Config`` of every save and load. ``max_inflight``: background
    saves at once (``save_async``); each manager has its own snapshot pool (``pool_stats()``).
    ``delta_every`` / ``full_every`` (steps), ``max_chain`` and ``delta_base`` (``"previous"``,
    a chain; ``"full"``, every delta on the newest full checkpoint): delta checkpoints (module
    docstring). ``lossy``: a ``gdsckpt.lossy.LossyPolicy`` (or dict) every save applies; off by
    default. ``remote``: an ``s3://bucket/prefix`` URL each completed checkpoint is uploaded to in
    the background, ``keep_last_remote`` of them kept there (None: all); see "Remote tier" in the
    module docstring.
    """

    def __init__(self, directory: PathLike, *, keep_last: int | None = 3, prefix: str = "step",
                 config: Config | None = None, max_inflight: int = 1, delta_every: int | None = None,
                 full_every: int | None = None, max_chain: int = DEFAULT_MAX_CHAIN, lossy: Any = None,
                 delta_base: str = "previous", remote: str | None = None, keep_last_remote: int | None = 3):
        for name, value in (("keep_last", keep_last), ("keep_last_remote", keep_last_remote)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        for name, value in (("delta_every", delta_every), ("full_every", full_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 (steps) or None, got {value!r}")
        if isinstance(max_chain, bool) or not isinstance(max_chain, int) or max_chain < 0:
            raise ValueError(f"max_chain must be an int >= 0, got {max_chain!r}")
        _saving.check_save_arguments("auto", None, config, lossy)  # raised by every save otherwise
        if delta_base not in DELTA_BASES:
            raise ValueError(f"delta_base must be one of {DELTA_BASES}, got {delta_base!r}")
        if (not prefix or prefix.startswith(".") or "/" in prefix or os.sep in prefix or prefix == POINTER
                or "\n" in prefix or "\r" in prefix):
            raise ValueError(f"prefix {prefix!r} must be a plain file name part (no '/', no line break: "
                             f"'{POINTER}' lists names a line each; not starting with '.', not {POINTER!r})")
        self.objects_only = isinstance(directory, str) and directory.startswith("s3://")
        """``directory`` is an ``s3://`` prefix: the checkpoints are objects there, no local tier."""
        if self.objects_only:
            if remote is not None:
                raise ValueError("directory is an s3:// URL already: remote= is the object tier behind a "
                                 "local directory")
            remote, keep_last_remote = str(directory), keep_last
            self.directory: Any = str(directory).rstrip("/")
        else:
            self.directory = Path(directory)
            self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.prefix = prefix
        self.config = config
        self.max_inflight = max_inflight
        self.delta_every = delta_every
        self.full_every = full_every
        self.max_chain = max_chain
        self.delta_base = delta_base
        self.lossy = lossy
        self._pattern = re.compile(rf"^{re.escape(prefix)}-(\d{{10,}})\.gdsckpt$")
        self._saver = AsyncSaver()
        self._lock = threading.RLock()
        """Guards the bookkeeping below; held while ``latest`` moves and pruning runs. An
        ``RLock`` only so that a signal handler calling the manager where the frame it
        interrupted holds it is refused (``_refuse_reentry``) instead of waiting for itself:
        nothing takes it twice."""
        self._saver.end_locks.append((self._lock, _MANAGER_LOCK))  # the saves' hooks take it
        _MANAGERS.add(self)
        self._file_at_begin: dict[int, tuple[int, int] | None] = {}
        """Step -> the (device, inode) of its file when its first save still running began (None:
        there was none): a save's rename puts a new file there, whatever the times say (a
        ``chmod`` moves an old file's change time)."""
        self._epoch = 0
        """Rollbacks begun so far: a save that begins below the step ``latest`` names starts a new
        epoch (a run gone back to an older step), and the saves after it belong to it."""
        self._running_tokens: dict[int, list[int]] = {}
        """Step -> the tokens (``_begin``) of its saves still running, in the order they began:
        saves of one file run one after the other (``api.inflight``), so the first is the one
        writing. A step is here exactly while a save of it runs."""
        self._save_epochs: dict[int, int] = {}
        """Token of a save still running -> the epoch it began in (per save: a second save of a
        step, begun after a rollback, must not give the first, of the run gone back from, its
        epoch)."""
        self._last_token = 0
        self._pointer_epoch = 0
        """The epoch of the step ``latest`` names (as this manager last moved it)."""
        self._bases_in_use: Counter[int] = Counter()
        """Steps that saves still being written use as their base: never pruned under them."""
        self._unusable_bases: set[Any] = set()
        """Checkpoints a delta save found damaged when it read them (``save``): passed over as
        bases until their step is saved again."""
        self._pointer_step: int | None = None
        self.keep_last_remote = keep_last_remote
        self.remote = self._open_remote(remote)
        self._unsent: dict[int, int] = {}
        """Step -> the version (``_versions``) of a checkpoint complete on the local tier that the
        remote tier still lacks, the ``keep_last_remote`` newest in restore order
        (``steps_in_restore_order``): older ones would be pruned there at once."""
        self._version_count = 0
        self._versions: dict[int, int] = {}
        """Step -> which of this manager's completed saves (a count) its local file is: a step saved
        again (after a rollback) is a new version."""
        self._sent: dict[int, int] = {}
        """Step -> the version of it this manager last uploaded. A step whose local version differs
        is one the remote tier holds an older file of, whatever its listing says (a delta's base
        saved again while the remote was down goes up before the delta)."""
        self._recovered = False
        """Whether an upload round has looked for what an earlier process left unsent
        (``_upload_round``)."""
        self._remote_newest: int | None = None
        """The highest step this manager uploaded: what the remote ``latest`` should name."""
        self._remote_pointer: int | None = None
        """The step this manager last wrote to the remote ``latest``."""
        self._remote_bases: dict[tuple[str, int], int | None] = {}
        """(object name, size) -> the step of the base it needs (None: a full checkpoint)."""
        self._uploader = Uploader(self._upload_round, name="gdsckpt-manager-upload")
        if not self.objects_only:
            self._remove_stale_temporaries()

    def _open_remote(self, remote: str | None) -> Any:
        """The remote tier's ``ObjectDirectory``, or None without ``remote``."""
        if remote is None:
            return None
        from ..io.s3 import ObjectDirectory, is_url, upload_concurrency

        if not is_url(remote):
            raise ValueError(f"remote must be an s3://bucket/prefix URL, got {remote!r}")
        if any(ord(char) < 32 or ord(char) == 127 for char in self.prefix):  # in every object's name
            raise ValueError(f"prefix {self.prefix!r} holds a control character, which object names on "
                             f"{remote!r} cannot hold")
        config = resolve_config(self.config)
        return ObjectDirectory(remote, endpoint=config.s3_endpoint,
                               concurrency=upload_concurrency(config.max_inflight_bytes), timeout=config.timeout)

    # -----------------------------------------------------------------------------------------
    # names

    def path(self, step: int) -> Any:
        """The file of checkpoint ``step`` (a ``Path``; the object's URL where ``directory`` is an
        ``s3://`` prefix)."""
        if self.objects_only:
            return self.remote.url_of(self._name(step))
        return self.directory / self._name(step)

    def _name(self, step: int) -> str:
        """The file (or object) name of checkpoint ``step``."""
        return f"{self.prefix}-{_check_step(step):010d}.gdsckpt"

    def _files(self) -> dict[int, Path]:
        """Step -> path of every regular file (or symlink to one) named like a checkpoint of this
        prefix. Anything else so named (a FIFO, a directory, a device) is no checkpoint and is left
        alone: opening a FIFO would block, and pruning must not remove what no save wrote. Empty
        for a manager of objects only (no local tier)."""
        found: dict[int, Path] = {}
        if self.objects_only:
            return found
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    match = self._pattern.match(entry.name)
                    if match and _is_regular(entry):
                        found[int(match.group(1))] = Path(entry.path)
        except FileNotFoundError:
            pass
        return found

    def _remove_stale_temporaries(self) -> None:
        """Remove temporary files that dead processes left behind (checkpoints and pointer),
        including those whose long target name ``temporary_prefix`` shortened."""
        ours = f"{self.prefix}-"
        for entry in self.directory.iterdir():
            parsed = temporary_target(entry.name)
            if parsed is None:
                continue
            target, shortened = parsed
            if shortened:
                belongs = target.startswith(ours) or ours.startswith(target)
            else:
                belongs = bool(self._pattern.match(target)) or target == POINTER
            if belongs:
                remove_if_stale(entry)

    # -----------------------------------------------------------------------------------------
    # saving

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a checkpoint: a multiple of ``delta_every`` or of
        ``full_every`` (False when neither is set)."""
        _check_step(step)
        return any(every is not None and step % every == 0 for every in (self.delta_every, self.full_every))

    def _refuse_reentry(self) -> None:
        """``RuntimeError`` where this thread holds the manager's lock: a signal handler (a
        pre-emption's SIGTERM) that interrupted this manager while it moved ``latest`` or pruned
        and calls it again would wait for the frame it interrupted, for ever."""
        refuse_reentry(self._lock, _MANAGER_LOCK)

    def _base_for(self, step: int) -> Path | None:
        """The base of a delta at ``step``: the newest complete checkpoint below it (with
        ``delta_base="full"``: the newest complete full one), or None for a full save (deltas
        off, a ``full_every`` step, or no usable checkpoint yet)."""
        if self.delta_every is None or (self.full_every is not None and step % self.full_every == 0):
            return None
        with self._lock:
            pointed = self._remote_pointer if self.objects_only else self._pointer_step
        candidates = [pointed] if pointed is not None and pointed < step and self.delta_base == "previous" else []
        if not candidates:
            existing = self._remote_objects() if self.objects_only else self._files()
            candidates = [s for s in sorted(existing, reverse=True) if s < step]
        for candidate in candidates:
            path = self.path(candidate)
            if path in self._unusable_bases:
                continue
            # Reserved before it is checked, so that no save completing meanwhile prunes it between
            # the check and the delta's reads (a pruned candidate fails the check instead); kept
            # from then until this save ends.
            with self._lock:
                self._bases_in_use[candidate] += 1
            try:
                # the whole chain below it must resolve: a base replaced by an earlier step saved
                # again, or deleted, made every later delta on it fail until the next full save
                usable = (self.delta_base == "previous" or self._is_full(path)) and \
                    _problem(path, config=self.config, chain=True, newer=True) is None
            except BaseException:
                self._release_base(candidate)
                raise
            if usable:
                return path
            self._release_base(candidate)
        return None

    def _release_base(self, step: int) -> None:
        """One save fewer uses checkpoint ``step`` as its base (``_bases_in_use``)."""
        with self._lock:
            self._bases_in_use[step] -= 1
            if self._bases_in_use[step] <= 0:
                del self._bases_in_use[step]

    def _recorded_base(self, path: Path) -> tuple[bool, dict[str, Any] | None]:
        """(readable, the index's ``base`` member) of the checkpoint at ``path``; a damaged file
        reads as (False, None), anything else wrong is raised."""
        try:
            return True, _api.inspect(path, config=self.config).base
        except Exception as err:
            if not _is_damage(err):
                raise
            return False, None

    def _is_full(self, path: Path) -> bool:
        """Whether the checkpoint at ``path`` is a readable full one (no base); a newer gdsckpt's
        file is none (no base for this version's deltas)."""
        try:
            readable, base = self._recorded_base(path)
        except NewerFormatError:
            return False
        return readable and base is None

    def save(self, step: int, state: dict[Any, Any], *, codec: str = "auto") -> _api.SaveReport:
        """Save ``state`` as checkpoint ``step`` now (a delta when due, see the module
        docstring); then move ``latest`` and prune."""
        self._refuse_reentry()
        path, token = self._begin(step, state)
        base = None
        try:
            base = self._base_for(step)
            # after any save or conversion of this file or of its base still in flight (api.inflight)
            with inflight.exclusive(path, base, resolve_config(self.config).timeout, what="CheckpointManager.save"):
                report = self._save_now(step, state, path, base, codec)
            self._completed(step, token)
        finally:
            self._end(step, token, base)
        return report

    def _save_now(self, step: int, state: dict[Any, Any], path: Path, base: Path | None, codec: str) -> _api.SaveReport:
        """``save``'s file: a delta on ``base`` where given, in full where that base proves damaged."""
        # force: a run restarted from an older step writes over the abandoned run's files by
        # design (``latest`` then names the new one), deltas of that run based on them included.
        # With a remote tier the file is uploaded too, and there every byte saved is worth
        # ``ratio`` bytes of state: ``auto`` compresses even where the local disk outruns it.
        try:
            return _saving.save_flat(flatten(state), path, codec=codec, config=self.config, base=base,
                                     max_chain=self.max_chain, lossy=self.lossy, may_store_as_is=self.remote is None)
        except Exception as err:
            if base is None or not _is_damage(err):
                raise
            # The base's chunks proved damaged (or its chain broken) only as the delta read
            # them: this step is saved in full instead of lost, and no later delta uses it.
            self._unusable_bases.add(base)
            warnings.warn(f"checkpoint step {step}: its delta base {str(base)!r} cannot be read ({err}); "
                          f"saving it in full", SkippedCheckpointWarning, stacklevel=3)
            return _saving.save_flat(flatten(state), path, codec=codec, config=self.config, base=None,
                                     max_chain=self.max_chain, lossy=self.lossy, may_store_as_is=self.remote is None)

    def save_async(self, step: int, state: dict[Any, Any], *, codec: str = "auto") -> SaveHandle:
        """``gdsckpt.save_async`` of ``state`` as checkpoint ``step``: returns once the snapshot is
        taken; ``latest`` moves and pruning runs in the background once the file is complete
        (before the handle reports done)."""
        self._refuse_reentry()
        path, token = self._begin(step, state)
        try:
            base = self._base_for(step)
        except BaseException:
            self._end(step, token)
            raise
        return self._saver.save(state, path, codec=codec, config=self.config, max_inflight=self.max_inflight,
                                after=lambda _report: self._completed(step, token),
                                finally_=lambda error: self._end(step, token, base, error), base=base,
                                max_chain=self.max_chain,
                                lossy=self.lossy, force=True)  # force: as in save

    def wait(self, timeout: float | None = None) -> None:
        """Wait for this manager's background saves, and with a remote tier for its uploads
        (retrying those that failed); raise the first error no handle reported, or
        ``RemoteUploadError`` if the remote tier still lacks a checkpoint or its ``latest``."""
        self._saver.wait_all(timeout)  # refuses first where this thread holds our lock (end_locks)
        if self.remote is None:
            return
        self._uploader.request()
        if not self._uploader.wait_idle(timeout):
            raise TimeoutError(f"uploads to {self.remote.url} still running after {timeout} s")
        with self._lock:
            unsent = sorted(self._unsent)
            stale = self._remote_newest != self._remote_pointer
        if unsent or stale:
            what = f"checkpoint step(s) {unsent}" if unsent else "its latest pointer"
            raise RemoteUploadError(f"the remote tier {self.remote.url} lacks {what}: {self._uploader.error}; "
                                    f"kept on the local tier, retried by the next save or wait()")

    def pending_uploads(self) -> list[int]:
        """Steps complete on the local tier that the remote tier still lacks (empty without one)."""
        self._refuse_reentry()
        with self._lock:
            return sorted(self._unsent)

    def remote_steps(self) -> list[int]:
        """Steps of the checkpoint objects on the remote tier, ascending (a listing; empty without
        one)."""
        if self.remote is None:
            return []
        return sorted(self._remote_objects())

    # -----------------------------------------------------------------------------------------
    # the remote tier (module docstring, "Remote tier"); rounds run on the uploader's thread

    def _remote_objects(self) -> dict[int, tuple[str, int]]:
        """Step -> (name, size) of every object on the remote tier named like our checkpoints."""
        found = {}
        for name, size in self.remote.names().items():
            match = self._pattern.match(name)
            if match:
                found[int(match.group(1))] = (name, size)
        return found

    def _upload_round(self) -> None:
        """Upload what the remote tier lacks (oldest first: bases before their deltas), then move
        its ``latest``, then prune it. Raises on the first failure (the rest stays pending)."""
        with self._lock:  # before the listing: a step joins ``_unsent`` once its file is in place
            unsent = dict(self._unsent)
        files = self._files()
        remote = self._remote_objects()
        if not self._recovered:
            # An earlier process may have died with an upload pending (its ``_unsent`` died with
            # it): the checkpoint the local ``latest`` names goes up if the remote tier lacks it.
            named = self._pointer(warn=False) if files else None  # no local tier: nothing to resend
            if named is not None and named[0] in files and named[0] not in remote:
                with self._lock:
                    unsent[named[0]] = self._unsent.setdefault(named[0], self._versions.get(named[0], 0))
            elif named is not None and named[0] in files:
                # Uploaded, but the process may have died before the remote ``latest`` moved to
                # it: moved now (below), never back past a newer step another node pointed it at.
                pointed = self._remote_pointer_step(warn=False)
                if pointed is None or pointed < named[0]:
                    with self._lock:
                        self._remote_newest = max(named[0], self._remote_newest or named[0])
            self._recovered = True
        with self._lock:
            # still pending now: a step this manager dropped since the copy (superseded under
            # keep_last_remote, then pruned) did not vanish, and no warning blames another process
            vanished = {step for step in unsent if step in self._unsent and step not in files}
            unsent = {step: version for step, version in unsent.items() if step in self._unsent or step in vanished}
            for step in vanished:
                del self._unsent[step]
        if vanished:  # removed from the local tier by something other than this manager
            warnings.warn(f"checkpoint step(s) {sorted(vanished)} vanished from {str(self.directory)!r} "
                          f"before their upload to {self.remote.url}", RemoteUploadWarning, stacklevel=1)
        wanted = unsent.keys() & files.keys()
        with self._lock:  # a base goes up where the remote lacks it, or holds an older version of it
            wanted |= {step for step in self._bases_of(set(wanted), files)
                       if step not in remote or self._sent.get(step) != self._versions.get(step, self._sent.get(step))}
            versions = {step: self._versions.get(step, unsent.get(step, 0)) for step in wanted}
        try:
            for step in sorted(wanted):
                path = files[step]
                try:
                    self.remote.upload(path, path.name)
                except FileNotFoundError:
                    # pruned locally since the listing: superseded, or a base no kept delta needs now
                    with self._lock:
                        self._sent_or_gone(step, versions[step])
                    continue
                with self._lock:
                    # A save of the step that completed during the upload is a newer version: it
                    # stays pending (the upload may have read the file it replaced).
                    self._sent_or_gone(step, versions[step])
                    self._sent[step] = versions[step]
                    # The remote latest follows the local one: to the step it names, else to
                    # the highest below it. A higher step than the local latest is one a run
                    # rolled back from (completed saves move the local latest first), which a
                    # replacement node must not restore.
                    pointer, newest = self._pointer_step, self._remote_newest
                    if pointer is not None and newest is not None and newest > pointer:
                        newest = None  # a step rolled back from: any step up to the pointer beats it
                    if step == pointer or ((pointer is None or step < pointer)
                                           and (newest is None or step > newest)):
                        self._remote_newest = step
                self._forget_remote_base(path.name)
        finally:
            # even after a failed upload: what did go up (its bases before it) is whole, and a
            # replacement node restores the newest of it
            with self._lock:
                newest, pointed = self._remote_newest, self._remote_pointer
            if newest is not None and newest != pointed:
                self._write_remote_pointer(newest)
                with self._lock:
                    self._remote_pointer = newest
        self._prune_remote()
        with self._lock:  # what was kept only because it was not uploaded yet may go now
            self._prune(completed=-1)

    def _sent_or_gone(self, step: int, version: int) -> None:
        """Under ``_lock``: ``version`` of ``step`` is on the remote tier now (or its file is gone):
        no longer pending, unless a newer version of the step completed meanwhile."""
        if self._unsent.get(step) == version:
            del self._unsent[step]

    def _prune_remote(self) -> None:
        if self.keep_last_remote is None:
            return
        objects = self._remote_objects()
        with self._lock:
            keep = set(self._unsent) | set(self._bases_in_use)  # bases of saves being written
            if self._remote_pointer is not None:
                keep.add(self._remote_pointer)
        pointed = self._remote_pointer_step()
        if pointed is not None:
            keep.add(pointed)
        # keep_last_remote in restore order (a run that went back to an older step keeps its own)
        # and the highest step besides (an abandoned run keeps its last), as ``_prune`` locally
        keep.update(steps_in_restore_order(objects, pointed)[:self.keep_last_remote])
        if objects:
            keep.add(max(objects))
        pending = [step for step in keep if step in objects]
        while pending:  # the bases kept deltas need, transitively
            base = self._remote_base(objects[pending.pop()])
            if base is not None and base in objects and base not in keep:
                keep.add(base)
                pending.append(base)
        for step in sorted(objects, reverse=True):  # deltas before their bases, as ``_prune``
            if step not in keep:
                self.remote.remove(objects[step][0])

    def _forget_remote_base(self, name: str) -> None:
        """Drop the cached base of object ``name``, whose content is new (a step saved again after a
        rollback): the base it names may no longer be the one it needs, even at the same size."""
        for entry in [entry for entry in self._remote_bases if entry[0] == name]:
            del self._remote_bases[entry]

    def _remote_base(self, entry: tuple[str, int]) -> int | None:
        """The step of the base the remote object ``entry`` (name, size) needs, None for a full or
        damaged checkpoint or a base not of this manager (cached until this manager uploads that
        name again)."""
        if entry not in self._remote_bases:
            name, _size = entry
            try:
                link = _api.inspect(self.remote.url_of(name), config=self.config).base
            except Exception as err:
                if not _is_damage(err):
                    raise
                link = None  # a damaged object needs nothing (as _recorded_base on the local tier)
            match = self._pattern.match(link["path"]) if link is not None else None
            self._remote_bases[entry] = int(match.group(1)) if match else None
        return self._remote_bases[entry]

    def _remote_pointer_step(self, warn: bool = False) -> int | None:
        """The step the remote ``latest`` names, None if none (or not one of ours)."""
        return self._pointed_step(lambda: self.remote.read_small(POINTER, MAX_POINTER_BYTES),
                                  self.remote.url_of(POINTER), warn)

    def _write_remote_pointer(self, step: int) -> None:
        """Point the remote ``latest`` at checkpoint ``step`` (one PUT: readers see the old or the new)."""
        self.remote.write_small(POINTER, (self._name(step) + "\n").encode("utf-8"))

    def _remote_candidates(self, warn: bool = True) -> list[tuple[int, str, str]]:
        """(step, URL, source) of the remote tier in the order restore tries them
        (``steps_in_restore_order``): the one its ``latest`` names (listed or not), the lower steps
        descending, then the higher ones (an abandoned run's) descending."""
        pointed = self._remote_pointer_step(warn=warn)
        objects = self._remote_objects()
        order: list[tuple[int, str, str]] = []
        if pointed is not None:
            order.append((pointed, self.remote.url_of(self._name(pointed)), "named by the remote latest"))
        order.extend((step, self.remote.url_of(objects[step][0]),
                      "remote" if pointed is None or step < pointed else "a higher step than the remote latest: "
                      "an abandoned run's") for step in steps_in_restore_order(objects, pointed) if step != pointed)
        return order

    def pool_stats(self) -> Any:
        """Statistics of this manager's snapshot pool (``gdsckpt.async_save.PoolStats``)."""
        return self._saver.pool.stats()

    def prepare(self, state: dict[Any, Any]) -> int:
        """Allocate the snapshot buffers ``save_async`` of a state like ``state`` will use, before
        the training loop (``gdsckpt.async_save.AsyncSaver.prepare``); returns the bytes held."""
        return self._saver.prepare(state, config=self.config, max_inflight=self.max_inflight)

    def _begin(self, step: int, state: Any) -> tuple[Path, int]:
        if not isinstance(state, dict):
            raise TypeError(f"CheckpointManager saves a dict state (e.g. {{'model': ..., 'optimizer': "
                            f"...}}), got {type(state).__qualname__}")
        path = self.path(step)
        if not self.objects_only:
            # before the checkpoint is written: a save whose pointer update then failed was
            # reported failed with its checkpoint in place, and restores took it all the same
            refuse_read_only(self.directory / POINTER)
        with self._lock:
            latest = self._remote_pointer if self.objects_only else self._pointer_step
            if latest is not None and step < latest:
                # begun after a higher step completed: a rollback (a run gone back to an older
                # step in this process), whose saves latest then names, even below the abandoned
                # steps; a save in flight together with a higher one that finishes later is none,
                # and latest stays
                self._epoch += 1
            self._last_token += 1
            token = self._last_token
            self._save_epochs[token] = self._epoch
            self._running_tokens.setdefault(step, []).append(token)
            if step not in self._file_at_begin:
                # (objects: an upload appears whole, the local tier's rename rule is not theirs)
                self._file_at_begin[step] = None if self.objects_only else _identity(Path(path))
        return path, token

    def _running_epoch(self, step: int) -> int | None:
        """The epoch of the save of ``step`` that is writing (the first still running), None
        where none runs."""
        tokens = self._running_tokens.get(step)
        return self._save_epochs[tokens[0]] if tokens else None

    def _end(self, step: int, token: int, base: Path | None = None, error: BaseException | None = None) -> None:
        """A save of ``step`` (a delta on ``base``) ended, with ``error`` or None: a base whose
        chunks proved damaged as a background delta read them is passed over from now on (the
        save's handle reports the error; ``save`` retries in full itself)."""
        if base is not None and error is not None and _is_damage(error):
            self._unusable_bases.add(base)
        with self._lock:
            self._save_epochs.pop(token, None)
            tokens = self._running_tokens.get(step, [])
            if token in tokens:
                tokens.remove(token)
            if not tokens:
                self._file_at_begin.pop(step, None)
                self._running_tokens.pop(step, None)
            elif not self.objects_only:
                # the next save of the step replaces the file there now (this one's, or the old)
                self._file_at_begin[step] = _identity(self.path(step))
        match = self._pattern.match(Path(str(base)).name) if base is not None else None
        if match:
            self._release_base(int(match.group(1)))

    def _completed(self, step: int, token: int) -> None:
        """Checkpoint ``step`` is complete: point ``latest`` at it where ``_moves_latest`` says so
        (a higher step of its epoch may be there already), then prune."""
        self._unusable_bases.discard(self.path(step))  # a new file: a base again
        if self.objects_only:
            self._completed_object(step, token)
            return
        with self._lock:
            epoch = self._save_epochs.get(token, self._epoch)
            newest = max([step, *self._renamed_in_flight(step, epoch)])
            if self._moves_latest(epoch, newest, self._pointer_step):
                self._write_pointer(newest, epoch)
                self._pointer_step, self._pointer_epoch = newest, epoch
            elif self._pointer_step is not None and step > self._pointer_step:
                # A save begun before a rollback, completed after it: a step the run went back
                # from, above ``latest``, which must record it as superseded (a restore would
                # take it for a save killed before its pointer update).
                self._write_pointer(self._pointer_step, self._pointer_epoch)
            self._version_count += 1
            self._versions[step] = self._version_count
            if self.remote is not None:
                self._unsent[step] = self._version_count
                if self.keep_last_remote is not None:  # older ones would be pruned there at once
                    kept = steps_in_restore_order(self._unsent, self._pointer_step)[:self.keep_last_remote]
                    self._unsent = {s: self._unsent[s] for s in kept}
            try:
                self._prune(completed=step)
            except Exception as err:  # noqa: BLE001 - the save itself is complete and published
                # Pruning only ever deletes; when it cannot tell which files to keep (an I/O error
                # reading one, memory short), deleting nothing is safe and the next save tries again.
                warnings.warn(f"checkpoint step {step} is saved, but pruning {str(self.directory)!r} "
                              f"was skipped: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
        if self.remote is not None:
            self._uploader.request()

    def _completed_object(self, step: int, token: int) -> None:
        """``_completed`` of a manager of objects only: the object is complete (an upload appears
        whole); move the ``latest`` object (only ever to a higher step of this manager), prune."""
        with self._lock:
            self._forget_remote_base(self._name(step))
            epoch = self._save_epochs.get(token, self._epoch)
            if self._moves_latest(epoch, step, self._remote_pointer):
                self._write_remote_pointer(step)
                self._remote_pointer = self._remote_newest = step
                self._pointer_epoch = epoch
        try:
            self._prune_remote()
        except Exception as err:  # noqa: BLE001 - as in _completed: the save is complete and published
            warnings.warn(f"checkpoint step {step} is saved, but pruning {self.directory!r} was skipped: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)

    def _moves_latest(self, epoch: int, step: int, pointed: int | None) -> bool:
        """Whether a save of ``epoch`` completing ``step`` moves ``latest`` (naming ``pointed``):
        a later epoch's (a rollback) always, the same epoch's to a step at least as high, an
        earlier epoch's (a step the run has gone back from) never."""
        if pointed is None or epoch > self._pointer_epoch:
            return True
        return epoch == self._pointer_epoch and step >= pointed

    def _renamed_in_flight(self, step: int, epoch: int) -> list[int]:
        """Higher steps than ``step`` whose saves are still running but whose files are already in
        place (renamed since their saves began): complete, their ``latest`` update to come. Why:
        with saves in flight together a later step can finish first; had ``latest`` then named
        ``step``, written after that file's rename, a process killed before the later step's own
        update would restore ``step`` (the later file no longer counts as completed after
        ``latest``), throwing its progress away. Only steps of ``epoch``: a rollback's ``latest``
        never names a step the run has gone back from."""
        return [later for later in self._renamed_saves() if later > step and self._running_epoch(later) == epoch]

    def _renamed_saves(self) -> list[int]:
        """Steps whose saves are still running and whose new files are in place (another file
        than the one there when the save began)."""
        renamed = []
        for later, before in self._file_at_begin.items():
            if self._running_tokens.get(later):
                now = _identity(self.path(later))
                if now is not None and now != before:
                    renamed.append(later)
        return renamed

    def _write_pointer(self, step: int, epoch: int) -> None:
        """Point ``latest`` at checkpoint ``step``, recording every checkpoint of a higher step on
        disk now (an abandoned run's: files of this run's higher steps still in flight are not
        renamed yet) with its ``_fingerprint``. Why: such a file is tried after ``latest``, while a higher
        one that appears later (a save that completed while its pointer update had not) is tried
        before it; telling them apart by change times failed wherever a file's ctime moved (a
        ``chmod``, a ``cp -a`` or ``rsync -a`` of the run), and restores took the abandoned run's
        state. A rewrite of a recorded step is a new file: its fingerprint differs."""
        config = self.config if self.config is not None else Config.from_env()
        name = self._name(step)
        files = self._files()
        # not the new files of saves still running of this run (begun at or after ``epoch``,
        # ``step``'s: a rollback's later saves): they are newer, not superseded
        newer = {later for later in self._renamed_saves() if (self._running_epoch(later) or 0) >= epoch}
        lines = [name, *(f"{SUPERSEDED} {_fingerprint(files[higher])} {files[higher].name}"
                         for higher in sorted(files) if higher > step and higher not in newer)]
        text = "\n".join(lines) + "\n"
        if len(text.encode("utf-8")) > MAX_POINTER_BYTES:
            warnings.warn(f"{len(lines) - 1} checkpoints above step {step} in {str(self.directory)!r} are more "
                          f"than 'latest' can record: restores tell them from newer ones by change times",
                          RuntimeWarning, stacklevel=4)
            text = name + "\n"
        write_atomically(self.directory / POINTER, text.encode("utf-8"), fsync=config.fsync,
                         timeout=config.timeout)

    def _prune(self, completed: int) -> None:
        if self.keep_last is None:
            return
        files = self._files()
        # Steps with a save still running (``completed``'s own save is done writing).
        busy = {step for step, tokens in self._running_tokens.items() if len(tokens) > (step == completed)}
        keep = set(busy)
        if self._pointer_step is not None:
            keep.add(self._pointer_step)
        on_disk = self._pointer(warn=False) if files else None
        if on_disk is not None:  # what ``latest`` names, whoever wrote it (a run this one resumes)
            keep.add(on_disk[0])
        # In the order restore tries them: an abandoned run's higher steps count last, so a
        # restarted run keeps keep_last of its own
        readable = [step for step, _path, _source in self._restore_order(files, on_disk)
                    if step in files and step not in busy and _problem(files[step], config=self.config) is None]
        keep.update(readable[:self.keep_last])
        if readable:  # and the newest by step: an abandoned run keeps its last checkpoint
            keep.add(max(readable))
        keep.update(self._bases_in_use)
        keep.update(self._unsent)  # the only copy until uploaded
        keep |= self._bases_of(keep, files)
        # Highest first: a delta's base has a lower step than the delta, so a process killed
        # between two removals never leaves a delta whose base is gone.
        for step in sorted(files, reverse=True):
            if step not in keep:
                try:
                    remove_releasing(files[step])  # a large file's storage is freed off the save's path
                except FileNotFoundError:
                    pass
                self._versions.pop(step, None)  # its next save is a new file, whatever was sent
                self._sent.pop(step, None)

    def _bases_of(self, steps: set[int], files: dict[int, Path]) -> set[int]:
        """Steps of the checkpoints that the delta checkpoints among ``steps`` need, transitively."""
        needed: set[int] = set()
        pending = [step for step in steps if step in files]
        while pending:
            path = files[pending.pop()]
            _readable, base = self._recorded_base(path)  # an unreadable file needs nothing
            if base is None:
                continue
            base_path = base_path_of(str(path), base)
            match = self._pattern.match(base_path.name)
            if match and base_path.parent.resolve() == self.directory.resolve():
                step = int(match.group(1))
                if step not in needed and step in files:
                    needed.add(step)
                    pending.append(step)
        return needed

    # -----------------------------------------------------------------------------------------
    # finding and restoring

    def steps(self) -> list[int]:
        """Steps of the readable checkpoints (header, trailer and index check out), ascending."""
        if self.objects_only:
            return [step for step, url, _source in sorted(self._remote_candidates(warn=False))
                    if _problem(url, config=self.config) is None]
        files = self._files()
        return [step for step in sorted(files) if _problem(files[step], config=self.config) is None]

    def latest_step(self) -> int | None:
        """The step ``restore_latest`` would pick first (without warnings or a full verify)."""
        tiers: list[Callable[..., Any]] = [self._remote_candidates] if self.objects_only else [self._candidates]
        if self.remote is not None and not self.objects_only:
            tiers.append(self._remote_candidates)  # a replacement node's: restore falls back to it
        for number, candidates in enumerate(tiers):
            for step, path, _source in candidates(warn=False):
                if _problem(path, config=self.config, chain=True) is None:  # checked as restore_latest does
                    return step
                # a damaged local file: restore_latest reads the remote tier's copy of that step
                copy = self._remote_copy(step, path) if number == 0 and self.remote is not None else None
                if copy is not None and _problem(copy[1], config=self.config, chain=True) is None:
                    return step
        return None

    def _pointer(self, warn: bool) -> _Pointer | None:
        """The local ``latest`` (``_Pointer``), or None (missing, or not naming a checkpoint of
        ours)."""
        pointer = self.directory / POINTER
        try:
            mtime = pointer.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        except OSError as err:
            if warn:
                warnings.warn(f"ignoring unreadable pointer {str(pointer)!r}: {err}",
                              SkippedCheckpointWarning, stacklevel=3)
            return None
        parsed = self._parse_pointer(lambda: read_small_file(pointer, MAX_POINTER_BYTES), str(pointer), warn)
        return None if parsed is None else _Pointer(parsed[0], mtime, parsed[1])

    def _pointed_step(self, read: Any, where: str, warn: bool) -> int | None:
        """The step a ``latest`` pointer names, ``read()`` giving its bytes (``where`` names it);
        None if it is missing, unreadable or not naming a checkpoint of ours (with ``warn``, a
        ``SkippedCheckpointWarning`` says which, at the caller of ``restore_latest``)."""
        parsed = self._parse_pointer(read, where, warn, stacklevel=5)
        return None if parsed is None else parsed[0]

    def _parse_pointer(self, read: Any, where: str, warn: bool,
                       stacklevel: int = 4) -> tuple[int, dict[int, str] | None] | None:
        """``_pointed_step``, and the checkpoints the pointer supersedes (``_Pointer``)."""
        try:
            text = read().decode("utf-8").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, CorruptCheckpointError, UnsupportedFormatError) as err:
            if warn:
                warnings.warn(f"ignoring unreadable pointer {where!r}: {err}", SkippedCheckpointWarning,
                              stacklevel=stacklevel)
            return None
        first, *rest = text.split("\n")
        match = self._pattern.match(first)
        records: dict[int, str] = {}
        for line in rest:
            # the name last: a prefix may hold spaces
            word, fingerprint, name = (line.split(" ", 2) + ["", "", ""])[:3]
            recorded = self._pattern.match(name)
            if word != SUPERSEDED or recorded is None or not fingerprint:
                match = None
                break
            records[int(recorded.group(1))] = fingerprint
        superseded = records if rest else None
        if not match:
            if warn:
                warnings.warn(f"ignoring pointer {where!r}: {text[:80]!r} is not a "
                              f"{self.prefix}-<step>.gdsckpt name", SkippedCheckpointWarning,
                              stacklevel=stacklevel)
            return None
        return int(match.group(1)), superseded

    def _candidates(self, warn: bool) -> list[tuple[int, Path, str]]:
        """(step, path, source) in the order restore tries them.

        First checkpoints with a higher step than ``latest`` names that were written after
        ``latest`` was (a crash between a save's rename and its pointer update leaves one), then the
        one ``latest`` names, then the lower steps, descending, and last the higher steps written
        before ``latest`` (an abandoned run's: a run restarted from an older step falls back to
        its own earlier checkpoints before those). ``_prune`` keeps ``keep_last`` in this order,
        and the newest by step besides.
        """
        if self.objects_only:
            return []
        return self._restore_order(self._files(), self._pointer(warn))

    def _restore_order(self, files: dict[int, Path], pointer: _Pointer | None) -> list[tuple[int, Path, str]]:
        """``_candidates`` of a listing (``_files``) and a pointer (``_pointer``) already read."""
        order: list[tuple[int, Path, str]] = []
        pointed = None
        if pointer is not None:
            pointed = pointer.step
            # a save that completed while its pointer was not yet written: newer than ``latest``
            for step in sorted(files, reverse=True):
                if step > pointed and _newer_than(files[step], step, pointer):
                    order.append((step, files[step], "completed after latest was written"))
            order.append((pointed, self.path(pointed), "named by latest"))
        listed = {step for step, _path, _source in order}
        order.extend((step, files[step], "scan" if pointed is None or step < pointed
                      else "a higher step written before latest: an abandoned run's")
                     for step in steps_in_restore_order(files, pointed) if step not in listed)
        return order

    def restore_latest(self, model: Any = None, optimizer: Any = None, state: dict[Any, Any] | None = None, *,
                       verify: bool = False) -> tuple[int, dict[Any, Any]] | None:
        """Restore the newest complete checkpoint in place; see the module docstring for the
        contract. ``verify=True`` reads and checks every chunk of a candidate first
        (``gdsckpt.verify``) instead of header, trailer and index only.

        Returns ``(step, extra)`` or ``None`` when there is no readable checkpoint.
        """
        if state is not None and not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__qualname__}")
        failed_loads: list[tuple[int, str | Path, BaseException]] = []
        tried: set[tuple[int, str]] = set()  # both tiers': a remote copy tried for a local file is not tried again
        restored = self._restore_listed(self._candidates, model, optimizer, state, verify, failed_loads, tried,
                                        instead=self._remote_copy if self.remote is not None else None)
        if restored is None and self.remote is not None:
            restored = self._restore_listed(self._remote_candidates, model, optimizer, state, verify,
                                            failed_loads, tried)
        if restored is None and failed_loads and (model is not None or optimizer is not None or state):
            step, path, error = failed_loads[-1]
            raise CorruptCheckpointError(
                f"no checkpoint could be restored, and the targets hold part of {str(path)!r} (step {step}), "
                f"which failed while loading ({error}): they are not a fresh start. Restore with "
                f"verify=True to check every chunk before anything is written") from error
        return restored

    def _restore_listed(self, candidates: Callable[..., Any], model: Any, optimizer: Any,
                        state: dict[Any, Any] | None, verify: bool,
                        failed_loads: list[tuple[int, str | Path, BaseException]], tried: set[tuple[int, str]],
                        instead: Any = None) -> tuple[int, dict[Any, Any]] | None:
        """``_restore_first`` of the candidates ``candidates(warn=...)`` lists (a tier's). Every
        candidate gone (pruned by a process saving meanwhile) is no proof that none is left: the
        checkpoints that replaced them are listed again while new ones appear, never a fresh start
        returned. A saver that prunes each checkpoint faster than this reads one (an object store,
        ``keep_last=1``) keeps it going past ``RELISTS`` listings until ``Config.timeout``, then
        a ``TimeoutError``. ``tried``: (step, path) of the candidates tried so far, added to."""
        timeout = resolve_config(self.config).timeout
        deadline = time.monotonic() + timeout
        listing = 0
        while True:
            listed: list[tuple[int, str | Path, str]] = [
                candidate for candidate in candidates(warn=listing == 0)
                if (candidate[0], str(candidate[1])) not in tried]
            if not listed:
                return None
            if listing >= RELISTS and time.monotonic() > deadline:
                raise TimeoutError(f"restore_latest: every checkpoint listed in {listing} listings was removed "
                                   f"before it could be read, for {timeout} s "
                                   f"(config timeout): another process prunes faster than this one reads")
            listing += 1
            restored = self._restore_first(listed, model, optimizer, state, verify, failed_loads, tried,
                                           instead=instead)
            if restored is not None:
                return restored

    def _remote_copy(self, step: int, path: str | Path) -> tuple[int, str | Path, str] | None:
        """The remote tier's copy of local checkpoint ``step`` as a candidate, or None where it has
        none. Asked only once the local file proved damaged: a restore of intact local files
        sends no request to the remote tier."""
        from ..io.s3 import is_url

        assert self.remote is not None
        if is_url(str(path)):  # a remote candidate itself: there is no other copy
            return None
        name = Path(path).name
        return (step, self.remote.url_of(name), "remote copy") if self.remote.size(name) is not None else None

    def _restore_first(self, candidates: Any, model: Any, optimizer: Any, state: dict[Any, Any] | None,
                       verify: bool, failed_loads: list[tuple[int, str | Path, BaseException]],
                       tried: set[tuple[int, str]], instead: Any = None) -> tuple[int, dict[Any, Any]] | None:
        """Restore the first usable of ``candidates`` ((step, path or URL, source)), passing over
        damaged ones with a warning (module docstring); those that failed while loading (after
        their checks, so part of them may be in the targets) are added to ``failed_loads``.
        ``instead(step, path)``: another copy of a damaged candidate's step to try before the
        older ones (the remote tier's), or None; a newer step whole elsewhere beats an older one
        here."""
        pending = list(candidates)
        replaced: set[str] = set()
        while pending:
            step, path, source = pending.pop(0)
            if (step, str(path)) in tried and str(path) not in replaced:
                continue  # a remote copy already tried for a local file
            tried.add((step, str(path)))
            try:
                # with its delta chain: a missing or changed base found before anything is written
                problem = _problem(path, verify=verify, config=self.config, chain=True)
                if problem is None:
                    writing: list[bool] = []
                    try:
                        return step, self._load(path, model, optimizer, state, writing)
                    except Exception as err:
                        if not _is_damage(err):
                            raise
                        # A file vanishing (a concurrent prune) fails its open, before any write:
                        # a local file cannot vanish under its reader, and a pruned object's
                        # newer replacement is listed next.
                        if writing and not isinstance(err, FileNotFoundError):
                            failed_loads.append((step, path, err))
                        problem = f"failed while loading: {err}"
            except ObjectChangedError:
                # saved again while read (a whole new version of the same step): read it once
                # more; a second replacement meanwhile is raised, never taken for damage
                if str(path) in replaced:
                    raise
                replaced.add(str(path))
                pending.insert(0, (step, path, source))
                continue
            warnings.warn(f"skipping checkpoint {str(path)!r}"
                          f"{f' ({source})' if source != 'scan' else ''}: {problem}",
                          SkippedCheckpointWarning, stacklevel=3)
            other = instead(step, path) if instead is not None else None
            if other is not None:
                pending.insert(0, other)
        return None

    def _load(self, path: str | Path, model: Any, optimizer: Any, state: dict[Any, Any] | None,
              writing: list[bool]) -> dict[Any, Any]:
        """Restore ``path`` into the targets (module docstring, "How"); ``writing`` gets an entry
        once the targets may change."""
        with open_reader(path, resolve_config(self.config)) as reader:
            tree = open_file(reader).index.tree
        if tree.get("t") != "dict":
            raise StateMismatchError(f"checkpoint {str(path)!r} does not hold a dict at its top level")
        top_keys = [decode_scalar(key) for key, _child in tree["items"]]
        target: dict[Any, Any] = dict(state) if state is not None else {}
        if model is not None:
            target["model"] = model
        if optimizer is not None:
            target["optimizer"] = optimizer
        if target:
            writing.append(True)
            _api.load_into(target, path, strict=False, config=self.config)
            if state is not None:
                for key, value in state.items():  # load_into replaced top-level plain values in ``target``
                    if value is None or isinstance(value, (bool, int, float, str)):
                        state[key] = target[key]
        rest = [key for key in top_keys if key not in target]
        if not rest:
            return {}
        if not target:
            return _api.load(path, config=self.config)
        return _api.load(path, keys=[escape_key(key) for key in rest], config=self.config)


def steps_in_restore_order(steps: Iterable[int], pointed: int | None) -> list[int]:
    """``steps`` in the order a restore tries them on either tier: the one its ``latest`` names
    (``pointed``), the lower steps descending, then the higher ones descending (a run that went
    back to an older step abandoned those: they count last). Pending uploads and pruning follow
    it too, so that what a tier keeps is what a restore from it would take."""
    ordered = sorted(steps, reverse=True)
    if pointed is None:
        return ordered
    return ([pointed] if pointed in ordered else []) + [step for step in ordered if step < pointed] + \
        [step for step in ordered if step > pointed]


def _is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()  # follows a symlink; False for FIFOs, devices, sockets, directories
    except OSError:
        return False


def _newer_than(path: Path, step: int, pointer: _Pointer) -> bool:
    """Whether checkpoint ``path`` of ``step`` (above the one ``pointer`` names) came after
    ``latest`` was written: not the file ``latest`` recorded as superseded for that step
    (``_write_pointer``). A one-line pointer records none (none was above it, or a version that
    did not record them wrote it): there the file's change time tells (``_changed_ns``)."""
    if pointer.superseded is None:
        return _changed_ns(path) >= pointer.mtime_ns
    recorded = pointer.superseded.get(step)
    return recorded is None or not _same_file(_fingerprint(path), recorded)


def _fingerprint(path: Path) -> str:
    """What tells one file of a step from another written later under its name, and survives a
    copy that keeps modification times (``cp -a``, ``rsync -a``) or a ``chmod``:
    ``<size>:<digest of its trailer>:<mtime in ns>`` (the trailer holds the index's checksum;
    the time tells a save replayed with the same bytes from the file it replaced); ``-`` where
    it cannot be read."""
    try:
        fd = open_regular(path)
    except (OSError, UnsupportedFormatError):
        return "-"
    try:
        status = os.fstat(fd)
        tail = os.pread(fd, TRAILER_SIZE, max(status.st_size - TRAILER_SIZE, 0))
    except OSError:
        return "-"
    finally:
        os.close(fd)
    return f"{status.st_size}:{hashlib.sha256(tail).hexdigest()[:16]}:{status.st_mtime_ns}"


def _same_file(current: str, recorded: str) -> bool:
    """Whether fingerprint ``current`` is the file ``recorded`` was taken of: size and trailer
    alike, and the modification time at the precision the file keeps now (a copy to a file
    system with coarser times, which truncates them, is still the same file)."""
    head, _sep, now_text = current.rpartition(":")
    recorded_head, _sep, then_text = recorded.rpartition(":")
    if head != recorded_head or not now_text.isdigit() or not then_text.isdigit():
        return current == recorded  # "-" (unreadable) matches only "-"
    now, then = int(now_text), int(then_text)
    grain = next((g for g in (10**9, 10**6, 10**3) if now % g == 0), 1)
    return now // grain == then // grain


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, None where there is none."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _changed_ns(path: Path) -> int:
    """When ``path`` last changed, its rename included (ns; -1 where it cannot be read). A
    checkpoint's mtime is its last write, before its fsync and rename: a save whose file was
    renamed after ``latest`` was written may have finished writing before it (saves in flight
    together), so the rename's ctime is what tells it completed after ``latest``."""
    try:
        stat = path.stat()
    except OSError:
        return -1
    return max(stat.st_mtime_ns, stat.st_ctime_ns)


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return step


def _problem(path: str | Path, *, verify: bool = False, config: Config | None = None,
             chain: bool = False, newer: bool = False) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None: ``gdsckpt.open``'s checks of header,
    trailer and index (or, with ``verify``, ``gdsckpt.verify`` of every chunk); with ``chain``,
    also each base of a delta opened in turn and checked to be the file it was written against
    (``open_base``). Only damage (``_is_damage``) is a reason, and with ``newer`` a newer
    gdsckpt's file (``NewerFormatError``); any other error (an I/O error, running out of memory,
    without ``newer`` a newer gdsckpt's file) is raised."""
    try:
        if verify:
            _api.verify(path, config=config)
        else:
            with _api.open(path, config=config) as checkpoint:
                index = checkpoint._opened.index  # a newer writer's names: NewerFormatError
                check_stage_names(index.chains, {chunk.chain for chunk in index.chunks})
                if chain:
                    with base_chain(checkpoint, resolve_config(config)):
                        pass
    except FileNotFoundError:
        return "file is missing"
    except Exception as err:
        if not _is_damage(err) and not (newer and isinstance(err, NewerFormatError)):
            raise
        return f"{type(err).__name__}: {err}"
    return None


__all__ = ["CheckpointManager", "SkippedCheckpointWarning"]
