"""Multi-turn episodes under the harness: every sample is an episode of a :class:`ToolEnv`.

:class:`EpisodeHarness` is a ``RolloutSubject.generate`` factory: it makes an
:class:`~trio_rl.envs.EpisodeRunner` over the harness's scripted engine, so every engine call the
schedule settles is one policy turn. Each episode plays a planned number of turns (1 to
``max_turns``); between two turns it calls a tool that returns, raises, returns after half the
tool timeout or never returns (ended by the tool timeout). The plan is a function of the
sample (its prompt and index), so an example replays and shrinks exactly; the schedule's
engine fates, virtual time and cancellations do the rest. After the run the harness checks
that every episode that ended has exactly one stop reason and that no tool call outlived its
episode (:attr:`Invariant.EPISODE_ENDS_ONCE`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from ..engines import Engine
from ..envs import EnvConfig, Episode, EpisodeRunner, EpisodeStats, ToolCall, ToolEnv
from ..rollout import GenerateFn
from ..samples import Sample
from ._errors import Invariant, InvariantViolationError
from ._hypothesis import PHASES, namespaced, subject_digest
from ._properties import check_credit_loop
from ._subject import HANG_TIMEOUT, RolloutSubject

__all__ = ["TOOL_FATES", "TOOL_TIMEOUT", "EpisodeHarness", "episode_property"]

#: Virtual seconds a harness tool call may take before it ends its episode as ``tool_timeout``.
TOOL_TIMEOUT = 5.0
#: What a harness tool call does: return, raise, return after half the timeout, never return.
TOOL_FATES = ("ok", "raise", "slow", "hang")

Check = Callable[[st.DataObject, RolloutSubject | None], None]


class _Codec:
    """Token ids as letters: the scripted engine's tokens decode to text, observations encode."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 64 for c in text]

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(chr(48 + t % 64) for t in tokens)


@attrs.frozen
class _PlannedCalls:
    """The policy's text calls the tool until the episode has played its planned turns."""

    episode: Episode
    turns: int

    def parse(self, text: str) -> list[ToolCall]:
        return [] if self.episode.turns >= self.turns else [ToolCall("tool")]

    def show(self, episode: Episode, call: ToolCall, result: str) -> None:
        episode.observe(result + "=")

    def show_error(self, episode: Episode, message: str) -> None:
        episode.observe("!=")


def _plan(sample: Sample, max_turns: int) -> tuple[int, list[str]]:
    """The sample's turn count and its tool calls' fates (deterministic: replays shrink)."""
    seed = zlib.crc32(f"{tuple(sample.prompt_tokens)}/{sample.index}".encode())
    turns = 1 + seed % max_turns
    fates = [TOOL_FATES[(seed >> (4 + 2 * k)) % len(TOOL_FATES)] for k in range(turns - 1)]
    return turns, fates


@attrs.define(eq=False)
class EpisodeHarness:
    """The episodes of one example at a time (the factory is called once per example).

    ``max_turns`` bounds each episode's planned turns; ``fates`` are the tool behaviours drawn
    from. ``tools_running`` counts tool calls in progress, ``ended`` the episodes the runner
    returned from, ``stats`` the runner's counts."""

    max_turns: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    fates: tuple[str, ...] = TOOL_FATES
    tools_running: int = 0
    tools_started: int = 0
    ended: int = 0
    stats: EpisodeStats = attrs.field(factory=EpisodeStats)

    def __call__(self, engine: Engine) -> GenerateFn:
        self.tools_running = self.tools_started = self.ended = 0
        config = EnvConfig(
            max_turns=self.max_turns,
            tool_timeout=TOOL_TIMEOUT,
            # an engine call held forever ends its episode, as the default generate's deadline
            episode_timeout=HANG_TIMEOUT,
            turn_retries=0,
        )
        runner = EpisodeRunner(engine, self._play, _Codec(), config=config, max_len=1 << 16)
        self.stats = runner.stats

        async def generate(sample: Sample) -> None:
            await runner(sample)
            self.ended += 1

        return generate

    async def _play(self, episode: Episode, record: Mapping[str, Any]) -> float:
        turns, plan = _plan(episode.sample, self.max_turns)
        fates = [f if f in self.fates else "ok" for f in plan]

        async def tool() -> str:
            fate = fates[self.tools_started % len(fates)] if fates else "ok"
            self.tools_started += 1
            self.tools_running += 1
            try:
                if fate == "raise":
                    raise RuntimeError("harness tool failure")
                if fate == "slow":
                    await trio.sleep(TOOL_TIMEOUT / 2)
                elif fate == "hang":
                    await trio.sleep_forever()
                return "ok"
            finally:
                self.tools_running -= 1

        env = ToolEnv([tool], _reward, max_turns=turns + 1, syntax=_PlannedCalls(episode, turns))
        return await env(episode, record)

    def check_end(self, steps: Sequence[str] = ()) -> None:
        """After the run: one stop reason per ended episode, no tool call still running."""
        problems = []
        if self.tools_running:
            problems.append(f"{self.tools_running} tool calls still running after the run")
        # an episode given up by a soft stop (abort) has no stop reason: it is regenerated
        if self.stats.episodes + self.stats.aborted != self.ended:
            problems.append(
                f"{self.ended} episodes ended but {self.stats.episodes} stop reasons counted"
                f" ({self.stats.stops}) and {self.stats.aborted} aborted"
            )
        if problems:
            raise InvariantViolationError(
                Invariant.EPISODE_ENDS_ONCE,
                "; ".join(problems),
                list(steps),
                description=Invariant.EPISODE_ENDS_ONCE.description,
            )


async def _reward(record: Mapping[str, Any], text: str, calls: Sequence[ToolCall]) -> float:
    # async, not a plain function: a plain one runs in a worker thread, and a task waiting on
    # a thread counts as blocked, so the harness would check the driver half-way through a
    # group's end (a lost wake-up that is only the check's race, and not reproducible)
    return float(len(calls))


def episode_property(
    check: Check = check_credit_loop,
    subject: RolloutSubject | None = None,
    *,
    harness: EpisodeHarness | None = None,
    settings_: settings | None = None,
) -> Callable[[], None]:
    """A ready-made Hypothesis test: ``check`` (a ``check_*`` function of the harness) with every
    sample an episode of ``harness`` (default :class:`EpisodeHarness`) instead of ``subject``'s
    generate function, then :meth:`EpisodeHarness.check_end`."""
    episodes = harness if harness is not None else EpisodeHarness()
    base = subject if subject is not None else RolloutSubject()
    played = attrs.evolve(base, generate=episodes)

    def test(data: st.DataObject, _random: Any) -> None:
        check(data, played)
        episodes.check_end()

    test.__name__ = test.__qualname__ = check.__name__.replace("check_", "test_episodes_")
    chosen = (
        settings_ if settings_ is not None else settings(report_multiple_bugs=False, phases=PHASES)
    )
    chosen = namespaced(chosen, subject_digest(base) + b"/episodes")
    wrapped: Callable[[], None] = chosen(given(st.data(), st.random_module())(test))
    return wrapped
