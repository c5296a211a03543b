"""attrs validators and checks for rollout settings, raising :class:`RolloutConfigError`.

Each message names the owner, the field and the bad value, so a bad knob is refused in one line
when the object is built instead of hanging, livelocking or failing later.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from ._errors import RolloutConfigError


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _named(owner: str, name: str) -> str:
    """``Owner.name `` in front of a message; nothing without an owner: a validator called
    without an instance, as the configuration loader calls it (it puts the file, line and key
    in front of the message itself)."""
    return f"{owner}.{name} " if owner else ""


def check_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    """Refuse ``value`` unless it is an int ``>= minimum``."""
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise RolloutConfigError(f"{_named(owner, name)}must be an int >= {minimum}, got {value!r}")


def check_optional_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    if value is not None:
        check_int(owner, name, value, minimum=minimum)


def check_timeout(owner: str, name: str, value: object) -> None:
    """Refuse a timeout unless it is None or finite and > 0."""
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value > 0):  # type: ignore[arg-type,operator]
        raise RolloutConfigError(
            f"{_named(owner, name)}must be finite and > 0 or None, got {value!r}"
        )


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise RolloutConfigError(f"{_named(owner, name)}must be one of {choices}, got {value!r}")


def _owner(instance: object) -> str:
    return "" if instance is None else type(instance).__name__


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_int(_owner(instance), attribute.name, value, minimum=1)


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_int(_owner(instance), attribute.name, value, minimum=0)


def optional_positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_optional_int(_owner(instance), attribute.name, value, minimum=1)


def optional_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not _is_int(value):
        raise RolloutConfigError(
            f"{_named(_owner(instance), attribute.name)}must be an int or None, got {value!r}"
        )


def timeout(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_timeout(_owner(instance), attribute.name, value)
