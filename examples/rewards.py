"""Reward functions for ``[reward] function``: each is ``fn(record, completion) -> float``.

``record`` is the JSONL line as a dict (every field of it), ``completion`` the decoded text.
A plain function runs in a worker process of the run's reward pool (imported there again by
its name, so it must live at the top level of a module); an ``async def`` one is awaited on the
event loop (for a reward that calls a service). A reward that raises or overruns
``[reward] timeout`` fails that one sample: the run counts it, shows the first few, and goes
on.

``trio-rl run examples/own_data.toml`` (from the repository root) names
``examples.rewards:partial_match``; the built-in tasks' rewards are in ``trio_rl.learn.tasks``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio
import trio.lowlevel


def partial_match(record: Mapping[str, Any], completion: str) -> float:
    """The share of ``record["answer"]``'s characters the completion gets right, position by
    position (a completion too long or too short loses the positions it gets wrong)."""
    answer = str(record["answer"])
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, completion, strict=False)) / longest


def exact_match(record: Mapping[str, Any], completion: str) -> float:
    """1.0 for exactly ``record["answer"]``, else 0.0."""
    return float(completion == str(record["answer"]))


async def checked_remotely(record: Mapping[str, Any], completion: str) -> float:
    """An async reward: where a real one would await a verifier service (with httpx, say),
    this one yields to the loop and scores locally."""
    await trio.lowlevel.checkpoint()
    return partial_match(record, completion)
