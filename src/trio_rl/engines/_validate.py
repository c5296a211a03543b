"""attrs validators for engine settings: refuse a bad value when the object is built.

Each raises :class:`EngineConfigError` naming the class, the field and the value, so a bad knob
(``max_tokens=0``, a zero decode speed) fails at once in one line instead of hanging or
flooding the log with per-request failures later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from ._errors import EngineConfigError


def _fail(instance: object, attribute: attrs.Attribute[Any], value: object, want: str) -> None:
    raise EngineConfigError(
        f"{type(instance).__name__}.{attribute.name} must be {want}, got {value!r}"
    )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def url_tuple(value: str | Sequence[str]) -> tuple[str, ...]:
    """A converter: one URL or several, as a tuple without trailing slashes."""
    urls = (value,) if isinstance(value, str) else tuple(value)
    return tuple(u.rstrip("/") for u in urls)


def a_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        _fail(instance, attribute, value, "True or False")


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(instance, attribute, value, "an int >= 1")


def optional_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        _fail(instance, attribute, value, "an int or None")


def an_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(instance, attribute, value, "an int")


def positive_finite(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (_is_number(value) and math.isfinite(value) and value > 0):  # type: ignore[arg-type,operator]
        _fail(instance, attribute, value, "finite and > 0")


def non_negative_finite(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (_is_number(value) and math.isfinite(value) and value >= 0):  # type: ignore[arg-type,operator]
        _fail(instance, attribute, value, "finite and >= 0")


def positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """> 0 and not NaN (``inf`` allowed: no limit)."""
    if not (value > 0 and not math.isnan(value)):
        _fail(instance, attribute, value, "> 0")


def non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """>= 0 (``inf`` allowed: no limit)."""
    if not value >= 0:
        _fail(instance, attribute, value, ">= 0")


def probability(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (_is_number(value) and 0.0 <= value <= 1.0):  # type: ignore[operator]
        _fail(instance, attribute, value, "in [0, 1]")


def open_unit(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (_is_number(value) and 0.0 < value <= 1.0):  # type: ignore[operator]
        _fail(instance, attribute, value, "in (0, 1]")


def http_urls(
    instance: object, attribute: attrs.Attribute[Any], value: str | tuple[str, ...]
) -> None:
    """One ``http(s)://`` URL, or a non-empty tuple of them."""
    urls = (value,) if isinstance(value, str) else value
    if not urls:
        _fail(instance, attribute, value, "at least one http(s):// URL")
    for url in urls:
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            _fail(instance, attribute, url, "an http(s):// URL")
