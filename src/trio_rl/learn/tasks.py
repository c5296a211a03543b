"""The built-in tasks as record rewards: three examples of ``[reward] function``.

Each is ``fn(record, completion) -> float``, the interface of any reward a run names in its
configuration (``[reward] function = "trio_rl.learn.tasks:reverse"``); the expected answer is
computed from ``record["prompt"]`` alone, so a JSONL file of ``{"prompt": "abd="}`` lines is a
complete data set for it. The reward is :func:`char_reward`: partial credit per character.
:func:`task_records` draws the records ``trio-rl run`` uses when ``[data] prompts`` is unset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from ._task import TASKS, char_reward

__all__ = ["copy", "expected", "repeat", "reverse", "task_records"]


def expected(task: str, prompt: str) -> str:
    """The right answer of ``task`` (copy, repeat, reverse) to ``prompt`` (ending in ``=``)."""
    text = prompt.removesuffix("=")
    if task == "copy":
        return text
    if task == "reverse":
        return text[::-1]
    if task == "repeat":
        letter, count = text[:1], text[1:]
        return letter * int(count) if count.isdigit() else ""
    raise InvalidArgumentError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def copy(record: Mapping[str, Any], completion: str) -> float:
    """``'abd='`` -> ``'abd'``."""
    return char_reward(completion, expected("copy", str(record["prompt"])))


def repeat(record: Mapping[str, Any], completion: str) -> float:
    """``'c4='`` -> ``'cccc'``."""
    return char_reward(completion, expected("repeat", str(record["prompt"])))


def reverse(record: Mapping[str, Any], completion: str) -> float:
    """``'abd='`` -> ``'dba'``."""
    return char_reward(completion, expected("reverse", str(record["prompt"])))


def task_records(task: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` records ``{"prompt": ..., "answer": ...}`` of built-in ``task`` drawn with
    ``seed`` (the answer is for a reader: the rewards recompute it from the prompt)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text, target = TASKS[task].draw(rng)
        out.append({"prompt": text + "=", "answer": target})
    return out
