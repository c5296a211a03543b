"""What the learning run derives from its configuration (`~trio_rl.config.LearnRunConfig`,
read as it is: every key is declared once, in its section's class): the run directory, the
policy, the prompts, the sink's and the orchestrator's configs, the reward's spec, and the
``run.json`` a torchrun or external trainer job reads the configuration back from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from ..config import LearnRunConfig, configure, flatten
from ..engines import SamplingParams
from ..errors import InvalidArgumentError
from ..orchestrator import OrchestratorConfig, check_sink_fits_step
from ..rollout import RolloutConfig, read_records
from ..samples import Prompt
from ..sink import SinkConfig
from ._model import CharTransformer
from ._policy import Policy, load_policy, record_prompts
from ._task import TASKS, Tokenizer
from .tasks import task_records

__all__ = [
    "build_model",
    "build_policy",
    "build_prompts",
    "completion_cap",
    "from_run_json",
    "orchestrator_config",
    "reward_function",
    "run_directory",
    "run_json",
    "sink_config",
]


def run_directory(config: LearnRunConfig) -> Path:
    """``run.out``: the learning run needs its directory (the CLI sets one when unset)."""
    if config.run.out is None:
        raise InvalidArgumentError("the learning run needs its run directory (run.out)")
    return Path(config.run.out)


def reward_function(config: LearnRunConfig) -> str:
    """``[reward] function``, or the built-in task's (``trio_rl.learn.tasks:<task>``)."""
    return config.reward.function or f"trio_rl.learn.tasks:{config.rollout.task}"


def uses_fleet(config: LearnRunConfig) -> bool:
    """Whether ``[inference]`` asks for an inference fleet (else the in-process engine)."""
    return bool(config.inference.urls or config.inference.launch)


def sink_config(config: LearnRunConfig) -> SinkConfig:
    """The train sink's config: ``[sink]``, cutting one step's samples per batch and stamping
    ``rollout.temperature``, the sampling temperature, on every trained token."""
    rollout = config.rollout
    sink = config.sink.to_config(
        batch_size=rollout.batch_groups * rollout.group_size,
        scoring_temperature=rollout.temperature,
    )
    check_sink_fits_step("LearnRunConfig", rollout.batch_groups, rollout.group_size, sink)
    check_stamped_temperature(rollout.temperature, sink)
    return sink


def check_stamped_temperature(temperature: float, sink: SinkConfig) -> None:
    """The sink stamps ``temperature``, the one the run samples at, on every trained token,
    else `InvalidArgumentError`: the trainer scores each token at its stamped temperature, and
    a token sampled at another would give a wrong importance ratio and KL."""
    scoring = sink.scoring
    if scoring.temperature != temperature:
        raise InvalidArgumentError(
            f"sink.scoring_temperature is {scoring.temperature:g}, but the run samples at "
            f"temperature {temperature:g} (rollout.temperature): the trainer would score the "
            "tokens at another temperature than they were sampled at"
        )
    other = {env: t for env, t in scoring.env_temperatures.items() if t != temperature}
    if other:
        raise InvalidArgumentError(
            f"sink.scoring_env_temperatures stamps {other}, but the run samples every env at "
            f"temperature {temperature:g} (rollout.temperature)"
        )


def rollout_config(config: LearnRunConfig) -> RolloutConfig:
    """``[rollout]``'s driver knobs: an unset ``max_groups_in_flight`` is one step's groups;
    ``[inference] routing_keys`` applies with a fleet (the in-process engine is one server)."""
    rollout = config.rollout.to_config(
        routing_keys=config.inference.routing_keys if uses_fleet(config) else "none"
    )
    if rollout.max_groups_in_flight is None:
        rollout = attrs.evolve(rollout, max_groups_in_flight=config.rollout.batch_groups)
    return rollout


def orchestrator_config(
    config: LearnRunConfig, max_tokens: int, *, stale_admission: bool = True
) -> OrchestratorConfig:
    """The :class:`OrchestratorConfig` of the learning run ``config``, its completions capped
    at ``max_tokens`` (:func:`completion_cap`)."""
    return OrchestratorConfig(
        batch_groups=config.rollout.batch_groups,
        group_size=config.rollout.group_size,
        rollout=rollout_config(config),
        sink=sink_config(config),
        checkpoint=config.checkpoint.to_config(),
        max_async_level=config.rollout.max_async_level,
        stale_admission=stale_admission,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=config.rollout.temperature),
        seed=config.run.seed,
        seq_len=1024,
        lockstep=config.run.deterministic,
    )


def build_policy(config: LearnRunConfig) -> Policy:
    """The run's initial policy: ``[model] path`` loaded with transformers, or the task's
    character model (seeded by ``run.seed``: every process builds the same one)."""
    return load_policy(
        model_path=config.model.path,
        task=config.rollout.task,
        seed=config.run.seed,
        d_model=config.engine.d_model,
        n_layers=config.engine.n_layers,
    )


def build_model(config: LearnRunConfig) -> tuple[CharTransformer, Tokenizer]:
    """The task's initial character model and its tokenizer."""
    policy = load_policy(
        model_path=None,
        task=config.rollout.task,
        seed=config.run.seed,
        d_model=config.engine.d_model,
        n_layers=config.engine.n_layers,
    )
    assert isinstance(policy.model, CharTransformer)
    return policy.model, TASKS[config.rollout.task].tokenizer


def completion_cap(config: LearnRunConfig, policy: Policy) -> int:
    """``max_tokens`` of every sample: ``[data] max_tokens`` with a data file or a model
    directory, else the built-in task's longest answer plus ``<eos>``."""
    if config.data.prompts is not None or config.model.path is not None:
        return config.data.max_tokens
    return policy.max_tokens


def build_prompts(config: LearnRunConfig, policy: Policy) -> list[Prompt]:
    """The run's prompts: the records of ``[data] prompts``, or ``rollout.prompts`` records of
    the built-in task; each record is its prompt's label (what the reward gets). Blocking."""
    if config.data.prompts is not None:
        records = read_records(config.data.prompts)
        where = config.data.prompts
    else:
        task = config.rollout.task
        records = task_records(task, config.rollout.prompts, config.run.seed)
        where = f"task {task!r}"
    return record_prompts(records, policy, where, completion_cap(config, policy))


#: The keys of ``run.json`` ``trio-rl inspect`` shows, by the configuration key they are.
SUMMARY_KEYS = {
    "task": "rollout.task",
    "steps": "run.steps",
    "batch_groups": "rollout.batch_groups",
    "group_size": "rollout.group_size",
    "ranks": "trainer.ranks",
    "trainer_mode": "trainer.mode",
    "seed": "run.seed",
}


def run_json(config: LearnRunConfig) -> dict[str, Any]:
    """``run.json``: the run's summary (`SUMMARY_KEYS`) and its whole configuration by key."""
    keys = flatten(config)
    return {**{name: keys[key] for name, key in SUMMARY_KEYS.items()}, "config": keys}


def from_run_json(raw: dict[str, Any], where: str) -> LearnRunConfig:
    """The configuration `run_json` wrote (``where`` names the file in errors)."""
    return configure(LearnRunConfig, raw["config"], where)
