"""``python -m gdsckpt``: the ``gdsckpt`` command."""

import sys

from .cli.main import main

sys.exit(main())
