"""The learning run: a tiny model that visibly learns under asynchronous RL, in one process.

Engine (:class:`~trio_rl.engines.TorchEngine`) -> orchestrator -> file transport -> GRPO
trainer (in-process, in worker threads; or DDP ranks under torchrun) -> published weights ->
weight watcher -> engine. :func:`run_learning` prints the mean reward of every shipped step and
writes ``metrics.jsonl`` and ``plot.png`` into the run directory.

Why this module is over 600 lines: it is the whole learning run, whose parts share one
`LearnConfig` and one run directory: the config, the in-process trainer's loop and its saved
state, the torchrun and external trainer jobs' start, heartbeat and end, and `run_learning`,
which opens them together. The model, the task, the GRPO trainer, the weights and the watcher
are modules of their own.
"""

from __future__ import annotations

import copy
import enum
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import torch
import trio
import trio_util

from .._validation import at_least, one_of
from ..config._deploy import DataSection, ModelSection, RewardSection
from ..config._schema import Inference, LearnSink
from ..engines import EngineFleet, SamplingParams, TorchEngine, open_inference
from ..errors import InvalidArgumentError
from ..orchestrator import Orchestrator, OrchestratorConfig, open_orchestrator
from ..orchestrator._config import check_sink_fits_step
from ..publish import Shipment, release_containers, step_record
from ..rollout import (
    FailurePolicy,
    InMemorySource,
    RolloutConfig,
    import_reward,
    open_record_reward,
    read_records,
)
from ..rundir import (
    HEARTBEAT_FILE,
    METRICS_FILE,
    ORCHESTRATOR_HEARTBEAT,
    RUN_FILE,
    STOP_FILE,
    TRAINED_LOG,
    TRAINER_LOG,
    TRAINER_STATE,
    RunDirectory,
)
from ..samples import PolicyVersion, Prompt
from ..train import CheckpointConfig, CheckpointError, PruneMode, ScoringConfig, SinkConfig
from ..trainer import TrainerConfig
from ..transport import (
    EndOfStreamError,
    FileReceiver,
    FileSender,
    TransportTimeoutError,
    free_port_pair,
)
from ..wire import decode
from ._logprob_check import LogprobCheck
from ._model import CharTransformer
from ._policy import Policy, load_policy, record_prompts
from ._task import TASKS, Tokenizer
from ._trainer import TRAINER_KEYS, GRPOTrainer, StepStats
from ._watcher import WeightLoader, watch_weights
from ._weights import latest_weights, publish_weights
from .tasks import task_records

__all__ = [
    "LearnConfig",
    "LearnResult",
    "build_model",
    "orchestrator_config",
    "run_learning",
    "write_plot",
]

logger = logging.getLogger("trio_rl.learn")


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
    path = out / TRAINER_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def read_trainer_log(out: Path) -> list[dict[str, Any]]:
    """The trainer's records (a torn last line is dropped)."""
    try:
        lines = (out / TRAINER_LOG).read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


@attrs.frozen
class LearnConfig:
    """A learning run. ``trainer_mode``: ``"inprocess"`` trains in this process (worker
    threads); ``"torchrun"`` launches ``torchrun --nproc_per_node=ranks -m
    trio_rl.learn.trainer_main``; ``"external"`` expects that job to be started separately."""

    out: Path = attrs.field(converter=Path)
    task: str = attrs.field(default="repeat", validator=one_of(TASKS))
    steps: int = attrs.field(default=200, validator=at_least(1))
    #: The run's last step, a total across resumes: this invocation ships ``steps`` more but
    #: never past it (counted from the step the orchestrator resumes at, its checkpoint's).
    max_steps: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(at_least(1))
    )
    batch_groups: int = attrs.field(default=8, validator=at_least(1))
    group_size: int = attrs.field(default=16, validator=at_least(2))
    seed: int = 0
    temperature: float = 1.0
    max_async_level: int = attrs.field(default=1, validator=at_least(0))
    #: How the rollouts are driven. An unset ``max_groups_in_flight`` is ``batch_groups`` here
    #: (the orchestrator's default is twice that); ``routing_keys`` (by default ``group``, as
    #: ``[inference] routing_keys``) applies with an inference fleet (``inference``), the
    #: in-process engine being one server.
    rollout: RolloutConfig = attrs.field(factory=lambda: RolloutConfig(routing_keys="group"))
    #: The orchestrator's checkpoints (``checkpoints/`` in ``out``).
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)
    #: Staleness-aware admission (see :attr:`OrchestratorConfig.stale_admission`).
    stale_admission: bool = True
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)
    d_model: int = 64
    n_layers: int = 3
    #: Seconds the in-process trainer waits after each step before publishing (forces staleness).
    trainer_delay: float = 0.0
    trainer_mode: Literal["inprocess", "torchrun", "external"] = "inprocess"
    ranks: int = attrs.field(default=1, validator=at_least(1))
    weights_keep: int = attrs.field(default=3, validator=at_least(1))
    #: Stop after this many seconds even if ``steps`` were not all shipped.
    time_limit: float | None = None
    #: Stop once the mean reward of ``stop_window`` consecutive steps reaches this.
    stop_at_reward: float | None = None
    stop_window: int = 5
    #: End the run once this many batches' worth of samples in a row were pruned (equal rewards
    #: in every group) without a step shipping: GRPO has no signal left, nothing would ship.
    converged_after: int = attrs.field(default=8, validator=at_least(1))
    prompts: int = 4096
    verbose: bool = True
    plot: bool = True
    #: Worker threads the run's one capacity limiter lends: the orchestrator's (finalizing,
    #: sending, checkpoints) and the in-process trainer's (reads, decoding, training).
    threads: int = attrs.field(default=4, validator=at_least(1))
    #: fsync every batch file.
    fsync: bool = False
    #: Continue the run in ``out`` when it has checkpoints, whichever the trainer mode (a
    #: torchrun or external trainer job resumes after its own saved step); False moves its
    #: checkpoints aside and starts over.
    resume: bool = True
    #: ``[model]``, ``[data]`` and ``[reward]`` of the configuration, as they are.
    model: ModelSection = attrs.field(factory=ModelSection)
    data: DataSection = attrs.field(factory=DataSection)
    reward: RewardSection = attrs.field(factory=RewardSection)
    #: ``[inference]``: an inference fleet (servers at ``urls``, or ``launch`` vLLM servers of
    #: ``model.path``) instead of the in-process engine.
    inference: Inference = attrs.field(factory=Inference)
    #: Seconds to wait for a torchrun or external trainer job's ready file before failing.
    connect_timeout: float = 300.0
    #: Reproducible by seed: the in-process trainer in lockstep with the rollouts (one group at
    #: a time, each step generated with exactly policy ``S - 1 - max_async_level``), torch on one
    #: thread; the same seed gives the same rewards bit for bit (docs/learning.md).
    deterministic: bool = False
    #: Seconds a normal end waits for the trainer to report the last shipped step.
    trainer_timeout: float = attrs.field(default=120.0, validator=at_least(0))
    #: The train sink's config (the staleness limit and rule, pruning, scoring); it cuts
    #: ``batch_groups x group_size`` samples per batch and stamps ``temperature``, the
    #: sampling temperature, on every trained token. By default that of ``trio-rl run``'s
    #: ``[sink]`` defaults (``trio_rl.config``'s ``LearnSink``).
    sink: SinkConfig = attrs.field(
        # max(1, ...): a bad batch_groups is reported by its own check, which attrs runs
        # after every default is made
        default=attrs.Factory(
            lambda self: LearnSink().to_config(
                batch_size=max(1, self.batch_groups * self.group_size),
                scoring_temperature=self.temperature,
            ),
            takes_self=True,
        )
    )

    @sink.validator
    def _check_sink(self, _: attrs.Attribute[SinkConfig], sink: SinkConfig) -> None:
        check_sink_fits_step("LearnConfig", self.batch_groups, self.group_size, sink)
        check_stamped_temperature("LearnConfig", self.temperature, sink)

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(
            self, value_serializer=lambda _, __, v: v.value if isinstance(v, enum.Enum) else v
        )
        d["out"] = str(self.out)
        return d

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LearnConfig:
        """The configuration :meth:`to_json` wrote."""
        raw = dict(raw)
        raw["trainer"] = TrainerConfig(
            **{**raw["trainer"], "betas": tuple(raw["trainer"]["betas"])}
        )
        if "rollout" in raw:
            rollout = dict(raw["rollout"])
            rollout["failure"] = FailurePolicy(**rollout["failure"])
            raw["rollout"] = RolloutConfig(**rollout)
        if "checkpoint" in raw:
            raw["checkpoint"] = CheckpointConfig(**raw["checkpoint"])
        if "sink" in raw:
            sink = dict(raw["sink"])
            sink["prune"] = PruneMode(sink["prune"])
            sink["scoring"] = ScoringConfig(**sink["scoring"])
            raw["sink"] = SinkConfig(**sink)
        for name, section in (
            ("model", ModelSection),
            ("data", DataSection),
            ("reward", RewardSection),
            ("inference", Inference),
        ):
            if name in raw:
                raw[name] = section(**raw[name])
        if "inference" in raw:
            raw["inference"] = attrs.evolve(
                raw["inference"],
                urls=tuple(raw["inference"].urls),
                vllm_args=tuple(raw["inference"].vllm_args),
            )
        return cls(**raw)

    @property
    def reward_function(self) -> str:
        """``[reward] function``, or the built-in task's (``trio_rl.learn.tasks:<task>``)."""
        return self.reward.function or f"trio_rl.learn.tasks:{self.task}"


def check_stamped_temperature(owner: str, temperature: float, sink: SinkConfig) -> None:
    """The sink stamps ``temperature``, the one the run samples at, on every trained token,
    else `InvalidArgumentError` naming ``owner``: the trainer scores each token at its stamped
    temperature, and a token sampled at another would give a wrong importance ratio and KL."""
    scoring = sink.scoring
    if scoring.temperature != temperature:
        raise InvalidArgumentError(
            f"{owner}.sink.scoring.temperature is {scoring.temperature:g}, but the run samples "
            f"at temperature {temperature:g} ({owner}.temperature): the trainer would score "
            "the tokens at another temperature than they were sampled at"
        )
    other = {env: t for env, t in scoring.env_temperatures.items() if t != temperature}
    if other:
        raise InvalidArgumentError(
            f"{owner}.sink.scoring.env_temperatures stamps {other}, but the run samples every "
            f"env at temperature {temperature:g} ({owner}.temperature)"
        )


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
    #: deterministic policy that is partly wrong, GRPO has no signal left) or ``signal`` (the
    #: ``stop`` event of :func:`run_learning` was set).
    stopped: str = "steps"
    #: The checkpoint saved at a stop (``stopped == "signal"``, in-process trainer), else None.
    checkpoint: Path | None = None
    #: The last step the trainer trained (and saved, in-process), this run or before.
    trained_through: int = 0
    #: The step this run resumed at (None: a new run).
    resumed_at: int | None = None
    #: The mean reward of the groups scored since the last shipped step, when the run
    #: ``converged`` or ``collapsed``.
    final_reward: float | None = None


def build_model(config: LearnConfig) -> tuple[CharTransformer, Tokenizer]:
    """The task's initial character model (seeded by ``config.seed``: every process builds the
    same one) and its tokenizer; :func:`build_policy` is the run's policy, whichever model."""
    policy = load_policy(
        model_path=None,
        task=config.task,
        seed=config.seed,
        d_model=config.d_model,
        n_layers=config.n_layers,
    )
    assert isinstance(policy.model, CharTransformer)
    return policy.model, TASKS[config.task].tokenizer


def build_policy(config: LearnConfig) -> Policy:
    """The run's initial policy: ``[model] path`` loaded with transformers, or the task's
    character model (seeded by ``config.seed``: every process builds the same one)."""
    return load_policy(
        model_path=config.model.path,
        task=config.task,
        seed=config.seed,
        d_model=config.d_model,
        n_layers=config.n_layers,
    )


def completion_cap(config: LearnConfig, policy: Policy) -> int:
    """``max_tokens`` of every sample: ``[data] max_tokens`` with a data file or a model
    directory, else the built-in task's longest answer plus ``<eos>``."""
    if config.data.prompts is not None or config.model.path is not None:
        return config.data.max_tokens
    return policy.max_tokens


def build_prompts(config: LearnConfig, policy: Policy) -> list[Prompt]:
    """The run's prompts: the records of ``[data] prompts``, or ``config.prompts`` records of
    the built-in task; each record is its prompt's label (what the reward gets). Blocking."""
    if config.data.prompts is not None:
        records = read_records(config.data.prompts)
        where = config.data.prompts
    else:
        records = task_records(config.task, config.prompts, config.seed)
        where = f"task {config.task!r}"
    return record_prompts(records, policy, where, completion_cap(config, policy))


def _p95(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


async def _probe_loop_lag(lags: list[float], interval: float = 0.005) -> None:
    while True:
        start = trio.current_time()
        await trio.sleep(interval)
        lags.append(trio.current_time() - start - interval)


def _one_thread() -> None:
    # torch.set_num_threads holds for the thread that calls it: a worker thread that runs
    # torch in a deterministic run sets it for itself (and keeps it: threads are reused)
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _train_and_publish(
    trainer: GRPOTrainer,
    step: int,
    micro_batches: Any,
    weights: Path,
    keep: int,
    deterministic: bool = False,
) -> tuple[StepStats, dict[str, Any]]:
    if deterministic:
        _one_thread()
    stats = trainer.train_step(step, micro_batches)
    # The trainer's state first: a published version is never ahead of the saved state, so a
    # resumed engine's weights (the state's) are never older than a version already reported.
    _save_trainer_state(weights.parent, step, trainer)
    publish_weights(weights, step, trainer.model.state_dict(), keep=keep, meta={"step": step})
    return stats, append_trainer_record(weights.parent, stats)


def _save_trainer_state(out: Path, step: int, trainer: GRPOTrainer) -> None:
    path = out / TRAINER_STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    state = {
        "step": step,
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
    }
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_trainer_state(out: Path) -> dict[str, Any] | None:
    """The in-process trainer's last saved state, or None; a damaged file is a
    `CheckpointError` naming it."""
    path = out / TRAINER_STATE
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


def _resumable(out: Path, config: LearnConfig) -> bool:
    # a torchrun or external trainer job resumes by itself (its own state and log): the
    # orchestrator resumes from its checkpoint and the watcher catches up with the weights
    return config.resume and RunDirectory(out).has_checkpoints()


async def _train_inprocess(
    config: LearnConfig,
    model: torch.nn.Module,
    stats: list[StepStats],
    state: dict[str, Any] | None = None,
    *,
    limiter: trio.CapacityLimiter,
    log: TrainerLog | None = None,
    may_train: Callable[[int], bool] | None = None,
) -> None:
    """Train every step the run's files deliver, until the end of the stream.

    Each trained step is reported to ``log``. ``may_train(step)``, when given, holds a step
    until it returns True (polled; the deterministic run keeps the trainer in lockstep).

    ``limiter`` is the run's one capacity limiter (``config.threads`` tokens, the
    orchestrator's too): the file reads, the decoding and the training step all borrow it.
    On cancellation: a step already taken is decoded, trained, saved and acknowledged
    (shielded) before the cancellation lands; nothing else is left running.
    """
    trainer = GRPOTrainer(model, config.trainer)
    start = 1
    if state is not None:  # the model already holds state["model"]
        trainer.optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    transport = FileReceiver(
        config.out,
        0,
        start_step=start,
        delete=True,
        poll_interval=0.002,
        max_poll_interval=0.02,
        limiter=limiter,
    )
    async with transport:
        while True:
            try:
                got = await transport.receive()
            except EndOfStreamError:
                return  # the source ran dry: every step was shipped
            if config.trainer_delay:
                await trio.sleep(config.trainer_delay)
            while may_train is not None and not may_train(got.step):  # noqa: ASYNC110
                await trio.sleep(0.002)
            # Decoded, trained, saved and only then acknowledged (deleting the file), shielded:
            # a step taken from the transport is trained exactly once, across stops and
            # crashes (a crash before the ack leaves the file for the resumed trainer).
            with trio.CancelScope(shield=True):
                micro_batches = await trio.to_thread.run_sync(decode, got.data, limiter=limiter)
                step_stats, record = await trio.to_thread.run_sync(
                    _train_and_publish,
                    trainer,
                    got.step,
                    micro_batches,
                    RunDirectory(config.out).weights,
                    config.weights_keep,
                    config.deterministic,
                    limiter=limiter,
                )
                stats.append(step_stats)
                await transport.ack(got.step)
                if log is not None:
                    log.add(record)


async def _run_torchrun(config: LearnConfig, done: trio.Event) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={config.ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port_pair()}",
        "-m",
        "trio_rl.learn.trainer_main",
        "--out",
        str(config.out),
    ]
    try:
        await trio.run_process(cmd, check=True)
    finally:
        done.set()


async def _poll_trainer_log(out: Path, log: TrainerLog, interval: float = 0.05) -> None:
    """Feed ``log`` from the trainer job's ``trainer/stats.jsonl`` (torchrun, external)."""
    seen = 0
    while True:
        records = await trio.to_thread.run_sync(read_trainer_log, out)
        for record in records[seen:]:
            log.add(record)
        seen = max(seen, len(records))
        await trio.sleep(interval)


async def _watch_convergence(
    orch: Orchestrator, config: LearnConfig, scope: trio.CancelScope
) -> None:
    """Cancel ``scope`` when ``converged_after`` batches' worth of samples were pruned (every
    group had equal rewards: the policy is deterministic on every prompt)."""
    start = orch.sink.counters.pruned
    limit = config.converged_after * config.batch_groups * config.group_size
    while orch.sink.counters.pruned - start < limit:  # noqa: ASYNC110 - the sink has no event
        await trio.sleep(0.05)
    scope.cancel()


def _read_heartbeat(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


async def _watch_trainer(config: LearnConfig, log_every: float = 10.0) -> None:
    """Fail the run when the trainer job has not beaten its heartbeat for
    ``config.connect_timeout`` seconds: never started, or stopped and not restarted. A
    heartbeat left by a job that is gone does not count: only a change does."""
    path = config.out / HEARTBEAT_FILE
    timeout = config.connect_timeout
    last = await trio.to_thread.run_sync(_read_heartbeat, path)
    connected = False
    changed = trio.current_time()
    # logged every `log_every` s, and at least once before a short deadline
    log_every = min(log_every, config.connect_timeout / 2)
    next_log = changed + log_every
    while True:
        await trio.sleep(0.25)
        now = trio.current_time()
        beat = await trio.to_thread.run_sync(_read_heartbeat, path)
        if beat is not None and beat != last:
            if not connected:
                logger.info("the trainer job is up (%s)", path)
            connected, last, changed, next_log = True, beat, now, now + log_every
            continue
        if now - changed >= timeout:
            what = "did not start" if not connected else "stopped"
            raise TransportTimeoutError(
                f"the trainer job {what}: no heartbeat in {path} for {timeout:g} s "
                f"(trainer.connect_timeout); start it with `trio-rl trainer CONFIG.toml` "
                "(under torchrun for several ranks) on a machine that sees the run directory"
            )
        if now >= next_log:
            logger.warning(
                "waiting for the trainer job (mode %s): no heartbeat in %s for %.0f s; "
                "failing in %.0f s (trainer.connect_timeout)",
                config.trainer_mode,
                path,
                now - changed,
                timeout - (now - changed),
            )
            next_log = now + log_every


async def beat(path: Path, interval: float = 1.0) -> None:
    """Rewrite ``path`` with a new counter every ``interval`` seconds until cancelled: the
    other side of the run directory watches it change."""
    count = 0
    while True:
        count += 1
        text = json.dumps({"beat": count, "pid": os.getpid()})
        await trio.to_thread.run_sync(_write_atomic, path, text)
        await trio.sleep(interval)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _percent(value: float | None) -> str:
    return "  -" if value is None else f"{value * 100:3.0f}%"


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _record(
    shipment: Shipment, lags: list[float], started: float, last_wall: float, version: int
) -> dict[str, Any]:
    # the standard record, as `trio-rl simulate` writes it; queue depth, open groups and the
    # engine's occupancy are added by the caller once it has read them
    wall = time.perf_counter() - started
    return step_record(
        shipment.record,
        wall_s=wall,
        interval_s=wall - last_wall,
        loop_lag_p95_ms=round(_p95(lags) * 1e3, 3),
        policy_version=version,
    )


class Display(Protocol):
    """Shows each step's record (e.g. :class:`trio_rl.tools.console.ConsoleDisplay`)."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def orchestrator_config(config: LearnConfig, max_tokens: int) -> OrchestratorConfig:
    """The :class:`OrchestratorConfig` of the learning run ``config``, its completions capped
    at ``max_tokens`` (:func:`completion_cap`)."""
    rollout = config.rollout
    if rollout.max_groups_in_flight is None:
        rollout = attrs.evolve(rollout, max_groups_in_flight=config.batch_groups)
    if not fleet_wanted(config):
        rollout = attrs.evolve(rollout, routing_keys="none")
    return OrchestratorConfig(
        batch_groups=config.batch_groups,
        group_size=config.group_size,
        rollout=rollout,
        sink=config.sink,
        checkpoint=config.checkpoint,
        max_async_level=config.max_async_level,
        stale_admission=config.stale_admission,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=config.temperature),
        seed=config.seed,
        seq_len=1024,
        lockstep=config.deterministic,
    )


def fleet_wanted(config: LearnConfig) -> bool:
    """Whether ``[inference]`` asks for an inference fleet (else the in-process engine)."""
    return bool(config.inference.urls or config.inference.launch)


def _weight_loader(
    config: LearnConfig,
    engine: TorchEngine | EngineFleet,
    model: torch.nn.Module,
    prompts: list[Prompt],
    limiter: trio.CapacityLimiter,
) -> WeightLoader:
    """The watcher's loader: the engine, or with ``[inference] check_logprobs`` the fleet
    checked against a copy of the policy model after every reload."""
    if not isinstance(engine, EngineFleet) or not config.inference.check_logprobs:
        return engine

    def report(line: str) -> None:
        logger.info("%s", line)
        if config.verbose:
            print(line, flush=True)

    return LogprobCheck(
        engine,
        copy.deepcopy(model).eval(),
        [p.tokens for p in prompts[: config.inference.check_logprobs]],
        max_tokens=config.data.max_tokens,
        limiter=limiter,
        report=report,
    )


@asynccontextmanager
async def _open_engine(
    config: LearnConfig, engine_model: torch.nn.Module, policy: Policy, trained: int
) -> AsyncIterator[TorchEngine | EngineFleet]:
    """The run's engine: the inference fleet ``[inference]`` describes (it serves
    ``[model] path``; a resumed run's servers first load the trainer's last published
    weights), or the policy served in-process by :class:`TorchEngine`."""
    if not fleet_wanted(config):
        async with TorchEngine.open(
            engine_model,
            eos_token_id=policy.eos_token_id,
            max_len=policy.max_len,
            limiter=trio.CapacityLimiter(1),
            seed=config.seed,
            policy_version=trained,
            # deterministic: a group's rows must always decode as one batch (one generator)
            gather_window=0.02 if config.deterministic else 0.002,
        ) as engine:
            yield engine
        return
    if config.inference.launch and config.model.path is None:
        raise InvalidArgumentError(
            "[inference] launch needs [model] path: the model the servers serve"
        )
    async with open_inference(
        **config.inference.inference_kwargs(),
        model_path=config.model.path,
        log_dir=RunDirectory(config.out).inference_logs,
    ) as fleet:
        if trained:
            latest = await trio.to_thread.run_sync(latest_weights, RunDirectory(config.out).weights)
            if latest is not None:
                await fleet.load_weights(latest.path, latest.version)
        yield fleet


async def run_learning(
    config: LearnConfig,
    *,
    stop: trio.Event | None = None,
    display: Display | None = None,
    sinks: Display | None = None,
) -> LearnResult:
    """Run the learning run described by ``config``; return its metrics.

    ``stop``: once set, the step in progress is cancelled (its groups are settled as the
    orchestrator closes) and the run ends as after its last step (``stopped == "signal"``):
    metrics, plot and ``STOP`` are written, the trainer and the transports are closed.
    ``display`` (with ``config.verbose``) shows each step's record instead of the plain line;
    it is closed at the end. ``sinks`` (e.g. :class:`trio_rl.tools.FanOut` of TensorBoard,
    W&B and Prometheus sinks) gets every record, in a worker thread; the caller closes it.

    Writes ``run.json``, ``metrics.jsonl`` (one object per shipped step), ``weights/step_<S>/``
    and, with ``config.plot``, ``plot.png`` into ``config.out``. A run in ``config.out`` with
    checkpoints is resumed (``config.resume``); else a previous run's ``weights/`` and
    ``batches/`` there are removed first. torch should be
    imported (and ``torch.set_num_threads`` chosen) before ``trio.run``.

    Cancellation: the engine, the orchestrator, the trainer and the watcher are all closed;
    ``metrics.jsonl`` holds the steps shipped so far.

    Why this function is long: the engine, the orchestrator, the trainer, the weight watcher
    and the metrics consumer are opened in one ``async with`` and one nursery, so that they
    close together and a failure of any cancels the others; its closures (the consumer, the
    record writer) share the run's channels and counters. The parts that need none of that
    (the step line, the convergence verdict, the trainer's loop, the waits) are functions.
    """
    out = config.out
    if config.deterministic:
        if config.trainer_mode != "inprocess":
            raise InvalidArgumentError("a deterministic run needs the in-process trainer")
        # one thread: a reduction's order (and so its last bits) must not depend on threads
        torch.set_num_threads(1)
    # A new run (nothing to resume) clears a previous run's weights and batch files: they would
    # be taken for this run's versions and steps.
    resuming = await trio.to_thread.run_sync(_resumable, out, config)
    await trio.to_thread.run_sync(_prepare_run_directory, out, config, resuming)
    state = (
        await trio.to_thread.run_sync(_load_trainer_state, out)
        if resuming and config.trainer_mode == "inprocess"
        else None
    )
    trained = 0 if state is None else int(state["step"])
    trainer_done = trio.Event()
    policy = await trio.to_thread.run_sync(build_policy, config)
    model = policy.model
    if state is not None:
        model.load_state_dict(state["model"])
    engine_model = copy.deepcopy(model).eval()
    prompts = await trio.to_thread.run_sync(build_prompts, config, policy)
    source = InMemorySource(prompts, epochs=None)
    orch_config = orchestrator_config(config, completion_cap(config, policy))
    metrics: list[dict[str, Any]] = []
    earlier = await trio.to_thread.run_sync(_earlier_metrics, out) if resuming else []
    checkpoint: Path | None = None
    resumed_at: int | None = None
    trainer_steps: list[StepStats] = []
    lags: list[float] = []
    begun = time.perf_counter()
    # a resumed run's records continue the earlier wall clock (rates are differences of it)
    started = begun - (earlier[-1].get("wall_s", 0.0) if earlier else 0.0)
    metrics_path = out / METRICS_FILE
    send, receive = trio.open_memory_channel[Shipment](64)
    version = [trained]

    def set_version(v: PolicyVersion) -> None:
        version[0] = v
        orch.set_policy_version(v)

    drained = trio.Event()
    written = trio.Event()
    trainer_log = TrainerLog()
    records_send, records_receive = trio.open_memory_channel[dict[str, Any]](math.inf)

    async def consume(receive: trio.MemoryReceiveChannel[Shipment]) -> None:
        last_wall = 0.0
        busy_last = (0.0, 0.0)  # the engine's (elapsed, busy row-seconds) at the last record
        async with receive:
            async for shipment in receive:
                rec = _record(shipment, lags, started, last_wall, version[0])
                # the consumer holds the last references to the step's samples: free them in a
                # worker, one at a time, not in one pause of the loop (see `Shipment`)
                await trio.to_thread.run_sync(
                    release_containers, [shipment.samples], limiter=limiter
                )
                del shipment
                # what waits behind the step: samples queued in the sink, groups the rollout
                # layer holds open (read when the record arrives, just after the ship)
                rec["counters/reward_failures"] = record_reward.failed
                rec["queue_depth"] = orch.sink.queued
                rec["open_groups"] = len(orch.held_groups())
                rec["cancelled_stale"] = orch.driver.statistics().cancelled_stale_samples
                # the engine's rows busy over the interval (batches finished in it)
                rec["slot_occupancy"] = None  # a fleet's servers report their own
                if isinstance(engine, TorchEngine):
                    stats = engine.statistics()
                    span = stats.elapsed - busy_last[0]
                    busy = stats.busy_row_seconds - busy_last[1]
                    if span > 0 and stats.slots > 0:
                        rec["slot_occupancy"] = round(min(1.0, busy / (stats.slots * span)), 4)
                    busy_last = (stats.elapsed, stats.busy_row_seconds)
                lags.clear()
                last_wall = rec["wall_s"]
                records_send.send_nowait(rec)  # written once the trainer reports the step
                if display is not None and config.verbose:
                    display.write(rec)
                elif config.verbose:
                    print(_plain_line(rec, record_reward.failed), flush=True)
        records_send.close()
        drained.set()

    async def write_records() -> None:
        # A step's record is written (metrics.jsonl, then the sinks) once the trainer reported
        # the step, with its trainer/... metrics; a step never trained is written without.
        async with records_receive:
            async for rec in records_receive:
                reported = await trainer_log.wait_for(rec["step"])
                if reported is not None:
                    rec.update({k: reported.get(k) for k in TRAINER_KEYS})
                metrics.append(rec)
                line = json.dumps(rec) + "\n"
                await trio.to_thread.run_sync(_append, metrics_path, line)
                if sinks is not None:  # TensorBoard, W&B, Prometheus: blocking writers
                    await trio.to_thread.run_sync(sinks.write, rec)
        written.set()

    # The run's one capacity limiter, sized by configuration: the orchestrator (publisher,
    # sender, checkpoints) and the in-process trainer (reads, decoding, training) borrow it.
    # The engine keeps its own limiter of 1: it serializes the model's forward passes.
    limiter = trio.CapacityLimiter(config.threads)
    sender = FileSender(out, config.ranks, fsync=config.fsync)
    async with (
        # the reward of every sample, the built-in tasks' as any other: fn(record, completion),
        # in worker processes of its own (a hung call is killed, never holds the run's limiter)
        open_record_reward(
            import_reward(config.reward_function),
            policy.decode,
            call_timeout=config.reward.timeout,
            failure_budget=config.batch_groups * config.group_size,
            name=f"reward {config.reward_function}",
        ) as record_reward,
        sender,
        _open_engine(config, engine_model, policy, trained) as engine,
        open_orchestrator(
            engine,
            source,
            sender,
            config=orch_config,
            sample_reward=record_reward,
            monitor=send,
            limiter=limiter,
            checkpoint_dir=RunDirectory(out).checkpoints,
            resume=resuming,
        ) as orch,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(consume, receive)
        nursery.start_soon(write_records)
        nursery.start_soon(_probe_loop_lag, lags)
        nursery.start_soon(
            lambda: watch_weights(
                RunDirectory(out).weights,
                [_weight_loader(config, engine, model, prompts, limiter)],
                set_version,
                current=trained,
                poll_interval=0.005,
            )
        )
        if config.trainer_mode == "inprocess":
            if config.ranks != 1:
                raise InvalidArgumentError(
                    "the in-process trainer has one rank; use trainer_mode='torchrun'"
                )
            may_train = None
            if config.deterministic:
                # lockstep: batch k trains once batch k + async level shipped (or the run's
                # last did), so batch S is generated by exactly policy S - 1 - async level
                def may_train(k: int) -> bool:
                    final = orch.final_step if orch.final_step is not None else k
                    return orch.sink.step > min(k + config.max_async_level, final)

            nursery.start_soon(
                partial(
                    _train_inprocess,
                    config,
                    model,
                    trainer_steps,
                    state,
                    limiter=limiter,
                    log=trainer_log,
                    may_train=may_train,
                )
            )
        else:
            nursery.start_soon(_poll_trainer_log, out, trainer_log)
        if config.trainer_mode == "torchrun":
            nursery.start_soon(_run_torchrun, config, trainer_done)
        to_ship = config.steps
        if config.max_steps is not None:
            to_ship = max(0, min(to_ship, config.max_steps - orch.step + 1))
        # admission generates nothing for steps after the run's last
        orch.final_step = orch.step + to_ship - 1
        if config.trainer_mode != "inprocess":
            nursery.start_soon(_watch_trainer, config)
            nursery.start_soon(beat, out / ORCHESTRATOR_HEARTBEAT)
        if trained > orch.policy_version:
            orch.set_policy_version(trained)  # the engine serves the trainer's saved state
        if resuming:
            resumed_at = orch.step
            if config.verbose:
                r = orch.restore
                print(
                    f"resumed at step {orch.step}: trainer state of step {trained}, "
                    f"{0 if r is None else r.queued} queued samples, "
                    f"{0 if r is None else len(r.resumed)} open groups continue",
                    flush=True,
                )
        if config.verbose:
            print(
                f"learning run: {policy.description}, "
                f"prompts {config.data.prompts or 'of the task'}, "
                f"reward {config.reward_function}, "
                f"{sum(p.numel() for p in model.parameters())} parameters, "
                f"{config.batch_groups} groups x {config.group_size} samples per step, "
                f"trainer {config.trainer_mode} x{config.ranks}, run directory {out}",
                flush=True,
            )
        deadline = None if config.time_limit is None else begun + config.time_limit
        rewards: list[float] = []
        stopped = "steps"
        final_reward: float | None = None
        for _ in range(to_ship):
            if stop is not None and stop.is_set():
                stopped = "signal"
                break
            summary = None
            async with trio.open_nursery() as step_nursery:
                if stop is not None:
                    step_nursery.start_soon(_cancel_when_set, stop, step_nursery.cancel_scope)

                async def one_step() -> None:
                    nonlocal summary
                    summary = await orch.run(1)
                    step_nursery.cancel_scope.cancel()

                step_nursery.start_soon(one_step)
                step_nursery.start_soon(_watch_convergence, orch, config, step_nursery.cancel_scope)
            if stop is not None and stop.is_set() and summary is None:
                stopped = "signal"
                break
            if summary is None:
                # Every group had equal rewards: the policy is deterministic on every prompt.
                # That is convergence only at the task's maximum (or stop_at_reward).
                final_reward = orch.sink.window.reward_mean
                stopped, message = _converged(final_reward, config)
                if stopped == "collapsed":
                    logger.warning("%s", message)
                if config.verbose:
                    print(message, flush=True)
                break
            rewards.extend(r.all.reward_mean or 0.0 for r in summary.records)
            if deadline is not None and time.perf_counter() >= deadline:
                stopped = "time_limit"
                break
            window = rewards[-config.stop_window :]
            if (
                config.stop_at_reward is not None
                and len(window) == config.stop_window
                and min(window) >= config.stop_at_reward
            ):
                stopped = "reward"
                break
        if stopped == "signal":
            # the groups finished since the last shipped step are saved, not regenerated
            checkpoint = await orch.save_checkpoint()
        counters = attrs.asdict(orch.sink.counters)
        last_shipped = orch.sink.step - 1
        # the run ends here, whatever ``steps`` said: no rollouts for later steps, and a
        # lockstep trainer may train up to the last shipped step
        orch.final_step = last_shipped
        # an external trainer job trains up to the last shipped step, then exits by itself
        await trio.to_thread.run_sync((out / STOP_FILE).write_text, str(last_shipped))
        if stopped != "signal" and config.trainer_mode != "external":
            await _wait_for_last_step(trainer_log, last_shipped, trained, config)
        if config.trainer_mode == "torchrun":
            with trio.move_on_after(60) as waited:
                await trainer_done.wait()
            if waited.cancelled_caught:
                logger.warning("the torchrun trainer did not exit within 60 s; stopping it")
            for record in (await trio.to_thread.run_sync(read_trainer_log, out))[
                len(trainer_log.steps) :
            ]:
                trainer_log.add(record)
        trainer_log.close()
        send.close()
        # let the consumer drain what was shipped, then stop the helpers
        with trio.move_on_after(5) as waited:
            await drained.wait()
            await written.wait()
        if waited.cancelled_caught:
            logger.warning(
                "the metrics consumer did not drain within 5 s; %s may lack steps", metrics_path
            )
        nursery.cancel_scope.cancel()
    wall = time.perf_counter() - begun
    if display is not None:
        display.close()
    if config.plot and metrics:
        await trio.to_thread.run_sync(
            write_plot, earlier + metrics, RunDirectory(out).plot, config.task
        )
    if config.verbose:
        print(f"done in {wall:.1f} s; metrics: {metrics_path}", flush=True)
    return LearnResult(
        metrics,
        counters,
        trainer_steps,
        wall,
        out,
        stopped,
        checkpoint=checkpoint,
        trained_through=max(trainer_log.last, trained),
        resumed_at=resumed_at,
        final_reward=final_reward,
    )


def _plain_line(rec: dict[str, Any], reward_failures: int) -> str:
    """A step's plain console line (without a display)."""
    reward = rec["reward_mean"]
    return (
        f"step {rec['step']:>4}  reward {'(none new)' if reward is None else f'{reward:.3f}'}"
        f"  policy v{rec['policy_version']:<4} off-policy max "
        f"{rec['off_policy_max']:.0f}  stale {rec['stale']:>4}  "
        f"{rec['samples_per_s']:>6.1f} samples/s  "
        f"lag p95 {rec['loop_lag_p95_ms']:.1f} ms  "
        f"{_percent(rec['slot_occupancy'])} rows busy  {rec['wall_s']:.1f} s"
        + (f"  reward failed {reward_failures} samples" if reward_failures else "")
    )


def _converged(final_reward: float | None, config: LearnConfig) -> tuple[str, str]:
    """Why a run whose groups all had equal rewards ends: ``converged`` at the task's maximum
    (or ``stop_at_reward``), else ``collapsed``; and the line saying so."""
    target = 1.0 if config.stop_at_reward is None else config.stop_at_reward
    shown = "none" if final_reward is None else _reward_text(final_reward, target)
    if final_reward is not None and final_reward >= target - 1e-9:
        return "converged", (
            f"stopping: converged at reward {shown}: the policy is deterministic "
            f"and right (the last {config.converged_after} batches' worth of "
            "groups all had equal rewards)"
        )
    return "collapsed", (
        f"stopping: collapsed at reward {shown}: the policy is deterministic "
        f"on every prompt (the last {config.converged_after} batches' worth of "
        "groups all had equal rewards, so GRPO has no signal left) but not "
        f"right (target {target:g}); raise trainer.entropy_coef or "
        "rollout.temperature"
    )


def _reward_text(reward: float, target: float) -> str:
    """``reward`` to three decimals, or to as many as it takes not to read as ``target`` when it
    is below it (a collapse at 0.9996 must not print as 1.000)."""
    for digits in range(3, 10):
        text = f"{reward:.{digits}f}"
        if reward >= target - 1e-9 or float(text) < target:
            return text
    return repr(reward)


async def _wait_for_last_step(
    log: TrainerLog, last: int, trained: int, config: LearnConfig
) -> None:
    """A normal end: wait (``config.trainer_timeout``) for the trainer to report ``last``, the
    last shipped step, so the final weights are that step's; say loudly when it does not."""
    if last <= trained or log.last >= last:
        return
    logger.info(
        "waiting up to %.0f s for the trainer to train step %d", config.trainer_timeout, last
    )
    if config.verbose:
        print(f"waiting for the trainer to train the last shipped step {last}", flush=True)
    with trio.move_on_after(config.trainer_timeout):
        await log.wait_for(last)
    if log.last < last:
        message = (
            f"the trainer did not report step {last}, the last shipped step, within "
            f"{config.trainer_timeout:.0f} s: the final weights are those of step "
            f"{max(log.last, trained)}, not {last}"
        )
        logger.error("%s", message)
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def _prepare_run_directory(out: Path, config: LearnConfig, resuming: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / STOP_FILE).unlink(missing_ok=True)
    (out / RUN_FILE).write_text(json.dumps(config.to_json(), indent=1))
    if resuming:
        return
    # A new run: an earlier run's weights would be taken for new versions, its batch files for
    # this run's steps (its checkpoints are moved aside by the orchestrator, never deleted).
    run = RunDirectory(out)
    for directory in (run.weights, run.batches):
        shutil.rmtree(directory, ignore_errors=True)
    for name in (TRAINER_STATE, TRAINED_LOG):  # set aside like the checkpoints, never deleted
        if (out / name).exists():
            (out / name).replace(out / f"{name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    (out / TRAINER_LOG).unlink(missing_ok=True)
    (out / METRICS_FILE).write_text("")


def _earlier_metrics(out: Path) -> list[dict[str, Any]]:
    """The records of the run being resumed (a torn last line is dropped)."""
    records = []
    try:
        lines = (out / METRICS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if isinstance(record, dict):
            records.append(record)
    return records


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line)


def write_plot(metrics: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """The run's standard figure as a PNG: the panels ``trio-rl plot`` draws
    (:func:`trio_rl.tools.plot_cmd.build_figure`), one figure family for both."""
    from ..tools.plot_cmd import build_figure

    build_figure(metrics, title=f"learning run {title}".strip()).savefig(path)
