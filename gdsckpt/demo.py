"""The documented import path ``gdsckpt.demo``: the demo model, training state and bit-exact
comparison.

The code lives in :mod:`gdsckpt.tools.demo`; this module re-exports its public names so that
``import gdsckpt.demo`` keeps working as the README and docs show it.
"""

from .tools.demo import *
from .tools.demo import __all__
