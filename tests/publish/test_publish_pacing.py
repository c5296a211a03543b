"""Yield points of the publisher's CPU-bound worker code (the loop's lag is the benchmark's)."""

from __future__ import annotations

import itertools

import pytest

from builders import make_sink
from trio_rl.publish import _pacing, cohort_stats, pack_lazily, release_containers
from trio_rl.publish._pacing import Pacer


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    calls: list[float] = []
    monkeypatch.setattr(_pacing, "sleep", calls.append)
    return calls


def test_a_pacer_yields_the_gil_once_per_interval(sleeps: list[float]) -> None:
    every_call = Pacer(interval=0.0)
    for _ in range(5):
        every_call()
    assert sleeps == [0] * 5
    sleeps.clear()
    rarely = Pacer(interval=3600.0)
    for _ in range(5):
        rarely()
    assert sleeps == [0], "due at once, then not again within the hour"


def test_the_publication_jobs_yield_between_samples_and_micro_batches(
    sleeps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clock that advances an hour per reading: every call of every pacer is due.
    clock = itertools.count(step=3600)
    monkeypatch.setattr(_pacing, "perf_counter", lambda: float(next(clock)))
    sink = make_sink(batch_size=6, groups=3)
    samples = list(sink.detach_batch().samples)
    assert len(samples) == 6
    cohort_stats(samples, 1)
    assert len(sleeps) >= len(samples)
    sleeps.clear()
    ranks = pack_lazily(samples, seq_len=8, num_ranks=2)
    # The plan yields once per sample validated and once per sample placed in a bin.
    assert len(sleeps) == 2 * len(samples)
    sleeps.clear()
    built = [mb for rank in ranks for mb in rank]
    # Per micro-batch: before it, after each of its samples, and once it is built.
    assert len(sleeps) == sum(2 + len(mb.sequence_lengths) for mb in built) > 0
    sleeps.clear()
    release_containers([list(range(10))])
    assert len(sleeps) == 10
