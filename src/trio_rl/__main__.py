"""``python -m trio_rl``: the ``trio-rl`` command."""

import sys

from .cli import leave, main

sys.exit(leave(main()))
