"""The learning run: a tiny torch policy that visibly learns under asynchronous RL.

This package needs torch (an optional extra); nothing in the library imports it except the
CLI, whose ``trio-rl run`` (``python -m trio_rl run``) loads its configuration
(:class:`~trio_rl.config.LearnRunConfig`, one class per section) and calls
:func:`run_learning` with it as it is.

Importing the package imports no torch: its names load on first use (module ``__getattr__``).
The built-in tasks' rewards (``trio_rl.learn.tasks``) run in reward worker processes, which
import them by name; with torch imported on the way, each worker process took 3 s to start
before it could score a sample (a learning run's first step waited for it), against 0.3 s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import tasks as tasks

if TYPE_CHECKING:
    from ..trainer import TrainerConfig as TrainerConfig
    from ._evals import eval_line as eval_line
    from ._grpo import TRAINER_KEYS as TRAINER_KEYS
    from ._grpo import GRPOTrainer as GRPOTrainer
    from ._grpo import StepStats as StepStats
    from ._grpo import grpo_token_losses as grpo_token_losses
    from ._grpo import grpo_token_terms as grpo_token_terms
    from ._model import CharTransformer as CharTransformer
    from ._model import ModelConfig as ModelConfig
    from ._model import sequence_logprobs as sequence_logprobs
    from ._offline import ProgressBar as ProgressBar
    from ._offline import evaluate_offline as evaluate_offline
    from ._policy import HFCausalLM as HFCausalLM
    from ._policy import Policy as Policy
    from ._policy import check_model_dir as check_model_dir
    from ._settings import build_model as build_model
    from ._settings import build_policy as build_policy
    from ._settings import build_prompts as build_prompts
    from ._settings import orchestrator_config as orchestrator_config
    from ._settings import sink_config as sink_config
    from ._task import TASKS as TASKS
    from ._task import Task as Task
    from ._task import Tokenizer as Tokenizer
    from ._task import char_reward as char_reward
    from ._task import make_prompts as make_prompts
    from ._tiny import write_tiny_llama as write_tiny_llama
    from ._watcher import watch_weights as watch_weights
    from ._weights import PublishedWeights as PublishedWeights
    from ._weights import latest_weights as latest_weights
    from ._weights import publish_weights as publish_weights
    from .run import LearnResult as LearnResult
    from .run import run_learning as run_learning
    from .run import write_plot as write_plot

#: each public name and the module it is loaded from on first use
_LAZY = {
    "TrainerConfig": "..trainer",
    "eval_line": "._evals",
    "TRAINER_KEYS": "._grpo",
    "GRPOTrainer": "._grpo",
    "StepStats": "._grpo",
    "grpo_token_losses": "._grpo",
    "grpo_token_terms": "._grpo",
    "CharTransformer": "._model",
    "ModelConfig": "._model",
    "sequence_logprobs": "._model",
    "ProgressBar": "._offline",
    "evaluate_offline": "._offline",
    "HFCausalLM": "._policy",
    "Policy": "._policy",
    "check_model_dir": "._policy",
    "build_model": "._settings",
    "build_policy": "._settings",
    "build_prompts": "._settings",
    "orchestrator_config": "._settings",
    "sink_config": "._settings",
    "TASKS": "._task",
    "Task": "._task",
    "Tokenizer": "._task",
    "char_reward": "._task",
    "make_prompts": "._task",
    "write_tiny_llama": "._tiny",
    "watch_weights": "._watcher",
    "PublishedWeights": "._weights",
    "latest_weights": "._weights",
    "publish_weights": "._weights",
    "LearnResult": ".run",
    "run_learning": ".run",
    "write_plot": ".run",
}


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
