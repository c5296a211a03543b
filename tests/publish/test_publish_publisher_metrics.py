"""The per-batch record: distributions, the ``all`` and ``effective`` sides, flat keys."""

from __future__ import annotations

import array
import math

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import make_group, make_sink
from trio_rl.publish import (
    AttemptStats,
    Distribution,
    ShipRecord,
    ShipTimings,
    cohort_stats,
)
from trio_rl.publish._metrics import attempt_stats
from trio_rl.sink import SinkWindow

finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=200))
def test_distribution_matches_numpy(values: list[float]) -> None:
    d = Distribution.of(values)
    assert d.count == len(values)
    assert d.min == min(values)
    assert d.max == max(values)
    assert d.mean == pytest.approx(float(np.mean(values)), rel=1e-9, abs=1e-6)
    for q, got in ((10, d.p10), (50, d.p50), (90, d.p90)):
        assert got == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)
    ordered = [d.min, d.p10, d.p50, d.p90, d.max]
    assert ordered == sorted(v for v in ordered if v is not None)


@given(st.lists(st.lists(finite | st.integers(-1000, 1000), max_size=40), max_size=8))
def test_distribution_of_parts_equals_of_the_concatenation(parts: list[list[float]]) -> None:
    # The cohort's per-token advantages are summarised part by part (a numpy sort with the
    # GIL released): the figures must be exactly those of the whole list.
    whole = [v for part in parts for v in part]
    assert Distribution.of_parts(parts) == Distribution.of(whole)
    # The cohort hands its parts over as arrays of doubles (no young lists for the collector).
    assert Distribution.of_parts([array.array("d", p) for p in parts]) == Distribution.of(whole)


def test_an_empty_distribution_has_no_statistics_and_no_keys() -> None:
    d = Distribution.of([])
    assert d == Distribution(count=0)
    assert list(d.items("x")) == []


@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=20),
    st.integers(0, 12),
)
def test_attempt_stats_count_every_outcome_of_the_window(
    outcome_counts: list[tuple[int, int]], step: int
) -> None:
    window = SinkWindow(
        attempts=sum(a + b for a, b in outcome_counts),
        groups=len(outcome_counts),
        shipped=sum(a for a, _ in outcome_counts),
        failed=sum(b for _, b in outcome_counts),
        reward_sum=float(len(outcome_counts)),
        reward_count=len(outcome_counts),
    )
    stats = attempt_stats(window)
    assert stats.attempts == window.attempts
    assert stats.groups == window.groups
    assert sum(stats.outcomes.values()) == window.shipped + window.failed
    assert stats.outcomes["shipped"] == window.shipped
    assert stats.outcomes["failed"] == window.failed
    assert stats.reward_mean == (1.0 if outcome_counts else None)


def test_cohort_stats_cover_the_shipped_samples() -> None:
    sink = make_sink(batch_size=6)
    sink.add_group(make_group([1.0, 0.0], group_id="a", prompt_len=2, version=0, env="math"))
    sink.add_group(
        make_group([3.0, 0.0, 0.0], group_id="b", prompt_len=2, version=2, completion=6, env="code")
    )
    samples = sink.queued_samples()
    stats = cohort_stats(samples, step=5)
    assert stats.samples == 5
    assert stats.groups == 2
    assert stats.tokens == 2 * 6 + 3 * 8
    assert stats.loss_tokens == 2 * 4 + 3 * 6
    assert dict(stats.samples_by_env) == {"math": 2, "code": 3}
    # batch 5 trains on version 4: lags 4 (version 0) and 2 (version 2)
    assert stats.off_policy.max == 4
    assert stats.off_policy.min == 2
    # advantages of trained tokens: +-0.5 (group a), +2, -1, -1 (group b)
    assert stats.advantages.min == -1.0
    assert stats.advantages.max == 2.0
    assert stats.advantages.count == 2 * 4 + 3 * 6


def test_the_record_is_frozen_and_flattens_to_scalar_keys() -> None:
    sink = make_sink(batch_size=2, groups=1)
    record = ShipRecord(
        step=3,
        all=attempt_stats(
            SinkWindow(attempts=2, groups=1, shipped=2, reward_sum=1.0, reward_count=2)
        ),
        effective=cohort_stats(sink.queued_samples(), 3),
        counters={"shipped": 2},
        policy_wait=1.5,
        ranks=2,
        micro_batches_per_rank=1,
        payload_bytes=100,
        timings=ShipTimings(pack=0.25),
    )
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        record.step = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        record.counters["shipped"] = 3  # type: ignore[index]
    flat = record.as_dict()
    assert flat["step"] == 3.0
    assert flat["train/all/attempts"] == 2.0
    assert flat["train/all/outcome/shipped"] == 2.0
    assert flat["train/all/reward/mean"] == 0.5
    assert flat["train/effective/samples"] == 2.0
    assert flat["train/effective/length/max"] == 6.0
    assert flat["time/wait_for_policy"] == 1.5
    assert flat["time/pack"] == 0.25
    assert flat["counters/shipped"] == 2.0
    assert all(isinstance(v, float) and math.isfinite(v) for v in flat.values())


def test_attempt_stats_outcomes_are_read_only() -> None:
    stats = AttemptStats(
        attempts=1,
        groups=1,
        outcomes={"shipped": 1},
        reward_mean=None,
        reward_count=0,
        shipped_tokens=0,
    )
    with pytest.raises(TypeError):
        stats.outcomes["shipped"] = 2  # type: ignore[index]
    assert "train/all/reward/mean" not in dict(stats.items("train/all"))
