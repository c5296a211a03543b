"""One metrics record per shipped batch: every attempt of the window and the shipped cohort.

The statistics are computed in a worker thread over values the event loop no longer
mutates (the detached cohort and the window the sink handed over); the record itself is a
frozen value, so a monitor can keep it as long as it likes.
"""

from __future__ import annotations

import array
import enum
import math
import types
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress
from typing import Any, ClassVar

import attrs

from ..sink import SinkWindow, TrainingSample
from ._distribution import Distribution
from ._pacing import Pacer
from ._policy_wait import policy_wait_dominates

__all__ = [
    "DISCARD_WARN_ABOVE",
    "TRAINABLE_WARN_AT",
    "WASTE_OUTCOMES",
    "Annotation",
    "AttemptStats",
    "CohortStats",
    "ProgressTotals",
    "SelectionStats",
    "ShipWarning",
    "WarningKind",
    "ShipRecord",
    "ShipTimings",
    "ThreadStats",
    "annotate",
    "attempt_stats",
    "batch_stats",
    "cohort_stats",
    "selection_stats",
    "ship_warnings",
    "step_record",
]

#: A batch whose selected samples are at most this fraction trainable gets a warning.
TRAINABLE_WARN_AT = 0.10
#: A window in which more than this fraction of attempts was wasted (stale, failed or filtered:
#: thrown away for a scheduling or engine reason, pruned ones excluded) gets a warning. With
#: staleness-aware admission a healthy learning run wastes 0-2 % per step; without it, 30-60 %
#: (docs/learning.md): above a fifth something is wrong, and the message says what to change.
DISCARD_WARN_ABOVE = 0.20
#: The outcomes that are wasted rollouts (generated, never trained, for a scheduling reason).
WASTE_OUTCOMES = ("stale", "cancelled", "failed", "filtered")


def _frozen_mapping(value: Mapping[str, int]) -> Mapping[str, int]:
    # A read-only copy: the caller's dict may keep changing (read-and-reset counters).
    return types.MappingProxyType(dict(value))


#: The distribution of no values (frozen: one instance serves every default).
_NO_VALUES = Distribution(count=0)

_OUTCOMES = ("shipped", "pruned", "stale", "filtered", "failed", "cancelled")


@attrs.frozen
class AttemptStats:
    """``all``: every attempt of the window, including pruned, stale, failed and cancelled ones.

    Built from the sink's `SinkWindow`, which the cut reads and resets: ``attempts`` is the
    attempt budget of every group finalized in the window, ``outcomes`` counts samples by how
    they ended, the reward figures cover every scored sample of the window. ``rewards`` and
    ``completion_lengths`` are distributions over the window's settled samples (scored ones;
    every finished one of a scored group), ``zero_length`` the finished samples filtered for
    having no trained token, ``failures`` the failed attempts' errors by exception type.
    """

    attempts: int
    groups: int
    outcomes: Mapping[str, int] = attrs.field(converter=_frozen_mapping)
    reward_mean: float | None
    reward_count: int
    shipped_tokens: int
    rewards: Distribution = _NO_VALUES
    completion_lengths: Distribution = _NO_VALUES
    zero_length: int = 0
    failures: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_mapping)

    @property
    def discarded(self) -> int:
        """Attempts that will never train: stale, failed, pruned (no signal) and filtered."""
        return sum(self.outcomes.get(k, 0) for k in ("stale", "failed", "pruned", "filtered"))

    @property
    def discarded_fraction(self) -> float | None:
        return self.discarded / self.attempts if self.attempts else None

    @property
    def wasted(self) -> int:
        """Attempts thrown away for a scheduling or engine reason: stale, failed and filtered
        (pruned ones are not: the reward gave them no signal, see ``LOW_TRAINABLE``)."""
        return sum(self.outcomes.get(k, 0) for k in ("stale", "failed", "filtered"))

    def items(self, prefix: str) -> Iterable[tuple[str, float]]:
        yield f"{prefix}/attempts", float(self.attempts)
        yield f"{prefix}/discarded", float(self.discarded)
        if self.discarded_fraction is not None:
            yield f"{prefix}/discarded_fraction", self.discarded_fraction
        yield f"{prefix}/groups", float(self.groups)
        for outcome, count in sorted(self.outcomes.items()):
            yield f"{prefix}/outcome/{outcome}", float(count)
        if self.reward_mean is not None:
            yield f"{prefix}/reward/mean", self.reward_mean
        yield f"{prefix}/reward/count", float(self.reward_count)
        # The distribution's own count and mean are the two keys above (the same samples).
        for name in ("min", "max", "p10", "p50", "p90"):
            value = getattr(self.rewards, name)
            if value is not None:
                yield f"{prefix}/reward/{name}", value
        yield from self.completion_lengths.items(f"{prefix}/completion_length")
        yield f"{prefix}/zero_length", float(self.zero_length)
        for kind, count in sorted(self.failures.items()):
            yield f"{prefix}/error/{kind}", float(count)
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
class SelectionStats:
    """The batch as selected, before post-selection pruning (with pruning before the queue, the
    shipped cohort itself): how much of it can train.

    A sample is *trainable* when some trained token has a nonzero advantage; a *zero-length*
    sample has no trained (completion) token at all.
    """

    selected: int
    trainable: int
    zero_length: int
    completion_lengths: Distribution

    @property
    def trainable_fraction(self) -> float | None:
        return self.trainable / self.selected if self.selected else None

    def items(self, prefix: str) -> Iterable[tuple[str, float]]:
        yield f"{prefix}/samples", float(self.selected)
        yield f"{prefix}/trainable", float(self.trainable)
        if self.trainable_fraction is not None:
            yield f"{prefix}/trainable_fraction", self.trainable_fraction
        yield f"{prefix}/zero_length", float(self.zero_length)
        yield from self.completion_lengths.items(f"{prefix}/completion_length")


class WarningKind(enum.Enum):
    """What a `ShipWarning` is about: the reference's publication warnings (#3806's
    low-trainable, high-discard and zero-length ones, #3811's policy-wait imbalance). #3806's
    zero-output budget warning is the sink's (it is logged as groups finish, not per batch)."""

    #: At most `TRAINABLE_WARN_AT` of the selected samples can train.
    LOW_TRAINABLE = "low_trainable"
    #: More than `DISCARD_WARN_ABOVE` of the window's attempts were discarded.
    HIGH_DISCARD = "high_discard"
    #: Some finished samples of the window (or of the selection) have no trained token.
    ZERO_LENGTH = "zero_length"
    #: The orchestrator waited for the policy at least as long as it worked in the step
    #: (`policy_wait_dominates`): the trainer is the bottleneck.
    POLICY_WAIT = "policy_wait"


@attrs.frozen
class ShipWarning:
    """A problem with a shipped batch worth a look (logged at WARNING, kept on the record)."""

    kind: WarningKind
    message: str


@attrs.frozen
class Annotation:
    """One shipped sample, stamped with the step and time it shipped (the reference's
    ``stamp_batch`` annotation), for monitors that keep per-sample records."""

    step: int
    shipped_at: float
    group_id: str
    sample_index: int
    env_name: str
    policy_version: int
    trace_id: str | None
    branch_index: int | None
    #: Mean advantage over the trained tokens (None without advantages or trained tokens).
    advantage: float | None
    trained_tokens: int


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


@attrs.define(slots=True)
class ProgressTotals:
    """The run's progress totals over every shipped batch (prime-rl's ``total_tokens``,
    ``total_samples``, ``total_problems``): sequence tokens (prompt and completion), samples,
    and problems (the distinct groups of each batch, summed over batches, as prime-rl counts
    the problems of each step). Saved in every checkpoint's ``progress`` map and restored on
    resume (`from_progress`), so a resumed run goes on counting where the last one stopped."""

    tokens: int = 0
    samples: int = 0
    problems: int = 0

    #: The keys of the checkpoint's ``progress`` map, per field.
    KEYS: ClassVar[Mapping[str, str]] = types.MappingProxyType(
        {"tokens": "total_tokens", "samples": "total_samples", "problems": "total_problems"}
    )

    def add_batch(self, samples: Sequence[TrainingSample]) -> None:
        """Count one shipped batch (on the loop, when it is settled: before its snapshot)."""
        self.tokens += sum(len(s.token_ids) for s in samples)
        self.samples += len(samples)
        self.problems += len({s.group_id for s in samples})

    def as_progress(self) -> dict[str, int]:
        """The checkpoint's ``progress`` entries (``total_tokens``, ...)."""
        return {key: getattr(self, name) for name, key in self.KEYS.items()}

    @classmethod
    def from_progress(cls, progress: Mapping[str, Any]) -> ProgressTotals:
        """The totals a checkpoint's ``progress`` map saved (0 for a key it lacks: a checkpoint
        written before they were kept). Raises ``ValueError`` naming the key if one is not a
        non-negative integer."""
        values: dict[str, int] = {}
        for name, key in cls.KEYS.items():
            value = progress.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"progress.{key}: a non-negative integer expected, got {value!r}")
            values[name] = value
        return cls(**values)


@attrs.frozen
class ShipRecord:
    """The one record published per shipped batch.

    ``counters`` is the sink's cumulative accounting right after the batch was settled (taken on
    the event loop); ``policy_wait`` the policy-wait seconds read and reset right after the
    threaded metrics returned, so waits that completed meanwhile are reported here, and
    ``step_time`` the seconds since the previous record's snapshot (since the publisher opened,
    for the first), taken in the same step (``time/step``).
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
    step_time: float = 0.0
    threads: ThreadStats = ThreadStats()
    selection: SelectionStats | None = None
    warnings: tuple[ShipWarning, ...] = ()

    def as_dict(self) -> dict[str, float]:
        """Flat scalar keys (``train/all/...``, ``train/effective/...``, ``time/...``)."""
        out: dict[str, float] = {"step": float(self.step)}
        out.update(self.all.items("train/all"))
        out.update(self.effective.items("train/effective"))
        if self.selection is not None:
            out.update(self.selection.items("train/selected"))
        for warning in self.warnings:
            out[f"warnings/{warning.kind.value}"] = 1.0
        for name, value in sorted(self.counters.items()):
            out[f"counters/{name}"] = float(value)
        out["time/wait_for_policy"] = self.policy_wait
        out["time/step"] = self.step_time
        for field in attrs.fields(ShipTimings):
            out[f"time/{field.name}"] = getattr(self.timings, field.name)
        out["batch/ranks"] = float(self.ranks)
        out["batch/micro_batches_per_rank"] = float(self.micro_batches_per_rank)
        out["batch/payload_bytes"] = float(self.payload_bytes)
        out["threads/limit"] = float(self.threads.limit)
        out["threads/busy_max"] = float(self.threads.busy_max)
        return out


def attempt_stats(window: SinkWindow) -> AttemptStats:
    """The ``all`` statistics of a window the sink handed over. Sorts the window's value lists
    (the distributions): CPU work, call it in a worker."""
    return AttemptStats(
        attempts=window.attempts,
        groups=window.groups,
        outcomes={name: getattr(window, name) for name in _OUTCOMES},
        reward_mean=window.reward_mean,
        reward_count=window.reward_count,
        shipped_tokens=window.shipped_tokens,
        rewards=Distribution.of_parts([window.rewards]),
        completion_lengths=Distribution.of_parts([window.completion_lengths]),
        zero_length=window.zero_length,
        failures=window.failure_types,
    )


def cohort_stats(samples: Sequence[TrainingSample], step: int) -> CohortStats:
    """Statistics over the shipped cohort of batch ``step``. CPU work: call it in a worker.

    Off-policy lag of a sample generated at version ``v`` for batch ``step`` is
    ``max(0, (step - 1) - v)``: batch ``S`` trains on the weights of version ``S - 1``.
    """
    # Per-token walks run as C iterators (sum, compress): a Python-level loop over every token
    # keeps the GIL busy in bytecode, and the event loop then waits a switch interval for it.
    # A Pacer yields the GIL to the event loop between samples (see `Pacer`).
    # Each sample's trained advantages are kept as an array of doubles, not a list: a list of
    # thousands of float objects per sample made the young generation hold ~3 million
    # references by the end of the loop, and the collection it triggers walks them all in one
    # GIL-holding pass (8 ms of a worker's CPU at 166 MiB, the loop waiting throughout); an
    # array is one object to the collector, and `Distribution.of_parts` reads the same doubles.
    advantages: list[array.array[float]] = []
    loss_tokens = 0
    pace = Pacer()
    for sample in samples:
        pace()
        loss_tokens += sum(sample.mask)
        if sample.advantages is not None:
            advantages.append(array.array("d", compress(sample.advantages, sample.mask)))
    lengths = [sample.num_tokens for sample in samples]
    return CohortStats(
        samples=len(samples),
        groups=len({sample.group_id for sample in samples}),
        tokens=sum(lengths),
        loss_tokens=loss_tokens,
        lengths=Distribution.of(lengths),
        advantages=Distribution.of_parts(advantages),
        off_policy=Distribution.of(max(0, (step - 1) - s.policy_version) for s in samples),
        samples_by_env=Counter(sample.env_name for sample in samples),
    )


def _trained(sample: TrainingSample) -> tuple[int, float | None, bool]:
    # (trained tokens, mean advantage over them, some trained token has a nonzero advantage)
    trained = sum(sample.mask)
    if sample.advantages is None or not trained:
        return trained, None, False
    values = list(compress(sample.advantages, sample.mask))
    # bool(a) is a != 0.0 for floats (NaN included), without a Python frame per token.
    return trained, math.fsum(values) / len(values), any(map(bool, values))


def selection_stats(selected: Sequence[TrainingSample]) -> SelectionStats:
    """Trainability of the selected batch. CPU work: call it in a worker."""
    pace = Pacer()
    trained = []
    for sample in selected:
        pace()
        trained.append(_trained(sample))
    return SelectionStats(
        selected=len(selected),
        trainable=sum(1 for _, _, live in trained if live),
        zero_length=sum(1 for n, _, _ in trained if n == 0),
        completion_lengths=Distribution.of(n for n, _, _ in trained),
    )


def annotate(samples: Sequence[TrainingSample], step: int, shipped_at: float) -> list[Annotation]:
    """One `Annotation` per shipped sample. CPU work: call it in a worker."""
    out = []
    pace = Pacer()
    for sample in samples:
        pace()
        trained, advantage, _ = _trained(sample)
        out.append(
            Annotation(
                step=step,
                shipped_at=shipped_at,
                group_id=sample.group_id,
                sample_index=sample.sample_index,
                env_name=sample.env_name,
                policy_version=sample.policy_version,
                trace_id=sample.trace_id,
                branch_index=sample.branch_index,
                advantage=advantage,
                trained_tokens=trained,
            )
        )
    return out


def ship_warnings(
    step: int,
    selection: SelectionStats | None,
    attempts: AttemptStats,
    waits: tuple[float, float] = (0.0, 0.0),
) -> tuple[ShipWarning, ...]:
    """The `WarningKind` warnings for batch ``step`` (scalars: constant time); ``waits`` is the
    record's one snapshot ``(policy wait, step time)``."""
    warnings: list[ShipWarning] = []
    wait, step_time = waits
    if policy_wait_dominates(wait, step_time):
        warnings.append(
            ShipWarning(
                WarningKind.POLICY_WAIT,
                f"step {step}: the orchestrator waited {wait:.3g} s for the policy, at least as "
                f"long as its {step_time - wait:.3g} s of active step time ({step_time:.3g} s in "
                "all): the trainer is the bottleneck; add trainer capacity (more trainer ranks "
                "or nodes) or let rollouts run further ahead (max_async_level)",
            )
        )
    if selection is not None and selection.selected:
        fraction = selection.trainable / selection.selected
        if fraction <= TRAINABLE_WARN_AT:
            warnings.append(
                ShipWarning(
                    WarningKind.LOW_TRAINABLE,
                    f"step {step}: only {selection.trainable} of {selection.selected} selected "
                    f"samples ({fraction:.0%}) have a nonzero advantage (at most "
                    f"{TRAINABLE_WARN_AT:.0%}): rewards may carry no signal",
                )
            )
    # The sink filters a finished sample with no trained token before selection, so the
    # window's count is where zero-length outputs show (a selected one is counted too, for a
    # sink that let one through).
    zero_selected = selection.zero_length if selection is not None else 0
    if attempts.zero_length or zero_selected:
        warnings.append(
            ShipWarning(
                WarningKind.ZERO_LENGTH,
                f"step {step}: {attempts.zero_length} samples of the window had no trained "
                f"(completion) token and were filtered"
                + (f"; {zero_selected} selected samples have none" if zero_selected else ""),
            )
        )
    if attempts.attempts and attempts.wasted / attempts.attempts > DISCARD_WARN_ABOVE:
        warnings.append(ShipWarning(WarningKind.HIGH_DISCARD, _waste_message(step, attempts)))
    return tuple(warnings)


def _waste_message(step: int, attempts: AttemptStats) -> str:
    counts = {k: attempts.outcomes.get(k, 0) for k in ("stale", "failed", "filtered")}
    worst = max(counts, key=lambda k: counts[k])
    advice = {
        "stale": "rollouts outran the trainer: turn stale_admission on (the default), raise "
        "max_off_policy_steps, or lower max_groups_in_flight",
        "failed": "the engine or the reward failed: see train/all/failures and the log",
        "filtered": "the dynamic filter dropped them: check its reasons and the rewards",
    }[worst]
    detail = ", ".join(f"{k} {n}" for k, n in counts.items())
    return (
        f"step {step}: {attempts.wasted} of {attempts.attempts} attempts of the window "
        f"({attempts.wasted / attempts.attempts:.0%}) were thrown away ({detail}; more than "
        f"{DISCARD_WARN_ABOVE:.0%}): {advice}"
    )


def batch_stats(
    samples: Sequence[TrainingSample],
    selected: Sequence[TrainingSample],
    step: int,
    shipped_at: float,
) -> tuple[CohortStats, SelectionStats, list[Annotation]]:
    """Every statistic of batch ``step`` that walks its samples, in one worker job: the shipped
    cohort, the selection before post-selection pruning, and the per-sample annotations."""
    return (
        cohort_stats(samples, step),
        selection_stats(selected),
        annotate(samples, step, shipped_at),
    )


def step_record(
    record: ShipRecord,
    *,
    wall_s: float,
    interval_s: float,
    loop_lag_p95_ms: float | None = None,
    policy_version: int | None = None,
    slot_occupancy: float | None = None,
    queue_depth: int | None = None,
    cancelled_stale: int | None = None,
) -> dict[str, Any]:
    """The standard metrics record of one shipped step (its fields: :data:`trio_rl.tools.FIELDS`),
    what ``metrics.jsonl`` holds and every metrics sink gets.

    ``record`` is the publisher's :class:`ShipRecord` (``Shipment.record``);
    ``wall_s`` the seconds since the run started and ``interval_s`` since the previous step
    shipped (rates are per that interval). The others are what the caller measures: the event
    loop's lag, the current policy version, the engine's slot occupancy over the interval and
    the sink's queue (``orch.sink.queued``), and the samples of groups the driver cancelled
    early as too stale (``AsyncDriverStatistics.cancelled_stale_samples``; they are counted in
    ``stale`` too). Fields left ``None`` are written as null.

    ``waste`` is the step's rate of wasted rollouts: of the samples settled in the step's
    window, the fraction that will never train for a scheduling reason (stale, cancelled,
    failed or filtered); ``waste_total`` the same over the run so far, of every dispatched
    sample. Pruned samples (zero advantage: the reward gives GRPO no gradient) are not waste
    here: they were generated to be scored, and the ``pruned`` field counts them.

    The record also carries every key of :meth:`ShipRecord.as_dict
    <trio_rl.publish.ShipRecord.as_dict>` (``train/all/...``, ``train/selected/...``,
    ``warnings/<kind>``, ``threads/...``, ``time/...``, ...); the standard fields win a clash
    (``step`` stays an int).
    """
    dt = max(interval_s, 1e-9)
    off_policy = record.effective.off_policy.max
    outcomes, counters = record.all.outcomes, record.counters
    wasted = sum(outcomes.get(k, 0) for k in WASTE_OUTCOMES)
    settled = sum(outcomes.values())
    wasted_total = sum(counters.get(k, 0) for k in WASTE_OUTCOMES)
    dispatched = counters.get("dispatched", 0)
    return record.as_dict() | {
        "step": record.step,
        "reward_mean": record.all.reward_mean,
        "reward_count": record.all.reward_count,
        "samples": record.effective.samples,
        "tokens": record.effective.tokens,
        "samples_per_s": round(record.all.reward_count / dt, 2),
        "tokens_per_s": round(record.effective.tokens / dt, 1),
        "slot_occupancy": slot_occupancy,
        "loop_lag_p95_ms": loop_lag_p95_ms,
        "queue_depth": queue_depth,
        "off_policy_max": 0 if off_policy is None else off_policy,
        "policy_version": policy_version,
        "stale": int(record.counters.get("stale", 0)),
        "pruned": int(record.counters.get("pruned", 0)),
        "policy_wait_s": round(record.policy_wait, 4),
        "wall_s": round(wall_s, 3),
        "waste": round(wasted / settled, 4) if settled else 0.0,
        "waste_total": round(wasted_total / dispatched, 4) if dispatched else 0.0,
        "cancelled_stale": cancelled_stale,
    }
