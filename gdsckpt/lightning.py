"""The documented import path ``gdsckpt.lightning``: the Lightning ``CheckpointIO`` plugin
(``GdsCheckpointIO``).

The code lives in :mod:`gdsckpt.integrations.lightning`; this module re-exports its public names so that
``import gdsckpt.lightning`` keeps working as the README and docs show it.
"""

from .integrations.lightning import *
from .integrations.lightning import __all__
