"""The ``trio-rl`` command.

``trio-rl run`` is the main job: the learning run of `trio_rl.learn` (a tiny character model
learns a verifiable task under asynchronous RL, served in-process and trained in-process or
under torchrun), printing the mean reward per step and writing ``metrics.jsonl`` and
``plot.png`` into its run directory.

``trio-rl simulate`` is the same pipeline on a simulated engine with straggler
latencies, a built-in prompt set and a verifiable reward, the full rollout -> sink -> publisher
-> file transport path, and an in-process trainer rank that reads every batch back, turns it
into torch tensors when torch is installed, and advances the policy version. Every step is
checkpointed; run it again with the same ``--out`` and it resumes where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs
import trio

from .config import (
    STORED_FILE,
    ConfigError,
    LearnRunConfig,
    Override,
    SimulateConfig,
    check_resume,
    env_overrides,
    flatten,
    load,
    store,
    to_toml,
)
from .engines import DISTRIBUTIONS, OpenAICompatibleEngine, SamplingParams, SimulatedEngine
from .errors import EngineTransportError, TrioRLError
from .orchestrator import Orchestrator, OrchestratorConfig, RunSummary, open_orchestrator
from .publish import Shipment
from .rollout import InMemorySource
from .samples import Prompt, Sample
from .train import CheckpointError, CheckpointManager
from .trainer import BatchReceiver, to_torch
from .transport import (
    FileReceiver,
    FileSender,
    Sender,
    ZmqSender,
    free_port_pair,
)
from .wire import MicroBatch, decode

__all__ = ["main"]


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


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _version() -> str:
    try:
        return importlib.metadata.version("trio-rl")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return "unknown"


@attrs.frozen
class _Flag:
    """A shorthand flag for ``--set key=value``."""

    flag: str
    key: str
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    note: str = ""

    @property
    def dest(self) -> str:
        return "flag__" + self.key.replace(".", "__")


_POS_INT, _POS_FLOAT = _positive(int), _positive(float)

_STEPS = "steps this invocation ships, not a total: a resumed run ships this many more; "

_SIMULATE_FLAGS = (
    _Flag("--out", "run.out", {"type": str, "metavar": "DIR"}),
    _Flag("--steps", "run.steps", {"type": _POS_INT}, _STEPS),
    _Flag("--seed", "run.seed", {"type": int}),
    _Flag("--batch-groups", "rollout.batch_groups", {"type": _POS_INT}),
    _Flag("--group-size", "rollout.group_size", {"type": _POS_INT}),
    _Flag("--submission", "rollout.submission", {"choices": ["sample", "group"]}),
    _Flag("--slots", "engine.slots", {"type": _POS_INT}),
    _Flag("--distribution", "engine.distribution", {"choices": sorted(DISTRIBUTIONS)}),
    _Flag("--tokens-per-second", "engine.tokens_per_second", {"type": _POS_FLOAT}),
    _Flag("--max-tokens", "engine.max_tokens", {"type": _POS_INT}),
    _Flag("--ranks", "trainer.ranks", {"type": _POS_INT}),
    _Flag("--transport", "transport.kind", {"choices": ["files", "zmq"]}),
    _Flag("--port", "transport.port", {"type": int}),
)

_RUN_FLAGS = (
    _Flag("--out", "run.out", {"type": str, "metavar": "DIR"}),
    _Flag("--steps", "run.steps", {"type": int}, _STEPS),
    _Flag(
        "--max-steps",
        "run.max_steps",
        {"type": int},
        "the run's last step, a total across resumes (--steps more, never past it); ",
    ),
    _Flag("--seed", "run.seed", {"type": int}),
    _Flag("--time-limit", "run.time_limit", {"type": float}),
    _Flag("--stop-at-reward", "run.stop_at_reward", {"type": float}),
    _Flag("--threads", "run.threads", {"type": int}),
    _Flag(
        "--deterministic",
        "run.deterministic",
        {"action": "store_const", "const": True},
        "same seed, same rewards bit for bit (in-process trainer, one thread); ",
    ),
    _Flag("--task", "rollout.task", {"choices": ["copy", "repeat", "reverse"]}),
    _Flag("--batch-groups", "rollout.batch_groups", {"type": int}),
    _Flag("--group-size", "rollout.group_size", {"type": int}),
    _Flag("--max-async-level", "rollout.max_async_level", {"type": int}),
    _Flag("--max-off-policy-steps", "sink.max_off_policy_steps", {"type": int}),
    _Flag("--trainer", "trainer.mode", {"choices": ["inprocess", "torchrun", "external"]}),
    _Flag("--ranks", "trainer.ranks", {"type": int}),
    _Flag("--lr", "trainer.lr", {"type": float}),
    _Flag("--epochs", "trainer.epochs", {"type": int}),
    _Flag("--trainer-delay", "trainer.delay", {"type": float}),
    _Flag(
        "--no-plot",
        "metrics.plot",
        {"action": "store_const", "const": False},
        "do not draw RUN_DIR/plot.png at the end; ",
    ),
    _Flag(
        "--plain",
        "metrics.display",
        {"action": "store_const", "const": "plain"},
        "one plain line per step, no live table or progress bar; ",
    ),
    _Flag("--log-level", "run.log_level", {"choices": ["debug", "info", "warning", "error"]}),
)


def _metavar(f: _Flag) -> dict[str, Any]:
    if "choices" in f.kwargs or "metavar" in f.kwargs:
        return f.kwargs
    return {"metavar": f.flag[2:].upper().replace("-", "_"), **f.kwargs}


def _add_config_arguments(
    p: argparse.ArgumentParser, schema: type[Any], flags: Sequence[_Flag], resumable: bool
) -> None:
    p.add_argument(
        "configs",
        nargs="*",
        type=Path,
        metavar="CONFIG.toml",
        help="configuration files, later ones overriding earlier ones (`trio-rl config` prints "
        "the effective configuration; docs/operations.md lists every key)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (after the files and the flags below); repeatable",
    )
    if resumable:
        p.add_argument(
            "--allow-change",
            action="append",
            default=[],
            metavar="SECTION.KEY",
            help="let a resumed run change this key of the configuration stored in its run "
            "directory (a run is refused otherwise); repeatable",
        )
    defaults = flatten(schema())
    for f in flags:
        default = defaults[f.key]
        shown = "unset" if default is None else default
        if "const" in f.kwargs:  # a switch: it sets one value, it has no default of its own
            const = f.kwargs["const"]
            value = str(const).lower() if isinstance(const, bool) else const
            text = f"{f.note}shorthand for --set {f.key}={value}"
        else:
            text = f"{f.note}shorthand for --set {f.key}=... (default {shown})"
        p.add_argument(
            f.flag,
            dest=f.dest,
            default=None,
            help=text,
            # the flag's name, not the dest, in the usage (choices show themselves)
            **_metavar(f),
        )
    p.add_argument("-v", "--verbose", action="store_true", help="log more; tracebacks on errors")


def _parser() -> argparse.ArgumentParser:
    """The command's parser (imports neither torch nor the learning run)."""
    parser = _Parser(
        prog="trio-rl",
        description="Rollout orchestration for asynchronous RL on language models, on trio.",
    )
    parser.add_argument("--version", action="version", version=f"trio-rl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    learning = sub.add_parser(
        "run",
        help="the learning run (the main job): a tiny model learns a verifiable task under "
        "asynchronous RL, in-process (needs torch)",
        description="The learning run. Run it again with the same --out and it resumes (the "
        "in-process trainer's model and optimizer, the policy version and the orchestrator's "
        "checkpoint); --steps is the number of steps this invocation ships (not a total). The "
        "first SIGINT or SIGTERM ends the step in progress, checkpoints and exits 130 / 143; "
        "a second exits at once. A step line's "
        "'reward (none new)': no group was scored since the previous step (it shipped "
        "samples queued before).",
    )
    _add_config_arguments(learning, LearnRunConfig, _RUN_FLAGS, resumable=True)
    learning.add_argument(
        "--fresh",
        action="store_true",
        help="start over: move the checkpoints in --out aside (checkpoints.old-<time>/) and "
        "remove the earlier run's weights, batches and trainer state",
    )
    trainer = sub.add_parser(
        "trainer",
        help="the run's trainer as its own job (alone, or under torchrun on any machine that "
        'sees run.out); pair it with [trainer] mode = "external"',
        description="The GRPO trainer of `trio-rl run CONFIG.toml` as its own job: reads the "
        "run's batches from run.out (a shared directory), publishes versioned safetensors "
        "weights there, and resumes after its last saved step when started again with the same "
        "command (no step trained twice or skipped). Several ranks or machines: torchrun "
        "--nnodes N --nproc-per-node M --rdzv-endpoint HOST:PORT --no-python trio-rl trainer "
        "CONFIG.toml (trainer.ranks = N x M). It ends after the orchestrator's last step.",
    )
    _add_config_arguments(trainer, LearnRunConfig, (), resumable=False)
    run = sub.add_parser(
        "simulate",
        help="a simulated rollout run: throughput, backfill and fault injection without a model",
        description="The pipeline on a simulated engine. Every step is checkpointed; run it "
        "again with the same --out and it resumes where it stopped (--steps more steps: "
        "not a total). The first SIGINT or SIGTERM checkpoints the work in progress and "
        "exits 130 / 143; a second exits at once. A step line's 'reward (none new)': no "
        "group was scored since the previous step (it shipped samples queued before).",
    )
    _add_config_arguments(run, SimulateConfig, _SIMULATE_FLAGS, resumable=True)
    run.add_argument(
        "--fresh",
        action="store_true",
        help="start over: move the checkpoints and batches in --out aside (to "
        "checkpoints.old-<time>/), never deleting them",
    )
    show = sub.add_parser(
        "config",
        help="print the effective configuration of `run` (or `simulate`) as TOML",
        description="Print the effective configuration as TOML: the defaults, then the files, "
        "then the TRIO_RL_<SECTION>__<KEY> environment variables, then the flags, then --set, "
        "in that order. Accepts every flag of `run`.",
    )
    show.add_argument(
        "--for",
        dest="target",
        choices=["run", "simulate"],
        default="run",
        help="the command whose configuration to print (default run)",
    )
    # every flag `run` accepts: its shortcuts set keys here too, so a command line can be
    # checked by putting `config` in place of `run`
    _add_config_arguments(show, LearnRunConfig, _RUN_FLAGS, resumable=True)
    show.add_argument("--fresh", action="store_true", help="accepted as `run` does; no effect")
    for name, module, what in (
        ("inspect", "inspect_cmd", "summarize a batch file, a checkpoint or a run directory"),
        ("plot", "plot_cmd", "draw a run's standard figures to PNG"),
        ("watch", "watch_cmd", "show a run's metrics records as lines (--follow: as they come)"),
    ):
        try:
            tool = importlib.import_module(f"trio_rl.tools.{module}")
        except ImportError:  # the tools package is optional at this layer
            continue
        doc = (tool.__doc__ or what).split("\n\n")[0].replace("``", "")
        p = sub.add_parser(name, help=what, description=doc)
        tool.add_arguments(p)
        if not any("-v" in a.option_strings for a in p._actions):
            p.add_argument("-v", "--verbose", action="store_true")
        p.set_defaults(tool=tool)
    return parser


def _layers(schema: type[Any], args: argparse.Namespace, flags: Sequence[_Flag]) -> list[Override]:
    """What overrides the files: the ``TRIO_RL_<SECTION>__<KEY>`` environment variables, then
    the flags, then ``--set``."""
    others = [s for s in (LearnRunConfig, SimulateConfig) if s is not schema]
    return [*env_overrides(schema, os.environ, others), *_overrides(args, flags)]


def _overrides(args: argparse.Namespace, flags: Sequence[_Flag]) -> list[Override]:
    out = [
        Override(f.key, getattr(args, f.dest), where=f.flag)
        for f in flags
        if getattr(args, f.dest, None) is not None
    ]
    return out + [Override.parse(text) for text in args.sets]


async def _trainer_rank(receiver: BatchReceiver, first: int, on_step: _Trained, rank: int) -> None:
    """One ZeroMQ trainer rank: read each step's micro-batches, tensorize, 'train', report."""
    async with receiver as batches:
        async for step, micro_batches in batches:
            on_step.add(step, rank, *_train(micro_batches))


def _train(micro_batches: Sequence[MicroBatch]) -> tuple[int, float]:
    tensorize = "torch" in sys.modules  # imported up front by main(), when installed
    tokens, loss = 0, 0.0
    for mb in micro_batches:
        tokens += len(mb.input_ids)
        if tensorize:
            t = to_torch(mb)
            loss += float((t.advantages * t.loss_mask).sum())
    return tokens, loss


def _trainer_log(out: Path, rank: int) -> Path:
    return out / "trainer" / f"rank_{rank}.jsonl"


def _trained_through(out: Path, rank: int) -> int | None:
    """The last step the file trainer rank recorded as trained (its own durable progress)."""
    try:
        lines = _trainer_log(out, rank).read_text().splitlines()
    except FileNotFoundError:
        return None
    last = None
    for line in lines:
        try:
            last = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            break  # a line torn by a crash: the step after it was not recorded
    return last


def _record(micro_batches: Sequence[MicroBatch], data: bytes) -> dict[str, object]:
    # What the trainer trained on, for checking exactly-once from its side: the payload's hash
    # and, per sequence, its prompt tokens and a fingerprint of its tokens and logprobs (two
    # samples of one prompt may decode the same tokens; their logprobs tell them apart).
    seqs = []
    for mb in micro_batches:
        pos = 0
        for length in mb.sequence_lengths:
            end = pos + length
            ids, mask = mb.input_ids[pos:end], mb.loss_mask[pos:end]
            logprobs = mb.inference_logprobs[pos:end]
            pos = end
            if any(mask):  # padding-only sequences train nothing
                digest = hashlib.sha1(repr((ids, mask, logprobs)).encode()).hexdigest()[:16]
                seqs.append([*ids[:3], digest])
    return {"sha256": hashlib.sha256(data).hexdigest(), "seqs": seqs}


async def _file_trainer_rank(
    out: Path, rank: int, start: int, stop: int, on_step: _Trained
) -> None:
    """One file-transport trainer rank, resumable: read step after step, train, append one
    fsynced line to ``trainer/rank_<R>.jsonl`` and only then delete the batch file. A restart
    continues after the last recorded step, so a step is trained exactly once even when the
    process is killed between reading and recording."""
    log = _trainer_log(out, rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    transport = FileReceiver(out, rank, start_step=start, max_poll_interval=0.02)
    async with transport:
        for step in range(start, stop):
            got = await transport.receive()
            data = bytes(got.data)
            micro_batches = await trio.to_thread.run_sync(decode, data)
            tokens, loss = _train(micro_batches)
            line = json.dumps({"step": step, "rank": rank, **_record(micro_batches, data)})
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_append_and_delete, log, line, Path(got.source))
            on_step.add(step, rank, tokens, loss)


def _append_and_delete(log: Path, line: str, batch: Path) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    batch.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        batch.parent.rmdir()  # other ranks' files may still be there


@attrs.define
class _Trained:
    """What the trainer ranks trained, ``(step, rank, tokens, loss)`` rows; the trainer finishing
    step S publishes policy S once every rank has trained step S (in `add`, no polling).

    A resumed trainer rank has trained everything before its start step, so the version
    ``min(start) - 1`` is reported by `start` (the orchestrator's ship gate waits for it)."""

    rows: list[tuple[int, int, int, float]] = attrs.field(factory=list)
    orch: Orchestrator | None = None
    done: list[int] = attrs.field(factory=list)

    def start(self, orch: Orchestrator, starts: list[int]) -> None:
        self.orch = orch
        self.done = [s - 1 for s in starts]
        self._advance()

    def add(self, step: int, rank: int, tokens: int, loss: float) -> None:
        self.rows.append((step, rank, tokens, loss))
        if self.orch is not None:
            self.done[rank] = max(self.done[rank], step)
            self._advance()

    def _advance(self) -> None:
        assert self.orch is not None
        version = min(self.done)
        if version > self.orch.policy_version:
            self.orch.set_policy_version(version)


@attrs.define
class _Stop:
    """What the first SIGINT or SIGTERM cancels (the whole job until the run is open, then
    only the run, which is then checkpointed), and what was received."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: Set by the first signal (the learning run watches it instead of a scope).
    event: trio.Event = attrs.field(factory=trio.Event)
    signals: list[int] = attrs.field(factory=list)
    reported: bool = False

    @property
    def status(self) -> int:
        return 128 + self.signals[0]

    def report(self, what: str) -> None:
        name = signal.Signals(self.signals[0]).name
        print(f"trio-rl: stopped by {name} {what}", file=sys.stderr, flush=True)
        self.reported = True


async def _run(args: argparse.Namespace, cfg: SimulateConfig) -> int:
    stop = _Stop()
    code = 0
    async with trio.open_nursery() as watcher:
        await watcher.start(_stop_on_signals, stop)
        with stop.scope:
            code = await _run_job(args, cfg, stop)
        watcher.cancel_scope.cancel()
    if stop.signals and not stop.reported:
        stop.report("before the run started: nothing to save")
    return stop.status if stop.signals else code


@attrs.define(eq=False)
class _SimulateMetrics:
    """``trio-rl simulate``'s ``metrics.jsonl``: one standard record (:func:`step_record`) per
    shipped step, the slot occupancy over the interval since the previous one. A line is a few
    hundred bytes appended to the page cache, so it is written from the monitor, on the loop."""

    out: Path
    engine: Any
    started: float
    sink: Any = None
    wall_last: float = 0.0
    engine_last: tuple[float, float] = (0.0, 0.0)  # (elapsed, busy slot-seconds) at the last

    def write(self, record: Any, orch: Any) -> None:
        from .tools.metrics import JsonlSink, step_record

        if self.sink is None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.sink = JsonlSink(self.out / "metrics.jsonl")
        now = time.perf_counter() - self.started
        occupancy = None
        if isinstance(self.engine, SimulatedEngine):
            # over the interval, in the engine's own clock: busy slot-seconds / slot-seconds
            stats = self.engine.statistics()
            span = stats.elapsed - self.engine_last[0]
            if span > 0:
                used = stats.busy_slot_seconds - self.engine_last[1]
                occupancy = round(min(1.0, used / (stats.slots * span)), 4)
            self.engine_last = (stats.elapsed, stats.busy_slot_seconds)
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
        max_groups_in_flight=cfg.rollout.max_groups_in_flight,
        submission=cfg.rollout.submission,
        max_off_policy_steps=cfg.sink.max_off_policy_steps,
        staleness=cfg.sink.staleness,
        sampling=SamplingParams(max_tokens=cfg.engine.max_tokens),
        seed=cfg.run.seed,
        seq_len=max(8192, cfg.engine.max_tokens + 16),
        checkpoint_keep=cfg.checkpoint.keep,
        # a server behind a router (SGLang's, vLLM's) keeps a group's prompt in one prefix
        # cache: every request of a group carries the group's X-SMG-Routing-Key
        routing_keys="group" if cfg.engine.kind == "openai" else "none",
    )


async def _run_job(args: argparse.Namespace, cfg: SimulateConfig, stop: _Stop) -> int:
    out: Path = args.out
    engine: SimulatedEngine | OpenAICompatibleEngine
    if cfg.engine.kind == "openai":
        engine = OpenAICompatibleEngine(
            [cfg.engine.url],
            model=cfg.engine.model,
            timeout=cfg.engine.timeout,
            max_attempts=cfg.engine.max_attempts,
            abort_path=None,  # vLLM aborts on disconnect; SGLang's /abort_request is optional
        )
    else:
        engine = SimulatedEngine(
            distribution=cfg.engine.distribution,
            slots=cfg.engine.slots,
            seed=cfg.run.seed,
            # Decoding at 30 tokens/s per slot, sped up so that --tokens-per-second holds; the same
            # factor shrinks the wall-time distributions (swe, heavy-tail), whose episodes are
            # minutes long in real time.
            seconds_per_token=1.0 / 30.0,
            time_scale=30.0 / cfg.engine.tokens_per_second,
        )
    config = orchestrator_config(cfg)
    source = InMemorySource(_demo_prompts(512), epochs=None)
    trained = _Trained()
    started = time.perf_counter()
    # metrics.jsonl, as the learning run writes it: what inspect, watch and plot read
    metrics = _SimulateMetrics(out, engine, started)

    def show(shipment: Shipment) -> None:
        r = shipment.record
        metrics.write(r, orch)
        reward = r.all.reward_mean
        print(
            f"step {r.step:>3}: shipped {r.effective.samples:>4} samples "
            f"({r.effective.tokens:>8} tokens) from {r.effective.groups:>3} groups | "
            f"reward {'(none new)' if reward is None else f'{reward:.3f}'} | "
            f"off-policy max {r.effective.off_policy.max or 0:.0f} | "
            f"{r.ranks} ranks x {r.micro_batches_per_rank} micro-batches, "
            f"{r.payload_bytes / 2**20:.1f} MiB | finalize {r.timings.total * 1e3:.0f} ms",
            flush=True,
        )

    sender: Sender
    ranks = cfg.trainer.ranks
    if cfg.transport.kind == "zmq":
        port = cfg.transport.port or free_port_pair()
        sender = ZmqSender(ranks, port=port)
        where = f"tcp://127.0.0.1:{port}"
    else:
        sender = FileSender(out, ranks)
        where = str(out / "batches")
    if args.fresh:
        _set_aside(out)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(metrics.close)
        if isinstance(engine, OpenAICompatibleEngine):
            await stack.enter_async_context(engine)
        await stack.enter_async_context(sender)
        orch = await stack.enter_async_context(
            open_orchestrator(
                engine,
                source,
                sender,
                config=config,
                checkpoint_dir=out / "checkpoints",
                resume=not args.fresh,
                limiter=trio.CapacityLimiter(cfg.publish.threads),
                sample_reward=_parity_reward,
                monitor=show,
                on_policy_version=engine.set_policy_version,
            )
        )
        first = orch.step
        last = first + cfg.run.steps - 1
        orch.final_step = last  # no rollouts for steps after the last: none left over
        if orch.restore is not None:
            r = orch.restore
            print(
                f"resumed at step {first}: {r.queued} queued samples ship first, "
                f"{len(r.resumed)} open groups continue, {len(r.completed_groups)} were complete"
            )
        print(
            f"trio-rl simulate: {cfg.run.steps} steps of {cfg.rollout.batch_groups} groups x "
            f"{cfg.rollout.group_size} samples, {cfg.rollout.submission} submission, "
            f"{cfg.engine.distribution} latencies, {cfg.engine.slots} slots, {ranks} trainer "
            f"ranks, batches via {where}"
        )
        summary: RunSummary | None = None
        # Trainer ranks start at the first step they have not trained: a pending step (its
        # delivery not confirmed before a crash) is re-sent first, identical.
        resent_from = min(orch.pending_steps, default=first)
        if cfg.transport.kind == "zmq":
            starts = [resent_from] * ranks  # a ZeroMQ frame has no step: restart with it
        else:
            starts = []
            for rank in range(ranks):
                # A rank's own log is the truth; a rank that logged nothing yet (killed before
                # its first step) starts at its oldest batch file still on disk.
                through = _trained_through(out, rank)
                if through is None:
                    waiting = (out / "batches").glob(f"step_*/rank_{rank}.bin")
                    through = min((int(p.parent.name[5:]) for p in waiting), default=resent_from)
                    through -= 1
                starts.append(through + 1)
        with trio.CancelScope() as work:
            stop.scope = work  # from now on a signal stops the run, then checkpoints
            if stop.signals:
                work.cancel()
            trained.start(orch, starts)
            async with trio.open_nursery() as nursery:
                for rank in range(ranks):
                    if cfg.transport.kind == "zmq":
                        receiver = BatchReceiver.zmq(
                            rank, port=port, start_step=starts[rank], stop_step=last + 1
                        )
                        nursery.start_soon(_trainer_rank, receiver, first, trained, rank)
                    else:
                        nursery.start_soon(
                            _file_trainer_rank, out, rank, starts[rank], last + 1, trained
                        )
                summary = await orch.run(cfg.run.steps)
                open_groups = orch.held_groups
        if stop.signals:
            # Stopped mid-step: save what was collected since the last shipped step.
            path = await orch.save_checkpoint()
            held = f"{orch.sink.queued} queued samples, {orch.held_groups} open groups"
            if args.keep:
                saved = f"saved {path} ({held}); resume with: {_resume_command(args.argv)}"
            else:
                saved = f"nothing kept ({held} were in a temporary directory; use --out DIR)"
            stop.report(f"after step {orch.step - 1}: {saved}")
            return stop.status
    assert summary is not None
    c = summary.counters
    tokens = sum(t for _, _, t, _ in trained.rows)
    print(
        f"done in {time.perf_counter() - started:.1f} s: "
        f"steps {summary.first_step}..{summary.last_step}, "
        f"trainer ranks read {len(trained.rows)} payloads ({tokens} tokens incl. padding)"
    )
    if isinstance(engine, SimulatedEngine):
        stats = engine.statistics()
        print(
            f"engine: {stats.requests_done} requests, {stats.tokens} tokens, "
            f"slot occupancy {stats.occupancy:.2f}"
        )
    print(
        f"accounting: dispatched {c.dispatched} = shipped {c.shipped} + pruned {c.pruned} + "
        f"stale {c.stale} + filtered {c.filtered} + failed {c.failed} + cancelled {c.cancelled}"
        f" + held {c.dispatched - c.settled} (queued or in open groups in the sink); the "
        f"rollout layer held {open_groups} open groups (continued or regenerated on resume)"
    )
    if args.keep:
        print(f"checkpoints: {out / 'checkpoints'} (run again with --out {out} to resume)")
    else:
        print("checkpoints: in a temporary directory, now removed (--out DIR keeps them)")
    return 0


async def _stop_on_signals(
    stop: _Stop, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The first SIGINT or SIGTERM cancels ``stop.scope`` (the run then checkpoints what it
    holds); a second one exits at once, leaving the last checkpoint as it is."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        _STARTUP.release()  # a signal held back during start-up arrives here now
        task_status.started()
        async for signum in received:
            name = signal.Signals(signum).name
            if stop.signals:
                print(f"trio-rl: {name} again: exiting now", file=sys.stderr, flush=True)
                os._exit(128 + signum)
            stop.signals.append(signum)
            print(
                f"trio-rl: {name}: stopping after saving a checkpoint ({name} again exits now)",
                file=sys.stderr,
                flush=True,
            )
            stop.scope.cancel()
            stop.event.set()


def _set_aside(out: Path) -> None:
    # --fresh: the earlier run's checkpoints, batches and trainer logs are moved, never deleted.
    manager = CheckpointManager(out / "checkpoints")
    aside = manager.set_aside()
    if aside is None and not any((out / d).exists() for d in ("batches", "trainer")):
        return
    if aside is None:
        aside = out / f"checkpoints.old-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir(parents=True, exist_ok=True)
    for name in ("batches", "trainer"):
        if (out / name).exists():
            os.replace(out / name, aside / name)
    print(f"--fresh: earlier checkpoints and batches moved to {aside}")


def _one_failure(exc: BaseException) -> BaseException:
    """The real failure inside (nested) exception groups: the first that is not a
    cancellation caused by it."""
    while isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        exc = (leaves or list(exc.exceptions))[0]
    return exc


class _UsageError(TrioRLError, ValueError):
    """A bad command line the parser cannot see (e.g. ``--out`` below a regular file): exit 2."""


def _hint(failure: BaseException, message: str, command: str) -> str:
    """What to do about ``failure``, appended to its one line."""
    chain: list[BaseException] = []
    cause: BaseException | None = failure
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if command not in ("run", "simulate"):
        return ""  # inspect, plot: the message is the finding
    if isinstance(failure, CheckpointError) and "unusable" in message:
        return "; pass --fresh to move them aside and start over"
    if isinstance(failure, CheckpointError):
        return "; pass --fresh to move the run's checkpoints aside and start over"
    if any(getattr(c, "errno", None) == errno.EADDRINUSE for c in chain) or (
        "Address already in use" in message
    ):
        return "; pick another port (--port, or 0 for a free pair) or stop the process using it"
    if _engine_failure(failure) is not None:
        return "; check the engine's URL and that the server is up"
    if isinstance(failure, PermissionError):
        return "; choose a directory you can write (--out)"
    return ""


def _engine_failure(failure: BaseException) -> EngineTransportError | None:
    """The engine transport error that made the rollout layer give up, if that is why."""
    cause: BaseException | None = failure
    for _ in range(8):
        if cause is None:
            return None
        if isinstance(cause, EngineTransportError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


class _FirstFailures(logging.Filter):
    """Pass the first ``limit`` records that carry an exception, then one line saying the
    rest are not shown (an unreachable engine fails every group: the error line says why)."""

    def __init__(self, limit: int = 3) -> None:
        super().__init__()
        self.limit, self.seen = limit, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        self.seen += 1
        if self.seen == self.limit + 1:
            record.msg, record.args, record.exc_info = (
                "further failures are not shown (-v shows every one)",
                None,
                None,
            )
            return True
        return self.seen <= self.limit


class _Quiet(logging.Formatter):
    """Log records as one line each: the exception's message without its traceback (``-v``
    keeps tracebacks)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record = logging.makeLogRecord(record.__dict__)
            record.msg = f"{record.getMessage()}: {' '.join(str(exc).split())}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return super().format(record)


def _check_out(out: Path) -> None:
    """``--out`` must be a directory or creatable as one, and writable: refuse it (a usage
    error, exit 2, naming the option) before anything starts. A directory made to check that is
    removed again, so a run that then fails on its configuration leaves nothing behind."""
    made: Path | None = None
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise _UsageError(
                    f"--out {out}: {path} is a regular file, not a directory; pass a directory"
                )
            break
        made = path
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise _UsageError(
            f"--out {out}: cannot write there ({exc.strerror or exc}); pass a directory you "
            "can write"
        ) from None
    finally:
        if made is not None:  # the directories this check made, innermost first
            for path in (out, *out.parents):
                try:
                    path.rmdir()
                except OSError:
                    break
                if path == made:
                    break


def _last_shipped(out: Path) -> int:
    """The last step the run in ``out`` shipped (its ``metrics.jsonl``), 0 for none."""
    from .tools.metrics import read_metrics

    try:
        records = read_metrics(out / "metrics.jsonl")
    except TrioRLError:  # no file (a new run) or a damaged one: the run itself says so
        return 0
    return max((r["step"] for r in records if "samples" in r or "wall_s" in r), default=0)


def _report(args: argparse.Namespace, exc: BaseException) -> int:
    failure = _one_failure(exc)
    if isinstance(failure, KeyboardInterrupt):
        print("trio-rl: interrupted", file=sys.stderr)
        return 130
    if getattr(args, "verbose", False):
        traceback.print_exception(exc)
    message = " ".join(str(failure).split()) or type(failure).__name__
    engine = _engine_failure(failure)
    if engine is not None:  # the cause, not the rollout layer's wrapping of it
        message = "the engine failed every request, e.g. " + " ".join(str(engine).split())
    if isinstance(failure, ConfigError | _UsageError):
        print(f"trio-rl: error: {message}", file=sys.stderr)
        return 2
    hint = _hint(failure, message, str(getattr(args, "command", "")))
    print(f"trio-rl: error: {message}{hint}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a failure the user can cause is one line on stderr and exit status 1
    (usage errors, a bad configuration included: 2); ``-v`` adds the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _STARTUP.hold()
    try:
        try:
            return _main_guarded(argv)
        finally:
            # A signal still held (the command ended before its loop) arrives here, where the
            # handler below sees its KeyboardInterrupt.
            _STARTUP.release()
    except KeyboardInterrupt:  # trio's own, before the watcher listens or after it stopped
        print("trio-rl: interrupted", file=sys.stderr)
        return 130


def _main_guarded(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.argv = argv
    # Only the handler made here is quieted (an embedding program's handlers are left alone;
    # basicConfig adds nothing when the root logger has handlers already).
    handler = logging.StreamHandler()
    fmt = "%(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt) if args.verbose else _Quiet(fmt))
    if not args.verbose:
        handler.addFilter(_FirstFailures())
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    try:
        return _main(args)
    except BrokenPipeError:
        # `trio-rl inspect RUN | head`: the reader left; say nothing more (Python would print
        # an error while flushing stdout at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        return _report(args, exc)


@attrs.define
class _StartupSignals:
    """SIGINT and SIGTERM are blocked (the operating system keeps them pending) from the start
    of the command until the event loop's watcher listens (``_stop_on_signals``), which then
    receives a pending one: a signal during imports, configuration or torch's import is never
    lost to a handler swap and stops the command like any later one. The console script's first
    module (``_trio_rl_start``) blocks them before the package imports; ``release`` restores the
    mask the process started with. Commands without an event loop release at once."""

    original: set[int] | None = None

    def hold(self) -> None:
        if self.original is not None:
            return
        before = set(signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}))
        # the launcher blocked them already: what to restore is the mask from before it
        launched: set[int] | None = getattr(
            sys.modules.get("_trio_rl_start"), "ORIGINAL_MASK", None
        )
        self.original = before if launched is None else set(launched)

    def release(self) -> None:
        if self.original is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.original)
            self.original = None


_STARTUP = _StartupSignals()


def _trio_run(fn: Callable[..., Any], *args: Any) -> int:
    # The loop's first task, the signal watcher, releases the held signals once it listens.
    try:
        return int(trio.run(fn, *args))
    finally:
        _STARTUP.release()


def _resume_command(argv: Sequence[str]) -> str:
    """The command that was run, without ``--fresh`` (which would set the checkpoints aside)."""
    return shlex.join(["trio-rl", *(a for a in argv if a != "--fresh")])


def _main(args: argparse.Namespace) -> int:
    if args.command == "config":
        _STARTUP.release()  # no event loop: Ctrl-C is a KeyboardInterrupt
        schema: type[Any] = SimulateConfig if args.target == "simulate" else LearnRunConfig
        flags = _RUN_FLAGS if schema is LearnRunConfig else ()
        if schema is SimulateConfig and any(getattr(args, f.dest, None) for f in _RUN_FLAGS):
            given = [f.flag for f in _RUN_FLAGS if getattr(args, f.dest, None) is not None]
            raise _UsageError(f"{', '.join(given)}: flags of `run`; with --for simulate use --set")
        cfg, _ = load(schema, args.configs, _layers(schema, args, flags))
        sys.stdout.write(to_toml(cfg))
        return 0
    if args.command == "trainer":
        return _trainer_job(args)
    if args.command == "run":
        learn_cfg, origin = load(
            LearnRunConfig, args.configs, _layers(LearnRunConfig, args, _RUN_FLAGS)
        )
        if learn_cfg.trainer.mode == "inprocess" and learn_cfg.trainer.ranks != 1:
            raise ConfigError(
                origin.get("trainer.ranks", "defaults"),
                "trainer.ranks",
                'the in-process trainer has one rank; set trainer.mode = "torchrun"',
            )
        args.default_out = learn_cfg.run.out is None
        if learn_cfg.run.out is None:  # runs/<time> under the current directory, kept
            learn_cfg = attrs.evolve(
                learn_cfg, run=attrs.evolve(learn_cfg.run, out=str(_default_run_directory()))
            )
        if learn_cfg.run.out is not None:
            out = Path(learn_cfg.run.out)
            _check_out(out)
            if not args.fresh and any((out / "checkpoints").glob("step_*.ckpt")):
                check_resume(LearnRunConfig, learn_cfg, out, args.allow_change)
        if importlib.util.find_spec("torch") is None:
            raise RuntimeError(
                "the learning run needs torch (pip install 'trio-rl[learn]'; on a CPU machine "
                "install torch==2.13.0 first); `trio-rl simulate` runs without it"
            )
        import torch  # seconds to import: before the event loop starts, never inside it

        from . import learn

        # the per-step line already shows the stale counter; the sink's warning would repeat it
        logging.getLogger("trio_rl.train").setLevel(logging.ERROR)
        torch.set_num_threads(1 if learn_cfg.run.deterministic else learn_cfg.run.threads)
        _check_run_inputs(learn_cfg, origin)
        config = attrs.evolve(learn.config_from_file(learn_cfg), resume=not args.fresh)
        if learn_cfg.run.max_steps is not None:
            # the run caps its steps itself (from the step it resumes at, its checkpoint's:
            # metrics.jsonl may lag behind it); this only spares a run with nothing to do
            shipped = _last_shipped(config.out) if _resuming(config) else 0
            if learn_cfg.run.max_steps - shipped <= 0:
                print(
                    f"trio-rl: the run in {config.out} has shipped step {shipped}, its "
                    f"run.max_steps ({learn_cfg.run.max_steps}): nothing to do (raise "
                    "--max-steps to go on)"
                )
                return 0
        resume = _resume_command(args.argv)
        if args.default_out:  # the command again must find this run's directory
            resume = shlex.join([*shlex.split(resume), "--out", str(config.out)])
        return _trio_run(_run_learning, config, learn_cfg, resume)
    if args.command == "simulate":
        cfg, _ = load(SimulateConfig, args.configs, _layers(SimulateConfig, args, _SIMULATE_FLAGS))
        if importlib.util.find_spec("torch") is not None:
            # torch is an optional extra; importing it takes seconds, so not inside the loop
            importlib.import_module("torch")
        args.keep = cfg.run.out is not None
        if cfg.run.out is None:
            with tempfile.TemporaryDirectory(prefix="trio-rl-") as tmp:
                args.out = Path(tmp)
                return _trio_run(_run, args, cfg)
        args.out = Path(cfg.run.out)
        _check_out(args.out)
        if not args.fresh and any((args.out / "checkpoints").glob("step_*.ckpt")):
            check_resume(SimulateConfig, cfg, args.out, args.allow_change)
        args.out.mkdir(parents=True, exist_ok=True)
        store(cfg, args.out)
        # a kept run directory gets its log too (info: the step lines and the summary)
        run_log = _RunLog(args.out, "debug" if args.verbose else "info")
        run_log.open()
        try:
            return _trio_run(_run, args, cfg)
        finally:
            run_log.close()
    if hasattr(args, "tool"):
        _STARTUP.release()  # the tools handle their own KeyboardInterrupt (watch --follow: 130)
        return int(args.tool.run(args))
    return 2  # pragma: no cover - argparse rejects unknown commands


def _check_run_inputs(cfg: LearnRunConfig, origin: dict[str, str]) -> None:
    """The model directory, the reward and the data file of a run, checked before anything
    starts: a bad one is a `ConfigError` naming the key and what is wrong (exit 2)."""
    from .learn import check_model_dir
    from .rollout import DataSourceError, RolloutConfigError, import_reward, read_records

    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, origin.get("model.path", "model.path"))
    spec = cfg.reward.function or f"trio_rl.learn.tasks:{cfg.rollout.task}"
    try:
        import_reward(spec)
    except RolloutConfigError as exc:
        raise ConfigError(
            origin.get("reward.function", "defaults"), "reward.function", str(exc)
        ) from None
    if cfg.data.prompts is not None:
        try:
            read_records(cfg.data.prompts)
        except DataSourceError as exc:
            raise ConfigError(
                origin.get("data.prompts", "data.prompts"), "data.prompts", str(exc)
            ) from None


def _trainer_job(args: argparse.Namespace) -> int:
    """``trio-rl trainer CONFIG.toml``: the run's trainer job in this process (one rank of a
    torchrun job, or the only one)."""
    _STARTUP.release()  # no event loop of ours watches signals: the job is killed as it is
    cfg, origin = load(LearnRunConfig, args.configs, _overrides(args, ()))
    if cfg.run.out is None:
        raise ConfigError(
            origin.get("run.out", "defaults"),
            "run.out",
            "the trainer job needs the run directory it shares with the orchestrator (run.out)",
        )
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("the trainer job needs torch (pip install 'trio-rl[learn]')")
    import torch  # noqa: F401 - seconds to import: before the job starts

    from . import learn
    from .learn import trainer_main

    if cfg.model.path is not None:
        check = learn.check_model_dir
        check(cfg.model.path, origin.get("model.path", "model.path"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.trainer.ranks:
        raise ConfigError(
            origin.get("trainer.ranks", "defaults"),
            "trainer.ranks",
            f"{cfg.trainer.ranks}, but the job has {world} rank(s) (torchrun's --nnodes x "
            "--nproc-per-node)",
        )
    code = trainer_main.run_job(learn.config_from_file(cfg))
    if "WORLD_SIZE" in os.environ:
        trainer_main.exit_hard(code)
    return code


async def _run_learning(config: Any, file_config: LearnRunConfig, resume: str) -> int:
    """The learning run under the signal watcher: the first SIGINT or SIGTERM ends the step in
    progress (its accounting settles as the orchestrator closes), then the run finishes as
    after its last step (metrics, plot, transports closed)."""
    from . import learn

    stop = _Stop()
    run_log = _RunLog(Path(config.out), file_config.run.log_level)
    async with trio.open_nursery() as watcher:
        await watcher.start(_stop_on_signals, stop)
        await trio.to_thread.run_sync(_store_learning_config, file_config, config.out)
        await trio.to_thread.run_sync(run_log.open)
        try:
            sinks = await trio.to_thread.run_sync(
                lambda: _open_metric_sinks(
                    file_config.metrics, config.out, file_config, _resuming(config)
                )
            )
            try:
                result = await learn.run_learning(
                    config,
                    stop=stop.event,
                    display=_open_display(
                        file_config.metrics.display,
                        total=_steps_to_ship(config),
                        stream=run_log.terminal,
                        log=run_log.console.info,
                    ),
                    sinks=sinks,
                )
            finally:
                if sinks is not None:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(sinks.close)
            _closing_lines(config, file_config, resume)
        finally:
            run_log.close()
        watcher.cancel_scope.cancel()
    if not stop.signals:
        return 0
    out = config.out
    last = result.metrics[-1]["step"] if result.metrics else (result.resumed_at or 1) - 1
    if result.checkpoint is not None and config.trainer_mode != "inprocess":
        saved = (
            f"saved {result.checkpoint} and {out / STORED_FILE} (the {config.trainer_mode} "
            f"trainer job keeps its own state in {out / 'trainer'}); resume with: {resume}"
        )
    elif result.checkpoint is not None:
        saved = (
            f"saved {result.checkpoint}, the trainer's state of step {result.trained_through} "
            f"and {out / STORED_FILE}; resume with: {resume}"
        )
    else:
        saved = (
            f"saved {out / 'metrics.jsonl'} and the weights in {out / 'weights'}; the "
            f"{config.trainer_mode} trainer does not resume: `trio-rl run --out {out}` starts over"
        )
    stop.report(f"after step {last}: {saved}")
    return stop.status


#: The run's log, in its run directory.
RUN_LOG = "logs/run.log"


def _default_run_directory() -> Path:
    """``runs/<YYYYmmdd-HHMMSS>`` under the current directory (``-2``, ``-3``, ... when a run
    started in the same second)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class _LogLines:
    """``sys.stdout`` during a run: what is printed goes to the terminal and, line by line, to
    the run's log (as records of ``trio_rl.console``)."""

    def __init__(self, stream: Any, logger: logging.Logger) -> None:
        self._stream, self._logger, self._part = stream, logger, ""

    def write(self, text: str) -> int:
        self._stream.write(text)
        lines = (self._part + text).split("\n")
        self._part = lines.pop()
        for line in lines:
            if line.strip():
                self._logger.info("%s", line)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RunLog:
    """``RUN_DIR/logs/run.log`` at ``level``: the library's log records, every line the run
    prints and every step's plain line (the fields the terminal shows, as text). The console
    handler keeps its level (warnings; ``-v``: info)."""

    def __init__(self, out: Path, level: str) -> None:
        self.path = out / RUN_LOG
        self.level = getattr(logging, level.upper())
        self.console = logging.getLogger("trio_rl.console")
        self.terminal: Any = sys.stdout
        self._handler: logging.Handler | None = None
        self._saved: tuple[int, list[tuple[logging.Handler, int]]] | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.path, encoding="utf-8")
        handler.setLevel(self.level)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        # the handlers already there keep what they showed: their level becomes explicit
        self._saved = (root.level, [(h, h.level) for h in root.handlers])
        for h in root.handlers:
            h.setLevel(max(h.level, root.level))
        root.setLevel(min(root.level, self.level))
        root.addHandler(handler)
        # the printed lines go to the log only, not to the console handler a second time
        self.console.propagate = False
        self.console.setLevel(logging.INFO)
        self.console.addHandler(handler)
        self._handler = handler
        self.terminal = sys.stdout
        sys.stdout = _LogLines(sys.stdout, self.console)

    def close(self) -> None:
        if self._handler is None:
            return
        if isinstance(sys.stdout, _LogLines):
            sys.stdout.flush()
            sys.stdout = self.terminal
        root = logging.getLogger()
        root.removeHandler(self._handler)
        self.console.removeHandler(self._handler)
        self.console.propagate = True
        if self._saved is not None:
            level, handlers = self._saved
            root.setLevel(level)
            for h, h_level in handlers:
                h.setLevel(h_level)
        self._handler.close()
        self._handler = None


def _closing_lines(config: Any, file_config: LearnRunConfig, resume: str) -> None:
    """The last lines of a run: where everything it wrote is, and how to go on."""
    out = Path(config.out)
    print(f"run directory: {out}", flush=True)
    print(f"  metrics: {out / 'metrics.jsonl'}", flush=True)
    if file_config.metrics.plot:
        print(f"  plot:    {out / 'plot.png'}  (again: trio-rl plot {out})", flush=True)
    print(f"  log:     {out / RUN_LOG}", flush=True)
    if config.trainer_mode == "inprocess":
        print(f"  resume:  {resume}", flush=True)
    else:
        print(f"  resume:  none (the {config.trainer_mode} trainer starts over)", flush=True)


def _open_display(
    kind: str, *, total: int | None = None, stream: Any = None, log: Any = None
) -> Any:
    """The console display of `trio_rl.tools.console` for ``metrics.display``: ``table`` (or
    ``auto`` on a terminal with ``rich`` installed) the live table and progress bar, else one
    plain line per step; ``log`` gets every step's plain line either way."""
    from .tools.console import ConsoleDisplay

    out = sys.stdout if stream is None else stream
    if kind == "plain":
        plain = True
    elif kind == "table":
        plain = False
    else:
        plain = not (out.isatty() and importlib.util.find_spec("rich") is not None)
    # the plain lines are printed to the terminal stream itself: the log gets them from `log`
    return ConsoleDisplay(out, plain=plain, total=total, log=log)


def _steps_to_ship(config: Any) -> int:
    """The steps this invocation ships, as the progress display counts them: ``steps``, or
    fewer up to ``max_steps`` (an estimate from ``metrics.jsonl``; the run caps itself)."""
    if config.max_steps is None:
        return int(config.steps)
    shipped = _last_shipped(Path(config.out)) if _resuming(config) else 0
    return max(1, min(int(config.steps), int(config.max_steps) - shipped))


def _resuming(config: Any) -> bool:
    """Whether the learning run continues the run in its directory (as `trio_rl.learn` decides:
    checkpoints there, no ``--fresh``; whichever the trainer mode, since a torchrun or external
    trainer job resumes by itself beside the resumed orchestrator)."""
    return bool(config.resume and any((Path(config.out) / "checkpoints").glob("step_*.ckpt")))


def _wandb_init(metrics: Any, out: Path, file_config: Any) -> dict[str, Any]:
    """``wandb.init`` arguments of ``[metrics]``: project, name, entity, tags and the
    effective configuration (by section)."""
    init: dict[str, Any] = {
        "project": metrics.wandb_project,
        "name": metrics.wandb_name or out.name,
        "dir": str(out),
    }
    if metrics.wandb_entity is not None:
        init["entity"] = metrics.wandb_entity
    if metrics.wandb_tags is not None:
        init["tags"] = [t.strip() for t in metrics.wandb_tags.split(",") if t.strip()]
    if file_config is not None:
        init["config"] = attrs.asdict(file_config)
    return init


def _open_metric_sinks(
    metrics: Any, out: Path, file_config: Any = None, resume: bool = False
) -> Any:
    """The optional metrics sinks ``[metrics]`` asks for (TensorBoard, W&B, Prometheus), fed
    the same records as ``metrics.jsonl``; None when none is asked for. A missing extra is a
    one-line error naming the extra to install. ``resume``: the run continues the one in
    ``out``, and so does its W&B run (its id kept in ``out``)."""
    if not (metrics.tensorboard or metrics.wandb_project is not None) and (
        metrics.prometheus_port is None
    ):
        return None
    from .tools import metrics as sinks

    opened: list[Any] = []
    try:
        if metrics.tensorboard:
            opened.append(sinks.TensorBoardSink(out / "tensorboard"))
        if metrics.wandb_project is not None:
            opened.append(
                sinks.WandbSink(
                    id_file=out / sinks.WANDB_ID_FILE,
                    resume=resume,
                    **_wandb_init(metrics, out, file_config),
                )
            )
        if metrics.prometheus_port is not None:
            prometheus = sinks.PrometheusSink(metrics.prometheus_port, host=metrics.prometheus_host)
            print(
                f"metrics: Prometheus endpoint on port {prometheus.port} "
                f"(http://{metrics.prometheus_host}:{prometheus.port}/metrics)",
                flush=True,
            )
            opened.append(prometheus)
    except BaseException:
        sinks.FanOut(opened).close()
        raise
    return sinks.FanOut(opened)


def _store_learning_config(file_config: LearnRunConfig, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    store(attrs.evolve(file_config, run=attrs.evolve(file_config.run, out=str(out))), out)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
