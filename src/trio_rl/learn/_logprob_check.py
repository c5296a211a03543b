"""After every weight reload, how far the inference servers' logprobs are from the trainer's.

A server that reloaded the published weights must score a sampled completion as the trainer's
model does with the same weights: the importance ratio of GRPO is the quotient of the two. A
gap beyond float noise means the reload did not take (stale weights, a prefix cache that was
not reset, a mismatched dtype). :class:`LogprobCheck` wraps the run's engine as the weight
watcher's loader: it loads the weights, then samples a few probe prompts from the engine and
scores the same tokens with a copy of the policy model loaded from the same directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import torch
import trio
from safetensors.torch import load_file
from torch import nn

from ..engines import Completion, GenerateRequest, SamplingParams, WeightLoader
from ..samples import PolicyVersion
from ._weights import WEIGHTS_FILE

__all__ = ["LogprobCheck", "ReloadGap"]

logger = logging.getLogger("trio_rl.learn")

#: Largest |server - trainer| logprob gap of a float32 model that counts as the same weights.
GAP_LIMIT = 1e-4


class _Generator(WeightLoader, Protocol):
    async def generate(self, request: GenerateRequest) -> Completion: ...


@attrs.frozen
class ReloadGap:
    """One reload's check: the largest |server - trainer| logprob gap over ``tokens``."""

    version: PolicyVersion
    max_gap: float
    tokens: int

    def line(self) -> str:
        flag = "" if self.max_gap <= GAP_LIMIT else f"  <-- above {GAP_LIMIT:g}"
        return (
            f"reload v{self.version}: max |server - trainer| logprob gap {self.max_gap:.2e} "
            f"over {self.tokens} tokens{flag}"
        )


def reference_logprobs(
    model: nn.Module, weights: Path, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[list[float]]:
    """The logprob ``model``, loaded with ``weights`` (a published version's directory), gives
    each completion token of each ``(prompt, completion)`` at temperature 1."""
    model.load_state_dict(load_file(str(weights / WEIGHTS_FILE)))
    out: list[list[float]] = []
    with torch.no_grad():
        for prompt, completion in sequences:
            ids = torch.tensor([[*prompt, *completion]], dtype=torch.long)
            logits = model(ids)[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp.gather(1, torch.tensor(list(completion)).unsqueeze(1)).squeeze(1)
            out.append(picked.tolist())
    return out


@attrs.define(eq=False)
class LogprobCheck:
    """The weight watcher's loader around ``engine`` (see the module docstring): after each
    :meth:`load_weights`, ``samples`` completions of each of ``prompts`` (temperature 1,
    ``max_tokens``, seeds derived from the version) are scored by ``reference`` (a copy of the
    policy model this object owns) loaded from the same directory; the gap goes to ``report``
    (one line) and :attr:`gaps`. The scoring runs in a worker thread under ``limiter``."""

    engine: _Generator
    reference: nn.Module
    prompts: Sequence[tuple[int, ...]]
    max_tokens: int
    limiter: trio.CapacityLimiter
    report: Callable[[str], None]
    samples: int = 2
    gaps: list[ReloadGap] = attrs.field(factory=list)

    async def load_weights(self, path: str | os.PathLike[str], version: PolicyVersion) -> None:
        await self.engine.load_weights(path, version)
        requests = [
            GenerateRequest(
                prompt_tokens=tuple(prompt),
                params=SamplingParams(
                    max_tokens=self.max_tokens, temperature=1.0, seed=1000 * version + i
                ),
                request_id=f"logprob-check-v{version}-{i}",
            )
            for i, prompt in enumerate(p for p in self.prompts for _ in range(self.samples))
        ]
        completions: list[Completion | None] = [None] * len(requests)

        async def one(i: int) -> None:
            completions[i] = await self.engine.generate(requests[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
        done = [c for c in completions if c is not None and c.tokens]
        pairs = [
            (r.prompt_tokens, c.tokens)
            for r, c in zip(requests, completions, strict=True)
            if c is not None and c.tokens
        ]
        ours = await trio.to_thread.run_sync(
            reference_logprobs, self.reference, Path(path), pairs, limiter=self.limiter
        )
        gap = max(
            (
                abs(a - b)
                for c, mine in zip(done, ours, strict=True)
                for a, b in zip(c.logprobs, mine, strict=True)
            ),
            default=0.0,
        )
        result = ReloadGap(version, gap, sum(len(c.tokens) for c in done))
        self.gaps.append(result)
        self.report(result.line())
        if gap > GAP_LIMIT:
            logger.warning("%s: the servers do not serve the published weights", result.line())
