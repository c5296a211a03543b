"""The learning run's engine, by ``[inference]`` (`~trio_rl.engines.engine_kind`): opened on
the run's policy, and the weight loader the watcher feeds every published version (with
``[inference] check_logprobs``, checked against the trainer's model after each reload)."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
import trio

from ..config import LearnRunConfig
from ..engines import Engine, EngineKind, EngineSetup, WeightLoader
from ..errors import InvalidArgumentError
from ..rundir import RunDirectory
from ..samples import PolicyVersion, Prompt
from ._logprob_check import LogprobCheck
from ._policy import Policy
from ._settings import run_directory
from ._weights import latest_weights

__all__ = ["open_engine", "weight_loader"]

logger = logging.getLogger("trio_rl.learn")


@asynccontextmanager
async def open_engine(
    config: LearnRunConfig, policy: Policy, trained: PolicyVersion
) -> AsyncIterator[Engine]:
    """The engine ``[inference]`` names, open, serving a copy of the policy's model (the
    in-process engine) or ``[model] path`` (servers), at version ``trained``; a resumed run's
    engine first loads the trainer's newest published weights."""
    kind = config.inference.kind
    out = run_directory(config)
    weights = None
    if trained and kind.loads_weights:
        latest = await trio.to_thread.run_sync(latest_weights, RunDirectory(out).weights)
        weights = None if latest is None else (latest.path, latest.version)
    setup = EngineSetup(
        out,
        log_dir=RunDirectory(out).inference_logs,
        seed=config.run.seed,
        policy_version=trained,
        model=copy.deepcopy(policy.model).eval(),
        eos_token_id=policy.eos_token_id,
        max_len=policy.max_len,
        model_path=config.model.path,
        deterministic=config.run.deterministic,
        weights=weights,
    )
    async with kind.open(setup, config.inference.engine_config(kind, "inference")) as engine:
        yield engine


def weight_loader(
    config: LearnRunConfig,
    kind: EngineKind,
    engine: Engine,
    model: torch.nn.Module,
    prompts: list[Prompt],
    limiter: trio.CapacityLimiter,
) -> WeightLoader:
    """The watcher's loader: the engine, or with ``[inference] check_logprobs`` the engine
    checked against a copy of the policy model after every reload."""
    if not kind.loads_weights or not isinstance(engine, WeightLoader):
        raise InvalidArgumentError(
            f"engine {kind.name!r} loads no weights: the learning run trains its policy"
        )
    if not config.inference.check_logprobs:
        return engine

    def report(line: str) -> None:
        logger.info("%s", line)
        if config.metrics.console:
            print(line, flush=True)

    return LogprobCheck(
        engine,
        copy.deepcopy(model).eval(),
        [p.tokens for p in prompts[: config.inference.check_logprobs]],
        max_tokens=config.data.max_tokens,
        limiter=limiter,
        report=report,
    )
