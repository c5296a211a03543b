"""The shared checks: every config class refuses a bad value with one error type, worded one way.

A bad field is an ``InvalidArgumentError``, which is both a ``TrioRLError`` (the library's one
root) and a ``ValueError`` (so code catching ``ValueError`` keeps working).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from trio_rl._validation import at_least, between, check_at_least, one_of, positive
from trio_rl.errors import InvalidArgumentError, TrioRLError
from trio_rl.orchestrator import OrchestratorConfig
from trio_rl.rollout._credits import CreditView
from trio_rl.train import SinkConfig


@attrs.frozen
class _Knobs:
    count: int | None = attrs.field(default=1, validator=at_least(1))
    port: int = attrs.field(default=80, validator=between(1, 65535))
    rate: float = attrs.field(default=1.0, validator=positive)
    mode: str = attrs.field(default="a", validator=one_of(("a", "b")))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "_Knobs.count must be >= 1, got 0"),
        ({"port": 0}, "_Knobs.port must be between 1 and 65535, got 0"),
        ({"rate": 0.0}, "_Knobs.rate must be a finite number > 0, got 0.0"),
        ({"rate": math.inf}, "_Knobs.rate must be a finite number > 0, got inf"),
        ({"rate": math.nan}, "_Knobs.rate must be a finite number > 0, got nan"),
        ({"mode": "c"}, "_Knobs.mode must be one of ['a', 'b'], got 'c'"),
    ],
)
def test_a_bad_field_is_one_error_naming_owner_field_and_value(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        _Knobs(**kwargs)
    assert str(caught.value) == message
    assert isinstance(caught.value, TrioRLError)
    assert isinstance(caught.value, ValueError)


def test_none_passes_the_range_checks_and_good_values_build() -> None:
    assert _Knobs(count=None, port=65535, rate=1e-9, mode="b").count is None


def test_without_an_instance_the_message_leaves_the_owner_to_the_caller() -> None:
    # the configuration loader checks a value before it builds the section, and puts the file,
    # line and dotted key in front itself
    attribute = attrs.fields(_Knobs).count
    with pytest.raises(InvalidArgumentError) as caught:
        at_least(1)(None, attribute, 0)
    assert str(caught.value) == "must be >= 1, got 0"


def test_check_at_least_names_the_argument() -> None:
    check_at_least("steps", 0, 0)
    with pytest.raises(InvalidArgumentError, match=r"^steps must be >= 0, got -1$"):
        check_at_least("steps", -1, 0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: OrchestratorConfig(batch_groups=0),
            "OrchestratorConfig.batch_groups must be >= 1",
        ),
        (
            lambda: OrchestratorConfig(batch_groups=2, sink=SinkConfig(batch_size=3)),
            "OrchestratorConfig.sink.batch_size must be batch_groups x group_size = 16",
        ),
        (lambda: SinkConfig(batch_size=0), "SinkConfig.batch_size must be >= 1, got 0"),
        (
            lambda: SinkConfig(batch_size=4, max_off_policy_steps=-1),
            "SinkConfig.max_off_policy_steps must be >= 0, got -1",
        ),
        (lambda: SinkConfig(), "exactly one of batch_size or token_batch_size"),
        (
            lambda: CreditView(in_flight=0, pending_groups=0, group_size=0, budget=1),
            "CreditView.group_size must be >= 1, got 0",
        ),
    ],
)
def test_the_library_configs_raise_the_shared_error(build: Any, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        build()
