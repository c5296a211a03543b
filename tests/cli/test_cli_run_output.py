"""Where a learning run's output is, as its user finds it: the default run directory
(``runs/<time>`` under the current directory), ``RUN_DIR/logs/run.log`` at the level given,
one plain progress line per step, and closing lines that name the run directory,
``metrics.jsonl``, the plot, the log and the command that continues the run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

QUICK = str(Path(__file__).parents[2] / "examples" / "learn-quick.toml")


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_rl", "run", QUICK, *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip


@pytest.mark.heavy
def test_a_run_without_out_lands_in_runs_and_says_where(tmp_path: Path) -> None:
    done = _run(tmp_path, "--steps", "2", "--set", "metrics.plot=true", "--plain")
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}(-\d+)?", run_dir.name), run_dir.name
    rel = Path("runs") / run_dir.name
    lines = done.stdout.splitlines()
    # one plain line per step, with the progress: step N/M, per-step counts, ETA
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 1/2", "step 2/2"]
    assert all(" | waste " in line and " | ETA " in line for line in steps), steps
    tail = lines[-5:]
    assert tail[0] == f"run directory: {rel}"
    assert tail[1] == f"  metrics: {rel / 'metrics.jsonl'}"
    assert tail[2].startswith(f"  plot:    {rel / 'plot.png'}")
    assert tail[3] == f"  log:     {rel / 'logs' / 'run.log'}"
    resume = tail[4].removeprefix("  resume:  ")
    assert shlex.split(resume)[-2:] == ["--out", str(rel)]
    assert (run_dir / "plot.png").is_file()
    log = (run_dir / "logs" / "run.log").read_text()
    # the log has what the terminal showed: the banner, each step's line, the closing lines
    assert "INFO trio_rl.console: learning run: task " in log
    for line in steps:
        assert f"INFO trio_rl.console: {line.split(' | ETA')[0]}" in log
    assert f"INFO trio_rl.console: run directory: {rel}" in log

    # the printed resume command continues the same run, in the same directory
    again = _run(tmp_path, *shlex.split(resume)[3:])
    assert again.returncode == 0, again.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    assert "resumed at step 3" in again.stdout
    assert log in (run_dir / "logs" / "run.log").read_text()  # appended, not replaced


def test_the_log_level_is_the_one_given(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = _run(tmp_path, "--steps", "1", "--out", str(out), "--log-level", "warning")
    assert done.returncode == 0, done.stderr
    log = (out / "logs" / "run.log").read_text()
    assert " INFO " not in log  # the step lines and the banner are info records
    assert "step 1/1" in done.stdout


def test_a_kept_simulate_run_has_its_log_too(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    done = subprocess.run(
        [sys.executable, "-m", "trio_rl", "simulate", "--out", str(out), "--steps", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    log = (out / "logs" / "run.log").read_text()
    for line in done.stdout.splitlines():
        if line.startswith("step "):
            assert f"INFO trio_rl.console: {line}" in log
    assert "INFO trio_rl.console: accounting: dispatched" in log


@pytest.mark.heavy
def test_a_torchrun_run_prints_the_command_that_continues_it_and_that_command_does(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    done = _run(tmp_path, "--trainer", "torchrun", "--steps", "2", "--out", str(out), "--plain")
    assert done.returncode == 0, done.stderr
    resume = done.stdout.splitlines()[-1]
    assert resume.startswith("  resume:  trio-rl run "), done.stdout
    command = shlex.split(resume.removeprefix("  resume:  "))
    assert command[:2] == ["trio-rl", "run"], command
    assert "--trainer" in command, command

    again = subprocess.run(
        [sys.executable, "-m", "trio_rl", *command[1:]],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    # the orchestrator continued from its checkpoint, the trainer job from its saved state
    assert "resumed at step 3" in again.stdout, again.stdout
    assert "trainer job: resumed after step 2" in again.stdout + again.stderr
    trained = [
        json.loads(line)["step"]
        for line in (out / "trainer" / "trained.jsonl").read_text().splitlines()
    ]
    assert trained == [1, 2, 3, 4]  # every step trained once, none again from the start
    shipped = [
        json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert shipped == [1, 2, 3, 4]
    assert again.stdout.splitlines()[-1] == resume  # and it can go on again the same way


def _external_run(cwd: Path, orchestrator: list[str], out: Path) -> tuple[str, str]:
    """The orchestrator's and the trainer job's stdout: the orchestrator ``orchestrator`` (argv
    after ``trio-rl``) with ``trio-rl trainer out/config.toml`` started beside it."""
    run = subprocess.Popen(
        [sys.executable, "-m", "trio_rl", *orchestrator],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "config.toml").exists():  # the orchestrator stores it first
            assert time.monotonic() < deadline, "the orchestrator stored no config.toml"
            assert run.poll() is None, run.communicate()
            time.sleep(0.05)
        trainer = subprocess.run(
            [sys.executable, "-m", "trio_rl", "trainer", str(out / "config.toml")],
            cwd=cwd, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        stdout, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
        run.communicate()
    assert run.returncode == 0, stderr
    assert trainer.returncode == 0, trainer.stderr
    return stdout, trainer.stdout + trainer.stderr


@pytest.mark.heavy
def test_an_external_run_prints_both_commands_that_continue_it_and_they_do(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    args = ["run", QUICK, "--trainer", "external", "--steps", "2", "--out", str(out), "--plain"]
    stdout, _ = _external_run(tmp_path, args, out)
    found = re.fullmatch(
        r"  resume:  (trio-rl run .*)  \(and start the trainer job again, as before: "
        r"(trio-rl trainer .*), under torchrun for several ranks\)",
        stdout.splitlines()[-1],
    )
    assert found is not None, stdout
    command, trainer = (shlex.split(found.group(i)) for i in (1, 2))
    assert trainer == ["trio-rl", "trainer", str(out / "config.toml")]

    stdout, trainer_out = _external_run(tmp_path, command[1:], out)
    assert "resumed at step 3" in stdout, stdout
    assert "resumed after step 2" in trainer_out, trainer_out
    trained = [
        json.loads(line)["step"]
        for line in (out / "trainer" / "trained.jsonl").read_text().splitlines()
    ]
    assert trained == [1, 2, 3, 4]
