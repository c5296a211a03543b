"""`OrchestratorConfig`: how a run is shaped; it holds the sink's own config."""

from __future__ import annotations

import logging
from typing import Literal

import attrs

from .._validation import at_least, one_of
from ..engines import SamplingParams
from ..errors import InvalidArgumentError
from ..rollout import (
    FailurePolicy,
    GroupGranularity,
    RoutingKeys,
    SampleBackfill,
    SubmissionPolicy,
)
from ..train import (
    SinkConfig,
)

logger = logging.getLogger("trio_rl.orchestrator")


def check_sink_fits_step(owner: str, batch_groups: int, group_size: int, sink: SinkConfig) -> None:
    """A config's sink cuts batches of one step's samples (``batch_groups x group_size``), else
    `InvalidArgumentError` naming ``owner``."""
    step = batch_groups * group_size
    if sink.batch_size != step:
        raise InvalidArgumentError(
            f"{owner}.sink.batch_size must be batch_groups x group_size = {step} "
            f"(the samples of one step), got {sink.batch_size}"
        )


@attrs.frozen(kw_only=True)
class OrchestratorConfig:
    """How a run is shaped (keyword arguments only).

    A step trains on ``batch_groups`` groups of ``group_size`` samples. ``max_groups_in_flight``
    (the budget ``B``, default ``2 x batch_groups``) bounds rollout concurrency under
    ``submission`` (``"sample"``: sample backfill; ``"group"``: group granularity).
    ``max_async_level`` is the ship gate: batch ``S`` ships only once the policy version is at
    least ``S - 1 - max_async_level``. ``sink`` is the train sink's own config
    (:class:`~trio_rl.train.SinkConfig`: the staleness limit ``max_off_policy_steps``, the
    ``staleness`` rule, pruning, scoring); by default the library's, cutting ``batch_groups x
    group_size`` samples per batch, which a given one must cut too. ``routing_keys``
    turns routing keys on (see :class:`~trio_rl.rollout.GroupFactory`): ``"group"`` is
    group-sticky routing, every sample of a group with one key, which the HTTP engines send as
    the ``X-SMG-Routing-Key`` header and :class:`~trio_rl.engines.EngineFleet` routes by.
    """

    batch_groups: int = attrs.field(default=8, validator=at_least(1))
    group_size: int = attrs.field(default=8, validator=at_least(1))
    max_groups_in_flight: int | None = attrs.field(default=None, validator=at_least(1))
    submission: Literal["sample", "group"] = "sample"
    max_async_level: int = attrs.field(default=1, validator=at_least(0))
    seq_len: int = attrs.field(default=8192, validator=at_least(1))
    pad_to_multiple_of: int = attrs.field(default=1, validator=at_least(1))
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    seed: int | None = None
    routing_keys: RoutingKeys = attrs.field(
        default="none", validator=one_of(("none", "sample", "group"))
    )
    failure: FailurePolicy = attrs.field(factory=FailurePolicy)
    checkpoint_keep: int = attrs.field(default=3, validator=at_least(1))
    #: Incremental checkpoints: a full one first, then per step a delta of what changed since
    #: the previous one, compacted into a full file in the background (see
    #: :class:`~trio_rl.train.CheckpointManager`). False: a full checkpoint every step.
    checkpoint_incremental: bool = True
    #: Deadline in seconds of each sample (generation plus its reward); expiry fails the sample
    #: and so its group, which then follows ``failure``. None: only the engine's own deadlines.
    sample_timeout: float | None = None
    #: Staleness-aware admission (:class:`StalenessAdmission`): a new group starts only if its
    #: samples can still ship within ``max_off_policy_steps`` (and before the run's last step),
    #: and a running group whose work can no longer be trained is cancelled early. False: the
    #: credit policy alone admits, and the sink drops what went stale.
    stale_admission: bool = True
    #: Reproducible rollouts (with ``stale_admission``): one group at a time, admitted only when
    #: the policy version is the one the async level prescribes for the batch it lands in
    #: (``S - 1 - max_async_level``), so a seeded run generates the same rollouts every time.
    #: The caller keeps the trainer from running ahead (see ``trio-rl run --deterministic``).
    lockstep: bool = False
    sink: SinkConfig = attrs.field(
        # max(1, ...): a bad batch_groups is reported by its own check, which attrs runs
        # after every default is made
        default=attrs.Factory(
            lambda self: SinkConfig(batch_size=max(1, self.batch_groups * self.group_size)),
            takes_self=True,
        )
    )

    @sink.validator
    def _check_sink(self, _: attrs.Attribute[SinkConfig], sink: SinkConfig) -> None:
        check_sink_fits_step("OrchestratorConfig", self.batch_groups, self.group_size, sink)

    def make_policy(self) -> SubmissionPolicy:
        return SampleBackfill() if self.submission == "sample" else GroupGranularity()
