"""The external-trainer layout stopped and resumed, through the real ``trio-rl`` executable:
Ctrl-C on the orchestrator; the trainer job trains up to ``STOP`` and says why it exits and how
to start it again; the resumed orchestrator names the step the trainer job really trained
through; the run ends at ``run.max_steps``; ``trio-rl inspect`` verifies exactly-once from
``trainer/trained.jsonl``, and a damaged log (a step trained twice) exits 1."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _config(tmp: Path) -> Path:
    config = tmp / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{tmp / "run"}"
            steps = 100
            max_steps = 6
            converged_after = 100000

            [engine]
            d_model = 16
            n_layers = 1

            [rollout]
            batch_groups = 2
            group_size = 4
            prompts = 32

            [trainer]
            mode = "external"
            # slow enough that the signal lands mid-run
            delay = 0.3

            [metrics]
            plot = false
            display = "plain"
            """
        )
    )
    return config


def _until(proc: subprocess.Popen[str], pattern: str, within: float) -> str:
    """``proc``'s stdout up to a line matching ``pattern``."""
    assert proc.stdout is not None
    # raw reads: a text wrapper would buffer lines that select() then never reports
    fd = proc.stdout.fileno()
    seen = ""
    deadline = time.monotonic() + within
    while not re.search(pattern, seen):
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} within {within} s:\n{seen}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"exited ({proc.wait()}) before {pattern!r}:\n{seen}"
            seen += chunk.decode(errors="replace")
    return seen


def _trainer(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [TRIO_RL, "trainer", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def test_an_external_run_stopped_and_resumed_trains_every_step_once(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run_dir = tmp_path / "run"
    with (
        _trainer(config) as trainer,
        subprocess.Popen(
            [TRIO_RL, "run", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        ) as orchestrator,
    ):
        try:
            _until(orchestrator, r"(?m)^step 2/", within=120)
            orchestrator.send_signal(signal.SIGINT)
            _, err = orchestrator.communicate(timeout=60)
            assert orchestrator.returncode == 130, err
            out, terr = trainer.communicate(timeout=120)
        finally:
            for p in (orchestrator, trainer):
                if p.poll() is None:
                    p.kill()
    assert trainer.returncode == 0, terr
    stopped_at = int((run_dir / "STOP").read_text())
    assert 2 <= stopped_at < 6
    # the trainer job says why it exits, and how to start it again
    assert (
        f"trainer job: the orchestrator stopped at step {stopped_at} (STOP: it was stopped by "
        "a signal), and every step up to it is trained; start me again with: "
        f"trio-rl trainer {config}"
    ) in out
    trained = [
        json.loads(x)["step"] for x in (run_dir / "trainer/trained.jsonl").read_text().splitlines()
    ]
    assert trained == list(range(1, stopped_at + 1))

    # resumed: the orchestrator names the trainer job's real step, and goes to max_steps
    beat = run_dir / "trainer" / "heartbeat"
    started = time.time()
    with _trainer(config) as trainer:
        try:
            # the job starts first: the STOP it finds names a step it trained, written by an
            # orchestrator stopped for the run to go on, so it waits for the next one's STOP
            deadline = time.monotonic() + 120
            while not (beat.exists() and beat.stat().st_mtime > started):
                assert trainer.poll() is None, trainer.communicate()
                assert time.monotonic() < deadline, "no trainer heartbeat within 120 s"
                time.sleep(0.05)
            time.sleep(2)
            assert trainer.poll() is None, trainer.communicate()
            done = subprocess.run(
                [TRIO_RL, "run", str(config)],
                capture_output=True,
                text=True,
                timeout=300,
                env=ENV,
            )
            out, terr = trainer.communicate(timeout=120)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    assert done.returncode == 0, done.stderr
    assert (
        f"resumed at step {stopped_at + 1}: the trainer job trained through step {stopped_at} "
        "(trainer/trained.jsonl)"
    ) in done.stdout
    assert trainer.returncode == 0, terr
    assert "trainer job: the orchestrator ended the run at step 6" in out
    trained = [
        json.loads(x)["step"] for x in (run_dir / "trainer/trained.jsonl").read_text().splitlines()
    ]
    assert trained == [1, 2, 3, 4, 5, 6]

    # exactly-once, verified by inspect; a step logged twice is a violation
    inspected = subprocess.run(
        [TRIO_RL, "inspect", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert inspected.returncode == 0, inspected.stderr
    assert "every shipped step trained once, with the samples shipped" in inspected.stdout
    assert "shipped: 1..6" in inspected.stdout
    log = run_dir / "trainer/trained.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines, lines[2]]) + "\n")
    damaged = subprocess.run(
        [TRIO_RL, "inspect", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert damaged.returncode == 1
    assert "step 3 was trained 2 times (lines 3, 7): not exactly once" in damaged.stderr
