"""One error root: every exception class trio-rl defines is a ``trio_rl.TrioRLError``.

The package is walked module by module (torch-dependent modules included), so a class added
anywhere later without the root fails here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import trio

import trio_rl
from trio_rl import errors
from trio_rl.rollout import _errors as rollout_errors
from trio_rl.testing import _errors as testing_errors

# The two classes that carry a value of a higher floor (a Group, an Invariant) are defined on
# that floor, so that trio_rl.errors imports nothing of ours, not even for annotations.
ON_THEIR_FLOOR: dict[str, ModuleType] = {
    "GroupFailedError": rollout_errors,
    "InvariantViolationError": testing_errors,
}


def _error_class(name: str) -> type[BaseException]:
    cls: type[BaseException] = getattr(ON_THEIR_FLOOR.get(name, errors), name)
    return cls


# `python -m` entry points run the CLI when imported; they must stay free of classes (checked
# below from their source).
_ENTRY_POINTS = {"trio_rl.__main__", "trio_rl.learn.__main__"}


def _modules() -> list[ModuleType]:
    found = [trio_rl]
    for info in pkgutil.walk_packages(trio_rl.__path__, "trio_rl."):
        if info.name in _ENTRY_POINTS:
            continue
        found.append(importlib.import_module(info.name))
    return found


def _classes_in(owner: object, module: str) -> list[type]:
    out: list[type] = []
    for value in vars(owner).values():
        if inspect.isclass(value) and value.__module__ == module and value is not owner:
            out.append(value)
            out.extend(_classes_in(value, module))
    return out


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in _modules():
        for cls in _classes_in(module, module.__name__):
            if issubclass(cls, BaseException):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


EXCEPTIONS = _exception_classes()


def test_the_walk_reaches_every_layer_and_the_private_classes() -> None:
    names = {cls.__name__ for cls in EXCEPTIONS.values()}
    # The classes that had roots of their own, private ones and the torch-free trainer layer
    # included: if the walk stopped finding them, the checks below would pass vacuously.
    for expected in (
        "TrioRLError",
        "WireFormatError",
        "WireEncodeError",
        "PackingError",
        "CodecError",
        "TensorConversionError",
        "CheckpointError",
        "EndOfStreamError",
        "InvariantViolationError",
        "ScriptedEngineError",
        "_RejectError",
    ):
        assert expected in names
    walked = {m.__name__ for m in _modules()}
    assert {"trio_rl.learn", "trio_rl.learn._grpo", "trio_rl.engines._torch"} <= walked


def test_entry_points_define_no_classes() -> None:
    for name in _ENTRY_POINTS:
        path = Path(trio_rl.__file__).parent.joinpath(*name.split(".")[1:]).with_suffix(".py")
        assert "class " not in path.read_text(), name


@pytest.mark.parametrize("where", sorted(EXCEPTIONS))
def test_every_exception_class_has_the_one_root(where: str) -> None:
    cls = EXCEPTIONS[where]
    assert issubclass(cls, trio_rl.TrioRLError), f"{where} is not a TrioRLError"


@pytest.mark.parametrize("where", sorted(EXCEPTIONS))
def test_every_exception_class_follows_the_naming_rule(where: str) -> None:
    assert EXCEPTIONS[where].__name__.endswith("Error"), where


def test_the_closed_signal_is_trios() -> None:
    assert not [w for w in EXCEPTIONS if "Closed" in w]
    for gone in ("EngineClosedError", "PublishClosedError"):
        for facade in (trio_rl, trio_rl.engines, trio_rl.publish, errors):
            assert not hasattr(facade, gone)
    assert not issubclass(trio.ClosedResourceError, trio_rl.TrioRLError)


# --- the tree drawn in trio_rl.errors' docstring is the real one ------------------------------

_TREE_LINE = re.compile(
    r"^(?P<indent>(?:[│ ] {3})*)(?P<branch>[├└]── )?(?P<name>\w+)(?: \((?P<b>.+)\))?$"
)


def _drawn_tree() -> list[tuple[str, str | None, set[str]]]:
    """(class, drawn parent, drawn builtin bases) for each line of the docstring's tree."""
    doc = errors.__doc__
    assert doc is not None
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    rows: list[tuple[str, str | None, set[str]]] = []
    stack: list[str] = []
    for line in block.splitlines():
        match = _TREE_LINE.match(line.removeprefix("    "))
        assert match, f"cannot read tree line {line!r}"
        depth = len(match["indent"]) // 4 + (1 if match["branch"] else 0)
        del stack[depth:]
        builtins = set(match["b"].split(", ")) if match["b"] else set()
        rows.append((match["name"], stack[-1] if stack else None, builtins))
        stack.append(match["name"])
    return rows


def test_the_docstring_tree_matches_the_classes() -> None:
    rows = _drawn_tree()
    assert rows[0] == ("TrioRLError", None, set())
    for name, parent, builtins in rows[1:]:
        cls = _error_class(name)
        # the first base is the parent drawn; the others (builtins, or the shared
        # InvalidArgumentError) are drawn in parentheses
        first, *rest = cls.__bases__
        others = {b.__name__ for b in rest} | (
            set() if issubclass(first, errors.TrioRLError) else {first.__name__}
        )
        ours = first.__name__ if issubclass(first, errors.TrioRLError) else None
        assert ours == parent, f"{name}: drawn under {parent}"
        assert others == builtins, f"{name}: drawn with {builtins}, has {others}"
    drawn = {name for name, _, _ in rows}
    public = {c.__name__ for c in EXCEPTIONS.values() if not c.__name__.startswith("_")}
    assert public == drawn, f"not drawn: {public - drawn}; drawn but gone: {drawn - public}"


def test_every_public_class_is_defined_in_the_errors_module_or_on_its_floor() -> None:
    elsewhere = [
        where
        for where, cls in EXCEPTIONS.items()
        if cls.__module__ != "trio_rl.errors" and not cls.__name__.startswith("_")
    ]
    assert sorted(elsewhere) == sorted(
        f"{module.__name__}.{name}" for name, module in ON_THEIR_FLOOR.items()
    )


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.WireFormatError, ValueError),
        (errors.WireEncodeError, ValueError),
        (errors.EngineConfigError, ValueError),
        (errors.RolloutConfigError, ValueError),
        (errors.TrainSinkError, ValueError),
        (errors.CodecError, ValueError),
        (errors.PackingError, ValueError),
        (errors.TensorConversionError, ValueError),
        (errors.PayloadError, OSError),
        (errors.PayloadFileMissingError, FileNotFoundError),
        (errors.TransportTimeoutError, TimeoutError),
        (testing_errors.InvariantViolationError, AssertionError),
    ],
)
def test_old_builtin_bases_still_catch(cls: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(cls, builtin)


def test_the_former_separate_roots_sit_under_their_layer() -> None:
    assert issubclass(errors.PackingError, trio_rl.PublishError)
    assert issubclass(errors.CodecError, trio_rl.sink.TrainError)
    assert issubclass(errors.SimulatedEngineError, trio_rl.EngineError)
    assert issubclass(errors.EndOfStreamError, trio_rl.TransportError)


def test_the_errors_module_imports_nothing_of_ours() -> None:
    code = (
        "import importlib.util, sys\n"
        # a package of its own name: its private modules load as its own, not as trio_rl's
        f"spec = importlib.util.spec_from_file_location('standalone', {errors.__file__!r},"
        f" submodule_search_locations=[{str(Path(errors.__file__).parent)!r}])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['standalone'] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert issubclass(module.DriverFailedError, module.TrioRLError)\n"
        "print(sorted(m for m in sys.modules if m.startswith('trio_rl')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


# --- what users catch -----------------------------------------------------------------------

ALIASES = {
    "GroupFailedError": "GroupFailedError",
    "SourceExhaustedError": "SourceExhaustedError",
    "FailureBudgetExceededError": "FailureBudgetExceededError",
    "DriverFailedError": "DriverFailedError",
    "PayloadFileMissingError": "PayloadFileMissingError",
    "SimulatedEngineError": "SimulatedEngineError",
    "ScriptedEngineError": "ScriptedEngineError",
    "EndOfStreamError": "EndOfStreamError",
    "InvariantViolationError": "InvariantViolationError",
}


@pytest.mark.parametrize(("old", "new"), sorted(ALIASES.items()))
def test_old_names_are_the_same_class(old: str, new: str) -> None:
    owner = ON_THEIR_FLOOR.get(new, errors)
    assert getattr(owner, old) is getattr(owner, new)
    assert old in (errors.__doc__ or "")


# Where each layer's users import its errors from.
LAYER_EXPORTS = {
    "trio_rl.engines": ["EngineError", "SimulatedEngineError", "SimulatedEngineError"],
    "trio_rl.rollout": [
        "RolloutError",
        "GroupFailedError",
        "SourceExhaustedError",
        "FailureBudgetExceededError",
        "DriverFailedError",
    ],
    "trio_rl.sink": ["TrainError", "CheckpointError", "PayloadError", "PayloadFileMissingError"],
    "trio_rl.publish": ["PublishError", "PackingError"],
    "trio_rl.transport": ["TransportError", "EndOfStreamError", "EndOfStreamError"],
    "trio_rl.wire": ["WireFormatError", "WireEncodeError"],
    "trio_rl.trainer": ["TensorConversionError"],
    "trio_rl.evals": ["EvalError", "EvalConfigError"],
    "trio_rl.testing": [
        "InvariantViolationError",
        "ScriptedEngineError",
    ],
}


@pytest.mark.parametrize("facade", sorted(LAYER_EXPORTS))
def test_layers_re_export_their_errors(facade: str) -> None:
    module = importlib.import_module(facade)
    for name in LAYER_EXPORTS[facade]:
        expected = _error_class(ALIASES.get(name, name))
        assert getattr(module, name) is expected, f"{facade}.{name}"


TOP_LEVEL = [
    "TrioRLError",
    "EngineError",
    "RolloutError",
    "DataSourceError",
    "GroupFailedError",
    "SourceExhaustedError",
    "DriverFailedError",
    "PayloadError",
    "TrainSinkError",
    "CheckpointError",
    "PublishError",
    "PackingError",
    "TransportError",
    "TransportIOError",
    "TransportTimeoutError",
    "EndOfStreamError",
    "WireFormatError",
    "WireEncodeError",
    "TensorConversionError",
]


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_the_classes_users_catch_are_exported_from_trio_rl(name: str) -> None:
    assert getattr(trio_rl, name) is _error_class(ALIASES.get(name, name))


def test_the_errors_page_draws_the_same_tree() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
    block = page.read_text().split("```\n", 2)[1]
    drawn = [re.sub(r"^[│├└─ ]*", "", line).split()[0] for line in block.splitlines()]
    assert drawn == [name for name, _, _ in _drawn_tree()]


def test_an_invariant_violation_names_its_invariant_member_not_a_number() -> None:
    import enum

    from trio_rl.testing import Invariant

    annotation = testing_errors.InvariantViolationError.__init__.__annotations__["invariant"]
    assert eval(annotation, {"Invariant": Invariant}) is Invariant
    # a plain Enum: nothing may compare it to, or sort it with, an int
    assert issubclass(Invariant, enum.Enum)
    assert not issubclass(Invariant, int)
    assert Invariant.NO_LOST_WAKEUP != 5  # type: ignore[comparison-overlap]  # the point
    error = testing_errors.InvariantViolationError(
        Invariant.NO_LOST_WAKEUP, "slept", ["a", "b"], description="no lost wake-up"
    )
    assert error.invariant is Invariant.NO_LOST_WAKEUP
    assert str(error).startswith("invariant NO_LOST_WAKEUP (no lost wake-up) violated: slept\n")
