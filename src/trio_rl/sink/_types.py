"""TrainingSample: one trainable sequence, in process only (never on the wire)."""

from __future__ import annotations

import attrs

from ..samples import PolicyVersion
from ..wire import MMRefs, PayloadSegment, RoutedExperts, SamplingMask

__all__ = ["TrainingSample"]


@attrs.define(slots=True, eq=False)
class TrainingSample:
    """A scored sample ready to be packed. Per-token lists all have length ``len(token_ids)``.

    The wire-facing fields follow the reference's ``TrainingSample``; the last four are
    the orchestrator's own (staleness, ordering, accounting) and never reach the trainer.
    """

    token_ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    temperatures: list[float]
    env_name: str
    advantages: list[float] | None = None
    ref_logprobs: list[float] | None = None
    mm_refs: MMRefs | None = None
    routed_experts: RoutedExperts | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    sampling_mask: SamplingMask | None = None
    trace_id: str | None = None
    branch_index: int | None = None
    payload: list[PayloadSegment] | None = None
    # the orchestrator's own fields
    policy_version: PolicyVersion = 0
    group_id: str = ""
    sample_index: int = -1
    arrival: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
