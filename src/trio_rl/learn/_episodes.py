"""The learning run's episodes: ``[env] function`` played for every sample."""

from __future__ import annotations

from typing import Any

import trio

from ..engines import Engine, SamplingParams
from ..envs import EnvConfig, EpisodeRunner, import_env
from ._policy import Policy

__all__ = ["ENV_TASKS", "env_function", "episode_runner"]

#: The built-in tasks that are environments: their default ``[env] function``.
ENV_TASKS = frozenset({"lookup"})


def env_function(env: EnvConfig, task: str, model_path: str | None) -> str | None:
    """The environment a run plays: ``[env] function``, else the built-in task's when the task
    is an environment (and the policy is its character model); None: single-turn samples."""
    if env.function is not None:
        return env.function
    if model_path is None and task in ENV_TASKS:
        return f"trio_rl.learn.tasks:{task}"
    return None


def episode_runner(
    env: EnvConfig,
    function: str | None,
    engine: Engine,
    policy: Policy,
    params: SamplingParams,
    seq_len: int,
    limiter: trio.CapacityLimiter,
) -> EpisodeRunner | None:
    """The generate function that plays ``function`` for each sample (None without one): every
    turn sampled with ``params`` (``max_tokens`` caps a turn), the episode within ``seq_len``
    and the model's context."""
    if function is None:
        return None
    codec: Any = policy.codec
    return EpisodeRunner(
        engine,
        import_env(function),
        codec,
        params,
        env,
        max_len=min(seq_len, policy.max_len),
        chat=policy.chat,
        limiter=limiter,
    )
