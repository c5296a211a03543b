"""The runner's deadline server: a scope armed with ``seconds`` is cancelled exactly when it
falls due, a disarmed one never, and a closed scope is not held once its call is over."""

from __future__ import annotations

import contextlib
import gc
import weakref
from contextlib import AbstractContextManager

import pytest
import trio
import trio.lowlevel
import trio.testing
from envs_helpers import CODEC, ScriptedPolicy

from trio_rl.engines import SamplingParams
from trio_rl.envs import CompactCalls, EnvConfig, Episode, EpisodeRunner, ToolEnv
from trio_rl.envs._deadlines import Deadlines
from trio_rl.errors import EnvConfigError
from trio_rl.samples import Sample


async def _wait(scope: trio.CancelScope, fired: dict[str, float], name: str) -> None:
    with scope:
        await trio.sleep_forever()
    fired[name] = trio.current_time()


async def test_each_scope_is_cancelled_when_its_deadline_falls_due(
    autojump_clock: trio.testing.MockClock,
) -> None:
    deadlines = Deadlines()
    fired: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(deadlines.serve)
        scopes = {name: trio.CancelScope() for name in ("ten", "three", "late ten", "one")}
        # durations armed out of order: the server sleeps until ten, then must wake for three
        # and one, armed while it sleeps
        deadlines.arm(scopes["ten"], 10.0)
        nursery.start_soon(_wait, scopes["ten"], fired, "ten")
        await trio.sleep(1)
        deadlines.arm(scopes["three"], 3.0)
        deadlines.arm(scopes["late ten"], 10.0)
        nursery.start_soon(_wait, scopes["three"], fired, "three")
        nursery.start_soon(_wait, scopes["late ten"], fired, "late ten")
        deadlines.arm(scopes["one"], 1.0)
        nursery.start_soon(_wait, scopes["one"], fired, "one")
        await trio.sleep(20)
        assert deadlines.armed == 0
        nursery.cancel_scope.cancel()
    assert fired == {"ten": 10.0, "one": 2.0, "three": 4.0, "late ten": 11.0}
    assert all(s.cancelled_caught for s in scopes.values())
    assert not deadlines.serving


async def test_a_disarmed_scope_is_never_cancelled_and_the_next_one_still_is(
    autojump_clock: trio.testing.MockClock,
) -> None:
    deadlines = Deadlines()
    async with trio.open_nursery() as nursery:
        await nursery.start(deadlines.serve)
        early, late = trio.CancelScope(), trio.CancelScope()
        deadlines.arm(early, 5.0)
        await trio.sleep(1)
        deadlines.arm(late, 5.0)
        deadlines.disarm(early, 5.0)
        with late:
            await trio.sleep_forever()
        assert trio.current_time() == 6.0
        assert not early.cancel_called
        assert deadlines.armed == 0
        nursery.cancel_scope.cancel()


async def test_a_scope_armed_when_its_server_stops_keeps_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    deadlines = Deadlines()
    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        await nursery.start(deadlines.serve)
        deadlines.arm(scope, 7.0)
        nursery.cancel_scope.cancel()
    assert not deadlines.serving
    assert deadlines.armed == 0
    with scope:
        await trio.sleep_forever()
    assert trio.current_time() == 7.0  # trio's own deadline, from the server's
    assert scope.cancelled_caught


def _runner() -> EpisodeRunner:
    async def quick(key: str) -> str:
        await trio.lowlevel.checkpoint()
        return "b"

    env = ToolEnv([quick], lambda *_: 1.0, syntax=CompactCalls())
    policy = ScriptedPolicy(lambda prompt: "a" if "b" in prompt else "?1")
    config = EnvConfig(tool_timeout=30.0, episode_timeout=None)
    return EpisodeRunner(policy, env, CODEC, SamplingParams(max_tokens=3), config)


@pytest.mark.parametrize("served", [True, False])
async def test_a_tool_call_s_scope_is_freed_when_the_call_ends_only_if_served(
    served: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    scopes: list[weakref.ref[trio.CancelScope]] = []
    cancel_after = Episode.cancel_after

    def recorded(episode: Episode, seconds: float) -> AbstractContextManager[trio.CancelScope]:
        cm = cancel_after(episode, seconds)
        scopes.append(weakref.ref(cm if isinstance(cm, trio.CancelScope) else cm.scope))  # type: ignore[attr-defined]
        return cm

    monkeypatch.setattr(Episode, "cancel_after", recorded)
    runner = _runner()
    sample = Sample(0, 0, CODEC.encode("1="), label={"prompt": "1="}, seed=1)
    async with runner if served else contextlib.nullcontext(runner), trio.open_nursery() as n:
        # an earlier deadline stays on top of trio's heap (as the engine's at many episodes
        # in flight): the tool call's closed scope, below it, is not popped on the next tick
        n.start_soon(trio.sleep, 10)
        await runner(sample)
        await trio.lowlevel.checkpoint()
        gc.collect()
        held = [ref() is not None for ref in scopes]
        n.cancel_scope.cancel()
    assert sample.metadata["episode"]["stop"] == "done"
    assert len(held) == 1
    # trio's heap keeps a closed scope with a deadline until it prunes the heap; the server
    # forgets it as the call ends
    assert held == [not served]


async def test_a_failure_in_an_open_runner_s_block_comes_out_as_itself() -> None:
    runner = _runner()
    with pytest.raises(KeyError, match="the block's own"):
        async with runner:
            raise KeyError("the block's own")
    # closed: its deadline server stopped, and it opens again
    async with runner:
        sample = Sample(0, 0, CODEC.encode("1="), label={"prompt": "1="}, seed=1)
        await runner(sample)
    assert sample.metadata["episode"]["stop"] == "done"


async def test_a_runner_opens_once_at_a_time() -> None:
    runner = _runner()
    async with runner:
        with pytest.raises(EnvConfigError, match="already open"):
            async with runner:
                pass


async def test_a_cancelled_block_closes_the_runner_and_its_server_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    runner = _runner()
    with trio.move_on_after(5) as outer:
        async with runner:
            served = runner._deadlines
            assert served is not None
            assert served.serving
            await trio.sleep_forever()
    assert outer.cancelled_caught  # the outer scope's cancellation, caught where it belongs
    assert trio.current_time() == 5
    assert served is not None
    assert not served.serving
    assert runner._deadlines is None
