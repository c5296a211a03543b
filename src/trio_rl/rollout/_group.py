"""The group runner: one nursery per group, one task per sample.

:func:`run_group` is the primitive; :class:`GroupRunner` bundles its options so drivers (and the
testing harness) can pass "how to run a group" around as one value. :func:`engine_generate`
builds the default generate function on top of an :class:`~trio_rl.engines.Engine`.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import attrs
import trio

from .._validation import check_optional_positive_finite, optional_positive_finite
from ..engines import AbortSignal, Engine, GenerateRequest, SamplingParams
from ..samples import Group, GroupBook, Sample, SampleStatus
from ._credits import CreditScheduler, GroupOutcome, GroupStatus
from ._errors import GroupFailedError

__all__ = [
    "GenerateFn",
    "GroupRewardFn",
    "GroupRunner",
    "SampleRewardFn",
    "current_abort",
    "engine_generate",
    "pending_samples",
    "reopen_aborted",
    "reward_started",
    "run_group",
    "run_reporting",
]

#: Fills one sample in place (tokens, logprobs, loss mask, status, policy versions). Raising
#: fails the group. Must be cancellable.
GenerateFn = Callable[[Sample], Awaitable[None]]
#: Scores one finished sample; sync or async. The result is stored in ``sample.reward``.
SampleRewardFn = Callable[[Sample], float | Awaitable[float]]
#: Scores a whole group after every sample finished; sync or async; returns one reward per
#: sample, in group order.
GroupRewardFn = Callable[[Group], Sequence[float] | Awaitable[Sequence[float]]]

#: The abort event of the group being run (set by `run_group` for its sample tasks).
_ABORT: contextvars.ContextVar[AbortSignal | None] = contextvars.ContextVar(
    "trio_rl_rollout_abort", default=None
)


#: The credit release of the sample whose reward this task runs (set by the group runner
#: around the reward call when the credit reporter supports it).
_SCORING: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "trio_rl_rollout_scoring", default=None
)


def reward_started() -> None:
    """Called by a sample reward once its call runs where it holds nothing the engine needs
    (a worker process of its own, :class:`~trio_rl.workers.WorkerPool`): the sample's credit
    comes back to the driver now instead of when the reward returns, so a call that hangs
    until its timeout does not hold a share of the rollout budget. A call still waiting for
    a worker keeps its credit (a saturated pool holds the rollout back, as a slow reward
    should). Does nothing outside a reward call run by `run_group`, or a second time."""
    release = _SCORING.get()
    if release is not None:
        _SCORING.set(None)
        release()


def current_abort() -> AbortSignal | None:
    """The soft-stop signal of the group this task generates for, or None.

    A driver sets it (the sync driver with ``partial_rollouts``, once its batch is full) to ask
    every running sample to stop and keep what it has: a generate function should end its
    engine call and record the partial output with status ABORTED. `engine_generate` passes it
    to the engine as :attr:`GenerateRequest.abort`; custom generate functions read it here and
    wrap their waits in ``signal.scope()``.
    """
    return _ABORT.get()


_STATUS_BY_FINISH = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def engine_generate(
    engine: Engine,
    params: SamplingParams | None = None,
    *,
    timeout: float | None = None,
) -> GenerateFn:
    """The default generate function: one :class:`GenerateRequest` per sample.

    The sample's seed (if set) overrides ``params.seed`` and its routing key is passed along.
    The completion's tokens and logprobs are appended (loss mask True), its policy version is
    appended to ``sample.policy_versions`` (not for an aborted call that produced no token),
    and the finish reason sets the status: ``stop`` -> COMPLETED, ``length`` -> TRUNCATED,
    ``abort`` -> ABORTED.

    **Continuation.** A sample that already holds completion tokens (a partial rollout stopped
    by an abort and reopened) is continued: the request's prompt is the prompt plus those
    tokens and ``max_tokens`` is what is left of ``params.max_tokens`` (none left: TRUNCATED
    without a call). The new span is appended, so ``policy_versions`` gets one entry per span.

    **Abort.** The driver's abort event (:func:`current_abort`) travels as
    :attr:`GenerateRequest.abort`: the engine returns its partial output with finish reason
    ``abort``. A sample whose abort is already set when it starts is marked ABORTED without a
    call.

    ``timeout`` (seconds) bounds each engine call; expiry raises ``trio.TooSlowError``, which
    fails the sample. Without it the call is bounded only by the engine's own deadline
    (``OpenAICompatibleEngine`` has one) or by ``GroupRunner.sample_timeout``; set one of them
    in production. On cancellation the engine call is abandoned and the sample is left
    untouched.
    """
    check_optional_positive_finite("engine_generate", "timeout", timeout)
    base = params if params is not None else SamplingParams()
    # Request ids: a random prefix per generate function and a counter (no uuid4 per call).
    request_prefix = uuid.uuid4().hex[:12]
    request_numbers = itertools.count()

    async def generate(sample: Sample) -> None:
        abort = _ABORT.get()
        if abort is not None and abort.is_set():
            sample.status = SampleStatus.ABORTED
            return
        done = len(sample.completion_tokens)
        left = base.max_tokens - done
        if left < 1:
            sample.status = SampleStatus.TRUNCATED
            return
        sample_params = base
        if sample.seed is not None or done:
            seed = base.seed if sample.seed is None else sample.seed
            sample_params = attrs.evolve(base, seed=seed, max_tokens=left)
        request = GenerateRequest(
            prompt_tokens=sample.prompt_tokens + tuple(sample.completion_tokens),
            params=sample_params,
            routing_key=sample.routing_key,
            request_id=f"{sample.index}-{request_prefix}-{next(request_numbers)}",
            sample_index=sample.index,
            abort=abort,
        )
        if timeout is None:
            completion = await engine.generate(request)
        else:
            with trio.fail_after(timeout):
                completion = await engine.generate(request)
        sample.completion_tokens.extend(completion.tokens)
        sample.logprobs.extend(completion.logprobs)
        sample.loss_mask.extend([True] * len(completion.tokens))
        if completion.tokens or completion.finish_reason != "abort":
            sample.policy_versions.append(completion.policy_version)
        sample.status = _STATUS_BY_FINISH[completion.finish_reason]

    return generate


#: The name of every sample task (trio would otherwise format one per spawn).
_SAMPLE_TASK = "trio_rl.rollout.sample"

_T = TypeVar("_T")
_S = TypeVar("_S")


async def _call(fn: Callable[[_S], _T | Awaitable[_T]], arg: _S) -> _T:
    result = fn(arg)
    if inspect.isawaitable(result):
        return await result
    return result


@attrs.define(slots=True, eq=False)
class _GroupRun:
    """One group's sample tasks: their options and shared state, one object per group (a
    closure would be a function and a cell per variable, all traced by the collector)."""

    generate: GenerateFn
    on_sample_done: Callable[[Sample], None] | None
    sample_reward: SampleRewardFn | None
    sample_timeout: float | None
    #: ``on_sample_done.generated``, if it has one and a reward runs: the sample's credit
    #: back before the reward returned, when the reward calls `reward_started`.
    on_generated: Callable[[Sample], None] | None = None
    scope: trio.CancelScope | None = None
    #: Made at the first failure: most groups never fail, and an empty list per group is
    #: one more object for the collector to walk while the group runs.
    failures: list[tuple[int | None, Exception]] | None = None
    cancelled: bool = False

    async def sample_task(self, sample: Sample) -> None:
        try:
            # No cancel scope without a timeout: a scope per sample is a large share of the
            # per-sample scheduling cost.
            if self.sample_timeout is None:
                await self.generate(sample)
                if self.sample_reward is not None and sample.status.is_finished:
                    await self._score(sample, self.sample_reward)
            else:
                with trio.fail_after(self.sample_timeout):
                    await self.generate(sample)
                    if self.sample_reward is not None and sample.status.is_finished:
                        await self._score(sample, self.sample_reward)
        except Exception as exc:  # a real failure
            if self.failures is None:
                self.failures = []
            self.failures.append((sample.index, exc))
            if self.scope is not None:
                self.scope.cancel()
        except trio.Cancelled:
            # Ended here, not re-raised: a cancelled child that raises costs trio an exception
            # group, a formatted cancel reason and a scope recalculation per task (most of a
            # shutdown's cost). The group task re-raises it once, at its checkpoint.
            self.cancelled = True
        finally:
            if self.on_sample_done is not None:
                self.on_sample_done(sample)

    async def _score(self, sample: Sample, reward: SampleRewardFn) -> None:
        on_generated = self.on_generated
        if on_generated is None:
            sample.reward = float(await _call(reward, sample))
            return
        # the reward may give the sample's credit back early (`reward_started`)
        token = _SCORING.set(lambda: on_generated(sample))
        try:
            sample.reward = float(await _call(reward, sample))
        finally:
            _SCORING.reset(token)


#: Sample tasks started between two checkpoints: a group of any size lets a cancellation (a
#: deadline around a resume, say) in after at most this many starts; real groups never reach it.
START_BATCH = 256


async def _start_samples(nursery: trio.Nursery, run: _GroupRun, group: Group) -> None:
    """One task per PENDING sample, START_BATCH at a time with a checkpoint between batches. A
    function of its own: the bound methods and the list it uses die with its frame instead of
    living in the group task's for the group's lifetime.

    Cancelled between two batches, it starts no more and returns with ``run.cancelled`` set
    (the started tasks are cancelled with the nursery; `run_group` re-raises at its checkpoint):
    no exception group for a cancellation."""
    start, sample_task = nursery.start_soon, run.sample_task
    started = 0
    for sample in group.samples:
        if sample.status is SampleStatus.PENDING:
            # A name: without one trio formats the function's qualified name per task.
            start(sample_task, sample, name=_SAMPLE_TASK)
            started += 1
            if started % START_BATCH == 0:
                try:
                    await trio.lowlevel.checkpoint()
                except trio.Cancelled:
                    run.cancelled = True
                    return


async def run_group(
    group: Group,
    generate: GenerateFn,
    *,
    on_sample_done: Callable[[Sample], None] | None = None,
    sample_reward: SampleRewardFn | None = None,
    group_reward: GroupRewardFn | None = None,
    sample_timeout: float | None = None,
    abort: AbortSignal | None = None,
) -> Group:
    """Generate and score one group; return it (the same object, filled in place).

    Only samples whose status is ``PENDING`` are generated; the others (for example the
    arrived members of a resumed group) are kept as they are, so a group with nothing pending
    starts no task at all. Each generated sample runs in its own task in one nursery:
    ``generate(sample)``, then ``sample_reward`` if the sample finished (COMPLETED or
    TRUNCATED). ``on_sample_done(sample)`` is called exactly once per started sample task, in
    its ``finally``, whatever the outcome (result, exception, cancellation); it must be
    synchronous and must not raise. If it has a ``generated(sample)`` method (the drivers'
    `SampleReport` does), a reward that calls `reward_started` has it called then, once: the
    sample's credit comes back while its reward still runs, and ``on_sample_done`` follows at
    the end as always. ``sample_timeout`` bounds each sample task (expiry is a failure,
    ``trio.TooSlowError``).

    After every sample finished, ``group_reward`` (if any) runs once over the whole group,
    unless a sample is ABORTED (such groups are rejected by consumers anyway).

    Failure: the first sample that raises cancels its siblings; the nursery waits for all of
    them (every ``on_sample_done`` has run), then :class:`GroupFailedError` is raised with the first
    failure as ``__cause__`` and all failures in ``.failures``. Siblings' cancellations are not
    failures, and no ``ExceptionGroup`` escapes. A failing group reward raises
    :class:`GroupFailedError` too. Group reward does not run on failure.

    ``abort`` is the soft stop: the sample tasks see it as :func:`current_abort` (and
    `engine_generate` hands it to the engine), so once it is set they end with what they have
    (ABORTED, partial output kept) and the group returns normally, without a group reward.
    None keeps the signal of the calling task (what `run_reporting` set).

    Cancellation from outside: the sample tasks are cancelled and settled (each calls
    ``on_sample_done``) and ``trio.Cancelled`` propagates; no reward runs.
    """
    generated = None if sample_reward is None else getattr(on_sample_done, "generated", None)
    run = _GroupRun(generate, on_sample_done, sample_reward, sample_timeout, generated)
    if any(s.status is SampleStatus.PENDING for s in group.samples):
        # Already cancelled (a driver shutting down before this group's task first ran): start
        # no sample task just to cancel it; the group's end returns the untaken credits.
        await trio.lowlevel.checkpoint_if_cancelled()
        # the sample tasks inherit this task's context, the signal included
        token = _ABORT.set(abort) if abort is not None else None
        try:
            async with trio.open_nursery() as nursery:
                run.scope = nursery.cancel_scope
                await _start_samples(nursery, run, group)
        finally:
            if token is not None:
                _ABORT.reset(token)
        if run.cancelled:
            # Raises Cancelled if the cancellation came from outside (it is still in force);
            # a sibling failure's cancellation ended with the nursery and falls through.
            await trio.lowlevel.checkpoint()
    failures = run.failures
    if failures:
        error = GroupFailedError(group, failures)
        raise error from failures[0][1]
    if group_reward is not None and not group.has_aborted:
        try:
            rewards = list(await _call(group_reward, group))
            if len(rewards) != group.size:
                raise ValueError(
                    f"group reward returned {len(rewards)} rewards for {group.size} samples"
                )
        except Exception as exc:
            raise GroupFailedError(group, [(None, exc)]) from exc
        for sample, reward in zip(group.samples, rewards, strict=True):
            sample.reward = float(reward)
    return group


@attrs.frozen
class GroupRunner:
    """How to run one group: the generate function and the reward functions.

    Calling :meth:`run` is :func:`run_group` with these options.
    """

    generate: GenerateFn
    sample_reward: SampleRewardFn | None = None
    group_reward: GroupRewardFn | None = None
    #: Deadline in seconds for each sample task (None: no deadline of its own).
    sample_timeout: float | None = attrs.field(default=None, validator=optional_positive_finite)

    async def run(
        self, group: Group, on_sample_done: Callable[[Sample], None] | None = None
    ) -> Group:
        """Run ``group`` with these options (see `run_group`).

        Cancellation: as `run_group`: the sample tasks are cancelled and settled (each calls
        ``on_sample_done``), no reward runs, and `trio.Cancelled` propagates.
        """
        return await run_group(
            group,
            self.generate,
            on_sample_done=on_sample_done,
            sample_reward=self.sample_reward,
            group_reward=self.group_reward,
            sample_timeout=self.sample_timeout,
        )


async def run_reporting(
    runner: GroupRunner,
    group: Group,
    scheduler: CreditScheduler,
    abort: AbortSignal | None = None,
) -> None:
    """Run ``group`` and report everything to ``scheduler``; the drivers' group task.

    ``abort`` (the soft stop of partial rollouts) is set as :func:`current_abort` for this
    task, so the runner's sample tasks inherit it; any object with ``run(group,
    on_sample_done=...)`` can be the runner.

    Each started sample reports :class:`SampleDone` in its ``finally``; then, in this task's
    ``finally``, one :class:`GroupDone` carries the outcome: COMPLETED, FAILED (with the
    :class:`GroupFailedError`), or CANCELLED (cancelled from outside; ``trio.Cancelled``
    propagates). Applying the ``GroupDone`` returns any credit no sample returned. A
    :class:`GroupFailedError` is reported, not raised; any other exception (a bug) propagates.
    A group whose task starts after its driver began closing (``scheduler.winding_down``) is not
    run: its outcome is CANCELLED at once.
    """
    status = GroupStatus.CANCELLED
    error: GroupFailedError | None = None
    if abort is not None:
        _ABORT.set(abort)  # this task's own context: nothing outside it sees the signal
    if refused_while_closing(scheduler, group):
        return
    try:
        await runner.run(group, on_sample_done=SampleReport(scheduler, group))
        status = GroupStatus.COMPLETED
    except GroupFailedError as exc:
        status, error = GroupStatus.FAILED, exc
    finally:
        scheduler.group_done(GroupOutcome(group, status, error))


@attrs.define(slots=True, eq=False)
class SampleReport:
    """A group task's ``on_sample_done``: the sample's credit back to the scheduler and, with a
    book, a finished member to it. One slotted object per group, not a closure (a function and
    a cell per captured name, all walked by the cyclic collector while the group runs)."""

    scheduler: CreditScheduler
    group: Group
    book: GroupBook | None = None
    # Bound once per group: each finished sample then costs one call and one channel send.
    _report: Callable[[str], None] = attrs.field(init=False, repr=False)
    _group_id: str = attrs.field(init=False, repr=False)
    #: Indices of the samples whose credit came back when their reward call started in a
    #: worker (made at the first: a group without such a reward never needs it).
    _scoring: set[int] | None = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._report = self.scheduler.sample_reporter()
        self._group_id = self.group.group_id

    def generated(self, sample: Sample) -> None:
        """The sample's generation ended and its reward call runs in a worker of its own
        (`reward_started`): its credit comes back now, so a reward call that hangs holds
        none of the rollout budget; the member itself arrives when the reward returned."""
        if self._scoring is None:
            self._scoring = set()
        self._scoring.add(sample.index)
        self._report(self._group_id)

    def __call__(self, sample: Sample) -> None:
        scoring = self._scoring
        if scoring is None or sample.index not in scoring:
            self._report(self._group_id)
        if self.book is not None and sample.status.is_finished:
            self.book.members_arrived(self.group, (sample,))


def refused_while_closing(scheduler: CreditScheduler, group: Group) -> bool:
    """If the group's driver began closing (``scheduler.winding_down``) before the group task
    first ran, report the group CANCELLED (its credits come back) and return True: the task
    ends without starting a sample. The drivers' group tasks call it first."""
    if not scheduler.winding_down:
        return False
    scheduler.group_done(GroupOutcome(group, GroupStatus.CANCELLED, None))
    return True


def pending_samples(group: Group) -> int:
    """The number of samples :func:`run_group` would generate: the credits the group takes."""
    return sum(1 for s in group.samples if s.status is SampleStatus.PENDING)


def reopen_aborted(group: Group) -> int:
    """Make the ABORTED samples of a kept partial group PENDING again, keeping their output.

    Their tokens, logprobs, loss mask, policy versions and metadata stay, so `engine_generate`
    continues each one from where it stopped; the reward is cleared. Returns how many samples
    were reopened (the credits the group takes when it is submitted again).
    """
    reopened = 0
    for sample in group.samples:
        if sample.status is SampleStatus.ABORTED:
            sample.status = SampleStatus.PENDING
            sample.reward = None
            reopened += 1
    return reopened
