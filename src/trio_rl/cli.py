"""The ``trio-rl`` command.

``trio-rl run`` is the main job on its embedded default: a simulated engine with straggler
latencies, a built-in prompt set and a verifiable reward, the full rollout -> sink -> publisher
-> file transport path, and an in-process trainer rank that reads every batch back, turns it
into torch tensors when torch is installed, and advances the policy version. Every step is
checkpointed; run it again with the same ``--out`` and it resumes where it stopped.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from .engines import DISTRIBUTIONS, SamplingParams, SimulatedEngine
from .orchestrator import Orchestrator, OrchestratorConfig, RunSummary, open_orchestrator
from .publish import Shipment
from .rollout import InMemorySource
from .samples import Prompt, Sample
from .trainer import BatchReceiver, to_torch
from .transport import (
    BatchSender,
    FileBatchReceiver,
    FileBatchSender,
    ZmqBatchSender,
    free_port_pair,
)

__all__ = ["main"]


def _demo_prompts(n: int) -> list[Prompt]:
    # Arithmetic prompts with a checkable answer: the "tokens" are the operands.
    return [
        Prompt(key=f"p{i}", tokens=(i % 97, (7 * i) % 89, 3), label=(i % 97 + (7 * i) % 89) % 2)
        for i in range(n)
    ]


def _parity_reward(sample: Sample) -> float:
    """A verifiable toy reward: 1.0 when the completion's token parity matches the label."""
    return 1.0 if sum(sample.completion_tokens) % 2 == sample.label else 0.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="a simulated rollout run (the embedded default)")
    run.add_argument("--steps", type=int, default=6, help="batches to ship (default 6)")
    run.add_argument("--batch-groups", type=int, default=8, help="groups per batch (default 8)")
    run.add_argument("--group-size", type=int, default=8, help="samples per group (default 8)")
    run.add_argument("--slots", type=int, default=64, help="engine decode slots (default 64)")
    run.add_argument(
        "--distribution",
        choices=sorted(DISTRIBUTIONS),
        default="long-cot",
        help="completion-length distribution of the simulated engine (default long-cot)",
    )
    run.add_argument(
        "--submission", choices=["sample", "group"], default="sample", help="submission policy"
    )
    run.add_argument(
        "--tokens-per-second",
        type=float,
        default=2_000_000.0,
        help="simulated decode speed per slot; high so the demo takes seconds (default 2e6)",
    )
    run.add_argument("--max-tokens", type=int, default=2048, help="completion cap (default 2048)")
    run.add_argument("--ranks", type=int, default=2, help="trainer data-parallel ranks (default 2)")
    run.add_argument(
        "--transport",
        choices=["files", "zmq"],
        default="files",
        help="how batches reach the trainer ranks (default files)",
    )
    run.add_argument(
        "--port", type=int, default=0, help="ZeroMQ data port; READY uses port+1 (0: pick free)"
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--out", type=Path, default=None, help="run directory (default: a temporary one)"
    )
    run.add_argument("--fresh", action="store_true", help="ignore checkpoints in --out")
    run.add_argument("-v", "--verbose", action="store_true")
    return parser


async def _trainer_rank(
    receiver: BatchReceiver, first: int, on_step: list[tuple[int, int, float]]
) -> None:
    """One trainer rank: read each step's micro-batches, tensorize, 'train', report."""
    tensorize = "torch" in sys.modules  # imported up front by main(), when installed
    async with receiver as batches:
        async for step, micro_batches in batches:
            tokens, loss = 0, 0.0
            for mb in micro_batches:
                tokens += len(mb.input_ids)
                if tensorize:
                    t = to_torch(mb)
                    loss += float((t.advantages * t.loss_mask).sum())
            on_step.append((step, tokens, loss))


async def _advance_policy(
    orch: Orchestrator, trained: list[tuple[int, int, float]], ranks: int, first: int, last: int
) -> None:
    """The trainer finishing step S publishes policy S, once every rank has read step S."""
    step = first
    while step <= last:
        if sum(1 for s, _, _ in trained if s == step) == ranks:
            orch.set_policy_version(step)
            step += 1
        else:
            await trio.sleep(0.002)


async def _run(args: argparse.Namespace) -> int:
    out: Path = args.out
    engine = SimulatedEngine(
        distribution=args.distribution,
        slots=args.slots,
        seed=args.seed,
        seconds_per_token=1.0 / args.tokens_per_second,
    )
    config = OrchestratorConfig(
        batch_groups=args.batch_groups,
        group_size=args.group_size,
        submission=args.submission,
        sampling=SamplingParams(max_tokens=args.max_tokens),
        seed=args.seed,
        seq_len=max(8192, args.max_tokens + 16),
    )
    source = InMemorySource(_demo_prompts(512), epochs=None)
    trained: list[tuple[int, int, float]] = []
    started = time.perf_counter()

    def show(shipment: Shipment) -> None:
        r = shipment.record
        reward = r.all.reward_mean
        print(
            f"step {r.step:>3}: shipped {r.effective.samples:>4} samples "
            f"({r.effective.tokens:>8} tokens) from {r.effective.groups:>3} groups | "
            f"reward {'-' if reward is None else f'{reward:.3f}'} | "
            f"off-policy max {r.effective.off_policy.max or 0:.0f} | "
            f"{r.ranks} ranks x {r.micro_batches_per_rank} micro-batches, "
            f"{r.payload_bytes / 2**20:.1f} MiB | finalize {r.timings.total * 1e3:.0f} ms",
            flush=True,
        )

    sender: BatchSender
    if args.transport == "zmq":
        port = args.port or free_port_pair()
        sender = ZmqBatchSender(args.ranks, port=port)
        where = f"tcp://127.0.0.1:{port}"
    else:
        sender = FileBatchSender(out, args.ranks)
        where = str(out / "batches")
    async with (
        sender,
        open_orchestrator(
            engine,
            source,
            sender,
            config=config,
            checkpoint_dir=out / "checkpoints",
            resume=not args.fresh,
            sample_reward=_parity_reward,
            monitor=show,
            on_policy_version=engine.set_policy_version,
        ) as orch,
    ):
        first = orch.step
        last = first + args.steps - 1
        if orch.restore is not None:
            r = orch.restore
            print(
                f"resumed at step {first}: {r.queued} queued samples ship first, "
                f"{len(r.resumed)} open groups continue, {len(r.completed_groups)} were complete"
            )
        print(
            f"trio-rl run: {args.steps} steps of {args.batch_groups} groups x {args.group_size} "
            f"samples, {args.submission} submission, {args.distribution} latencies, "
            f"{args.slots} slots, {args.ranks} trainer ranks, batches via {where}"
        )
        summary: RunSummary | None = None
        async with trio.open_nursery() as nursery:
            for rank in range(args.ranks):
                if args.transport == "zmq":
                    receiver = BatchReceiver.zmq(
                        rank, port=port, start_step=first, stop_step=last + 1
                    )
                else:
                    receiver = BatchReceiver(
                        FileBatchReceiver(
                            out, rank, start_step=first, delete=True, max_poll_interval=0.02
                        ),
                        stop_step=last + 1,
                    )
                nursery.start_soon(_trainer_rank, receiver, first, trained)
            nursery.start_soon(_advance_policy, orch, trained, args.ranks, first, last)
            summary = await orch.run(args.steps)
    assert summary is not None
    stats = engine.statistics()
    c = summary.counters
    tokens = sum(t for _, t, _ in trained)
    print(
        f"done in {time.perf_counter() - started:.1f} s: "
        f"steps {summary.first_step}..{summary.last_step}, "
        f"trainer ranks read {len(trained)} payloads ({tokens} tokens incl. padding)"
    )
    print(
        f"engine: {stats.requests_done} requests, {stats.tokens} tokens, "
        f"slot occupancy {stats.occupancy:.2f}"
    )
    print(
        f"accounting: dispatched {c.dispatched} = shipped {c.shipped} + pruned {c.pruned} + "
        f"stale {c.stale} + filtered {c.filtered} + failed {c.failed} + cancelled {c.cancelled}"
        f" + held {c.dispatched - c.settled}"
    )
    if args.keep:
        print(f"checkpoints: {out / 'checkpoints'} (run again with --out {out} to resume)")
    else:
        print("checkpoints: in a temporary directory, now removed (--out DIR keeps them)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "run":
        if importlib.util.find_spec("torch") is not None:
            # torch is an optional extra; importing it takes seconds, so not inside the loop
            importlib.import_module("torch")
        args.keep = args.out is not None
        if args.out is None:
            with tempfile.TemporaryDirectory(prefix="trio-rl-") as tmp:
                args.out = Path(tmp)
                return trio.run(_run, args)
        return trio.run(_run, args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
