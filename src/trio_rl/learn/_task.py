"""The built-in verifiable tasks and their character vocabulary.

A prompt is a short string ending in ``=``; the model replies with characters and ends with
``<eos>``. The reward gives partial credit per character (see :func:`char_reward`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs

from ..samples import Prompt, Sample

__all__ = [
    "EOS",
    "PAD",
    "TASKS",
    "Task",
    "Tokenizer",
    "char_reward",
    "make_prompts",
]

PAD, EOS = 0, 1
_SPECIALS = ("<pad>", "<eos>")
LETTERS = "abcde"


@attrs.frozen
class Tokenizer:
    """Characters <-> token ids. Ids 0 and 1 are ``<pad>`` and ``<eos>``."""

    chars: str = LETTERS + "="

    @property
    def vocab_size(self) -> int:
        return len(_SPECIALS) + len(self.chars)

    def encode(self, text: str) -> tuple[int, ...]:
        try:
            return tuple(len(_SPECIALS) + self.chars.index(c) for c in text)
        except ValueError:
            bad = next(c for c in text if c not in self.chars)
            raise ValueError(f"character {bad!r} of {text!r} is not in the vocabulary") from None

    def decode(self, tokens: Sequence[int]) -> str:
        """The text up to the first ``<eos>``; ``<pad>`` decodes to nothing."""
        out = []
        for t in tokens:
            if t == EOS:
                break
            if t >= len(_SPECIALS):
                out.append(self.chars[t - len(_SPECIALS)])
        return "".join(out)


def char_reward(reply: str, target: str) -> float:
    """Partial credit per character: ``#{i: reply[i] == target[i]} / max(len(reply), len(target))``.

    1.0 exactly for the right answer; a reply that is too long or too short loses the share of
    the positions it gets wrong, so stopping at the right length is learned too.
    """
    longest = max(len(reply), len(target))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(reply, target, strict=False)) / longest


@attrs.frozen
class Task:
    """A prompt generator and the answer it expects."""

    name: str
    #: Every character of prompts and answers ('=' included): the model's vocabulary.
    chars: str
    #: ``rng -> (prompt text without the trailing '=', target)``
    draw: Callable[[random.Random], tuple[str, str]]
    #: The longest reply worth generating (the engine's ``max_tokens`` minus the ``<eos>``).
    max_answer: int
    #: The longest prompt, ``=`` included.
    max_prompt: int
    description: str

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.chars)

    def reward(self) -> Callable[[Sample], float]:
        """The sample reward: :func:`char_reward` of the decoded completion and the label."""
        tokenizer = self.tokenizer

        def reward(sample: Sample) -> float:
            return char_reward(tokenizer.decode(sample.completion_tokens), str(sample.label))

        return reward


def _copy(rng: random.Random) -> tuple[str, str]:
    text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 6)))
    return text, text


def _reverse(rng: random.Random) -> tuple[str, str]:
    text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 6)))
    return text, text[::-1]


#: The lookup task's keys and the letters of its values.
LOOKUP_KEYS, LOOKUP_LETTERS = "12345", "abcdefgh"


def _lookup(rng: random.Random) -> tuple[str, str]:
    key = rng.choice(LOOKUP_KEYS)
    return key, rng.choice(LOOKUP_LETTERS)


def _repeat(rng: random.Random) -> tuple[str, str]:
    letter, count = rng.choice("abc"), rng.randint(1, 6)
    return f"{letter}{count}", letter * count


TASKS: dict[str, Task] = {
    "copy": Task(
        "copy",
        LETTERS + "=",
        _copy,
        max_answer=6,
        max_prompt=7,
        description="'abd=' -> 'abd': echo 1-6 letters of a-e",
    ),
    "reverse": Task(
        "reverse",
        LETTERS + "=",
        _reverse,
        max_answer=6,
        max_prompt=7,
        description="'abd=' -> 'dba': reverse 1-6 letters of a-e",
    ),
    "repeat": Task(
        "repeat",
        "abc123456=",
        _repeat,
        max_answer=6,
        max_prompt=3,
        description="'c4=' -> 'cccc': a letter of a-c repeated 1-6 times",
    ),
    # two turns: '3=' -> the call '3', the tool's reply 'f=' -> the answer 'f'; the prompt
    # is as long as the conversation before the answer (prompt, call and reply), so the
    # model's context holds the whole episode
    "lookup": Task(
        "lookup",
        LOOKUP_LETTERS + LOOKUP_KEYS + "=",
        _lookup,
        max_answer=1,
        max_prompt=2 + 2 + 2,
        description="'3=' -> call '3', read the reply 'f=' -> answer 'f': a tool lookup",
    ),
}


def make_prompts(task: Task, n: int, seed: int) -> list[Prompt]:
    """``n`` prompts of ``task`` drawn with ``seed``; the label is the expected reply."""
    tokenizer = task.tokenizer
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        text, target = task.draw(rng)
        prompts.append(
            Prompt(key=f"{task.name}-{i}", tokens=tokenizer.encode(text + "="), label=target)
        )
    return prompts
