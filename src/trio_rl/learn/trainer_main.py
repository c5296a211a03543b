"""The DDP trainer job: ``torchrun --nproc_per_node=N -m trio_rl.learn.trainer_main --out DIR``.

Every rank reads its own micro-batches of every step from ``DIR/batches`` (the file transport),
trains with :class:`GRPOTrainer` under DistributedDataParallel (gloo), and rank 0 publishes the
weights of every step under ``DIR/weights`` and then appends the step's ``trainer/...`` metrics
to ``DIR/trainer/stats.jsonl``. The job ends after the step the orchestrator
writes into ``DIR/STOP`` at the end of its run (or after ``--steps``). The run's shape (model,
seed, trainer settings) is read from ``DIR/run.json``, written by the orchestrator process
(:func:`run_learning`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import trio

from ..trainer import BatchReceiver
from ..transport import FileReceiver
from ._trainer import GRPOTrainer, TrainerConfig
from ._weights import publish_weights
from .run import RUN_FILE, STOP_FILE, LearnConfig, append_trainer_record, build_model

__all__ = ["main", "load_run_config"]

logger = logging.getLogger("trio_rl.learn")


def load_run_config(out: Path, timeout: float = 60.0) -> LearnConfig:
    """The :class:`LearnConfig` the orchestrator wrote to ``out/run.json`` (waits for it)."""
    path = out / RUN_FILE
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)
    raw = json.loads(path.read_text())
    raw["trainer"] = TrainerConfig(**{**raw["trainer"], "betas": tuple(raw["trainer"]["betas"])})
    return LearnConfig(**raw)


async def _serve(config: LearnConfig, trainer: GRPOTrainer, rank: int, steps: int | None) -> None:
    receiver = BatchReceiver(
        FileReceiver(
            config.out, rank, start_step=1, delete=True, poll_interval=0.002, max_poll_interval=0.02
        ),
        stop_step=None if steps is None else steps + 1,
    )
    limiter = trio.CapacityLimiter(1)
    trained = [0]

    async def train() -> None:
        async with receiver:
            async for step, micro_batches in receiver:
                stats = await trio.to_thread.run_sync(
                    trainer.train_step, step, micro_batches, limiter=limiter
                )
                if rank == 0:
                    publish = functools.partial(
                        publish_weights,
                        config.out / "weights",
                        step,
                        trainer.model.state_dict(),
                        keep=config.weights_keep,
                        meta={"step": step, "world_size": trainer.world_size},
                    )
                    await trio.to_thread.run_sync(publish, limiter=limiter)
                    # the trainer's own record, after the weights: the orchestrator merges its
                    # trainer/... metrics into the step's metrics record
                    await trio.to_thread.run_sync(
                        append_trainer_record, config.out, stats, limiter=limiter
                    )
                    print(
                        f"trainer step {step}: {stats.loss_tokens} loss tokens, loss "
                        f"{stats.loss:+.4f}, ratio {stats.ratio_mean:.3f}",
                        flush=True,
                    )
                # only now: the stop below must not cancel the step's publication or record
                trained[0] = step
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(train)
        # Every rank stops after the same step (a rank leaving early would hang the others in
        # an all-reduce): the one the orchestrator names in the stop file, once trained.
        last = await _wait_for_stop(config.out / STOP_FILE)
        if trained[0] < last:
            logger.info("trainer job: stop file names step %d; training up to it", last)
        while trained[0] < last:  # noqa: ASYNC110 - the training thread has no event
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def _wait_for_stop(path: Path, log_every: float = 300.0) -> int:
    """The step named in ``path`` once it appears; logs every ``log_every`` s until then (no
    deadline: the orchestrator writes it at the end of its run, however long that is)."""
    next_log = trio.current_time() + log_every
    while True:
        text = await trio.to_thread.run_sync(_read_stop, path)
        if text is not None:
            return int(text)
        if trio.current_time() >= next_log:
            logger.warning("trainer job: still waiting for %s", path)
            next_log += log_every
        await trio.sleep(0.1)


def _read_stop(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trio_rl.learn.trainer_main", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--steps", type=int, default=None, help="stop after this step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        config = load_run_config(args.out)
        if dist.get_world_size() != config.ranks:
            raise SystemExit(
                f"torchrun started {dist.get_world_size()} ranks but {args.out / RUN_FILE} "
                f"says ranks={config.ranks}"
            )
        model, _ = build_model(config)
        trainer = GRPOTrainer(model, config.trainer)
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        trio.run(_serve, config, trainer, rank, args.steps)
        del trainer, model  # the DDP wrapper goes before the process group it holds
        gc.collect()
        # Both ranks finish before either tears gloo down: destroying the group while the peer
        # still uses it aborts the process ("terminate called without an active exception").
        # Bounded: a peer that died is reported instead of waited for.
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # pragma: no cover
    code = main()
    # Skip the interpreter's teardown of torch's C++ statics once the group is destroyed: it
    # aborted a rank after a clean finish ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
