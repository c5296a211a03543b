"""`trio-rl run` (the learning run) as an operator drives it: real signals on a real
subprocess, a resume that continues the trainer and the orchestrator, one-line errors."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builders import reward_worker_processes

pytest.importorskip("torch")

QUICK = str(Path(__file__).parents[2] / "examples" / "learn-quick.toml")


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill the process if it still runs, and close its pipes (no ResourceWarning later)."""
    proc.kill()
    proc.communicate(timeout=60)


def _cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "trio_rl", "run", QUICK, "--out", str(out), *args]


def _start(out: Path, steps: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _cmd(out, "--steps", str(steps)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(proc: subprocess.Popen[str], step: int, deadline: float = 90) -> None:
    assert proc.stdout is not None
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            _, stderr = proc.communicate(timeout=60)
            pytest.fail(f"the run ended (status {proc.returncode}) before step {step}: {stderr}")
        if re.match(rf"step\s+{step}[\s/]", line):
            return
    pytest.fail(f"no step {step} within {deadline} s")


def _steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.heavy)]
)
def test_a_signal_checkpoints_the_learning_run_and_it_resumes(tmp_path: Path, signum: int) -> None:
    out = tmp_path / "run"
    proc = _start(out, 10_000)
    try:
        _wait_for_step(proc, 2)
        # a single-turn run scores its samples in reward workers (the envs test: none there)
        assert reward_worker_processes(proc.pid)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    name = signal.Signals(signum).name
    last = stderr.strip().splitlines()[-1]
    m = re.fullmatch(
        rf"trio-rl: stopped by {name} after step (\d+): saved (\S+\.ckpt), the trainer's state "
        rf"of step (\d+) and \S+config\.toml; resume with: "
        + re.escape(shlex.join(["trio-rl", *_cmd(out, "--steps", "10000")[3:]])),
        last,
    )
    assert m is not None, last
    stopped_after, trained = int(m.group(1)), int(m.group(3))
    assert Path(m.group(2)).is_file()
    # 0 when the trainer had not saved step 1 yet (it lags the orchestrator on a loaded machine)
    assert 0 <= trained <= stopped_after
    assert _steps(out) == list(range(1, stopped_after + 1))

    resumed = subprocess.run(_cmd(out, "--steps", "2"), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {stopped_after + 1}: trainer state of step {trained}" in (
        resumed.stdout
    )
    # every step once, the earlier ones kept; the trainer went on from its saved step
    assert _steps(out) == list(range(1, stopped_after + 3))
    versions = [json.loads(line)["policy_version"] for line in
                (out / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    assert versions[stopped_after] >= trained  # the resumed engine serves the saved model


def test_a_second_signal_exits_the_learning_run_at_once(tmp_path: Path) -> None:
    proc = _start(tmp_path / "run", 10_000)
    try:
        _wait_for_step(proc, 1)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last == "trio-rl: SIGTERM again: exiting now" or last.startswith(
        "trio-rl: stopped by SIGTERM"
    ), stderr


@pytest.mark.heavy
def test_a_damaged_trainer_state_is_one_line_and_nothing_is_lost(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = subprocess.run(_cmd(out, "--steps", "3"), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    state = out / "trainer" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    kept = {p: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    done = subprocess.run(_cmd(out, "--steps", "2"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"trio-rl: error: checkpoint {state}: the trainer state is damaged"
    )
    assert "--fresh" in done.stderr
    assert {p: p.read_bytes() for p in (out / "checkpoints").iterdir()} == kept
    assert _steps(out) == [1, 2, 3]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--steps", "0"], "--steps: run.steps: must be >= 1, got 0"),
        (["--lr", "-1"], "--lr: trainer.lr: must be finite and > 0, got -1.0"),
        (["--ranks", "2"], "--ranks: trainer.ranks: the in-process trainer has one rank"),
        (["--set", "rollout.group_size=1"], "--set: rollout.group_size: must be >= 2"),
    ],
)
def test_bad_learning_run_knobs_are_one_line_exit_2(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    done = subprocess.run(_cmd(tmp_path / "run", *args), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"trio-rl: error: {needle}" + done.stderr.split(needle, 1)[1]
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_out_below_a_regular_file_is_one_line_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for command in (
        _cmd(blocker / "run", "--steps", "1"),
        [sys.executable, "-m", "trio_rl", "simulate", "--out", str(blocker / "run")],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr == (
            f"trio-rl: error: --out {blocker / 'run'}: {blocker} is a regular file, not a "
            "directory; pass a directory\n"
        )
    assert blocker.read_text() == "not a directory"


def _run_with(tmp_path: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """``trio-rl run`` on the quick example plus ``config``, into ``tmp_path/run``."""
    cmd = [
        sys.executable,
        "-m",
        "trio_rl",
        "run",
        QUICK,
        str(config),
        "--out",
        str(tmp_path / "run"),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_stamped_temperature_other_than_the_sampling_one_is_one_line_exit_2(
    tmp_path: Path,
) -> None:
    # the trainer scores every token at its stamped temperature: it must be the sampled one
    config = tmp_path / "t.toml"
    config.write_text("[rollout]\ntemperature = 0.7\n\n[sink]\nscoring_temperature = 1.0\n")
    done = _run_with(tmp_path, config)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"trio-rl: error: sink.scoring_temperature at {config}:5, rollout.temperature at "
        f"{config}:2: sink.scoring_temperature: 1 conflicts with rollout.temperature = 0.7"
    ), done.stderr
    assert not (tmp_path / "run").exists()
    per_env = tmp_path / "e.toml"
    per_env.write_text(
        "[rollout]\ntemperature = 0.7\n\n[sink]\nscoring_env_temperatures = {math = 1.0}\n"
    )
    done = _run_with(tmp_path, per_env)
    assert done.returncode == 2, done.stderr
    assert (
        "sink.scoring_env_temperatures: {'math': 1.0} conflicts with rollout.temperature = 0.7"
        in done.stderr
    )
    # equal, or unset, is the sampling temperature: accepted (checked by `trio-rl config`)
    for text in ("scoring_temperature = 0.7\n", ""):
        config.write_text(f"[rollout]\ntemperature = 0.7\n\n[sink]\n{text}")
        shown = subprocess.run(
            [sys.executable, "-m", "trio_rl", "config", "--for", "run", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr


@pytest.mark.heavy
def test_a_run_stored_with_the_stamped_temperature_set_resumes(tmp_path: Path) -> None:
    # a run stored before the key was unset by default has `scoring_temperature = 1.0` in its
    # config.toml: the same stamp as unset (rollout.temperature = 1.0), no change to refuse
    out = tmp_path / "run"
    first = subprocess.run(_cmd(out, "--steps", "1"), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    stored = out / "config.toml"
    unset = "# scoring_temperature =  (unset)\n"
    assert unset in stored.read_text()
    stored.write_text(stored.read_text().replace(unset, "scoring_temperature = 1.0\n"))
    again = subprocess.run(_cmd(out, "--steps", "1"), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "resumed at step 2" in again.stdout
