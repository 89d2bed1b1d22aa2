"""gdsckpt: GPU-native, compressed, chunked and indexed checkpoints of training state.

``import gdsckpt`` needs neither a GPU nor torch, CuPy, nvCOMP or kvikio: array libraries and
GPU packages are imported when a state or a call needs them.
"""

from .api import (
    Checkpoint,
    CheckpointInfo,
    SaveReport,
    TensorInfo,
    VerifyReport,
    inspect,
    load,
    load_into,
    open,
    rebase,
    save,
    verify,
)
from .background.async_save import SaveHandle, save_async, wait_all
from .config import Config
from .errors import (
    BaseCheckpointError,
    CheckpointError,
    CodecUnavailableError,
    ConvertError,
    CorruptCheckpointError,
    DeltaBaseError,
    ForeignExtensionWarning,
    InsufficientSpaceError,
    LossyWarning,
    NewerFormatError,
    ObjectChangedError,
    PickleOnlyMetadataWarning,
    RemoteUploadError,
    RemoteUploadWarning,
    SaveWorkerError,
    SkippedCheckpointWarning,
    StateChangedError,
    StateMismatchError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .integrations.convert import ConvertReport, convert
from .manager import CheckpointManager
from .state.lossy import LossyPolicy
from .version import __version__

__all__ = [
    "BaseCheckpointError", "Checkpoint", "CheckpointError", "CheckpointInfo", "CheckpointManager",
    "CodecUnavailableError", "Config", "ConvertError", "ConvertReport", "CorruptCheckpointError",
    "DeltaBaseError", "ForeignExtensionWarning", "InsufficientSpaceError", "LossyPolicy", "LossyWarning",
    "NewerFormatError", "ObjectChangedError", "PickleOnlyMetadataWarning",
    "RemoteUploadError", "RemoteUploadWarning", "SaveHandle", "SaveReport", "SaveWorkerError",
    "SkippedCheckpointWarning", "StateChangedError", "StateMismatchError", "TensorInfo", "UnsafePickleError",
    "UnsupportedFormatError", "VerifyReport", "__version__", "convert", "inspect", "load", "load_into",
    "open", "rebase", "save", "save_async", "verify", "wait_all",
]


_ON_FIRST_USE = ("async_save", "dcp", "lightning", "lossy")
"""Documented modules reachable as attributes after a plain ``import gdsckpt`` (the README's
``gdsckpt.async_save.prepare``), imported on first use: ``gdsckpt.dcp`` brings in
``torch.distributed`` and ``gdsckpt.lightning`` Lightning, which ``import gdsckpt`` does not need."""


def __getattr__(name: str) -> object:
    """The modules of ``_ON_FIRST_USE``, imported when first named."""
    if name in _ON_FIRST_USE:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
