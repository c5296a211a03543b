"""The harness drives multi-turn episodes: every sample is a ToolEnv episode of 1 to 4 turns
whose tool calls return, raise, take half the tool timeout or never return, under the
adversarial schedules of the credit loop and the drivers; credit conservation, no leaked task,
one stop reason per ended episode and no tool call left running are checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import trio
from hypothesis import Phase, settings

from conftest import scaled
from trio_rl.engines import Engine
from trio_rl.envs import Episode
from trio_rl.rollout import GenerateFn
from trio_rl.samples import Sample
from trio_rl.testing import (
    TOOL_FATES,
    EpisodeHarness,
    Invariant,
    InvariantViolationError,
    RolloutSubject,
    ScriptedEngine,
    check_async_driver,
    check_credit_loop,
    check_sync_driver,
    episode_property,
)

LIBRARY = RolloutSubject(max_steps=scaled(16))

test_episodes_credit_loop = episode_property(check_credit_loop, LIBRARY)
test_episodes_sync_driver = episode_property(check_sync_driver, LIBRARY)
test_episodes_async_driver = episode_property(check_async_driver, LIBRARY)

HUNT = settings(
    max_examples=200, database=None, derandomize=True, phases=[Phase.generate, Phase.shrink]
)


def test_the_episodes_play_every_turn_count_and_tool_fate() -> None:
    """The plans cover 1 to 4 turns and every tool fate, and stop reasons of each kind end
    episodes (the property above is not vacuous)."""
    harness = EpisodeHarness()
    seen: dict[str, int] = {}
    turns: set[int] = set()

    async def main() -> None:
        generate = harness(ScriptedEngine())
        for i in range(40):
            sample = Sample(index=i, group_index=i, prompt_tokens=(i,))
            await generate(sample)
            episode = sample.metadata["episode"]
            turns.add(episode["turns"])
            seen[episode["stop"]] = seen.get(episode["stop"], 0) + 1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert turns == {1, 2, 3, 4}
    assert {"done", "error", "tool_timeout"} <= set(seen), seen
    assert harness.tools_running == 0
    assert harness.stats.episodes == harness.ended == 40
    assert set(TOOL_FATES) == {"ok", "raise", "slow", "hang"}


class _ForgetfulHarness(EpisodeHarness):
    """A runner that ends some episodes without counting a stop reason (the bug)."""

    def __call__(self, engine: Engine) -> GenerateFn:
        generate = super().__call__(engine)

        async def forgetful(sample: Sample) -> None:
            await generate(sample)
            if sample.metadata["episode"]["turns"] > 1:
                self.ended += 1  # counted twice: the runner's count no longer matches

        return forgetful


class _LeakyToolHarness(EpisodeHarness):
    """A tool whose call outlives its episode: started in a nursery that is not the
    episode's (the bug)."""

    async def _play(self, episode: Episode, record: Mapping[str, Any]) -> float:
        self.tools_running += 1  # a tool call that never ends
        return await super()._play(episode, record)


@pytest.mark.parametrize("harness", [_ForgetfulHarness(), _LeakyToolHarness()])
def test_catches_an_episode_that_breaks_the_end_invariant(harness: EpisodeHarness) -> None:
    test = episode_property(check_credit_loop, LIBRARY, harness=harness, settings_=HUNT)
    with pytest.raises(InvariantViolationError) as caught:
        test()
    assert caught.value.invariant is Invariant.EPISODE_ENDS_ONCE, str(caught.value)
