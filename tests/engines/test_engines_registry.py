"""The engine registry: a fifth engine, registered outside the library (`fifth_engine`), runs
the real ``trio-rl simulate`` and ``trio-rl run`` by its name in the configuration (the recipe
of docs/contributing.md), and a bad name or option is a configuration error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_rl.config import ConfigError, LearnRunConfig, SimulateConfig, configure
from trio_rl.engines import (
    EngineKind,
    SimulatedConfig,
    engine_kind,
    engine_kinds,
    register_engine,
    unregister_engine,
)
from trio_rl.errors import InvalidArgumentError

HERE = Path(__file__).resolve().parent


def _trio_rl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "trio_rl", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )


def test_a_fifth_engine_runs_trio_rl_simulate(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    config = tmp_path / "sim.toml"
    config.write_text(
        f'[engine]\nkind = "fifth_engine:LOGGED"\noptions = {{log = "{log}", slots = 4}}\n'
    )
    done = _trio_rl(tmp_path, "simulate", str(config), "--steps", "2", "--seed", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step   2: shipped" in done.stdout
    assert log.read_text().splitlines() == ["opened simulated seed 3", "closed"]


@pytest.mark.heavy
def test_a_fifth_engine_runs_trio_rl_run_and_loads_every_published_version(
    tmp_path: Path,
) -> None:
    log = tmp_path / "engine.log"
    config = tmp_path / "run.toml"
    config.write_text(
        f'[inference]\nengine = "fifth_engine:LOGGED"\noptions = {{log = "{log}"}}\n'
        "[rollout]\nbatch_groups = 2\ngroup_size = 4\n"
        "[engine]\nd_model = 32\nn_layers = 1\n"
        '[metrics]\nplot = false\ndisplay = "plain"\n'
    )
    out = tmp_path / "run"
    done = _trio_rl(tmp_path, "run", str(config), "--out", str(out), "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "opened model seed 0"
    assert lines[-1] == "closed"
    # the watcher loaded the trainer's published versions into it, in order
    loaded = [int(line.split()[1]) for line in lines if line.startswith("loaded ")]
    assert loaded
    assert loaded == sorted(loaded)
    assert set(loaded) <= {1, 2, 3}
    assert (out / "metrics.jsonl").read_text().count("\n") == 3


def test_a_bad_engine_name_or_option_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.kind.*no engine 'nope'.*openai, simulated"):
        configure(SimulateConfig, {"engine.kind": "nope"})
    with pytest.raises(ConfigError, match=r"an engine of `trio-rl run`"):
        configure(LearnRunConfig, {"inference.engine": "simulated"})
    sys.path.insert(0, str(HERE))
    try:
        with pytest.raises(ConfigError, match=r"engine\.options: \['colour'\] are no knobs"):
            configure(
                SimulateConfig,
                {"engine.kind": "fifth_engine:LOGGED", "engine.options": {"colour": 1}},
            )
    finally:
        sys.path.remove(str(HERE))
        unregister_engine("logged")


def test_a_registered_kind_is_listed_and_replaced_by_its_name() -> None:
    from fifth_engine import open_logged

    kind = register_engine(
        EngineKind("sixth", SimulatedConfig, open_logged, commands=("simulate",))
    )
    try:
        assert "sixth" in engine_kinds("simulate")
        assert "sixth" not in engine_kinds("run")
        assert engine_kind("sixth") is kind
        with pytest.raises(InvalidArgumentError, match="an engine of `trio-rl run`"):
            engine_kind("sixth", "run")
    finally:
        unregister_engine("sixth")
    assert "sixth" not in engine_kinds()
