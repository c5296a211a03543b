"""``python -m trio_rl``: the ``trio-rl`` command."""

import sys

from .cli import main

sys.exit(main())
