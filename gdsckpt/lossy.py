"""The documented import path ``gdsckpt.lossy``: the opt-in lossy policies and their analysis tools.

The code lives in :mod:`gdsckpt.state.lossy` (policies and rounding) and
:mod:`gdsckpt.state.lossy_analysis` (``compare_modes``, ``sensitivity``); this module re-exports
their public names so that ``import gdsckpt.lossy`` keeps working as the README and docs show it.
"""

from .state import lossy as _policies
from .state import lossy_analysis as _analysis
from .state.lossy import *
from .state.lossy_analysis import *

__all__ = [*_policies.__all__, *_analysis.__all__]
