"""The learning run's files, shared by the orchestrator's side (`trio_rl.learn.run`) and the
trainer job (`trio_rl.learn.trainer_job`): the trainer's log of trained steps
(``trainer/stats.jsonl``) and its reader on the loop, the trainer's saved state (one saver, which
fsyncs), a new run's directory, and the metrics records of a run being resumed."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import trio_util

from ..rundir import (
    RunDirectory,
)
from ..sink import CheckpointError
from ._grpo import GRPOTrainer, StepStats

__all__ = [
    "TrainerLog",
    "append_line",
    "append_trainer_record",
    "earlier_metrics",
    "last_trained_step",
    "load_trainer_state",
    "prepare_run_directory",
    "read_trainer_log",
    "save_trainer_state",
    "trainer_record",
    "write_atomic",
]


class TrainerLog:
    """The steps the trainer reported trained (its ``trainer/stats.jsonl`` lines), on the loop."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}
        self.closed = False
        # counts the changes: a waiter's condition is checked again at each one
        self._changes: trio_util.AsyncValue[int] = trio_util.AsyncValue(0)

    @property
    def last(self) -> int:
        return max(self.steps, default=0)

    def add(self, record: dict[str, Any]) -> None:
        self.steps[int(record["step"])] = record
        self._changes.value += 1

    def close(self) -> None:
        """No more reports: waiters get what there is."""
        self.closed = True
        self._changes.value += 1

    async def wait_for(self, step: int) -> dict[str, Any] | None:
        """The trainer's record of ``step`` once reported (None once closed, or when a later
        step was reported without it)."""

        def settled(_: int) -> bool:
            return step in self.steps or self.closed or self.last >= step

        await self._changes.wait_value(settled)
        return self.steps.get(step)


def trainer_record(stats: StepStats) -> dict[str, Any]:
    """The line the trainer writes to ``trainer/stats.jsonl`` for a trained step."""
    return {"step": stats.step, **stats.metrics(), "loss_tokens": stats.loss_tokens}


def append_trainer_record(out: Path, stats: StepStats) -> dict[str, Any]:
    record = trainer_record(stats)
    path = RunDirectory(out).trainer_stats
    path.parent.mkdir(parents=True, exist_ok=True)
    append_line(path, json.dumps(record) + "\n")
    return record


def read_trainer_log(out: Path) -> list[dict[str, Any]]:
    """The trainer's records (a torn last line is dropped)."""
    return [
        r for r in _read_jsonl(RunDirectory(out).trainer_stats) if isinstance(r.get("step"), int)
    ]


def last_trained_step(out: Path) -> int:
    """The last step a torchrun or external trainer job logged in ``trainer/trained.jsonl``
    (0 for none)."""
    steps = [r["step"] for r in _read_jsonl(RunDirectory(out).trained_log)]
    return max((s for s in steps if isinstance(s, int)), default=0)


def earlier_metrics(out: Path) -> list[dict[str, Any]]:
    """The records of the run being resumed (a torn last line is dropped)."""
    return _read_jsonl(RunDirectory(out).metrics)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if isinstance(record, dict):
            records.append(record)
    return records


def append_line(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line)


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part (temp file, replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_trainer_state(out: Path, step: int, trainer: GRPOTrainer, log: str | None = None) -> None:
    """Save the trainer's state after ``step`` (model, optimizer; ``log``: the step's line of
    the trainer job's log, for a job killed before it logged it), fsynced, then replaced: a
    crash leaves the previous state or this one."""
    path = RunDirectory(out).trainer_state
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    state: dict[str, Any] = {
        "step": step,
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
    }
    if log is not None:
        state["log"] = log
    torch.save(state, tmp)
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_trainer_state(out: Path) -> dict[str, Any] | None:
    """The trainer's last saved state, or None; a damaged file is a `CheckpointError` naming
    it."""
    path = RunDirectory(out).trainer_state
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step: a non-negative integer expected, got {step!r}")
        if "model" not in state or "optimizer" not in state:
            raise ValueError("the model or the optimizer state is missing")
    except Exception as exc:  # torch.load raises many types for a damaged file
        raise CheckpointError(str(path), f"the trainer state is damaged: {exc}") from exc
    return dict(state)


def prepare_run_directory(out: Path, run_json: dict[str, Any], resuming: bool) -> None:
    """Write ``run.json`` and clear ``STOP``; a new run (not ``resuming``) also clears an
    earlier run's weights and batch files, which would be taken for this run's versions and
    steps, and sets its trainer state and log aside (its checkpoints the orchestrator sets
    aside: nothing is deleted that a run cannot make again)."""
    out.mkdir(parents=True, exist_ok=True)
    run = RunDirectory(out)
    run.stop.unlink(missing_ok=True)
    run.run_file.write_text(json.dumps(run_json, indent=1))
    if resuming:
        return
    for directory in (run.weights, run.batches):
        shutil.rmtree(directory, ignore_errors=True)
    for path in (run.trainer_state, run.trained_log):
        if path.exists():
            path.replace(path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    run.trainer_stats.unlink(missing_ok=True)
    run.metrics.write_text("")
