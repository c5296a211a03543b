"""`EvalConfig`: when a run evaluates, on what, and how (the ``[eval]`` section's knobs)."""

from __future__ import annotations

from typing import Literal

import attrs

from .._validation import at_least, one_of, positive_finite

__all__ = ["BUILTIN_HELD_OUT", "EvalConfig", "OnResume"]

#: ``redo``: an eval a kill cut short is run again on resume; ``drop``: it is recorded as
#: dropped (status ``dropped``, no figures) and the run goes on.
OnResume = Literal["redo", "drop"]

#: Held-out prompts a built-in task draws when ``num_examples`` is unset.
BUILTIN_HELD_OUT = 64


@attrs.frozen(kw_only=True)
class EvalConfig:
    """When a run evaluates its policy on held-out prompts, and how (keyword arguments only).

    Each knob's meaning is its field's ``metadata["help"]``: the ``[eval]`` section of the
    configuration files is generated from these fields. Every key may change when a run
    resumes (``may_change``): an eval never changes what the run trains.
    """

    prompts: str | None = attrs.field(
        default=None,
        metadata={
            "may_change": True,
            "help": "held-out records (JSONL, the [data] format), never trained on (unset: a "
            "built-in task's own held-out prompts; a run on its own [data] prompts then has "
            "no eval)",
        },
    )
    interval: int = attrs.field(
        default=10,
        validator=at_least(0),
        metadata={
            "may_change": True,
            "help": "evaluate every this many trained steps (0: not during training)",
        },
    )
    num_examples: int | None = attrs.field(
        default=None,
        validator=at_least(1),
        metadata={
            "may_change": True,
            "help": "prompts per eval, the first of the file (unset: all of them; a built-in "
            f"task draws {BUILTIN_HELD_OUT})",
        },
    )
    k: int = attrs.field(
        default=8,
        validator=at_least(1),
        metadata={
            "may_change": True,
            "help": "samples per prompt: the k of avg@k, pass@k and pass^k",
        },
    )
    temperature: float | None = attrs.field(
        default=None,
        validator=at_least(0.0),
        metadata={
            "may_change": True,
            "help": "sampling temperature of the eval (unset: the rollout's)",
        },
    )
    before_train: bool = attrs.field(
        default=True,
        metadata={
            "may_change": True,
            "help": "evaluate the initial policy (step 0) before training",
        },
    )
    on_resume: OnResume = attrs.field(
        default="redo",
        validator=one_of(("redo", "drop")),
        metadata={
            "may_change": True,
            "help": "an eval a kill cut short: redo (run it again on resume) or drop "
            "(record it as dropped)",
        },
    )
    reward: str | None = attrs.field(
        default=None,
        metadata={
            "may_change": True,
            "help": 'the eval\'s reward, "package.module:name" called as fn(record, '
            "completion) (unset: the run's [reward] function)",
        },
    )
    env: str | None = attrs.field(
        default=None,
        metadata={
            "may_change": True,
            "help": "the eval's environment, \"package.module:play\" (unset: the run's [env] "
            "function; with neither, single-turn samples scored by the reward)",
        },
    )
    success_threshold: float = attrs.field(
        default=1.0,
        metadata={
            "may_change": True,
            "help": "a sample counts as correct (pass@k, pass^k) when its reward is at least this",
        },
    )
    timeout: float = attrs.field(
        default=600.0,
        validator=positive_finite,
        metadata={
            "may_change": True,
            "help": "seconds one eval may take; past them it is cut and recorded as cut "
            "(status cut), never waited for",
        },
    )

    def due(self, step: int) -> bool:
        """Whether the policy trained for ``step`` steps is evaluated (0: before training)."""
        if step == 0:
            return self.before_train
        return self.interval > 0 and step % self.interval == 0

    def schedule(self, first: int, last: int) -> list[int]:
        """The steps in ``first .. last`` (inclusive) that are evaluated."""
        return [s for s in range(first, last + 1) if self.due(s)]
