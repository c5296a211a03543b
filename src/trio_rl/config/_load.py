"""Layered TOML configuration onto attrs classes, hand-written.

A schema is an attrs class whose fields are *sections*, attrs classes of scalar options (int,
float, bool, str, a ``Literal`` of strings, or one of those or None). Each option carries its
meaning in ``metadata["help"]``; the docs' reference and `to_toml` are generated from it.
Values come in *layers* (TOML files, then flags, then ``--set``), later ones winning; every value
remembers where it came from, so an error names the file and line (tomllib gives no line
numbers: the key's line is found in the text) or the flag.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs

from .._validation import at_least, between, optional_positive_finite, positive_finite
from ._errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "Override",
    "at_least",
    "between",
    "choices",
    "configure",
    "env_overrides",
    "flatten",
    "load",
    "option",
    "optional_positive_finite",
    "positive_finite",
    "reference_markdown",
    "to_toml",
]

T = TypeVar("T")

_HELP, _MAY_CHANGE = "help", "may_change"


def option(
    default: Any,
    help: str,
    *,
    validator: Callable[[Any, attrs.Attribute[Any], Any], None] | None = None,
    may_change: bool = False,
) -> Any:
    """A configuration option: its default, its meaning, its check. ``may_change``: a resumed
    run may give it another value than the stored configuration (e.g. ``run.steps``)."""
    return attrs.field(
        default=default, validator=validator, metadata={_HELP: help, _MAY_CHANGE: may_change}
    )


@attrs.frozen
class Override:
    """One value from the command line: ``key`` is ``section.name``; ``value`` is typed (a flag
    argparse already converted) or, with ``raw``, TOML text (``--set``; bare words are strings,
    ``none`` unsets an optional key). ``where`` names it in errors (``--set``, ``--steps``)."""

    key: str
    value: Any
    where: str = "--set"
    raw: bool = False

    @classmethod
    def parse(cls, text: str, where: str = "--set") -> Override:
        """``section.key=value`` as given to ``--set``."""
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ConfigError(where, "", f"expected section.key=value, got {text!r}")
        return cls(key.strip(), value.strip(), where, raw=True)


def _sections(schema: type[Any]) -> dict[str, type[Any]]:
    """Section name -> the class of its options: the class its default is made from (a section
    generated from a library config, e.g. ``[sink]``, is annotated with its base class)."""
    hints = typing.get_type_hints(schema)
    out: dict[str, type[Any]] = {}
    for f in attrs.fields(schema):
        factory = f.default.factory if isinstance(f.default, attrs.Factory) else None  # type: ignore[arg-type]
        out[f.name] = factory if isinstance(factory, type) else hints[f.name]
    return out


def _options(section: type[Any]) -> dict[str, tuple[attrs.Attribute[Any], Any]]:
    # a generated section carries its types on its attributes, a written one in annotations
    hints = typing.get_type_hints(section)
    return {f.name: (f, hints.get(f.name, f.type)) for f in attrs.fields(section)}


def _optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, ``(tp, False)`` otherwise."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _is_table(tp: Any) -> bool:
    """``Mapping[str, float]`` (names to numbers), ``Mapping[str, str]`` (names to text, e.g.
    headers) or ``Mapping[str, Any]`` (a plug-in's knobs, checked by the plug-in): the table
    types an option may have."""
    origin = typing.get_origin(tp)
    return origin in (Mapping, dict) and typing.get_args(tp) in (
        (str, float),
        (str, str),
        (str, Any),
    )


def _is_list(tp: Any) -> bool:
    """``tuple[str, ...]``: the one list type an option may have (a list of strings)."""
    return typing.get_origin(tp) is tuple and typing.get_args(tp) == (str, Ellipsis)


def _type_name(tp: Any) -> str:
    base, optional = _optional(tp)
    if _is_list(base):
        name = "list of str"
    elif _is_table(base):
        name = f"table of str to {getattr(typing.get_args(base)[1], '__name__', 'value')}"
    elif typing.get_origin(base) is Literal:
        name = " | ".join(json.dumps(a) for a in typing.get_args(base))
    else:
        name = getattr(base, "__name__", str(base))
    return f"{name} (optional)" if optional else name


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``, or ValueError saying what was expected."""
    base, optional = _optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError(f"a value of type {_type_name(tp)} is required")
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if value not in choices:
            shown = ", ".join(map(json.dumps, choices))
            raise ValueError(f"expected one of {shown}, got {value!r}")
        return value
    if _is_list(base):
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif _is_table(base) and typing.get_args(base)[1] is Any:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
    elif _is_table(base) and typing.get_args(base)[1] is str:
        if isinstance(value, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            return dict(value)
    elif _is_table(base):
        if isinstance(value, Mapping) and all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in value.items()
        ):
            return {k: float(v) for k, v in value.items()}
    elif base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema with an unsupported type is a programming error
        raise TypeError(f"unsupported option type {base!r}")
    raise ValueError(f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _parse_raw(text: str, tp: Any) -> Any:
    """A ``--set`` value: TOML (``3``, ``1e-3``, ``true``, ``"x"``), a bare word as a string,
    ``none`` as unset for an optional key."""
    _, optional = _optional(tp)
    if optional and text.lower() in ("none", "null", ""):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_ASSIGN = re.compile(r"^\s*([A-Za-z0-9_\-.\"' ]+?)\s*=")


def _unquote(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))


def key_line(text: str, section: str, key: str | None) -> int | None:
    """The 1-based line of ``key`` in ``[section]`` (or of the header, for ``key`` None), or of
    a dotted ``section.key = ...`` at the top level."""
    current: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            current = _unquote(header.group(1))
            if key is None and current == section:
                return number
            continue
        assign = _ASSIGN.match(line)
        if assign is None:
            continue
        name = _unquote(assign.group(1))
        if current == section and name == key:
            return number
        if current is None and (name == f"{section}.{key}" or (key is None and name == section)):
            return number
        if current is None and key is None and name.startswith(f"{section}."):
            return number
    return None


@attrs.frozen
class _Value:
    value: Any
    where: str


def _read_file(
    path: Path, sections: dict[str, type[Any]], into: dict[str, dict[str, _Value]]
) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "no such configuration file") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "", "is a directory, not a TOML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot be read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        line = found.group(1) if found else str(max(1, len(text.splitlines())))
        where = f"{path}:{line}"
        reason = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)", "", str(exc))
        raise ConfigError(where, "", f"not valid TOML: {reason}") from None

    def at(section: str, key: str | None) -> str:
        line = key_line(text, section, key)
        return f"{path}:{line}" if line is not None else str(path)

    for name, table in data.items():
        if name not in sections:
            raise ConfigError(at(name, None), name, _unknown("section", name, sections))
        if not isinstance(table, dict):
            raise ConfigError(at(name, None), name, "expected a [section] table of options")
        options = _options(sections[name])
        for key, value in table.items():
            where = at(name, key)
            if key not in options:
                raise ConfigError(where, f"{name}.{key}", _unknown("key", key, options))
            if isinstance(value, dict) and not _is_table(_optional(options[key][1])[0]):
                raise ConfigError(where, f"{name}.{key}", "expected a value, got a table")
            into.setdefault(name, {})[key] = _Value(value, where)


def _unknown(what: str, name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what}{hint}; known: {', '.join(known)}"


#: The prefix of the environment variables that set a key: ``TRIO_RL_<SECTION>__<KEY>``.
ENV_PREFIX = "TRIO_RL_"


def env_overrides(
    schema: type[Any], environ: Mapping[str, str], others: Sequence[type[Any]] = ()
) -> list[Override]:
    """The ``TRIO_RL_<SECTION>__<KEY>=VALUE`` variables of ``environ`` as overrides of
    ``schema`` (``TRIO_RL_ROLLOUT__BATCH_GROUPS=16`` is ``--set rollout.batch_groups=16``), in
    name order; values are read as ``--set`` reads them. A variable naming a key of one of
    ``others`` only (the other command's configuration) is left to it; one naming no key of
    any is a `ConfigError` naming the variable. Variables without ``__`` are not keys."""
    sections = _sections(schema)
    out: list[Override] = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if section in sections and key in _options(sections[section]):
            out.append(Override(f"{section}.{key}", environ[name], where=name, raw=True))
            continue
        if any(
            section in _sections(other) and key in _options(_sections(other)[section])
            for other in others
        ):
            continue
        if section not in sections:
            raise ConfigError(name, f"{section}.{key}", _unknown("section", section, sections))
        raise ConfigError(
            name, f"{section}.{key}", _unknown("key", key, _options(sections[section]))
        )
    return out


def load(
    schema: type[T], files: Sequence[Path] = (), overrides: Sequence[Override] = ()
) -> tuple[T, dict[str, str]]:
    """The configuration of ``files`` (in order) then ``overrides``, validated; with, for
    every key set anywhere, where its value came from (``file:line`` or the flag).

    Raises `ConfigError` naming the key and where the bad value came from."""
    sections = _sections(schema)
    values: dict[str, dict[str, _Value]] = {}
    for path in files:
        layer: dict[str, dict[str, _Value]] = {}
        _read_file(Path(path), sections, layer)
        # Every layer's values are checked, not only the ones that win: a bad value in a file
        # is an error even where a later file or a flag overrides it.
        for name, section in layer.items():
            for key, value in section.items():
                _checked(sections[name], name, key, value)
            values.setdefault(name, {}).update(section)
    for o in overrides:
        name, dot, key = o.key.partition(".")
        if not dot or name not in sections:
            raise ConfigError(o.where, o.key, _unknown("section", name, sections))
        options = _options(sections[name])
        if key not in options:
            raise ConfigError(o.where, o.key, _unknown("key", key, options))
        value = _parse_raw(o.value, options[key][1]) if o.raw else o.value
        values.setdefault(name, {})[key] = _Value(value, o.where)
    built: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, cls in sections.items():
        kwargs: dict[str, Any] = {}
        for key, got in values.get(name, {}).items():
            kwargs[key] = _checked(cls, name, key, got)
            origin[f"{name}.{key}"] = got.where
        try:
            built[name] = cls(**kwargs)
        except ValueError as exc:  # a check across options of the section
            where = ", ".join(sorted({origin[f"{name}.{k}"] for k in kwargs})) or "defaults"
            raise ConfigError(where, name, str(exc)) from None
    return schema(**built), origin


def configure(schema: type[T], values: Mapping[str, Any], where: str = "code") -> T:
    """The configuration of ``schema`` with ``values`` (``{"section.key": value}``, typed
    values as a flag gives them) over its defaults, checked as a file's are: a bad one is a
    `ConfigError` naming the key and ``where``. ``configure(LearnRunConfig, flatten(c))`` is
    ``c`` again (lists read back as tuples)."""
    return load(schema, [], [Override(key, value, where) for key, value in values.items()])[0]


def _checked(cls: type[Any], name: str, key: str, got: _Value) -> Any:
    """``got``'s value coerced to the option's type and validated, or the `ConfigError` that
    names where it came from."""
    attribute, tp = _options(cls)[key]
    try:
        value = _coerce(got.value, tp)
        if attribute.validator is not None:
            attribute.validator(None, attribute, value)
    except ValueError as exc:
        raise ConfigError(got.where, f"{name}.{key}", str(exc)) from None
    return value


def flatten(config: Any) -> dict[str, Any]:
    """``{"section.key": value}`` of every option."""
    out: dict[str, Any] = {}
    for section in attrs.fields(type(config)):
        values = getattr(config, section.name)
        for f in attrs.fields(type(values)):
            out[f"{section.name}.{f.name}"] = getattr(values, f.name)
    return out


def choices(schema: type[Any], key: str) -> tuple[Any, ...] | None:
    """The values ``key`` (``section.name``) allows when its type is a ``Literal`` (None
    otherwise): a flag offers the choices the key declares, not a second list of them."""
    name, _, option_name = key.partition(".")
    _, tp = _options(_sections(schema)[name])[option_name]
    base, _ = _optional(tp)
    return typing.get_args(base) if typing.get_origin(base) is Literal else None


def may_change(schema: type[Any], key: str) -> bool:
    """Whether a resumed run may give ``key`` a new value without ``--allow-change``."""
    name, _, option_name = key.partition(".")
    section = _sections(schema).get(name)
    if section is None:
        return False
    found = _options(section).get(option_name)
    return bool(found and found[0].metadata.get(_MAY_CHANGE))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(json.dumps(str(v)) for v in value) + "]"
    if isinstance(value, Mapping):
        return (
            "{"
            + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items())
            + "}"
        )
    return json.dumps(str(value))


def to_toml(config: Any, comments: bool = True) -> str:
    """``config`` as TOML that `load` reads back to an equal configuration; an unset optional
    key is written as a comment. ``comments``: each key's meaning above it."""
    lines: list[str] = []
    for section in attrs.fields(type(config)):
        values = getattr(config, section.name)
        if lines:
            lines.append("")
        lines.append(f"[{section.name}]")
        for f in attrs.fields(type(values)):
            value = getattr(values, f.name)
            if comments:
                lines.append(f"# {f.metadata.get(_HELP, '')}")
            if value is None:
                lines.append(f"# {f.name} =  (unset)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def reference_markdown(schema: type[Any], heading: str = "###") -> str:
    """A Markdown reference of every section and option of ``schema``: type, default, meaning
    (generated into ``docs/operations.md``)."""
    out: list[str] = []
    defaults = schema()
    for section in attrs.fields(schema):
        cls = _sections(schema)[section.name]
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        out.append(f"{heading} `[{section.name}]`\n")
        out.append(" ".join(doc.split()) + "\n")
        out.append("| key | type | default | meaning |")
        out.append("|---|---|---|---|")
        for name, (attribute, tp) in _options(cls).items():
            value = getattr(getattr(defaults, section.name), name)
            shown = "unset" if value is None else f"`{_toml_value(value)}`"
            meaning = " ".join(str(attribute.metadata.get(_HELP, "")).split()).replace("|", "\\|")
            if attribute.metadata.get(_MAY_CHANGE):
                meaning += " (may change on resume)"
            kind = _type_name(tp).replace("|", "or")
            out.append(f"| `{name}` | {kind} | {shown} | {meaning} |")
        out.append("")
    return "\n".join(out)
