"""examples/ uses only the public API, and its configurations load and run.

Every ``examples/*.py`` is parsed and each import of ours is checked: a private module
(``trio_rl._x``, ``trio_rl.x._y``) or a private name (``from trio_rl.x import _y``) fails."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trio_rl.config import LearnRunConfig, SimulateConfig, load

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
CONFIGS = sorted(EXAMPLES.glob("*.toml"))


def _private_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        modules: list[tuple[str, list[str]]] = []
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Import):
            modules = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [(node.module, [alias.name for alias in node.names])]
        for module, names in modules:
            parts = module.split(".")
            if parts[0] != "trio_rl":
                continue
            if any(p.startswith("_") for p in parts[1:]):
                found.append(f"line {node.lineno}: {module}")
            found += [f"line {node.lineno}: {module}.{n}" for n in names if n.startswith("_")]
    return found


def test_there_are_example_scripts_to_check() -> None:
    assert SCRIPTS, "examples/ has no .py file: the check below would pass on nothing"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_an_example_imports_only_public_names(script: Path) -> None:
    assert _private_imports(script.read_text()) == []


def test_the_check_catches_private_imports() -> None:
    source = (
        "import trio_rl.engines._vllm\n"
        "from trio_rl.learn._grpo import GRPOTrainer\n"
        "from trio_rl.learn import _task\n"
        "from trio_rl.rollout import JsonlSource\n"
        "import trio\n"
    )
    assert _private_imports(source) == [
        "line 1: trio_rl.engines._vllm",
        "line 2: trio_rl.learn._grpo",
        "line 3: trio_rl.learn._task",
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_an_example_configuration_loads(config: Path) -> None:
    schema = SimulateConfig if config.name == "simulate.toml" else LearnRunConfig
    cfg, origin = load(schema, [config])
    assert origin
    assert cfg != schema()


def test_the_own_data_example_runs_with_its_jsonl_and_reward_module(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "trio_rl", "run", "examples/own_data.toml"]
    done = subprocess.run(
        [*command, "--steps", "2", "--out", str(out), "--plain"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "reward examples.rewards:partial_match" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["counters/reward_failures"] == 0 for r in records)
