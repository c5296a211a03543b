"""The estimators against their definitions: pass@k and pass^k by enumerating every draw."""

from __future__ import annotations

import itertools
import math

import pytest

from trio_rl.errors import InvalidArgumentError
from trio_rl.evals import (
    EvalResult,
    PromptOutcome,
    mean_pass_at_k,
    mean_pass_hat_k,
    pass_at_k,
    pass_hat_k,
)


def _by_enumeration(n: int, c: int, k: int) -> tuple[float, float]:
    """(any correct, all correct) over every k-subset of n samples whose first c are correct."""
    draws = list(itertools.combinations(range(n), k))
    any_ok = sum(1 for d in draws if any(i < c for i in d))
    all_ok = sum(1 for d in draws if all(i < c for i in d))
    return any_ok / len(draws), all_ok / len(draws)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_and_pass_hat_k_match_every_draw(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            any_ok, all_ok = _by_enumeration(n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(any_ok, abs=1e-12), (n, c, k)
            assert pass_hat_k(n, c, k) == pytest.approx(all_ok, abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_fraction_correct_and_large_n_stays_finite() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # the product form needs no binomial of 10_000
    value = pass_at_k(10_000, 1, 5_000)
    assert value == pytest.approx(0.5)
    assert math.isfinite(pass_hat_k(200, 150, 100))


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_impossible_counts_are_one_clear_error(n: int, c: int, k: int) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)
    with pytest.raises(InvalidArgumentError):
        pass_hat_k(n, c, k)


def test_means_skip_prompts_with_fewer_than_k_samples() -> None:
    outcomes = [PromptOutcome(4, 1), PromptOutcome(4, 4), PromptOutcome(2, 0)]
    assert mean_pass_at_k(outcomes, 4) == pytest.approx((1.0 + 1.0) / 2)
    assert mean_pass_at_k(outcomes, 1) == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert mean_pass_hat_k(outcomes, 4) == pytest.approx((0.0 + 1.0) / 2)
    assert mean_pass_at_k([], 1) is None
    with pytest.raises(InvalidArgumentError, match="correct"):
        PromptOutcome(2, 3)


def test_the_record_uses_the_names_users_know_and_reads_back() -> None:
    result = EvalResult(
        step=4,
        policy_version=4,
        k=8,
        prompts=10,
        prompts_planned=10,
        samples=80,
        avg_at_k=0.5,
        pass_at_1=0.3,
        pass_at_k=0.9,
        pass_hat_k=0.01,
        truncated=0.1,
        failed=0.0,
        completion_tokens_mean=12.0,
        turns_mean=1.0,
        temperature=1.0,
        wall_s=2.5,
    )
    rec = result.record()
    assert list(rec)[:8] == [
        "step",
        "policy_version",
        "status",
        "k",
        "avg@8",
        "pass@1",
        "pass@8",
        "pass^8",
    ]
    assert (rec["step"], rec["policy_version"], rec["pass@8"], rec["pass^8"]) == (4, 4, 0.9, 0.01)
    assert EvalResult.from_record(rec) == result
    single = EvalResult(step=0, policy_version=0, k=1, pass_at_1=0.2, pass_at_k=0.2).record()
    assert "pass@1" in single
    assert "avg@1" in single
    assert "pass^1" in single
