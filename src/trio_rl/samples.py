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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from .errors import PayloadError
from .payloads import PayloadSegment

__all__ = [
    "Group",
    "GroupBook",
    "OpenGroup",
    "RESUMED_AT",
    "PolicyVersion",
    "Prompt",
    "Sample",
    "SampleStatus",
    "new_group_id",
]

#: A policy (weights) version. Versions start at 0 and only grow.
PolicyVersion = int

# ``Sample.metadata`` key of a member generated for a resumed group: the policy version its
# attempt started with (the group's own start is older). The ``"group_start"`` staleness rule
# judges such a member by it, as prime-rl judges each episode by its own dispatch version; it
# is kept through checkpoints with the rest of the metadata. (Documented in docs/api.md.)
RESUMED_AT = "resumed_at_version"


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


@attrs.define(slots=True, eq=False, on_setattr=attrs.setters.NO_OP, repr=False)
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
    # The four per-sample lists are made on first read (None until then): a sample waiting for
    # its engine has none, and an empty list is still an object the cyclic GC tracks and walks
    # (4 of the ~5 tracked objects per in-flight sample).
    _completion_tokens: list[int] | None = attrs.field(default=None, alias="completion_tokens")
    _logprobs: list[float] | None = attrs.field(default=None, alias="logprobs")
    _loss_mask: list[bool] | None = attrs.field(default=None, alias="loss_mask")
    reward: float | None = None
    status: SampleStatus = SampleStatus.PENDING
    _policy_versions: list[PolicyVersion] | None = attrs.field(
        default=None, alias="policy_versions"
    )
    routing_key: str | None = None
    seed: int | None = None
    label: Any = None
    env_name: str = "default"
    metadata: dict[str, Any] = attrs.field(factory=dict)
    # No attribute hooks on the class: attrs would route every assignment (``status``, ``reward``,
    # several per sample on the hot path) through a Python-level ``__setattr__``; ``payload``,
    # the one checked field, is a property over this slot instead.
    _payload: tuple[PayloadSegment, ...] = attrs.field(
        default=(), converter=_segments, validator=_check_payload, alias="payload"
    )

    @property
    def completion_tokens(self) -> list[int]:
        value = self._completion_tokens
        if value is None:
            value = self._completion_tokens = []
        return value

    @completion_tokens.setter
    def completion_tokens(self, value: list[int]) -> None:
        self._completion_tokens = value

    @property
    def logprobs(self) -> list[float]:
        value = self._logprobs
        if value is None:
            value = self._logprobs = []
        return value

    @logprobs.setter
    def logprobs(self, value: list[float]) -> None:
        self._logprobs = value

    @property
    def loss_mask(self) -> list[bool]:
        value = self._loss_mask
        if value is None:
            value = self._loss_mask = []
        return value

    @loss_mask.setter
    def loss_mask(self, value: list[bool]) -> None:
        self._loss_mask = value

    @property
    def policy_versions(self) -> list[PolicyVersion]:
        value = self._policy_versions
        if value is None:
            value = self._policy_versions = []
        return value

    @policy_versions.setter
    def policy_versions(self, value: list[PolicyVersion]) -> None:
        self._policy_versions = value

    def __repr__(self) -> str:
        # attrs' repr, with the public names and an unmade list shown as the empty list it reads
        # as (reading them here would make them).
        parts = []
        for field in _SAMPLE_FIELDS:
            value = getattr(self, field.name)
            parts.append(
                f"{field.alias}={[] if value is None and field.name in _LAZY else value!r}"
            )
        return f"Sample({', '.join(parts)})"

    @property
    def payload(self) -> tuple[PayloadSegment, ...]:
        return self._payload

    @payload.setter
    def payload(self, value: Sequence[PayloadSegment]) -> None:
        segments = _segments(value)
        _check_payload(self, _PAYLOAD_FIELD, segments)
        self._payload = segments

    @property
    def oldest_version(self) -> PolicyVersion | None:
        """The oldest policy version that produced any token of this sample, or None."""
        versions = self._policy_versions
        return min(versions) if versions else None

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
        self._completion_tokens = self._logprobs = self._loss_mask = None
        self.reward = None
        self.status = SampleStatus.PENDING
        self._policy_versions = None
        self._payload = ()


_SAMPLE_FIELDS = attrs.fields(Sample)
_PAYLOAD_FIELD = _SAMPLE_FIELDS._payload
_LAZY = frozenset({"_completion_tokens", "_logprobs", "_loss_mask", "_policy_versions"})


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
        # The stored lists, not the properties: reading those would make an empty list for
        # every sample that has none (the consumer asks this of every group it takes).
        versions = [v for s in self.samples if s._policy_versions for v in s._policy_versions]
        return min(versions) if versions else None

    def staleness(self, current: PolicyVersion) -> int:
        """Current version minus the oldest version behind any token of the group (0 if none)."""
        oldest = self.oldest_version
        return 0 if oldest is None else max(0, current - oldest)

    @property
    def has_aborted(self) -> bool:
        return any(s.status is SampleStatus.ABORTED for s in self.samples)


def _sample_list(value: Iterable[Sample]) -> list[Sample]:
    return list(value)


def _arrived_indices(group: OpenGroup) -> set[int]:
    return {s.index for s in group.arrived}


@attrs.define(slots=True, eq=False)
class OpenGroup:
    """A group in progress: the one shape of an open group, from submission to restore.

    The train sink's open-group book holds one per group the rollout layer has opened (the
    driver reports it through :class:`GroupBook`); a checkpoint saves it as it is (id, prompt,
    size, start version, arrived members); a restore hands it back to the rollout layer, which
    continues it under the same ``group_id``, prompt and ``policy_version_at_start``: the members
    in ``arrived`` (finished: COMPLETED or TRUNCATED) are kept and only the ``missing`` ones are
    generated. A group with nothing missing dispatches nothing: it is complete as it stands and
    is scored exactly once with exactly its members.

    The keyword-only fields are the book's live tally of the current attempt, never saved (what
    they count is settled already, and a resumed group regenerates those members): ``seen``
    holds the index of every sample that arrived in any status, ``failed`` and ``cancelled``
    count members that ended without a usable sample, ``aborted`` says one was aborted.
    """

    group_id: str
    prompt: Prompt
    group_size: int
    arrived: list[Sample] = attrs.field(factory=list, converter=_sample_list)
    policy_version_at_start: PolicyVersion = 0
    seen: set[int] = attrs.field(
        default=attrs.Factory(_arrived_indices, takes_self=True), kw_only=True
    )
    failed: int = attrs.field(default=0, kw_only=True)
    cancelled: int = attrs.field(default=0, kw_only=True)
    aborted: bool = attrs.field(default=False, kw_only=True)

    @property
    def missing(self) -> int:
        """How many members a resume generates: the group size minus the arrived ones."""
        return max(0, self.group_size - len(self.arrived))

    @property
    def complete(self) -> bool:
        """Every member of the attempt ended: arrived, failed or cancelled."""
        return len(self.arrived) + self.failed + self.cancelled >= self.group_size


class GroupBook(Protocol):
    """The one owner of work in flight, as the async rollout driver reports to it.

    The train sink's open-group book implements it (``sink.book``); the driver calls it on the
    event loop, and no method may block or raise for a well-formed report. Every sample of every
    attempt is dispatched once and settles once in the owner's books:

    * ``group_opened`` -- ``group`` was submitted (new, resumed or retried); a group the book
      already holds open (a restored one) stays as it is.
    * ``members_arrived`` -- finished members (COMPLETED or TRUNCATED) of an open group; the
      book holds them (the same objects: a group reward fills their ``reward`` in place).
    * ``attempt_failed`` -- the attempt failed (raised): every member of it, held or not yet
      arrived, settles as failed; the group stays open, empty, for a retry. ``error`` is the
      attempt's exception (a ``GroupFailedError``), for counting failures by type.
    * ``group_discarded`` -- the group will not reach the consumer (``reason``: ``"failed"``
      after its last attempt, with its ``error``, ``"aborted"``, ``"filtered"``, ``"stale"``);
      the book settles what it holds and closes it.

    A group that reaches the consumer is closed by the consumer handing it to the owner (the
    sink's ``add_group``), which scores it exactly once.
    """

    def group_opened(self, group: Group) -> None: ...

    def members_arrived(self, group: Group, samples: Sequence[Sample]) -> None: ...

    def attempt_failed(self, group: Group, error: BaseException | None = None) -> None: ...

    def group_discarded(
        self, group: Group, reason: str, error: BaseException | None = None
    ) -> None: ...
