"""`RunDirectory`: the one owner of a run directory's layout.

A run (``trio-rl run``, ``trio-rl simulate``, the trainer job) writes into one directory, and
``inspect``, ``plot`` and ``watch`` read it back. Every name in it is spelled here, once::

    RUN_DIR/
        config.toml          the effective configuration (`config`)
        metrics.jsonl        one record per shipped step (`metrics`)
        plot.png             the run's figure (`plot`)
        logs/run.log         the run's log (`run_log`)
        checkpoints/         the orchestrator's checkpoints (`checkpoints`, `has_checkpoints`)
        batches/             the file transport's batches (`batches`, `held_batches`)
        weights/             the published policy versions (`weights`)
        trainer/             the trainer's state and logs:
            state.pt             the in-process trainer's model and optimizer (`trainer_state`)
            stats.jsonl          one record per trained step (`trainer_stats`)
            trained.jsonl        the trainer job's trained steps (`trained_log`)
            heartbeat            the trainer job's heartbeat (`trainer_heartbeat`)
            rank_<R>.jsonl       ``trio-rl simulate``'s rank R (`trainer_log`)
            rank_<R>.lock        the lock of the trainer job's rank R (`trainer_lock`)
        orchestrator/heartbeat   the orchestrator's heartbeat (`orchestrator_heartbeat`)
        STOP                 the last shipped step, for the trainer job (`stop`)
        ended.json           how the learning run ended: its last step, why it stopped (`ended`)
        run.json             the learning run's configuration, for its trainer job (`run_file`)
        eval.jsonl           one record per evaluation (`eval_log`)
        eval.pending         the evaluation in progress, if any (`eval_pending`)
        envs/                what the environments write, one directory each (`env_outputs`)
        tensorboard/         the TensorBoard sink's files (`tensorboard`)
        inference/           the inference servers' logs (`inference_logs`)

What lies inside ``checkpoints/`` and ``batches/`` belongs to their owners (the checkpoint
manager of `trio_rl.sink`, the file transport of `trio_rl.transport`, which also names its
directory), which this asks. Every other module takes its paths from here instead of joining a
name to the run directory (``tests/package/test_package_rundir.py`` greps for such joins).
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from .sink import CheckpointManager
from .transport import batches_dir, held_steps

__all__ = [
    "ENDED_FILE",
    "ENV_OUTPUTS",
    "EVAL_LOG",
    "EVAL_PENDING_FILE",
    "HEARTBEAT_FILE",
    "ORCHESTRATOR_HEARTBEAT",
    "RUN_FILE",
    "RUN_LOG",
    "STOP_FILE",
    "STORED_FILE",
    "TRAINED_LOG",
    "TRAINER_LOG",
    "TRAINER_STATE",
    "RunDirectory",
]

#: The effective configuration of a run.
STORED_FILE = "config.toml"
#: One metrics record per shipped step.
METRICS_FILE = "metrics.jsonl"
#: The run's log.
RUN_LOG = "logs/run.log"
#: The learning run's configuration, which its trainer job reads.
RUN_FILE = "run.json"
#: Written at the end of a learning run with the last shipped step: the trainer job stops there.
STOP_FILE = "STOP"
#: How the learning run ended (its last shipped step, why it stopped, the line that said so).
ENDED_FILE = "ended.json"
#: The in-process trainer's model and optimizer after its last step (``torch.save``).
TRAINER_STATE = "trainer/state.pt"
#: The trainer job's log of trained steps and its heartbeat (see `trio_rl.learn.trainer_job`).
TRAINED_LOG = "trainer/trained.jsonl"
HEARTBEAT_FILE = "trainer/heartbeat"
#: The orchestrator's heartbeat, which a trainer job watches the same way.
ORCHESTRATOR_HEARTBEAT = "orchestrator/heartbeat"
#: The trainer's own record: one JSON line per trained step (its ``trainer/...`` metrics).
TRAINER_LOG = "trainer/stats.jsonl"
#: One record per evaluation of the policy (`trio_rl.evals`), and the marker of an evaluation
#: in progress.
EVAL_LOG = "eval.jsonl"
EVAL_PENDING_FILE = "eval.pending"
#: What the environments write, one directory per environment.
ENV_OUTPUTS = "envs"


@attrs.frozen
class RunDirectory:
    """A run directory: every path of its layout (see the module's documentation)."""

    root: Path = attrs.field(converter=Path)

    @classmethod
    def of(cls, path: str | os.PathLike[str] | RunDirectory) -> RunDirectory:
        return path if isinstance(path, RunDirectory) else cls(Path(path))

    @property
    def config(self) -> Path:
        return self.root / STORED_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def plot(self) -> Path:
        return self.root / "plot.png"

    @property
    def run_log(self) -> Path:
        return self.root / RUN_LOG

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def batches(self) -> Path:
        return batches_dir(self.root)

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def trainer(self) -> Path:
        return self.root / "trainer"

    @property
    def trainer_state(self) -> Path:
        return self.root / TRAINER_STATE

    @property
    def trainer_stats(self) -> Path:
        return self.root / TRAINER_LOG

    @property
    def trained_log(self) -> Path:
        return self.root / TRAINED_LOG

    @property
    def trainer_heartbeat(self) -> Path:
        return self.root / HEARTBEAT_FILE

    @property
    def orchestrator_heartbeat(self) -> Path:
        return self.root / ORCHESTRATOR_HEARTBEAT

    @property
    def stop(self) -> Path:
        return self.root / STOP_FILE

    @property
    def ended(self) -> Path:
        return self.root / ENDED_FILE

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def eval_log(self) -> Path:
        return self.root / EVAL_LOG

    @property
    def eval_pending(self) -> Path:
        return self.root / EVAL_PENDING_FILE

    @property
    def env_outputs(self) -> Path:
        return self.root / ENV_OUTPUTS

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def inference_logs(self) -> Path:
        return self.root / "inference"

    def trainer_log(self, rank: int) -> Path:
        """``trio-rl simulate``'s trainer rank ``rank``: one line per trained step."""
        return self.trainer / f"rank_{rank}.jsonl"

    def trainer_lock(self, rank: int) -> Path:
        """The lock a trainer job's rank ``rank`` holds while it runs."""
        return self.trainer / f"rank_{rank}.lock"

    def has_checkpoints(self) -> bool:
        """Whether ``checkpoints/`` holds a checkpoint (a run to resume)."""
        return bool(CheckpointManager(self.checkpoints).list_checkpoints())

    def held_batches(self, rank: int) -> list[int]:
        """The steps whose batch file for ``rank`` is still in ``batches/``."""
        return held_steps(self.root, rank)
