"""Incremental checkpoints: a delta per step after a full base, replay on load, compaction.

What is pinned: a delta's bytes follow what changed since the previous checkpoint, not the queue
(and so does the loop's snapshot); base + deltas restore exactly the state a full save of the
same sink records, through any mix of the sink's operations, a resume and compactions; a torn
newest file falls back to the step before; a damaged earlier file is a `CheckpointError` naming
it, the field and the byte offset; full (schema 1) checkpoints of earlier versions still load.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from sink_helpers import assert_accounted
from test_sink_checkpoint import state_dicts

from builders import make_group, make_sample
from trio_rl.errors import CheckpointCompactionError, InvalidArgumentError
from trio_rl.samples import Prompt
from trio_rl.sink import (
    CheckpointError,
    CheckpointManager,
    PruneMode,
    SinkConfig,
    SinkState,
    TrainSink,
    encode_checkpoint,
    read_checkpoint,
)
from trio_rl.sink._checkpoint_format import DELTA_SCHEMA_VERSION, SCHEMA_VERSION


def _version(path: Path) -> int:
    return int(struct.unpack_from("<H", path.read_bytes(), 8)[0])


def _incremental(tmp_path: Path, **kw: Any) -> CheckpointManager:
    kw.setdefault("background_compaction", False)
    return CheckpointManager(tmp_path, incremental=True, **kw)


async def test_a_delta_costs_what_arrived_not_the_queue(tmp_path: Path) -> None:
    """Per-step arrivals and batches constant, the queue growing 30x: every delta file is the
    same size (within a few bytes of counters), while a full save grows with the queue; the
    loop's snapshot holds only the step's arrivals."""
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    mgr = _incremental(tmp_path, compact_ratio=1e9, keep=2)
    full_sizes, delta_puts = [], []
    for step in range(1, 31):
        for _ in range(4):  # 4 groups x 4 samples arrive each step, a batch of 8 ships
            sink.add_group(make_group([1.0, 0.0, 0.5, 0.25], completion=64))
        await sink.take_batch()
        snap = mgr.snapshot(sink, step=step, cursor={"step": step})
        delta_puts.append(len(getattr(mgr._chain.pending[-1][1], "put", sink.queued_samples())))
        await mgr.save(snap)
        full_sizes.append(len(encode_checkpoint(CheckpointManager(tmp_path).snapshot(sink))))
    assert sink.queued == 30 * 8
    deltas = mgr.written_bytes[1:]
    assert _version(mgr.path_for(30)) == DELTA_SCHEMA_VERSION
    assert max(deltas) < 1.01 * min(deltas), deltas  # ids and counters grow a few bytes
    assert full_sizes[-1] > 25 * full_sizes[0]  # what a full save would have cost
    assert max(deltas) < 3 * full_sizes[0]
    assert delta_puts == [8] + [16] * 29  # the first is the full state: 8 queued then
    ckpt = read_checkpoint(mgr.path_for(30))
    assert state_dicts(ckpt.sink) == state_dicts(sink.state_dict())
    assert mgr.list_checkpoints()[0].name == "step_00000001.ckpt"  # the base stays


async def _random_run(
    tmp_path: Path, seed: int, *, steps: int = 40, **kw: Any
) -> tuple[CheckpointManager, TrainSink]:
    """A seeded mix of every sink operation, with an incremental save after each step and the
    loaded state compared to the full state each time (a resume halfway)."""
    rng = random.Random(seed)
    prune = PruneMode.AFTER_SELECTION if seed % 2 else PruneMode.BEFORE_QUEUE
    config = SinkConfig(batch_size=6, max_off_policy_steps=1, prune=prune)
    sink = TrainSink(config)
    mgr = _incremental(tmp_path, **kw)
    version, n_open = 0, 0
    kinds = set()
    for step in range(1, steps + 1):
        for _ in range(rng.randint(0, 5)):
            op = rng.random()
            open_ids = sink.open_group_ids()
            if op < 0.3:
                rewards = [rng.choice([0.0, 0.5, 1.0]) for _ in range(rng.randint(1, 4))]
                sink.add_group(make_group(rewards, version=version))
            elif op < 0.45 or not open_ids:
                n_open += 1
                gid = f"open-{seed}-{n_open}"
                sink.open_group(gid, Prompt(gid, (1, 2)), rng.randint(1, 4), version)
            elif op < 0.7:
                sink.add_member(rng.choice(open_ids), make_sample(0, rng.random(), version=version))
            elif op < 0.78:
                sink.record_failed(1, rng.choice(open_ids))
            elif op < 0.84:
                sink.book.attempt_failed(make_group([0.0], group_id=rng.choice(open_ids)))
            elif op < 0.9:
                sink.book.group_discarded(
                    make_group([1.0], group_id=rng.choice(open_ids)), "filtered"
                )
            elif op < 0.95 and sink.queued:
                with pytest.raises(RuntimeError):  # a cut that fails goes back (pruned copies)
                    async with sink.cut(force=True):
                        raise RuntimeError("send failed")
            else:
                version += 1
        if sink.ready():
            await sink.take_batch()
        if step == steps // 2:  # resume: a new sink and manager from the latest checkpoint
            latest = await mgr.load_latest()
            assert latest is not None
            sink = TrainSink(config)
            mgr = _incremental(tmp_path, **kw)
            mgr.restore(sink, latest)  # the next checkpoint: a delta after the loaded one
        expected = state_dicts(sink.state_dict())
        path = await mgr.save(mgr.snapshot(sink, step=step, cursor={"step": step}))
        kinds.add(_version(path))
        loaded = read_checkpoint(path)
        assert loaded.cursor == {"step": step}
        assert state_dicts(loaded.sink) == expected, (seed, step)
        assert_accounted(sink)
    assert kinds == {SCHEMA_VERSION, DELTA_SCHEMA_VERSION}
    return mgr, sink


@pytest.mark.parametrize("seed", range(8))
async def test_base_and_deltas_restore_what_a_full_save_records(tmp_path: Path, seed: int) -> None:
    mgr, _ = await _random_run(tmp_path, seed, compact_ratio=2.0, keep=3)
    assert mgr.compactions >= 1
    versions = {_version(p) for p in mgr.list_checkpoints()}
    assert versions <= {SCHEMA_VERSION, DELTA_SCHEMA_VERSION}
    # every kept checkpoint loads; pruning kept what they depend on and nothing else of ours
    for p in mgr.list_checkpoints():
        read_checkpoint(p)
    assert len(mgr.list_checkpoints()) <= 3 + mgr.max_chain


async def test_compaction_rewrites_the_newest_delta_as_an_equal_full_file(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    mgr = _incremental(tmp_path, compact_ratio=1e9, max_chain=2, keep=1)
    for step in range(1, 5):
        sink.add_group(make_group([1.0, 0.0]))
        await mgr.save(mgr.snapshot(sink, step=step))
        if step == 3:
            assert state_dicts(read_checkpoint(mgr.path_for(3)).sink) == state_dicts(
                sink.state_dict()
            )
    # step 1 full; 2 and 3 deltas (the second makes a chain of 2: 3 is compacted); 4 a delta
    assert mgr.compactions == 1
    assert _version(mgr.path_for(3)) == SCHEMA_VERSION
    assert _version(mgr.path_for(4)) == DELTA_SCHEMA_VERSION
    # keep=1: step 4 and the file it replays; 1 and 2 are needed by nothing kept
    assert [p.name for p in mgr.list_checkpoints()] == ["step_00000003.ckpt", "step_00000004.ckpt"]
    assert state_dicts(read_checkpoint(mgr.path_for(4)).sink) == state_dicts(sink.state_dict())


async def test_background_compaction_is_equivalent_and_close_stops_it(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    mgr = CheckpointManager(tmp_path, incremental=True, compact_ratio=0.5, keep=1)
    for step in range(1, 8):
        sink.add_group(make_group([1.0, 0.0]))
        await mgr.save(mgr.snapshot(sink, step=step))
        mgr.wait_compaction()
    assert mgr.compactions >= 2
    assert state_dicts(read_checkpoint(mgr.path_for(7)).sink) == state_dicts(sink.state_dict())
    mgr.close()
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".tmp", ".compact"))]


async def test_a_torn_newest_file_falls_back_to_the_step_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    mgr = _incremental(tmp_path, compact_ratio=1e9, keep=5)
    states = {}
    for step in range(1, 5):
        sink.add_group(make_group([1.0, 0.0, 0.5]))
        await mgr.save(mgr.snapshot(sink, step=step))
        states[step] = state_dicts(sink.state_dict())
    newest = mgr.path_for(4)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) - 7])  # the tail never made it to disk
    (tmp_path / "step_00000005.ckpt.123.tmp").write_bytes(data[:30])  # a writer died mid-save
    with pytest.raises(CheckpointError, match="truncated or incomplete"):
        read_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="trio_rl.sink"):
        latest = CheckpointManager(tmp_path).read_latest()
    assert latest is not None
    assert latest.step == 3
    assert state_dicts(latest.sink) == states[3]
    assert newest.name in caplog.text


def _repack(path: Path, mutate: Any) -> int:
    """Rewrite a checkpoint with ``mutate(records)`` applied and a valid checksum; returns the
    byte offset of the second record (the first queued sample)."""
    data = path.read_bytes()
    unpacker = msgpack.Unpacker(io.BytesIO(data[16:-20]), raw=False, strict_map_key=False)
    records = list(unpacker)
    mutate(records)
    packed = [msgpack.packb(r, use_bin_type=True) for r in records]
    body = b"".join(packed)
    trailer = struct.pack("<QI8s", len(body), zlib.crc32(body), b"TRIOEND!")
    path.write_bytes(data[:16] + body + trailer)
    return 16 + len(packed[0])


async def test_a_damaged_earlier_delta_is_named_with_its_field_and_offset(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    mgr = _incremental(tmp_path, compact_ratio=1e9, keep=5)
    for step in range(1, 5):
        sink.add_group(make_group([1.0, 0.0, 0.5]))
        await mgr.save(mgr.snapshot(sink, step=step, cursor=step))
    damaged = mgr.path_for(2)
    assert _version(damaged) == DELTA_SCHEMA_VERSION

    def mutate(records: list[Any]) -> None:
        records[1][0] = "not tokens"  # the first queued sample's token ids

    offset = _repack(damaged, mutate)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(mgr.path_for(4))
    message = str(info.value)
    assert info.value.path == str(mgr.path_for(4))
    assert damaged.name in message
    assert "sink.queued[0]" in message
    assert f"byte offset {offset}" in message
    with caplog.at_level(logging.WARNING, logger="trio_rl.sink"):
        latest = CheckpointManager(tmp_path).read_latest()
    assert latest is not None
    assert latest.cursor == 1  # 4 and 3 depend on the damaged 2: all three skipped, set aside
    assert [p.name for p in CheckpointManager(tmp_path).list_checkpoints()] == [
        "step_00000001.ckpt"
    ]


async def test_a_delta_after_a_replaced_parent_is_refused(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    mgr = _incremental(tmp_path, compact_ratio=1e9, keep=5)
    for step in range(1, 4):
        sink.add_group(make_group([1.0]))
        await mgr.save(mgr.snapshot(sink, step=step))
    # another run's full file in place of step 2: the delta of step 3 was not written after it
    other = CheckpointManager(tmp_path / "other")
    mgr.path_for(2).write_bytes(encode_checkpoint(other.snapshot(sink, step=2)))
    with pytest.raises(CheckpointError, match="not the checkpoint it was written after"):
        read_checkpoint(mgr.path_for(3))


async def test_schema_1_checkpoints_load_and_an_incremental_run_continues(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    sink.add_group(make_group([1.0, 0.0]))
    sink.open_group("open-1", Prompt("k", (1,)), 3, 0)
    sink.add_member("open-1", make_sample(0, 1.0))
    await CheckpointManager(tmp_path).save(CheckpointManager(tmp_path).snapshot(sink, step=1))
    mgr = _incremental(tmp_path, compact_ratio=1e9)
    latest = await mgr.load_latest()
    assert latest is not None
    resumed = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    resumed.load_state_dict(latest.sink)
    for step in (2, 3):
        resumed.add_group(make_group([0.5, 0.0]))
        resumed.add_member("open-1", make_sample(0, 0.0))
        await mgr.save(mgr.snapshot(resumed, step=step))
    assert _version(mgr.path_for(2)) == SCHEMA_VERSION  # the first after a restore is full
    assert _version(mgr.path_for(3)) == DELTA_SCHEMA_VERSION
    state: SinkState = read_checkpoint(mgr.path_for(3)).sink
    assert state_dicts(state) == state_dicts(resumed.state_dict())


async def test_a_snapshot_not_written_is_folded_into_the_next_delta(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    mgr = _incremental(tmp_path, compact_ratio=1e9)
    await mgr.save(mgr.snapshot(sink, step=1))
    sink.add_group(make_group([1.0, 0.0]))
    mgr.snapshot(sink, step=2)  # taken, never written (a cancelled save)
    sink.add_group(make_group([0.0, 0.5]))
    path = await mgr.save(mgr.snapshot(sink, step=3))
    assert _version(path) == DELTA_SCHEMA_VERSION
    assert state_dicts(read_checkpoint(path).sink) == state_dicts(sink.state_dict())


async def test_a_sink_nobody_checkpoints_records_nothing() -> None:
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    for _ in range(50):
        sink.add_group(make_group([1.0, 0.0]))
    assert not sink.changes.active
    assert not sink.changes.queued


async def test_a_resumed_run_goes_on_with_a_delta_after_the_loaded_file(tmp_path: Path) -> None:
    """`CheckpointManager.restore`: the first checkpoint after a resume is a delta after the
    file resumed from, holding what the restore itself dropped (here: work stale under the
    resumed run's tighter staleness), and it never deletes the earlier run's files."""
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    first = _incremental(tmp_path, compact_ratio=1e9)
    for step in range(1, 5):
        sink.add_group(make_group([1.0, 0.0, 0.5], version=step - 1))
        await sink.take_batch()
        sink.open_group(f"open{step}", Prompt("k", (1,)), 3, step - 1)
        sink.add_member(f"open{step}", make_sample(0, 1.0, version=step - 1))
        await first.save(first.snapshot(sink, step=step))
    before = {p.name: p.read_bytes() for p in first.list_checkpoints()}
    mgr = _incremental(tmp_path, compact_ratio=1e9, keep=1)
    latest = await mgr.load_latest()
    assert latest is not None
    assert [f.path.name for f in latest.chain] == [f"step_0000000{i}.ckpt" for i in (4, 3, 2, 1)]
    resumed = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=1))
    report = mgr.restore(resumed, latest)
    assert report.dropped_queued_stale + report.dropped_members_stale > 0
    for step in (5, 6):
        resumed.add_group(make_group([0.5, 0.0], version=4))
        path = await mgr.save(mgr.snapshot(resumed, step=step))
        assert _version(path) == DELTA_SCHEMA_VERSION
        assert len(path.read_bytes()) < len(before["step_00000001.ckpt"]) + 4096
        assert state_dicts(read_checkpoint(path).sink) == state_dicts(resumed.state_dict())
    # keep=1 prunes only this manager's own files: the first run's are all still there
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert [p.name for p in mgr.list_checkpoints()][-1] == "step_00000006.ckpt"


async def test_close_gives_up_on_a_stalled_compaction_with_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from trio_rl.sink import _checkpoint_chain, _checkpoint_format

    stalled, release = threading.Event(), threading.Event()
    real = _checkpoint_format.write_stream

    def write(*args: Any, **kw: Any) -> None:
        if kw.get("abort") is not None:  # the compaction's write: a disk that stalls
            stalled.set()
            release.wait(30)
        real(*args, **kw)

    monkeypatch.setattr(_checkpoint_chain, "write_stream", write)
    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    mgr = CheckpointManager(tmp_path, incremental=True, compact_ratio=0.5, keep=1)
    for step in range(1, 8):
        sink.add_group(make_group([1.0, 0.0]))
        await mgr.save(mgr.snapshot(sink, step=step))
        if stalled.is_set():
            break
    assert stalled.wait(10), "no compaction started"
    started = time.monotonic()
    with pytest.raises(CheckpointCompactionError, match=r"did not stop within 0\.2 s"):
        mgr.close(timeout=0.2)
    assert time.monotonic() - started < 5
    release.set()
    mgr.close()  # the write goes on, sees the stop between records, and ends: joined
    assert mgr._chain.compaction.thread is None
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".compact")]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"keep": 0}, "CheckpointManager keep must be >= 1, got 0"),
        ({"compact_ratio": 0.0}, "CheckpointManager compact_ratio must be > 0, got 0.0"),
        ({"max_chain": 0}, "CheckpointManager max_chain must be >= 1, got 0"),
    ],
)
def test_a_bad_argument_is_an_invalid_argument_naming_it(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        _incremental(tmp_path, **kw)
