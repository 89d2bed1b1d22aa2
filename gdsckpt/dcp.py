"""The documented import path ``gdsckpt.dcp``: the torch.distributed.checkpoint storage layer
(``GdsStorageWriter`` / ``GdsStorageReader``).

The code lives in :mod:`gdsckpt.integrations.dcp`; this module re-exports its public names so that
``import gdsckpt.dcp`` keeps working as the README and docs show it.
"""

from .integrations.dcp import *
from .integrations.dcp import __all__
