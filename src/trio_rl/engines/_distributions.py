"""Straggler distributions for the simulated engine (docs/engines.md, "Straggler distributions").

A distribution turns one random stream into the cost of one request: either a number of tokens
(the engine turns it into time with its per-token decode time) or a wall time in seconds (agentic
episodes, whose time is not proportional to tokens). ``LN(m, s)`` below means ``m * exp(s * Z)``,
a lognormal with median ``m``.

Every draw takes two inputs: ``rng``, private to the request, and ``prompt_rng``, seeded from the
prompt alone, so a distribution can make the samples of one prompt correlate (``correlated``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import attrs

from .._validation import positive_finite, positive_int, probability
from ._errors import EngineConfigError
from ._protocol import FinishReason

__all__ = [
    "DISTRIBUTIONS",
    "CorrelatedTokens",
    "Draw",
    "LatencyDistribution",
    "LogNormalSeconds",
    "LogNormalTokens",
    "ParetoSeconds",
    "get_distribution",
]


@attrs.frozen
class Draw:
    """The cost of one request.

    Exactly one of ``tokens`` (time = tokens x per-token decode time) and ``seconds`` (wall time)
    is set. ``finish_reason`` is ``length`` when a token cap was hit, ``abort`` when the request
    was killed (a hang or a kill timeout), else ``stop``.
    """

    tokens: int | None
    seconds: float | None
    finish_reason: FinishReason

    def __attrs_post_init__(self) -> None:
        if (self.tokens is None) == (self.seconds is None):
            raise EngineConfigError(
                f"Draw needs exactly one of tokens and seconds, got tokens={self.tokens!r}, "
                f"seconds={self.seconds!r}"
            )
        if self.tokens is not None and self.tokens < 0:
            raise EngineConfigError(f"Draw.tokens must be >= 0, got {self.tokens!r}")
        if self.seconds is not None and not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise EngineConfigError(f"Draw.seconds must be finite and >= 0, got {self.seconds!r}")
        if self.finish_reason not in ("stop", "length", "abort"):
            raise EngineConfigError(
                f"Draw.finish_reason must be stop, length or abort, got {self.finish_reason!r}"
            )


@runtime_checkable
class LatencyDistribution(Protocol):
    """Anything that draws the cost of one request; the engine accepts any such object."""

    @property
    def name(self) -> str: ...

    def draw(self, rng: random.Random, prompt_rng: random.Random) -> Draw: ...


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


@attrs.frozen
class LogNormalTokens:
    """``tokens ~ min(LN(median, sigma), cap)``; the default is ``long-cot``."""

    median: float = attrs.field(default=4000.0, validator=positive_finite)
    sigma: float = attrs.field(default=1.1, validator=positive_finite)
    cap: int = attrs.field(default=32768, validator=positive_int)
    name: str = "long-cot"

    def draw(self, rng: random.Random, prompt_rng: random.Random) -> Draw:
        raw = _lognormal(rng, self.median, self.sigma)
        if raw >= self.cap:
            return Draw(self.cap, None, "length")
        return Draw(max(1, round(raw)), None, "stop")


@attrs.frozen
class CorrelatedTokens:
    """``tokens ~ min(LN(prompt_median, prompt_sigma)_prompt x LN(1, sample_sigma)_sample, cap)``.

    The prompt factor is drawn from ``prompt_rng``, which the engine seeds from the prompt, so
    all samples of one prompt share it (within-group max/median is about 2.8 for groups of 8).
    """

    prompt_median: float = attrs.field(default=2000.0, validator=positive_finite)
    prompt_sigma: float = attrs.field(default=0.7, validator=positive_finite)
    sample_sigma: float = attrs.field(default=0.6, validator=positive_finite)
    cap: int = attrs.field(default=32768, validator=positive_int)
    name: str = "correlated"

    def draw(self, rng: random.Random, prompt_rng: random.Random) -> Draw:
        prompt_factor = _lognormal(prompt_rng, self.prompt_median, self.prompt_sigma)
        raw = prompt_factor * _lognormal(rng, 1.0, self.sample_sigma)
        if raw >= self.cap:
            return Draw(self.cap, None, "length")
        return Draw(max(1, round(raw)), None, "stop")


@attrs.frozen
class LogNormalSeconds:
    """``seconds ~ min(LN(median, sigma), cap)``; the default is ``swe`` (about 2.5% hit the
    2 h cap, which ends them as ``length``: the episode ran out of time)."""

    median: float = attrs.field(default=1500.0, validator=positive_finite)
    sigma: float = attrs.field(default=0.8, validator=positive_finite)
    cap: float = attrs.field(default=7200.0, validator=positive_finite)
    name: str = "swe"

    def draw(self, rng: random.Random, prompt_rng: random.Random) -> Draw:
        raw = _lognormal(rng, self.median, self.sigma)
        if raw >= self.cap:
            return Draw(None, self.cap, "length")
        return Draw(None, raw, "stop")


@attrs.frozen
class ParetoSeconds:
    """``seconds ~ scale x (1 + Lomax(alpha))``; ``hang_probability`` of requests hang and,
    like any request reaching ``kill_after``, are killed then (finish reason ``abort``).

    The default is ``heavy-tail``: median about 103 s, an infinite-variance tail, 0.5% hangs.
    """

    scale: float = attrs.field(default=60.0, validator=positive_finite)
    alpha: float = attrs.field(default=1.3, validator=positive_finite)
    hang_probability: float = attrs.field(default=0.005, validator=probability)
    kill_after: float = attrs.field(default=3600.0, validator=positive_finite)
    name: str = "heavy-tail"

    def draw(self, rng: random.Random, prompt_rng: random.Random) -> Draw:
        if rng.random() < self.hang_probability:
            return Draw(None, self.kill_after, "abort")
        # paretovariate is 1 + Lomax(alpha) (numpy's "pareto" is the Lomax form).
        raw = self.scale * rng.paretovariate(self.alpha)
        if raw >= self.kill_after:
            return Draw(None, self.kill_after, "abort")
        return Draw(None, raw, "stop")


#: The four named distributions (docs/engines.md, "Straggler distributions").
DISTRIBUTIONS: Mapping[str, LatencyDistribution] = {
    "long-cot": LogNormalTokens(),
    "correlated": CorrelatedTokens(),
    "swe": LogNormalSeconds(),
    "heavy-tail": ParetoSeconds(),
}


def get_distribution(name: str) -> LatencyDistribution:
    """The named distribution; raises ``ValueError`` listing the known names otherwise."""
    try:
        return DISTRIBUTIONS[name]
    except KeyError:
        known = ", ".join(sorted(DISTRIBUTIONS))
        raise EngineConfigError(f"unknown latency distribution {name!r}; known: {known}") from None
