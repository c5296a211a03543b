"""Every knob of the train sink's own config reaches it from a file and from ``--set``.

The ``[sink]`` section is generated from :class:`trio_rl.train.SinkConfig`: this test walks
the sink's fields (a nested config's fields included), sets each to a value that is not its
default through a TOML file and through ``trio-rl config --set``, and checks that the
``SinkConfig`` each command runs with carries it. A knob added to ``SinkConfig`` is covered
here without a change to this file.
"""

from __future__ import annotations

import enum
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest

from trio_rl import cli
from trio_rl.config import LearnRunConfig, SimulateConfig, load
from trio_rl.config._load import _toml_value
from trio_rl.config._sections import SIZED_ELSEWHERE
from trio_rl.learn import config_from_file
from trio_rl.train import SinkConfig


def _paths(cls: type[Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, type)`` of every leaf field of ``cls``, nested attrs configs walked."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[tuple[str, ...], Any]] = []
    for f in attrs.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and attrs.has(tp):
            out.extend(_paths(tp, (*prefix, f.name)))
        else:
            out.append(((*prefix, f.name), tp))
    return out


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj.value if isinstance(obj, enum.Enum) else obj


def _other(value: Any, tp: Any) -> Any:
    """A valid value of type ``tp`` other than ``value``."""
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


KNOBS = [(p, tp) for p, tp in _paths(SinkConfig) if p[0] not in SIZED_ELSEWHERE]


def _sink_of(schema: type[Any], config: Any, tmp_path: Path) -> SinkConfig:
    """The SinkConfig the command of ``schema`` runs with."""
    if schema is SimulateConfig:
        return cli.orchestrator_config(config).sink
    config = attrs.evolve(config, run=attrs.evolve(config.run, out=str(tmp_path / "run")))
    return config_from_file(config).sink


def test_the_sink_has_knobs_to_check() -> None:
    keys = {"_".join(p) for p, _ in KNOBS}
    assert {"max_off_policy_steps", "staleness", "prune", "scoring_normalize_std"} <= keys
    # the sizing fields are the only ones left out, and each says where its value comes from
    assert {p[0] for p, _ in _paths(SinkConfig)} - {p[0] for p, _ in KNOBS} == set(SIZED_ELSEWHERE)


@pytest.mark.parametrize("schema", [SimulateConfig, LearnRunConfig], ids=["simulate", "run"])
@pytest.mark.parametrize(("path", "tp"), KNOBS, ids=["_".join(p) for p, _ in KNOBS])
def test_every_sink_knob_reaches_the_sink_from_a_file_and_from_set(
    schema: type[Any],
    path: tuple[str, ...],
    tp: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = "_".join(path)
    default = _get(_sink_of(schema, schema(), tmp_path), path)
    value = _other(default, tp)
    text = _toml_value(value)

    toml = tmp_path / "c.toml"
    toml.write_text(f"[sink]\n{key} = {text}\n")
    from_file, _ = load(schema, [toml])
    assert _get(_sink_of(schema, from_file, tmp_path), path) == value

    target = "simulate" if schema is SimulateConfig else "run"
    assert cli.main(["config", "--for", target, "--set", f"sink.{key}={text}"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    from_set, _ = load(schema, [printed])
    assert _get(_sink_of(schema, from_set, tmp_path), path) == value
    assert from_set == from_file


@pytest.mark.parametrize("schema", [SimulateConfig, LearnRunConfig], ids=["simulate", "run"])
def test_the_sink_batch_is_the_rollout_step(schema: type[Any], tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[rollout]\nbatch_groups = 3\ngroup_size = 4\n")
    config, _ = load(schema, [toml])
    sink = _sink_of(schema, config, tmp_path)
    assert (sink.batch_size, sink.token_batch_size) == (12, None)
