"""``python -m trio_rl.learn`` moved to ``trio-rl run`` (``python -m trio_rl run``), which
reads configuration files and handles signals; this module only says so (the learning run
is a layer below the command line and does not import it)."""

import sys

print(
    "python -m trio_rl.learn is now `trio-rl run` (or `python -m trio_rl run`), with the same "
    "options; see `trio-rl run --help`",
    file=sys.stderr,
)
sys.exit(2)
