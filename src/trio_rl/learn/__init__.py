"""The learning run: a tiny torch policy that visibly learns under asynchronous RL.

This package imports torch (an optional extra); nothing in the library imports it except the
CLI, whose ``trio-rl run`` (``python -m trio_rl run``) builds a :class:`LearnConfig` from its
configuration (:func:`config_from_file`) and calls :func:`run_learning`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..config import LearnRunConfig
from ..trainer import TrainerConfig as TrainerConfig
from . import tasks as tasks
from ._model import CharTransformer as CharTransformer
from ._model import ModelConfig as ModelConfig
from ._model import sequence_logprobs as sequence_logprobs
from ._policy import HFCausalLM as HFCausalLM
from ._policy import Policy as Policy
from ._policy import check_model_dir as check_model_dir
from ._task import TASKS as TASKS
from ._task import Task as Task
from ._task import Tokenizer as Tokenizer
from ._task import char_reward as char_reward
from ._task import make_prompts as make_prompts
from ._tiny import write_tiny_llama as write_tiny_llama
from ._trainer import TRAINER_KEYS as TRAINER_KEYS
from ._trainer import GRPOTrainer as GRPOTrainer
from ._trainer import StepStats as StepStats
from ._trainer import grpo_token_losses as grpo_token_losses
from ._trainer import grpo_token_terms as grpo_token_terms
from ._watcher import watch_weights as watch_weights
from ._weights import PublishedWeights as PublishedWeights
from ._weights import latest_weights as latest_weights
from ._weights import publish_weights as publish_weights
from .run import LearnConfig as LearnConfig
from .run import LearnResult as LearnResult
from .run import build_model as build_model
from .run import build_policy as build_policy
from .run import build_prompts as build_prompts
from .run import orchestrator_config as orchestrator_config
from .run import run_learning as run_learning
from .run import write_plot as write_plot


def config_from_file(config: LearnRunConfig) -> LearnConfig:
    """The :class:`LearnConfig` of a loaded ``trio-rl run`` configuration (``run.out`` unset: a
    fresh temporary directory)."""
    run, rollout, trainer = config.run, config.rollout, config.trainer
    out = Path(run.out) if run.out is not None else Path(tempfile.mkdtemp(prefix="trio-rl-learn-"))
    return LearnConfig(
        out=out,
        task=rollout.task,
        steps=run.steps,
        batch_groups=rollout.batch_groups,
        group_size=rollout.group_size,
        seed=run.seed,
        temperature=rollout.temperature,
        sink=config.sink.to_config(
            batch_size=rollout.batch_groups * rollout.group_size,
            scoring_temperature=rollout.temperature,
        ),
        rollout=rollout.to_config(routing_keys=config.inference.routing_keys),
        checkpoint=config.checkpoint.to_config(),
        max_async_level=rollout.max_async_level,
        trainer=trainer.to_config(),
        d_model=config.engine.d_model,
        n_layers=config.engine.n_layers,
        trainer_delay=trainer.delay,
        trainer_mode=trainer.mode,
        ranks=trainer.ranks,
        weights_keep=config.checkpoint.weights_keep,
        max_steps=run.max_steps,
        time_limit=run.time_limit,
        stop_at_reward=run.stop_at_reward,
        stop_window=run.stop_window,
        converged_after=run.converged_after,
        prompts=rollout.prompts,
        inference=config.inference,
        verbose=config.metrics.console,
        plot=config.metrics.plot,
        threads=config.publish.threads,
        fsync=config.transport.fsync,
        model=config.model,
        data=config.data,
        reward=config.reward,
        connect_timeout=trainer.connect_timeout,
        deterministic=run.deterministic,
        env=config.env.to_config(),
    )
