"""Why a learning run ends, said once and truly, quoting the figure that decided it.

A run whose groups all get equal rewards has no GRPO signal left, for one of two reasons:

- its policy has settled: every sample of a group is the same completion, or, after some
  training, the completions differ only where the reward does not look (each sample draws its
  own seed, so a nearly deterministic policy still varies now and then) and the rewards are
  the target or differ between prompts. At the task's maximum (or ``stop_at_reward``) that is
  convergence (a success: ``reached``); below it, a collapse (raise the entropy coefficient or
  the temperature);
- its samples differ but the reward scores every one of them alike (all zero, typically: an
  exact-match reward on an untrained model, or a reward reading the wrong field), or nothing
  was trained yet. That is nothing to learn from, and the reward is what to check.

`SampleLog` keeps the last samples the reward scored (which prompt, which completion, which
reward) so the verdict can tell the two apart; the run's sample reward (or, with an
environment, its episode runner) is wrapped to feed it.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ..config import LearnRunConfig
from ..rundir import RunDirectory
from ..samples import Sample, SampleStatus

__all__ = [
    "Ending",
    "SampleLog",
    "equal_rewards_verdict",
    "read_ended",
    "resumes",
    "reward_stop_line",
    "target_line",
    "write_ended",
]


@attrs.define(slots=True)
class Ending:
    """How the run's steps ended: ``stopped`` is ``steps`` (every step shipped), ``signal``,
    ``time_limit``, ``reward`` (``stop_at_reward`` reached), ``converged`` (deterministic and
    right), ``collapsed`` (deterministic, below the target) or ``no_signal`` (the samples
    differ but their rewards are all equal); ``message`` the line that said so (None for
    ``steps`` and ``signal``)."""

    stopped: str = "steps"
    message: str | None = None
    final_reward: float | None = None
    checkpoint: Any = None


def _key(record: Mapping[str, Any]) -> str:
    try:
        return json.dumps(record, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(record)


@attrs.define(slots=True)
class SampleLog:
    """The last ``size`` samples the reward scored: (prompt, completion, reward)."""

    size: int
    samples: deque[tuple[str, str, float]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.samples = deque(maxlen=self.size)

    def add(self, record: Mapping[str, Any], completion: str, reward: object) -> None:
        if isinstance(reward, int | float) and not isinstance(reward, bool):
            self.samples.append((_key(record), str(completion), float(reward)))

    def scoring(
        self, reward: Callable[[Sample], Awaitable[float]], decode: Callable[[list[int]], str]
    ) -> Callable[[Sample], Awaitable[float]]:
        """The sample reward ``reward`` that also logs each sample it scores. It logs in this
        process, around the call: the reward function itself runs wherever its workers are."""

        async def scored(sample: Sample) -> float:
            value = await reward(sample)
            if sample.status is not SampleStatus.FAILED:
                record = sample.label if isinstance(sample.label, Mapping) else {}
                self.add(record, decode(list(sample.completion_tokens)), value)
            return value

        return scored

    def playing(
        self, play: Callable[[Sample], Awaitable[None]], decode: Callable[[list[int]], str]
    ) -> Callable[[Sample], Awaitable[None]]:
        """The episode runner ``play`` that also logs each episode it finishes: an
        environment returns its episode's reward, so no sample reward is there to wrap."""

        async def played(sample: Sample) -> None:
            await play(sample)
            if sample.status is not SampleStatus.FAILED:
                record = sample.label if isinstance(sample.label, Mapping) else {}
                self.add(record, decode(list(sample.completion_tokens)), sample.reward)

        return played

    def identical_groups(self) -> bool:
        """Whether every prompt's logged samples are one completion (a deterministic policy)."""
        seen: dict[str, str] = {}
        for prompt, completion, _ in self.samples:
            if seen.setdefault(prompt, completion) != completion:
                return False
        return bool(seen)

    def mean_reward(self) -> float | None:
        if not self.samples:
            return None
        return sum(r for _, _, r in self.samples) / len(self.samples)

    def distinct_rewards(self) -> list[float]:
        return sorted({r for _, _, r in self.samples})


def _target(config: LearnRunConfig) -> tuple[float, str]:
    stop_at = config.run.stop_at_reward
    if stop_at is None:
        return 1.0, "the task's maximum 1"
    return stop_at, f"stop_at_reward {stop_at:g}"


def reward_text(reward: float, target: float) -> str:
    """``reward`` to three decimals, or to as many as it takes not to read as ``target`` when it
    is below it (a collapse at 0.9996 must not print as 1.000)."""
    for digits in range(3, 10):
        text = f"{reward:.{digits}f}"
        if reward >= target - 1e-9 or float(text) < target:
            return text
    return repr(reward)


def equal_rewards_verdict(log: SampleLog, config: LearnRunConfig, shipped: int) -> Ending:
    """Why a run whose last ``converged_after`` batches' worth of groups all had equal rewards
    ends: ``converged``, ``collapsed`` or ``no_signal`` (see the module docstring), with the
    one line that says so, quoting the reward of those samples. ``shipped``: the steps this
    invocation shipped (none: the reward gave nothing to learn from from the start)."""
    after = config.run.converged_after
    target, named = _target(config)
    reward = log.mean_reward()
    shown = "none" if reward is None else reward_text(reward, target)
    span = f"the last {after} batches' worth of groups ({len(log.samples)} samples)"
    values = log.distinct_rewards()
    right = reward is not None and reward >= target - 1e-9
    if log.identical_groups():
        if right:
            return Ending(
                "converged",
                f"stopping: reached reward {shown} (>= {named}): the policy is deterministic "
                f"and right ({span} each had one completion)",
                reward,
            )
        return Ending(
            "collapsed",
            f"stopping: collapsed at reward {shown}, below {named}: the policy is deterministic "
            f"({span} each had one completion, so GRPO has no signal left); raise "
            "trainer.entropy_coef or rollout.temperature",
            reward,
        )
    # The samples differ. After training, a policy that has settled still varies where the
    # reward does not look: right (or right on some prompts, wrong on others) is not a reward
    # that scores everything alike.
    if shipped > 0 and right:
        return Ending(
            "converged",
            f"stopping: reached reward {shown} (>= {named}): every group's samples scored "
            f"alike ({span}; the completions differ only where the reward does not look)",
            reward,
        )
    if shipped > 0 and len(values) > 1:
        return Ending(
            "collapsed",
            f"stopping: collapsed at reward {shown}, below {named}: every group's samples "
            f"scored alike ({span}; the completions differ, their rewards do not, so GRPO has "
            "no signal left); raise trainer.entropy_coef or rollout.temperature",
            reward,
        )
    equal = f"all {values[0]:g}" if len(values) == 1 else "equal within each group"
    since = "from the first step" if shipped == 0 else f"after {shipped} steps"
    scorer = config.env.function or config.reward.function or "the task"
    return Ending(
        "no_signal",
        f"stopping: nothing to learn from {since}: the samples differ but their rewards are "
        f"{equal} ({span}); check the reward ({scorer}'s scores on a few completions)",
        reward,
    )


def reward_stop_line(window: list[float], config: LearnRunConfig) -> str:
    """The line of a run that reached ``stop_at_reward`` over ``stop_window`` steps."""
    target = config.run.stop_at_reward
    return (
        f"stopping: reached reward {min(window):.3f} (>= stop_at_reward {target:g}) in each of "
        f"the last {len(window)} steps (their mean {sum(window) / len(window):.3f})"
    )


def target_line(rewards: list[float], config: LearnRunConfig) -> str | None:
    """At the end of a run that shipped all its steps: whether ``stop_at_reward`` was reached
    (None when the run has no target)."""
    target, window = config.run.stop_at_reward, config.run.stop_window
    if target is None:
        return None
    if not rewards:
        return f"stop_at_reward {target:g} not reached: no step was scored"
    last = rewards[-window:]
    return (
        f"stop_at_reward {target:g} not reached in {len(rewards)} steps: the last {len(last)} "
        f"averaged {sum(last) / len(last):.3f} (best step {max(rewards):.3f}); run again with "
        "the same --out and more --steps to go on"
    )


def write_ended(out: Path, last_shipped: int, ending: Ending) -> None:
    """``ended.json``: the run's last shipped step, why it stopped and the line that said so
    (the plot marks it; a trainer job tells why it exits)."""
    record = {"step": last_shipped, "stopped": ending.stopped, "message": ending.message}
    path = RunDirectory(out).ended
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)


def read_ended(out: Path) -> dict[str, Any] | None:
    """The run's ``ended.json``, None without one (or a damaged one)."""
    try:
        record = json.loads(RunDirectory(out).ended.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def resumes(ended: Mapping[str, Any] | None, max_steps: int | None) -> bool:
    """Whether the orchestrator that wrote ``ended`` (``ended.json``) stopped for the run to go
    on: stopped by a signal or its ``time_limit``, or after its ``--steps`` short of
    ``run.max_steps`` (unset: every invocation's ``--steps`` is a stretch of the run, which the
    closing lines tell how to resume). A reward target or convergence ends the run."""
    if not ended:
        return False
    stopped = ended.get("stopped")
    if stopped in ("signal", "time_limit"):
        return True
    return stopped == "steps" and (max_steps is None or ended.get("step") != max_steps)
