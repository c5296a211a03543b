"""The sections of ``trio-rl run`` that describe a real run: your model (``[model]``), your
prompts (``[data]``) and your reward (``[reward]``). Each attrs class here is the one place its
keys are spelled: the TOML schema maps onto it and the run reads it as it is."""

from __future__ import annotations

import attrs

from ..errors import InvalidArgumentError
from ..workers import DEFAULT_WORKERS, WorkerMode
from ._load import at_least, option, positive_finite

__all__ = ["DataSection", "ModelSection", "RewardSection"]


def _spec(_: object, attribute: attrs.Attribute[object], value: object) -> None:
    if value is None:
        return
    module, sep, name = str(value).partition(":")
    if not sep or not module.strip() or not name.strip():
        raise InvalidArgumentError(f'expected "package.module:name", got {value!r}')


@attrs.frozen
class ModelSection:
    """The policy: a Hugging Face model directory (unset: the built-in character model of
    ``rollout.task``)."""

    path: str | None = option(
        None,
        "a Hugging Face model directory (config.json, weights, tokenizer files), loaded with "
        "transformers (trio-rl[transformers]); unset: the built-in character model",
    )


@attrs.frozen
class DataSection:
    """The prompts: a JSONL file, one record per line (unset: ``rollout.task``'s generated
    prompts)."""

    prompts: str | None = option(
        None,
        'a JSONL file: each line an object with `"prompt"` (text) or `"messages"` (a chat, '
        "rendered with the tokenizer's chat template); every field goes to the reward; unset: "
        "`rollout.prompts` prompts of `rollout.task`",
    )
    max_tokens: int = option(
        32, "completion cap of a sample drawn from `prompts`", validator=at_least(1)
    )


@attrs.frozen
class RewardSection:
    """The reward: ``fn(record, completion) -> float``, plain or async (unset: the task's)."""

    function: str | None = option(
        None,
        '"package.module:name", imported from the working directory or sys.path and called as '
        "`fn(record, completion)` (the JSONL line as a dict, the decoded completion); a plain "
        "function runs in workers of its own (`mode`); a reward that raises fails its sample "
        "(counted, shown) and the run goes on; unset: `trio_rl.learn.tasks:<rollout.task>`",
        validator=_spec,
    )
    timeout: float = option(
        60.0,
        "seconds one reward call may take; a slower one is killed (its worker process; in "
        "thread mode its thread is abandoned) and fails its sample",
        validator=positive_finite,
        may_change=True,
    )
    mode: WorkerMode = option(  # noqa: RUF009 - a Literal alias, not a mutable default
        "process",
        "where a plain reward runs: `process`, worker processes of its own, killed when a call "
        "overruns (the function must be importable by name); `thread`, threads under the "
        "reward's own limiter, for a reward that cannot be pickled or is known to be fast (a "
        "call that hangs cannot be killed: its thread keeps a token)",
        may_change=True,
    )
    workers: int = option(
        DEFAULT_WORKERS,
        "calls of a plain reward at a time (worker processes at most: two start with the run, "
        "more while calls wait); more than a group of samples, so that a group whose record "
        "hangs leaves workers to the others",
        validator=at_least(1),
        may_change=True,
    )
    failure_budget: int | None = option(
        None,
        "samples failed by the reward in a row that stop the run (exit 1, one line naming the "
        "reward, the exception and the record); unset: a step's worth "
        "(`rollout.batch_groups` x `rollout.group_size`)",
        validator=at_least(1),
        may_change=True,
    )
