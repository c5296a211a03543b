"""The eval runner on a SimulatedEngine: the pass@k figures, a deadline, failures, pinning."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from evals_helpers import held_out, success_reward

from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.errors import EvalError
from trio_rl.evals import EvalRunner, VersionPin
from trio_rl.rollout import engine_generate
from trio_rl.samples import Sample

SUCCESS = 0.3
K = 8


async def test_pass_at_1_and_pass_at_8_match_a_success_rate_of_0_3(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimulatedEngine(seed=0, slots=512)
    runner = EvalRunner(
        generate=engine_generate(engine, SamplingParams(max_tokens=4)),
        reward=success_reward(SUCCESS),
        k=K,
        seed=1234,
        max_samples_in_flight=512,
    )
    prompts = held_out(2_000)
    seen: list[tuple[int, int]] = []
    result = await runner.run(prompts, step=3, progress=lambda done, n: seen.append((done, n)))
    assert result.status == "done"
    assert (result.prompts, result.samples, result.k) == (2_000, 16_000, K)
    assert result.pass_at_1 == pytest.approx(SUCCESS, abs=0.03)
    assert result.pass_at_k == pytest.approx(1 - (1 - SUCCESS) ** K, abs=0.03)
    assert result.pass_hat_k == pytest.approx(SUCCESS**K, abs=0.003)
    assert result.avg_at_k == pytest.approx(SUCCESS, abs=0.03)  # rewards are 0 or 1
    assert result.failed == 0.0
    assert result.turns_mean == 1.0
    assert 0 < result.completion_tokens_mean <= 4  # type: ignore[operator]
    assert result.policy_version == 0
    assert result.step == 3
    assert seen[-1] == (2_000, 2_000)
    assert len(seen) == 2_000
    assert engine.statistics().in_flight == 0


async def test_a_fixed_seed_reproduces_the_figures(autojump_clock: trio.testing.MockClock) -> None:
    async def once() -> dict[str, object]:
        engine = SimulatedEngine(seed=5, slots=64)
        runner = EvalRunner(
            generate=engine_generate(engine, SamplingParams(max_tokens=4)),
            reward=success_reward(SUCCESS),
            k=4,
            seed=9,
        )
        rec = (await runner.run(held_out(50), step=0)).record()
        del rec["wall_s"]
        return rec

    assert await once() == await once()


async def test_an_eval_whose_engine_stalls_ends_at_its_deadline_reported_as_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a third of the requests hang forever: without the deadline the eval never ends
    engine = SimulatedEngine(seed=0, slots=64, hang_rate=0.34)
    runner = EvalRunner(
        generate=engine_generate(engine, SamplingParams(max_tokens=4)),
        reward=success_reward(SUCCESS),
        k=2,
        seed=0,
    )
    started = trio.current_time()
    result = await runner.run(held_out(40), step=6, deadline=30.0)
    assert trio.current_time() - started == pytest.approx(30.0)
    assert result.status == "cut"
    assert result.prompts_planned == 40
    assert 0 < result.prompts < 40
    assert result.samples == 2 * result.prompts
    assert engine.statistics().in_flight == 0  # every stalled request was cancelled
    assert result.record()["status"] == "cut"


async def test_an_engine_that_never_answers_gives_a_cut_eval_without_figures(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimulatedEngine(seed=0, hang_rate=1.0)
    runner = EvalRunner(
        generate=engine_generate(engine, SamplingParams(max_tokens=4)), reward=lambda s: 1.0, k=8
    )
    result = await runner.run(held_out(3), step=0, deadline=5.0)
    assert (result.status, result.prompts, result.samples) == ("cut", 0, 0)
    assert result.pass_at_1 is None
    assert result.policy_version is None


async def test_failed_samples_are_counted_and_fail_nothing_else(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimulatedEngine(seed=3, failure_rate=0.25)

    def reward(sample: Sample) -> float:
        if sample.index % 10 == 0:
            raise ValueError("reward broke")
        return 1.0

    runner = EvalRunner(
        generate=engine_generate(engine, SamplingParams(max_tokens=4)), reward=reward, k=4
    )
    result = await runner.run(held_out(100), step=0)
    assert result.status == "done"
    assert result.prompts == 100
    assert result.samples == 400
    # a quarter fail in the engine, a tenth of the rest in the reward
    assert result.failed == pytest.approx(0.25 + 0.75 * 0.1, abs=0.06)
    assert result.pass_at_1 == pytest.approx(1 - result.failed, abs=1e-9)  # type: ignore[operator]


async def test_samples_from_two_versions_are_an_error_and_the_pin_prevents_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimulatedEngine(seed=0, slots=4)  # a queue: the eval spans the version change
    runner = EvalRunner(
        generate=engine_generate(engine, SamplingParams(max_tokens=4)), reward=lambda s: 1.0, k=4
    )

    async def load_new_weights(pin: VersionPin | None, version: int) -> None:
        await trio.sleep(0.05)
        if pin is None:
            engine.set_policy_version(version)
            return
        async with pin.loading(f"the load of version {version}"):
            engine.set_policy_version(version)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(load_new_weights, None, 1)
        with pytest.raises(EvalError, match=r"policy versions \[0, 1\]"):
            await runner.run(held_out(20), step=0)

    pin = VersionPin()
    async with trio.open_nursery() as nursery, pin.pinned("the eval of step 1"):
        nursery.start_soon(load_new_weights, pin, 2)
        result = await runner.run(held_out(20), step=1, policy_version=1)
        assert engine.policy_version == 1  # the load waited
        assert pin.holder == "the eval of step 1"
    assert result.policy_version == 1
    assert engine.policy_version == 2  # and then happened
