"""The learning run: a tiny torch policy that visibly learns under asynchronous RL.

This package imports torch (an optional extra); nothing in the library imports it except the
CLI, whose ``trio-rl run`` (``python -m trio_rl run``) loads its configuration
(:class:`~trio_rl.config.LearnRunConfig`, one class per section) and calls
:func:`run_learning` with it as it is.
"""

from __future__ import annotations

from ..trainer import TrainerConfig as TrainerConfig
from . import tasks as tasks
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
