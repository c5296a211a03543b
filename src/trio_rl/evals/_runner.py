"""`EvalRunner`: one evaluation of one policy version, ``k`` samples per held-out prompt."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence

import attrs
import trio

from .._validation import at_least, optional_positive_finite
from ..envs import EPISODE_KEY
from ..errors import EvalError
from ..rollout import (
    GenerateFn,
    GroupFactory,
    PriorityLane,
    SampleRewardFn,
    run_group,
)
from ..samples import Group, PolicyVersion, Prompt, Sample, SampleStatus
from ._estimators import PromptOutcome, mean_pass_at_k, mean_pass_hat_k
from ._result import EvalResult

__all__ = ["EvalProgress", "EvalRunner", "turns_of"]

logger = logging.getLogger("trio_rl.evals")


def turns_of(sample: Sample) -> int:
    """The turns of ``sample``'s episode (its ``metadata[EPISODE_KEY]["turns"]``, set by the
    episode runner; 1 for a single completion)."""
    episode = sample.metadata.get(EPISODE_KEY)
    turns = episode.get("turns", 1) if isinstance(episode, dict) else 1
    return turns if isinstance(turns, int) and turns >= 0 else 1


#: Told ``(prompts finished, prompts planned)`` after each prompt's samples ended.
EvalProgress = Callable[[int, int], None]


@attrs.define(slots=True, eq=False)
class _Tally:
    """What the finished prompts of one eval add up to."""

    outcomes: list[PromptOutcome] = attrs.field(factory=list)
    samples: int = 0
    truncated: int = 0
    failed: int = 0
    tokens: int = 0
    turns: int = 0
    versions: set[PolicyVersion] = attrs.field(factory=set)

    def add(self, group: Group, threshold: float) -> None:
        correct, reward_sum = 0, 0.0
        for s in group.samples:
            self.samples += 1
            self.tokens += len(s.completion_tokens)
            self.turns += turns_of(s)
            self.versions.update(s.policy_versions)
            if s.status is SampleStatus.TRUNCATED:
                self.truncated += 1
            if not s.status.is_finished:
                self.failed += 1  # failed, or aborted by the engine
                continue
            reward = s.reward if s.reward is not None else 0.0
            reward_sum += reward
            correct += reward >= threshold
        self.outcomes.append(PromptOutcome(group.size, correct, reward_sum))


@attrs.define(slots=True, eq=False, kw_only=True)
class EvalRunner:
    """Evaluates prompts ``k`` samples each and reduces them to one :class:`EvalResult`.

    ``generate`` fills one sample (e.g. ``engine_generate(engine, SamplingParams(...))`` with
    the eval's temperature); ``reward`` scores a finished sample (the run's, or the eval's
    own). A sample is *correct* when its reward is at least ``success_threshold``. A sample
    whose generation or reward raises (or outlives ``sample_timeout``) is *failed*: counted,
    never correct, and it fails nothing else.

    Work is admitted through ``lane``: a :class:`~trio_rl.rollout.PriorityLane` attached to the
    training driver's scheduler shares its budget and goes first; without one, the runner
    keeps at most ``max_samples_in_flight`` samples in flight on its own. ``seed`` seeds
    the samples as the training groups are seeded
    (:meth:`~trio_rl.rollout.GroupFactory.sample_seed`): each sample of an eval its own, the
    same at every eval.
    ``temperature`` is only recorded.
    """

    generate: GenerateFn
    reward: SampleRewardFn
    k: int = attrs.field(validator=at_least(1))
    success_threshold: float = 1.0
    lane: PriorityLane | None = None
    max_samples_in_flight: int = attrs.field(default=256, validator=at_least(1))
    sample_timeout: float | None = attrs.field(default=None, validator=optional_positive_finite)
    seed: int | None = None
    temperature: float | None = None
    #: Failures logged with their error (the rest are only counted).
    log_first: int = 3
    _failures: int = attrs.field(default=0, init=False)

    async def run(
        self,
        prompts: Sequence[Prompt],
        *,
        step: int,
        deadline: float | None = None,
        policy_version: PolicyVersion | None = None,
        progress: EvalProgress | None = None,
    ) -> EvalResult:
        """Evaluate ``prompts`` as the eval of ``step``; return its result.

        ``deadline`` (seconds from now) bounds the eval: when it passes, the samples in flight
        are cancelled and the result (status ``cut``) covers the prompts that finished.
        ``policy_version``, when given, is the version the caller pinned: a sample from any
        other raises :class:`~trio_rl.errors.EvalError`, as do samples from more than one
        version. Cancellation of the caller propagates (nothing is returned or recorded).
        """
        lane = self.lane if self.lane is not None else PriorityLane(self.max_samples_in_flight)
        factory = GroupFactory(self.k, seed=self.seed, seeds="run")
        tally = _Tally()
        started = trio.current_time()
        version = 0 if policy_version is None else policy_version

        async def one(group: Group) -> None:
            try:
                await run_group(group, self._generate, sample_reward=self._reward)
                tally.add(group, self.success_threshold)
                if progress is not None:
                    progress(len(tally.outcomes), len(prompts))
            finally:
                lane.release(self.k)

        asked = 0
        # every prompt's request is announced: the training driver admits nothing new until
        # the last of them is granted (the eval goes first)
        lane.announce(len(prompts))
        try:
            with trio.move_on_after(math.inf if deadline is None else deadline) as window:
                async with trio.open_nursery() as nursery:
                    for prompt in prompts:
                        group = factory.make(prompt, version)
                        await lane.acquire(self.k)
                        asked += 1
                        nursery.start_soon(one, group)
        finally:
            lane.announce(asked - len(prompts))
        if window.cancelled_caught:
            logger.warning(
                "eval of step %d cut at its deadline (%.0f s): %d of %d prompts finished",
                step,
                deadline,
                len(tally.outcomes),
                len(prompts),
            )
        return self._result(tally, step, len(prompts), window.cancelled_caught, started)

    def _result(
        self, tally: _Tally, step: int, planned: int, cut: bool, started: float
    ) -> EvalResult:
        if len(tally.versions) > 1:
            raise EvalError(
                f"the eval of step {step} was generated by policy versions "
                f"{sorted(tally.versions)}: the engines must keep one version during an eval "
                "(hold a VersionPin around weight loads and the eval)"
            )
        version = next(iter(tally.versions), None)
        n = tally.samples
        outcomes = tally.outcomes
        return EvalResult(
            step=step,
            policy_version=version,
            k=self.k,
            status="cut" if cut else "done",
            prompts=len(outcomes),
            prompts_planned=planned,
            samples=n,
            avg_at_k=sum(o.reward_sum for o in outcomes) / n if n else None,
            pass_at_1=mean_pass_at_k(outcomes, 1),
            pass_at_k=mean_pass_at_k(outcomes, self.k),
            pass_hat_k=mean_pass_hat_k(outcomes, self.k),
            truncated=tally.truncated / n if n else None,
            failed=tally.failed / n if n else None,
            completion_tokens_mean=tally.tokens / n if n else None,
            turns_mean=tally.turns / n if n else None,
            temperature=self.temperature,
            wall_s=trio.current_time() - started,
        )

    def _fail(self, sample: Sample, what: str, exc: Exception) -> None:
        sample.status = SampleStatus.FAILED
        self._failures += 1
        if self._failures <= self.log_first:
            logger.warning(
                "eval sample %d: %s failed (%s: %s); counted as failed",
                sample.index,
                what,
                type(exc).__name__,
                " ".join(str(exc).split()) or "(no message)",
            )

    async def _generate(self, sample: Sample) -> None:
        try:
            with trio.fail_after(math.inf if self.sample_timeout is None else self.sample_timeout):
                await self.generate(sample)
        except Exception as exc:
            self._fail(sample, "generation", exc)

    async def _reward(self, sample: Sample) -> float:
        try:
            value = self.reward(sample)
            if inspect.isawaitable(value):
                value = await value
            return float(value)
        except Exception as exc:
            self._fail(sample, "the reward", exc)
            return 0.0
