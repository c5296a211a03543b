"""``trio-rl watch RUN_DIR``: show a run's metrics records (its ``metrics.jsonl``) through the
console display, one plain line per step off a terminal, a live table on one.

``--follow`` keeps showing records as the run appends them (until interrupted); ``--plain``
prints plain lines even on a terminal. Also ``python -m trio_rl.tools.watch_cmd``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..rundir import RunDirectory
from ._errors import InspectError
from ._main import tool_main
from .console import ConsoleDisplay
from .metrics import read_metrics

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``watch`` subcommand's arguments."""
    parser.add_argument("path", type=Path, help="a run directory or its metrics.jsonl")
    parser.add_argument("--plain", action="store_true", help="plain lines, never the table")
    parser.add_argument(
        "--follow", action="store_true", help="keep showing records as the run appends them"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=0.5,
        help="seconds between polls with --follow (default 0.5)",
    )


def run(args: argparse.Namespace) -> int:
    """Show the records; with ``--follow`` poll for more until interrupted (then 130). A
    damaged line raises :class:`~trio_rl.tools.MetricsFileError` after the lines before it."""
    path = RunDirectory(args.path).metrics if args.path.is_dir() else args.path
    if not path.is_file():
        what = "no metrics.jsonl in this run directory" if args.path.is_dir() else "no such file"
        raise InspectError(str(path), f"{what} (pass a run directory or its metrics.jsonl)")
    display = ConsoleDisplay(plain=True if args.plain else None)
    shown = 0
    try:
        while True:
            records = read_metrics(path)
            for record in records[shown:]:
                display.write(record)
            shown = len(records)
            if not args.follow:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 130
    finally:
        display.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trio_rl.tools.watch_cmd``: errors are one line on stderr, status 1."""
    return tool_main("trio-rl watch", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
