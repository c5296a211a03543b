"""The learning run's waits for the other side (docs/operations.md, "Waits and retries"), on a
virtual clock so that minutes of waiting take milliseconds: each logs the line the page quotes,
every 10 s with the time left, gives up at its budget, and ends at once when cancelled.

- a normal end's wait for the trainer to train the last shipped step (120 s);
- the torchrun trainer's exit (60 s);
- the heartbeats, the orchestrator's of the trainer job and the job's of the orchestrator
  (``trainer.connect_timeout``);
- the trainer job's last batches after ``STOP``, its watch for ``STOP``, and its wait for the
  run's configuration (``run.json``) as it starts."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
import trio_util
from learn_helpers import learn_config

from operations_waits import documented
from trio_rl.learn import trainer_job
from trio_rl.learn._heartbeat import watch_heartbeat
from trio_rl.learn._run_io import TrainerLog
from trio_rl.learn._trainer_jobs import TrainerSide, trainer_heartbeat
from trio_rl.learn._verdict import resumes
from trio_rl.learn.trainer_job import (
    _orchestrator_heartbeat,
    _wait_for_stop,
    _wait_trained,
    load_run_config,
)
from trio_rl.transport import TransportTimeoutError


def _warnings(caplog: pytest.LogCaptureFixture, logger: str = "trio_rl.learn") -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING
    ]


def _side(tmp_path: Path, mode: str = "inprocess", trained_through: int = 38) -> TrainerSide:
    config = learn_config(tmp_path, trainer__mode=mode, metrics__console=False)
    log = TrainerLog()
    log.add({"step": trained_through})
    return TrainerSide(config, log, torch.nn.Linear(1, 1), trio.CapacityLimiter(1))


async def test_the_wait_for_the_last_step_logs_every_10_s_and_gives_up_naming_the_weights(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.INFO, logger="trio_rl.learn")
    side = _side(tmp_path)
    start = trio.current_time()
    await side.finish(40, wait=True)
    # the budget: 120 s (run_learning's trainer_timeout), not a second more
    assert trio.current_time() - start == pytest.approx(120)
    lines = _warnings(caplog)
    assert lines == [
        f"waiting for the trainer to train step 40, the last shipped step (trained through 38); "
        f"giving up in {left} s"
        for left in range(110, 0, -10)
    ]
    documented("a normal end's wait for the last shipped step", lines[0])
    message = (
        "the trainer did not report step 40, the last shipped step, within 120 s: the final "
        "weights are those of step 38, not 40"
    )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [message]
    assert capsys.readouterr().err == f"WARNING: {message}\n"


async def test_a_trainer_that_reports_the_last_step_ends_the_wait_at_once(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    side = _side(tmp_path)

    async def train_at_25_s() -> None:
        await trio.sleep(25)
        side.log.add({"step": 39})
        side.log.add({"step": 40})

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(train_at_25_s)
        await side.finish(40, wait=True)
    assert trio.current_time() - start == pytest.approx(25)
    assert len(_warnings(caplog)) == 2  # at 10 and 20 s
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert capsys.readouterr().err == ""


async def test_the_wait_for_the_last_step_ends_when_cancelled(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    side = _side(tmp_path)
    start = trio.current_time()
    with trio.move_on_after(15):
        await side.finish(40, wait=True)
    assert trio.current_time() - start == pytest.approx(15)
    assert len(_warnings(caplog)) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_torchrun_trainer_that_does_not_exit_is_stopped_after_60_s(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    side = _side(tmp_path, mode="torchrun", trained_through=40)
    start = trio.current_time()
    await side.finish(40, wait=True)  # step 40 is trained: only the job's exit is waited for
    assert trio.current_time() - start == pytest.approx(60)
    lines = _warnings(caplog)
    assert lines == ["the torchrun trainer did not exit within 60 s; stopping it"]
    documented("the torchrun trainer's exit", lines[0])
    assert side.log.closed

    caplog.clear()
    side = _side(tmp_path, mode="torchrun", trained_through=40)
    side.done.set()  # a job that exited: no wait, no line
    start = trio.current_time()
    await side.finish(40, wait=True)
    assert trio.current_time() == start
    assert _warnings(caplog) == []


@pytest.mark.parametrize("side", ["orchestrator", "trainer job"])
async def test_a_heartbeat_that_never_comes_is_logged_every_10_s_and_fails_at_the_timeout(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    side: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    config = learn_config(tmp_path, trainer__mode="external", trainer__connect_timeout=300.0)
    if side == "orchestrator":  # the orchestrator waits for the trainer job's heartbeat
        heart = trainer_heartbeat(config)
        quoted = "waiting for the trainer job (mode external): no heartbeat in"
        error = "the trainer job did not start: no heartbeat in"
    else:
        heart = _orchestrator_heartbeat(config)
        quoted = "trainer job: waiting for the orchestrator: no heartbeat in"
        error = "trainer job: no orchestrator heartbeat in"
    start = trio.current_time()
    with pytest.raises(TransportTimeoutError) as info:
        await watch_heartbeat(heart)
    # the budget, trainer.connect_timeout, to the poll (0.25 s)
    assert 300 <= trio.current_time() - start <= 300.5
    assert str(info.value).startswith(f"{error} {heart.path} for 300 s (trainer.connect_timeout)")
    lines = _warnings(caplog)
    assert len(lines) == 29  # at 10, 20, ... 290 s
    assert lines[0] == (
        f"{quoted} {heart.path} for 10 s; failing in 290 s (trainer.connect_timeout)"
    )
    assert lines[-1].endswith("for 290 s; failing in 10 s (trainer.connect_timeout)")
    if side == "orchestrator":
        documented("the orchestrator's wait for a torchrun", lines[0])
    else:
        documented("the trainer job's wait for the orchestrator", lines[0])


async def test_a_heartbeat_wait_ends_when_cancelled(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    config = learn_config(tmp_path, trainer__mode="external", trainer__connect_timeout=300.0)
    with trio.move_on_after(42) as scope:
        await watch_heartbeat(trainer_heartbeat(config))
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(42)


async def test_the_trainer_job_s_last_batches_are_waited_for_with_a_line_every_10_s(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    trained = trio_util.AsyncValue(89)
    start = trio.current_time()
    with pytest.raises(TransportTimeoutError, match=r"step 90's batch never arrived in RUN/b"):
        await _wait_trained(trained, 91, idle_limit=300.0, where="RUN/b")
    assert trio.current_time() - start == pytest.approx(300)
    lines = _warnings(caplog)
    assert len(lines) == 29
    assert lines[0] == (
        "trainer job: the orchestrator's last step is 91; trained up to 89, waiting for step "
        "90's batch in RUN/b for 10 s; failing in 290 s (trainer.connect_timeout)"
    )
    documented("the trainer job's last batches", lines[0])


async def test_the_trainer_job_s_watch_for_stop_logs_every_300_s_until_it_appears(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    stop = tmp_path / "STOP"
    read = trainer_job._read_stop

    def orchestrator_ends_at_700_s(path: Path) -> str | None:
        # The orchestrator writes STOP at 700 s. Not a task sleeping until then: the watch
        # reads the file in a worker thread, and while it does, every task is blocked, so the
        # autojump clock would jump to that task's deadline in the middle of a read.
        if autojump_clock.current_time() >= 700 and not stop.exists():
            stop.write_text("91")
        return read(path)

    monkeypatch.setattr(trainer_job, "_read_stop", orchestrator_ends_at_700_s)
    assert await _wait_for_stop(stop) == 91
    assert 700 <= trio.current_time() <= 701
    lines = _warnings(caplog)
    assert lines == [f"trainer job: still waiting for {stop}"] * 2  # at 300 and 600 s
    documented("the trainer job's watch for `STOP`", lines[0])


def test_the_trainer_job_s_wait_for_run_json_is_logged_and_fails_at_its_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a synchronous wait before the job's event loop: real time, a short budget
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    path = tmp_path / "run.json"
    started = time.monotonic()
    with pytest.raises(TransportTimeoutError) as info:
        load_run_config(tmp_path, timeout=0.5, log_every=0.2)
    assert time.monotonic() - started >= 0.5
    assert str(info.value) == (
        f"trainer job: {path} did not appear within 0.5 s: no orchestrator started a run in "
        "that directory"
    )
    lines = _warnings(caplog)
    assert 1 <= len(lines) <= 2  # at 0.2 and 0.4 s (a loaded machine may skip one)
    assert re.fullmatch(
        rf"trainer job: waiting for {re.escape(str(path))} \(the orchestrator writes it as it "
        r"starts\) for 0 s; failing in 0 s",
        lines[0],
    ), lines[0]
    documented("the trainer job's start", lines[0])


async def test_a_trainer_job_waits_past_a_stale_stop_for_the_next_one(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = tmp_path / "STOP"
    stop.write_text("91")  # the stopped orchestrator's, naming a step the job trained
    stale = trainer_job._file_id(stop)
    assert stale is not None
    read = trainer_job._read_stop

    def resumed_orchestrator_ends_at_50_s(path: Path) -> str | None:
        # the resumed orchestrator clears STOP at its start (20 s) and writes its own at 50 s
        now = autojump_clock.current_time()
        if 20 <= now < 50:
            stop.unlink(missing_ok=True)
        elif now >= 50 and not stop.exists():
            stop.write_text("91")  # the same text: only the file tells them apart
            # written a run later (a file's time has a clock tick's granularity, and the inode
            # of an unlinked file may come back)
            later = stale[1] + 60 * 10**9
            os.utime(stop, ns=(later, later))
        return read(path)

    monkeypatch.setattr(trainer_job, "_read_stop", resumed_orchestrator_ends_at_50_s)
    assert await _wait_for_stop(stop, stale) == 91
    assert 50 <= trio.current_time() <= 51


@pytest.mark.parametrize(
    ("stopped", "step", "max_steps", "goes_on"),
    [
        ("signal", 91, 200, True),
        ("time_limit", 91, None, True),
        # without run.max_steps every invocation's --steps is a stretch of the run: the closing
        # lines print how to resume it, and a trainer job started beside that resume must wait
        ("steps", 91, None, True),
        ("steps", 91, 200, True),
        ("steps", 200, 200, False),
        ("reward", 91, None, False),
        ("converged", 91, None, False),
    ],
)
def test_which_orchestrator_stops_leave_the_run_to_go_on(
    stopped: str, step: int, max_steps: int | None, goes_on: bool
) -> None:
    assert resumes({"step": step, "stopped": stopped}, max_steps) is goes_on
    assert not resumes(None, max_steps)
