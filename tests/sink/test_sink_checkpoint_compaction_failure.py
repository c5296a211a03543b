"""A compaction that fails reaches the caller: retried at the next write, raised as a
`CheckpointCompactionError` naming the file (chained to the cause) once it failed
``COMPACTION_ATTEMPTS`` times in a row, by `wait_compaction` and by `close`; never only logged.
Every step written before stays readable. The failures are real: the compaction's temporary
path is a directory (the tests run as root, where a permission bit stops no write).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from test_sink_checkpoint import state_dicts

from builders import make_group
from operations_waits import documented
from trio_rl.errors import CheckpointCompactionError, CheckpointError
from trio_rl.sink import CheckpointManager, SinkConfig, SinkState, TrainSink, read_checkpoint
from trio_rl.sink._checkpoint_compaction import COMPACTION_ATTEMPTS


def _block(directory: Path, steps: range) -> list[Path]:
    """Make the compaction of these steps' files fail: its temporary path is a directory."""
    blocks = [directory / f"step_{s:08d}.ckpt.{os.getpid()}.compact" for s in steps]
    for b in blocks:
        b.mkdir(parents=True)
    return blocks


def _sink() -> TrainSink:
    return TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))


async def test_a_compaction_that_keeps_failing_is_raised_by_the_write_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.sink")
    sink = _sink()
    # every delta is compacted at once (max_chain=1), in the writing thread
    mgr = CheckpointManager(
        tmp_path, incremental=True, max_chain=1, keep=2, background_compaction=False
    )
    blocks = _block(tmp_path, range(1, 20))
    states: dict[int, SinkState] = {}
    raised: CheckpointCompactionError | None = None
    step = 0
    while raised is None and step < 10:
        step += 1
        sink.add_group(make_group([1.0, 0.0]))
        try:
            await mgr.save(mgr.snapshot(sink, step=step))
        except CheckpointCompactionError as exc:
            raised = exc
        states[step] = sink.state_dict()
    assert raised is not None, "a compaction failing every time was never raised"
    # step 1 is full; 2, 3, 4 deltas whose compactions fail: the third failure is raised
    assert step == 1 + COMPACTION_ATTEMPTS
    assert raised.path == str(mgr.path_for(step))
    assert isinstance(raised, CheckpointError)
    assert isinstance(raised.__cause__, IsADirectoryError)
    assert f"{COMPACTION_ATTEMPTS} times" in str(raised)
    assert mgr.compactions == 0
    # one WARNING per failure, counting them, before the error
    lines = [r.getMessage() for r in caplog.records if "compaction" in r.getMessage()]
    assert [line.split(" failed (")[1].split(" in a row")[0] for line in lines] == [
        str(n) for n in range(1, COMPACTION_ATTEMPTS + 1)
    ]
    assert lines[0].startswith(f"checkpoint compaction of {mgr.path_for(2)} failed (1 in a row")
    documented("checkpoint compaction", lines[0])
    # nothing accepted is lost: the step whose write raised is on disk, as is every one kept
    latest = mgr.read_latest()
    assert latest is not None
    assert latest.step == step
    for s in (step - 1, step):
        assert state_dicts(read_checkpoint(mgr.path_for(s)).sink) == state_dicts(states[s])
    # the cause gone, the next write compacts, and the run goes on
    for b in blocks:
        shutil.rmtree(b)
    sink.add_group(make_group([1.0, 0.0]))
    await mgr.save(mgr.snapshot(sink, step=step + 1))
    assert mgr.compactions == 1
    assert state_dicts(read_checkpoint(mgr.path_for(step + 1)).sink) == state_dicts(
        sink.state_dict()
    )
    mgr.close()
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".tmp", ".compact"))]


async def test_a_transient_compaction_failure_is_retried_and_not_raised(tmp_path: Path) -> None:
    sink = _sink()
    mgr = CheckpointManager(
        tmp_path, incremental=True, max_chain=1, keep=1, background_compaction=False
    )
    (block,) = _block(tmp_path, range(2, 3))  # only step 2's compaction fails
    for step in range(1, 4):
        sink.add_group(make_group([1.0, 0.0]))
        await mgr.save(mgr.snapshot(sink, step=step))
        if step == 2:
            assert mgr.compactions == 0
            shutil.rmtree(block)
    # retried at step 3's write: that delta (2 deltas long now) compacted
    assert mgr.compactions == 1
    mgr.wait_compaction()
    mgr.close()
    assert state_dicts(read_checkpoint(mgr.path_for(3)).sink) == state_dicts(sink.state_dict())


async def test_a_failed_background_compaction_reaches_wait_compaction_and_close(
    tmp_path: Path,
) -> None:
    sink = _sink()
    mgr = CheckpointManager(tmp_path, incremental=True, max_chain=1, keep=2)
    _block(tmp_path, range(1, 5))
    sink.add_group(make_group([1.0, 0.0]))
    await mgr.save(mgr.snapshot(sink, step=1))
    sink.add_group(make_group([1.0, 0.0]))
    await mgr.save(mgr.snapshot(sink, step=2))
    with pytest.raises(CheckpointCompactionError) as info:
        mgr.wait_compaction()
    assert info.value.path == str(mgr.path_for(2))
    assert isinstance(info.value.__cause__, IsADirectoryError)
    mgr.wait_compaction()  # reported once
    sink.add_group(make_group([1.0, 0.0]))
    await mgr.save(mgr.snapshot(sink, step=3))  # retried in the background: fails again
    with pytest.raises(CheckpointCompactionError, match=r"step_00000003\.ckpt"):
        mgr.close()
    assert mgr._chain.compaction.thread is None  # joined: no thread outlives the manager
    mgr.close()  # reported once
    assert state_dicts(read_checkpoint(mgr.path_for(3)).sink) == state_dicts(sink.state_dict())
