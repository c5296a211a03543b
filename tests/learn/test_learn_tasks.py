"""The built-in tasks are record rewards like any other: the same prompts as before (less
their held-out part, which is evaluated, never trained on), the same reward as before, through
``fn(record, completion)``."""

from __future__ import annotations

import pytest

from trio_rl.errors import InvalidArgumentError
from trio_rl.learn import TASKS, char_reward, make_prompts, tasks

#: The built-in tasks that are environments (multi-turn: not record rewards).
ENVIRONMENTS = {"lookup"}


@pytest.mark.parametrize("name", sorted(set(TASKS) - ENVIRONMENTS))
def test_a_task_reward_scores_its_records_as_the_task_did(name: str) -> None:
    records = tasks.task_records(name, 200, seed=3)
    tokenizer = TASKS[name].tokenizer
    drawn = make_prompts(TASKS[name], 600, seed=3)
    trained = [p for p in drawn if not tasks.held_out(tokenizer.decode(p.tokens)[:-1])]
    assert len(trained) < len(drawn)  # the held-out prompts were drawn, and left out
    prompts = trained[:200]
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


def test_the_built_in_tasks_hold_out_an_eighth_never_trained() -> None:
    for name in ("copy", "repeat", "reverse"):
        held = tasks.task_records(name, 64, seed=1, split="held_out")
        trained = tasks.task_records(name, 2_000, seed=1)
        held_texts = {r["prompt"] for r in held}
        assert len(held_texts) == len(held)  # distinct
        assert all(tasks.held_out(p.removesuffix("=")) for p in held_texts)
        assert not held_texts & {r["prompt"] for r in trained}
        assert len(trained) == 2_000
    # the repeat task has 18 prompts; these three are its held-out part
    assert {r["prompt"] for r in tasks.task_records("repeat", 64, 0, "held_out")} == {
        "a6=",
        "b1=",
        "c5=",
    }


def test_the_lookup_task_holds_out_new_tables() -> None:
    """The lookup task's answers are drawn per record: its held-out records are records of
    another stream, each answer the value its table holds for its key."""
    held = tasks.task_records("lookup", 64, seed=1, split="held_out")
    trained = tasks.task_records("lookup", 64, seed=1)
    assert held != trained
    assert tasks.task_records("lookup", 64, seed=1, split="held_out") == held  # reproducible
    for record in held + trained:
        assert record["table"][record["key"]] == record["answer"]
        assert record["prompt"] == record["key"] + "="
