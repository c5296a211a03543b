"""The ``trio-rl`` console script's first module: it makes SIGINT and SIGTERM one line while
the package is still importing (``import trio_rl`` takes most of a second), then hands over to
:func:`trio_rl.cli.main`, which keeps them one line until the event loop's watcher takes over.

It imports nothing but the standard library before its handlers are in place.
"""

from __future__ import annotations

import signal
import sys
from typing import NoReturn

_received: list[int] = []


def _raise(signum: int, frame: object) -> NoReturn:
    _received.append(signum)
    raise KeyboardInterrupt


def main() -> int:
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        from trio_rl.cli import main as cli_main
    except KeyboardInterrupt:
        signum = _received[0] if _received else signal.SIGINT
        name = signal.Signals(signum).name
        print(f"trio-rl: stopped by {name} before any work started", file=sys.stderr)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return cli_main()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
