"""The built-in tasks as record rewards: three examples of ``[reward] function``.

Each is ``fn(record, completion) -> float``, the interface of any reward a run names in its
configuration (``[reward] function = "trio_rl.learn.tasks:reverse"``); the expected answer is
computed from ``record["prompt"]`` alone, so a JSONL file of ``{"prompt": "abd="}`` lines is a
complete data set for it. The reward is :func:`char_reward`: partial credit per character.
:func:`task_records` draws the records ``trio-rl run`` uses when ``[data] prompts`` is unset:
its training prompts, or its held-out part (:func:`held_out`, an eighth of the prompt texts),
which the run evaluates on and never trains on.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping
from typing import Any, Literal

from ..errors import InvalidArgumentError
from ._task import TASKS, char_reward

__all__ = ["HELD_OUT_EVERY", "copy", "expected", "held_out", "repeat", "reverse", "task_records"]


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


#: One prompt text in this many (by CRC-32) is the task's held-out part: never drawn for
#: training, evaluated on (``repeat`` holds out ``a6``, ``b1`` and ``c5``).
HELD_OUT_EVERY = 8
#: Draws tried per held-out record wanted (a small task has few distinct held-out prompts).
_HELD_OUT_DRAWS = 200


def held_out(text: str) -> bool:
    """Whether the prompt ``text`` (without its ``=``) is in its task's held-out part."""
    return zlib.crc32(text.encode()) % HELD_OUT_EVERY == 0


def task_records(
    task: str, n: int, seed: int, split: Literal["train", "held_out"] = "train"
) -> list[dict[str, Any]]:
    """``n`` records ``{"prompt": ..., "answer": ...}`` of built-in ``task`` drawn with
    ``seed`` (the answer is for a reader: the rewards recompute it from the prompt).

    ``split="train"`` never draws a held-out prompt (:func:`held_out`); ``"held_out"`` draws
    distinct held-out prompts only, at most ``n`` (fewer when the task has fewer)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(n * _HELD_OUT_DRAWS if split == "held_out" else 1_000 * n):
        if len(out) == n:
            break
        text, target = TASKS[task].draw(rng)
        if held_out(text) != (split == "held_out") or (split == "held_out" and text in seen):
            continue
        seen.add(text)
        out.append({"prompt": text + "=", "answer": target})
    return out
