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
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import IO, Any

__all__ = [
    "COLUMNS",
    "TRAINER_COLUMNS",
    "ConsoleDisplay",
    "StepRates",
    "format_line",
    "progress_line",
]


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


#: The trainer's fields the display shows when a record carries them: (field, title, format).
TRAINER_COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("trainer/loss", "loss", _num(".4f")),
    ("trainer/kl", "kl", _num(".4f")),
    ("trainer/entropy", "entropy", _num(".3f")),
)


def _count(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


#: The outcomes counted as waste: generated, never trained, for a scheduling or engine reason
#: (pruned samples are not: the reward gave them no signal).
_WASTED = ("stale", "cancelled", "failed", "filtered")


class StepRates:
    """Per-step figures from the record's cumulative counters (``stale``, ``pruned`` and the
    sink's ``counters/<outcome>``): samples dropped as stale and pruned since the previous
    record, and the waste, the share of the samples settled since then that will never train
    (stale, cancelled, failed, filtered). A record's own ``waste`` field (the publisher's
    figure for the step) is shown as it is. The first record's are against zero (a fresh
    run) or, for a resumed run, what it resumed with."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def update(self, record: Mapping[str, Any]) -> dict[str, float | None]:
        now = {
            key: value
            for key in record
            if (key in ("stale", "pruned") or key.startswith("counters/"))
            and (value := _count(record[key])) is not None
        }
        if not now and "waste" not in record:
            return {}
        delta = {key: value - self._last.get(key, 0.0) for key, value in now.items()}
        self._last.update(now)
        out: dict[str, float | None] = {
            "stale": delta.get("stale", delta.get("counters/stale")),
            "pruned": delta.get("pruned", delta.get("counters/pruned")),
        }
        if "waste" in record:
            out["waste"] = _count(record["waste"])
            return out
        settled = sum(
            v for k, v in delta.items() if k.startswith("counters/") and k != "counters/dispatched"
        )
        wasted = sum(delta.get(f"counters/{k}", 0.0) for k in _WASTED)
        has_counters = any(k.startswith("counters/") for k in delta)
        out["waste"] = max(0.0, wasted / settled) if has_counters and settled > 0 else None
        return out


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _rate_parts(rates: Mapping[str, float | None]) -> list[str]:
    parts = []
    for key in ("stale", "pruned"):
        if key in rates:
            value = rates[key]
            parts.append(f"{key} {'-' if value is None else format(value, 'g')}")
    if "waste" in rates:
        waste = rates["waste"]
        parts.append(f"waste {'-' if waste is None else format(waste, '.0%')}")
    return parts


def progress_line(
    record: Mapping[str, Any],
    rates: Mapping[str, float | None] | None = None,
    *,
    last_step: int | None = None,
    eta_s: float | None = None,
) -> str:
    """The plain line of a record with the run's progress: :func:`format_line`, then ``step
    N/M`` (with ``last_step``), the per-step stale and pruned counts and the waste (from
    :class:`StepRates`), the trainer's loss, KL and entropy when the record has them, the samples
    the reward failed on (a cumulative count, when there are any), and the ETA. A trainer's
    record of its own (no ``samples``) is ``trainer step S | loss ...``."""
    trainer = [
        f"{title} {render(record[key])}" for key, title, render in TRAINER_COLUMNS if key in record
    ]
    if "samples" not in record and "reward_mean" not in record and trainer:
        return " | ".join([f"trainer step {_num('d')(record.get('step'))}", *trainer])
    line = format_line(record)
    if last_step is not None:
        head, sep, rest = line.partition(" | ")
        line = f"{head}/{last_step}{sep}{rest}"
    parts = [line, *_rate_parts(rates or {}), *trainer]
    # a reward that raised failed its sample: counted, and shown on the line of its run
    if record.get("counters/reward_failures"):
        parts.append(f"reward failed {record['counters/reward_failures']} samples")
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    return " | ".join(parts)


class ConsoleDisplay:
    """A :class:`~trio_rl.tools.metrics.MetricsSink` that shows each record on ``stream``.

    ``plain``: ``None`` decides from ``stream.isatty()`` (and whether ``rich`` is installed);
    ``True`` forces plain lines; ``False`` forces the live table (raising ImportError-derived
    :class:`~trio_rl.tools.MissingExtraError` without ``rich``). ``rows``: how many recent
    steps the live table keeps.

    ``total``: the steps this run ships (its progress: ``step N/M``, a progress bar under the
    table and the ETA, from the time per step since the display opened). ``log``: called with
    the plain line of every record, whatever is shown (a run's log file gets the same fields as
    the terminal).
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        plain: bool | None = None,
        rows: int = 10,
        total: int | None = None,
        log: Callable[[str], None] | None = None,
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
        self.total = total
        self._log = log
        self._rates = StepRates()
        self._recent: deque[dict[str, Any]] = deque(maxlen=rows)
        self._shown: dict[str, Any] | None = None  # the latest step's record and figures
        self._opened = time.monotonic()
        self._done = 0
        self._first: int | None = None
        self._live: Any = None
        self._tee: _LineTee | None = None
        if not plain:
            # imported by name: type-checking does not need the optional extra installed
            rich_console = importlib.import_module("rich.console")
            rich_live = importlib.import_module("rich.live")
            console = rich_console.Console(file=self.stream, force_terminal=True)
            self._live = rich_live.Live(self._view(), console=console, auto_refresh=False)
            self._live.start()
            if log is not None:
                # the live display prints what the program prints above itself (its stdout
                # proxy); the log gets those lines too
                self._tee = _LineTee(sys.stdout, log)
                sys.stdout = self._tee

    @property
    def last_step(self) -> int | None:
        """The run's last step (``total`` steps from the first shown), once a step was shown."""
        if self.total is None or self._first is None:
            return None
        return self._first + self.total - 1

    def _eta(self) -> float | None:
        if self.total is None or self._done == 0:
            return None
        per_step = (time.monotonic() - self._opened) / self._done
        return per_step * max(0, self.total - self._done)

    def _table(self) -> Any:
        table = importlib.import_module("rich.table").Table(title="trio-rl", expand=False)
        trainer = [c for c in TRAINER_COLUMNS if any(c[0] in r for r in self._recent)]
        rates = any("waste" in r["_rates"] for r in self._recent)
        for _, title, _ in COLUMNS:
            table.add_column(title, justify="right")
        if rates:
            for title in ("stale", "pruned", "waste"):
                table.add_column(title, justify="right")
        for _, title, _ in trainer:
            table.add_column(title, justify="right")
        for record in self._recent:
            cells = [render(record.get(key)) for key, _, render in COLUMNS]
            if rates:
                cells += [p.split(" ", 1)[1] for p in _rate_parts(record["_rates"])] or ["-"] * 3
            cells += [render(record.get(key)) for key, _, render in trainer]
            table.add_row(*cells)
        return table

    def _bar(self) -> Any:
        """The progress bar and its figures: step N/M, reward, samples/s, ETA."""
        rich_table = importlib.import_module("rich.table")
        bar = importlib.import_module("rich.progress_bar").ProgressBar
        latest = self._shown or {}
        reward = _num(".3f")(latest.get("reward_mean"))
        rate = _num(".1f")(latest.get("samples_per_s"))
        eta = self._eta()
        grid = rich_table.Table.grid(padding=(0, 1))
        grid.add_row(
            bar(total=self.total or 1, completed=self._done, width=30),
            f"step {_num('d')(latest.get('step'))}/{self.last_step}",
            f"reward {reward}",
            f"samples/s {rate}",
            f"ETA {'-' if eta is None else _duration(eta)}",
        )
        return grid

    def _view(self) -> Any:
        if self.total is None or self._shown is None:
            return self._table()
        group = importlib.import_module("rich.console").Group
        return group(self._table(), self._bar())

    def write(self, record: Mapping[str, Any]) -> None:
        is_step = "samples" in record or "reward_mean" in record
        rates = self._rates.update(record) if is_step else {}
        if is_step:
            self._done += 1
            if self._first is None and isinstance(record.get("step"), int):
                self._first = record["step"]
        line = progress_line(record, rates, last_step=self.last_step, eta_s=self._eta())
        if self._log is not None:
            self._log(line)
        if self.plain:
            self.stream.write(line + "\n")
            self.stream.flush()
            return
        if is_step:
            self._shown = {**record, "_rates": rates}
            self._recent.append(self._shown)
        else:  # a trainer's report: shown in its step's row, if that row is still shown
            for row in self._recent:
                if row.get("step") == record.get("step"):
                    row.update({k: v for k, v in record.items() if k.startswith("trainer/")})
        self._live.update(self._view(), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            tee = self._tee
            if tee is not None and sys.stdout is tee:
                wrapped = tee.wrapped
                tee.flush()
                sys.stdout = wrapped
            self._live.stop()
            self._live = None


class _LineTee:
    """A stdout that writes through to ``wrapped`` and hands each whole line to ``log``."""

    def __init__(self, wrapped: Any, log: Callable[[str], None]) -> None:
        self.wrapped, self._log, self._part = wrapped, log, ""

    def write(self, text: str) -> int:
        self.wrapped.write(text)
        lines = (self._part + text).split("\n")
        self._part = lines.pop()
        for line in lines:
            if line.strip():
                self._log(line)
        return len(text)

    def flush(self) -> None:
        self.wrapped.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)
