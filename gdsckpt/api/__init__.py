"""The public API: save, load, load_into, open, inspect, verify, rebase.

Each call flattens or rebuilds the state (``gdsckpt.state``), plans chunks, and runs the one
pipeline (``gdsckpt.pipeline``) with an engine and a storage backend chosen from the
configuration. The modules, by job:

- ``reports``: what the calls return (``SaveReport``, ``CheckpointInfo`` with its ``TensorInfo``,
  ``ChunkInfo`` and ``GroupInfo``, ``VerifyReport``);
- ``resolve``: a call's arguments -> configuration, codec, reader or writer, engine, device;
- ``saving``: ``save``, ``rebase`` and ``save_flat``, the one save entry the background savers
  and the integrations use too;
- ``checkpoint``: the restore core and ``Checkpoint`` (``open``);
- ``reading``: ``load``, ``inspect``, ``verify``;
- ``in_place``: ``load_into``.
"""

from ..codecs import known_codec_names
from ..errors import CheckpointError
from ..state import escape_key
from .checkpoint import Checkpoint, open
from .in_place import load_into
from .reading import inspect, load, verify
from .reports import CheckpointInfo, ChunkInfo, GroupInfo, Progress, SaveReport, TensorInfo, VerifyReport
from .saving import rebase, save

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointInfo", "ChunkInfo", "GroupInfo", "Progress", "SaveReport", "TensorInfo",
    "VerifyReport",
    "escape_key", "inspect", "known_codec_names", "load", "load_into", "open", "rebase", "save", "verify",
]
