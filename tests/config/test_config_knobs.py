"""Every knob of the rollout's and the checkpoints' own configs reaches the orchestrator from a
file and from ``--set``, and every knob of the trainer's reaches ``trio-rl run``'s trainer.

``[rollout]`` and ``[checkpoint]`` are generated from :class:`trio_rl.rollout.RolloutConfig`
and :class:`trio_rl.sink.CheckpointConfig` (as ``[sink]`` is from ``SinkConfig``,
``test_config_sink.py``): this test walks their fields (a nested config's fields included),
sets each to a value that is not the one the command runs with by default, through a TOML file
and through ``trio-rl config --set``, and checks that the :class:`OrchestratorConfig` each
command builds carries it. A knob added to either config is covered here without a change to
this file; one a command sets from another key must be listed as left out, with where its
value comes from.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from config_walk import leaf_paths, other_value, value_at

from trio_rl import cli
from trio_rl.config import LearnRunConfig, SimulateConfig, load
from trio_rl.config._load import _toml_value
from trio_rl.config._sections import ConfigSection
from trio_rl.errors import ConfigError
from trio_rl.learn import orchestrator_config as learn_orchestrator_config
from trio_rl.orchestrator import OrchestratorConfig
from trio_rl.rollout import RolloutConfig
from trio_rl.sink import CheckpointConfig
from trio_rl.trainer import TrainerConfig

SCHEMAS = [SimulateConfig, LearnRunConfig]
SECTIONS = {"rollout": RolloutConfig, "checkpoint": CheckpointConfig}
#: The fields each command sets from another key, not from the section of the config's name.
LEFT_OUT = {"rollout": {"routing_keys"}, "checkpoint": set()}


def _orchestrator_of(schema: type[Any], config: Any, tmp_path: Path) -> OrchestratorConfig:
    """The OrchestratorConfig the command of ``schema`` runs with."""
    if schema is SimulateConfig:
        return cli.orchestrator_config(config)
    config = attrs.evolve(config, run=attrs.evolve(config.run, out=str(tmp_path / "run")))
    return learn_orchestrator_config(config, max_tokens=16)


KNOBS = [
    (section, path, tp)
    for section, cls in SECTIONS.items()
    for path, tp in leaf_paths(cls)
    if path[0] not in LEFT_OUT[section]
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["simulate", "run"])
@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_the_section_is_generated_from_the_library_config(schema: type[Any], section: str) -> None:
    values = getattr(schema(), section)
    assert isinstance(values, ConfigSection)
    assert values.config is SECTIONS[section]
    # what is left out says where its value comes from, and is exactly the listed fields
    assert set(values.omitted) == LEFT_OUT[section]
    assert all(values.omitted.values())
    keys = {f.name for f in attrs.fields(typing.cast("Any", type(values)))}
    assert {"_".join(p) for p, _ in leaf_paths(SECTIONS[section])} - keys == LEFT_OUT[section]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["simulate", "run"])
@pytest.mark.parametrize(
    ("section", "path", "tp"), KNOBS, ids=[f"{s}.{'_'.join(p)}" for s, p, _ in KNOBS]
)
def test_every_rollout_and_checkpoint_knob_reaches_the_orchestrator(
    schema: type[Any],
    section: str,
    path: tuple[str, ...],
    tp: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = "_".join(path)
    default = value_at(_orchestrator_of(schema, schema(), tmp_path), (section, *path))
    value = other_value(default, tp)
    text = _toml_value(value)

    toml = tmp_path / "c.toml"
    toml.write_text(f"[{section}]\n{key} = {text}\n")
    from_file, _ = load(schema, [toml])
    assert value_at(_orchestrator_of(schema, from_file, tmp_path), (section, *path)) == value

    target = "simulate" if schema is SimulateConfig else "run"
    assert cli.main(["config", "--for", target, "--set", f"{section}.{key}={text}"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    from_set, _ = load(schema, [printed])
    assert value_at(_orchestrator_of(schema, from_set, tmp_path), (section, *path)) == value
    assert from_set == from_file


TRAINER_KNOBS = [(p, tp) for p, tp in leaf_paths(TrainerConfig) if p != ("betas",)]


def test_the_trainer_section_is_generated_from_the_trainers_config() -> None:
    values = LearnRunConfig().trainer
    assert values.config is TrainerConfig
    assert set(values.omitted) == {"betas"}  # a pair of floats: no key
    assert values.to_config() == TrainerConfig()


@pytest.mark.parametrize(("path", "tp"), TRAINER_KNOBS, ids=["_".join(p) for p, _ in TRAINER_KNOBS])
def test_every_trainer_knob_reaches_the_learning_runs_trainer(
    path: tuple[str, ...], tp: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def trainer_of(config: LearnRunConfig) -> TrainerConfig:
        config = attrs.evolve(config, run=attrs.evolve(config.run, out=str(tmp_path / "run")))
        return config.trainer.to_config()

    key = "_".join(path)
    value = other_value(value_at(trainer_of(LearnRunConfig()), path), tp)
    text = _toml_value(value)
    toml = tmp_path / "c.toml"
    toml.write_text(f"[trainer]\n{key} = {text}\n")
    from_file, _ = load(LearnRunConfig, [toml])
    assert value_at(trainer_of(from_file), path) == value

    assert cli.main(["config", "--for", "run", "--set", f"trainer.{key}={text}"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    from_set, _ = load(LearnRunConfig, [printed])
    assert value_at(trainer_of(from_set), path) == value


def test_the_routing_keys_come_from_the_engine_or_the_fleet(tmp_path: Path) -> None:
    def routing(schema: type[Any], text: str) -> str:
        toml = tmp_path / "c.toml"
        toml.write_text(text)
        config, _ = load(schema, [toml])
        return _orchestrator_of(schema, config, tmp_path).rollout.routing_keys

    assert routing(SimulateConfig, "") == "none"
    assert routing(SimulateConfig, '[engine]\nkind = "openai"\n') == "group"
    # the learning run: `[inference] routing_keys`, with a fleet (the in-process engine: none)
    assert routing(LearnRunConfig, '[inference]\nrouting_keys = "sample"\n') == "none"
    fleet = '[inference]\nurls = ["http://127.0.0.1:9"]\n'
    assert routing(LearnRunConfig, fleet) == "group"
    assert routing(LearnRunConfig, fleet + 'routing_keys = "sample"\n') == "sample"


def test_the_learning_runs_unset_budget_is_one_step(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[rollout]\nbatch_groups = 3\ngroup_size = 4\n")
    learn, _ = load(LearnRunConfig, [toml])
    assert _orchestrator_of(LearnRunConfig, learn, tmp_path).group_budget == 3
    sim, _ = load(SimulateConfig, [toml])
    assert _orchestrator_of(SimulateConfig, sim, tmp_path).group_budget == 6


def test_a_bad_knob_is_refused_by_the_library_configs_check(tmp_path: Path) -> None:
    from trio_rl.config import ConfigError

    for text, key in [
        ("[rollout]\nsample_timeout = 0\n", "rollout.sample_timeout"),
        ("[rollout]\nfailure_max_retries = -1\n", "rollout.failure_max_retries"),
        ("[checkpoint]\nkeep = 0\n", "checkpoint.keep"),
        ('[rollout]\nsubmission = "prompt"\n', "rollout.submission"),
    ]:
        toml = tmp_path / "bad.toml"
        toml.write_text(text)
        with pytest.raises(ConfigError) as info:
            load(SimulateConfig, [toml])
        assert info.value.key == key
        assert info.value.where == f"{toml}:2"
        # the check's own wording, after the key the loader names once
        assert str(info.value).count(key.partition(".")[2]) == 1
        assert "must be" in str(info.value) or "expected one of" in str(info.value)


def test_a_trainer_job_reads_the_configuration_back(tmp_path: Path) -> None:
    # a torchrun or external trainer job reads the run's configuration from run.json
    import json

    from trio_rl.config import configure
    from trio_rl.learn._settings import from_run_json, run_json

    config = configure(
        LearnRunConfig,
        {
            "run.out": str(tmp_path),
            "rollout.max_groups_in_flight": 5,
            "rollout.sample_timeout": 3.0,
            "rollout.failure_action": "retry",
            "checkpoint.keep": 2,
            "checkpoint.incremental": False,
            "trainer.lr": 3e-4,
            "inference.vllm_args": ("--dtype", "float32"),
            "sink.scoring_env_temperatures": {"math": 1.0},
        },
    )
    again = from_run_json(json.loads(json.dumps(run_json(config))), "run.json")
    assert again == config
    assert again.rollout.to_config().failure.action == "retry"


@pytest.mark.parametrize("schema", SCHEMAS, ids=["simulate", "run"])
def test_a_flag_offers_the_values_its_key_declares(schema: type[Any]) -> None:
    import argparse

    from trio_rl._flags import RUN_FLAGS, SIMULATE_FLAGS, add_config_arguments
    from trio_rl.config import choices

    flags = SIMULATE_FLAGS if schema is SimulateConfig else RUN_FLAGS
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, schema, flags, resumable=False)
    offered = {a.dest: a.choices for a in parser._actions}
    declared = {f.dest: choices(schema, f.key) for f in flags if "const" not in f.kwargs}
    checked = {dest for dest, values in declared.items() if values is not None}
    assert checked, "no flag of a key with a fixed set of values"
    for dest in checked:
        assert list(offered[dest] or ()) == list(declared[dest] or ()), dest


def test_inference_min_servers_reaches_the_fleet_and_is_checked(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    urls = '[inference]\nurls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]\n'
    toml.write_text(urls)
    config, _ = load(LearnRunConfig, [toml])
    assert config.inference.fleet_config().min_servers is None
    toml.write_text(urls + "min_servers = 1\n")
    config, _ = load(LearnRunConfig, [toml])
    assert config.inference.fleet_config().min_servers == 1
    for bad, match in [("3", r"min_servers = 3 is more than the 2 servers"), ("0", "min_servers")]:
        toml.write_text(urls + f"min_servers = {bad}\n")
        with pytest.raises(ConfigError, match=match):
            load(LearnRunConfig, [toml])
