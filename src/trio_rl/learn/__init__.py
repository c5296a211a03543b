"""The learning run: a tiny torch policy that visibly learns under asynchronous RL.

This package imports torch (an optional extra); nothing in the library imports it except the
CLI. ``python -m trio_rl.learn`` runs :func:`main`; the CLI's default ``trio-rl run`` calls
:func:`run_learning` the same way.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import trio

from ._model import CharTransformer as CharTransformer
from ._model import ModelConfig as ModelConfig
from ._model import sequence_logprobs as sequence_logprobs
from ._task import TASKS as TASKS
from ._task import Task as Task
from ._task import Tokenizer as Tokenizer
from ._task import char_reward as char_reward
from ._task import make_prompts as make_prompts
from ._trainer import GRPOTrainer as GRPOTrainer
from ._trainer import StepStats as StepStats
from ._trainer import TrainerConfig as TrainerConfig
from ._trainer import grpo_token_losses as grpo_token_losses
from ._watcher import watch_weights as watch_weights
from ._weights import PublishedWeights as PublishedWeights
from ._weights import latest_weights as latest_weights
from ._weights import publish_weights as publish_weights
from .run import LearnConfig as LearnConfig
from .run import LearnResult as LearnResult
from .run import build_model as build_model
from .run import run_learning as run_learning
from .run import write_plot as write_plot


def parser() -> argparse.ArgumentParser:
    """The parser of ``python -m trio_rl.learn``."""
    p = argparse.ArgumentParser(prog="python -m trio_rl.learn", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the learning run's options to ``p`` (e.g. the CLI's ``run`` subcommand); turn the
    parsed namespace into a :class:`LearnConfig` with :func:`config_from_args`."""
    d = LearnConfig(out=Path("."))
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a fresh one)")
    p.add_argument("--task", choices=sorted(TASKS), default=d.task)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-groups", type=int, default=d.batch_groups)
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.trainer.lr)
    p.add_argument("--epochs", type=int, default=d.trainer.epochs, help="updates per batch")
    p.add_argument("--max-off-policy-steps", type=int, default=d.max_off_policy_steps)
    p.add_argument("--max-async-level", type=int, default=d.max_async_level)
    p.add_argument(
        "--trainer-delay", type=float, default=0.0, help="seconds a slow trainer waits per step"
    )
    p.add_argument(
        "--trainer", choices=["inprocess", "torchrun", "external"], default=d.trainer_mode
    )
    p.add_argument("--ranks", type=int, default=d.ranks, help="trainer ranks (torchrun)")
    p.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    p.add_argument(
        "--stop-at-reward", type=float, default=None, help="stop once 5 steps in a row reach it"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-plot", action="store_true")


def config_from_args(args: argparse.Namespace) -> LearnConfig:
    """The :class:`LearnConfig` of options added by :func:`add_arguments` (``--out`` unset: a
    fresh temporary directory)."""
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="trio-rl-learn-"))
    return LearnConfig(
        out=out,
        task=args.task,
        steps=args.steps,
        batch_groups=args.batch_groups,
        group_size=args.group_size,
        seed=args.seed,
        trainer=TrainerConfig(lr=args.lr, epochs=args.epochs),
        max_off_policy_steps=args.max_off_policy_steps,
        max_async_level=args.max_async_level,
        trainer_delay=args.trainer_delay,
        trainer_mode=args.trainer,
        ranks=args.ranks,
        time_limit=args.time_limit,
        stop_at_reward=args.stop_at_reward,
        plot=not args.no_plot,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the learning run, return 0."""
    args = parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    # the per-step line already shows the stale counter; the sink's warning would repeat it
    logging.getLogger("trio_rl.train").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    trio.run(run_learning, config_from_args(args))
    return 0
