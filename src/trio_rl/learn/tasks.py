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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

from ..envs import CompactCalls, ToolCall, ToolEnv
from ..errors import InvalidArgumentError
from ._task import LOOKUP_KEYS, TASKS, char_reward

__all__ = [
    "HELD_OUT_EVERY",
    "copy",
    "expected",
    "held_out",
    "lookup",
    "lookup_blind",
    "lookup_reward",
    "repeat",
    "reverse",
    "task_records",
]


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


def lookup_reward(record: Mapping[str, Any], answer: str, calls: Sequence[ToolCall]) -> float:
    """The lookup task's reward: nothing without a tool call (the task is to look the value
    up); with one, 0.05, 0.1 more when it named the prompt's key, plus 0.85 x
    :func:`char_reward` of the answer and the key's value in the record's table. The value
    is drawn per record: only the tool's reply tells it (a policy that calls right and
    guesses the answer gets about 0.25)."""
    if not calls:
        return 0.0
    key = str(record["key"])
    right = any(call.args == (key,) for call in calls)
    return 0.05 + 0.1 * right + 0.85 * char_reward(answer, str(record["table"][key]))


def _table_tool(
    blank: bool,
) -> Callable[[Mapping[str, Any]], list[Callable[[str], Awaitable[str]]]]:
    def tools(record: Mapping[str, Any]) -> list[Callable[[str], Awaitable[str]]]:
        table = record["table"]

        async def lookup(key: str) -> str:  # a dict lookup: on the loop, no worker thread
            return "" if blank else str(table.get(key, ""))

        return [lookup]

    return tools


#: The lookup task's call syntax: a turn that is one key looks it up; the reply is the
#: value, then ``=``.
LOOKUP_CALLS = CompactCalls(pattern=f"([{LOOKUP_KEYS}])$")

#: The built-in multi-turn task (``[env] function = "trio_rl.learn.tasks:lookup"``): the
#: prompt names a key (``'3='``); the policy calls the lookup tool with it (``'3'``), reads the
#: reply (``'f='``) and answers the value (``'f'``).
lookup = ToolEnv(
    [], lookup_reward, max_turns=2, syntax=LOOKUP_CALLS, record_tools=_table_tool(blank=False)
)
#: The control of :data:`lookup`: the same task with the tool's reply blanked (``'='``).
lookup_blind = ToolEnv(
    [], lookup_reward, max_turns=2, syntax=LOOKUP_CALLS, record_tools=_table_tool(blank=True)
)


def task_records(
    task: str, n: int, seed: int, split: Literal["train", "held_out"] = "train"
) -> list[dict[str, Any]]:
    """``n`` records ``{"prompt": ..., "answer": ...}`` of built-in ``task`` drawn with
    ``seed`` (the answer is for a reader: the rewards recompute it from the prompt). The
    lookup task's records also hold the ``key`` and the ``table`` its tool reads (a value per
    key, drawn per record).

    ``split="train"`` never draws a held-out prompt (:func:`held_out`); ``"held_out"`` draws
    distinct held-out prompts only, at most ``n`` (fewer when the task has fewer). The lookup
    task holds out no key: its answers are drawn per record, so its held-out records are new
    tables (drawn from another stream of ``seed``) that no training record has."""
    if task == "lookup":
        return _lookup_records(n, seed if split == "train" else seed + _HELD_OUT_STREAM)
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


#: The lookup task's held-out records come from this offset of the run's seed.
_HELD_OUT_STREAM = 1_000_003


def _lookup_records(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for _ in range(n):
        text, target = TASKS["lookup"].draw(rng)
        table = {k: TASKS["lookup"].draw(rng)[1] for k in LOOKUP_KEYS}
        table[text] = target
        out.append({"prompt": text + "=", "answer": target, "key": text, "table": table})
    return out
