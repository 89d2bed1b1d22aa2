"""The documented import path ``gdsckpt.async_save``: background saves (``prepare``, ``pool_stats``,
``clear_pool``, ``AsyncSaver``, ``SaveHandle``).

The code lives in :mod:`gdsckpt.background.async_save`; this module re-exports its public names so
that ``gdsckpt.async_save.prepare(state)`` keeps working as the README and docs show it.
"""

from .background.async_save import *
from .background.async_save import __all__
