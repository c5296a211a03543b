"""The orchestrator end to end: real engine simulation, real files, real checkpoints."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from builders import WatchedCell, scripted_engine
from operations_waits import documented
from trio_rl import cli
from trio_rl.engines import Completion, GenerateRequest, SamplingParams, SimulatedEngine
from trio_rl.orchestrator import Orchestrator, OrchestratorConfig, open_orchestrator
from trio_rl.payloads import PayloadStore
from trio_rl.publish import Shipment
from trio_rl.rollout import FailurePolicy, InMemorySource, RolloutConfig, engine_generate
from trio_rl.samples import Group, OpenGroup, Prompt, Sample
from trio_rl.sink import SinkConfig
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import MemorySender

G = 4
T = 3


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(key=f"k{i}", tokens=(i, i + 1, 7)) for i in range(n)]


def _reward(sample: Sample) -> float:
    # distinct within every group, so no sample is pruned for a zero advantage
    return float(sample.index % G)


def _engine() -> SimulatedEngine:
    return SimulatedEngine(distribution="long-cot", slots=16, seed=3, seconds_per_token=1e-7)


def _config(**kw: object) -> OrchestratorConfig:
    base: dict[str, object] = {
        "batch_groups": T,
        "group_size": G,
        "max_async_level": 1000,
        "sampling": SamplingParams(max_tokens=64),
        "seed": 11,
        # no staleness filter: every sample these tests follow ships
        "sink": SinkConfig(batch_size=T * G, max_off_policy_steps=None),
    }
    base.update(kw)
    return OrchestratorConfig(**base)  # type: ignore[arg-type]


class _Recorder:
    """Maps group ids to prompt keys (via the group reward) and collects shipped samples."""

    def __init__(self) -> None:
        self.key_of: dict[str, str] = {}
        self.shipments: list[Shipment] = []

    def group_reward(self, group: Group) -> list[float]:
        self.key_of[group.group_id] = group.prompt.key
        # Distinct within the group by position (a resumed group's new members get fresh global
        # indices, so ``index % G`` could repeat and give one sample the mean: zero advantage).
        return [float(i) for i in range(len(group.samples))]

    def shipped_keys(self) -> list[str]:
        keys = []
        for shipment in self.shipments:
            gids = {s.group_id for s in shipment.samples}
            keys += [self.key_of[g] for g in gids]
        return keys


@contextlib.asynccontextmanager
async def _gated(rec: _Recorder, cell: WatchedCell) -> AsyncIterator[Orchestrator]:
    """An orchestrator whose ship gate waits for the policy (``max_async_level=0``), its
    version in ``cell``, over an engine that answers at once."""
    async with (
        MemorySender(1) as sender,
        open_orchestrator(
            scripted_engine(delay=0.0, version=0),
            InMemorySource(_prompts(100)),
            sender,
            config=_config(max_async_level=0),
            group_reward=rec.group_reward,
            monitor=rec.shipments.append,
            version=cell,
        ) as orch,
    ):
        yield orch


async def test_a_run_ships_every_step_to_every_rank_and_accounts_for_every_sample(
    tmp_path: Path,
) -> None:
    rec = _Recorder()
    received: dict[int, list[int]] = {0: [], 1: []}

    sender = MemorySender(2)

    async def rank(r: int) -> None:
        transport = sender.receiver(r, start_step=1)
        async with BatchReceiver(transport, stop_step=4) as batches:
            async for step, micro_batches in batches:
                assert micro_batches, "every rank gets at least one micro-batch"
                received[r].append(step)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rank, 0)
        nursery.start_soon(rank, 1)
        async with (
            sender,
            open_orchestrator(
                _engine(),
                InMemorySource(_prompts(100)),
                sender,
                config=_config(),
                checkpoint_dir=tmp_path / "ckpt",
                group_reward=rec.group_reward,
                monitor=rec.shipments.append,
            ) as orch,
        ):
            summary = await orch.run(3)

    assert (summary.first_step, summary.last_step) == (1, 3)
    assert [r.step for r in summary.records] == [1, 2, 3]
    assert received == {0: [1, 2, 3], 1: [1, 2, 3]}
    for shipment in rec.shipments:
        assert len(shipment.samples) == T * G
        counters = shipment.record.counters
        settled = sum(
            counters[k] for k in ("shipped", "pruned", "stale", "filtered", "failed", "cancelled")
        )
        assert settled <= counters["dispatched"]
    keys = rec.shipped_keys()
    assert len(keys) == len(set(keys)) == 3 * T
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[-1] == "step_00000003.ckpt"


@pytest.mark.parametrize("crash_after", [0.0, 0.01, 0.05, 0.2])
async def test_crashes_and_resumes_lose_no_prompt_and_ship_none_twice(
    tmp_path: Path, crash_after: float
) -> None:
    n_prompts = 10 * T
    rec = _Recorder()

    def open_run() -> object:
        # a fresh source object each time, restored from the checkpoint's cursor
        return open_orchestrator(
            _engine(),
            InMemorySource(_prompts(n_prompts)),
            sender,
            config=_config(),
            checkpoint_dir=tmp_path / "ckpt",
            group_reward=rec.group_reward,
            monitor=rec.shipments.append,
        )

    async with MemorySender(1) as sender:
        # two runs that crash at an arbitrary moment while work is in flight, then one to the end
        for _ in range(2):
            async with open_run() as orch:  # type: ignore[attr-defined]
                assert orch.step == len(rec.shipments) + 1
                await orch.run(1)
                with trio.move_on_after(crash_after):
                    await orch.run(2)
        async with open_run() as orch:  # type: ignore[attr-defined]
            assert orch.step == len(rec.shipments) + 1
            summary = await orch.run(100)
            assert summary.exhausted
            counters = orch.sink.counters

    keys = rec.shipped_keys()
    assert sorted(keys) == sorted(p.key for p in _prompts(n_prompts)), "each prompt ships once"
    assert counters.dispatched == counters.shipped == n_prompts * G


async def test_resumed_open_groups_keep_their_id(tmp_path: Path) -> None:
    rec = _Recorder()
    async with MemorySender(1) as sender:
        start = functools.partial(
            open_orchestrator,
            config=_config(),
            checkpoint_dir=tmp_path / "ckpt",
            group_reward=rec.group_reward,
            monitor=rec.shipments.append,
        )
        async with start(_engine(), InMemorySource(_prompts(60)), sender) as orch:
            await orch.run(1)
            held = orch.held_groups()  # the driver's own list, not a count
            assert held
            assert all(isinstance(g, OpenGroup) for g in held)
        assert orch.held_groups() == [], "no driver once the block is left"
        async with start(_engine(), InMemorySource(_prompts(60)), sender) as orch:
            restore = orch.restore
            assert restore is not None
            resumed_ids = {g.group_id for g in restore.resumed} | set(restore.completed_groups)
            assert (await orch.run(100)).exhausted
    shipped_ids = {s.group_id for sh in rec.shipments[1:] for s in sh.samples}
    assert resumed_ids, "work was in flight when the first run closed"
    assert resumed_ids <= shipped_ids, "a resumed group ships under its original id"


def test_cli_runs_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--steps", "2", "--out", str(tmp_path), "--batch-groups", "2"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert "step   1:" in first
    assert "step   2:" in first
    assert "accounting: dispatched" in first
    assert cli.main(args) == 0
    second = capsys.readouterr().out
    assert "resumed at step 3" in second
    assert "step   3:" in second
    assert "step   4:" in second


async def test_the_ship_gate_holds_a_batch_until_the_policy_catches_up(
    mock_clock: trio.testing.MockClock,
) -> None:
    """With ``max_async_level=0`` batch S ships only once the policy is at version S - 1; the
    time held is reported as policy wait, to the (virtual) second.

    The clock moves only when the test jumps it, and the engine answers at once, so the whole
    wait is the jump: exact, and no worker thread can race a deadline."""
    rec = _Recorder()
    cell = WatchedCell()
    async with _gated(rec, cell) as orch:
        await orch.run(1)  # batch 1 needs version 0: ships at once
        assert rec.shipments[0].record.policy_wait == 0.0
        assert cell.floors == []
        async with trio.open_nursery() as nursery:
            await cell.start_held(nursery, functools.partial(orch.run, 1))
            assert cell.floors == [1], "batch 2 waits for policy version 1"
            mock_clock.jump(3.0)  # less than the gate's 5 s warning interval
            await trio.testing.wait_all_tasks_blocked()
            assert len(rec.shipments) == 1, "held at the gate, time passing or not"
            orch.set_policy_version(1)
        assert [s.record.step for s in rec.shipments] == [1, 2]
        assert rec.shipments[1].record.policy_wait == 3.0
        with pytest.raises(ValueError, match="cannot go back"):
            orch.set_policy_version(0)


class _AbortingEngine:
    """A simulated engine whose every 9th request is aborted by the 'server'."""

    def __init__(self, inner: SimulatedEngine) -> None:
        self.inner = inner
        self.calls = 0

    async def generate(self, request: GenerateRequest) -> Completion:
        self.calls += 1
        completion = await self.inner.generate(request)
        if self.calls % 9 == 0:
            return attrs.evolve(completion, finish_reason="abort")
        return completion


async def test_failed_and_aborted_groups_are_booked_so_every_sample_settles_once(
    tmp_path: Path,
) -> None:
    engine = _AbortingEngine(
        SimulatedEngine(
            distribution="long-cot", slots=16, seed=5, seconds_per_token=1e-7, failure_rate=0.04
        )
    )
    async with (
        MemorySender(1) as sender,
        open_orchestrator(
            engine,
            InMemorySource(_prompts(200)),
            sender,
            config=_config(),
            sample_reward=_reward,
        ) as orch,
    ):
        # Which groups finish before a step ships depends on the real clock: run until both
        # kinds were booked (a few steps normally), and at most 30.
        for _ in range(30):
            await orch.run(1)
            if orch.sink.counters.failed and orch.sink.counters.cancelled:
                break
        c, sink = orch.sink.counters, orch.sink
        stats = orch.driver.statistics()
    assert c.failed > 0, "some groups failed and were skipped"
    assert c.cancelled > 0, "aborted samples are booked as cancelled"
    assert stats.failed > 0
    assert stats.aborted_recycled > 0
    assert c.dispatched == c.settled + sink.held


async def test_a_hung_sample_hits_its_deadline_and_its_group_is_booked_failed(
    tmp_path: Path,
) -> None:
    engine = SimulatedEngine(
        distribution="long-cot", slots=64, seed=9, seconds_per_token=1e-7, hang_rate=0.2
    )
    async with (
        MemorySender(1) as sender,
        open_orchestrator(
            engine,
            InMemorySource(_prompts(300)),
            sender,
            config=_config(rollout=RolloutConfig(sample_timeout=0.1)),
            sample_reward=_reward,
        ) as orch,
    ):
        await orch.run(10)
        c = orch.sink.counters
        assert c.failed > 0, "hung samples failed at their deadline instead of blocking the run"
        assert c.dispatched == c.settled + orch.sink.held


async def test_by_handle_payloads_are_read_by_the_trainer_and_orphans_swept(
    tmp_path: Path,
) -> None:
    """Samples carry routed-expert rows by handle in ``v<k>`` files; the trainer reads every
    batch's rows (nothing live is ever swept) and deletes them; the orchestrator sweeps the
    directories nobody can read any more."""
    store = PayloadStore(tmp_path / "payloads")
    # slow enough that generation interleaves with training, so versions advance mid-run
    engine = SimulatedEngine(distribution="long-cot", slots=16, seed=3, seconds_per_token=2e-5)
    inner = engine_generate(engine, SamplingParams(max_tokens=64))

    async def generate(sample: Sample) -> None:
        await inner(sample)
        rows = np.arange(2 * len(sample.completion_tokens), dtype=np.int32).reshape(-1, 2)
        version = sample.policy_versions[-1]
        segments = await trio.to_thread.run_sync(
            lambda: store.write_request(
                version, {"routed_experts": rows}, pos=len(sample.prompt_tokens)
            )
        )
        sample.payload = tuple(segments)

    read_rows = 0
    versions_seen: set[int] = set()

    async def trainer(orch: Orchestrator, steps: int) -> None:
        nonlocal read_rows
        transport = sender.receiver(0, start_step=1)
        async with BatchReceiver(transport, stop_step=steps + 1) as batches:
            async for step, micro_batches in batches:
                files: set[str] = set()
                for mb in micro_batches:
                    segs = mb.payload or []
                    files.update(seg.file for seg in segs)
                    versions_seen.update(int(Path(seg.file).parent.name[1:]) for seg in segs)
                    got = await store.aread_field(segs, "routed_experts", 0, len(mb.input_ids))
                    assert got is not None
                    read_rows += sum(seg.rows for seg in segs)
                await store.adelete_files(files)
                orch.set_policy_version(step)

    async with (
        MemorySender(1) as sender,
        open_orchestrator(
            engine,
            InMemorySource(_prompts(200)),
            sender,
            config=_config(max_async_level=1),
            sample_reward=_reward,
            generate=generate,
            payloads=store,
            on_policy_version=engine.set_policy_version,
        ) as orch,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer, orch, 12)
            await orch.run(12)
        # the trainer has read every batch: sweep once more against what is live now
        live = orch.live_payload_versions()
        await orch.sweep_payloads()
    assert read_rows > 0
    assert len(versions_seen) > 1, "batches came from several policy versions"
    on_disk = store.versions_on_disk()
    assert all(v >= min(live) for v in on_disk), "orphan directories below every holder are gone"
    if min(live) > 0:
        assert 0 not in on_disk, "v0 was written in step 1 and swept once nobody could read it"
    assert on_disk, "live versions are kept"


async def test_every_retried_attempt_settles_once_in_the_books(tmp_path: Path) -> None:
    """A group that fails and is retried books each attempt's samples, members
    that had already finished included, as failed, once; the successful attempt ships."""
    inner = engine_generate(_engine(), SamplingParams(max_tokens=64))
    calls: dict[int, int] = {}

    async def generate(sample: Sample) -> None:
        calls[sample.index] = calls.get(sample.index, 0) + 1
        if sample.index % G == G - 1 and calls[sample.index] == 1:
            await trio.sleep(0.01)  # its siblings finish first: held members of a failed attempt
            raise RuntimeError(f"first attempt of sample {sample.index} fails")
        await inner(sample)

    async with (
        MemorySender(1) as sender,
        open_orchestrator(
            _engine(),
            InMemorySource(_prompts(200)),
            sender,
            config=_config(rollout=RolloutConfig(failure=FailurePolicy("retry", max_retries=1))),
            sample_reward=_reward,
            generate=generate,
        ) as orch,
    ):
        await orch.run(2)
        c, sink = orch.sink.counters, orch.sink
        stats = orch.driver.statistics()
    assert stats.retried > 0
    assert stats.failed == 0
    # every sample of every failed attempt settled once as failed: G per retry
    assert c.failed == G * stats.retried, (c, stats.retried)
    assert c.shipped == 2 * T * G
    assert c.dispatched == c.settled + sink.held


async def test_progress_totals_are_checkpointed_and_restored_on_resume(tmp_path: Path) -> None:
    """Tokens, samples and problems over every shipped batch: saved with each checkpoint,
    restored by the resumed run, which goes on counting from them."""
    rec = _Recorder()

    def totals(shipments: list[Shipment]) -> tuple[int, int, int]:
        samples = [s for sh in shipments for s in sh.samples]
        problems = sum(len({s.group_id for s in sh.samples}) for sh in shipments)
        return sum(len(s.token_ids) for s in samples), len(samples), problems

    async with MemorySender(1) as sender:
        start = functools.partial(
            open_orchestrator,
            config=_config(),
            checkpoint_dir=tmp_path / "ckpt",
            group_reward=rec.group_reward,
            monitor=rec.shipments.append,
        )
        async with start(_engine(), InMemorySource(_prompts(30)), sender) as orch:
            await orch.run(2)
            first = attrs.astuple(orch.progress)
        assert first == totals(rec.shipments)
        assert first[1] == 2 * T * G
        async with start(_engine(), InMemorySource(_prompts(30)), sender) as orch:
            assert attrs.astuple(orch.progress) == first  # restored, not zero
            await orch.run(1)
            assert attrs.astuple(orch.progress) == totals(rec.shipments)


async def test_the_ship_gate_says_what_it_waits_for_every_5_s_and_a_cancel_ends_the_hold(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The gate has no budget of its own (the trainer's waits bound a trainer that stopped),
    but it is never silent: a line every 5 s naming the step, the version it needs and the
    current one, as docs/operations.md quotes it."""
    caplog.set_level(logging.WARNING, logger="trio_rl.orchestrator")
    rec = _Recorder()
    cell = WatchedCell()
    async with _gated(rec, cell) as orch:
        await orch.run(1)
        async with trio.open_nursery() as nursery:
            await cell.start_held(nursery, functools.partial(orch.run, 1))
            for _ in range(2):  # 5 s, then 10 s held
                mock_clock.jump(5.0)
                await trio.testing.wait_all_tasks_blocked()
            lines = [r.getMessage() for r in caplog.records if "ship gate" in r.getMessage()]
            assert lines == [
                f"ship gate: step 2 waits for policy version >= 1 (current 0) for {held} s; "
                "only the trainer advances the version (set_policy_version)"
                for held in (5, 10)
            ]
            documented("the ship gate", lines[0])
            nursery.cancel_scope.cancel()  # the run stops while the gate holds
        assert [s.record.step for s in rec.shipments] == [1]
