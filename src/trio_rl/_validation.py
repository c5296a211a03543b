"""Every check of an argument or a config field: one module, one error, one wording.

Each check is named by what it accepts (`positive_finite`, `positive_or_inf`,
`optional_positive_int`, `open_unit`, ...): the ``optional_`` ones accept None too, the others
refuse it. A refused value is always an :class:`~trio_rl.errors.InvalidArgumentError` (a
:class:`~trio_rl.errors.TrioRLError` and a ``ValueError``) worded the same way everywhere:
``<Owner>.<field> must be an int >= 1, got 0``.

The attrs validators name the field by its class and attribute (``OrchestratorConfig.
batch_groups``). Called without an instance, as the configuration loader calls them to check a
value before it builds the section, they leave the name out: the loader puts the file, line and
dotted key in front of the message itself. The ``check_*`` functions check a plain argument and
take its name.

This module sits on the ground floor beside :mod:`trio_rl.errors`: every layer may import it,
and it imports nothing of ours but the errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
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


def _named(owner: str, name: str) -> str:
    """``Owner.name `` in front of a message; nothing without an owner: a validator called
    without an instance, as the configuration loader calls it (it puts the file, line and key
    in front of the message itself)."""
    return f"{owner}.{name} " if owner else ""


def _refuse(where: str, value: object, want: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{where}must be {want}, got {value!r}")


def is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_finite(value: object) -> bool:
    return is_number(value) and math.isfinite(value) and value > 0  # type: ignore[arg-type,operator]


# attrs validators taking no parameter ----------------------------------------------------------


def a_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """True or False."""
    if not isinstance(value, bool):
        raise _refuse(_field(instance, attribute), value, "True or False")


def an_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Any int (not a bool)."""
    if not is_int(value):
        raise _refuse(_field(instance, attribute), value, "an int")


def optional_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """None or any int."""
    if value is not None and not is_int(value):
        raise _refuse(_field(instance, attribute), value, "an int or None")


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An int ``>= 1``."""
    check_int(_owner(instance), attribute.name, value, minimum=1)


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An int ``>= 0``."""
    check_int(_owner(instance), attribute.name, value, minimum=0)


def optional_positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """None or an int ``>= 1``."""
    check_optional_int(_owner(instance), attribute.name, value, minimum=1)


def positive_finite(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A finite number ``> 0`` (nan and inf are refused)."""
    if not _is_positive_finite(value):
        raise _refuse(_field(instance, attribute), value, "finite and > 0")


def optional_positive_finite(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    """None or a finite number ``> 0`` (a timeout that may be unset)."""
    check_optional_positive_finite(_owner(instance), attribute.name, value)


def positive_or_inf(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A number ``> 0``, ``inf`` included (no limit); nan is refused."""
    if not (is_number(value) and value > 0):  # type: ignore[operator]
        raise _refuse(_field(instance, attribute), value, "> 0 (inf: no limit)")


def non_negative_finite(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A finite number ``>= 0``."""
    if not (is_number(value) and math.isfinite(value) and value >= 0):  # type: ignore[arg-type,operator]
        raise _refuse(_field(instance, attribute), value, "finite and >= 0")


def non_negative_or_inf(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A number ``>= 0``, ``inf`` included (no limit); nan is refused."""
    if not (is_number(value) and value >= 0):  # type: ignore[operator]
        raise _refuse(_field(instance, attribute), value, ">= 0 (inf: no limit)")


def probability(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A number in ``[0, 1]``."""
    if not (is_number(value) and 0.0 <= value <= 1.0):  # type: ignore[operator]
        raise _refuse(_field(instance, attribute), value, "in [0, 1]")


def open_unit(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A number in ``(0, 1]``."""
    if not (is_number(value) and 0.0 < value <= 1.0):  # type: ignore[operator]
        raise _refuse(_field(instance, attribute), value, "in (0, 1]")


def http_urls(
    instance: object, attribute: attrs.Attribute[Any], value: str | tuple[str, ...]
) -> None:
    """One ``http(s)://`` URL, or a non-empty tuple of them."""
    urls = (value,) if isinstance(value, str) else value
    if not urls:
        raise _refuse(_field(instance, attribute), value, "at least one http(s):// URL")
    for url in urls:
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise _refuse(_field(instance, attribute), url, "an http(s):// URL")


def url_tuple(value: str | Sequence[str]) -> tuple[str, ...]:
    """A converter: one URL or several, as a tuple without trailing slashes."""
    urls = (value,) if isinstance(value, str) else tuple(value)
    return tuple(u.rstrip("/") for u in urls)


# attrs validators made from a parameter --------------------------------------------------------


def at_least(n: float) -> Validator:
    """A validator: None or a number ``>= n`` (nan is refused)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value >= n:
            raise _refuse(_field(instance, attribute), value, f">= {n}")

    return check


def between(low: int, high: int) -> Validator:
    """A validator: None or a number in ``[low, high]``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not low <= value <= high:
            raise _refuse(_field(instance, attribute), value, f"between {low} and {high}")

    return check


def one_of(choices: Collection[Any]) -> Validator:
    """A validator: one of ``choices``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise _refuse(_field(instance, attribute), value, f"one of {list(choices)}")

    return check


# checks of plain arguments ---------------------------------------------------------------------


def _owner(instance: object) -> str:
    return "" if instance is None else type(instance).__name__


def check_at_least(name: str, value: float | None, n: float) -> None:
    """``value`` (an argument called ``name``) is None or ``>= n``."""
    if value is not None and not value >= n:
        raise _refuse(f"{name} ", value, f">= {n}")


def check_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    """``value`` (``owner.name``) is an int ``>= minimum``."""
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise _refuse(_named(owner, name), value, f"an int >= {minimum}")


def check_optional_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    """``value`` (``owner.name``) is None or an int ``>= minimum``."""
    if value is not None:
        check_int(owner, name, value, minimum=minimum)


def check_optional_positive_finite(owner: str, name: str, value: object) -> None:
    """``value`` (``owner.name``) is None or a finite number ``> 0``."""
    if value is not None and not _is_positive_finite(value):
        raise _refuse(_named(owner, name), value, "finite and > 0 or None")


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` (``owner.name``) is one of ``choices``."""
    if value not in choices:
        raise _refuse(_named(owner, name), value, f"one of {choices}")
