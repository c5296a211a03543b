"""`RolloutConfig`: how a run's rollouts are driven (concurrency, submission, routing keys,
deadlines, failed groups)."""

from __future__ import annotations

from typing import Literal

import attrs

from .._validation import at_least, one_of, optional_positive_finite
from ._credits import GroupGranularity, SampleBackfill, SubmissionPolicy
from ._factory import RoutingKeys, SeedRule
from ._triage import FailurePolicy


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """How a run's rollouts are driven (keyword arguments only): what the orchestrator hands the
    fully-async driver (:func:`open_async_rollout`), the group runner and the group factory.

    The step's shape (``batch_groups`` groups of ``group_size`` samples) is not here: it is
    the orchestrator's, which sizes the sink's batches from it.

    Each knob's meaning is its field's ``metadata["help"]``: the ``[rollout]`` section of the
    configuration files (``trio_rl.config``) is generated from these fields (a nested config,
    ``failure``, contributes its fields as ``failure_<name>``), so a knob added here is a key
    there, with ``--set rollout.<key>=...``, and a line of the reference.
    """

    max_groups_in_flight: int | None = attrs.field(
        default=None,
        validator=at_least(1),
        metadata={"help": "rollout concurrency in groups, the budget B (unset: 2 x batch_groups)"},
    )
    submission: Literal["sample", "group"] = attrs.field(
        default="sample",
        validator=one_of(("sample", "group")),
        metadata={"help": "sample: sample backfill; group: group granularity"},
    )
    routing_keys: RoutingKeys = attrs.field(
        default="none",
        validator=one_of(("none", "sample", "group")),
        metadata={
            "help": "routing keys (see GroupFactory): group: every sample of a group with one "
            "key (sent as the X-SMG-Routing-Key header, routed by EngineFleet); sample: a key "
            "per sample; none"
        },
    )
    seeds: SeedRule = attrs.field(
        default="run",
        validator=one_of(("run", "group")),
        metadata={
            "help": "sampling seeds of a seeded run (see GroupFactory): run: every sample its "
            "own (seed + its slot in the run); group: sample i of every group seed + i, the "
            "reference's rule (a prompt seen again under the same weights draws the same "
            "completions)"
        },
    )
    sample_timeout: float | None = attrs.field(
        default=None,
        validator=optional_positive_finite,
        metadata={
            "help": "seconds each sample (generation and reward) may take; expiry fails the "
            "sample and so its group, which then follows the failure policy (unset: only the "
            "engine's own deadlines)"
        },
    )
    failure: FailurePolicy = attrs.field(factory=FailurePolicy)

    def make_policy(self) -> SubmissionPolicy:
        """The submission policy ``submission`` names."""
        return SampleBackfill() if self.submission == "sample" else GroupGranularity()
