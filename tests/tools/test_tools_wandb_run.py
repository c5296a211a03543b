"""The W&B run of a trio-rl run: its name, entity, tags and the effective configuration, and
its id kept in the run directory so that a resumed run continues it (``resume="allow"``).
Offline (``WANDB_MODE=offline``), read back from the run files ``wandb sync`` would upload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tools_helpers import extra, wandb_history, wandb_records

from trio_rl.tools import WANDB_ID_FILE, WandbSink

QUICK = Path(__file__).parents[2] / "examples" / "learn-quick.toml"


def _run_record(run_file: Path) -> Any:
    (run,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    return run


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    extra("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _next_second() -> None:
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.02)


@pytest.mark.usefixtures("offline")
def test_a_resumed_sink_continues_the_run_whose_id_it_kept(tmp_path: Path) -> None:
    id_file = tmp_path / WANDB_ID_FILE
    first = WandbSink(project="trio-rl-test", dir=str(tmp_path), id_file=id_file)
    first.write({"step": 1, "reward_mean": 0.25})
    run_id = first.run.id
    first.close()
    assert id_file.read_text().strip() == run_id
    # W&B names an offline run's directory by the second it started and its id: the resumed
    # run must start in another second to get a directory of its own
    _next_second()
    again = WandbSink(project="trio-rl-test", dir=str(tmp_path), id_file=id_file, resume=True)
    again.write({"step": 2, "reward_mean": 0.5})
    assert again.run.id == run_id
    again.close()
    # not resuming (a fresh run in the same directory): a new W&B run, its id kept instead
    fresh = WandbSink(project="trio-rl-test", dir=str(tmp_path), id_file=id_file)
    assert fresh.run.id != run_id
    fresh.close()
    assert id_file.read_text().strip() == fresh.run.id
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert [p.name.rsplit("-", 1)[1] for p in runs].count(run_id) == 2
    resumed = [p for p in runs if p.name.endswith(run_id)]
    steps = [sorted(wandb_history(next(p.glob("*.wandb")))) for p in resumed]
    assert sorted(steps) == [[1], [2]]


@pytest.mark.heavy
def test_trio_rl_run_names_tags_configures_and_resumes_its_wandb_run(tmp_path: Path) -> None:
    """Two invocations of `trio-rl run` on one run directory: one W&B run id, the second
    marked as resumed, each with the name, entity, tags and effective configuration."""
    extra("wandb")
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    args = [
        sys.executable, "-m", "trio_rl", "run", str(QUICK), "--out", str(out), "--steps", "2",
        "--set", "metrics.wandb_project=trio-rl-test", "--set", "metrics.wandb_name=quick-1",
        "--set", "metrics.wandb_entity=trio-team", "--set", "metrics.wandb_tags=smoke, quick",
    ]  # fmt: skip
    for _ in range(2):
        done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
    run_id = (out / WANDB_ID_FILE).read_text().strip()
    runs = sorted((out / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    assert len(runs) == 2
    records = [_run_record(next(p.glob("*.wandb"))) for p in runs]
    for run in records:
        assert run.run_id == run_id
        assert run.display_name == "quick-1"
        assert run.entity == "trio-team"
        assert list(run.tags) == ["smoke", "quick"]
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["rollout"]["batch_groups"] == 2  # from learn-quick.toml
        assert config["metrics"]["wandb_name"] == "quick-1"
    steps = [sorted(wandb_history(next(p.glob("*.wandb")))) for p in runs]
    # the held-out eval of the initial policy is step 0; the second invocation continues at 3
    assert steps == [[0, 1, 2], [3, 4]]
