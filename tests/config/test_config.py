"""Configuration files: layering, validation naming the key and file:line, the effective
configuration as TOML, the stored configuration a resume is checked against, the examples."""

from __future__ import annotations

import inspect
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest

from trio_rl.config import (
    ConfigChangedError,
    ConfigError,
    LearnRunConfig,
    Override,
    SimulateConfig,
    check_resume,
    flatten,
    load,
    store,
    to_toml,
)
from trio_rl.orchestrator import OrchestratorConfig
from trio_rl.sink import DEFAULT_STALENESS, STALENESS_RULES, SinkConfig
from trio_rl.sink._scoring import sample_version, score_group

EXAMPLES = Path(__file__).parents[2] / "examples"
_CLI = [sys.executable, "-m", "trio_rl"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_CLI, *args], capture_output=True, text=True, timeout=timeout)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_later_files_then_overrides_win_and_origins_are_kept(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.toml", "[rollout]\nbatch_groups = 4\ngroup_size = 4\n")
    b = _write(tmp_path / "b.toml", "# b\n\n[rollout]\n\ngroup_size = 6\n")
    cfg, origin = load(
        SimulateConfig,
        [a, b],
        [Override("run.steps", 3, where="--steps"), Override.parse("engine.distribution=swe")],
    )
    assert (cfg.rollout.batch_groups, cfg.rollout.group_size) == (4, 6)
    assert (cfg.run.steps, cfg.engine.distribution) == (3, "swe")
    assert origin == {
        "rollout.batch_groups": f"{a}:2",
        "rollout.group_size": f"{b}:5",
        "run.steps": "--steps",
        "engine.distribution": "--set",
    }
    # `none` unsets an optional key; TOML values parse as TOML
    learn, _ = load(LearnRunConfig, [], [Override.parse("sink.max_off_policy_steps=none")])
    assert learn.sink.max_off_policy_steps is None
    learn, _ = load(LearnRunConfig, [], [Override.parse("trainer.lr=1e-3")])
    assert learn.trainer.lr == 1e-3


@pytest.mark.parametrize(
    ("text", "line", "key", "reason"),
    [
        ("[rollout]\nbatch_groups = [\n", 2, "", "not valid TOML"),
        ("[run]\nsteps = 3\n\n[rollout]\ngroup_sise = 4\n", 5, "rollout.group_sise", "mean"),
        ("[run]\nsteps = 3\n[bogus]\nx = 1\n", 3, "bogus", "unknown section"),
        ('[rollout]\n\ngroup_size = "4"\n', 3, "rollout.group_size", "expected int, got str"),
        ("[run]\nseed = 1\nsteps = 0\n", 3, "run.steps", "must be >= 1, got 0"),
        ("rollout.batch_groups = -2\n", 1, "rollout.batch_groups", "must be >= 1"),
        ('[engine]\ndistribution = "uniform"\n', 2, "engine.distribution", "expected one of"),
        ("[engine]\ntokens_per_second = nan\n", 2, "engine.tokens_per_second", "finite"),
        # READY listens on port + 1, so the data port's highest value is 65534
        ("[transport]\nport = 65535\n", 2, "transport.port", "between 0 and 65534"),
    ],
)
def test_a_bad_file_names_the_file_line_and_key(
    tmp_path: Path, text: str, line: int, key: str, reason: str
) -> None:
    path = _write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        load(SimulateConfig, [path])
    assert info.value.where == f"{path}:{line}"
    assert info.value.key == key
    assert reason in str(info.value)


def test_the_effective_configuration_round_trips_through_toml(tmp_path: Path) -> None:
    for schema in (LearnRunConfig, SimulateConfig):
        default = schema()
        # every option changed from its default, where the type allows it
        changed: dict[str, object] = {}
        for key, value in flatten(default).items():
            if isinstance(value, bool):
                changed[key] = not value
            elif isinstance(value, int | float) and value is not None:
                changed[key] = value + 1
        cfg, _ = load(schema, [], [Override(k, v) for k, v in changed.items()])
        path = _write(tmp_path / "effective.toml", to_toml(cfg))
        again, _ = load(schema, [path])
        assert again == cfg
        assert {k: flatten(again)[k] for k in changed} == changed


def test_simulate_defaults_are_the_orchestrators() -> None:
    sim, orch = SimulateConfig(), OrchestratorConfig()
    step = (orch.batch_groups, orch.group_size)
    assert (sim.rollout.batch_groups, sim.rollout.group_size) == step
    assert sim.sink.to_config(batch_size=orch.batch_groups * orch.group_size) == orch.sink
    assert sim.checkpoint.to_config() == orch.checkpoint
    assert sim.rollout.to_config(routing_keys="none") == orch.rollout
    assert sim.sink.staleness == orch.sink.staleness == LearnRunConfig().sink.staleness


@pytest.mark.parametrize("rule", ["oldest_token", "group_start"])
def test_the_sink_staleness_key_reaches_both_commands_configs(tmp_path: Path, rule: str) -> None:
    from trio_rl.cli import orchestrator_config
    from trio_rl.learn import sink_config

    path = _write(
        tmp_path / "c.toml", f'[run]\nout = "{tmp_path}"\n\n[sink]\nstaleness = "{rule}"\n'
    )
    sim, _ = load(SimulateConfig, [path])
    assert orchestrator_config(sim).sink.staleness == rule
    learn, _ = load(LearnRunConfig, [path])
    assert sink_config(learn).staleness == rule
    bad = _write(tmp_path / "bad.toml", '[sink]\nstaleness = "newest_token"\n')
    with pytest.raises(ConfigError) as info:
        load(SimulateConfig, [bad])
    assert info.value.key == "sink.staleness"
    assert "expected one of" in str(info.value)


def test_a_resume_with_a_changed_key_is_refused_unless_allowed(tmp_path: Path) -> None:
    stored = SimulateConfig()
    store(stored, tmp_path)
    check_resume(SimulateConfig, stored, tmp_path)
    # run.steps and run.out may change on every resume
    more = attrs.evolve(stored, run=attrs.evolve(stored.run, steps=99, out="elsewhere"))
    check_resume(SimulateConfig, more, tmp_path)
    other = attrs.evolve(stored, rollout=attrs.evolve(stored.rollout, group_size=4))
    with pytest.raises(ConfigChangedError) as info:
        check_resume(SimulateConfig, other, tmp_path)
    assert info.value.changes == [("rollout.group_size", 8, 4)]
    assert "rollout.group_size 8 -> 4" in str(info.value)
    assert "--allow-change rollout.group_size" in str(info.value)
    check_resume(SimulateConfig, other, tmp_path, allow=["rollout.group_size"])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[rollout]\ngroup_size = [\n", ":2: not valid TOML"),
        ("[rollout]\ngroup_sise = 4\n", ":2: rollout.group_sise: unknown key"),
        ('[rollout]\ngroup_size = "four"\n', ":2: rollout.group_size: expected int"),
        ("[trainer]\nranks = 0\n", ":2: trainer.ranks: must be >= 1, got 0"),
    ],
)
def test_the_command_reports_a_bad_config_in_one_line_exit_2(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = _write(tmp_path / "bad.toml", text)
    for command in (["simulate", "--out", str(tmp_path / "run")], ["config", "--for", "simulate"]):
        done = _cli(*command, str(path))
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"trio-rl: error: {path}{needle}"), done.stderr
        assert done.stdout == ""
    assert not (tmp_path / "run").exists()


def test_trio_rl_config_prints_the_effective_configuration(tmp_path: Path) -> None:
    done = _cli("config", "--for", "simulate", str(EXAMPLES / "simulate.toml"),
                "--set", "rollout.group_size=5")  # fmt: skip
    assert done.returncode == 0, done.stderr
    path = _write(tmp_path / "effective.toml", done.stdout)
    cfg, _ = load(SimulateConfig, [path])
    expected, _ = load(
        SimulateConfig, [EXAMPLES / "simulate.toml"], [Override("rollout.group_size", 5)]
    )
    assert cfg == expected
    assert cfg.transport.kind == "zmq"


def test_the_learning_examples_load() -> None:
    for name in ("learn.toml", "learn-quick.toml"):
        cfg, origin = load(LearnRunConfig, [EXAMPLES / name])
        assert origin, name  # the file set something
        assert cfg != LearnRunConfig()
    done = _cli("config", str(EXAMPLES / "learn.toml"))
    assert done.returncode == 0, done.stderr
    assert 'task = "reverse"' in done.stdout


def test_the_simulate_example_runs_stores_its_config_and_refuses_a_changed_resume(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    example = str(EXAMPLES / "simulate.toml")
    first = _cli("simulate", example, "--out", str(out), "--set", "run.steps=2")
    assert first.returncode == 0, first.stderr
    assert "steps 1..2" in first.stdout
    assert "batches via tcp://127.0.0.1:" in first.stdout
    stored, _ = load(SimulateConfig, [out / "config.toml"])
    assert stored.rollout.group_size == 4
    assert stored.transport.kind == "zmq"
    ckpts = {p.name: p.read_bytes() for p in (out / "checkpoints").glob("step_*.ckpt")}

    refused = _cli("simulate", example, "--out", str(out), "--group-size", "2")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "rollout.group_size 4 -> 2" in refused.stderr
    assert "--allow-change rollout.group_size" in refused.stderr
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").glob("step_*.ckpt")} == ckpts
    assert load(SimulateConfig, [out / "config.toml"])[0] == stored

    # the same configuration with more steps resumes
    resumed = _cli("simulate", example, "--out", str(out), "--steps", "1")
    assert resumed.returncode == 0, resumed.stderr
    assert "steps 3..3" in resumed.stdout


def test_python_dash_m_and_version() -> None:
    done = _cli("--version")
    assert done.returncode == 0
    assert done.stdout.startswith("trio-rl ")
    for command in ("simulate", "run"):
        helped = " ".join(_cli(command, "--help").stdout.split())
        assert "--steps STEPS steps this invocation ships, not a total" in helped
        assert "--set SECTION.KEY=VALUE" in helped
    assert "--allow-change" in _cli("simulate", "--help").stdout


def test_the_staleness_rule_has_one_default_and_one_spelling() -> None:
    """The allowed values and the default are defined once (`trio_rl.sink`); the schema's
    ``[sink]`` section is generated from the sink's config and takes both from it."""
    assert STALENESS_RULES == ("group_start", "oldest_token")
    key_type = attrs.fields_dict(typing.cast("Any", type(SimulateConfig().sink)))["staleness"].type
    assert typing.get_args(key_type) == STALENESS_RULES
    assert SinkConfig(batch_size=1).staleness == DEFAULT_STALENESS
    assert OrchestratorConfig().sink.staleness == DEFAULT_STALENESS
    assert SimulateConfig().sink.staleness == LearnRunConfig().sink.staleness == DEFAULT_STALENESS
    assert attrs.fields(SinkConfig).staleness.default == DEFAULT_STALENESS
    assert inspect.signature(score_group).parameters["rule"].default == DEFAULT_STALENESS
    # no second default hidden in a helper: the rule is always passed
    assert inspect.signature(sample_version).parameters["rule"].default is inspect.Parameter.empty
