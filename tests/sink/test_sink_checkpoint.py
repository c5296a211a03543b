"""Checkpoint format, atomic save, restore semantics and the three reference defects."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from sink_helpers import assert_accounted

from builders import make_group, make_sample
from trio_rl.payloads import PayloadStore, segment_files
from trio_rl.samples import Group, OpenGroup, Prompt, SampleStatus
from trio_rl.sink import (
    CheckpointError,
    CheckpointManager,
    PruneMode,
    SinkConfig,
    SinkState,
    TrainingSample,
    TrainSink,
    read_checkpoint,
)
from trio_rl.sink._codec import decode_training_sample, encode_training_sample
from trio_rl.wire import MMImageRef, MMRefs, PayloadSegment, RoutedExperts, SamplingMask


def ts_dict(s: TrainingSample) -> dict[str, Any]:
    return attrs.asdict(s, recurse=True)


def state_dicts(state: SinkState) -> dict[str, Any]:
    return {
        "step": state.step,
        "next_arrival": state.next_arrival,
        "counters": state.counters,
        "window": state.window,
        "queued": [ts_dict(s) for s in state.queued],
        "open": [
            (
                g.group_id,
                g.prompt,
                g.group_size,
                g.policy_version_at_start,
                [attrs.asdict(m) for m in g.arrived],
            )
            for g in state.open_groups
        ],
    }


def filled_sink() -> TrainSink:
    s = TrainSink(SinkConfig(batch_size=64, max_off_policy_steps=None))
    s.add_group(make_group([1.0, 0.0, 0.5], version=1))
    s.add_group(make_group([0.25, 0.0], version=2))
    s.open_group("open-1", Prompt("k1", (1, 2, 3), label={"answer": 4}, env_name="math"), 4, 2)
    s.add_member("open-1", make_sample(9, 1.0, version=2))
    s.open_group("open-empty", Prompt("k2", (7,)), 2, 3)
    return s


async def test_roundtrip_preserves_everything(tmp_path: Path) -> None:
    sink = filled_sink()
    rich = sink.queued_samples()[0]
    n = rich.num_tokens
    rich.ref_logprobs = [-0.0, 1e-300, *([0.5] * (n - 2))]
    rich.mm_refs = MMRefs([MMImageRef("file:///a.png", 3, 99)])
    rich.routed_experts = RoutedExperts(b"\x01\x02" * n, [n, 1, 2], "uint8")
    rich.mm_token_type_ids = [0] * n
    rich.rl_weights = [1.0] * n
    rich.ce_weights = [0.0] * n
    # one allowed id at the first position, none at the others (one int32 count per token)
    rich.sampling_mask = SamplingMask(b"\x00" * 4, b"\x01\x00\x00\x00" + bytes(4 * (n - 1)))
    rich.trace_id, rich.branch_index = "trace-1", 2
    rich.payload = [PayloadSegment("routed_experts", "v1/x.bin", 8, 0, n, "<i4", [2, 3])]
    mgr = CheckpointManager(tmp_path, limiter=trio.CapacityLimiter(1))
    snap = mgr.snapshot(sink, cursor={"epoch": 2, "cursor": [1, 2, 3]}, progress={"tokens": 5})
    path = await mgr.save(snap)
    assert path == tmp_path / "step_00000000.ckpt"
    loaded = await mgr.load(path)
    assert (loaded.step, loaded.cursor, loaded.progress) == (0, snap.cursor, {"tokens": 5})
    assert state_dicts(loaded.sink) == state_dicts(snap.sink)


@given(
    st.lists(st.integers(0, 2**40), min_size=1, max_size=20),
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=20),
)
def test_codec_is_exact_for_any_values(tokens: list[int], floats: list[float]) -> None:
    n = len(tokens)
    vals = (floats * n)[:n]
    s = TrainingSample(
        token_ids=tokens,
        mask=[i % 2 == 0 for i in range(n)],
        logprobs=vals,
        temperatures=[vals[0]] * n,
        env_name="e",
        advantages=list(reversed(vals)),
    )
    back = decode_training_sample(encode_training_sample(s), "x")
    assert ts_dict(back) == ts_dict(s)
    assert [str(x) for x in back.temperatures] == [str(x) for x in s.temperatures]  # -0.0 kept


async def test_snapshot_is_isolated_from_later_mutation(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=64, prune=PruneMode.AFTER_SELECTION))
    sink.add_group(make_group([1.0, 0.0, 0.5], version=1))  # one zero advantage: pruned later
    sink.open_group("open-1", Prompt("k1", (1, 2, 3)), 4, 2)
    sink.add_member("open-1", make_sample(9, 1.0, version=2))
    mgr = CheckpointManager(tmp_path)
    snap = mgr.snapshot(sink)
    expected = state_dicts(snap.sink)
    assert all(s["rl_weights"] is None for s in expected["queued"])
    # mutate everything after the snapshot: new work, arrivals, a cut with pruning
    sink.add_group(make_group([3.0, 1.0]))
    sink.add_member("open-1", make_sample(9, 0.0, version=2))
    sink.open_group("open-2", Prompt("k2", (1,)), 2, 2)
    batch = await sink.take_batch(force=True)
    assert sink.counters.pruned == 1
    assert len(batch.samples) == 4
    loaded = await mgr.load(await mgr.save(snap))
    assert state_dicts(loaded.sink) == expected


async def test_keeps_the_last_k(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep=2)
    sink = filled_sink()
    for step in range(5):
        await mgr.save(mgr.snapshot(sink, step=step))
    assert [p.name for p in mgr.list_checkpoints()] == ["step_00000003.ckpt", "step_00000004.ckpt"]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


async def test_saving_after_resuming_from_an_older_checkpoint_supersedes_newer_ones(
    tmp_path: Path,
) -> None:
    mgr = CheckpointManager(tmp_path, keep=3)
    sink = filled_sink()
    for step in (4, 5, 6):
        await mgr.save(mgr.snapshot(sink, step=step, cursor=f"first run {step}"))
    # resume from step 4 and save step 5 again: the abandoned step 6 must not stay "latest"
    await mgr.save(mgr.snapshot(sink, step=5, cursor="second run 5"))
    assert [p.name for p in mgr.list_checkpoints()] == ["step_00000004.ckpt", "step_00000005.ckpt"]
    latest = await mgr.load_latest()
    assert latest is not None
    assert latest.cursor == "second run 5"


async def _two_checkpoints(tmp_path: Path) -> tuple[CheckpointManager, Path, Path]:
    mgr = CheckpointManager(tmp_path, keep=5)
    sink = filled_sink()
    first = await mgr.save(mgr.snapshot(sink, step=1, cursor="first"))
    second = await mgr.save(mgr.snapshot(sink, step=2, cursor="second"))
    return mgr, first, second


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[: len(b) // 2], "truncated or incomplete"),
        (lambda b: b[:10], "truncated"),
        (lambda b: b[:40] + bytes([b[40] ^ 0xFF]) + b[41:], "checksum mismatch"),
        (lambda b: b[:8] + struct.pack("<H", 99) + b[10:], "unknown schema version 99"),
        (lambda b: b"NOTACKPT" + b[8:], "bad magic"),
        (lambda b: b"", "truncated"),
    ],
)
async def test_damaged_checkpoint_is_named_and_the_previous_one_loads(
    tmp_path: Path, damage: Any, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    mgr, first, second = await _two_checkpoints(tmp_path)
    second.write_bytes(damage(second.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as info:
        read_checkpoint(second)
    assert info.value.path == str(second)
    assert str(second) in str(info.value)
    with caplog.at_level(logging.WARNING, logger="trio_rl.sink"):
        latest = await mgr.load_latest()
    assert latest is not None
    assert latest.cursor == "first"
    assert latest.path == first
    assert "skipping unusable checkpoint" in caplog.text
    assert second.name in caplog.text


async def test_missing_checkpoint_and_no_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot open"):
        read_checkpoint(tmp_path / "step_00000001.ckpt")
    assert await CheckpointManager(tmp_path / "none").load_latest() is None


async def test_unserialisable_cursor_is_a_checkpoint_error(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    snap = mgr.snapshot(filled_sink(), cursor={"rng": object()})
    with pytest.raises(CheckpointError, match="not MessagePack-able"):
        await mgr.save(snap)
    assert os.listdir(tmp_path) == []


async def test_cancelled_save_leaves_no_partial_file(tmp_path: Path) -> None:
    limiter = trio.CapacityLimiter(1)
    mgr = CheckpointManager(tmp_path, limiter=limiter)
    snap = mgr.snapshot(filled_sink())
    async with limiter:
        with trio.move_on_after(0.05):
            await mgr.save(snap)  # waits for the limiter, then is cancelled
    assert os.listdir(tmp_path) == []
    await mgr.save(snap)
    assert len(mgr.list_checkpoints()) == 1


async def test_restore_ships_queued_first_and_resumes_open_groups(tmp_path: Path) -> None:
    sink = filled_sink()
    mgr = CheckpointManager(tmp_path)
    restored_ids = [s.sample_index for s in sink.queued_samples()]
    ck = await mgr.load(await mgr.save(mgr.snapshot(sink)))
    new = TrainSink(SinkConfig(batch_size=4, max_off_policy_steps=None))
    report = new.load_state_dict(ck.sink)
    assert report.queued == 4
    assert report.completed_groups == []
    by_id = {r.group_id: r for r in report.resumed}
    assert set(by_id) == {"open-1", "open-empty"}
    assert by_id["open-1"].missing == 3
    assert len(by_id["open-1"].arrived) == 1
    assert by_id["open-1"].prompt == Prompt("k1", (1, 2, 3), label={"answer": 4}, env_name="math")
    assert by_id["open-1"].policy_version_at_start == 2
    assert by_id["open-empty"].missing == 2
    assert new.counters == sink.counters
    # new work arrives after the restore; the restored samples still ship first
    new.add_group(make_group([1.0, 0.0], version=3))
    batch = await new.take_batch()
    assert [s.sample_index for s in batch.samples] == restored_ids
    # the resumed group completes with the arrived member plus regenerated ones, same id
    r = by_id["open-1"]
    regenerated = [make_sample(9, x, version=4) for x in (0.0, 0.5, 0.25)]
    new.add_group(Group(r.group_id, r.prompt, [*r.arrived, *regenerated], 2))
    assert new.window.attempts == 4
    assert sum(1 for s in new.queued_samples() if s.group_id == "open-1") == 4
    assert_accounted(new)


def _open_state(members: list[Any], group_size: int, step: int = 1) -> SinkState:
    return SinkState(
        step=step,
        next_arrival=0,
        counters=attrs.evolve(
            TrainSink(SinkConfig(batch_size=1)).counters, dispatched=len(members)
        ),
        window=TrainSink(SinkConfig(batch_size=1)).window,
        queued=(),
        open_groups=(OpenGroup("full", Prompt("k", (1, 2)), group_size, members, 0),),
    )


@pytest.mark.parametrize("extra", [0, 1])
async def test_defect1_full_resumed_group_dispatches_nothing_and_scores_once(
    tmp_path: Path, extra: int
) -> None:
    members = [make_sample(0, float(i % 2), version=0) for i in range(4 + extra)]
    mgr = CheckpointManager(tmp_path)
    from trio_rl.sink import CheckpointSnapshot

    state = _open_state(members, 4)
    snap = CheckpointSnapshot(step=0, progress={}, cursor=None, sink=state)
    if extra:
        # a checkpoint never holds an over-full open group: the writer refuses what the reader
        # would, and nothing reaches the directory ...
        with pytest.raises(CheckpointError, match=r"sink\.open_groups\[0\]\.members: 5 members"):
            await mgr.save(snap)
        assert mgr.list_checkpoints() == []
        assert not any(tmp_path.iterdir())  # noqa: ASYNC240 - a listing of an empty directory
    else:
        await mgr.save(snap)
        ck = await mgr.load_latest()
        assert ck is not None
        state = ck.sink
    # ... while the sink itself still scores such a group once, with exactly its members
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    report = sink.load_state_dict(state)
    # no resumed request at all for the full group, hence no zero-rollout request
    assert report.resumed == []
    assert report.completed_groups == ["full"]
    assert sink.open_group_ids() == []
    # scored exactly once, with exactly its members
    assert sink.window.groups == 1
    assert sink.window.attempts == len(members)
    queued = sink.queued_samples()
    assert sorted(s.sample_index for s in queued) == sorted(m.index for m in members)
    rewards = [float(i % 2) for i in range(len(members))]
    mean = sum(rewards) / len(rewards)
    assert [s.advantages[-1] for s in queued] == [r - mean for r in rewards]  # type: ignore[index]
    assert_accounted(sink)


def test_defect1_only_groups_with_members_missing_are_handed_back() -> None:
    """Beside a full group, a partial one: only the partial one is resumed, and for exactly
    the members it lacks (never a zero-rollout request)."""
    full = [make_sample(0, float(i % 2), version=0) for i in range(4)]
    partial = [make_sample(1, 1.0, version=0)]
    state = attrs.evolve(
        _open_state(full, 4),
        counters=attrs.evolve(
            TrainSink(SinkConfig(batch_size=1)).counters, dispatched=len(full) + len(partial)
        ),
        open_groups=(
            OpenGroup("full", Prompt("k", (1, 2)), 4, full, 0),
            OpenGroup("partial", Prompt("j", (3, 4)), 4, partial, 0),
        ),
    )
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    report = sink.load_state_dict(state)
    assert report.completed_groups == ["full"]
    assert [(r.group_id, r.missing) for r in report.resumed] == [("partial", 3)]
    assert sink.open_group_ids() == ["partial"]
    assert_accounted(sink)


async def test_defect2_stale_members_count_in_the_attempt_budget(tmp_path: Path) -> None:
    # batch 5, m = 2: min fresh version = 2; members at v2 are fresh now, stale from batch 6.
    # Judged per token: the group started at v2, but its members regenerated at v5 are fresh.
    cfg = SinkConfig(batch_size=2, max_off_policy_steps=2, staleness="oldest_token")
    sink = TrainSink(cfg, step=5)
    sink.open_group("g", Prompt("k", (1, 2)), 4, policy_version_at_start=2)
    old = [make_sample(0, r, version=2) for r in (1.0, 0.0)]
    for m in old:
        sink.add_member("g", m)
    mgr = CheckpointManager(tmp_path)
    ck = await mgr.load(await mgr.save(mgr.snapshot(sink)))
    resumed_sink = TrainSink(cfg)
    report = resumed_sink.load_state_dict(ck.sink)
    (resumed,) = report.resumed
    assert (resumed.group_id, resumed.missing, len(resumed.arrived)) == ("g", 2, 2)
    # meanwhile batch 5 ships, so the two restored members go stale
    resumed_sink.add_group(make_group([1.0, 0.0], version=4))
    await resumed_sink.take_batch()
    assert resumed_sink.step == 6
    before = resumed_sink.counters
    fresh = [make_sample(0, r, version=5) for r in (3.0, 1.0)]
    resumed_sink.add_group(Group("g", resumed.prompt, [*resumed.arrived, *fresh], 2))
    w = resumed_sink.window
    assert w.attempts == 4
    assert w.groups == 1
    assert resumed_sink.counters.stale - before.stale == 2
    scored = [s for s in resumed_sink.queued_samples() if s.group_id == "g"]
    assert sorted(s.sample_index for s in scored) == sorted(m.index for m in fresh)
    assert sorted(s.advantages[-1] for s in scored) == [-1.0, 1.0]  # type: ignore[index]
    assert_accounted(resumed_sink)


async def test_defect3_sweep_keeps_restored_queued_payloads(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path / "payload")
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None), step=3)
    group = make_group([1.0, 0.0], version=2)
    rows = np.arange(2 * 7, dtype=np.int32).reshape(7, 2)
    for s in group.samples:
        s.payload = tuple(store.write_request(2, {"routed_experts": rows}))
    sink.add_group(group)
    mgr = CheckpointManager(tmp_path / "ckpt", payload_root=store.root)
    ck = await mgr.load(await mgr.save(mgr.snapshot(sink)))
    assert ck.missing_files == frozenset()
    restored = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    report = restored.load_state_dict(ck.sink, missing_files=ck.missing_files)
    assert report.queued == 2
    assert report.resumed == []
    # nothing else is live; the restored queue alone must protect v2
    assert store.sweep_orphans(restored.live_payload_versions(), current_version=5) == []
    assert store.versions_on_disk() == [2]
    batch = await restored.take_batch(force=True)
    for t in batch.samples:  # the trainer's read succeeds
        out = store.read_field(t.payload, "routed_experts", 0, t.num_tokens)
        np.testing.assert_array_equal(out, rows)
    files = set().union(*(segment_files(s.payload) for s in batch.samples))
    assert store.delete_files(files) == 2
    restored.mark_read(batch.step)
    assert store.sweep_orphans(restored.live_payload_versions(), current_version=5) == [2]


async def test_restore_drops_work_whose_payload_files_are_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PayloadStore(tmp_path / "payload")
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    group = make_group([1.0, 0.0, 0.25], version=1)
    for s in group.samples:
        s.payload = tuple(store.write_request(1, {"routed_experts": np.ones((7, 1), np.int32)}))
    sink.add_group(group)
    sink.open_group("open", Prompt("k", (1, 2, 3)), 3, 1)
    members = [make_sample(0, r, version=1) for r in (1.0, 0.0)]
    for m in members:
        m.payload = tuple(store.write_request(1, {"routed_experts": np.ones((7, 1), np.int32)}))
        sink.add_member("open", m)
    mgr = CheckpointManager(tmp_path / "ckpt", payload_root=store.root)
    path = await mgr.save(mgr.snapshot(sink))
    # the trainer read and deleted one queued sample's files and one member's after the save
    store.delete_files(segment_files(group.samples[0].payload))
    store.delete_files(segment_files(members[1].payload))
    ck = await mgr.load(path)
    assert len(ck.missing_files) == 2
    restored = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    with caplog.at_level(logging.WARNING, logger="trio_rl.sink"):
        report = restored.load_state_dict(ck.sink, missing_files=ck.missing_files)
    assert "dropped 1 queued samples with missing payload files" in caplog.text
    assert (report.dropped_queued_missing, report.dropped_members_missing) == (1, 1)
    assert report.queued == 2
    (r,) = report.resumed
    assert r.missing == 2
    assert [m.index for m in r.arrived] == [members[0].index]
    assert_accounted(restored)
    # an inline run (no payload root) loses nothing
    inline = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    rep2 = inline.load_state_dict((await CheckpointManager(tmp_path / "ckpt").load(path)).sink)
    assert rep2.queued == 3
    assert rep2.resumed[0].missing == 1


async def test_restore_filters_stale_work(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=1), step=2)
    sink.add_group(make_group([1.0, 0.0], version=0))
    sink.open_group("g", Prompt("k", (1,)), 2, 0)
    sink.add_member("g", make_sample(0, 1.0, version=0))
    mgr = CheckpointManager(tmp_path)
    ck = await mgr.load(await mgr.save(mgr.snapshot(sink)))
    # resuming at a later step makes v0 stale: (4 - 1) - 1 = 2 > 0
    state = attrs.evolve(ck.sink, step=4)
    restored = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=1))
    report = restored.load_state_dict(state)
    assert (report.dropped_queued_stale, report.dropped_members_stale, report.queued) == (2, 1, 0)
    assert report.resumed[0].missing == 2
    assert_accounted(restored)


def test_failed_member_status_roundtrips() -> None:
    s = make_sample(0, 0.0, status=SampleStatus.TRUNCATED)
    from trio_rl.sink._codec import decode_sample, encode_sample

    back = decode_sample(encode_sample(s), "m")
    assert attrs.asdict(back) == attrs.asdict(s)
