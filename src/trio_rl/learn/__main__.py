"""``python -m trio_rl.learn``: the learning run (see :func:`trio_rl.learn.main`)."""

import sys

from . import main

sys.exit(main())
