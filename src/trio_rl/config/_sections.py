"""Sections generated from a library config: ``[rollout]`` from
:class:`~trio_rl.rollout.RolloutConfig`, ``[sink]`` from :class:`~trio_rl.sink.SinkConfig`,
``[checkpoint]`` from :class:`~trio_rl.sink.CheckpointConfig`.

`config_section` makes a section class with one key per knob of the library config, taking the
field's type, default, check and meaning (``metadata["help"]``) from it, so a knob is declared
once, in its layer's own config, and reaches the files, ``--set <section>.<key>=...``, the
environment and the reference without a second spelling. A nested config (``scoring``: a
:class:`~trio_rl.sink.ScoringConfig`) contributes its fields as ``scoring_<name>``; an enum
(``prune``) is written as its value. :meth:`ConfigSection.to_config` builds the library config.

A command may change a default (``max_off_policy_steps=1`` for the learning run) or a key's
meaning line (where the command resolves an unset value its own way). Fields the command sets
from other keys are left out (``omit``: each says where its value comes from), and keys that
are the command's own, no library knob (``[rollout] task``), are a hand-written ``base`` the
generated class extends. A key whose value is another key's unless set (``derived``: the
learning run's ``[sink] scoring_temperature``, by default ``rollout.temperature``) is optional
and unset by default; the command passes the other key's value to `ConfigSection.to_config`.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, cast

import attrs

from ..engines import EngineKind

C = TypeVar("C")
S = TypeVar("S", bound="ConfigSection[Any]")

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


def _knobs(cls: type[Any], omit: Mapping[str, str], path: tuple[str, ...] = ()) -> list[_Knob]:
    hints = typing.get_type_hints(cls)
    out: list[_Knob] = []
    for f in attrs.fields(cls):
        if not path and f.name in omit:
            continue
        tp = hints[f.name]
        if isinstance(tp, type) and attrs.has(tp):
            out.extend(_knobs(tp, omit, (*path, f.name)))
            continue
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            tp = Literal[tuple(m.value for m in tp)]
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} has no metadata['help'] (its key's meaning)")
        out.append(_Knob("_".join((*path, f.name)), (*path, f.name), f, tp))
    return out


class ConfigSection(Generic[C]):
    """The base of the sections `config_section` generates from the library config ``C``."""

    #: The library config the section is generated from, and its fields that are no key.
    config: ClassVar[type[Any]]
    omitted: ClassVar[Mapping[str, str]]
    #: The keys that are unset by default, and the key whose value they then take.
    derived: ClassVar[Mapping[str, str]]

    if TYPE_CHECKING:  # the generated fields, one per knob, are known at run time only

        def __getattr__(self, name: str) -> Any: ...

    def to_config(self, **given: Any) -> C:
        """The library config of these values; ``given``: the fields that are no key of the
        section (`omitted`), values the command resolved its own way, and the value of every
        `derived` key (by its key, e.g. ``scoring_temperature``), taken when it is unset."""
        missing = set(self.derived) - set(given)
        if missing:
            raise TypeError(f"to_config needs the values of {sorted(missing)} (derived keys)")
        defaults = {k: given.pop(k) for k in self.derived}
        kwargs = _build(self.config, self, self.omitted, (), defaults)
        return cast("C", self.config(**{**kwargs, **given}))


def _build(
    cls: type[Any],
    section: object,
    omit: Mapping[str, str],
    path: tuple[str, ...],
    defaults: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments of ``cls`` (at ``path`` in the library config) from ``section``;
    ``defaults``: the values of the derived keys left unset."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in attrs.fields(cls):
        if not path and f.name in omit:
            continue
        tp = hints[f.name]
        if isinstance(tp, type) and attrs.has(tp):
            kwargs[f.name] = tp(**_build(tp, section, omit, (*path, f.name), defaults))
            continue
        key = "_".join((*path, f.name))
        value = getattr(section, key)
        if value is None and key in defaults:
            value = defaults[key]
        kwargs[f.name] = tp(value) if isinstance(tp, type) and issubclass(tp, enum.Enum) else value
    return kwargs


@typing.overload
def config_section(
    config: type[C],
    name: str,
    doc: str,
    *,
    base: type[S],
    omit: Mapping[str, str] | None = None,
    meaning: Mapping[str, str] | None = None,
    derived: Mapping[str, str] | None = None,
    checks: Mapping[str, Any] | None = None,
    **defaults: Any,
) -> type[S]: ...


@typing.overload
def config_section(
    config: type[C],
    name: str,
    doc: str,
    *,
    omit: Mapping[str, str] | None = None,
    meaning: Mapping[str, str] | None = None,
    derived: Mapping[str, str] | None = None,
    checks: Mapping[str, Any] | None = None,
    **defaults: Any,
) -> type[ConfigSection[C]]: ...


def config_section(
    config: type[C],
    name: str,
    doc: str,
    *,
    base: type[ConfigSection[Any]] = ConfigSection,
    omit: Mapping[str, str] | None = None,
    meaning: Mapping[str, str] | None = None,
    derived: Mapping[str, str] | None = None,
    checks: Mapping[str, Any] | None = None,
    **defaults: Any,
) -> type[ConfigSection[Any]]:
    """A section class named ``name`` with one key per knob of ``config``: the library's
    defaults except those in ``defaults`` (a command's own choice), its meanings except those
    in ``meaning`` (a default may also be one of a key of ``base``). ``omit``: the fields
    that are no key, each with where its value comes
    from. ``derived``: the keys that are optional and unset by default, each with the key
    whose value they then take (`ConfigSection.to_config` is given it). ``base``: an attrs
    subclass of `ConfigSection` holding the command's own keys. ``checks``: a command's
    stricter check of a key of ``base``, run after the key's own."""
    omit = {} if omit is None else dict(omit)
    meaning = {} if meaning is None else dict(meaning)
    derived = {} if derived is None else dict(derived)
    knobs = _knobs(config, omit)
    keys = {k.key for k in knobs}
    inherited = {f.name: f for f in attrs.fields(base)} if attrs.has(base) else {}
    for what, given, known in (
        ("default", defaults, keys | set(inherited)),
        ("meaning", meaning, keys),
        ("derived key", derived, keys),
    ):
        unknown = set(given) - known
        if unknown:
            raise TypeError(f"{name}: a {what} for no key of {config.__name__}: {sorted(unknown)}")
    if set(inherited) & keys:
        raise TypeError(
            f"{name}: {sorted(set(inherited) & keys)} are keys of {config.__name__} already"
        )
    these: dict[str, Any] = {}
    checks = {} if checks is None else dict(checks)
    if set(checks) - set(inherited):
        raise TypeError(f"{name}: a check for no key of {base.__name__}: {sorted(checks)}")
    for key in (set(defaults) | set(checks)) & set(inherited):
        # a base key (declared once, e.g. the step's shape) with this command's default/check
        f = inherited[key]
        validator = f.validator
        if key in checks:
            validator = (
                checks[key] if validator is None else attrs.validators.and_(validator, checks[key])
            )
        these[key] = attrs.field(
            default=defaults.get(key, f.default),
            validator=validator,
            metadata=dict(f.metadata),
            type=f.type,
        )
    for knob in knobs:
        default: Any = knob.field.default
        if knob.key in defaults:
            default = defaults[knob.key]
        elif isinstance(default, enum.Enum):
            default = default.value
        metadata = dict(knob.field.metadata)
        if knob.key in meaning:
            metadata["help"] = meaning[knob.key]
        tp, validator = knob.tp, knob.field.validator
        if knob.key in derived:
            tp, default = tp | None, None
            metadata["help"] = f"{metadata['help']} (unset: {derived[knob.key]})"
            # its value is pinned to the key it derives from (the command refuses another),
            # so set or unset on a resume it is the same: a run stored with it set resumes
            metadata["may_change"] = True
            if validator is not None:
                validator = attrs.validators.optional(validator)
        these[knob.key] = attrs.field(
            default=default, validator=validator, metadata=metadata, type=tp
        )
    cls = cast(
        "type[ConfigSection[Any]]",
        # a base key given another default is set on the instance: no slot of its own
        attrs.make_class(
            name,
            these,
            bases=(base,),
            frozen=True,
            slots=not (set(defaults) | set(checks)) & set(inherited),
        ),
    )
    cls.__doc__ = doc
    cls.__module__ = __name__
    cls.config = config
    cls.omitted = omit
    cls.derived = derived
    return cls


class EngineSection:
    """The base of a command's engine section (`engine_section`): its own keys (which engine,
    a plug-in's ``options``) and the knobs of its built-in engines."""

    #: The engines whose knobs are keys of the section (generated from their config classes).
    kinds: ClassVar[tuple[EngineKind, ...]]

    if TYPE_CHECKING:  # the generated fields, one per knob, are known at run time only

        def __getattr__(self, name: str) -> Any: ...

    def engine_config(self, kind: EngineKind, where: str) -> Any:
        """``kind``'s config: of this section's keys for a built-in engine, else of its
        ``options`` table (``where`` names the section in errors)."""
        if any(k.name == kind.name for k in self.kinds):
            return kind.config(**{f.name: getattr(self, f.name) for f in attrs.fields(kind.config)})
        return kind.configure(getattr(self, "options", {}), f"{where}.options")


def engine_section(
    name: str, doc: str, *, base: type[EngineSection], kinds: tuple[EngineKind, ...]
) -> type[Any]:
    """A section class named ``name``: the keys of ``base`` (an attrs subclass of
    `EngineSection`: which engine, and the command's own keys), then one key per knob of each
    engine of ``kinds``, taken from its config class (type, default, check, meaning)."""
    these: dict[str, Any] = {}
    own = {f.name for f in attrs.fields(cast("type[Any]", base))}
    for kind in kinds:
        hints = typing.get_type_hints(kind.config)
        for f in attrs.fields(kind.config):
            if f.name in these or f.name in own:
                raise TypeError(f"{name}: {f.name!r} is a knob of two engines, or a key of {name}")
            if "help" not in f.metadata:
                raise TypeError(f"{kind.config.__name__}.{f.name} has no metadata['help']")
            these[f.name] = attrs.field(
                default=f.default,
                validator=f.validator,
                metadata=dict(f.metadata),
                type=hints[f.name],
            )
    cls = cast("type[EngineSection]", attrs.make_class(name, these, bases=(base,), frozen=True))
    cls.__doc__ = doc
    cls.__module__ = __name__
    cls.kinds = kinds
    return cls


#: The default of a `section` field whose class is its annotation, until `command_sections`
#: replaces it with that class.
_ANNOTATED = object()


def section(generated: type[Any] | None = None) -> Any:
    """A command's section: a field of its configuration class, whose default is a section of
    its annotated class. A class `config_section` or `engine_section` generated is known to
    mypy by its base only: the field is annotated with that base and names the class here.
    The class must be decorated with ``attrs.frozen(field_transformer=command_sections)``."""
    if generated is not None:
        return attrs.field(factory=generated)
    return attrs.field(default=_ANNOTATED)


def command_sections(
    cls: type[Any], fields: list[attrs.Attribute[Any]]
) -> list[attrs.Attribute[Any]]:
    """The field transformer of a command's configuration class: a `section` whose class is
    its annotation gets that class as its default's factory (one spelling of each class)."""
    hints = typing.get_type_hints(cls)
    return [
        f.evolve(default=attrs.Factory(hints[f.name])) if f.default is _ANNOTATED else f
        for f in fields
    ]
