"""Samples, groups, prompts and policy versions: the values every layer passes around.

This module is near the bottom of the package: it imports only the payload segment type and
the error tree.

A *sample* is one rollout of one prompt. A *group* is the ``n`` samples of one prompt
(GRPO-style); groups are submitted whole, carry an id that survives checkpoint and resume,
and remember the policy version that was current when they opened.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .errors import PayloadError
from .payloads import PayloadSegment

__all__ = [
    "Group",
    "PolicyVersion",
    "Prompt",
    "ResumedGroup",
    "Sample",
    "SampleStatus",
    "new_group_id",
]

#: A policy (weights) version. Versions start at 0 and only grow.
PolicyVersion = int


class SampleStatus(enum.Enum):
    """Where a sample stands.

    ``PENDING`` samples still need generating. ``COMPLETED`` (finish reason ``stop``) and
    ``TRUNCATED`` (finish reason ``length``) are normal finished samples. ``ABORTED`` means the
    engine or the agent gave up (finish reason ``abort``, e.g. during a weight update); a group
    holding one is rejected by group-level consumers. ``FAILED`` is a recoverable tool or API
    error recorded on the sample rather than raised.
    """

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        """True for the statuses that carry a usable rollout (completed or truncated)."""
        return self in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


def new_group_id() -> str:
    """A fresh group id (uuid4 hex); ids are strings so they survive any serialisation."""
    return uuid.uuid4().hex


def _tokens(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


def _segments(value: Sequence[PayloadSegment]) -> tuple[PayloadSegment, ...]:
    if not isinstance(value, (list, tuple)):
        raise PayloadError(
            f"Sample.payload must be a list or tuple of PayloadSegment, got {type(value).__name__}"
        )
    return tuple(value)


def _check_payload(sample: Sample, _: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    for i, seg in enumerate(value):
        if not isinstance(seg, PayloadSegment):
            index = getattr(sample, "index", "?")  # unset while __init__ still runs validators
            raise PayloadError(
                f"sample {index}: payload[{i}] must be a PayloadSegment, got {type(seg).__name__}"
            )


@attrs.frozen
class Prompt:
    """One task handed out by a data source.

    ``key`` identifies the prompt inside its source (it is what gets recycled and what a resumed
    group is matched on); ``tokens`` is the tokenised prompt; ``label`` is whatever the reward
    functions need (a reference answer, test cases, ...).
    """

    key: str
    tokens: tuple[int, ...] = attrs.field(converter=_tokens)
    label: Any = None
    env_name: str = "default"
    metadata: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.define(slots=True, eq=False)
class Sample:
    """One rollout. Mutable: the engine and reward functions fill it in place.

    ``index`` is unique across the run and ``group_index`` is shared by the samples of one
    group; drivers sort batches by the index of each group's first sample. ``loss_mask`` and
    ``logprobs`` align with ``completion_tokens`` (``loss_mask[i]`` is True when the model sampled
    token ``i``; environment tokens spliced into a multi-turn completion are False).
    ``policy_versions`` gets one entry per engine call that produced tokens of this sample.
    ``payload`` holds the by-handle payload segments of the sample's per-token side arrays
    (routed experts, ...), positions relative to its full sequence (prompt then completion);
    any sequence of :class:`~trio_rl.payloads.PayloadSegment` is stored as a tuple, anything
    else raises :class:`~trio_rl.errors.PayloadError` (on construction and on assignment).
    """

    index: int
    group_index: int
    prompt_tokens: tuple[int, ...] = attrs.field(converter=_tokens)
    completion_tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    loss_mask: list[bool] = attrs.field(factory=list)
    reward: float | None = None
    status: SampleStatus = SampleStatus.PENDING
    policy_versions: list[PolicyVersion] = attrs.field(factory=list)
    routing_key: str | None = None
    seed: int | None = None
    label: Any = None
    env_name: str = "default"
    metadata: dict[str, Any] = attrs.field(factory=dict)
    payload: tuple[PayloadSegment, ...] = attrs.field(
        default=(), converter=_segments, validator=_check_payload
    )

    @property
    def oldest_version(self) -> PolicyVersion | None:
        """The oldest policy version that produced any token of this sample, or None."""
        return min(self.policy_versions) if self.policy_versions else None

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion length."""
        return len(self.prompt_tokens) + len(self.completion_tokens)

    def reset_for_retry(self) -> None:
        """Forget everything generated; keep identity, prompt, label and routing key.

        The payload segments go too: they describe the forgotten tokens. Keeping
        ``routing_key`` sends a retried sample back to the same engine, where its prefix is still
        cached.
        """
        self.completion_tokens = []
        self.logprobs = []
        self.loss_mask = []
        self.reward = None
        self.status = SampleStatus.PENDING
        self.policy_versions = []
        self.payload = ()


@attrs.define(slots=True, eq=False)
class Group:
    """The ``n`` samples of one prompt, submitted and judged as a whole."""

    group_id: str
    prompt: Prompt
    samples: list[Sample]
    policy_version_at_start: PolicyVersion = 0

    @property
    def group_index(self) -> int:
        return self.samples[0].group_index

    @property
    def first_index(self) -> int:
        """Index of the first sample: the sort key of a batch."""
        return self.samples[0].index

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def oldest_version(self) -> PolicyVersion | None:
        """The oldest version that produced any token of any sample, or None if none did."""
        versions = [v for s in self.samples for v in s.policy_versions]
        return min(versions) if versions else None

    def staleness(self, current: PolicyVersion) -> int:
        """Current version minus the oldest version behind any token of the group (0 if none)."""
        oldest = self.oldest_version
        return 0 if oldest is None else max(0, current - oldest)

    @property
    def has_aborted(self) -> bool:
        return any(s.status is SampleStatus.ABORTED for s in self.samples)


@attrs.define(slots=True, eq=False)
class ResumedGroup:
    """An open group restored from a checkpoint.

    It continues with the same ``group_id``, prompt and ``policy_version_at_start``; the members
    in ``arrived`` are kept and only the ``missing`` ones are generated. Drivers schedule resumed
    groups before any new prompt. A resumed group with nothing missing dispatches nothing: it is
    complete as it stands and is scored exactly once with exactly its members.
    """

    group_id: str
    prompt: Prompt
    group_size: int
    arrived: list[Sample] = attrs.field(factory=list)
    policy_version_at_start: PolicyVersion = 0

    @property
    def missing(self) -> int:
        return max(0, self.group_size - len(self.arrived))
