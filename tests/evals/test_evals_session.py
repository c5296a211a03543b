"""A run's evals: due versions are never skipped, each eval is of one version and recorded
once, a stop mid-eval is redone or dropped on resume, and the last one is bounded.

Real time, not MockClock: the journal writes in worker threads, and an autojumping clock
jumps while a thread runs. The engine runs at 1/100 of its simulated time."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from evals_helpers import held_out, success_reward

from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.evals import EvalConfig, EvalJournal, EvalResult, EvalRunner, RunEvals, VersionPin
from trio_rl.evals._config import OnResume
from trio_rl.rollout import (
    GroupFactory,
    GroupRunner,
    InMemorySource,
    PriorityLane,
    engine_generate,
    open_async_rollout,
)
from trio_rl.samples import Prompt

STEPS = 6
SCALE = 0.01  # the engine's time scale: a 1 s sample takes 10 ms


class Run:
    """A training run in miniature on a SimulatedEngine: a driver generating rollouts, a
    trainer publishing a version every ``train_s`` seconds, and the weight loader that drives
    the evals (the learning run's watcher does the same)."""

    def __init__(self, out: Path, config: EvalConfig, *, served: int = 0) -> None:
        self.engine = SimulatedEngine(seed=0, slots=16, time_scale=SCALE)
        self.engine.set_policy_version(served)
        self.config = config
        self.lane = PriorityLane()
        self.published = list(range(served + 1))
        self.reported: list[EvalResult] = []
        self.loaded: list[int] = []

        async def report(result: EvalResult) -> None:
            self.reported.append(result)

        self.evals = RunEvals(
            config=config,
            runner=EvalRunner(
                generate=engine_generate(self.engine, SamplingParams(max_tokens=30)),
                reward=success_reward(0.5),
                k=config.k,
                lane=self.lane,
                seed=0,
            ),
            prompts=held_out(12),
            journal=EvalJournal(out),
            pin=VersionPin(),
            report=report,
        )

    async def train(self, last: int, train_s: float) -> None:
        while self.published[-1] < last:
            await trio.sleep(train_s)
            self.published.append(self.published[-1] + 1)

    async def load_and_evaluate(self) -> None:
        current = self.engine.policy_version
        while True:
            if self.evals.wants(current):
                await self.evals.evaluate(current)
            target = self.evals.target(current, self.published)
            if target is None:
                await trio.sleep(0.001)
                continue
            async with self.evals.pin.loading(f"the load of version {target}"):
                await trio.sleep(0.001)  # loading takes time
                self.engine.set_policy_version(target)
            self.loaded.append(target)
            current = target

    async def run(self, train_s: float = 0.01, last: int = STEPS) -> None:
        await self.evals.open(self.engine.policy_version)
        training = InMemorySource([Prompt(key=f"t{i}", tokens=(3, i)) for i in range(100_000)])
        async with (
            open_async_rollout(
                training,
                GroupFactory(4, seed=0),
                GroupRunner(engine_generate(self.engine, SamplingParams(max_tokens=30))),
                batch_size=2,
                max_groups_in_flight=4,
                buffer_capacity=100_000,
            ) as driver,
            trio.open_nursery() as nursery,
        ):
            with self.lane.attach(driver.scheduler, 4):
                nursery.start_soon(self.train, last, train_s)
                nursery.start_soon(self.load_and_evaluate)
                while self.published[-1] < last:  # noqa: ASYNC110 - the trainer's clock
                    await trio.sleep(0.005)
                with trio.move_on_after(self.config.timeout + 10):
                    await self.evals.wait_recorded(last)
                await self.evals.cut(last)
                nursery.cancel_scope.cancel()


def _records(out: Path) -> list[tuple[int, int | None, str]]:
    return [(r.step, r.policy_version, r.status) for r in EvalJournal(out).results()]


async def test_six_steps_every_two_give_exactly_four_evals_each_of_one_version(
    tmp_path: Path,
) -> None:
    # the trainer publishes faster than an eval runs: a loader taking the newest version
    # would skip steps 2 and 4
    run = Run(tmp_path, EvalConfig(interval=2, k=4, before_train=True))
    await run.run(train_s=0.005)
    assert _records(tmp_path) == [(0, 0, "done"), (2, 2, "done"), (4, 4, "done"), (6, 6, "done")]
    assert [r.step for r in run.reported] == [0, 2, 4, 6]
    assert all(r.prompts == 12 and r.samples == 48 for r in run.reported)
    assert {2, 4, 6} <= set(run.loaded)


@pytest.mark.parametrize(
    ("on_resume", "served", "expected"),
    [
        ("redo", 4, [(0, 0, "done"), (2, 2, "done"), (4, 4, "done"), (6, 6, "done")]),
        ("drop", 4, [(0, 0, "done"), (2, 2, "done"), (4, 4, "dropped"), (6, 6, "done")]),
        # the resumed run serves a newer policy: step 4's eval cannot be redone, it is recorded
        ("redo", 5, [(0, 0, "done"), (2, 2, "done"), (4, 4, "dropped"), (6, 6, "done")]),
    ],
)
async def test_a_run_stopped_mid_eval_redoes_or_drops_it_on_resume_and_logs_nothing_twice(
    tmp_path: Path,
    on_resume: OnResume,
    served: int,
    expected: list[tuple[int, int | None, str]],
) -> None:
    config = EvalConfig(interval=2, k=4, on_resume=on_resume)
    first = Run(tmp_path, config)
    with trio.move_on_after(60) as stopped:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first.run)
            # the stop comes mid-eval, with samples in flight (observed, not signalled)
            while not first.evals.pin.holder.startswith("the eval of step 4"):  # noqa: ASYNC110
                await trio.sleep(0.001)
            while not first.lane.statistics().held:  # noqa: ASYNC110
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
    assert not stopped.cancelled_caught
    assert _records(tmp_path) == expected[:2]
    assert EvalJournal(tmp_path).pending() is not None  # the stop left its marker

    resumed = Run(tmp_path, config, served=served)
    await resumed.run()
    assert _records(tmp_path) == expected
    assert [r.step for r in resumed.reported] == [s for s, _, _ in expected[2:]]
    assert EvalJournal(tmp_path).pending() is None


async def test_the_last_eval_on_a_stalling_engine_is_cut_at_its_timeout(tmp_path: Path) -> None:
    run = Run(tmp_path, EvalConfig(interval=2, k=4, before_train=False, timeout=1.0))
    run.engine.hang_rate = 0.3  # some requests never answer: only the timeout ends the eval
    with trio.fail_after(30):  # the run waits timeout + 10 s at most for it: never forever
        await run.run(last=2)
    (record,) = EvalJournal(tmp_path).results()
    assert (record.step, record.status) == (2, "cut")
    assert record.prompts < 12
