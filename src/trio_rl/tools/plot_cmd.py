"""``trio-rl plot RUN_DIR``: the standard figures of a run, from its ``metrics.jsonl``, as PNG.

One figure: ``trio-rl run`` draws its ``plot.png`` with the same :func:`write_figure`, so both
carry one title (``trio-rl run DIR | task T | seed S | W s wall``, the task and seed from the
run's ``config.toml``). Where the run stopped, and why (its ``ended.json``), is a dashed line
on every panel and the figure's second title line. Eight panels against step, each quantity
on an axis of its own: reward (mean reward), throughput (samples scored per second, over a
sliding window of steps: one step's rate is spiky, a step can ship from a backlog in
milliseconds), slot occupancy, off-policy lag (the mean lag of a step's samples, with the
largest as a dotted line: the largest alone sits at ``max_async_level`` and is a flat line),
loop lag (the event loop's p95, ms), and the trainer's loss, KL and entropy (``trainer/...``,
from the trainer's reports). Each y range is robust: it spans the bulk of the
values (quartiles +- 3 interquartile ranges), so one outlier (a 950 ms first step) does not
squash a panel; points beyond it are drawn on the edge as triangles and counted in the panel.
A panel whose fields no record has says so instead of drawing an empty line. With the run's
held-out evals (``eval.jsonl``), the reward panel also draws their ``avg@k`` and ``pass@1``
against the eval's step. Needs matplotlib (``trio-rl[learn]``); without it the command fails
with one line naming the extra.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..rundir import RunDirectory
from ._errors import InspectError, MissingExtraError
from ._main import tool_main
from .metrics import read_metrics

__all__ = [
    "PANELS",
    "add_arguments",
    "build_figure",
    "main",
    "read_evals",
    "run",
    "run_facts",
    "write_figure",
]

#: Panel titles, in order (the figure's axes carry exactly these titles).
PANELS = (
    "reward",
    "throughput",
    "slot occupancy",
    "off-policy lag",
    "loop lag",
    "trainer loss",
    "trainer KL",
    "trainer entropy",
)
_WINDOW = 10

#: (panel, record field, y label, colour) of the panels that plot one field as it is.
_SIMPLE = (
    ("slot occupancy", "slot_occupancy", "busy fraction of decode slots", "tab:green"),
    (
        "off-policy lag",
        "train/effective/off_policy/mean",
        "lag shipped: mean, dotted largest (versions)",
        "tab:purple",
    ),
    ("loop lag", "loop_lag_p95_ms", "event-loop lag p95 (ms)", "tab:red"),
    ("trainer loss", "trainer/loss", "policy loss", "tab:brown"),
    ("trainer KL", "trainer/kl", "KL to the behaviour policy (k3)", "tab:pink"),
    ("trainer entropy", "trainer/entropy", "entropy (nats)", "tab:olive"),
)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def _scored(record: Mapping[str, Any]) -> int:
    """Samples scored for a record's step (records without the count: what was shipped)."""
    for key in ("reward_count", "samples"):
        value = record.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _steps_only(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The orchestrator's records of shipped steps (a trainer's own report is not a step)."""
    return [r for r in records if "samples" in r or "reward_mean" in r or "wall_s" in r]


def _throughput(records: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float]]:
    """Samples scored per second over the last ``_WINDOW`` steps (needs ``wall_s``); records
    without ``wall_s`` fall back to their own ``samples_per_s``."""
    records = _steps_only(records)
    if not all(isinstance(r.get("wall_s"), int | float) for r in records):
        return _series(records, "samples_per_s")
    steps, rates = [], []
    for i, r in enumerate(records):
        first = max(0, i - _WINDOW + 1)
        before = float(records[first - 1]["wall_s"]) if first else 0.0
        elapsed = max(float(r["wall_s"]) - before, 1e-9)
        scored = sum(_scored(m) for m in records[first : i + 1])
        steps.append(int(r["step"]))
        rates.append(scored / elapsed)
    return steps, rates


def _missing(ax: Any, what: str) -> None:
    ax.text(
        0.5,
        0.5,
        f"no {what} in metrics.jsonl",
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="gray",
    )


def robust_limits(values: Sequence[float], floor: float | None = None) -> tuple[float, float]:
    """A y range for ``values`` that one outlier does not decide: the quartiles widened by
    three interquartile ranges, cut to the values' own range, padded by 5 %. ``floor`` (0 for
    counts, rates and lags) is always included: only outliers above the bulk are cut."""
    ordered = sorted(values)
    n = len(ordered)

    def quantile(q: float) -> float:
        pos = q * (n - 1)
        i = int(pos)
        j = min(i + 1, n - 1)
        return ordered[i] + (ordered[j] - ordered[i]) * (pos - i)

    q1, q3 = quantile(0.25), quantile(0.75)
    spread = q3 - q1
    low = max(ordered[0], q1 - 3 * spread)
    high = min(ordered[-1], q3 + 3 * spread)
    if floor is not None:
        low = min(floor, ordered[0])
    if high - low < 1e-9:  # a flat line: a range around it
        pad = abs(high) * 0.1 or 1.0
        return low - pad, high + pad
    pad = (high - low) * 0.05
    return low - pad, high + pad


def _draw(ax: Any, steps: list[int], values: list[float], color: str, floor: float | None) -> None:
    """The line, on a robust y range; values beyond it as triangles on the edge, counted."""
    ax.plot(steps, values, color=color)
    low, high = robust_limits(values, floor)
    ax.set_ylim(low, high)
    above = [(s, v) for s, v in zip(steps, values, strict=True) if v > high]
    below = [(s, v) for s, v in zip(steps, values, strict=True) if v < low]
    for points, edge, marker in ((above, high, "^"), (below, low, "v")):
        if points:
            ax.plot([s for s, _ in points], [edge] * len(points), marker, color=color, ms=6)
    if above or below:
        shown = ", ".join(f"{v:.4g}" for _, v in (above + below)[:3])
        more = "" if len(above) + len(below) <= 3 else ", ..."
        ax.text(
            0.99,
            0.97,
            f"{len(above) + len(below)} off scale ({shown}{more})",
            ha="right",
            va="top",
            transform=ax.transAxes,
            fontsize="small",
            color="gray",
        )


def read_evals(path: Path) -> list[dict[str, Any]]:
    """The records of an ``eval.jsonl`` (none if there is no file); a line that is not a JSON
    object with an int ``step`` raises :class:`InspectError` naming the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InspectError(f"{path}:{number}", f"not JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise InspectError(f"{path}:{number}", "not an eval record (no int step)")
        out.append(rec)
    return out


def _eval_series(evals: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """``key`` (``avg@k`` or ``pass@1``; ``k`` is each record's own) of the evals that have it."""
    steps, values = [], []
    for r in evals:
        v = r.get(key.replace("@k", f"@{r.get('k')}"))
        if isinstance(v, int | float) and not isinstance(v, bool):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def _draw_evals(ax: Any, evals: Sequence[Mapping[str, Any]]) -> None:
    k = next((r.get("k") for r in evals if r.get("k")), "k")
    for key, color, label in (
        ("avg@k", "tab:green", f"held-out avg@{k}"),
        ("pass@1", "tab:red", "held-out pass@1"),
    ):
        steps, values = _eval_series(evals, key)
        if steps:
            ax.plot(steps, values, color=color, marker="o", label=label)
    cut = [r for r in evals if r.get("status") == "cut"]
    steps, values = _eval_series(cut, "avg@k")
    if steps:
        ax.plot(steps, values, "o", color="white", markeredgecolor="tab:green", label="cut")
    if evals:
        ax.plot([], [], color="tab:blue", label="training mean reward")
        ax.legend(loc="lower right", fontsize="small")


def build_figure(
    records: Sequence[Mapping[str, Any]],
    title: str = "",
    *,
    evals: Sequence[Mapping[str, Any]] = (),
    about: Mapping[str, Any] | None = None,
    ended: Mapping[str, Any] | None = None,
) -> Any:
    """The figure (a matplotlib ``Figure`` with one axes per entry of :data:`PANELS`):
    ``title`` the run directory's name, ``about`` what else the title shows (task, seed),
    ``ended`` the run's ``ended.json`` (its stop, marked on every panel); ``evals``
    (``eval.jsonl`` records) add the held-out curve to the reward panel."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise MissingExtraError("trio-rl plot", "matplotlib", "learn") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 12), dpi=100)
    axes = fig.subplots(4, 2, sharex=True).flatten()
    panel = dict(zip(PANELS, axes, strict=True))
    for name, ax in panel.items():
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    for ax in axes[-2:]:
        ax.set_xlabel("step")

    reward = panel["reward"]
    steps, values = _series(_steps_only(records), "reward_mean")
    if steps:
        reward.plot(steps, values, color="tab:blue")
        low, high = robust_limits(values, floor=0.0)
        reward.set_ylim(min(low, 0.0), max(high, 1.0) if high <= 1.05 else high)
    else:
        _missing(reward, "reward_mean")
    _draw_evals(reward, evals)
    reward.set_ylabel("mean reward")

    thru = panel["throughput"]
    steps, values = _throughput(records)
    if steps:
        _draw(thru, steps, values, "tab:orange", floor=0.0)
    else:
        _missing(thru, "samples_per_s")
    thru.set_ylabel(f"samples scored / s ({_WINDOW}-step window)")

    for name, key, label, color in _SIMPLE:
        ax = panel[name]
        steps, values = _series(records, key)
        if not steps and name == "off-policy lag":  # records from before the mean was kept
            steps, values = _series(records, "off_policy_max")
        if not steps:
            _missing(ax, key)
        elif key == "slot_occupancy":
            ax.plot(steps, values, color=color)
            ax.set_ylim(0, 1.05)
        else:
            floor = None if key == "trainer/loss" else 0.0
            _draw(ax, steps, values, color, floor=floor)
            if name == "off-policy lag":
                largest = _series(records, "off_policy_max")
                if largest[0]:
                    ax.plot(*largest, ":", color=color)
                    ax.set_ylim(top=max(ax.get_ylim()[1], max(largest[1]) * 1.05 + 0.05))
        ax.set_ylabel(label)

    stop = _stop_of(ended)
    if stop is not None:
        for ax in axes:
            ax.axvline(stop[0], color="gray", linestyle="--", linewidth=1)
    if records:
        walls = [r["wall_s"] for r in records if isinstance(r.get("wall_s"), int | float)]
        parts = [f"trio-rl run {title}".strip() if title else "trio-rl run"]
        parts += [f"{k} {v}" for k, v in (about or {}).items()]
        if walls:
            parts.append(f"{walls[-1]:.0f} s wall")
        head = " | ".join(parts)
        fig.suptitle(head if stop is None else f"{head}\nstopped at step {stop[0]}: {stop[1]}")
    fig.tight_layout()
    return fig


def _stop_of(ended: Mapping[str, Any] | None) -> tuple[int, str] | None:
    """(step, why) of an ``ended.json`` record, the reason cut to fit a title line."""
    if not ended or not isinstance(ended.get("step"), int):
        return None
    why = str(ended.get("message") or ended.get("stopped") or "")
    return int(ended["step"]), why if len(why) <= 110 else why[:107] + "..."


def run_facts(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What the title shows of a run directory (its task and seed, from ``config.toml``), and
    its ``ended.json`` (None without one: a run still going, or killed)."""
    run = RunDirectory(run_dir)
    about: dict[str, Any] = {}
    try:
        config = tomllib.loads(run.config.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        config = {}
    task = config.get("rollout", {}).get("task")
    seed = config.get("run", {}).get("seed")
    if task is not None:
        about["task"] = task
    if seed is not None:
        about["seed"] = seed
    try:
        ended = json.loads(run.ended.read_text())
    except (OSError, ValueError):
        ended = None
    return about, ended if isinstance(ended, dict) else None


def write_figure(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Read ``<run_dir>/metrics.jsonl`` (or a metrics file given directly), write the PNG
    (default ``<run_dir>/plot.png``, the figure ``trio-rl run`` draws at its end) and return
    its path."""
    src = Path(run_dir)
    metrics = RunDirectory(src).metrics if src.is_dir() else src
    if not metrics.is_file():
        raise InspectError(str(metrics), "no metrics file (a learning run writes metrics.jsonl)")
    records = read_metrics(metrics)
    if not records:
        raise InspectError(str(metrics), "no records yet: nothing to plot")
    target = Path(out) if out is not None else RunDirectory(metrics.parent).plot
    evals = read_evals(RunDirectory(metrics.parent).eval_log)
    about, ended = run_facts(metrics.parent)
    fig = build_figure(records, title=metrics.parent.name, evals=evals, about=about, ended=ended)
    try:
        fig.savefig(target)
    except OSError as exc:
        raise InspectError(str(target), f"cannot write: {exc.strerror or exc}") from exc
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plot`` subcommand's arguments."""
    parser.add_argument("run_dir", type=Path, help="a run directory (or its metrics.jsonl)")
    parser.add_argument(
        "-o", "--out", type=Path, default=None, help="PNG to write (default RUN_DIR/plot.png)"
    )


def run(args: argparse.Namespace) -> int:
    """Write the figure; print its path."""
    print(write_figure(args.run_dir, args.out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trio_rl.tools.plot_cmd``: errors are one line on stderr, status 1."""
    return tool_main("trio-rl plot", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
