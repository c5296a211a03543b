"""A reward for the worker benchmark, in a module of its own: a worker process imports it by
name (a function of the script itself would be ``__main__``'s, which a worker cannot import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def score(record: Mapping[str, Any], completion: str) -> float:
    """A reward as cheap as the built-in tasks' (per-character credit)."""
    answer = str(record["answer"])
    longest = max(len(answer), len(completion))
    return sum(a == b for a, b in zip(answer, completion, strict=False)) / max(longest, 1)
