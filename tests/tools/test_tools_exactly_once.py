"""``trio-rl inspect RUN_DIR`` checks exactly-once from ``trainer/trained.jsonl`` against what
``metrics.jsonl`` says was shipped: every step once, the samples shipped, a shipped step not
trained yet still waiting as a batch file. Any violation: the summary, then one line, exit 1.
(The end-to-end check, on a real stopped and resumed external-trainer run, is in
tests/cli/test_cli_external_stop.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trio_rl.errors import InspectError
from trio_rl.tools.inspect_cmd import inspect_path
from trio_rl.wire import encode

TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))


def _run_dir(tmp: Path, shipped: dict[int, int], trained: list[tuple[int, int]]) -> Path:
    run = tmp / "run"
    (run / "trainer").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "samples": n, "wall_s": float(s)}) + "\n"
            for s, n in shipped.items()
        )
    )
    (run / "trainer" / "trained.jsonl").write_text(
        "".join(json.dumps({"step": s, "sequences": n, "world_size": 1}) + "\n" for s, n in trained)
    )
    return run


def _inspect(run: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TRIO_RL, "inspect", str(run)], capture_output=True, text=True, timeout=60
    )


def test_every_step_once_with_its_samples_passes(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {1: 8, 2: 8, 3: 6}, [(1, 8), (2, 8), (3, 6)])
    done = _inspect(run)
    assert done.returncode == 0, done.stderr
    assert "verdict: every shipped step trained once, with the samples shipped" in done.stdout
    assert "shipped: 1..3" in done.stdout
    assert "trained: 1..3" in done.stdout


def test_a_step_trained_twice_exits_1_naming_the_step_and_lines(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {1: 8, 2: 8}, [(1, 8), (2, 8), (2, 8)])
    done = _inspect(run)
    assert done.returncode == 1
    assert "VIOLATED" in done.stdout  # the summary is printed first
    assert done.stderr.strip().splitlines()[-1] == (
        f"trio-rl: error: {run / 'trainer' / 'trained.jsonl'}: step 2 was trained 2 times "
        "(lines 2, 3): not exactly once"
    )


def test_samples_other_than_shipped_are_a_violation(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {1: 8, 2: 8}, [(1, 8), (2, 7)])
    summary = inspect_path(run)
    with pytest.raises(InspectError, match="step 2 trained 7 samples, but 8 were shipped"):
        raise summary.damage[0]


def test_a_shipped_step_neither_trained_nor_waiting_is_lost(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {1: 8, 2: 8, 3: 8, 4: 8}, [(1, 8), (4, 8)])
    # step 3's batch file still waits for the trainer: not trained yet, not lost
    (run / "batches" / "step_3").mkdir(parents=True)
    (run / "batches" / "step_3" / "rank_0.bin").write_bytes(encode([]))
    summary = inspect_path(run)
    assert [str(d) for d in summary.damage] == [
        f"{run / 'trainer' / 'trained.jsonl'}: step(s) 2 were shipped but neither trained nor "
        "waiting in batches/: lost"
    ]
    assert summary.data["exactly_once"]["not_trained_yet"].startswith("3 ")


def test_a_damaged_line_is_named_with_its_line_number(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {1: 8}, [(1, 8)])
    with (run / "trainer" / "trained.jsonl").open("a") as f:
        f.write('{"step": 2, "seq\n')
    done = _inspect(run)
    assert done.returncode == 1
    assert f"{run / 'trainer' / 'trained.jsonl'}:2: not a trained-step line" in done.stderr


def test_without_a_trainer_log_there_is_nothing_to_check(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {1: 8}, [])
    (run / "trainer" / "trained.jsonl").unlink()
    summary = inspect_path(run)
    assert "exactly_once" not in summary.data
    assert not summary.damage
