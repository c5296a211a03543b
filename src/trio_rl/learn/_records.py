"""The learning run's records: each shipped step's record, shown on the console (a display
or the plain line) as it ships and written to ``metrics.jsonl`` and the metrics sinks once
the trainer reported the step (with its ``trainer/...`` metrics); the plot at the end."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import attrs
import trio

from ..config import LearnRunConfig
from ..engines import Engine, SlotOccupancy
from ..envs import EpisodeStats
from ..orchestrator import Orchestrator
from ..publish import Shipment, release_containers
from ..rollout import RecordReward
from ..rundir import RunDirectory
from ..samples import PolicyVersion
from ._grpo import TRAINER_KEYS
from ._run_io import TrainerLog, append_line
from ._settings import run_directory
from ._steps import Display, plain_line, probe_loop_lag, step_line_record

__all__ = ["Records", "write_plot"]

logger = logging.getLogger("trio_rl.learn")


@attrs.define(eq=False)
class Records:
    """The run's step records (see the module docstring); `set_version` is the weight
    watcher's report of a new policy version."""

    config: LearnRunConfig
    orch: Orchestrator
    engine: Engine
    #: the samples' reward (None with ``[env]``: an episode's environment returns its reward)
    reward: RecordReward | None
    trainer_log: TrainerLog
    limiter: trio.CapacityLimiter
    display: Display | None = None
    sinks: Display | None = None
    #: the episodes' counts (stop reasons, turns, tool calls) of a run with an environment
    episodes: EpisodeStats | None = None
    metrics: list[dict[str, Any]] = attrs.field(factory=list)
    lags: list[float] = attrs.field(factory=list)
    version: PolicyVersion = 0
    started: float = 0.0
    drained: trio.Event = attrs.field(factory=trio.Event)
    written: trio.Event = attrs.field(factory=trio.Event)
    _send: Any = None
    _receive: Any = None

    def set_version(self, version: PolicyVersion) -> None:
        self.version = version
        self.orch.set_policy_version(version)

    def start(
        self,
        nursery: trio.Nursery,
        shipments: trio.MemoryReceiveChannel[Shipment],
        begun: float,
        earlier: list[dict[str, Any]],
        version: PolicyVersion,
    ) -> None:
        """Consume ``shipments`` and write their records in ``nursery``; a resumed run's
        records continue the earlier wall clock (rates are differences of it)."""
        self.version = version
        self.started = begun - (earlier[-1].get("wall_s", 0.0) if earlier else 0.0)
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](math.inf)
        nursery.start_soon(self._consume, shipments)
        nursery.start_soon(self._write)
        nursery.start_soon(probe_loop_lag, self.lags)

    async def _consume(self, receive: trio.MemoryReceiveChannel[Shipment]) -> None:
        last_wall = 0.0
        occupancy = SlotOccupancy(self.engine)
        orch, verbose = self.orch, self.config.metrics.console
        async with receive:
            async for shipment in receive:
                rec = step_line_record(shipment, self.lags, self.started, last_wall, self.version)
                # the consumer holds the last references to the step's samples: free them in a
                # worker, one at a time, not in one pause of the loop (see `Shipment`)
                await trio.to_thread.run_sync(
                    release_containers, [shipment.samples], limiter=self.limiter
                )
                del shipment
                # what waits behind the step: samples queued in the sink, groups the rollout
                # layer holds open (read when the record arrives, just after the ship)
                rec["counters/reward_failures"] = failed = (
                    0 if self.reward is None else self.reward.failed
                )
                if self.episodes is not None:  # run totals: stop reasons, turns, tool calls
                    rec.update(self.episodes.record())
                rec["queue_depth"] = orch.sink.queued
                rec["open_groups"] = len(orch.held_groups())
                rec["cancelled_stale"] = orch.driver.statistics().cancelled_stale_samples
                # the engine's rows busy over the interval (a fleet's servers report their own)
                rec["slot_occupancy"] = occupancy.read()
                self.lags.clear()
                last_wall = rec["wall_s"]
                self._send.send_nowait(rec)  # written once the trainer reports the step
                # the line shows the trainer's loss, KL and entropy of the last step it trained
                # (a step trains after it ships: the record gets its own once reported)
                shown = dict(rec)
                trained = self.trainer_log.steps.get(self.trainer_log.last)
                if trained is not None:
                    shown.update({k: trained.get(k) for k in TRAINER_KEYS})
                if self.display is not None and verbose:
                    self.display.write(shown)
                elif verbose:
                    print(plain_line(shown, failed), flush=True)
        self._send.close()
        self.drained.set()

    async def _write(self) -> None:
        # A step's record is written (metrics.jsonl, then the sinks) once the trainer reported
        # the step, with its trainer/... metrics; a step never trained is written without.
        path = RunDirectory(run_directory(self.config)).metrics
        async with self._receive:
            async for rec in self._receive:
                reported = await self.trainer_log.wait_for(rec["step"])
                if reported is not None:
                    rec.update({k: reported.get(k) for k in TRAINER_KEYS})
                self.metrics.append(rec)
                await trio.to_thread.run_sync(append_line, path, json.dumps(rec) + "\n")
                if self.sinks is not None:  # TensorBoard, W&B, Prometheus: blocking writers
                    await trio.to_thread.run_sync(self.sinks.write, rec)
        self.written.set()

    async def drain(self) -> None:
        """Let the consumer write what was shipped (the shipments' channel closed)."""
        with trio.move_on_after(5) as waited:
            await self.drained.wait()
            await self.written.wait()
        if waited.cancelled_caught:
            logger.warning(
                "the metrics consumer did not drain within 5 s; %s may lack steps",
                RunDirectory(run_directory(self.config)).metrics,
            )

    async def close(self, earlier: list[dict[str, Any]], wall: float) -> None:
        """Close the display, draw the plot (``metrics.plot``), say the run is done."""
        if self.display is not None:
            self.display.close()
        run = RunDirectory(run_directory(self.config))
        if self.config.metrics.plot and self.metrics:
            from ..tools.plot_cmd import write_figure

            # what `trio-rl plot RUN_DIR` draws: one figure, one title, the stop marked
            await trio.to_thread.run_sync(write_figure, run.root)
        if self.config.metrics.console:
            print(f"done in {wall:.1f} s; metrics: {run.metrics}", flush=True)


def write_plot(
    metrics: list[dict[str, Any]], path: Path, title: str = "", evals: Path | None = None
) -> None:
    """The run's standard figure as a PNG: the panels ``trio-rl plot`` draws
    (:func:`trio_rl.tools.plot_cmd.build_figure`), one figure family for both; with the
    run's ``eval.jsonl`` (``evals``), the held-out curve on the reward panel."""
    from ..tools.plot_cmd import build_figure, read_evals

    held_out = read_evals(evals) if evals is not None else []
    build_figure(metrics, title=f"learning run {title}".strip(), evals=held_out).savefig(path)
