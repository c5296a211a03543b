"""The benchmark scripts run: ``run_all.py --quick`` (tiny sizes, one repetition) in a subprocess.

The recorded figures come from ``nox -s bench``; this only pins that every script still runs
to its end and prints its goal lines, so a broken benchmark fails CI instead of the next
recorded run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

#: Each script's verdict lines, as ``run_all`` collects them into its summary.
GOALS = {
    "scheduler": ("goal 1:", "goal 2:"),
    "publish": ("goal 3:",),
    "encode": ("goal 5:",),
    "transport": ("goal 6:",),
    "checkpoint": ("goal 4:",),
    "checkpoint_incremental": ("goal 4:",),
    "episodes": ("goal 7:", "goal 8:"),
    "reward_workers": ("goal 9:",),
}


def test_every_benchmark_is_in_run_all() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "nothing"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stdout.strip().endswith("choose from " + ", ".join(GOALS)), done.stdout


# One test per script, so that the two xdist workers share them (one 30 s test at the end of
# a worker's share was CI's tail). The two longest smoke runs (10-12 s each: real-time windows,
# real `trio-rl run` pairs) are `heavy`; `nox -s bench` and `nox -s heavy` run them.
_HEAVY = {"scheduler", "reward_workers"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.heavy) if n in _HEAVY else n for n in GOALS]
)
def test_every_benchmark_runs_to_its_goal_lines(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", name],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = done.stdout.split("===== summary (quick)", 1)[1]
    for goal in GOALS[name]:
        assert f"[{name}] {goal}" in summary, f"{name} printed no '{goal}' line"
