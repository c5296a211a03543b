"""`OrchestratorConfig`: how a run is shaped; it holds the rollout, sink and checkpoint
configs themselves."""

from __future__ import annotations

import logging

import attrs

from .._validation import at_least
from ..engines import SamplingParams
from ..errors import InvalidArgumentError
from ..rollout import RolloutConfig
from ..sink import CheckpointConfig, SinkConfig

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

    The orchestrator holds the configs of the layers it wires, each the one source of its
    knobs: ``rollout`` (:class:`~trio_rl.rollout.RolloutConfig`: concurrency, submission,
    routing keys, the sample deadline, failed groups), ``sink``
    (:class:`~trio_rl.sink.SinkConfig`: the staleness limit ``max_off_policy_steps``, the
    ``staleness`` rule, pruning, scoring) and ``checkpoint``
    (:class:`~trio_rl.sink.CheckpointConfig`: how many are kept, incremental ones).

    Its own fields are the knobs that span layers, which no lower config could hold alone.
    The step's shape: a step trains on ``batch_groups`` groups of ``group_size`` samples, which
    fixes the sink's batch size (``sink`` by default cuts ``batch_groups x group_size``
    samples, and a given one must cut as many) and the rollout budget's default
    (``rollout.max_groups_in_flight`` unset: ``2 x batch_groups``); ``seq_len`` and
    ``pad_to_multiple_of`` shape the packed batch. ``max_async_level`` is the ship gate: batch
    ``S`` ships only once the policy version is at least ``S - 1 - max_async_level``.
    ``sampling`` and ``seed`` are the run's, shared by the engine calls and the group factory.
    ``stale_admission`` and ``lockstep`` decide which groups start from the sink's staleness
    limit and the ship gate together (the orchestrator's :class:`StalenessAdmission`).
    """

    batch_groups: int = attrs.field(default=8, validator=at_least(1))
    group_size: int = attrs.field(default=8, validator=at_least(1))
    max_async_level: int = attrs.field(default=1, validator=at_least(0))
    seq_len: int = attrs.field(default=8192, validator=at_least(1))
    pad_to_multiple_of: int = attrs.field(default=1, validator=at_least(1))
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    seed: int | None = None
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
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)
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

    @property
    def group_budget(self) -> int:
        """The rollout budget in groups: ``rollout.max_groups_in_flight``, by default
        ``2 x batch_groups``."""
        budget = self.rollout.max_groups_in_flight
        return 2 * self.batch_groups if budget is None else budget
