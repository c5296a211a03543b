"""What the harness tests: the pluggable pieces of a rollout, as factories."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from .._validation import at_least
from ..engines import Engine
from ..errors import InvalidArgumentError
from ..rollout import (
    CreditScheduler,
    CreditView,
    GenerateFn,
    GroupGranularity,
    GroupRunner,
    SampleBackfill,
    SubmissionPolicy,
    engine_generate,
)
from ._engine import FateKind
from ._recorder import RunnerLike

__all__ = ["HANG_TIMEOUT", "PolicyFactory", "RolloutSubject", "default_generate"]

#: Makes a fresh submission policy.
PolicyFactory = Callable[[], SubmissionPolicy]

#: Virtual seconds after which the default generate function gives up on an engine call
#: (``trio.TooSlowError``), so a hanging sample cannot hold a run forever.
HANG_TIMEOUT = 60.0


def default_generate(engine: Engine) -> GenerateFn:
    """:func:`~trio_rl.rollout.engine_generate` with a :data:`HANG_TIMEOUT` deadline."""
    return engine_generate(engine, timeout=HANG_TIMEOUT)


def _all_kinds() -> tuple[FateKind, ...]:
    return ("stop", "length", "abort", "raise", "hang")


@attrs.frozen
class RolloutSubject:
    """The pieces under test; each defaults to the library's own.

    ``policy()`` makes a :class:`~trio_rl.rollout.SubmissionPolicy` (a tuple of factories:
    each example draws one; the default draws both library policies); ``runner(generate)``
    makes a group runner (anything with ``async run(group, on_sample_done)``, like
    :class:`~trio_rl.rollout.GroupRunner`) around the harness's generate function;
    ``generate(engine)`` makes the per-sample generate function on top of the harness's
    :class:`~trio_rl.testing.ScriptedEngine`; ``scheduler(policy, group_size)`` makes the
    credit scheduler (used by the credit-loop property only; the real drivers build their own).

    ``rule`` is the admission rule the policy must follow at every decision point; None means
    the library's rule for :class:`~trio_rl.rollout.SampleBackfill` (admit while
    ``in_flight + group_size <= budget * group_size``) and
    :class:`~trio_rl.rollout.GroupGranularity` (while ``pending_groups < budget``), and no rule
    for other policies. ``kinds`` are
    the fates the adversary may give an engine call. A ``hang`` needs a deadline somewhere
    (the default generate function has one); leave it out if your generate function has none,
    or every hang is reported as a deadlock. ``max_steps`` bounds each schedule.
    """

    policy: PolicyFactory | tuple[PolicyFactory, ...] = (SampleBackfill, GroupGranularity)
    runner: Callable[[GenerateFn], RunnerLike] = GroupRunner
    generate: Callable[[Engine], GenerateFn] = default_generate
    scheduler: Callable[[SubmissionPolicy, int], CreditScheduler] = CreditScheduler
    rule: Callable[[CreditView], bool] | None = None
    kinds: tuple[FateKind, ...] = attrs.field(factory=_all_kinds)
    #: The longest schedule an example draws (steps before the run is let finish).
    max_steps: int = attrs.field(default=16, validator=at_least(0))

    @property
    def policies(self) -> tuple[PolicyFactory, ...]:
        """The policy factories; with several, each example draws one."""
        return self.policy if isinstance(self.policy, tuple) else (self.policy,)

    @kinds.validator
    def _check_kinds(
        self, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
    ) -> None:
        if not value:
            raise InvalidArgumentError("RolloutSubject.kinds must name at least one fate kind")
