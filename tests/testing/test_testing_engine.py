"""The scripted engine does exactly what its script and the test tell it to."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from trio_rl.engines import AbortSignal, Completion, Engine, GenerateRequest
from trio_rl.rollout import GroupFailedError, GroupRunner, engine_generate
from trio_rl.samples import Group, Prompt, Sample
from trio_rl.testing import Call, Fate, ScriptedEngine, ScriptedEngineError


def test_is_an_engine() -> None:
    assert isinstance(ScriptedEngine(), Engine)


async def test_delayed_fates_end_at_their_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fates: dict[tuple[int, ...], Fate] = {
        (1,): Fate("stop", after=2.0, tokens=3),
        (2,): Fate("length", after=5.0),
    }
    engine = ScriptedEngine(lambda r: fates[r.prompt_tokens], policy_version=7)
    results: dict[str, tuple[Completion, float]] = {}

    async def one(name: str, tokens: tuple[int, ...]) -> None:
        results[name] = (await engine.generate(GenerateRequest(tokens)), trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "a", (1,))
        nursery.start_soon(one, "b", (2,))
    (a, ta), (b, tb) = results["a"], results["b"]
    assert (a.finish_reason, a.tokens, a.policy_version, ta) == ("stop", [0, 1, 2], 7, 2.0)
    assert (b.finish_reason, tb) == ("length", 5.0)
    assert sorted(str(c.outcome) for c in engine.calls) == ["length", "stop"]


async def test_held_calls_wait_for_settle_and_record_cancellation() -> None:
    engine = ScriptedEngine(lambda _r: Fate("stop"))
    outcomes: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = (await engine.generate(GenerateRequest((i,)))).finish_reason
        except ScriptedEngineError as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()
        assert len(engine.held) == 4
        assert outcomes == {}
        c0, c1, c2, c3 = sorted(engine.calls, key=lambda c: c.request.prompt_tokens)
        engine.settle(c0)
        engine.settle(c1, "raise")
        engine.settle(c2, "abort")
        await trio.testing.wait_all_tasks_blocked()
        assert engine.held == [c3]
        assert engine.running == [c3]
        with pytest.raises(ValueError, match="not waiting"):
            engine.settle(c0)
        nursery.cancel_scope.cancel()
    assert outcomes[0] == "stop"
    assert isinstance(outcomes[1], ScriptedEngineError)
    assert outcomes[2] == "abort"
    assert 3 not in outcomes
    assert [c.outcome for c in (c0, c1, c2, c3)] == ["stop", "raise", "abort", "cancelled"]
    assert engine.running == []


async def test_hang_ends_only_by_cancellation(autojump_clock: trio.testing.MockClock) -> None:
    engine = ScriptedEngine(lambda _r: Fate("hang", after=1.0))
    with trio.move_on_after(1000) as scope:
        await engine.generate(GenerateRequest(()))
    assert scope.cancelled_caught
    assert trio.current_time() == 1000
    assert engine.calls[0].outcome == "cancelled"


def test_fate_validates() -> None:
    with pytest.raises(ValueError):
        Fate("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Fate("stop", after=-1.0)


def _group(size: int) -> Group:
    samples = [Sample(index=i, group_index=0, prompt_tokens=(i,)) for i in range(size)]
    return Group(group_id="g", prompt=Prompt(key="g", tokens=(0,)), samples=samples)


async def _run_and_settle(settle: Callable[[ScriptedEngine], None]) -> GroupFailedError:
    engine = ScriptedEngine(lambda _r: Fate("stop"))
    runner = GroupRunner(engine_generate(engine))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            result: list[GroupFailedError] = []

            async def run() -> None:
                try:
                    await runner.run(_group(4))
                except GroupFailedError as exc:
                    result.append(exc)

            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
            assert len(engine.held) == 4
            settle(engine)
    (failed,) = result
    assert [c.outcome for c in engine.calls].count("cancelled") == 4 - len(failed.failures)
    return failed


async def test_fail_together_fails_several_calls_in_one_tick() -> None:
    # Three calls waiting on one event raise together: the group sees three failures, as with
    # a real engine; settling them one by one lets the first failure cancel the others.
    def together(engine: ScriptedEngine) -> None:
        engine.fail_together(sorted(engine.held, key=lambda c: c.number)[:3])

    def one_by_one(engine: ScriptedEngine) -> None:
        for call in sorted(engine.held, key=lambda c: c.number)[:3]:
            engine.settle(call, "raise")

    failed = await _run_and_settle(together)
    assert len(failed.failures) == 3
    assert all(isinstance(exc, ScriptedEngineError) for _, exc in failed.failures)
    assert len((await _run_and_settle(one_by_one)).failures) == 1


async def test_fail_together_refuses_a_call_not_held() -> None:
    engine = ScriptedEngine(lambda _r: Fate("stop"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.generate, GenerateRequest((1,)))
        await trio.testing.wait_all_tasks_blocked()
        (call,) = engine.held
        engine.settle(call)
        with pytest.raises(ValueError, match="not waiting"):
            engine.fail_together([call])


async def test_a_waiting_call_honours_the_abort_signal_and_a_hang_ignores_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine(lambda r: Fate("stop"))  # held until settled
    abort = AbortSignal()
    results: dict[str, Completion] = {}

    async def one(name: str, token: int) -> None:
        results[name] = await engine.generate(GenerateRequest((token,), abort=abort))

    def call(token: int) -> Call:
        (found,) = [c for c in engine.calls if c.request.prompt_tokens == (token,)]
        return found

    with trio.move_on_after(100) as hung:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "held", 1)
            nursery.start_soon(one, "hang", 2)
            await trio.testing.wait_all_tasks_blocked()
            engine.settle(call(2), "hang")
            await trio.testing.wait_all_tasks_blocked()  # now hanging, past its wait
            abort.set()
            await trio.testing.wait_all_tasks_blocked()
            assert results["held"].finish_reason == "abort"
            assert results["held"].tokens == []
            assert (call(1).outcome, call(2).outcome) == ("abort", None)
    assert hung.cancelled_caught  # the hang only ends by cancellation
    assert call(2).outcome == "cancelled"
