"""The loops over an unbounded number of records let a cancellation in: a checkpoint read (and
its payload scan) in a worker thread stops at its next records once told to, a restore yields
every few hundred records, a payload sweep stops between directories."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_rl.payloads import PayloadStore
from trio_rl.samples import OpenGroup, Prompt
from trio_rl.sink import (
    CheckpointManager,
    CheckpointSnapshot,
    SinkConfig,
    SinkCounters,
    SinkState,
    SinkWindow,
    TrainSink,
    read_checkpoint,
)
from trio_rl.sink._checkpoint_format import _ReadStoppedError
from trio_rl.sink._sink import RESTORE_BATCH, restoring


def _many_groups(n: int) -> SinkState:
    groups = tuple(OpenGroup(f"g-{i}", Prompt("k", (1,)), 2) for i in range(n))
    return SinkState(1, 0, SinkCounters(), SinkWindow(), (), groups)


def test_a_stopped_read_ends_at_its_next_records_and_moves_nothing(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep=5)
    good = mgr.write(CheckpointSnapshot(1, {}, None, _many_groups(500)))
    broken = mgr.path_for(2)
    broken.write_bytes(b"not a checkpoint at all, but a newer file")
    stop = threading.Event()
    stop.set()
    with pytest.raises(_ReadStoppedError):
        read_checkpoint(good, stop=stop)
    with pytest.raises(_ReadStoppedError):
        mgr.read_latest(stop=stop)
    assert broken.exists()  # a stopped read moves nothing aside
    assert len(read_checkpoint(good).sink.open_groups) == 500  # not stopped: it reads all


async def test_a_cancelled_load_returns_at_once(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.write(CheckpointSnapshot(1, {}, None, _many_groups(20_000)))
    with trio.move_on_after(0.001) as scope:
        await mgr.load_latest()
    assert scope.cancelled_caught
    assert (await mgr.load_latest()) is not None  # the manager is still usable


def test_a_restore_yields_every_batch_of_records() -> None:
    n = 3 * RESTORE_BATCH + 5
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    steps = restoring(sink, _many_groups(n))
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            report: Any = done.value
            break
        yields += 1
    assert yields == n // RESTORE_BATCH
    assert len(report.resumed) == n


async def test_a_restore_on_the_loop_lets_a_cancellation_in(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    ckpt = mgr.read(mgr.write(CheckpointSnapshot(1, {}, None, _many_groups(5 * RESTORE_BATCH))))
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    checkpoints = 0

    async def cancel_soon(scope: trio.CancelScope) -> None:
        nonlocal checkpoints
        while True:  # runs at each checkpoint the restore gives the loop
            checkpoints += 1
            if checkpoints == 3:
                scope.cancel()
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            nursery.start_soon(cancel_soon, scope)
            await mgr.arestore(sink, ckpt)
        nursery.cancel_scope.cancel()
    assert scope.cancelled_caught
    assert len(sink.open_group_ids()) < 5 * RESTORE_BATCH  # stopped part-way


def test_a_stopped_sweep_finishes_its_directory_and_deletes_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PayloadStore(tmp_path)
    for k in range(20):
        (store.version_dir(k) / "sub").mkdir(parents=True)
        (store.version_dir(k) / "sub" / "r.bin").write_bytes(b"x" * 10)
    stop = threading.Event()
    real = shutil.rmtree

    def rmtree(path: Any, ignore_errors: bool = False) -> None:
        real(path, ignore_errors=ignore_errors)
        stop.set()  # told to stop while deleting the first directory

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert store.sweep_orphans([], 19, stop=stop) == [0]
    assert store.versions_on_disk() == list(range(1, 20))
    monkeypatch.undo()
    assert store.sweep_orphans([], 19) == list(range(1, 19))  # the next sweep deletes the rest
