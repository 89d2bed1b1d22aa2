"""The documented import path ``gdsckpt.lossy``: the opt-in lossy policies and their analysis tools.

The code lives in :mod:`gdsckpt.state.lossy`; this module re-exports its public names so that
``import gdsckpt.lossy`` keeps working as the README and docs show it.
"""

from .state.lossy import *
from .state.lossy import __all__  # noqa: F401
