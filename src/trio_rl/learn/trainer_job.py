"""The trainer job: the run's GRPO trainer as its own process (or DDP job).

Started two ways, the same job either way:

* ``trio-rl trainer CONFIG.toml`` by hand, alone or under ``torchrun --nnodes ...
  --nproc-per-node ... --rdzv-endpoint ... $(which trio-rl) trainer CONFIG.toml`` on any
  machine that sees the run directory (``run.out``, a shared path): ``[trainer] mode =
  "external"`` in the orchestrator's configuration;
* by the orchestrator itself with ``[trainer] mode = "torchrun"``: ``torchrun
  --nproc_per_node=N -m trio_rl.learn.trainer_job --out DIR`` (the run's shape read from
  ``DIR/run.json``).

Every rank reads its own micro-batches of every step from ``DIR/batches`` (the file
transport), trains with :class:`GRPOTrainer` (DistributedDataParallel over gloo with several
ranks), and rank 0 publishes the weights of every step under ``DIR/weights``.

Exactly-once across a restart: a step is trained, then rank 0 saves the trainer's state
(model, optimizer, step: ``DIR/trainer/state.pt``) and appends the step to its log
(``DIR/trainer/trained.jsonl``, fsynced), then every rank passes a barrier, and only then is
the step's batch file acknowledged (deleted). A job killed at any point and started again with
the same command resumes after the saved step: a step whose state was saved is never trained
again, one whose state was not is trained (again) from the saved state, so the log lists every
shipped step exactly once. Rank 0 beats ``DIR/trainer/heartbeat`` every second while the job
runs: the orchestrator waits for it (``trainer.connect_timeout``). The job ends after the step
the orchestrator writes into ``DIR/STOP`` at the end of its run (or after ``--steps``).

Beside its log, rank 0 appends each trained step's ``trainer/...`` metrics to
``DIR/trainer/stats.jsonl`` once the step's weights are published: the orchestrator merges them
into the step's metrics record and waits for the last shipped step's line before it reports done.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import functools
import gc
import json
import logging
import operator
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import trio
import trio_util

from ..config import LearnRunConfig
from ..errors import TrainError, collapse_single
from ..rundir import (
    HEARTBEAT_FILE,
    TRAINED_LOG,
    RunDirectory,
)
from ..transport import FileReceiver, TransportTimeoutError
from ..wire import decode
from ._grpo import GRPOTrainer, StepStats
from ._heartbeat import Heartbeat, beat, watch_heartbeat
from ._run_io import append_trainer_record, load_trainer_state, save_trainer_state
from ._settings import build_policy, from_run_json, run_directory
from ._verdict import read_ended, resumes
from ._weights import publish_weights

__all__ = ["HEARTBEAT_FILE", "TRAINED_LOG", "load_run_config", "main", "run_job"]

logger = logging.getLogger("trio_rl.learn")


def load_run_config(out: Path, timeout: float = 60.0, log_every: float = 10.0) -> LearnRunConfig:
    """The configuration the orchestrator wrote to ``out/run.json``: waited for up to
    ``timeout`` seconds (`TransportTimeoutError`), logging at WARNING every ``log_every``
    seconds what it waits for."""
    path = RunDirectory(out).run_file
    start = time.monotonic()
    next_log = start + log_every
    while not path.exists():
        now = time.monotonic()
        if now - start >= timeout:
            raise TransportTimeoutError(
                f"trainer job: {path} did not appear within {timeout:g} s: no orchestrator "
                "started a run in that directory"
            )
        if now >= next_log:
            logger.warning(
                "trainer job: waiting for %s (the orchestrator writes it as it starts) for "
                "%.0f s; failing in %.0f s",
                path,
                now - start,
                timeout - (now - start),
            )
            next_log = now + log_every
        time.sleep(0.05)
    return from_run_json(json.loads(path.read_text()), str(path))


def _fsync_append(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def _drop_torn_line(path: Path) -> None:
    """Cut a last line the job was killed while writing (no newline yet), so that the next
    line starts on a line of its own."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    if data and not data.endswith(b"\n"):
        with path.open("rb+") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())


def _logged_steps(path: Path) -> list[int]:
    steps = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            break  # a torn last line (killed mid-write): what follows it was never written
    return steps


def _log_line(stats: StepStats, sequences: int, world_size: int, **extra: Any) -> str:
    return (
        json.dumps(
            {
                "step": stats.step,
                "sequences": sequences,
                "loss_tokens": stats.loss_tokens,
                "loss": stats.loss,
                "ratio_mean": stats.ratio_mean,
                "clipped_fraction": stats.clipped_fraction,
                "world_size": world_size,
                "pid": os.getpid(),
                **extra,
            }
        )
        + "\n"
    )


class _Job:
    """One rank's trainer loop (see the module docstring for the order of its effects)."""

    def __init__(self, config: LearnRunConfig, rank: int, steps: int | None) -> None:
        self.config, self.rank, self.steps = config, rank, steps
        self.out = run_directory(config)
        policy = build_policy(config)
        state = load_trainer_state(self.out)
        if state is not None:
            policy.model.load_state_dict(state["model"])
        self.trainer = GRPOTrainer(policy.model, config.trainer.to_config())
        self.start = 1
        if state is not None:
            self.trainer.optimizer.load_state_dict(state["optimizer"])
            self.start = int(state["step"]) + 1
            if rank == 0:
                self._reconcile(state)
        #: The last step this rank trained (its state saved, its batch acknowledged).
        self.trained: trio_util.AsyncValue[int] = trio_util.AsyncValue(self.start - 1)
        #: ``STOP`` as the previous orchestrator left it when it stopped for the run to go on
        #: (by a signal, or after its ``--steps``) at a step this job has trained: the job was
        #: started beside the next orchestrator, which may not have cleared it yet, so it
        #: waits for the STOP that orchestrator writes (None: no such file)
        self.stale_stop = _stale_stop(config, self.start - 1)

    def _reconcile(self, state: dict[str, Any]) -> None:
        log = RunDirectory(self.out).trained_log
        _drop_torn_line(log)
        # killed between saving the state and logging its step: the log gets the saved line
        logged = _logged_steps(log)
        if (not logged or logged[-1] < state["step"]) and "log" in state:
            _fsync_append(log, state["log"])

    def _step(self, step: int, data: bytes | bytearray | memoryview) -> StepStats:
        micro_batches = decode(data)
        stats = self.trainer.train_step(step, micro_batches)
        sequences = torch.tensor([sum(len(mb.seq_lens) for mb in micro_batches)], dtype=torch.int64)
        if self.trainer.distributed:
            dist.all_reduce(sequences)
        if self.rank == 0:
            line = _log_line(stats, int(sequences.item()), self.trainer.world_size)
            save_trainer_state(self.out, stats.step, self.trainer, log=line)
            _fsync_append(RunDirectory(self.out).trained_log, line)
        if self.trainer.distributed:
            # no rank deletes its batch file before the state that covers it is saved
            dist.barrier()
        if self.rank == 0:
            publish_weights(
                RunDirectory(self.out).weights,
                step,
                self.trainer.model.state_dict(),
                keep=self.config.checkpoint.weights_keep,
                meta={"step": step, "world_size": self.trainer.world_size},
            )
            # the trainer's metrics, after the weights: the orchestrator merges them into the
            # step's record and counts the step trained once it has them
            append_trainer_record(self.out, stats)
        return stats

    async def serve(self) -> None:
        limiter = trio.CapacityLimiter(1)
        transport = FileReceiver(
            self.out,
            self.rank,
            start_step=self.start,
            delete=True,
            poll_interval=0.002,
            max_poll_interval=0.05,
            limiter=limiter,
        )
        async with trio.open_nursery() as nursery:
            if self.rank == 0:
                nursery.start_soon(beat, RunDirectory(self.out).trainer_heartbeat)
            nursery.start_soon(
                watch_heartbeat, _orchestrator_heartbeat(self.config, self.stale_stop)
            )

            async def train() -> None:
                async with transport:
                    while self.steps is None or self.trained.value < self.steps:
                        got = await transport.receive()
                        with trio.CancelScope(shield=True):
                            stats = await trio.to_thread.run_sync(
                                self._step, got.step, got.data, limiter=limiter
                            )
                            await transport.ack(got.step)
                        self.trained.value = got.step
                        if self.rank == 0:
                            print(
                                f"trainer step {got.step}: {stats.loss_tokens} loss tokens, loss "
                                f"{stats.loss:+.4f}, ratio {stats.ratio_mean:.3f}",
                                flush=True,
                            )
                nursery.cancel_scope.cancel()

            nursery.start_soon(train)
            if self.rank == 0 and self.start > 1:
                print(f"trainer job: resumed after step {self.start - 1}", flush=True)
            # Every rank stops after the same step (a rank leaving early would hang the others
            # in an all-reduce): the one the orchestrator names in the stop file, once trained.
            last = await _wait_for_stop(RunDirectory(self.out).stop, self.stale_stop)
            await _wait_trained(
                self.trained,
                last,
                self.config.trainer.connect_timeout,
                f"{RunDirectory(self.out).batches} (rank {self.rank})",
            )
            nursery.cancel_scope.cancel()


async def _wait_trained(
    trained: trio_util.AsyncValue[int],
    last: int,
    idle_limit: float,
    where: str,
    log_every: float = 10.0,
) -> None:
    """Wait until ``trained`` reaches ``last`` (the orchestrator's last step, from ``STOP``),
    failing when no step was trained for ``idle_limit`` seconds (``trainer.connect_timeout``):
    a batch the orchestrator shipped but that never arrives (lost, or the job reads another
    directory) would otherwise keep the job, and every other rank, waiting forever. Logs what
    it waits for every ``log_every`` seconds (at least once before a short deadline)."""
    log_every = min(log_every, idle_limit / 2)
    progress, seen = trio.current_time(), trained.value
    while trained.value < last:
        if trained.value > seen:
            progress, seen = trio.current_time(), trained.value
        wait = min(log_every, progress + idle_limit - trio.current_time())
        past = functools.partial(operator.lt, seen)  # past(v): seen < v
        with trio.move_on_after(max(wait, 0.0)):
            await trained.wait_value(past)
        if trained.value > seen:
            continue
        idle = trio.current_time() - progress
        if idle >= idle_limit:
            raise TransportTimeoutError(
                f"trainer job: the orchestrator's last step is {last} (STOP) but no step was "
                f"trained for {idle_limit:g} s (trainer.connect_timeout): step {seen + 1}'s batch "
                f"never arrived in {where}"
            )
        logger.warning(
            "trainer job: the orchestrator's last step is %d; trained up to %d, waiting for "
            "step %d's batch in %s for %.0f s; failing in %.0f s (trainer.connect_timeout)",
            last,
            seen,
            seen + 1,
            where,
            idle,
            idle_limit - idle,
        )


def _orchestrator_heartbeat(config: LearnRunConfig, stale: _FileId | None = None) -> Heartbeat:
    """The orchestrator's heartbeat, as the trainer job watches it; once the orchestrator named
    its last step (a ``STOP`` other than ``stale``), its silence is expected."""
    run = RunDirectory(run_directory(config))
    stop = run.stop
    return Heartbeat(
        run.orchestrator_heartbeat,
        config.trainer.connect_timeout,
        name="trainer job: the orchestrator",
        waiting="trainer job: waiting for the orchestrator",
        lost=lambda _: "trainer job: no orchestrator heartbeat",
        start="`trio-rl run CONFIG.toml`",
        ended=lambda: _file_id(stop) not in (None, stale),
    )


#: A file's identity: inode, modification time and size (the orchestrator writes ``STOP`` anew
#: at the end of each of its runs).
_FileId = tuple[int, int, int]


def _file_id(path: Path) -> _FileId | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _stale_stop(config: LearnRunConfig, trained: int) -> _FileId | None:
    """``STOP``'s identity when it names a step this job has trained (``trained``) and the
    orchestrator that wrote it stopped for the run to go on (``ended.json``), else None."""
    out = run_directory(config)
    stop = RunDirectory(out).stop
    found, text = _file_id(stop), _read_stop(stop)
    if found is None or text is None or int(text) > trained:
        return None
    return found if resumes(read_ended(out), config.run.max_steps) else None


async def _wait_for_stop(path: Path, stale: _FileId | None = None, log_every: float = 300.0) -> int:
    """The step named in ``path`` once it appears (other than the ``stale`` file); logs every
    ``log_every`` s until then (no deadline: the orchestrator writes it at the end of its run,
    however long that is)."""
    next_log = trio.current_time() + log_every
    if stale is not None:
        logger.info(
            "trainer job: %s names a step this job trained, from an orchestrator stopped for "
            "the run to go on: waiting for the next one's",
            path,
        )
    while True:
        text = await trio.to_thread.run_sync(_read_new_stop, path, stale)
        if text is not None:
            return int(text)
        if trio.current_time() >= next_log:
            logger.warning("trainer job: still waiting for %s", path)
            next_log += log_every
        await trio.sleep(0.1)


def _read_new_stop(path: Path, stale: _FileId | None) -> str | None:
    """``path``'s text, None while it is missing or is the ``stale`` file (read and stat in one
    worker call: no file system call on the event loop)."""
    text = _read_stop(path)
    return text if stale is None or _file_id(path) != stale else None


def _read_stop(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def hold_rank(out: Path, rank: int) -> IO[str]:
    """Take rank ``rank`` of the run in ``out`` for this process: an exclusive lock on
    ``out/trainer/rank_<rank>.lock``, held while the returned file is open (the kernel drops it
    when the process dies, however it dies). Two jobs on one run directory would both train
    its steps: :class:`~trio_rl.errors.TrainError` naming the holder when another has it."""
    path = RunDirectory(out).trainer / f"rank_{rank}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    held = path.open("a+")
    try:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.seek(0)
        holder = held.read().strip() or "a process"
        held.close()
        raise TrainError(
            f"trainer job: rank {rank} of the run in {out} is held by another trainer job "
            f"({holder}, {path}); stop it first: two jobs would train the same steps twice"
        ) from None
    held.seek(0)
    held.truncate()
    held.write(f"pid {os.getpid()} on {socket.gethostname()}")
    held.flush()
    return held


def run_job(config: LearnRunConfig, steps: int | None = None, where: str = "") -> int:
    """Run the trainer job of ``config`` in this process: one rank of a torchrun job (the
    ``WORLD_SIZE`` / ``RANK`` of its environment), or the only rank when started without one.
    Blocks until the orchestrator's stop file (or ``steps``); returns the exit status."""
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = run_directory(config)
    if world != config.trainer.ranks:
        raise ValueError(
            f"{where or RunDirectory(out).run_file}: trainer.ranks = {config.trainer.ranks} but "
            f"the job has {world} rank(s) (torchrun --nproc-per-node x --nnodes)"
        )
    if distributed:
        dist.init_process_group("gloo")
    held: IO[str] | None = None
    try:
        rank = dist.get_rank() if distributed else 0
        held = _hold_all_ranks(out, rank, distributed)
        job = _Job(config, rank, steps)
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        with collapse_single():  # one failure of the job's tasks is raised as itself
            trio.run(job.serve)
        del job  # the DDP wrapper goes before the process group it holds
        gc.collect()
        if distributed:
            # Both ranks finish before either tears gloo down: destroying the group while the
            # peer still uses it aborts the process ("terminate called without an active
            # exception"). Bounded: a peer that died is reported instead of waited for.
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    finally:
        if distributed:
            dist.destroy_process_group()
        if held is not None:
            held.close()
    return 0


def _hold_all_ranks(out: Path, rank: int, distributed: bool) -> IO[str]:
    # every rank fails together when any rank is held elsewhere: a rank going on alone would
    # wait in its first collective for peers that left
    held: IO[str] | None = None
    error: TrainError | None = None
    try:
        held = hold_rank(out, rank)
    except TrainError as exc:
        error = exc
    if distributed:
        failed = torch.tensor([error is not None], dtype=torch.int64)
        dist.all_reduce(failed)
        if failed.item() and error is None:
            error = TrainError(
                f"trainer job: another rank of the run in {out} is held by another trainer job; "
                "stop it first: two jobs would train the same steps twice"
            )
    if error is not None:
        if held is not None:
            held.close()
        raise error
    assert held is not None
    return held


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trio_rl.learn.trainer_job", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--steps", type=int, default=None, help="stop after this step")
    args = parser.parse_args(argv)
    return run_job(load_run_config(args.out), args.steps)


def exit_hard(code: int) -> None:
    """Leave without the interpreter's teardown of torch's C++ statics once the process group
    is destroyed: it aborted a rank after a clean finish ("terminate called without an active
    exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    exit_hard(main())
