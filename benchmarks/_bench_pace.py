"""The pace of a run whose reward hangs on some records, against a control, side by side.

Two ``trio-rl run`` processes of the same project (32 records, a plain reward in worker
processes, ``[reward] timeout``) run *at the same time* on the same machine: the control, and
one whose reward sleeps an hour on records ``r3`` and ``r11`` (killed at the timeout, counted as
failed samples). Each step line a run prints is stamped as it arrives; the figure is the steps
each run shipped in the wall span both were shipping (from the later first step to the earlier
last one), so start-up is excluded and both shared the machine throughout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs

#: Records whose reward call hangs in the hanging run.
HANGING = ("r3", "r11")

REWARDS = f"""
import os, random, time

def score(record, completion):
    if record["id"] in {HANGING!r} and os.environ.get("HANG") == "1":
        time.sleep(3600)
    return random.random()
"""

CONFIG = """
[run]
steps = {steps}
[data]
prompts = "data.jsonl"
max_tokens = 6
[reward]
function = "pace_rewards:score"
timeout = {timeout}
[rollout]
task = "reverse"
batch_groups = 4
group_size = 4
[engine]
d_model = 32
n_layers = 1
[metrics]
plot = false
"""

_STEP = re.compile(r"step (\d+)/\d+ ")


@attrs.define
class Run:
    """One ``trio-rl run``: the times (monotonic) its step lines arrived, its failures."""

    name: str
    shipped: list[float] = attrs.field(factory=list)
    reward_failures: int = 0
    returncode: int | None = None

    def in_span(self, start: float, end: float) -> int:
        return sum(1 for t in self.shipped if start < t <= end)


def _project(where: Path, steps: int, timeout: float) -> Path:
    (where / "pace_rewards.py").write_text(REWARDS)
    with (where / "data.jsonl").open("w") as f:
        for i in range(32):
            text = "abcde"[i % 5] + "abcde"[(i * 3) % 5] * (1 + i % 3)
            f.write(json.dumps({"id": f"r{i}", "prompt": text + "=", "answer": text[::-1]}) + "\n")
    config = where / "run.toml"
    config.write_text(CONFIG.format(steps=steps, timeout=timeout))
    return config


def _script() -> str:
    script = Path(sys.executable).with_name("trio-rl")
    return str(script) if script.is_file() else "trio-rl"


def _follow(proc: subprocess.Popen[str], run: Run) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if _STEP.match(line):
            run.shipped.append(time.monotonic())


def side_by_side(steps: int, timeout: float) -> tuple[Run, Run]:
    """Run the control and the hanging run at once; return both (control first)."""
    with tempfile.TemporaryDirectory(prefix="bench-pace-") as tmp:
        where = Path(tmp)
        config = _project(where, steps, timeout)
        runs, procs, readers = [], [], []
        for name, hang in (("control", "0"), ("hang", "1")):
            run = Run(name)
            proc = subprocess.Popen(
                [_script(), "run", str(config), "--out", name],
                cwd=where,
                env={**os.environ, "HANG": hang},
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            reader = threading.Thread(target=_follow, args=(proc, run), daemon=True)
            reader.start()
            runs.append(run)
            procs.append(proc)
            readers.append(reader)
        for run, proc, reader in zip(runs, procs, readers, strict=True):
            try:
                run.returncode = proc.wait(timeout=600)
            finally:
                proc.kill()
            reader.join(timeout=10)
            lines = (where / run.name / "metrics.jsonl").read_text().splitlines()
            if lines:
                run.reward_failures = int(json.loads(lines[-1])["counters/reward_failures"])
    return runs[0], runs[1]


def pace_ratio(control: Run, hang: Run) -> tuple[float, float, int, int]:
    """The common span (seconds), hang / control steps in it, and both counts."""
    if not control.shipped or not hang.shipped:
        return 0.0, 0.0, len(control.shipped), len(hang.shipped)
    start = max(control.shipped[0], hang.shipped[0])
    end = min(control.shipped[-1], hang.shipped[-1])
    c, h = control.in_span(start, end), hang.in_span(start, end)
    return end - start, (h / c if c else 0.0), c, h
