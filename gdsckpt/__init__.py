"""gdsckpt: GPU-native, compressed, chunked and indexed checkpoints of training state.

``import gdsckpt`` needs neither a GPU nor torch, CuPy, nvCOMP or kvikio: array libraries and
GPU packages are imported when a state or a call needs them.
"""

from .version import __version__
from .api import (  # noqa: E402
    Checkpoint, CheckpointInfo, SaveReport, TensorInfo, VerifyReport, inspect, load, load_into, open,
    rebase, save, verify,
)
from .background.async_save import SaveHandle, save_async, wait_all  # noqa: E402
from .config import Config  # noqa: E402
from .integrations.convert import ConvertError, ConvertReport, UnsafePickleError, convert  # noqa: E402
from .errors import (  # noqa: E402
    BaseCheckpointError, CheckpointError, CodecUnavailableError, CorruptCheckpointError, SaveWorkerError,
    StateMismatchError, UnsupportedFormatError,
)
from .state.lossy import LossyPolicy, LossyWarning  # noqa: E402
from .manager import CheckpointManager, SkippedCheckpointWarning  # noqa: E402

__all__ = [
    "BaseCheckpointError", "Checkpoint", "CheckpointError", "CheckpointInfo", "CheckpointManager", "CodecUnavailableError",
    "Config", "ConvertError", "ConvertReport", "CorruptCheckpointError", "LossyPolicy", "LossyWarning",
    "SaveHandle", "SaveReport", "SaveWorkerError",
    "SkippedCheckpointWarning", "StateMismatchError", "TensorInfo", "UnsafePickleError",
    "UnsupportedFormatError", "VerifyReport", "__version__", "convert", "inspect", "load", "load_into",
    "open", "rebase", "save", "save_async", "verify", "wait_all",
]
