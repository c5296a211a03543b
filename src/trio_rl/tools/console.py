"""The live console display of a run: one row per shipped step.

Fed the same records as ``metrics.jsonl`` (:mod:`trio_rl.tools.metrics`), it shows step,
reward, samples/s, slot occupancy, loop lag, queue depth and off-policy lag. On a terminal,
with ``rich`` installed (``trio-rl[console]``), a live table of the latest steps redraws in
place; otherwise (output not a terminal, ``plain=True`` or ``--plain``, or no ``rich``) each
record is one plain line, fit for a log file or ``tail -f``. A field a record lacks shows ``-``.

``trio-rl watch RUN_DIR [--follow] [--plain]`` (:mod:`trio_rl.tools.watch_cmd`) shows a run's
``metrics.jsonl`` through this display.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections import deque
from collections.abc import Callable, Mapping
from typing import IO, Any

__all__ = ["COLUMNS", "ConsoleDisplay", "format_line"]


def _num(fmt: str) -> Callable[[Any], str]:
    def render(value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "-"
        if fmt == "d" and isinstance(value, float):
            return format(value, "g")  # a count written as a float: show it, not fail
        return format(value, fmt)

    return render


#: (record field, column title, formatter), in display order.
COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("step", "step", _num("d")),
    ("reward_mean", "reward", _num(".3f")),
    ("samples_per_s", "samples/s", _num(".1f")),
    ("slot_occupancy", "slots", _num(".0%")),
    ("loop_lag_p95_ms", "lag p95 ms", _num(".1f")),
    ("queue_depth", "queue", _num("d")),
    ("off_policy_max", "off-policy", _num(".0f")),
)


def format_line(record: Mapping[str, Any]) -> str:
    """One record as a plain line: ``step 3 | reward 0.516 | samples/s 812.0 | ...``."""
    return " | ".join(f"{title} {render(record.get(key))}" for key, title, render in COLUMNS)


class ConsoleDisplay:
    """A :class:`~trio_rl.tools.metrics.MetricsSink` that shows each record on ``stream``.

    ``plain``: ``None`` decides from ``stream.isatty()`` (and whether ``rich`` is installed);
    ``True`` forces plain lines; ``False`` forces the live table (raising ImportError-derived
    :class:`~trio_rl.tools.MissingExtraError` without ``rich``). ``rows``: how many recent
    steps the live table keeps.
    """

    def __init__(
        self, stream: IO[str] | None = None, *, plain: bool | None = None, rows: int = 10
    ) -> None:
        self.stream = sys.stdout if stream is None else stream
        has_rich = importlib.util.find_spec("rich") is not None
        if plain is None:
            isatty = getattr(self.stream, "isatty", None)
            plain = not (has_rich and callable(isatty) and isatty())
        if not plain and not has_rich:
            from ._errors import MissingExtraError

            raise MissingExtraError("the live console table", "rich", "console")
        self.plain = plain
        self._recent: deque[Mapping[str, Any]] = deque(maxlen=rows)
        self._live: Any = None
        if not plain:
            # imported by name: type-checking does not need the optional extra installed
            rich_console = importlib.import_module("rich.console")
            rich_live = importlib.import_module("rich.live")
            console = rich_console.Console(file=self.stream, force_terminal=True)
            self._live = rich_live.Live(self._table(), console=console, auto_refresh=False)
            self._live.start()

    def _table(self) -> Any:
        table = importlib.import_module("rich.table").Table(title="trio-rl", expand=False)
        for _, title, _ in COLUMNS:
            table.add_column(title, justify="right")
        for record in self._recent:
            table.add_row(*(render(record.get(key)) for key, _, render in COLUMNS))
        return table

    def write(self, record: Mapping[str, Any]) -> None:
        if self.plain:
            self.stream.write(format_line(record) + "\n")
            self.stream.flush()
            return
        self._recent.append(dict(record))
        self._live.update(self._table(), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
