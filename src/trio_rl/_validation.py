"""The shared checks of arguments and config fields: one error, one wording.

Every config class (attrs) and every function that checks a number uses these instead of a
hand-written ``if value < n: raise ValueError(...)``, so a bad value is always an
:class:`~trio_rl.errors.InvalidArgumentError` (a :class:`~trio_rl.errors.TrioRLError` and a
``ValueError``) worded the same way everywhere: ``<Owner>.<field> must be >= 1, got 0``.

The attrs validators name the field by its class and attribute (``OrchestratorConfig.
batch_groups``). Called without an instance, as the configuration loader calls them to check a
value before it builds the section, they leave the name out: the loader puts the file, line and
dotted key in front of the message itself.

This module sits on the ground floor beside :mod:`trio_rl.errors`: every layer may import it,
and it imports nothing of ours but the errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import attrs

from .errors import InvalidArgumentError

#: The signature of an attrs validator: ``(instance, attribute, value)``.
Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _field(instance: object, attribute: attrs.Attribute[Any]) -> str:
    """``Owner.field `` for a validator called on an instance, empty without one."""
    if instance is None:
        return ""
    return f"{type(instance).__name__}.{attribute.name} "


def at_least(n: float) -> Validator:
    """A validator: None or a number ``>= n`` (nan is refused)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value >= n:
            raise InvalidArgumentError(f"{_field(instance, attribute)}must be >= {n}, got {value}")

    return check


def between(low: int, high: int) -> Validator:
    """A validator: None or a number in ``[low, high]``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not low <= value <= high:
            raise InvalidArgumentError(
                f"{_field(instance, attribute)}must be between {low} and {high}, got {value}"
            )

    return check


def positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A validator: None or a finite number ``> 0`` (nan and inf are refused)."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise InvalidArgumentError(
            f"{_field(instance, attribute)}must be a finite number > 0, got {value}"
        )


def one_of(choices: Collection[Any]) -> Validator:
    """A validator: one of ``choices``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise InvalidArgumentError(
                f"{_field(instance, attribute)}must be one of {list(choices)}, got {value!r}"
            )

    return check


def check_at_least(name: str, value: float | None, n: float) -> None:
    """``value`` (an argument called ``name``) is None or ``>= n``, else
    `InvalidArgumentError`."""
    if value is not None and not value >= n:
        raise InvalidArgumentError(f"{name} must be >= {n}, got {value}")
