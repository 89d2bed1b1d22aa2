"""The exceptions gdsckpt raises. A leaf module: every layer may import it, it imports nothing.

One base class, a few subclasses, each message naming the bad value and, where there are valid
choices, listing them. Failures of underlying libraries are wrapped with ``raise ... from err``.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every gdsckpt error about a checkpoint file or its contents."""


class CorruptCheckpointError(CheckpointError):
    """The file is damaged: bad checksum, truncated, inconsistent index, undecodable chunk.

    ``key`` and ``chunk`` name the tensor and chunk where the damage was found, when known.
    """

    def __init__(self, message: str, *, key: str | None = None, chunk: int | None = None):
        parts = [message]
        if key is not None:
            parts.append(f"tensor {key!r}")
        if chunk is not None:
            parts.append(f"chunk {chunk}")
        super().__init__(parts[0] if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})")
        self.reason = message
        self.key = key
        self.chunk = chunk


class UnsupportedFormatError(CheckpointError):
    """The file is not a gdsckpt checkpoint, or has a format version this reader cannot read."""


class CodecUnavailableError(CheckpointError):
    """A codec named by the caller or by a checkpoint cannot run here (e.g. a GPU-only codec
    on a machine without a GPU, or a missing optional package)."""


class StateMismatchError(CheckpointError, ValueError):
    """``load_into`` found keys, shapes or dtypes that differ between target and checkpoint."""


class BaseCheckpointError(CheckpointError):
    """A delta checkpoint's base is missing, was changed since the delta was written against it,
    or does not hold an array the delta needs."""


class SaveWorkerError(RuntimeError):
    """The worker process of ``save_async`` with ``Config(async_worker="process")`` died, did not
    answer within ``Config.timeout``, or could not be started; that save failed (the target path
    keeps its previous content) and the next save starts a new worker."""
