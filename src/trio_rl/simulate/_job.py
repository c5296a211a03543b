"""The ``trio-rl simulate`` job: the pipeline on a simulated engine (or an OpenAI-compatible
server), a built-in prompt set and a verifiable reward, through the transport its
``[transport] kind`` names, to in-process trainer ranks (`trio_rl.simulate._ranks`). Every step
is checkpointed; the same ``--out`` again resumes where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .._flags import SIMULATE_FLAGS, layers
from .._jobs import RunLog, Stop, check_out, resume_command, stop_on_signals, trio_run
from ..config import SimulateConfig, check_resume, load, store
from ..engines import (
    EngineKind,
    EngineSetup,
    FollowsVersion,
    SamplingParams,
    SlotOccupancy,
    engine_kind,
)
from ..orchestrator import Orchestrator, OrchestratorConfig, RunSummary, open_orchestrator
from ..publish import Shipment
from ..rollout import InMemorySource
from ..rundir import RunDirectory
from ..samples import Prompt, Sample
from ..sink import CheckpointManager
from ..transport import Sender, TransportKind, TransportSetup, transport_kind
from ._ranks import Trained, start_step, trainer_rank


def _demo_prompts(n: int) -> list[Prompt]:
    # Arithmetic prompts with a checkable answer: the "tokens" are the operands.
    return [
        Prompt(key=f"p{i}", tokens=(i % 97, (7 * i) % 89, 3), label=(i % 97 + (7 * i) % 89) % 2)
        for i in range(n)
    ]


def _parity_reward(sample: Sample) -> float:
    """A verifiable toy reward: 1.0 when the completion's first token has the label's parity.

    (Not the parity of the whole completion: the simulated engine's completions are runs of
    consecutive ids, so samples capped at the same length would all get one reward, and a group
    with one reward has nothing to train on.)"""
    first = sample.completion_tokens[0] if sample.completion_tokens else 0
    return 1.0 if first % 2 == sample.label else 0.0


@attrs.define(eq=False)
class _SimulateMetrics:
    """``trio-rl simulate``'s ``metrics.jsonl``: one standard record (:func:`step_record`) per
    shipped step, the slot occupancy over the interval since the previous one. A line is a few
    hundred bytes appended to the page cache, so it is written from the monitor, on the loop."""

    out: Path
    occupancy: SlotOccupancy
    started: float
    sink: Any = None
    wall_last: float = 0.0

    def write(self, record: Any, orch: Any) -> None:
        from ..tools.metrics import JsonlSink, step_record

        if self.sink is None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.sink = JsonlSink(RunDirectory(self.out).metrics)
        now = time.perf_counter() - self.started
        # over the interval, in the engine's own clock: busy slot-seconds / slot-seconds
        occupancy = self.occupancy.read()
        self.sink.write(
            step_record(
                record,
                wall_s=now,
                interval_s=now - self.wall_last,
                policy_version=orch.policy_version,
                slot_occupancy=occupancy,
                queue_depth=orch.sink.queued,
                cancelled_stale=orch.driver.statistics().cancelled_stale_samples,
            )
        )
        self.wall_last = now

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def orchestrator_config(cfg: SimulateConfig) -> OrchestratorConfig:
    """The :class:`OrchestratorConfig` ``trio-rl simulate`` runs with, from its configuration."""
    return OrchestratorConfig(
        batch_groups=cfg.rollout.batch_groups,
        group_size=cfg.rollout.group_size,
        rollout=cfg.rollout.to_config(
            # a server behind a router (SGLang's, vLLM's) keeps a group's prompt in one prefix
            # cache: every request of a group carries the group's X-SMG-Routing-Key
            routing_keys="group" if engine_kind(cfg.engine.kind).prefix_cache else "none",
        ),
        sink=cfg.sink.to_config(batch_size=cfg.rollout.batch_groups * cfg.rollout.group_size),
        checkpoint=cfg.checkpoint.to_config(),
        sampling=SamplingParams(max_tokens=cfg.engine.max_tokens),
        seed=cfg.run.seed,
        seq_len=max(8192, cfg.engine.max_tokens + 16),
    )


def _step_line(shipment: Shipment) -> str:
    r = shipment.record
    reward = r.all.reward_mean
    return (
        f"step {r.step:>3}: shipped {r.effective.samples:>4} samples "
        f"({r.effective.tokens:>8} tokens) from {r.effective.groups:>3} groups | "
        f"reward {'(none new)' if reward is None else f'{reward:.3f}'} | "
        f"off-policy max {r.effective.off_policy.max or 0:.0f} | "
        f"{r.ranks} ranks x {r.micro_batches_per_rank} micro-batches, "
        f"{r.payload_bytes / 2**20:.1f} MiB | finalize {r.timings.total * 1e3:.0f} ms"
    )


async def run_simulation(args: argparse.Namespace, cfg: SimulateConfig) -> int:
    """The simulate job under the signal watcher: the first SIGINT or SIGTERM stops the run,
    which then checkpoints what it holds; exit status 128 + the signal."""
    stop = Stop()
    code = 0
    async with trio.open_nursery() as watcher:
        await watcher.start(stop_on_signals, stop)
        with stop.scope:
            job = _Job(cfg, args.out, stop, keep=args.keep, fresh=args.fresh, argv=args.argv)
            code = await job.run()
        watcher.cancel_scope.cancel()
    if stop.signals and not stop.reported:
        stop.report("before the run started: nothing to save")
    return stop.status if stop.signals else code


@attrs.define(eq=False)
class _Job:
    """One invocation of ``trio-rl simulate``: the engine, the transport by its registered
    kind, the orchestrator and the trainer ranks, in the run directory ``out``."""

    cfg: SimulateConfig
    out: Path
    stop: Stop
    keep: bool
    fresh: bool
    argv: Sequence[str]
    started: float = attrs.field(factory=time.perf_counter)
    trained: Trained = attrs.field(factory=Trained)
    #: Groups the rollout layer held when the run ended (continued or regenerated on resume).
    open_groups: int = 0

    async def run(self) -> int:
        cfg, out = self.cfg, self.out
        engines = engine_kind(cfg.engine.kind, "simulate")
        kind = transport_kind(cfg.transport.kind)
        options = attrs.asdict(cfg.transport)
        setup = kind.resolve(TransportSetup(out, cfg.trainer.ranks, cfg.transport.port, options))
        sender = kind.sender(setup)

        def show(shipment: Shipment) -> None:
            metrics.write(shipment.record, orch)
            print(_step_line(shipment), flush=True)

        if self.fresh:
            set_aside(out)
        async with contextlib.AsyncExitStack() as stack:
            engine = await stack.enter_async_context(
                engines.open(
                    EngineSetup(out, seed=cfg.run.seed), cfg.engine.engine_config(engines, "engine")
                )
            )
            # metrics.jsonl, as the learning run writes it: what inspect, watch and plot read
            metrics = _SimulateMetrics(out, SlotOccupancy(engine), self.started)
            stack.callback(metrics.close)
            await stack.enter_async_context(sender)
            orch = await stack.enter_async_context(
                open_orchestrator(
                    engine,
                    InMemorySource(_demo_prompts(512), epochs=None),
                    sender,
                    config=orchestrator_config(cfg),
                    checkpoint_dir=RunDirectory(out).checkpoints,
                    resume=not self.fresh,
                    limiter=trio.CapacityLimiter(cfg.publish.threads),
                    sample_reward=_parity_reward,
                    monitor=show,
                    on_policy_version=(
                        engine.set_policy_version if isinstance(engine, FollowsVersion) else None
                    ),
                )
            )
            self._opened(orch, kind.describe(setup))
            summary = await self._ship(orch, kind, setup, sender)
            if summary is None:
                return await self._stopped(orch)
        self._summary(summary, engines, engine)
        return 0

    def _opened(self, orch: Orchestrator, where: str) -> None:
        cfg, first = self.cfg, orch.step
        orch.final_step = first + cfg.run.steps - 1  # no rollouts after the last: none left over
        if orch.restore is not None:
            r = orch.restore
            print(
                f"resumed at step {first}: {r.queued} queued samples ship first, "
                f"{len(r.resumed)} open groups continue, {len(r.completed_groups)} were complete"
            )
        print(
            f"trio-rl simulate: {cfg.run.steps} steps of {cfg.rollout.batch_groups} groups x "
            f"{cfg.rollout.group_size} samples, {cfg.rollout.submission} submission, "
            f"{cfg.engine.distribution} latencies, {cfg.engine.slots} slots, "
            f"{cfg.trainer.ranks} trainer ranks, batches via {where}"
        )

    async def _ship(
        self, orch: Orchestrator, kind: TransportKind, setup: TransportSetup, sender: Sender
    ) -> RunSummary | None:
        """Run the steps with every trainer rank reading them; None when a signal stopped it."""
        first, ranks = orch.step, self.cfg.trainer.ranks
        last = first + self.cfg.run.steps - 1
        # Trainer ranks start at the first step they have not trained: a pending step (its
        # delivery not confirmed before a crash) is re-sent first, identical.
        resent_from = min(orch.pending_steps, default=first)
        starts = [start_step(kind, setup, self.out, rank, resent_from) for rank in range(ranks)]
        summary: RunSummary | None = None
        with trio.CancelScope() as work:
            self.stop.scope = work  # from now on a signal stops the run, then checkpoints
            self.stop.started.set()
            if self.stop.signals:
                work.cancel()
            self.trained.start(orch, starts)
            async with trio.open_nursery() as nursery:
                for rank in range(ranks):
                    receiver = kind.receiver(setup, sender, rank, starts[rank])
                    nursery.start_soon(
                        trainer_rank, receiver, self.out, starts[rank], last + 1, self.trained
                    )
                summary = await orch.run(self.cfg.run.steps)
                self.open_groups = len(orch.held_groups())
        return None if self.stop.signals else summary

    async def _stopped(self, orch: Orchestrator) -> int:
        # Stopped mid-step: save what was collected since the last shipped step.
        path = await orch.save_checkpoint()
        held = f"{orch.sink.queued} queued samples, {len(orch.held_groups())} open groups"
        if self.keep:
            saved = f"saved {path} ({held}); resume with: {resume_command(self.argv)}"
        else:
            saved = f"nothing kept ({held} were in a temporary directory; use --out DIR)"
        self.stop.report(f"after step {orch.step - 1}: {saved}")
        return self.stop.status

    def _summary(self, summary: RunSummary, kind: EngineKind, engine: Any) -> None:
        c, rows = summary.counters, self.trained.rows
        tokens = sum(t for _, _, t, _ in rows)
        print(
            f"done in {time.perf_counter() - self.started:.1f} s: "
            f"steps {summary.first_step}..{summary.last_step}, "
            f"trainer ranks read {len(rows)} payloads ({tokens} tokens incl. padding)"
        )
        line = None if kind.summary is None else kind.summary(engine)
        if line is not None:
            print(line)
        print(
            f"accounting: dispatched {c.dispatched} = shipped {c.shipped} + pruned {c.pruned} + "
            f"stale {c.stale} + filtered {c.filtered} + failed {c.failed} + cancelled "
            f"{c.cancelled} + held {c.dispatched - c.settled} (queued or in open groups in the "
            f"sink); the rollout layer held {self.open_groups} open groups (continued or "
            "regenerated on resume)"
        )
        if self.keep:
            checkpoints = RunDirectory(self.out).checkpoints
            print(f"checkpoints: {checkpoints} (run again with --out {self.out} to resume)")
        else:
            print("checkpoints: in a temporary directory, now removed (--out DIR keeps them)")


def set_aside(out: Path) -> None:
    # --fresh: the earlier run's checkpoints, batches and trainer logs are moved, never deleted.
    run = RunDirectory(out)
    manager = CheckpointManager(run.checkpoints)
    aside = manager.set_aside()
    moved = [d for d in (run.batches, run.trainer) if d.exists()]
    if aside is None and not moved:
        return
    if aside is None:
        aside = out / f"{run.checkpoints.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir(parents=True, exist_ok=True)
    for directory in moved:
        os.replace(directory, aside / directory.name)
    print(f"--fresh: earlier checkpoints and batches moved to {aside}")


def simulate_command(args: argparse.Namespace) -> int:
    """``trio-rl simulate``: load the configuration, prepare the run directory (a temporary one
    without ``--out``), check a resumed run's stored configuration, and run the job."""
    cfg, _ = load(SimulateConfig, args.configs, layers(SimulateConfig, args, SIMULATE_FLAGS))
    if importlib.util.find_spec("torch") is not None:
        # torch is an optional extra; importing it takes seconds, so not inside the loop
        importlib.import_module("torch")
    args.keep = cfg.run.out is not None
    if cfg.run.out is None:
        with tempfile.TemporaryDirectory(prefix="trio-rl-") as tmp:
            args.out = Path(tmp)
            return trio_run(run_simulation, args, cfg)
    args.out = Path(cfg.run.out)
    check_out(args.out)
    if not args.fresh and RunDirectory(args.out).has_checkpoints():
        check_resume(SimulateConfig, cfg, args.out, args.allow_change)
    args.out.mkdir(parents=True, exist_ok=True)
    store(cfg, args.out)
    # a kept run directory gets its log too (info: the step lines and the summary)
    run_log = RunLog(args.out, "debug" if args.verbose else "info")
    run_log.open()
    try:
        return trio_run(run_simulation, args, cfg)
    finally:
        run_log.close()
