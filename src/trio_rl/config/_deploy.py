"""The sections of ``trio-rl run`` that describe a real run: your model (``[model]``), your
prompts (``[data]``) and your reward (``[reward]``). Each attrs class here is the one place its
keys are spelled: the TOML schema maps onto it and the run reads it as it is."""

from __future__ import annotations

import attrs

from ..errors import InvalidArgumentError
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
        "function runs in worker threads under the run's one capacity limiter; a reward that "
        "raises fails its sample (counted, shown) and the run goes on; unset: "
        "`trio_rl.learn.tasks:<rollout.task>`",
        validator=_spec,
    )
    timeout: float = option(
        60.0,
        "seconds one reward call may take; a slower one fails its sample",
        validator=positive_finite,
        may_change=True,
    )
