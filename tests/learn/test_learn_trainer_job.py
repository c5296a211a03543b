"""The trainer job (``trio-rl trainer``) never waits forever for a step the orchestrator named
as its last (``STOP``): no step trained for ``trainer.connect_timeout`` seconds fails it, with
what it waited for; progress resets the deadline."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
import trio
import trio_util
from learn_helpers import learn_config

from trio_rl.errors import TrainError, TransportTimeoutError
from trio_rl.learn.trainer_job import _wait_trained, hold_rank, run_job

torch.set_num_threads(1)


def test_a_last_step_whose_batch_never_arrives_fails_the_job_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # the orchestrator named step 2 its last, but no batch file of step 1 or 2 ever comes
    (tmp_path / "STOP").write_text("2")
    config = learn_config(
        tmp_path,
        trainer__mode="external",
        trainer__connect_timeout=1.0,
        metrics__console=False,
        metrics__plot=False,
    )
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    started = time.monotonic()
    with pytest.raises(TransportTimeoutError) as info:
        run_job(config)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "last step is 2" in message
    assert "step 1's batch never arrived" in message
    assert str(tmp_path / "batches") in message
    assert "trainer.connect_timeout" in message
    # the deadline, not the test's patience: a second or so after the job started waiting
    assert elapsed < 30
    waits = [
        r.getMessage() for r in caplog.records if "waiting for step 1's batch" in r.getMessage()
    ]
    assert waits, "the wait was not logged before the deadline"


async def test_progress_resets_the_deadline_of_the_wait_for_the_last_step() -> None:
    trained = trio_util.AsyncValue(0)

    async def train_slowly() -> None:
        for step in (1, 2, 3):
            await trio.sleep(0.5)
            trained.value = step

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(train_slowly)
        # each step comes within the 1 s deadline, all three take longer than it
        await _wait_trained(trained, 3, idle_limit=1.0, where="batches")
    assert trained.value == 3
    assert trio.current_time() - started >= 1.5


async def test_a_stalled_wait_fails_after_its_deadline_with_the_step_it_waits_for() -> None:
    trained = trio_util.AsyncValue(4)
    started = trio.current_time()
    with pytest.raises(TransportTimeoutError, match=r"step 5's batch never arrived in here"):
        await _wait_trained(trained, 6, idle_limit=0.5, where="here")
    assert 0.5 <= trio.current_time() - started < 5


def test_a_second_trainer_job_on_the_same_run_directory_is_refused_naming_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "STOP").write_text("1")
    config = learn_config(
        tmp_path,
        trainer__mode="external",
        trainer__connect_timeout=1.0,
        metrics__console=False,
        metrics__plot=False,
    )
    first = hold_rank(tmp_path, 0)  # the job already running (a separate open file: flock)
    try:
        with pytest.raises(TrainError) as info:
            run_job(config)
    finally:
        first.close()
    message = str(info.value)
    assert f"pid {os.getpid()}" in message  # who holds it
    assert str(tmp_path / "trainer" / "rank_0.lock") in message
    assert "train the same steps twice" in message
    # the lock goes with its holder: a job started after it takes the rank (and then waits
    # for step 1's batch, which never comes)
    with pytest.raises(TransportTimeoutError):
        run_job(config)
