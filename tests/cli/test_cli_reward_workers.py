"""A user's reward that hangs or always raises, driven from outside with the real ``trio-rl``
executable: the reward runs in worker processes of its own, so a reward hanging on 2 records of
32 costs those samples (killed at the timeout, counted) and the run goes on meanwhile; the first
SIGTERM during a hung call ends the run at once with a checkpoint that resumes; a reward that
raises on every record stops the run with one line; and no worker process outlives the run,
however it ended."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operations_waits import documented

pytest.importorskip("torch")

REWARDS = """
import os, random, time

def _log(event, record):
    # one write per line, appended: the calls of every worker process in one file
    fd = os.open("calls.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{time.time():.6f} {event} {record['id']}\\n".encode())
    finally:
        os.close(fd)

def score(record, completion):
    if record["id"] in ("r3", "r11") and os.environ.get("HANG") == "1":
        open(f"stuck-{os.getpid()}", "w").close()
        _log("hung", record)
        time.sleep(3600)
    _log("done", record)
    return random.random()  # never equal within a group: no convergence stop

def misspelled(record, completion):
    return float(record["answr"] == completion)
"""

CONFIG = """
[run]
steps = {steps}
[data]
prompts = "data.jsonl"
max_tokens = 6
[reward]
function = "{function}"
timeout = {timeout}
{reward_keys}
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


def _script() -> str:
    # the console script pip installed next to this interpreter (what a user runs)
    script = Path(sys.executable).with_name("trio-rl")
    assert script.is_file(), f"no installed trio-rl script next to {sys.executable}"
    return str(script)


def _project(
    tmp_path: Path, *, steps: int, function: str, timeout: float = 60, reward_keys: str = ""
) -> Path:
    """A user's directory: the reward module, 32 records (ids r0..r31), a configuration."""
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    with (tmp_path / "data.jsonl").open("w") as f:
        for i in range(32):
            text = "abcde"[i % 5] + "abcde"[(i * 3) % 5] * (1 + i % 3)
            f.write(json.dumps({"id": f"r{i}", "prompt": text + "=", "answer": text[::-1]}))
            f.write("\n")
    config = tmp_path / "run.toml"
    config.write_text(
        CONFIG.format(steps=steps, function=function, timeout=timeout, reward_keys=reward_keys)
    )
    return config


def _env(hang: bool) -> dict[str, str]:
    return {**os.environ, "HANG": "1" if hang else "0"}


def _workers_of(pid: int) -> list[int]:
    """Live worker processes started by process ``pid`` (their command line names it), whether
    ``pid`` still runs or not (an orphan is re-parented, not gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (
            state != "Z"
            and any(a.endswith(b"_child.py") for a in argv)
            and argv[-2:-1] == [str(pid).encode()]
        ):
            found.append(int(entry.name))
    return found


def _no_worker_left(pid: int) -> None:
    # the workers are reaped before the run exits; an orphan would show here
    assert _workers_of(pid) == []


def _step_walls(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["wall_s"] for line in lines]


def _scored_while_hung(log: Path, window: float) -> list[int]:
    """Per hung call, the calls on other records that completed within ``window`` seconds
    after it began (while it hung: its timeout had not killed it yet)."""
    events = [line.split() for line in log.read_text().splitlines()]
    done = [float(t) for t, event, _ in events if event == "done"]
    return [
        sum(1 for d in done if float(t) < d < float(t) + window)
        for t, event, _ in events
        if event == "hung"
    ]


def _start_hanging_run(tmp_path: Path, config: Path) -> subprocess.Popen[str]:
    """``trio-rl run config --out run`` in the user's directory, with the reward hanging."""
    return subprocess.Popen(
        [_script(), "run", str(config), "--out", "run"],
        cwd=tmp_path,
        env=_env(hang=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_reward_hanging_on_2_records_of_32_costs_those_samples_not_the_run(
    tmp_path: Path,
) -> None:
    timeout = 2
    config = _project(tmp_path, steps=16, function="user_rewards:score", timeout=timeout)
    proc = _start_hanging_run(tmp_path, config)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    _no_worker_left(proc.pid)
    # Every step ships, and the run went on while calls hung: other records' groups were
    # generated and scored meanwhile (a hung call holds no credit of the rollout budget, and
    # its samples hold back no admission: they may never arrive). A run held back by its hung
    # group would score nothing until the timeout killed the call. The pace itself, against
    # a control, is measured by benchmarks/bench_reward_workers.py (docs/benchmarks.md).
    assert len(_step_walls(tmp_path / "run")) == 16
    assert list(tmp_path.glob("stuck-*")), "the reward never hung: the test proves nothing"
    scored = _scored_while_hung(tmp_path / "calls.log", window=timeout - 0.1)
    print(f"calls on other records completed while each call hung: {scored}")
    assert scored, "no hung call was logged"
    assert max(scored) >= 16, scored  # a step's worth
    # the hung samples were killed at the timeout and counted, in the log and in the metrics
    assert re.search(
        r"reward user_rewards:score failed sample \d+ on record id 'r(3|11)': took longer than "
        rf"{timeout} s, killed; the sample is failed, the run goes on",
        err,
    ), err
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["counters/reward_failures"] >= 4  # a group of 4 samples of a hanging record
    # ... and only as often as the data brings the 2 hanging records back (once a pass over the
    # 32 records): a group whose reward hung is failed at the timeout, never cancelled as stale
    # and recycled to hang again (that cost 47 kills from 2 records in 16 steps)
    passes = -(-int(last["counters/dispatched"]) // (4 * 32))
    assert last["counters/reward_failures"] <= 2 * 4 * passes, last
    assert "reward failed" in out


def test_the_first_sigterm_during_a_hung_reward_ends_the_run_with_a_checkpoint_that_resumes(
    tmp_path: Path,
) -> None:
    config = _project(tmp_path, steps=1000, function="user_rewards:score")
    proc = _start_hanging_run(tmp_path, config)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob("stuck-*")):  # a call hangs (and will for an hour)
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no reward call hung"
            time.sleep(0.1)
        workers = _workers_of(proc.pid)
        assert workers, "the reward does not run in worker processes"
        stuck = {int(p.name.removeprefix("stuck-")) for p in tmp_path.glob("stuck-*")}
        assert stuck <= set(workers)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            _, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail("the first SIGTERM did not end the run within 5 s")
        print(f"exited {time.monotonic() - sent:.2f} s after SIGTERM")
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    stop = re.match(r"trio-rl: stopped by SIGTERM after step (\d+): saved \S+\.ckpt", last)
    assert stop is not None, err
    _no_worker_left(proc.pid)
    # the checkpoint resumes: the same command goes on where the run stopped
    shipped = int(stop.group(1))
    config.write_text(config.read_text().replace("steps = 1000", "steps = 1"))
    resumed = subprocess.run(
        [_script(), "run", str(config), "--out", "run"],
        cwd=tmp_path,
        env=_env(hang=False),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {shipped + 1}:" in resumed.stdout, resumed.stdout
    assert len(_step_walls(tmp_path / "run")) == shipped + 1


def test_a_reward_raising_on_every_record_ends_the_run_with_one_line(tmp_path: Path) -> None:
    # the budget is a key (unset: a step's worth, 16 samples here)
    config = _project(
        tmp_path, steps=1000, function="user_rewards:misspelled", reward_keys="failure_budget = 5"
    )
    proc = subprocess.Popen(
        [_script(), "run", str(config), "--out", "run"],
        cwd=tmp_path,
        env=_env(hang=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for first in proc.stderr:  # until the first failure is logged
            if "failed sample" in first:
                break
        else:
            pytest.fail("the run ended without a reward failure")
        try:
            _, rest = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the run did not end within 30 s of the reward's first failure")
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 1, rest
    errors = [line for line in rest.splitlines() if line.startswith("trio-rl: error:")]
    assert len(errors) == 1, rest
    assert re.fullmatch(
        r"trio-rl: error: reward user_rewards:misspelled failed on 5 samples in a row \(the "
        r"failure budget: 5\); the first: KeyError: 'answr' \(user_rewards\.py:21 in "
        r"misspelled\) on record id 'r\d+'; nothing can train: fix the reward",
        errors[0],
    ), errors[0]
    documented("rewards that keep failing", errors[0])
    assert "Traceback" not in rest
    _no_worker_left(proc.pid)
