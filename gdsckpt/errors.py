"""The exceptions gdsckpt raises. A leaf module: every layer may import it, it imports nothing.

One base class, ``CheckpointError``, and its subclasses, each message naming the bad value and,
where there are valid choices, listing them; errors that are also misuse or a runtime failure keep
the built-in class callers catch them by (``StateMismatchError`` is a ``ValueError``,
``SaveWorkerError`` a ``RuntimeError``). Failures of underlying libraries are wrapped with
``raise ... from err``; resource errors (``MemoryError``, ``OSError``) are raised as themselves.
The warnings the package issues are here too. Every class is importable from ``gdsckpt``.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every gdsckpt error about a checkpoint file or its contents."""


class CorruptCheckpointError(CheckpointError):
    """The file is damaged: bad checksum, truncated, inconsistent index, undecodable chunk.

    ``key`` and ``chunk`` name the tensor and chunk where the damage was found, when known;
    ``base`` the file it is in where that is a delta's base, not the file the caller named (a
    delta's own chunk numbers are not the base's: the message names the file to replace).
    """

    def __init__(self, message: str, *, key: str | None = None, chunk: int | None = None,
                 base: str | None = None):
        parts = [message if base is None else f"{message} in base checkpoint {base!r}"]
        if key is not None:
            parts.append(f"tensor {key!r}")
        if chunk is not None:
            parts.append(f"chunk {chunk}")
        super().__init__(parts[0] if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})")
        self.reason = message
        self.key = key
        self.chunk = chunk
        self.base = base

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by its parts (a save worker process hands its errors back pickled): the default
        # rebuilt it from the whole message, with key, chunk and base lost.
        return _corrupt_error, (type(self), self.reason, self.key, self.chunk, self.base)


def _corrupt_error(cls: type[CorruptCheckpointError], reason: str, key: str | None, chunk: int | None,
                   base: str | None) -> CorruptCheckpointError:
    return cls(reason, key=key, chunk=chunk, base=base)


class UnsupportedFormatError(CheckpointError):
    """The file is not a gdsckpt checkpoint, or has a format version this reader cannot read."""


class NewerFormatError(UnsupportedFormatError):
    """The checkpoint was written by a newer gdsckpt: a format major version, codec or transform
    this version does not know, in a header or index whose checksum holds. Intact as far as this
    version can tell: upgrade gdsckpt to read it. ``CheckpointManager.restore_latest`` raises it
    rather than restoring an older step, and its pruning never removes such a file."""


class CodecUnavailableError(CheckpointError):
    """A codec named by the caller or by a checkpoint cannot run here (e.g. a GPU-only codec
    on a machine without a GPU, or a missing optional package)."""


class StateMismatchError(CheckpointError, ValueError):
    """``load_into`` found keys, shapes or dtypes that differ between target and checkpoint."""


class DeltaBaseError(CheckpointError):
    """A delta checkpoint's base is missing, was changed since the delta was written against it,
    or does not hold an array the delta needs; or a save would replace a file that deltas use as
    their base."""


BaseCheckpointError = DeltaBaseError
"""The former name of ``DeltaBaseError`` (it read like the root class), kept as an alias for one
release."""


class ConvertError(CheckpointError):
    """A conversion failed: the source cannot be read as its format, or its content cannot be
    written in the destination format. The message names the file and, where one is to blame,
    the key."""


class UnsafePickleError(ConvertError):
    """A torch pickle holds objects other than tensors and plain containers (it could run code
    when unpickled); ``convert`` reads pickles only with ``torch.load(weights_only=True)``."""


class InsufficientSpaceError(CheckpointError, ValueError):
    """A target has less free space than ``gdsckpt bench`` (``tools.storagebench``) would write
    there at once."""


class SaveWorkerError(CheckpointError, RuntimeError):
    """The worker process of ``save_async`` with ``Config(async_worker="process")`` died, did not
    answer within ``Config.timeout``, or could not be started; that save failed (the target path
    keeps its previous content) and the next save starts a new worker."""


class RemoteUploadError(CheckpointError):
    """``CheckpointManager.wait`` found checkpoints that the manager's remote tier still lacks
    (their upload failed, also when retried): they stay on the local tier, where pruning keeps
    them, and the next save or ``wait`` uploads them again."""


class StateChangedError(CheckpointError):
    """A save found that an array it was writing from the state's own memory changed while it
    was written (another thread updating a tensor during the save): the file would hold bytes
    its checksums do not cover, so nothing is saved and the file at the path stays as it was."""


class ObjectChangedError(CheckpointError):
    """The object a read of an ``s3://`` URL reads was replaced after the reader opened it: its GETs ask for
    the version it opened (``If-Match`` that version's ETag) and the server holds another one now.
    Not damage: the object at the URL is a complete checkpoint (saves replace objects whole), only
    not the one this read began with, and opening it again reads the new one."""


class RemoteUploadWarning(UserWarning):
    """A background upload of a ``CheckpointManager`` checkpoint to its remote tier failed; it
    is retried by the next save and by ``wait``."""


class SkippedCheckpointWarning(UserWarning):
    """``restore_latest`` passed over a checkpoint file (incomplete, damaged, or vanished)."""


class LossyWarning(UserWarning):
    """A load read arrays that were saved with ``save(lossy=...)``: within their recorded error
    bounds, not bit-exact."""


class ForeignExtensionWarning(UserWarning):
    """A save's path ends in an extension another format owns (``.pt``, ``.safetensors``,
    ``.npz`` ...): the file is a gdsckpt checkpoint all the same, which that format's tools cannot
    read. Name it ``.gdsckpt``, or write the other format with ``gdsckpt convert``."""


class PickleOnlyMetadataWarning(UserWarning):
    """A save wrote DCP's metadata as the pickle ``.metadata`` only: it holds a value the JSON
    form cannot express. ``GdsStorageReader`` then needs ``trust_pickle=True`` to load it."""
