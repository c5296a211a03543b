"""``trio-rl plot RUN_DIR``: the standard figures of a run, from its ``metrics.jsonl``, as PNG.

Four panels against step: reward (mean reward), throughput (samples scored per second, over a
sliding window of steps: one step's rate is spiky, a step can ship from a backlog in
milliseconds), slot occupancy, and lag (event-loop lag p95 and off-policy lag). A panel whose
fields no record has says so instead of drawing an empty line. Needs matplotlib
(``trio-rl[learn]``); without it the command fails with one line naming the extra.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import TrioRLError
from ._errors import InspectError, MissingExtraError
from .metrics import read_metrics

__all__ = ["PANELS", "add_arguments", "build_figure", "main", "run", "write_figure"]

#: Panel titles, in order (the figure's axes carry exactly these titles).
PANELS = ("reward", "throughput", "slot occupancy", "lag")
_WINDOW = 10


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


def _throughput(records: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float]]:
    """Samples scored per second over the last ``_WINDOW`` steps (needs ``wall_s``); records
    without ``wall_s`` fall back to their own ``samples_per_s``."""
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


def build_figure(records: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """The figure (a matplotlib ``Figure`` with one axes per entry of :data:`PANELS`)."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise MissingExtraError("trio-rl plot", "matplotlib", "learn") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 7), dpi=100)
    axes = fig.subplots(2, 2, sharex=True).flatten()
    reward, thru, occ, lag = axes
    for ax, name in zip(axes, PANELS, strict=True):
        ax.set_title(name)
        ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers

    steps, values = _series(records, "reward_mean")
    if steps:
        reward.plot(steps, values, color="tab:blue")
    else:
        _missing(reward, "reward_mean")
    reward.set_ylabel("mean reward")

    steps, values = _throughput(records)
    if steps:
        thru.plot(steps, values, color="tab:orange")
    else:
        _missing(thru, "samples_per_s")
    thru.set_ylabel(f"samples scored / s ({_WINDOW}-step window)")

    steps, values = _series(records, "slot_occupancy")
    if steps:
        occ.plot(steps, values, color="tab:green")
        occ.set_ylim(0, 1.05)
    else:
        _missing(occ, "slot_occupancy")
    occ.set_ylabel("busy fraction of decode slots")

    drew = False
    steps, values = _series(records, "loop_lag_p95_ms")
    if steps:
        lag.plot(steps, values, color="tab:red", label="loop lag p95 (ms)")
        drew = True
    steps, values = _series(records, "off_policy_max")
    if steps:
        lag.plot(steps, values, color="tab:purple", label="off-policy lag max (versions)")
        drew = True
    if drew:
        lag.legend(loc="upper left", fontsize="small")
    else:
        _missing(lag, "loop_lag_p95_ms or off_policy_max")

    if records:
        wall = records[-1].get("wall_s")
        suffix = f" ({wall:.0f} s wall)" if isinstance(wall, int | float) else ""
        fig.suptitle(f"trio-rl {title}{suffix}".replace("  ", " "))
    fig.tight_layout()
    return fig


def write_figure(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Read ``<run_dir>/metrics.jsonl`` (or a metrics file given directly), write the PNG
    (default ``<run_dir>/metrics.png``) and return its path."""
    src = Path(run_dir)
    metrics = src / "metrics.jsonl" if src.is_dir() else src
    if not metrics.is_file():
        raise InspectError(str(metrics), "no metrics file (a learning run writes metrics.jsonl)")
    records = read_metrics(metrics)
    if not records:
        raise InspectError(str(metrics), "no records yet: nothing to plot")
    target = Path(out) if out is not None else metrics.parent / "metrics.png"
    fig = build_figure(records, title=metrics.parent.name)
    try:
        fig.savefig(target)
    except OSError as exc:
        raise InspectError(str(target), f"cannot write: {exc.strerror or exc}") from exc
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plot`` subcommand's arguments."""
    parser.add_argument("run_dir", type=Path, help="a run directory (or its metrics.jsonl)")
    parser.add_argument(
        "-o", "--out", type=Path, default=None, help="PNG to write (default RUN_DIR/metrics.png)"
    )


def run(args: argparse.Namespace) -> int:
    """Write the figure; print its path."""
    print(write_figure(args.run_dir, args.out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trio_rl.tools.plot_cmd``: errors are one line on stderr, status 1."""
    parser = argparse.ArgumentParser(prog="trio-rl plot", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TrioRLError as exc:
        print(f"trio-rl: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
