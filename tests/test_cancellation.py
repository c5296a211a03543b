"""Cancellation across layers: one home for the tests in which a cancellation crosses from one
layer of trio-rl into another (as trio's ``_core/_tests/test_cancel.py`` is for trio).

Each test cancels a caller while work it started runs in a lower layer, and checks what the
layers' cancellation paragraphs promise: nothing is lost or counted twice, nothing is left
running, and the work a worker thread was given finishes (it is never abandoned) before
`trio.Cancelled` arrives. A layer's own cancellation tests (a transport's receive, the sink's
cut, a driver's close) stay with that layer's tests.

- the publisher over the train sink and a transport: a cut cancelled while pruning, a publish
  cancelled in a worker job (packing, encoding, a checkpoint write, a memory release), and the
  owner cancelled while a release runs;
- the trainer's batch receiver over a transport and the wire decoder: receives cancelled while
  they wait, read or decode lose no step;
- the orchestrator over the rollout layer: a resume cancelled by its first sample stops
  starting the samples of a huge group at its next batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from builders import (
    RESUME_PROMPTS,
    Releases,
    grid,
    make_group,
    make_sink,
    one_per_sample_packer,
    open_one_prompt_orchestrator,
    resume_watchdog,
    write_open_groups_checkpoint,
)
from trio_rl.publish import open_publisher, release_containers
from trio_rl.rollout._group import START_BATCH
from trio_rl.samples import OpenGroup, Sample
from trio_rl.sink import PruneMode, TrainingSample
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import FileReceiver, FileSender, batch_path
from trio_rl.wire import MicroBatch, encode

# --------------------------------------------------------------------------- publish over train


async def test_cancelled_while_pruning_the_publisher_cuts_like_take_batch(tmp_path: Path) -> None:
    # One cutter: the publisher goes through TrainSink.cut, whose pruning worker is waited for
    # (shielded) and whose result is counted: pruned samples count as pruned, survivors go back.
    sink = make_sink(batch_size=4, prune=PruneMode.AFTER_SELECTION)
    # zero advantages: pruned after selection
    sink.add_group(make_group([1.0, 1.0], group_id="flat", prompt_len=2))
    sink.add_group(make_group([1.0, 0.0], group_id="live", prompt_len=2))
    limiter = trio.CapacityLimiter(1)
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(1), limiter=limiter) as pub,
    ):
        with trio.fail_after(10):
            await limiter.acquire()  # the pruning worker waits for this token
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pub.publish)
                await trio.testing.wait_all_tasks_blocked()
                assert sink.queued == 0  # detached
                nursery.cancel_scope.cancel()
                limiter.release()
        assert pub.step == sink.step == 1
        assert sink.counters.pruned == 2
        assert sink.queued == 2
        assert [s.group_id for s in sink.queued_samples()] == ["live", "live"]
        sink.add_group(make_group([1.0, 0.0], group_id="live2", prompt_len=2))
        record = await pub.publish()
    assert record is not None
    assert record.effective.samples == 4
    assert sink.counters.shipped == 4
    assert sink.counters.dispatched == sink.counters.settled == 6


@pytest.mark.parametrize("where", ["pack", "encode"])
async def test_cancelling_during_finalize_puts_the_batch_back_and_releases_nothing_extra(
    tmp_path: Path, where: str
) -> None:
    sink = make_sink(batch_size=2, groups=2)
    releases = Releases()
    entered = threading.Event()
    unblock = threading.Event()
    base = one_per_sample_packer(1)
    calls = {"pack": 0, "encode": 0}

    def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
        calls["pack"] += 1
        if where == "pack" and calls["pack"] == 2:
            entered.set()
            unblock.wait(30)
        return base(samples)

    def enc(mbs: Sequence[MicroBatch]) -> bytes:
        from trio_rl.wire import encode

        calls["encode"] += 1
        if where == "encode" and calls["encode"] == 2:
            entered.set()
            unblock.wait(30)
        return encode(mbs)

    with trio.CancelScope() as outer:
        async with (
            FileSender(tmp_path, world_size=1, fsync=False) as sender,
            open_publisher(sink, sender, pack=pack, encode=enc, release=releases) as pub,
            trio.open_nursery() as nursery,
        ):
            await pub.publish()

            async def cancel_when_entered() -> None:
                await trio.to_thread.run_sync(entered.wait)
                outer.cancel()
                unblock.set()  # the worker is never abandoned: it finishes, then Cancelled

            nursery.start_soon(cancel_when_entered)
            await pub.publish()
            pytest.fail("the second publish should have been cancelled")
    assert outer.cancelled_caught
    assert pub.step == 2
    assert sink.queued == 2  # the second batch went back to the queue
    assert sink.held == 2
    assert not batch_path(tmp_path, 2, 0).exists()
    assert len(releases.calls) == 1  # the first batch's, and only once
    assert pub.release.completed == 1


async def test_cancelling_the_owner_during_a_release_neither_orphans_nor_repeats_it(
    tmp_path: Path,
) -> None:
    sink = make_sink(batch_size=2, groups=1)
    releases = Releases(gated=True)
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as outer:

            async def cancel_then_let_release_finish() -> None:
                await trio.to_thread.run_sync(releases.started.wait)
                outer.cancel()
                await trio.sleep(0.02)  # teardown is now waiting (shielded) for the release
                assert releases.gate.is_set() is False
                releases.gate.set()

            nursery.start_soon(cancel_then_let_release_finish)
            async with (
                FileSender(tmp_path, world_size=1, fsync=False) as sender,
                open_publisher(
                    sink, sender, pack=one_per_sample_packer(1), release=releases
                ) as pub,
            ):
                await pub.publish()
                await trio.sleep_forever()
        # the publisher block exited only after the release had run to completion
        assert pub.release.completed == 1
        assert not pub.release.pending
    assert outer.cancelled_caught
    assert len(releases.calls) == 1
    assert releases.max_active == 1


@given(
    groups=st.integers(1, 6),
    batch_size=st.integers(1, 4),
    world_size=st.integers(1, 3),
    cancel_at=st.integers(0, 30),
)
def test_cancellation_at_any_worker_job_keeps_releases_and_accounting_exact(
    tmp_path_factory: pytest.TempPathFactory,
    groups: int,
    batch_size: int,
    world_size: int,
    cancel_at: int,
) -> None:
    """Cancel the publisher's owner at the ``cancel_at``-th worker job (pack, encode,
    checkpoint write, release): every shipped batch is released exactly once and checkpointed
    once, no unshipped batch is, and every sample is shipped or back in the queue."""
    tmp_path = tmp_path_factory.mktemp("cancel")
    sink = make_sink(batch_size=batch_size, groups=groups)
    total = sink.queued
    base = one_per_sample_packer(world_size)
    releases: list[int] = []
    jobs = 0
    shipped_steps: list[int] = []
    checkpoints: list[int] = []
    pending: list[int] = []

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        scope = trio.CancelScope()

        def job() -> None:
            nonlocal jobs
            jobs += 1
            if jobs == cancel_at:
                trio.from_thread.run_sync(scope.cancel, trio_token=token)

        def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
            job()
            return base(samples)

        def enc(mbs: Sequence[MicroBatch]) -> bytes:
            from trio_rl.wire import encode

            job()
            return encode(mbs)

        def release(containers: Sequence[Any]) -> None:
            job()
            releases.append(len(containers[0]))
            release_containers(containers)

        class Checkpoints:
            def snapshot(self, step: int) -> int:
                return step

            def write(self, step: int) -> None:
                job()
                checkpoints.append(step)

        with scope:
            async with (
                FileSender(tmp_path, world_size=world_size, fsync=False) as sender,
                open_publisher(
                    sink, sender, pack=pack, encode=enc, release=release, checkpointer=Checkpoints()
                ) as pub,
            ):
                try:
                    while True:
                        record = await pub.publish(force=True)
                        if record is None:
                            break
                        shipped_steps.append(record.step)
                finally:
                    pending.extend(pub.pending_steps)

    trio.run(main)
    shipped = sink.step - 1
    assert shipped_steps == list(range(1, len(shipped_steps) + 1))
    assert len(shipped_steps) in (shipped, shipped - 1)  # the last may be cancelled after send
    assert len(releases) == shipped  # exactly once per shipped batch
    assert checkpoints == list(range(1, shipped + 1))  # and one checkpoint per shipped step
    assert sum(releases) == sink.counters.shipped
    assert sink.counters.shipped + sink.queued == total
    assert sink.held == sink.queued  # nothing stuck in a cut
    # a step settled (and checkpointed) whose send was cancelled stays pending, to be re-sent
    assert set(pending) <= {shipped}
    for step in range(1, shipped + 1):
        assert batch_path(tmp_path, step, 0).exists() != (step in pending)
    assert not batch_path(tmp_path, shipped + 1, 0).exists()


# --------------------------------------------------------------------------- trainer over transport


async def test_cancelled_receives_lose_no_step(tmp_path: Path) -> None:
    """Receives (waiting, reading, decoding in a thread) cancelled by tiny timeouts: every step
    still arrives exactly once, in order, even though each file is deleted once read."""
    steps = 25
    sent = [grid(s, 1, per_rank=3, tokens=2048)[0] for s in range(steps)]
    transport = FileReceiver(tmp_path, 0, delete=True, poll_interval=0.0005)
    got: list[int] = []
    cancelled = 0
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        BatchReceiver(transport, thread_threshold=1024) as receiver,
        trio.open_nursery() as nursery,
    ):

        async def send_all() -> None:
            for s in range(steps):
                await sender.send(s, [encode(sent[s])])
                await trio.sleep(0.002)  # make some receives wait, to be cancelled

        nursery.start_soon(send_all)
        with trio.fail_after(60):
            while len(got) < steps:
                with trio.move_on_after(0.0003) as scope:
                    step, micro_batches = await receiver.receive()
                    assert micro_batches == sent[step]
                    got.append(step)
                cancelled += scope.cancelled_caught
    assert got == list(range(steps))
    assert cancelled > 0


async def test_cancellation_reaches_the_start_of_a_huge_group(tmp_path: Path) -> None:
    """The group's sample tasks start in batches: the first sample to run cancels the resume,
    and the loop starting the others stops at its next batch (not after all of them)."""
    size = 20_000
    write_open_groups_checkpoint(
        tmp_path / "ckpt",
        [OpenGroup("g-0", RESUME_PROMPTS[0], size)],
        samples_made=0,
        groups_made=1,
    )
    calls = 0
    scope = trio.CancelScope()

    async def generate(sample: Sample) -> None:
        nonlocal calls
        calls += 1
        scope.cancel()
        await trio.sleep_forever()

    with resume_watchdog(), scope:
        async with open_one_prompt_orchestrator(tmp_path, size, generate=generate) as orch:  # type: ignore[attr-defined]
            await orch.run(1)
    assert scope.cancelled_caught
    # the samples of the few batches started before the cancellation was seen, not 20,000
    assert 1 <= calls <= 8 * START_BATCH < size, calls
