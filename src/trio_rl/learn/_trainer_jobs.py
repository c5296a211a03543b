"""The learning run's trainer, from the orchestrator's side (`trainer.mode`): the in-process
trainer in this process's worker threads, or a trainer job (`trio_rl.learn.trainer_job`)
that the run launches under torchrun or that is started by hand (external); the job's log is
polled into the run's `TrainerLog` and its heartbeat watched. At the end, the run waits for
the trainer to report the last shipped step."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from ..config import LearnRunConfig
from ..errors import InvalidArgumentError
from ..evals import VersionPin
from ..orchestrator import Orchestrator
from ..rundir import RunDirectory
from ..transport import free_port_pair
from ._grpo import StepStats
from ._heartbeat import Heartbeat, beat, watch_heartbeat
from ._inprocess import InProcessTrainer
from ._run_io import TrainerLog, read_trainer_log
from ._settings import run_directory

__all__ = ["TrainerSide"]

logger = logging.getLogger("trio_rl.learn")


async def _poll_trainer_log(out: Path, log: TrainerLog, interval: float = 0.05) -> None:
    """Feed ``log`` from the trainer job's ``trainer/stats.jsonl`` (torchrun, external)."""
    seen = 0
    while True:
        records = await trio.to_thread.run_sync(read_trainer_log, out)
        for record in records[seen:]:
            log.add(record)
        seen = max(seen, len(records))
        await trio.sleep(interval)


def trainer_heartbeat(config: LearnRunConfig) -> Heartbeat:
    """The trainer job's heartbeat, as the orchestrator watches it."""
    return Heartbeat(
        RunDirectory(run_directory(config)).trainer_heartbeat,
        config.trainer.connect_timeout,
        name="the trainer job",
        waiting=f"waiting for the trainer job (mode {config.trainer.mode})",
        lost=lambda up: f"the trainer job {'stopped' if up else 'did not start'}: no heartbeat",
        start="`trio-rl trainer CONFIG.toml` (under torchrun for several ranks)",
    )


@attrs.define(eq=False)
class TrainerSide:
    """The run's trainer as ``[trainer] mode`` says, reporting every trained step to ``log``.

    ``trained``: the step the in-process trainer's saved state is at (0: none; ``state``
    holds it); ``model``: the policy model it trains."""

    config: LearnRunConfig
    log: TrainerLog
    model: torch.nn.Module
    limiter: trio.CapacityLimiter
    state: dict[str, Any] | None = None
    trained: int = 0
    #: Seconds a normal end waits for the trainer to report the last shipped step.
    patience: float = 120.0
    steps: list[StepStats] = attrs.field(factory=list)
    done: trio.Event = attrs.field(factory=trio.Event)

    @property
    def mode(self) -> str:
        return str(self.config.trainer.mode)

    def start(
        self, nursery: trio.Nursery, orch: Orchestrator, pin: VersionPin | None = None
    ) -> None:
        """Start the trainer (and, for a job, the log poller and the heartbeats) in
        ``nursery``; ``pin``: the run's evals' pin, which the in-process trainer's
        publications hold (a trainer job publishes on its own: the watcher holds it)."""
        config = self.config
        if self.mode == "inprocess":
            if config.trainer.ranks != 1:
                raise InvalidArgumentError(
                    "the in-process trainer has one rank; use trainer_mode='torchrun'"
                )
            trainer = InProcessTrainer(
                config,
                self.model,
                self.limiter,
                self.steps,
                self.state,
                self.log,
                _lockstep(orch, config.rollout.max_async_level)
                if config.run.deterministic
                else None,
                pin if pin is not None else VersionPin(),
            )
            nursery.start_soon(trainer.run)
            return
        out = run_directory(config)
        nursery.start_soon(_poll_trainer_log, out, self.log)
        if self.mode == "torchrun":
            nursery.start_soon(self._run_torchrun)
        nursery.start_soon(watch_heartbeat, trainer_heartbeat(config))
        nursery.start_soon(beat, RunDirectory(out).orchestrator_heartbeat)

    async def _run_torchrun(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={self.config.trainer.ranks}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port_pair()}",
            "-m",
            "trio_rl.learn.trainer_job",
            "--out",
            str(run_directory(self.config)),
        ]
        try:
            await trio.run_process(cmd, check=True)
        finally:
            self.done.set()

    async def finish(self, last: int, wait: bool) -> None:
        """The run ended after shipping ``last``: wait (`patience`; ``wait``: a normal end,
        not an external job) for the trainer to report it, for a torchrun job to exit and
        for its last lines; then no more reports."""
        if wait:
            await self._wait_for_last_step(last)
        if self.mode == "torchrun":
            with trio.move_on_after(60) as waited:
                await self.done.wait()
            if waited.cancelled_caught:
                logger.warning("the torchrun trainer did not exit within 60 s; stopping it")
            out = run_directory(self.config)
            for record in (await trio.to_thread.run_sync(read_trainer_log, out))[
                len(self.log.steps) :
            ]:
                self.log.add(record)
        self.log.close()

    async def _wait_for_last_step(self, last: int) -> None:
        """Wait for the trainer to report ``last``, the last shipped step, so the final
        weights are that step's; say loudly when it does not."""
        log, timeout = self.log, self.patience
        if last <= self.trained or log.last >= last:
            return
        logger.info("waiting up to %.0f s for the trainer to train step %d", timeout, last)
        if self.config.metrics.console:
            print(f"waiting for the trainer to train the last shipped step {last}", flush=True)
        deadline = trio.current_time() + timeout
        while log.last < last and trio.current_time() < deadline and not log.closed:
            # one line every 10 s with the time left: a trainer that stopped is never a
            # silent wait
            with trio.move_on_at(min(deadline, trio.current_time() + LOG_EVERY)):
                await log.wait_for(last)
            left = deadline - trio.current_time()
            if log.last < last and left > 0:
                logger.warning(
                    "waiting for the trainer to train step %d, the last shipped step "
                    "(trained through %d); giving up in %.0f s",
                    last,
                    max(log.last, self.trained),
                    left,
                )
        if log.last < last:
            message = (
                f"the trainer did not report step {last}, the last shipped step, within "
                f"{timeout:.0f} s: the final weights are those of step "
                f"{max(log.last, self.trained)}, not {last}"
            )
            logger.error("%s", message)
            print(f"WARNING: {message}", file=sys.stderr, flush=True)


#: Seconds between two lines of a wait for the trainer.
LOG_EVERY = 10.0


def _lockstep(orch: Orchestrator, async_level: int) -> Any:
    """Batch ``k`` trains once batch ``k + async_level`` shipped (or the run's last did), so
    batch ``S`` is generated by exactly policy ``S - 1 - async_level``."""

    def may_train(k: int) -> bool:
        final = orch.final_step if orch.final_step is not None else k
        return orch.sink.step > min(k + async_level, final)

    return may_train
