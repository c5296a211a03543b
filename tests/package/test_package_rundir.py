"""`RunDirectory` owns a run directory's layout: its paths, and no other module spells them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trio_rl import rundir
from trio_rl.rundir import RunDirectory
from trio_rl.sink import CheckpointManager
from trio_rl.transport import batch_path, batches_dir, end_marker_path

SRC = Path(__file__).resolve().parents[2] / "src" / "trio_rl"


def test_the_layout(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path)
    assert run.config == tmp_path / "config.toml"
    assert run.metrics == tmp_path / "metrics.jsonl"
    assert run.plot == tmp_path / "plot.png"
    assert run.run_log == tmp_path / "logs" / "run.log"
    assert run.checkpoints == tmp_path / "checkpoints"
    assert run.weights == tmp_path / "weights"
    assert run.trainer_log(1) == tmp_path / "trainer" / "rank_1.jsonl"
    assert run.trainer_lock(2) == tmp_path / "trainer" / "rank_2.lock"
    assert run.trainer_state == tmp_path / "trainer" / "state.pt"
    assert run.trainer_stats == tmp_path / "trainer" / "stats.jsonl"
    assert run.trained_log == tmp_path / "trainer" / "trained.jsonl"
    assert run.trainer_heartbeat == tmp_path / "trainer" / "heartbeat"
    assert run.orchestrator_heartbeat == tmp_path / "orchestrator" / "heartbeat"
    assert run.stop == tmp_path / "STOP"
    assert run.run_file == tmp_path / "run.json"
    assert run.eval_log == tmp_path / "eval.jsonl"
    assert run.eval_pending == tmp_path / "eval.pending"
    assert run.env_outputs == tmp_path / "envs"
    # the batches are where the file transport writes them, under the name it gives
    assert run.batches == batches_dir(tmp_path) == tmp_path / "batches"
    assert batch_path(tmp_path, 3, 0).parent.parent == run.batches
    assert end_marker_path(tmp_path).parent == run.batches


def test_checkpoints_and_held_batches_are_asked_of_their_owners(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path)
    assert not run.has_checkpoints()
    run.checkpoints.mkdir()
    (run.checkpoints / "notes.txt").write_text("not a checkpoint")
    assert not run.has_checkpoints()
    CheckpointManager(run.checkpoints).path_for(4).write_bytes(b"")
    assert run.has_checkpoints()
    assert run.held_batches(0) == []
    for step in (5, 3):
        path = batch_path(tmp_path, step, 0)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
    batch_path(tmp_path, 9, 1).parent.mkdir(parents=True)
    batch_path(tmp_path, 9, 1).write_bytes(b"x")
    assert run.held_batches(0) == [3, 5]
    assert run.held_batches(1) == [9]


# The names the layout spells, as strings and as rundir's constants.
_NAMES = (
    r"checkpoints|metrics\.jsonl|config\.toml|weights|batches|trainer|logs|plot\.png|run\.json|"
    r"tensorboard|inference|orchestrator|STOP|eval\.jsonl|eval\.pending|envs|\.consumed|\.staging"
)
_CONSTANTS = "|".join(name for name in rundir.__all__ if name.isupper())
# A path joined with one of the run directory's names or constants, or a glob for checkpoint
# files.
_SPELLED = re.compile(rf"""/\s*["']({_NAMES})["'/]|/\s*({_CONSTANTS})\b|glob\(["']step_""")
# the owners: the layout itself, and the file transport's own directory format
_OWNERS = {"rundir.py", "transport/_file_layout.py"}
# Modules whose joins are still to be replaced by `RunDirectory`'s paths: the learning run's,
# being split by concern. Each entry is to be removed as its module is converted, and none
# may be added.
_NOT_YET_CONVERTED = {"config/__init__.py"}


def test_the_unconverted_modules_still_join_by_hand() -> None:
    # an entry whose module no longer joins by hand must leave the list
    for name in _NOT_YET_CONVERTED:
        assert any(_SPELLED.search(line) for line in (SRC / name).read_text().splitlines()), name


@pytest.mark.parametrize(
    "path",
    sorted(
        p for p in SRC.rglob("*.py") if str(p.relative_to(SRC)) not in _OWNERS | _NOT_YET_CONVERTED
    ),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_no_other_module_spells_the_layout(path: Path) -> None:
    found = [
        f"{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _SPELLED.search(line)
    ]
    assert found == []
