"""The learning run: a tiny model that visibly learns under asynchronous RL, in one process.

Engine (``[inference]``: the policy in-process, a fleet, or a plug-in) -> orchestrator -> file
transport -> GRPO trainer (in-process, in worker threads; or DDP ranks under torchrun) ->
published weights -> weight watcher -> engine. :func:`run_learning` prints the mean reward of
every shipped step and writes ``metrics.jsonl`` and ``plot.png`` into the run directory.

This module is the run's outline; its rooms are modules of their own: what the run derives
from its configuration (`_settings`), its files (`_run_io`), the engine (`_engine`), the
trainer (`_trainer_jobs`, `_inprocess`), the steps' records (`_steps`, `_records`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from ..config import LearnRunConfig
from ..engines import Engine
from ..envs import EpisodeRunner
from ..errors import InvalidArgumentError
from ..evals import RunEvals
from ..orchestrator import Orchestrator, OrchestratorConfig, open_orchestrator
from ..publish import Shipment
from ..rollout import (
    InMemorySource,
    RecordReward,
    RecordRewardFn,
    import_reward,
    open_record_reward,
)
from ..rundir import RunDirectory
from ..samples import Prompt
from ..transport import FileSender
from ._engine import open_engine, weight_loader
from ._episodes import env_function, episode_runner
from ._evals import finish_evals, open_run_evals
from ._grpo import StepStats
from ._policy import Policy
from ._records import Records, write_plot
from ._run_io import (
    TrainerLog,
    earlier_metrics,
    last_trained_step,
    load_trainer_state,
    prepare_run_directory,
)
from ._settings import (
    build_policy,
    build_prompts,
    completion_cap,
    orchestrator_config,
    reward_function,
    run_directory,
    run_json,
)
from ._steps import Display, watch_convergence
from ._trainer_jobs import TrainerSide
from ._verdict import (
    Ending,
    SampleLog,
    equal_rewards_verdict,
    reward_stop_line,
    target_line,
    write_ended,
)
from ._watcher import watch_weights

__all__ = ["LearnResult", "run_learning", "write_plot"]

logger = logging.getLogger("trio_rl.learn")


@attrs.frozen
class LearnResult:
    metrics: list[dict[str, Any]]
    counters: dict[str, int]
    trainer_steps: list[StepStats]
    wall_s: float
    out: Path
    #: Why the run ended: ``steps``, ``time_limit``, ``reward`` (``stop_at_reward``),
    #: ``converged`` (every group had equal rewards for ``converged_after`` batches' worth, at
    #: the task's maximum reward or ``stop_at_reward``), ``collapsed`` (the same, below it: a
    #: settled policy that is partly wrong, GRPO has no signal left), ``no_signal`` (the same,
    #: but the reward scores every differing sample alike, or nothing was trained) or
    #: ``signal`` (the
    #: ``stop`` event of :func:`run_learning` was set).
    stopped: str = "steps"
    #: The checkpoint saved at a stop (``stopped == "signal"``), else None.
    checkpoint: Path | None = None
    #: The last step the trainer trained (and saved, in-process), this run or before.
    trained_through: int = 0
    #: The step this run resumed at (None: a new run).
    resumed_at: int | None = None
    #: The mean reward of the samples that decided a ``converged``, ``collapsed`` or
    #: ``no_signal`` end.
    final_reward: float | None = None
    #: The line that said why the run stopped (None for ``steps`` and ``signal``).
    message: str | None = None
    #: False when ``stop`` was set while the run was still starting (opening the engine,
    #: waiting for a server): it ended at once, with nothing to save.
    started: bool = True


async def run_learning(
    config: LearnRunConfig,
    *,
    resume: bool = True,
    stop: trio.Event | None = None,
    first_step: trio.Event | None = None,
    display: Display | None = None,
    sinks: Display | None = None,
    trainer_timeout: float = 120.0,
    stale_admission: bool = True,
) -> LearnResult:
    """Run the learning run ``config`` describes (``run.out`` set); return its metrics.

    ``resume``: continue the run in ``run.out`` when it has checkpoints (else its checkpoints
    are set aside and a previous run's ``weights/`` and ``batches/`` removed). ``stop``: once
    set, the step in progress is cancelled and the run ends as after its last step
    (``stopped == "signal"``); set before the first step begins, the start just ends
    (``started == False``, nothing saved). ``first_step``: set when the first step begins (from
    then on a ``stop`` has a step to end and a checkpoint to save). ``display`` (with
    ``metrics.console``) shows each step's record instead of the plain line, and is closed at
    the end; ``sinks`` gets every record, in a worker thread. ``trainer_timeout``: seconds a
    normal end waits for the trainer to report the last shipped step. ``stale_admission``: see
    :attr:`OrchestratorConfig.stale_admission`.
    Writes ``run.json``, ``metrics.jsonl``, ``weights/step_<S>/`` and ``plot.png`` into
    ``run.out``. Cancellation closes the engine, the orchestrator, the trainer and the watcher.
    """
    out, begun = run_directory(config), time.perf_counter()
    start = await _Start.prepare(config, resume)
    trainer = start.trainer_side(trainer_timeout)
    shipments_send, shipments = trio.open_memory_channel[Shipment](64)
    orch_config = orchestrator_config(
        config, completion_cap(config, start.policy), stale_admission=stale_admission
    )
    # Until the first step starts, a stop cancels everything at once: the waits of the start
    # (a server that does not answer, a model loading) have nothing to save.
    starting, started = trio.CancelScope(), trio.CancelScope()
    records: Records | None = None
    async with trio.open_nursery() as guard:
        if stop is not None:
            guard.start_soon(_stop_while_starting, stop, starting, started)
        with starting:
            async with (
                _open_run(config, start, orch_config, shipments_send, sinks) as run,
                trio.open_nursery() as nursery,
            ):
                records = run.records(config, trainer, start.limiter, display, sinks)
                records.start(nursery, shipments, begun, start.earlier, start.trained)
                resumed_at = _begin(config, run.orch, start)
                nursery.start_soon(start.watch_weights, run.engine, records.set_version, run.evals)
                trainer.start(nursery, run.orch, None if run.evals is None else run.evals.pin)
                started.cancel()  # from now on a stop ends the step in progress
                if first_step is not None:
                    first_step.set()
                ending = await _ship_steps(config, run.orch, stop, begun, start.samples)
                counters = await _end_run(config, run, trainer, start, ending)
                shipments_send.close()
                await records.drain()
                nursery.cancel_scope.cancel()
        started.cancel()
    wall = time.perf_counter() - begun
    if starting.cancelled_caught:
        if records is not None and display is not None:
            display.close()
        return LearnResult([], {}, [], wall, out, "signal", started=False)
    assert records is not None
    await records.close(start.earlier, wall)
    if ending.message is not None:  # after the last step's line
        _say(config, ending)
    return LearnResult(
        records.metrics,
        counters,
        trainer.steps,
        wall,
        out,
        ending.stopped,
        checkpoint=ending.checkpoint,
        trained_through=max(trainer.log.last, start.trained),
        resumed_at=resumed_at,
        final_reward=ending.final_reward,
        message=ending.message,
    )


@attrs.frozen
class _Run:
    """What a run holds open while it ships its steps."""

    reward: RecordReward | None
    engine: Engine
    orch: Orchestrator
    evals: RunEvals | None
    #: the episodes' generate function, with ``[env]`` (None: single-turn samples)
    runner: EpisodeRunner | None

    def records(
        self,
        config: LearnRunConfig,
        trainer: TrainerSide,
        limiter: trio.CapacityLimiter,
        display: Display | None,
        sinks: Display | None,
    ) -> Records:
        """The records of the run's steps, of what this run holds."""
        return Records(
            config,
            self.orch,
            self.engine,
            self.reward,
            trainer.log,
            limiter,
            display,
            sinks,
            episodes=None if self.runner is None else self.runner.stats,
        )


@asynccontextmanager
async def _open_run(
    config: LearnRunConfig,
    start: _Start,
    orch_config: OrchestratorConfig,
    monitor: trio.MemorySendChannel[Shipment],
    sinks: Display | None,
) -> AsyncIterator[_Run]:
    """Open the run's resources in order (closed in reverse): the reward's workers, the
    sender to the trainer, the engine, the orchestrator, the evals."""
    out = run_directory(config)
    # the reward of every sample, the built-in tasks' as any other, in workers of its own: a
    # call that hangs is killed, and never holds what the run needs to go on or to stop; an
    # episode's environment returns its reward, so a run with [env] starts no reward workers
    reward_cm: contextlib.AbstractAsyncContextManager[RecordReward | None] = (
        open_record_reward(
            start.reward_fn,
            start.policy.decode,
            mode=config.reward.mode,
            workers=config.reward.workers,
            call_timeout=config.reward.timeout,
            failure_budget=config.reward.failure_budget or start.samples_per_step,
            name=f"reward {reward_function(config)}",
        )
        if start.env is None
        else contextlib.nullcontext(None)
    )
    async with (
        reward_cm as reward,
        FileSender(out, config.trainer.ranks, fsync=config.transport.fsync) as sender,
        open_engine(config, start.policy, start.trained) as engine,
    ):
        decode = start.policy.decode
        runner = episode_runner(
            config.env.to_config(),
            start.env,
            engine,
            start.policy,
            orch_config.sampling,
            orch_config.seq_len,
            start.limiter,
        )
        # the runner's task serves its episodes' deadlines while the orchestrator plays them
        episodes_cm: contextlib.AbstractAsyncContextManager[object] = (
            contextlib.nullcontext() if runner is None else runner
        )
        async with (
            episodes_cm,
            open_orchestrator(
                engine,
                InMemorySource(start.prompts, epochs=None),
                sender,
                config=orch_config,
                # an episode's environment returns its reward
                sample_reward=(None if reward is None else start.samples.scoring(reward, decode)),
                generate=None if runner is None else start.samples.playing(runner, decode),
                monitor=monitor,
                limiter=start.limiter,
                checkpoint_dir=RunDirectory(out).checkpoints,
                resume=start.resuming,
            ) as orch,
            open_run_evals(
                config, start.policy, engine, orch, start.limiter, served=start.trained, sinks=sinks
            ) as evals,
        ):
            if orch.admission is not None and reward is not None:
                # samples whose reward call runs slow (a hang, until its timeout) do not hold
                # back new work: they may never arrive
                orch.admission.uncounted = reward.slow_calls
            yield _Run(reward, engine, orch, evals, runner)


async def _end_run(
    config: LearnRunConfig, run: _Run, trainer: TrainerSide, start: _Start, ending: Ending
) -> dict[str, int]:
    """End the run after its last shipped step, whatever ``steps`` said: no rollouts for
    later steps, the trainer told where to stop, the last eval. Returns the run's counters."""
    orch, out = run.orch, run_directory(config)
    last_shipped, counters = orch.sink.step - 1, attrs.asdict(orch.sink.counters)
    # a lockstep trainer may train up to the last shipped step; an external trainer job trains
    # up to it, then exits by itself
    orch.final_step = last_shipped
    # ended.json first: a trainer job reads why the run ended
    await trio.to_thread.run_sync(write_ended, out, last_shipped, ending)
    await trio.to_thread.run_sync(RunDirectory(out).stop.write_text, str(last_shipped))
    normal_end = ending.stopped != "signal" and config.trainer.mode != "external"
    await trainer.finish(last_shipped, wait=normal_end)
    if ending.stopped != "signal":
        # the eval of the last trained version, bounded: cut, never waited for forever
        await finish_evals(run.evals, max(trainer.log.last, start.trained))
    return counters


@attrs.frozen
class _Start:
    """What the run starts from: whether it resumes, the in-process trainer's saved state
    (``trained``: its step), the earlier records, the policy and its prompts, the run's one
    capacity limiter and the reward."""

    config: LearnRunConfig
    resuming: bool
    state: dict[str, Any] | None
    earlier: list[dict[str, Any]]
    policy: Policy
    prompts: list[Prompt]
    limiter: trio.CapacityLimiter
    reward_fn: RecordRewardFn
    #: the last samples the reward scored (the verdict of an end on equal rewards reads them)
    samples: SampleLog
    #: the last step a torchrun or external trainer job logged (``trainer/trained.jsonl``)
    job_trained: int = 0
    #: the environment the run plays (None: single-turn samples scored by ``reward``)
    env: str | None = None

    @property
    def samples_per_step(self) -> int:
        return self.config.rollout.batch_groups * self.config.rollout.group_size

    @property
    def trained(self) -> int:
        return 0 if self.state is None else int(self.state["step"])

    def trainer_side(self, patience: float) -> TrainerSide:
        """The trainer of this run (in-process, torchrun ranks or an external job)."""
        return TrainerSide(
            self.config,
            TrainerLog(),
            self.policy.model,
            self.limiter,
            self.state,
            self.trained,
            patience=patience,
        )

    @classmethod
    async def prepare(cls, config: LearnRunConfig, resume: bool) -> _Start:
        resuming, state, earlier = await _prepare(config, run_directory(config), resume)
        policy = await trio.to_thread.run_sync(build_policy, config)
        if state is not None:
            policy.model.load_state_dict(state["model"])
        prompts = await trio.to_thread.run_sync(build_prompts, config, policy)
        # the run's one capacity limiter: the orchestrator (publisher, sender, checkpoints)
        # and the in-process trainer (reads, decoding, training) borrow it
        limiter = trio.CapacityLimiter(config.publish.threads)
        spec = reward_function(config)
        shape = config.rollout.batch_groups * config.rollout.group_size
        samples = SampleLog(config.run.converged_after * shape)
        reward_fn = import_reward(spec)
        env = env_function(config.env.to_config(), config.rollout.task, config.model.path)
        job_trained = 0
        if resuming and config.trainer.mode != "inprocess":
            job_trained = await trio.to_thread.run_sync(last_trained_step, run_directory(config))
        return cls(
            config,
            resuming,
            state,
            earlier,
            policy,
            prompts,
            limiter,
            reward_fn,
            samples,
            job_trained,
            env,
        )

    async def watch_weights(
        self, engine: Engine, set_version: Any, evals: RunEvals | None = None
    ) -> None:
        """Load every version the trainer publishes into the engine, then count it; with
        ``evals``, evaluate each version an eval is due for before loading another."""
        loader = weight_loader(
            self.config,
            self.config.inference.kind,
            engine,
            self.policy.model,
            self.prompts,
            self.limiter,
        )
        await watch_weights(
            RunDirectory(run_directory(self.config)).weights,
            [loader],
            set_version,
            current=self.trained,
            poll_interval=0.005,
            evals=evals,
        )


async def _prepare(
    config: LearnRunConfig, out: Path, resume: bool
) -> tuple[bool, dict[str, Any] | None, list[dict[str, Any]]]:
    """Whether the run resumes, the in-process trainer's saved state, the earlier records;
    the run directory prepared (a new run clears a previous run's weights and batch files:
    they would be taken for this run's versions and steps)."""
    if config.run.deterministic:
        if config.trainer.mode != "inprocess":
            raise InvalidArgumentError("a deterministic run needs the in-process trainer")
        # one thread: a reduction's order (and so its last bits) must not depend on threads
        torch.set_num_threads(1)
    # a torchrun or external trainer job resumes by itself (its own state and log): the
    # orchestrator resumes from its checkpoint and the watcher catches up with the weights
    resuming = resume and await trio.to_thread.run_sync(RunDirectory(out).has_checkpoints)
    await trio.to_thread.run_sync(prepare_run_directory, out, run_json(config), resuming)
    state = None
    if resuming and config.trainer.mode == "inprocess":
        state = await trio.to_thread.run_sync(load_trainer_state, out)
    earlier = await trio.to_thread.run_sync(earlier_metrics, out) if resuming else []
    return resuming, state, earlier


def _begin(config: LearnRunConfig, orch: Orchestrator, start: _Start) -> int | None:
    """Set the run's last step and its policy version; say how it starts. Returns the step it
    resumed at (None: a new run)."""
    to_ship = config.run.steps
    if config.run.max_steps is not None:
        to_ship = max(0, min(to_ship, config.run.max_steps - orch.step + 1))
    # admission generates nothing for steps after the run's last
    orch.final_step = orch.step + to_ship - 1
    trained, policy = start.trained, start.policy
    if trained > orch.policy_version:
        orch.set_policy_version(trained)  # the engine serves the trainer's saved state
    verbose = config.metrics.console
    if start.resuming and verbose:
        r = orch.restore
        where = (
            f"trainer state of step {trained}"
            if config.trainer.mode == "inprocess"
            else f"the trainer job trained through step {start.job_trained} "
            f"({RunDirectory(run_directory(config)).trained_log.relative_to(run_directory(config))})"
        )
        print(
            f"resumed at step {orch.step}: {where}, "
            f"{0 if r is None else r.queued} queued samples, "
            f"{0 if r is None else len(r.resumed)} open groups continue",
            flush=True,
        )
    if verbose:
        print(
            f"learning run: {policy.description}, "
            f"prompts {config.data.prompts or 'of the task'}, "
            f"{_scored_by(config, start)}, "
            f"{sum(p.numel() for p in policy.model.parameters())} parameters, "
            f"{config.rollout.batch_groups} groups x {config.rollout.group_size} samples per "
            f"step, trainer {config.trainer.mode} x{config.trainer.ranks}, run directory "
            f"{run_directory(config)}",
            flush=True,
        )
    return orch.step if start.resuming else None


def _scored_by(config: LearnRunConfig, start: _Start) -> str:
    if start.env is None:
        return f"reward {reward_function(config)}"
    return f"environment {start.env}"


async def _ship_steps(
    config: LearnRunConfig,
    orch: Orchestrator,
    stop: trio.Event | None,
    begun: float,
    samples: SampleLog,
) -> Ending:
    """Ship the run's steps one at a time until the last, a stop, the time limit, the reward
    target or equal rewards everywhere; a stop saves a checkpoint of what the unfinished step
    collected. Why the run stopped is said once (`trio_rl.learn._verdict`)."""
    run = config.run
    deadline = None if run.time_limit is None else begun + run.time_limit
    rewards: list[float] = []
    ending = Ending()
    assert orch.final_step is not None
    for _ in range(orch.final_step - orch.step + 1):
        if stop is not None and stop.is_set():
            ending.stopped = "signal"
            break
        summary = await _one_step(config, orch, stop)
        if summary is None and stop is not None and stop.is_set():
            ending.stopped = "signal"
            break
        if summary is None:
            # every group had equal rewards for converged_after batches: a deterministic
            # policy (right or not), or a reward that scores different samples alike
            ending = equal_rewards_verdict(samples, config, shipped=len(rewards))
            break
        rewards.extend(r.all.reward_mean or 0.0 for r in summary.records)
        if deadline is not None and time.perf_counter() >= deadline:
            ending.stopped = "time_limit"
            ending.message = f"stopping: run.time_limit ({run.time_limit:g} s) reached"
            break
        window = rewards[-run.stop_window :]
        target = run.stop_at_reward
        if target is not None and len(window) == run.stop_window and min(window) >= target:
            ending = Ending("reward", reward_stop_line(window, config), min(window))
            break
    else:
        # every step shipped: a run with a target says whether it got there
        ending.message = target_line(rewards, config)
    if ending.stopped == "signal":
        # the groups finished since the last shipped step are saved, not regenerated
        ending.checkpoint = await orch.save_checkpoint()
    return ending


def _say(config: LearnRunConfig, ending: Ending) -> None:
    """The line of why the run ended, once: on the console (which the run log copies), or,
    without one, as a log record (a warning for an end that is no success)."""
    assert ending.message is not None
    if config.metrics.console:
        print(ending.message, flush=True)
    elif ending.stopped in ("collapsed", "no_signal") or "not reached" in ending.message:
        logger.warning("%s", ending.message)
    else:
        logger.info("%s", ending.message)


async def _one_step(config: LearnRunConfig, orch: Orchestrator, stop: trio.Event | None) -> Any:
    """Ship one step: its summary, or None when a stop or convergence cancelled it."""
    summary = None
    async with trio.open_nursery() as nursery:
        if stop is not None:
            nursery.start_soon(_cancel_when_set, stop, nursery.cancel_scope)

        async def one() -> None:
            nonlocal summary
            summary = await orch.run(1)
            nursery.cancel_scope.cancel()

        nursery.start_soon(one)
        nursery.start_soon(watch_convergence, orch, config, nursery.cancel_scope)
    return summary


async def _stop_while_starting(
    stop: trio.Event, starting: trio.CancelScope, started: trio.CancelScope
) -> None:
    """Cancel ``starting`` (the whole run) if ``stop`` is set before ``started`` is cancelled
    (the run's first step begins)."""
    with started:
        await stop.wait()
        starting.cancel()


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
