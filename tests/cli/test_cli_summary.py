"""What `trio-rl simulate` prints, read as its user reads it: the step lines and the closing
accounting line add up, and what the rollout layer held is shown, not `held 0`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from test_cli_errors import _LAUNCH  # the demo without importing torch


def test_the_summary_accounts_for_every_dispatched_sample(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCH, "simulate", "--out", str(tmp_path / "run"),
         "--steps", "3", "--batch-groups", "4", "--group-size", "4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("trio-rl simulate: 3 steps of 4 groups x 4 samples"), out
    steps = re.findall(r"^step +(\d+): shipped +(\d+) samples .*\| reward (\S+ ?\S*) \|", out, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3]
    for _, _, reward in steps:
        assert reward == "(none new)" or re.fullmatch(r"\d\.\d{3}", reward), reward
    m = re.search(
        r"accounting: dispatched (\d+) = shipped (\d+) \+ pruned (\d+) \+ stale (\d+) \+ "
        r"filtered (\d+) \+ failed (\d+) \+ cancelled (\d+) \+ held (\d+) .*; the rollout "
        r"layer held (\d+) open groups",
        out,
    )
    assert m is not None, out
    dispatched, *parts, held_groups = (int(g) for g in m.groups())
    assert dispatched == sum(parts)
    shipped = parts[0]
    assert shipped == sum(int(n) for _, n, _ in steps)
    # admission has a horizon (the run's last step): what is still held at the end is at most
    # the last batch's worth, never work for steps the run will not ship
    assert parts[-1] <= 4 * 4
    assert held_groups <= 4

    # metrics.jsonl, the same standard records as the learning run's
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["samples"] for r in records] == [int(n) for _, n, _ in steps]
    for r in records:
        assert 0.0 <= r["slot_occupancy"] <= 1.0
        assert r["queue_depth"] >= 0
        assert r["policy_version"] >= 0
    inspected = subprocess.run(
        [sys.executable, "-m", "trio_rl", "inspect", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert inspected.returncode == 0, inspected.stderr
    assert "steps: 1..3" in inspected.stdout
