"""Sections generated from a library config: ``[sink]`` is :class:`~trio_rl.train.SinkConfig`.

The ``[sink]`` section has one key per knob of ``SinkConfig`` and takes the field's type,
default, check and meaning (``metadata["help"]``) from it, so a sink knob is declared once, in
the sink's own config, and reaches the files, ``--set sink.<key>=...``, the environment and the
reference without a second spelling. A nested config (``scoring``: a
:class:`~trio_rl.train.ScoringConfig`) contributes its fields as ``scoring_<name>``; an enum
(``prune``) is written as its value. :meth:`SinkSection.to_config` builds the ``SinkConfig``.

The batch size is not a key: the commands size a step from ``[rollout]`` (``batch_groups`` x
``group_size`` samples; `SIZED_ELSEWHERE` says so for each sizing field).
"""

from __future__ import annotations

import enum
import typing
from typing import TYPE_CHECKING, Any, Literal

import attrs

from ..train import SinkConfig

#: The ``SinkConfig`` fields that are no ``[sink]`` key, and where their value comes from.
SIZED_ELSEWHERE: dict[str, str] = {
    "batch_size": "rollout.batch_groups x rollout.group_size",
    "token_batch_size": "unset: the commands cut batches in samples (rollout.batch_groups x "
    "rollout.group_size)",
}


@attrs.frozen
class _Knob:
    """One key of a generated section: where it sits in the library config, and its field."""

    key: str
    path: tuple[str, ...]
    field: attrs.Attribute[Any]
    tp: Any


def _knobs(cls: type[Any], path: tuple[str, ...] = ()) -> list[_Knob]:
    hints = typing.get_type_hints(cls)
    out: list[_Knob] = []
    for f in attrs.fields(cls):
        if not path and f.name in SIZED_ELSEWHERE:
            continue
        tp = hints[f.name]
        if isinstance(tp, type) and attrs.has(tp):
            out.extend(_knobs(tp, (*path, f.name)))
            continue
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            tp = Literal[tuple(m.value for m in tp)]
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} has no metadata['help'] (its key's meaning)")
        out.append(_Knob("_".join((*path, f.name)), (*path, f.name), f, tp))
    return out


class SinkSection:
    """The base of the generated ``[sink]`` sections (`sink_section`)."""

    if TYPE_CHECKING:  # the generated fields, one per knob, are known at run time only

        def __getattr__(self, name: str) -> Any: ...

    def to_config(self, batch_size: int) -> SinkConfig:
        """The :class:`~trio_rl.train.SinkConfig` of these values, cutting ``batch_size``
        samples per batch."""
        return SinkConfig(batch_size=batch_size, **_build(SinkConfig, self, ()))


def _build(cls: type[Any], section: object, path: tuple[str, ...]) -> dict[str, Any]:
    """The keyword arguments of ``cls`` (at ``path`` in ``SinkConfig``) from ``section``."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in attrs.fields(cls):
        if not path and f.name in SIZED_ELSEWHERE:
            continue
        tp = hints[f.name]
        if isinstance(tp, type) and attrs.has(tp):
            kwargs[f.name] = tp(**_build(tp, section, (*path, f.name)))
            continue
        value = getattr(section, "_".join((*path, f.name)))
        kwargs[f.name] = tp(value) if isinstance(tp, type) and issubclass(tp, enum.Enum) else value
    return kwargs


def sink_section(name: str, doc: str, **defaults: Any) -> type[SinkSection]:
    """A ``[sink]`` section class named ``name``: every knob of ``SinkConfig``, with the
    library's defaults except those in ``defaults`` (a command's own choice)."""
    unknown = set(defaults) - {k.key for k in _knobs(SinkConfig)}
    if unknown:
        raise TypeError(f"sink_section: no [sink] key {sorted(unknown)}")
    these: dict[str, Any] = {}
    for knob in _knobs(SinkConfig):
        default: Any = knob.field.default
        if knob.key in defaults:
            default = defaults[knob.key]
        elif isinstance(default, enum.Enum):
            default = default.value
        these[knob.key] = attrs.field(
            default=default,
            validator=knob.field.validator,
            metadata=dict(knob.field.metadata),
            type=knob.tp,
        )
    cls = attrs.make_class(name, these, bases=(SinkSection,), frozen=True)
    cls.__doc__ = doc
    cls.__module__ = __name__
    return cls
