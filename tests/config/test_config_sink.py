"""Every knob of the train sink's own config reaches it from a file and from ``--set``.

The ``[sink]`` section is generated from :class:`trio_rl.sink.SinkConfig`: this test walks
the sink's fields (a nested config's fields included), sets each to a value that is not its
default through a TOML file and through ``trio-rl config --set``, and checks that the
``SinkConfig`` each command runs with carries it. A knob added to ``SinkConfig`` is covered
here without a change to this file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from config_walk import leaf_paths, other_value, value_at

from trio_rl import cli
from trio_rl.config import LearnRunConfig, SimulateConfig, load
from trio_rl.config._load import _toml_value
from trio_rl.config._sections import SIZED_ELSEWHERE
from trio_rl.learn import sink_config
from trio_rl.sink import SinkConfig

KNOBS = [(p, tp) for p, tp in leaf_paths(SinkConfig) if p[0] not in SIZED_ELSEWHERE]


def _sink_of(schema: type[Any], config: Any, tmp_path: Path) -> SinkConfig:
    """The SinkConfig the command of ``schema`` runs with."""
    if schema is SimulateConfig:
        return cli.orchestrator_config(config).sink
    config = attrs.evolve(config, run=attrs.evolve(config.run, out=str(tmp_path / "run")))
    return sink_config(config)


def test_the_sink_has_knobs_to_check() -> None:
    keys = {"_".join(p) for p, _ in KNOBS}
    assert {"max_off_policy_steps", "staleness", "prune", "scoring_normalize_std"} <= keys
    # the sizing fields are the only ones left out, and each says where its value comes from
    left_out = {p[0] for p, _ in leaf_paths(SinkConfig)} - {p[0] for p, _ in KNOBS}
    assert left_out == set(SIZED_ELSEWHERE)


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
    default = value_at(_sink_of(schema, schema(), tmp_path), path)
    value = other_value(default, tp)
    text = _toml_value(value)

    # the learning run stamps its sampling temperature: a stamp is set with rollout.temperature
    sampled = _sampled_at(schema, key, value)
    toml = tmp_path / "c.toml"
    rollout = "" if sampled is None else f"[rollout]\ntemperature = {sampled!r}\n"
    toml.write_text(f"{rollout}[sink]\n{key} = {text}\n")
    from_file, _ = load(schema, [toml])
    assert value_at(_sink_of(schema, from_file, tmp_path), path) == value

    target = "simulate" if schema is SimulateConfig else "run"
    also = [] if sampled is None else ["--set", f"rollout.temperature={sampled!r}"]
    assert cli.main(["config", "--for", target, *also, "--set", f"sink.{key}={text}"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    from_set, _ = load(schema, [printed])
    assert value_at(_sink_of(schema, from_set, tmp_path), path) == value
    assert from_set == from_file


def _sampled_at(schema: type[Any], key: str, value: Any) -> float | None:
    """The ``rollout.temperature`` the learning run needs for ``[sink] key = value``."""
    if schema is SimulateConfig:
        return None
    if key == "scoring_temperature":
        return float(value)
    if key == "scoring_env_temperatures":
        (temperature,) = set(value.values())
        return float(temperature)
    return None


@pytest.mark.parametrize("schema", [SimulateConfig, LearnRunConfig], ids=["simulate", "run"])
def test_the_sink_batch_is_the_rollout_step(schema: type[Any], tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[rollout]\nbatch_groups = 3\ngroup_size = 4\n")
    config, _ = load(schema, [toml])
    sink = _sink_of(schema, config, tmp_path)
    assert (sink.batch_size, sink.token_batch_size) == (12, None)
