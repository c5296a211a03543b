"""Engines by name: ``kind`` -> its knobs, how it opens, whether it loads weights.

A command names its engine in the configuration (``trio-rl simulate``'s ``[engine] kind``,
``trio-rl run``'s ``[inference] engine``) and looks it up here instead of branching on the
name. The four built-in engines register exactly as a fifth one would::

    @attrs.frozen
    class EchoConfig:
        reply: int = attrs.field(default=7, metadata={"help": "the token every completion is"})

    @asynccontextmanager
    async def open_echo(setup: EngineSetup, config: EchoConfig) -> AsyncIterator[Engine]:
        yield EchoEngine(config.reply, seed=setup.seed)

    ECHO = register_engine(EngineKind("echo", EchoConfig, open_echo, commands=("simulate",)))

Every engine opens one way: ``open(setup, config)`` is an async context manager that yields it
open and closes it on leaving. ``config`` is an instance of the kind's ``config`` class (an
attrs class whose fields carry ``metadata["help"]``): a built-in engine's fields are keys of
the command's engine section (generated from the class); a plug-in's are given as that
section's ``options`` table. A name ``"package.module:NAME"`` imports the module, whose
``NAME`` is the registered kind (a plug-in on ``sys.path``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from ..errors import InvalidArgumentError
from ..samples import PolicyVersion
from ._protocol import Engine

__all__ = [
    "Command",
    "EngineKind",
    "EngineSetup",
    "FollowsVersion",
    "WeightLoader",
    "engine_kind",
    "engine_kinds",
    "register_engine",
    "unregister_engine",
]

#: The commands an engine can serve: ``simulate`` (no model: a simulated engine or a server)
#: and ``run`` (the learning run: it serves the run's policy and loads its published weights).
Command = Literal["run", "simulate"]


@runtime_checkable
class WeightLoader(Protocol):
    """An engine that can load published weights (e.g. :class:`~trio_rl.engines.TorchEngine`,
    :class:`~trio_rl.engines.EngineFleet`)."""

    async def load_weights(self, path: str | os.PathLike[str], version: PolicyVersion) -> None: ...


@runtime_checkable
class FollowsVersion(Protocol):
    """An engine told each new policy version (one that stamps it without loading weights,
    such as :class:`~trio_rl.engines.SimulatedEngine`)."""

    def set_policy_version(self, version: PolicyVersion) -> None: ...


@attrs.frozen
class EngineSetup:
    """What a run gives an engine to open with; an engine reads what it needs."""

    #: The run directory.
    directory: Path
    #: Where launched servers write their logs (None: nowhere).
    log_dir: Path | None = None
    seed: int = 0
    #: The policy version the engine starts at (a resumed run's trained step).
    policy_version: PolicyVersion = 0
    #: The learning run's model to serve (a copy of the policy's), with its end-of-sequence
    #: token and longest sequence; None in ``trio-rl simulate``.
    model: Any = None
    eos_token_id: int | None = None
    max_len: int | None = None
    #: ``[model] path``: the model directory servers load (None: the built-in model).
    model_path: str | None = None
    #: Reproducible by seed: an engine decodes a group's rows as one batch.
    deterministic: bool = False
    #: The newest published weights (path, version) a resumed run's engine loads first.
    weights: tuple[Path, PolicyVersion] | None = None


OpenEngine = Callable[[EngineSetup, Any], AbstractAsyncContextManager[Engine]]


@attrs.frozen
class EngineKind:
    """One engine, by name.

    ``config``: the attrs class of its knobs (each field's ``metadata["help"]`` is its key's
    meaning). ``open(setup, config)``: an async context manager yielding the engine.
    ``loads_weights``: the learning run's weight watcher loads every published version into it
    (it is a `WeightLoader`). ``commands``: the commands it serves. ``prefix_cache``: servers
    that keep a group's prompt in one prefix cache, so the run routes requests by group.
    ``summary(engine)``: a line for the end of a run (None: none)."""

    name: str
    config: type[Any]
    open: OpenEngine
    loads_weights: bool = False
    commands: tuple[Command, ...] = ("run", "simulate")
    prefix_cache: bool = False
    summary: Callable[[Any], str | None] | None = None

    def configure(self, options: Mapping[str, Any], where: str) -> Any:
        """The kind's config of ``options`` (a plug-in's ``options`` table), checked: an
        unknown or bad key is an `InvalidArgumentError` naming ``where``."""
        known = {f.name for f in attrs.fields(self.config)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgumentError(
                f"{where}: {unknown} are no knobs of engine {self.name!r}; known: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        try:
            return self.config(**options)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{where}: engine {self.name!r}: {exc}") from None


_KINDS: dict[str, EngineKind] = {}


def register_engine(kind: EngineKind) -> EngineKind:
    """Make ``kind`` available by its name (a name registered again is replaced); returns it."""
    if not attrs.has(kind.config):
        raise InvalidArgumentError(f"engine {kind.name!r}: its config must be an attrs class")
    _KINDS[kind.name] = kind
    return kind


def unregister_engine(name: str) -> None:
    """Forget the engine ``name`` (a no-op for an unknown one)."""
    _KINDS.pop(name, None)


def engine_kinds(command: Command | None = None) -> tuple[str, ...]:
    """The names of every registered engine (that serves ``command``), sorted."""
    return tuple(sorted(k.name for k in _KINDS.values() if command in (None, *k.commands)))


def engine_kind(name: str, command: Command | None = None) -> EngineKind:
    """The engine registered as ``name``, or for ``"package.module:NAME"`` the kind that
    module registers as its ``NAME`` (imported first); one that does not serve ``command`` or
    an unknown name is an `InvalidArgumentError` listing the known ones."""
    module, sep, attribute = name.partition(":")
    if sep:
        try:
            found = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise InvalidArgumentError(f"engine {name!r}: cannot import it: {exc}") from None
        if not isinstance(found, EngineKind):
            raise InvalidArgumentError(f"engine {name!r} is no EngineKind: {found!r}")
        kind: EngineKind | None = register_engine(found)
    else:
        kind = _KINDS.get(name)
    if kind is None or (command is not None and command not in kind.commands):
        known = ", ".join(engine_kinds(command))
        what = "registered" if kind is None else f"an engine of `trio-rl {command}`"
        raise InvalidArgumentError(f"no engine {name!r} is {what}; known: {known}")
    return kind
