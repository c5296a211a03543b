"""Property: whatever the order of adds, cuts, checkpoints, restores (from any earlier
checkpoint), trainer reads and sweeps, every dispatched sample is accounted exactly once and no
live payload file is ever swept.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from builders import make_sample
from trio_rl.payloads import PayloadStore, segment_files
from trio_rl.samples import Group, OpenGroup, Prompt, Sample, SampleStatus, new_group_id
from trio_rl.sink import (
    CheckpointManager,
    PruneMode,
    SinkConfig,
    TrainBatch,
    TrainSink,
    decode_checkpoint,
    encode_checkpoint,
    prune_detached,
)
from trio_rl.sink._sink_state import payload_files_of_state

REWARDS = st.sampled_from([0.0, 0.5, 1.0])


class SinkMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="trio-rl-sink-"))
        self.store = PayloadStore(self.dir)
        self.mgr = CheckpointManager(self.dir / "ckpt")
        self.saved: list[tuple[bytes, int]] = []
        self.unread: list[TrainBatch] = []
        self.resumed: list[OpenGroup] = []
        self.dispatched = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize(
        prune=st.sampled_from(list(PruneMode)),
        max_off=st.sampled_from([None, 0, 1]),
        tokens=st.booleans(),
    )
    def setup(self, prune: PruneMode, max_off: int | None, tokens: bool) -> None:
        size = {"token_batch_size": 20} if tokens else {"batch_size": 3}
        self.config = SinkConfig(**size, max_off_policy_steps=max_off, prune=prune)  # type: ignore[arg-type]
        self.sink = TrainSink(self.config)

    @property
    def version(self) -> int:
        return self.sink.step - 1

    def _member(self, reward: float, lag: int, by_handle: bool, status: SampleStatus) -> Sample:
        v = max(0, self.version - lag)
        s = make_sample(0, reward, version=v, completion=2, status=status)
        if by_handle and status.is_finished:
            s.payload = tuple(
                self.store.write_request(v, {"routed_experts": np.full((5, 1), s.index, np.int32)})
            )
        return s

    @rule(
        rewards=st.lists(REWARDS, min_size=1, max_size=4),
        lag=st.integers(0, 3),
        by_handle=st.booleans(),
        failed=st.booleans(),
    )
    def add_group(self, rewards: list[float], lag: int, by_handle: bool, failed: bool) -> None:
        statuses = [SampleStatus.COMPLETED] * len(rewards)
        if failed:
            statuses[0] = SampleStatus.FAILED
        samples = [
            self._member(r, lag, by_handle, st_) for r, st_ in zip(rewards, statuses, strict=True)
        ]
        g = Group(new_group_id(), Prompt("k", (1, 2, 3)), samples, max(0, self.version - lag))
        self.sink.add_group(g)
        self.dispatched += len(samples)

    @rule(size=st.integers(1, 3), reward=REWARDS, by_handle=st.booleans())
    def open_group_with_member(self, size: int, reward: float, by_handle: bool) -> None:
        gid = new_group_id()
        self.sink.open_group(gid, Prompt("k", (1, 2, 3)), size, self.version)
        self.sink.add_member(gid, self._member(reward, 0, by_handle, SampleStatus.COMPLETED))
        self.dispatched += 1

    @precondition(lambda self: bool(self.sink.open_group_ids()))
    @rule(data=st.data(), reward=REWARDS, by_handle=st.booleans(), fail=st.booleans())
    def member_arrives(
        self, data: st.DataObject, reward: float, by_handle: bool, fail: bool
    ) -> None:
        gid = data.draw(st.sampled_from(self.sink.open_group_ids()))
        if fail:
            self.sink.record_failed(1, group_id=gid)
        else:
            self.sink.add_member(gid, self._member(reward, 0, by_handle, SampleStatus.COMPLETED))
        self.dispatched += 1

    @precondition(lambda self: bool(self.resumed))
    @rule(rewards=st.lists(REWARDS, min_size=3, max_size=3), by_handle=st.booleans())
    def resumed_group_completes(self, rewards: list[float], by_handle: bool) -> None:
        r = self.resumed.pop(0)
        # `r` is the book's own record: members that arrived since the restore are in it
        if r.group_id not in self.sink.open_group_ids():
            return  # completed member by member already
        assert r.missing > 0  # an open group always waits for someone
        new = [
            self._member(rewards[i % 3], 0, by_handle, SampleStatus.COMPLETED)
            for i in range(r.missing)
        ]
        self.sink.add_group(
            Group(r.group_id, r.prompt, [*r.arrived, *new], r.policy_version_at_start)
        )
        self.dispatched += len(new)

    @rule(n=st.integers(0, 2))
    def stray_cancellations(self, n: int) -> None:
        self.sink.record_cancelled(n)
        self.dispatched += n

    @rule(force=st.booleans())
    def take(self, force: bool) -> None:
        if not (self.sink.ready() or (force and self.sink.queued)):
            return
        detached = self.sink.detach_batch(force=force)
        result = (
            prune_detached(detached.samples)
            if self.config.prune is PruneMode.AFTER_SELECTION
            else None
        )
        batch = self.sink.settle_batch(detached, result)
        if batch.samples:
            self.unread.append(batch)

    @rule()
    def checkpoint(self) -> None:
        self.saved.append((encode_checkpoint(self.mgr.snapshot(self.sink)), self.dispatched))

    @precondition(lambda self: bool(self.saved))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        blob, dispatched = data.draw(st.sampled_from(self.saved))
        ck = decode_checkpoint(blob)
        missing = {f for f in payload_files_of_state(ck.sink) if not self.store.path(f).exists()}
        self.sink = TrainSink(self.config)
        report = self.sink.load_state_dict(ck.sink, missing_files=missing)
        self.dispatched = dispatched
        self.unread = []  # the trainer restarts from the checkpoint too
        self.resumed = list(report.resumed)
        # never a zero-rollout request: a resumed group handed back waits for a member
        assert all(r.missing > 0 for r in self.resumed)

    @precondition(lambda self: bool(self.unread))
    @rule()
    def trainer_reads_and_deletes(self) -> None:
        batch = self.unread.pop(0)
        files: set[str] = set()
        for s in batch.samples:
            if s.payload:
                out = self.store.read_field(s.payload, "routed_experts", 0, s.num_tokens)
                assert out is not None
                assert (out[: min(5, s.num_tokens), 0] == s.sample_index).all()
                files |= segment_files(s.payload)
        self.store.delete_files(files)
        self.sink.mark_read(batch.step)

    @rule()
    def sweep(self) -> None:
        self.store.sweep_orphans(self.sink.live_payload_versions(), current_version=self.version)

    @invariant()
    def everything_accounted_once(self) -> None:
        if not hasattr(self, "sink"):
            return
        c = self.sink.counters
        assert c.dispatched == self.dispatched
        assert c.dispatched == c.settled + self.sink.held, (c, self.sink.held)

    @invariant()
    def nothing_live_was_swept(self) -> None:
        if not hasattr(self, "sink"):
            return
        live = payload_files_of_state(self.sink.state_dict())
        for b in self.unread:
            for s in b.samples:
                live |= segment_files(s.payload)
        for r in self.resumed:
            for m in r.arrived:
                live |= {seg.file for seg in m.payload}
        for f in live:
            assert self.store.path(f).exists(), f


SinkMachine.TestCase.settings = settings(stateful_step_count=30)
TestSinkMachine = SinkMachine.TestCase
