"""The in-process trainer: the run's GRPO trainer in worker threads of the orchestrator's
process, reading the run's batch files, training, saving its state, publishing the weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import trio

from ..config import LearnRunConfig
from ..evals import VersionPin
from ..rundir import RunDirectory
from ..transport import EndOfStreamError, FileReceiver
from ..wire import decode
from ._grpo import GRPOTrainer, StepStats
from ._run_io import TrainerLog, append_trainer_record, save_trainer_state
from ._settings import run_directory
from ._weights import publish_weights

__all__ = ["InProcessTrainer"]


def _one_thread() -> None:
    # torch.set_num_threads holds for the thread that calls it: a worker thread that runs
    # torch in a deterministic run sets it for itself (and keeps it: threads are reused)
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@attrs.define(eq=False)
class InProcessTrainer:
    """Trains every step the run's files deliver, until the end of the stream (`run`).

    Each trained step is appended to ``stats`` and reported to ``log``. ``may_train(step)``,
    when given, holds a step until it returns True (polled; the deterministic run keeps the
    trainer in lockstep). ``state``: the saved state it resumes from (the model holds its
    ``model`` already). ``pin``: the run's evals' pin; each step's publication (saved state
    and weights) holds it, so none happens while an eval runs. ``limiter`` is the run's one
    capacity limiter (``publish.threads`` tokens, the orchestrator's too): the file reads, the
    decoding and the training step all borrow it."""

    config: LearnRunConfig
    model: torch.nn.Module
    limiter: trio.CapacityLimiter
    stats: list[StepStats] = attrs.field(factory=list)
    state: dict[str, Any] | None = None
    log: TrainerLog | None = None
    may_train: Callable[[int], bool] | None = None
    #: The run's evals' pin (see `trio_rl.evals.VersionPin`): a publication waits for an eval.
    pin: VersionPin = attrs.field(factory=VersionPin)

    def _train(self, trainer: GRPOTrainer, step: int, micro_batches: Any) -> StepStats:
        if self.config.run.deterministic:
            _one_thread()
        return trainer.train_step(step, micro_batches)

    def _publish(
        self, trainer: GRPOTrainer, step: int, stats: StepStats
    ) -> tuple[StepStats, dict[str, Any]]:
        out = run_directory(self.config)
        # The trainer's state first: a published version is never ahead of the saved state,
        # so a resumed engine's weights (the state's) are never older than a version reported.
        save_trainer_state(out, step, trainer)
        publish_weights(
            RunDirectory(out).weights,
            step,
            trainer.model.state_dict(),
            keep=self.config.checkpoint.weights_keep,
            meta={"step": step},
        )
        return stats, append_trainer_record(out, stats)

    async def run(self) -> None:
        """Train until the end of the stream. On cancellation: a step already taken is
        decoded, trained, saved and acknowledged (shielded) before the cancellation lands;
        nothing else is left running."""
        trainer = GRPOTrainer(self.model, self.config.trainer.to_config())
        start = 1
        if self.state is not None:  # the model already holds state["model"]
            trainer.optimizer.load_state_dict(self.state["optimizer"])
            start = self.state["step"] + 1
        transport = FileReceiver(
            run_directory(self.config),
            0,
            start_step=start,
            delete=True,
            poll_interval=0.002,
            max_poll_interval=0.02,
            limiter=self.limiter,
        )
        async with transport:
            while True:
                try:
                    got = await transport.receive()
                except EndOfStreamError:
                    return  # the source ran dry: every step was shipped
                if self.config.trainer.delay:
                    await trio.sleep(self.config.trainer.delay)
                while self.may_train is not None and not self.may_train(got.step):  # noqa: ASYNC110
                    await trio.sleep(0.002)
                # Decoded, trained, saved and only then acknowledged (deleting the file),
                # shielded: a step taken from the transport is trained exactly once, across
                # stops and crashes (a crash before the ack leaves the file for the resume).
                with trio.CancelScope(shield=True):
                    micro_batches = await trio.to_thread.run_sync(
                        decode, got.data, limiter=self.limiter
                    )
                    trained = await trio.to_thread.run_sync(
                        self._train, trainer, got.step, micro_batches, limiter=self.limiter
                    )
                # The new version waits while an eval runs (the pin): the saved state never
                # moves past the version being evaluated, so a run stopped mid-eval resumes
                # at that version and can redo it. Cancelled while waiting, the step was
                # neither saved nor acknowledged: the resumed trainer trains it again.
                async with self.pin.loading(f"the trainer's publication of step {got.step}"):
                    with trio.CancelScope(shield=True):
                        step_stats, record = await trio.to_thread.run_sync(
                            self._publish, trainer, got.step, trained, limiter=self.limiter
                        )
                        self.stats.append(step_stats)
                        await transport.ack(got.step)
                        if self.log is not None:
                            self.log.add(record)
