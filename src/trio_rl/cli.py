"""The ``trio-rl`` command: its parser and the dispatch to each command's module.

- ``trio-rl run`` and ``trio-rl trainer``: the learning run and its trainer job
  (`trio_rl._learn_cmd`, over `trio_rl.learn`);
- ``trio-rl simulate``: the pipeline on a simulated engine (`trio_rl.simulate`);
- ``trio-rl config``: the effective configuration as TOML;
- ``trio-rl inspect``, ``plot``, ``watch``: the operations tools (`trio_rl.tools`).

The configuration flags are shorthands for ``--set`` of one configuration path
(`trio_rl._flags`); what the jobs share (the signal watcher, the run log) is in `trio_rl._jobs`,
and a failure becomes one line on stderr and an exit status in `trio_rl._failures`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ._failures import FirstFailures, Quiet, report_failure
from ._flags import RUN_FLAGS, SIMULATE_FLAGS, add_config_arguments, layers
from ._jobs import STARTUP, _UsageError
from ._learn_cmd import eval_command, run_command, trainer_command
from .config import LearnRunConfig, SimulateConfig, load, to_toml
from .simulate import orchestrator_config as orchestrator_config
from .simulate import simulate_command

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _version() -> str:
    try:
        return importlib.metadata.version("trio-rl")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return "unknown"


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
    add_config_arguments(learning, LearnRunConfig, RUN_FLAGS, resumable=True)
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
    add_config_arguments(trainer, LearnRunConfig, (), resumable=False)
    ev = sub.add_parser(
        "eval",
        help="one held-out eval of the [eval] section, offline: of published weights, a model "
        "directory or the initial policy (needs torch)",
        description="One eval of the configuration's [eval] section (held-out prompts, k "
        "samples each: avg@k, pass@1, pass@k, pass^k) against the engines it names "
        "([inference]: the policy in-process, urls or launch). Prints a table and appends the "
        "record to --out; a progress bar with an ETA on stderr. Exit status 0; 2 on bad input.",
    )
    add_config_arguments(ev, LearnRunConfig, (), resumable=False)
    which = ev.add_mutually_exclusive_group()
    which.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="published weights to evaluate, RUN_DIR/weights/step_S (the eval's step is S)",
    )
    which.add_argument(
        "--model", type=Path, default=None, help="a Hugging Face model directory to evaluate"
    )
    ev.add_argument(
        "--out",
        type=Path,
        default=Path("eval.jsonl"),
        help="the JSONL file the record is appended to (default ./eval.jsonl)",
    )
    run = sub.add_parser(
        "simulate",
        help="a simulated rollout run: throughput, backfill and fault injection without a model",
        description="The pipeline on a simulated engine. Every step is checkpointed; run it "
        "again with the same --out and it resumes where it stopped (--steps more steps: "
        "not a total). The first SIGINT or SIGTERM checkpoints the work in progress and "
        "exits 130 / 143; a second exits at once. A step line's 'reward (none new)': no "
        "group was scored since the previous step (it shipped samples queued before).",
    )
    add_config_arguments(run, SimulateConfig, SIMULATE_FLAGS, resumable=True)
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
    add_config_arguments(show, LearnRunConfig, RUN_FLAGS, resumable=True)
    show.add_argument("--fresh", action="store_true", help="accepted as `run` does; no effect")
    _add_tools(sub)
    return parser


def _add_tools(sub: Any) -> None:
    """The operations tools' commands (each module adds its own arguments)."""
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a failure the user can cause is one line on stderr and exit status 1
    (usage errors, a bad configuration included: 2); ``-v`` adds the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    STARTUP.hold()
    try:
        try:
            return _main_guarded(argv)
        finally:
            # A signal still held (the command ended before its loop) arrives here, where the
            # handler below sees its KeyboardInterrupt.
            STARTUP.release()
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
    handler.setFormatter(logging.Formatter(fmt) if args.verbose else Quiet(fmt))
    if not args.verbose:
        handler.addFilter(FirstFailures())
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    try:
        return _main(args)
    except BrokenPipeError:
        # `trio-rl inspect RUN | head`: the reader left; say nothing more (Python would print
        # an error while flushing stdout at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        return report_failure(args, exc)


def _show_config(args: argparse.Namespace) -> int:
    """``trio-rl config``: the effective configuration as TOML."""
    STARTUP.release()  # no event loop: Ctrl-C is a KeyboardInterrupt
    schema: type[Any] = SimulateConfig if args.target == "simulate" else LearnRunConfig
    flags = RUN_FLAGS if schema is LearnRunConfig else ()
    if schema is SimulateConfig and any(getattr(args, f.dest, None) for f in RUN_FLAGS):
        given = [f.flag for f in RUN_FLAGS if getattr(args, f.dest, None) is not None]
        raise _UsageError(f"{', '.join(given)}: flags of `run`; with --for simulate use --set")
    cfg, _ = load(schema, args.configs, layers(schema, args, flags))
    sys.stdout.write(to_toml(cfg))
    return 0


def _main(args: argparse.Namespace) -> int:
    if args.command == "config":
        return _show_config(args)
    if args.command == "trainer":
        return trainer_command(args)
    if args.command == "eval":
        return eval_command(args)
    if args.command == "run":
        return run_command(args)
    if args.command == "simulate":
        return simulate_command(args)
    if hasattr(args, "tool"):
        STARTUP.release()  # the tools handle their own KeyboardInterrupt (watch --follow: 130)
        return int(args.tool.run(args))
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
