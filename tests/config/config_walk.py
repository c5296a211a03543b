"""Walking a library config's knobs, for the tests that set each through a configuration file
and ``--set`` (``test_config_sink.py``, ``test_config_knobs.py``)."""

from __future__ import annotations

import enum
import typing
from typing import Any

import attrs


def leaf_paths(cls: type[Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, type)`` of every leaf field of ``cls``, nested attrs configs walked."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[tuple[str, ...], Any]] = []
    for f in attrs.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and attrs.has(tp):
            out.extend(leaf_paths(tp, (*prefix, f.name)))
        else:
            out.append(((*prefix, f.name), tp))
    return out


def value_at(obj: Any, path: tuple[str, ...]) -> Any:
    """The value at ``path`` in ``obj``, an enum as its value (as a file writes it)."""
    for name in path:
        obj = getattr(obj, name)
    return obj.value if isinstance(obj, enum.Enum) else obj


def other_value(value: Any, tp: Any) -> Any:
    """A valid value of type ``tp`` other than ``value``."""
    if value is None:  # an unset optional knob: any value of its type
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return {int: 5, float: 2.5}[args[0]]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(m.value for m in tp if m.value != value)
    if typing.get_origin(tp) is typing.Literal:
        return next(v for v in typing.get_args(tp) if v != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value * 2 + 0.5
    if isinstance(value, typing.Mapping):
        return {"math": 0.5}
    raise AssertionError(f"no other value for {value!r} of {tp!r}")
