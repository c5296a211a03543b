"""The ``trio-rl`` console script's first module: it holds SIGINT and SIGTERM back (blocked,
so the operating system keeps them pending) while the package imports, so a signal during
start-up is never lost to a handler swap, never kills the process without a word and never
prints a traceback from the middle of an import. :func:`trio_rl.cli.main` keeps them blocked
until the event loop's signal watcher listens, which then receives a pending one and stops the
command as it would later (one line, exit 130 / 143).

It imports nothing but the standard library before the signals are blocked.
"""

from __future__ import annotations

import signal
import sys

#: The signal mask the process started with, restored once the watcher listens.
ORIGINAL_MASK = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def main() -> int:
    try:
        from trio_rl.cli import leave
        from trio_rl.cli import main as cli_main
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, ORIGINAL_MASK)
        raise
    return leave(cli_main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
