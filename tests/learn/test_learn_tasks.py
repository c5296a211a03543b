"""The built-in tasks are record rewards like any other: the same prompts as before, the same
reward as before, through ``fn(record, completion)``."""

from __future__ import annotations

import pytest

from trio_rl.errors import InvalidArgumentError
from trio_rl.learn import TASKS, char_reward, make_prompts, tasks


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_task_reward_scores_its_records_as_the_task_did(name: str) -> None:
    records = tasks.task_records(name, 200, seed=3)
    prompts = make_prompts(TASKS[name], 200, seed=3)
    fn = getattr(tasks, name)
    for record, prompt in zip(records, prompts, strict=True):
        assert TASKS[name].tokenizer.encode(record["prompt"]) == prompt.tokens
        assert record["answer"] == prompt.label
        assert fn(record, prompt.label) == 1.0
        for reply in ("", "a", prompt.label + "a", prompt.label[::-1]):
            assert fn(record, reply) == char_reward(reply, prompt.label)


def test_an_unknown_task_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown task 'sort'"):
        tasks.expected("sort", "ab=")


def test_an_unknown_task_is_an_invalid_argument_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown task 'sort'; known: "):
        tasks.expected("sort", "ab=")
