"""Test helpers for the rollout layer: prompts, a source, a puppet generate function.

The scripted engine and the group builders are in tests/builders.py.
"""

from __future__ import annotations

import trio

from trio_rl.rollout import InMemorySource
from trio_rl.samples import Prompt, Sample, SampleStatus


def prompts(n: int, prefix: str = "p") -> list[Prompt]:
    return [Prompt(key=f"{prefix}{i}", tokens=(i, i + 1), label=i) for i in range(n)]


def source(n: int, **kwargs: object) -> InMemorySource:
    return InMemorySource(prompts(n), **kwargs)  # type: ignore[arg-type]


class Puppet:
    """A generate function whose samples finish only when the test says so.

    ``auto_delay`` (seconds) makes every sample finish on its own after that (virtual) time.
    Each started sample is recorded in ``started``; a cancelled one in ``cancelled``.
    """

    def __init__(self, *, auto_delay: float | None = None, version: int = 0) -> None:
        self.auto_delay = auto_delay
        self.version = version
        self.started: list[Sample] = []
        self.cancelled: list[int] = []
        self.finished: list[int] = []
        self._gates: dict[int, trio.Event] = {}
        self._errors: dict[int, Exception] = {}
        self._statuses: dict[int, SampleStatus] = {}
        self._versions: dict[int, int] = {}

    def _gate(self, index: int) -> trio.Event:
        return self._gates.setdefault(index, trio.Event())

    async def __call__(self, sample: Sample) -> None:
        self.started.append(sample)
        try:
            if self.auto_delay is not None and sample.index not in self._gates:
                await trio.sleep(self.auto_delay)
            else:
                await self._gate(sample.index).wait()
        except trio.Cancelled:
            self.cancelled.append(sample.index)
            raise
        if sample.index in self._errors:
            raise self._errors[sample.index]
        sample.completion_tokens.extend([7, 8])
        sample.logprobs.extend([-0.5, -0.25])
        sample.loss_mask.extend([True, True])
        sample.policy_versions.append(self._versions.get(sample.index, self.version))
        sample.status = self._statuses.get(sample.index, SampleStatus.COMPLETED)
        self.finished.append(sample.index)

    def hold(self, *indices: int) -> None:
        """Make these samples wait for :meth:`finish` even in auto mode."""
        for i in indices:
            self._gate(i)

    def finish(
        self,
        *indices: int,
        status: SampleStatus = SampleStatus.COMPLETED,
        version: int | None = None,
    ) -> None:
        for i in indices:
            self._statuses[i] = status
            if version is not None:
                self._versions[i] = version
            self._gate(i).set()

    def fail(self, index: int, error: Exception) -> None:
        self._errors[index] = error
        self._gate(index).set()

    def started_indices(self) -> list[int]:
        return [s.index for s in self.started]

    def started_groups(self) -> list[int]:
        return sorted({s.group_index for s in self.started})
