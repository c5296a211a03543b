"""`EnvConfig`: an episode's budgets and what a run does with an episode that goes wrong."""

from __future__ import annotations

from typing import Literal

import attrs

from .._validation import (
    non_negative_int,
    one_of,
    optional_positive_finite,
    optional_positive_int,
    positive_finite,
)

__all__ = ["EnvConfig", "MismatchPolicy", "STOP_REASONS", "StopReason"]

#: Why an episode ended; every episode ends with exactly one.
StopReason = Literal["done", "max_turns", "tool_timeout", "episode_timeout", "budget", "error"]
#: The stop reasons, in the order the metrics list them.
STOP_REASONS: tuple[StopReason, ...] = (
    "done",
    "max_turns",
    "tool_timeout",
    "episode_timeout",
    "budget",
    "error",
)
#: What a run does with an episode whose chat template rewrote earlier turns.
MismatchPolicy = Literal["fail", "drop"]


@attrs.frozen(kw_only=True)
class EnvConfig:
    """How a run plays its episodes (keyword arguments only). Each knob's meaning is its field's
    ``metadata["help"]``; the ``[env]`` section of the configuration files is made of them."""

    function: str | None = attrs.field(
        default=None,
        metadata={
            "help": 'the environment, "package.module:name": async fn(episode, record) -> '
            "reward (unset: one turn scored by [reward] function)"
        },
    )
    max_turns: int | None = attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata={
            "help": "policy turns (generate calls) an episode may take; one more ends it as "
            "max_turns (unset: only the token budget)"
        },
    )
    tool_timeout: float = attrs.field(
        default=30.0,
        validator=positive_finite,
        metadata={
            "help": "seconds one tool call may take; expiry ends the episode as tool_timeout"
        },
    )
    episode_timeout: float | None = attrs.field(
        default=600.0,
        validator=optional_positive_finite,
        metadata={
            "help": "seconds one episode may take, turns and tools included; expiry ends it "
            "as episode_timeout (unset: no limit of its own)"
        },
    )
    on_mismatch: MismatchPolicy = attrs.field(
        default="fail",
        validator=one_of(("fail", "drop")),
        metadata={
            "help": "a chat template that rewrote earlier turns: fail (the group fails with "
            "TemplateMismatchError) or drop (the episode trains nothing); counted either way"
        },
    )
    turn_retries: int = attrs.field(
        default=1,
        validator=non_negative_int,
        metadata={
            "help": "times a turn whose engine request failed (transport error, timeout) is "
            "sent again with the episode's whole prefix, counted; then the group fails"
        },
    )
