"""One metrics record per shipped batch: every attempt of the window and the shipped cohort.

The statistics are computed in a worker thread over values the event loop no longer
mutates (the detached cohort and the window the sink handed over); the record itself is a
frozen value, so a monitor can keep it as long as it likes.
"""

from __future__ import annotations

import math
import types
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..train import SinkWindow, TrainingSample

__all__ = [
    "AttemptStats",
    "CohortStats",
    "Distribution",
    "ShipRecord",
    "ShipTimings",
    "ThreadStats",
    "attempt_stats",
    "cohort_stats",
]


def _frozen_mapping(value: Mapping[str, int]) -> Mapping[str, int]:
    # A read-only copy: the caller's dict may keep changing (read-and-reset counters).
    return types.MappingProxyType(dict(value))


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``ordered`` non-empty."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


@attrs.frozen
class Distribution:
    """Summary of a list of numbers. All statistics are ``None`` when ``count == 0``."""

    count: int
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    p10: float | None = None
    p50: float | None = None
    p90: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(float(v) for v in values)
        if not ordered:
            return cls(count=0)
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            min=ordered[0],
            max=ordered[-1],
            p10=_percentile(ordered, 0.1),
            p50=_percentile(ordered, 0.5),
            p90=_percentile(ordered, 0.9),
        )

    def items(self, prefix: str) -> Iterable[tuple[str, float]]:
        """Flat ``(key, value)`` pairs; an empty distribution yields no keys."""
        if self.count == 0:
            return
        yield f"{prefix}/count", float(self.count)
        for name in ("mean", "min", "max", "p10", "p50", "p90"):
            value = getattr(self, name)
            if value is not None:
                yield f"{prefix}/{name}", value


_OUTCOMES = ("shipped", "pruned", "stale", "filtered", "failed", "cancelled")


@attrs.frozen
class AttemptStats:
    """``all``: every attempt of the window, including pruned, stale, failed and cancelled ones.

    Built from the sink's `SinkWindow`, which the cut reads and resets: ``attempts`` is the
    attempt budget of every group finalized in the window, ``outcomes`` counts samples by how
    they ended, the reward figures cover every scored sample of the window.
    """

    attempts: int
    groups: int
    outcomes: Mapping[str, int] = attrs.field(converter=_frozen_mapping)
    reward_mean: float | None
    reward_count: int
    shipped_tokens: int

    def items(self, prefix: str) -> Iterable[tuple[str, float]]:
        yield f"{prefix}/attempts", float(self.attempts)
        yield f"{prefix}/groups", float(self.groups)
        for outcome, count in sorted(self.outcomes.items()):
            yield f"{prefix}/outcome/{outcome}", float(count)
        if self.reward_mean is not None:
            yield f"{prefix}/reward/mean", self.reward_mean
        yield f"{prefix}/reward/count", float(self.reward_count)
        yield f"{prefix}/shipped_tokens", float(self.shipped_tokens)


@attrs.frozen
class CohortStats:
    """``effective``: the shipped cohort only."""

    samples: int
    groups: int
    tokens: int
    loss_tokens: int
    lengths: Distribution
    advantages: Distribution
    off_policy: Distribution
    samples_by_env: Mapping[str, int] = attrs.field(converter=_frozen_mapping)

    def items(self, prefix: str) -> Iterable[tuple[str, float]]:
        yield f"{prefix}/samples", float(self.samples)
        yield f"{prefix}/groups", float(self.groups)
        yield f"{prefix}/tokens", float(self.tokens)
        yield f"{prefix}/loss_tokens", float(self.loss_tokens)
        yield from self.lengths.items(f"{prefix}/length")
        yield from self.advantages.items(f"{prefix}/advantage")
        yield from self.off_policy.items(f"{prefix}/off_policy")
        for env, count in sorted(self.samples_by_env.items()):
            yield f"{prefix}/env/{env}", float(count)


@attrs.frozen
class ShipTimings:
    """Wall seconds spent in each phase of one publication (worker time, awaited on the loop)."""

    prune: float = 0.0
    pack: float = 0.0
    metrics: float = 0.0
    send: float = 0.0
    checkpoint: float = 0.0
    release_wait: float = 0.0
    total: float = 0.0


@attrs.frozen
class ThreadStats:
    """The pipeline's worker threads as one publication saw them: ``limit`` is the shared
    limiter's size, ``busy_max`` the most tokens borrowed (this publication's jobs and anyone
    else's: sender, checkpoint, ingest) at the start of one of its worker jobs."""

    limit: int = 0
    busy_max: int = 0


@attrs.frozen
class ShipRecord:
    """The one record published per shipped batch.

    ``counters`` is the sink's cumulative accounting right after the batch was booked (taken on
    the event loop); ``policy_wait`` the policy-wait seconds read and reset right after the
    threaded metrics returned, so waits that completed meanwhile are reported here.
    """

    step: int
    all: AttemptStats
    effective: CohortStats
    counters: Mapping[str, int] = attrs.field(converter=_frozen_mapping)
    policy_wait: float
    ranks: int
    micro_batches_per_rank: int
    payload_bytes: int
    timings: ShipTimings
    threads: ThreadStats = ThreadStats()

    def as_dict(self) -> dict[str, float]:
        """Flat scalar keys (``train/all/...``, ``train/effective/...``, ``time/...``)."""
        out: dict[str, float] = {"step": float(self.step)}
        out.update(self.all.items("train/all"))
        out.update(self.effective.items("train/effective"))
        for name, value in sorted(self.counters.items()):
            out[f"counters/{name}"] = float(value)
        out["time/wait_for_policy"] = self.policy_wait
        for field in attrs.fields(ShipTimings):
            out[f"time/{field.name}"] = getattr(self.timings, field.name)
        out["batch/ranks"] = float(self.ranks)
        out["batch/micro_batches_per_rank"] = float(self.micro_batches_per_rank)
        out["batch/payload_bytes"] = float(self.payload_bytes)
        out["threads/limit"] = float(self.threads.limit)
        out["threads/busy_max"] = float(self.threads.busy_max)
        return out


def attempt_stats(window: SinkWindow) -> AttemptStats:
    """The ``all`` statistics of a window the sink handed over (scalars: constant time)."""
    return AttemptStats(
        attempts=window.attempts,
        groups=window.groups,
        outcomes={name: getattr(window, name) for name in _OUTCOMES},
        reward_mean=window.reward_mean,
        reward_count=window.reward_count,
        shipped_tokens=window.shipped_tokens,
    )


def cohort_stats(samples: Sequence[TrainingSample], step: int) -> CohortStats:
    """Statistics over the shipped cohort of batch ``step``. CPU work: call it in a worker.

    Off-policy lag of a sample generated at version ``v`` for batch ``step`` is
    ``max(0, (step - 1) - v)``: batch ``S`` trains on the weights of version ``S - 1``.
    """
    advantages: list[float] = []
    loss_tokens = 0
    for sample in samples:
        loss_tokens += sum(sample.mask)
        if sample.advantages is not None:
            advantages.extend(a for a, m in zip(sample.advantages, sample.mask, strict=False) if m)
    lengths = [sample.num_tokens for sample in samples]
    return CohortStats(
        samples=len(samples),
        groups=len({sample.group_id for sample in samples}),
        tokens=sum(lengths),
        loss_tokens=loss_tokens,
        lengths=Distribution.of(lengths),
        advantages=Distribution.of(advantages),
        off_policy=Distribution.of(max(0, (step - 1) - s.policy_version) for s in samples),
        samples_by_env=Counter(sample.env_name for sample in samples),
    )
