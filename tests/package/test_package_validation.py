"""The one validator module: every config class refuses a bad value with one error type, worded
one way, and each check accepts exactly what its name says.

A bad field is an ``InvalidArgumentError``, which is both a ``TrioRLError`` (the library's one
root) and a ``ValueError`` (so code catching ``ValueError`` keeps working).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from trio_rl import _validation as v
from trio_rl._validation import at_least, between, check_at_least, one_of, positive_finite
from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.errors import EngineConfigError, InvalidArgumentError, RolloutConfigError, TrioRLError
from trio_rl.orchestrator import OrchestratorConfig
from trio_rl.rollout import GroupFactory
from trio_rl.rollout._credits import CreditView
from trio_rl.sink import SinkConfig


@attrs.frozen
class _Knobs:
    count: int | None = attrs.field(default=1, validator=at_least(1))
    port: int = attrs.field(default=80, validator=between(1, 65535))
    rate: float = attrs.field(default=1.0, validator=positive_finite)
    mode: str = attrs.field(default="a", validator=one_of(("a", "b")))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "_Knobs.count must be >= 1, got 0"),
        ({"port": 0}, "_Knobs.port must be between 1 and 65535, got 0"),
        ({"rate": 0.0}, "_Knobs.rate must be finite and > 0, got 0.0"),
        ({"rate": math.inf}, "_Knobs.rate must be finite and > 0, got inf"),
        ({"rate": math.nan}, "_Knobs.rate must be finite and > 0, got nan"),
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


_INF, _NAN = math.inf, math.nan

# check -> (accepted values, refused values): each name says what it accepts
_ACCEPTS: dict[str, tuple[list[Any], list[Any]]] = {
    "a_bool": ([True, False], [0, 1, None, "yes"]),
    "an_int": ([0, -3, 7], [1.0, True, None, "1"]),
    "optional_int": ([None, 0, -3], [1.5, False, "1"]),
    "positive_int": ([1, 10**9], [0, -1, 1.0, True, None]),
    "non_negative_int": ([0, 5], [-1, 0.0, False, None]),
    "optional_positive_int": ([None, 1], [0, 2.0, True]),
    "positive_finite": ([1e-9, 3, 2.5], [0, -1.0, _INF, _NAN, None, True, "1"]),
    "optional_positive_finite": ([None, 1e-9, 4], [0, _INF, _NAN, False, "1"]),
    "positive_or_inf": ([1e-9, 2, _INF], [0, -_INF, _NAN, None, True]),
    "non_negative_finite": ([0, 0.0, 3.5], [-1e-9, _INF, _NAN, None, False]),
    "non_negative_or_inf": ([0, 2.0, _INF], [-1, _NAN, None, True]),
    "probability": ([0, 0.5, 1.0], [-0.1, 1.01, _NAN, None, True]),
    "open_unit": ([1e-9, 1.0], [0, 0.0, 1.5, _NAN, None]),
    "http_urls": (["http://a", ("https://a", "http://b")], [(), "localhost:8000", ("http://a", 3)]),
}


@pytest.mark.parametrize("name", sorted(_ACCEPTS))
def test_each_check_accepts_what_its_name_says(name: str) -> None:
    check = getattr(v, name)
    accepted, refused = _ACCEPTS[name]
    attribute = attrs.fields(_Knobs).rate
    for value in accepted:
        check(_Knobs(), attribute, value)
    for value in refused:
        with pytest.raises(InvalidArgumentError, match=r"^_Knobs\.rate must be "):
            check(_Knobs(), attribute, value)


def test_the_argument_checks_name_owner_and_argument() -> None:
    v.check_int("Driver", "batch", 2, minimum=1)
    v.check_optional_int("Driver", "batch", None, minimum=1)
    v.check_optional_positive_finite("run", "timeout", None)
    v.check_choice("Driver", "mode", "a", ("a", "b"))
    with pytest.raises(InvalidArgumentError, match=r"^Driver\.batch must be an int >= 1, got 0$"):
        v.check_optional_int("Driver", "batch", 0, minimum=1)
    with pytest.raises(InvalidArgumentError, match=r"^run\.timeout must be finite and > 0"):
        v.check_optional_positive_finite("run", "timeout", _INF)
    with pytest.raises(InvalidArgumentError, match=r"^Driver\.mode must be one of"):
        v.check_choice("Driver", "mode", "c", ("a", "b"))


def test_the_layer_errors_are_the_shared_error() -> None:
    # code that catches the shared error also catches the layers' own config errors
    assert issubclass(EngineConfigError, InvalidArgumentError)
    assert issubclass(RolloutConfigError, InvalidArgumentError)


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
        (
            lambda: SamplingParams(max_tokens=0),
            "SamplingParams.max_tokens must be an int >= 1, got 0",
        ),
        (
            lambda: SimulatedEngine("long-cot", slots=0),
            "SimulatedEngine.slots must be an int >= 1, got 0",
        ),
        (
            lambda: GroupFactory(group_size=0),
            "GroupFactory.group_size must be an int >= 1, got 0",
        ),
    ],
)
def test_the_library_configs_raise_the_shared_error(build: Any, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        build()
