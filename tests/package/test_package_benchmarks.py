"""The benchmark scripts run: ``run_all.py --quick`` (tiny sizes, one repetition) in a subprocess.

The recorded figures come from ``nox -s bench``; this only pins that every script still runs
to its end and prints its goal lines, so a broken benchmark fails CI instead of the next
recorded run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
}


def test_every_benchmark_runs_to_its_goal_lines() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = done.stdout.split("===== summary (quick)", 1)[1]
    for name, goals in GOALS.items():
        for goal in goals:
            assert f"[{name}] {goal}" in summary, f"{name} printed no '{goal}' line"
