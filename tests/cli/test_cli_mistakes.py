"""A user's first mistakes, through the real ``trio-rl`` executable, never hang the run and
never get a wrong verdict: an ``[inference]`` URL with nothing listening is reported at once
and the run stops at the first SIGINT; rewards that are all zero are not called a collapse."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import write_tiny_llama
from operations_waits import documented

TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))


def _refused_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _read_until(proc: subprocess.Popen[str], needle: str, within: float) -> str:
    """What ``proc`` wrote on stderr up to the line holding ``needle``."""
    assert proc.stderr is not None
    # raw reads: a text wrapper would buffer lines that select() then never reports
    fd = proc.stderr.fileno()
    seen = ""
    deadline = time.monotonic() + within
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} within {within} s:\n{seen}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"exited ({proc.wait()}) before {needle!r}:\n{seen}"
            seen += chunk.decode(errors="replace")
    return seen


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.heavy)],
    ids=["SIGINT", "SIGTERM"],
)
def test_an_unreachable_server_is_reported_at_once_and_a_signal_stops_the_wait(
    tmp_path: Path, sig: signal.Signals
) -> None:
    write_tiny_llama(tmp_path / "model")
    url = _refused_url()
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{tmp_path / "run"}"
            steps = 2

            [model]
            path = "{tmp_path / "model"}"

            [rollout]
            task = "repeat"
            batch_groups = 2
            group_size = 4

            [inference]
            urls = ["{url}"]
            start_timeout = 600.0

            [metrics]
            plot = false
            display = "plain"
            """
        )
    )
    with subprocess.Popen(
        [TRIO_RL, "run", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:
        try:
            # the first attempt is refused: said at once (the command's own start-up, torch's
            # import included, is what the bound allows for), with the time left
            seen = _read_until(proc, "connection refused", within=60)
            assert (
                f"waiting for {url}/health (connection refused, 1 attempt), giving up in 6" in seen
            )
            proc.send_signal(sig)
            sent = time.monotonic()
            code = proc.wait(timeout=30)
            waited = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.stderr is not None
        rest = proc.stderr.read()
    assert code == 128 + sig, rest
    # nothing of the 600 s wait is left: the signal ends it (well within a second on an idle
    # machine; the bound leaves room for a loaded CI runner)
    assert waited < 10, waited
    name = sig.name
    # the acknowledgement says what happens (nothing to checkpoint), not a checkpoint to come
    said = [line for line in rest.splitlines() if line.startswith("trio-rl:")]
    assert said == [
        f"trio-rl: {name}: stopping now: the run is still starting, there is nothing to "
        "checkpoint yet",
        f"trio-rl: stopped by {name} while starting (before its first step): nothing to save",
    ], rest
    assert "saving a checkpoint" not in rest
    if sig == signal.SIGINT:  # the lines docs/operations.md quotes
        documented("a startup wait", said[0], 0)
        documented("a startup wait", said[1], 1)
    assert "Traceback" not in rest
    # the run's log has the wait too
    log = (tmp_path / "run" / "logs" / "run.log").read_text()
    assert "connection refused" in log
    waiting = next(line for line in log.splitlines() if "connection refused" in line)
    documented("opening a fleet", waiting.split(": ", 1)[1])


def test_all_zero_rewards_are_nothing_to_learn_from_not_a_collapse(tmp_path: Path) -> None:
    # an exact-match reward on an untrained model: every reward is 0, the samples all differ
    (tmp_path / "zero_reward.py").write_text(
        "def score(record, completion):\n    return float(completion == record['answer'] * 9)\n"
    )
    (tmp_path / "data.jsonl").write_text(
        "".join(f'{{"prompt": "{c}=", "answer": "{c}"}}\n' for c in "abcde")
    )
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{tmp_path / "run"}"
            steps = 20
            converged_after = 2

            [engine]
            d_model = 16
            n_layers = 1

            [rollout]
            task = "reverse"
            batch_groups = 2
            group_size = 4

            [data]
            prompts = "{tmp_path / "data.jsonl"}"
            max_tokens = 6

            [reward]
            function = "zero_reward:score"

            [metrics]
            plot = false
            display = "plain"
            """
        )
    )
    done = subprocess.run(
        [TRIO_RL, "run", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    both = done.stdout + done.stderr
    assert "collapsed" not in both
    assert "deterministic" not in both
    assert "entropy_coef" not in both
    # one line, once, saying what is wrong, and no step could be trained: a failure
    assert both.count("nothing to learn from from the first step") == 1, both
    assert "rewards are all 0" in both
    assert "check the reward (zero_reward:score" in both
    assert done.returncode == 1, both
