"""Test helpers for evaluation: held-out prompts, a reward with a known success rate, an
engine wrapper that records what it was asked."""

from __future__ import annotations

import attrs
import trio

from trio_rl.engines import Completion, Engine, GenerateRequest
from trio_rl.samples import Prompt, Sample


def held_out(n: int, prefix: str = "held") -> list[Prompt]:
    return [Prompt(key=f"{prefix}{i}", tokens=(7, i % 97, i // 97), label=i) for i in range(n)]


def success_reward(rate: float):  # type: ignore[no-untyped-def]
    """A sample reward correct with probability ``rate`` on a SimulatedEngine: its first
    token id is drawn uniformly from 0..999 per sample (seeded), so ``< rate * 1000`` is a
    Bernoulli(rate) draw."""

    def reward(sample: Sample) -> float:
        tokens = sample.completion_tokens
        return 1.0 if tokens and tokens[0] < rate * 1000 else 0.0

    return reward


@attrs.define(eq=False)
class Recording:
    """An engine that forwards to ``inner`` and records each request's start (virtual time,
    the lane it came from: ``eval`` if its prompt starts with token 7) and the peak number of
    requests in flight."""

    inner: Engine
    starts: list[tuple[float, str]] = attrs.field(factory=list)
    in_flight: int = 0
    peak: int = 0

    async def generate(self, request: GenerateRequest) -> Completion:
        self.starts.append(
            (trio.current_time(), "eval" if request.prompt_tokens[:1] == (7,) else "train")
        )
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await self.inner.generate(request)
        finally:
            self.in_flight -= 1
