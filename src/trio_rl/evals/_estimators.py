"""The estimators: unbiased pass@k (the Codex estimator), pass^k and avg@k.

For one prompt with ``n`` samples of which ``c`` are correct:

- ``pass@k = 1 - C(n - c, k) / C(n, k)``: the chance that at least one of ``k`` samples
  drawn without replacement from the ``n`` is correct (Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code"); unbiased for every ``k <= n``, so ``pass@1`` is ``c / n``.
- ``pass^k = C(c, k) / C(n, k)``: the chance that all ``k`` of them are correct (the
  consistency measure of tau-bench).
- ``avg@k`` is the mean reward of the ``n`` samples.

Each figure of an eval is the mean of the per-prompt values over its prompts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from .._validation import at_least
from ..errors import InvalidArgumentError

__all__ = ["PromptOutcome", "mean_pass_at_k", "mean_pass_hat_k", "pass_at_k", "pass_hat_k"]


def _check(n: int, c: int, k: int) -> None:
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise InvalidArgumentError(
            f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}"
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt: ``n`` samples, ``c`` correct, ``k <= n``.

    Computed as ``1 - prod(1 - k / i for i in n - c + 1 .. n)``, which equals
    ``1 - C(n - c, k) / C(n, k)`` without the large binomials."""
    _check(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k of one prompt: the chance that ``k`` of its ``n`` samples, drawn without
    replacement, are all correct (``C(c, k) / C(n, k)``)."""
    _check(n, c, k)
    if c < k:
        return 0.0
    return math.comb(c, k) / math.comb(n, k)


@attrs.frozen
class PromptOutcome:
    """One prompt's samples: how many, how many correct, and the sum of their rewards."""

    samples: int = attrs.field(validator=at_least(1))
    correct: int = attrs.field(validator=at_least(0))
    reward_sum: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.correct > self.samples:
            raise InvalidArgumentError(
                f"PromptOutcome.correct ({self.correct}) exceeds samples ({self.samples})"
            )


def mean_pass_at_k(outcomes: Iterable[PromptOutcome], k: int) -> float | None:
    """The mean unbiased pass@k over prompts with at least ``k`` samples (None: no prompt)."""
    values = [pass_at_k(o.samples, o.correct, k) for o in outcomes if o.samples >= k]
    return sum(values) / len(values) if values else None


def mean_pass_hat_k(outcomes: Iterable[PromptOutcome], k: int) -> float | None:
    """The mean pass^k over prompts with at least ``k`` samples (None: no prompt)."""
    values = [pass_hat_k(o.samples, o.correct, k) for o in outcomes if o.samples >= k]
    return sum(values) / len(values) if values else None
