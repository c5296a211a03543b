"""The ``python -m trio_rl.tools.<tool>`` entry shared by the tools: one parser, one line per
error."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ..errors import TrioRLError


def tool_main(
    prog: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], object],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """Parse ``argv`` for ``prog`` (described by the first line of ``doc``) and run it; a
    :class:`TrioRLError` is one line on stderr and status 1."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TrioRLError as exc:
        print(f"trio-rl: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
