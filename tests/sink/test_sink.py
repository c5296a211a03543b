"""The train sink: ingest, staleness, readiness and cut, pruning modes, accounting."""

from __future__ import annotations

import logging
import threading

import pytest
import trio
import trio.testing
from sink_helpers import assert_accounted

from builders import make_group, make_sample
from trio_rl.samples import Group, Prompt, SampleStatus
from trio_rl.sink import (
    PruneMode,
    ScoringConfig,
    SequenceLists,
    SinkConfig,
    TrainSink,
    TrainSinkError,
)
from trio_rl.sink import _sink as _sink_module
from trio_rl.sink._scoring import build_sequences


def sink(**kw: object) -> TrainSink:
    kw.setdefault("batch_size", 4)
    return TrainSink(SinkConfig(**kw))  # type: ignore[arg-type]


def test_config_needs_exactly_one_batch_size() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SinkConfig()
    with pytest.raises(ValueError, match="exactly one"):
        SinkConfig(batch_size=2, token_batch_size=10)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        SinkConfig(batch_size=0)


async def test_group_is_scored_queued_and_cut_at_batch_size() -> None:
    s = sink(scoring=ScoringConfig(temperature=0.6))
    s.add_group(make_group([1.0, 0.0, 1.0, 0.0]))
    assert s.queued == 4
    assert s.ready()
    batch = await s.take_batch()
    assert batch.step == 1
    assert s.step == 2
    assert [x.advantages[-1] for x in batch.samples] == [0.5, -0.5, 0.5, -0.5]  # type: ignore[index]
    assert all(x.temperatures == [0.6] * x.num_tokens for x in batch.samples)
    assert batch.window is not None
    assert (batch.window.attempts, batch.window.groups, batch.window.shipped) == (4, 1, 4)
    assert batch.window.reward_mean == 0.5
    assert s.counters.shipped == 4
    assert_accounted(s)


async def test_not_ready_cut_is_an_error_and_changes_nothing() -> None:
    s = sink()
    s.add_group(make_group([1.0, 0.0]))
    assert not s.ready()
    with pytest.raises(TrainSinkError, match="not ready"):
        await s.take_batch()
    assert s.queued == 2
    forced = await s.take_batch(force=True)
    assert len(forced.samples) == 2


def test_zero_advantage_group_pruned_before_queueing() -> None:
    s = sink()
    s.add_group(make_group([1.0, 1.0, 1.0, 1.0]))
    assert s.queued == 0
    assert s.counters.pruned == 4
    assert s.window.attempts == 4
    assert_accounted(s)


async def test_cut_takes_oldest_version_first_stable_on_arrival() -> None:
    s = sink(batch_size=3, max_off_policy_steps=None)
    g_new = make_group([1.0, 0.0], version=5)
    g_old = make_group([1.0, 0.0], version=2)
    g_new2 = make_group([0.0, 1.0], version=5)
    for g in (g_new, g_old, g_new2):
        s.add_group(g)
    batch = await s.take_batch()
    got = [(x.policy_version, x.sample_index) for x in batch.samples]
    assert got == [
        (2, g_old.samples[0].index),
        (2, g_old.samples[1].index),
        (5, g_new.samples[0].index),
    ]
    rest = [(x.policy_version, x.sample_index) for x in s.queued_samples()]
    assert rest == [
        (5, g_new.samples[1].index),
        (5, g_new2.samples[0].index),
        (5, g_new2.samples[1].index),
    ]


async def test_token_batch_includes_the_crossing_sample() -> None:
    s = TrainSink(SinkConfig(token_batch_size=20))
    s.add_group(make_group([1.0, 0.0], completion=5))  # 8 tokens each
    assert not s.ready()
    s.add_group(make_group([1.0, 0.0], completion=5))
    assert s.ready()  # 32 tokens
    batch = await s.take_batch()
    assert [x.num_tokens for x in batch.samples] == [8, 8, 8]
    assert s.queued_tokens == 8


def test_staleness_boundary_and_once_per_step_sweep(caplog: pytest.LogCaptureFixture) -> None:
    # batch S=12 with m=2: min fresh version (12 - 1) - 2 = 9; v=8 is stale, v=9 is not
    s = TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=2), step=12)
    s.add_group(make_group([1.0, 0.0], version=9))
    s.add_group(make_group([1.0, 0.0], version=8))  # stale on insertion (scoring)
    assert s.queued == 2
    assert s.counters.stale == 2
    # a queued sample goes stale when the step moves on; the sweep at the readiness check drops it
    s.queue.step = 13  # simulate a shipped batch elsewhere
    with caplog.at_level(logging.WARNING, logger="trio_rl.sink"):
        assert not s.ready()
    assert s.queued == 0
    assert s.counters.stale == 4
    assert "dropped 2 queued samples" in caplog.text
    assert_accounted(s)


def test_early_steps_never_stale() -> None:
    s = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=0), step=1)
    s.add_group(make_group([1.0, 0.0], version=0))
    assert s.ready()


async def test_all_pruned_cut_keeps_step_and_window() -> None:
    s = sink(batch_size=2, prune=PruneMode.AFTER_SELECTION)
    s.add_group(make_group([1.0, 1.0]))
    assert s.queued == 2  # not pruned before queueing in this mode
    before = s.window
    batch = await s.take_batch()
    assert batch.samples == []
    assert batch.window is None
    assert s.step == 1
    # the window is kept (it also records the pruning) and goes out with the next batch
    assert s.window.attempts == before.attempts == 2
    assert s.window.pruned == 2
    assert s.counters.pruned == 2
    s.add_group(make_group([1.0, 0.0]))
    batch = await s.take_batch()
    assert len(batch.samples) == 2
    assert s.step == 2
    assert batch.window is not None
    assert batch.window.attempts == 4
    assert batch.window.pruned == 2
    assert_accounted(s)


async def test_after_selection_batch_may_shrink() -> None:
    s = sink(batch_size=4, prune=PruneMode.AFTER_SELECTION)
    s.add_group(make_group([2.0, 2.0]))
    s.add_group(make_group([1.0, 0.0]))
    batch = await s.take_batch(limiter=trio.CapacityLimiter(1))
    assert len(batch.samples) == 2
    assert s.counters.pruned == 2
    assert s.counters.shipped == 2
    assert_accounted(s)


async def test_cancelled_while_pruning_requeues_survivors() -> None:
    s = sink(batch_size=4, prune=PruneMode.AFTER_SELECTION)
    s.add_group(make_group([2.0, 2.0]))
    s.add_group(make_group([1.0, 0.0]))
    order = [x.arrival for x in s.queued_samples()]
    with trio.CancelScope() as scope:
        scope.cancel()  # already cancelled: the first checkpoint raises, nothing detached
        await s.take_batch()
    assert s.queued == 4
    limiter = trio.CapacityLimiter(1)
    async with trio.open_nursery() as nursery:

        async def cut() -> None:
            await s.take_batch(limiter=limiter)

        async with limiter:
            nursery.start_soon(cut)
            await trio.testing.wait_all_tasks_blocked()
            assert s.held == 4  # detached samples are still held (in the cut)
            nursery.cancel_scope.cancel()
    assert s.step == 1
    assert [x.arrival for x in s.queued_samples()] == order[2:]
    assert s.counters.pruned == 2
    assert s.counters.shipped == 0
    assert_accounted(s)


def test_failed_aborted_and_unfinished_members() -> None:
    s = sink()
    g = make_group(
        [1.0, 0.0, 0.0],
        statuses=[SampleStatus.COMPLETED, SampleStatus.FAILED, SampleStatus.TRUNCATED],
    )
    s.add_group(g)
    assert s.counters.failed == 1
    assert s.queued == 2
    aborted = make_group([1.0, 0.0], statuses=[SampleStatus.COMPLETED, SampleStatus.ABORTED])
    s.add_group(aborted)
    assert s.counters.cancelled == 1
    assert s.counters.filtered == 1
    s.record_failed(3)
    s.record_cancelled(2)
    assert (s.counters.failed, s.counters.cancelled) == (4, 3)
    assert_accounted(s)


def test_untrainable_member_is_filtered() -> None:
    s = sink()
    g = make_group([1.0, 0.0])
    g.samples[0].loss_mask = [False] * len(g.samples[0].loss_mask)
    s.add_group(g)
    assert s.counters.filtered == 1
    assert s.queued == 1


def test_bad_group_is_rejected_without_changing_state() -> None:
    s = sink()
    s.add_group(make_group([1.0, 0.0]))
    before = (s.counters, s.window, s.queued)
    g = make_group([1.0, 0.0, 0.5])
    g.samples[2].logprobs = []
    with pytest.raises(TrainSinkError, match=r"sample \d+: logprobs has 0 entries"):
        s.add_group(g)
    pending = make_group([1.0, 0.0])
    pending.samples[1].status = SampleStatus.PENDING
    with pytest.raises(TrainSinkError, match="still pending"):
        s.add_group(pending)
    assert (s.counters, s.window, s.queued) == before


def test_members_arrive_one_by_one() -> None:
    s = sink()
    prompt = Prompt("k", (1, 2))
    s.open_group("g", prompt, 3, policy_version_at_start=0)
    a = make_sample(0, 1.0)
    s.add_member("g", a)
    with pytest.raises(TrainSinkError, match="arrived twice"):
        s.add_member("g", a)
    s.record_failed(1, group_id="g")
    assert s.open_group_ids() == ["g"]
    assert s.held == 1
    s.add_member("g", make_sample(0, 0.0))
    assert s.open_group_ids() == []
    assert s.queued == 2
    assert s.window.attempts == 3
    with pytest.raises(TrainSinkError, match="not open"):
        s.add_member("g", make_sample(0, 0.0))
    assert_accounted(s)


def test_whole_group_for_an_open_group_counts_held_members_once() -> None:
    s = sink()
    s.open_group("g", Prompt("k", (1, 2)), 4)
    first = [make_sample(0, 1.0), make_sample(0, 0.0)]
    for m in first:
        s.add_member("g", m)
    rest = [make_sample(0, 1.0), make_sample(0, 0.0)]
    s.add_group(Group("g", Prompt("k", (1, 2)), [*first, *rest]))
    assert s.counters.dispatched == 4
    assert s.queued == 4
    assert sorted(x.sample_index for x in s.queued_samples()) == sorted(
        m.index for m in first + rest
    )


def test_discard_queued_counts_cancelled() -> None:
    s = sink()
    s.add_group(make_group([1.0, 0.0]))
    assert s.discard_queued() == 2
    assert s.counters.cancelled == 2
    assert s.queued == 0
    assert_accounted(s)


async def test_live_payload_versions_cover_every_holder() -> None:
    s = sink(batch_size=2, max_off_policy_steps=None)
    s.add_group(make_group([1.0, 0.0], version=3))
    s.add_group(make_group([1.0, 0.0], version=4))
    s.open_group("open", Prompt("k", (1,)), 2, policy_version_at_start=6)
    s.add_member("open", make_sample(0, 1.0, version=5))
    assert s.live_payload_versions() == {3, 4, 5, 6}
    batch = await s.take_batch()
    assert {x.policy_version for x in batch.samples} == {3}
    assert 3 in s.live_payload_versions()  # shipped, not yet read
    s.mark_read(batch.step)
    assert s.live_payload_versions() == {4, 5, 6}


async def test_requeue_undoes_an_unshipped_cut() -> None:
    s = sink(batch_size=2, prune=PruneMode.AFTER_SELECTION)
    s.add_group(make_group([1.0, 1.0]))
    s.add_group(make_group([1.0, 0.0]))
    order = [x.arrival for x in s.queued_samples()]
    window = s.window
    detached = s.detach_batch()
    s.requeue_batch(detached)  # e.g. the send failed before pruning ran
    assert [x.arrival for x in s.queued_samples()] == order
    with pytest.raises(TrainSinkError, match="settled twice"):
        s.settle_batch(detached)
    detached = s.detach_batch()
    from trio_rl.sink import prune_detached

    s.requeue_batch(detached, prune_detached(detached.samples))  # pruned, then not shipped
    assert [x.arrival for x in s.queued_samples()] == order[2:]
    assert s.counters.pruned == 2
    assert s.step == 1
    assert s.window.attempts == window.attempts
    assert_accounted(s)


def _queued_view(sink: TrainSink) -> list[tuple[object, ...]]:
    return [
        (s.sample_index, s.token_ids, s.mask, s.logprobs, s.advantages, s.rl_weights, s.arrival)
        for s in sink.queued_samples()
    ]


async def test_ingest_group_builds_lists_in_a_worker_and_queues_what_add_group_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    groups = [make_group([1.0, 0.0, 0.5, 0.5], completion=50) for _ in range(3)]
    groups.append(make_group([1.0, 1.0, 1.0, 1.0], completion=50))  # all pruned
    on_loop, threaded = TrainSink(SinkConfig(batch_size=64)), TrainSink(SinkConfig(batch_size=64))
    main_thread = threading.get_ident()
    seen_threads: list[int] = []

    def spy(group: Group) -> dict[int, SequenceLists]:
        seen_threads.append(threading.get_ident())
        return build_sequences(group)

    # the name the sink module calls (imported there from the scoring module)
    monkeypatch.setattr(_sink_module, "build_sequences", spy)
    for g in groups:
        on_loop.add_group(g)
        await threaded.ingest_group(g, limiter=trio.CapacityLimiter(1))
    monkeypatch.undo()
    assert seen_threads
    assert main_thread not in seen_threads
    assert _queued_view(threaded) == _queued_view(on_loop)
    assert threaded.counters == on_loop.counters
    assert_accounted(threaded)


async def test_a_cancelled_ingest_still_adds_the_group() -> None:
    sink = TrainSink(SinkConfig(batch_size=64))
    group = make_group([1.0, 0.0], completion=20)
    with trio.CancelScope() as scope:
        scope.cancel()
        await sink.ingest_group(group)
        assert sink.queued == 2, "the group is in although the scope was cancelled"
        await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught, "the cancellation lands at the caller's next checkpoint"
    assert sink.queued == 2
    assert_accounted(sink)
