"""A graceful stop: the first SIGINT or SIGTERM during a long first step checkpoints the work
collected so far, says so in one line and exits 130 / 143; the resumed run continues those
groups instead of starting over, and the trainer sees every sample once."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_cli_kill import _LAUNCH  # the demo without importing torch

RANKS = 2


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill the process if it still runs, and close its pipes (no ResourceWarning later)."""
    proc.kill()
    proc.communicate(timeout=60)


def _cmd(out: Path, steps: int) -> list[str]:
    # swe episodes of ~2 s each (time scale 30/20000): the first step takes several seconds
    return [
        sys.executable, "-c", _LAUNCH, "simulate", "--out", str(out), "--steps", str(steps),
        "--batch-groups", "4", "--group-size", "4", "--ranks", str(RANKS),
        "--distribution", "swe", "--tokens-per-second", "20000", "--max-tokens", "256",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.heavy)]
)
def test_first_signal_checkpoints_the_step_in_progress(tmp_path: Path, signum: int) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, 3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert banner.startswith("trio-rl simulate:"), banner
        time.sleep(2.0)  # groups finish, none shipped yet
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    name = signal.Signals(signum).name
    last = stderr.strip().splitlines()[-1]
    hint = re.fullmatch(
        rf"trio-rl: stopped by {name} after step (\d+): saved \S+step_0*(\d+)\.ckpt "
        r"\((\d+) queued samples, (\d+) open groups\); resume with: (.+)",
        last,
    )
    assert hint is not None, last
    # the hint is the command that was run (simulate, same --out), ready to paste
    assert shlex.split(hint.group(5)) == ["trio-rl", *_cmd(out, 3)[3:]]
    stopped_after = int(re.search(r"after step (\d+)", last).group(1))  # type: ignore[union-attr]
    assert (out / "checkpoints" / f"step_{stopped_after:08d}.ckpt").is_file()

    resumed = subprocess.run(_cmd(out, 2), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    m = re.search(
        r"resumed at step 1: (\d+) queued samples ship first, (\d+) open groups", resumed.stdout
    )
    assert m is not None, resumed.stdout
    assert int(m.group(1)) + int(m.group(2)) > 0, "the work of the interrupted step was lost"
    shipped = int(re.search(r"shipped (\d+) \+ pruned", resumed.stdout).group(1))  # type: ignore[union-attr]
    fingerprints: Counter[str] = Counter()
    for rank in range(RANKS):
        records = [
            json.loads(line)
            for line in (out / "trainer" / f"rank_{rank}.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records] == list(range(1, stopped_after + 3))
        fingerprints.update(d for r in records for *_, d in r["seqs"])
    assert max(fingerprints.values()) == 1
    assert sum(fingerprints.values()) == shipped


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, 3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("trio-rl simulate:")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] in (
        "trio-rl: SIGTERM again: exiting now",
        # the first stop may complete before the second signal is read
        *[line for line in stderr.splitlines() if line.startswith("trio-rl: stopped by SIGTERM")],
    )


def _installed_script() -> Path:
    # the console script pip installed next to this interpreter (what a user runs)
    script = Path(sys.executable).with_name("trio-rl")
    assert script.is_file(), f"no installed trio-rl script next to {sys.executable}"
    return script


@pytest.mark.parametrize("delay", [0.4, 1.2])
@pytest.mark.parametrize(
    "signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.heavy)]
)
def test_a_signal_while_starting_is_one_line(tmp_path: Path, signum: int, delay: float) -> None:
    # While the interpreter imports the package (and torch, for `run`), before the event loop
    # and its watcher exist (not during the interpreter's own start-up, before the console
    # script's first line runs: nothing of ours can be there yet). SIGTERM's default would kill
    # without a word, SIGINT would print a
    # KeyboardInterrupt traceback from wherever the import was.
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [str(_installed_script()), "run", "--out", str(out), "--steps", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(delay)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        _reap(proc)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    # Early enough, nothing started; a little later, the run was starting (nothing to save);
    # later still, the run had opened and checkpointed what it held.
    assert last in (
        f"trio-rl: stopped by {name} before any work started",
        f"trio-rl: stopped by {name} while starting (before its first step): nothing to save",
    ) or last.startswith(f"trio-rl: stopped by {name} after step "), stderr
    if last.endswith("before any work started"):
        assert stderr.count("\n") == 1, stderr
    elif last.endswith("nothing to save"):  # after the signal's own acknowledgement
        assert stderr.count("\n") == 2, stderr
        # which says what happens: no checkpoint is promised when there is none to save
        assert stderr.splitlines()[0] == (
            f"trio-rl: {name}: stopping now: the run is still starting, there is nothing to "
            "checkpoint yet"
        ), stderr
    else:
        assert f"trio-rl: {name}: stopping after saving a checkpoint" in stderr, stderr
