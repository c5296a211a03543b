"""The configuration of ``trio-rl run`` (`LearnRunConfig`) and ``trio-rl simulate``
(`SimulateConfig`): one section per component.

``[rollout]``, ``[sink]``, ``[checkpoint]`` and the learning run's ``[trainer]`` are generated
from the library's own configs (:class:`~trio_rl.rollout.RolloutConfig`,
:class:`~trio_rl.sink.SinkConfig`, :class:`~trio_rl.sink.CheckpointConfig`,
:class:`~trio_rl.trainer.TrainerConfig`; see `config_section`), their defaults and checks
included; a command's own keys beside them are written here. The other defaults are the
commands' own; a test pins those the library's configs also hold to them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ..engines import (
    FLEET,
    OPENAI,
    SIMULATED,
    TORCH,
    Command,
    EngineKind,
    InferenceConfig,
    engine_kind,
)
from ..envs import EnvConfig
from ..errors import InvalidArgumentError
from ..evals import EvalConfig
from ..rollout import RolloutConfig
from ..sink import CheckpointConfig, SinkConfig
from ..trainer import TrainerConfig
from ..transport import transport_kind
from ._deploy import DataSection, ModelSection, RewardSection
from ._load import at_least, between, option, optional_positive_finite, positive_finite
from ._sections import (
    SIZED_ELSEWHERE,
    ConfigSection,
    EngineSection,
    command_sections,
    config_section,
    engine_section,
    section,
)

__all__ = ["Inference", "InferenceKeys", "LearnRunConfig", "SimulateConfig", "StepShape"]

Task = Literal["copy", "repeat", "reverse", "lookup"]


def _check_port(port: int | None, allowed: bool, name: str) -> None:
    """A port below 1024 (0 aside: a free one) is a privileged port, most likely a typo (80
    for 8000): refused unless the section allows it."""
    if port is not None and 0 < port < 1024 and not allowed:
        raise InvalidArgumentError(
            f"{name} {port} is below 1024 (a privileged port); set "
            f"allow_privileged_port = true to use it"
        )


def _registered_transport(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    transport_kind(value)  # an unknown name is an InvalidArgumentError listing the known ones


# no slots: a command's section gives a key of the step's shape its own default, which attrs
# sets on the instance (a slot of this base would shadow it)
@attrs.frozen(slots=False)
class StepShape(ConfigSection[RolloutConfig]):
    """``[rollout]``'s keys of both commands that are no knob of ``RolloutConfig``: the step's
    shape, ``batch_groups`` groups of ``group_size`` samples (the sink cuts batches of that)."""

    batch_groups: int = option(8, "groups per step", validator=at_least(1))
    group_size: int = option(8, "samples per group", validator=at_least(1))


# ------------------------------------------------------------------ trio-rl run (learning)


@attrs.frozen
class LearnRun:
    """The run as a whole: where it writes, how long it lasts, its seed."""

    out: str | None = option(
        None,
        "run directory (unset: runs/<YYYYmmdd-HHMMSS> under the current directory)",
        may_change=True,
    )
    steps: int = option(
        200,
        "steps to ship in this invocation (not a total: a resumed run ships this many more; "
        "the run's total across resumes is `max_steps`)",
        validator=at_least(1),
        may_change=True,
    )
    max_steps: int | None = option(
        None,
        "the last step of the run, a total across resumes: an invocation ships `steps` more "
        "but never past this one (unset: no limit)",
        validator=at_least(1),
        may_change=True,
    )
    seed: int = option(0, "seed of the model, the prompts and the sampling")
    time_limit: float | None = option(
        None,
        "stop after this many seconds even if not every step shipped (unset: no time limit)",
        validator=optional_positive_finite,
        may_change=True,
    )
    stop_at_reward: float | None = option(
        None,
        "stop once `stop_window` consecutive steps reach this mean reward (unset: no target)",
        may_change=True,
    )
    stop_window: int = option(5, "steps averaged by `stop_at_reward`", validator=at_least(1))
    converged_after: int = option(
        8,
        "end the run once this many batches' worth of groups in a row were pruned (equal "
        "rewards: GRPO has no signal left): converged at the maximum reward (or "
        "`stop_at_reward`), else collapsed",
        validator=at_least(1),
    )
    threads: int = option(
        1, "torch threads of this process", validator=at_least(1), may_change=True
    )
    log_level: Literal["debug", "info", "warning", "error"] = option(
        "info",
        "level of RUN_DIR/logs/run.log (the library's log records, the printed lines and one "
        "plain line per step); the terminal shows warnings (-v: info)",
        may_change=True,
    )
    deterministic: bool = option(
        False,
        "reproducible by seed: rollouts in lockstep with the in-process trainer, one torch "
        "thread (slower)",
    )


@attrs.frozen
class LearnEngine:
    """The policy served in-process by ``TorchEngine`` (the trainer trains the same model)."""

    d_model: int = option(64, "model width", validator=at_least(1))
    n_layers: int = option(3, "transformer layers", validator=at_least(1))


@attrs.frozen(slots=False)
class LearnRolloutKeys(StepShape):
    """``[rollout]``'s keys of the learning run that are no knob of ``RolloutConfig``: the
    task's prompts, the step's shape and the sampling temperature."""

    task: Task = option(  # noqa: RUF009
        "repeat", "the verifiable task (copy, repeat, reverse; lookup: a tool, two turns)"
    )
    prompts: int = option(4096, "prompts drawn from the task (cycled)", validator=at_least(1))
    max_async_level: int = option(
        1,
        "ship gate: step S ships once the policy version is >= S - 1 - this",
        validator=at_least(0),
    )
    temperature: float = option(1.0, "sampling temperature (0: greedy)", validator=at_least(0))


#: ``[rollout]`` of the learning run: its own keys and the knobs of
#: :class:`~trio_rl.rollout.RolloutConfig`. An unset rollout budget is one step's groups
#: here (``trio-rl run`` resolves it; the orchestrator's is two steps').
LearnRollout = config_section(
    RolloutConfig,
    "LearnRollout",
    "The data source and the rollout driver (trio_rl.rollout.RolloutConfig): the task's "
    "prompts, grouped and sampled.",
    base=LearnRolloutKeys,
    omit={"routing_keys": "inference.routing_keys with an inference fleet, else none"},
    meaning={
        "max_groups_in_flight": "rollout concurrency in groups, the budget B (unset: "
        "`batch_groups`)"
    },
    # GRPO scores a sample against the other samples of its group: two at least
    checks={"group_size": at_least(2)},
    group_size=16,
)

#: ``[sink]`` of the learning run: the knobs of :class:`~trio_rl.sink.SinkConfig`. The learning
#: run keeps at most one version of staleness by default: its tiny model moves fast, and samples
#: older than that train it the wrong way.
LearnSink = config_section(
    SinkConfig,
    "LearnSink",
    "The train sink (trio_rl.sink.SinkConfig): scoring, pruning and the staleness filter.",
    omit=SIZED_ELSEWHERE,
    # The trainer scores every token at its stamped temperature: the stamp is the sampling
    # temperature by construction, and `trio-rl run` refuses another value (exit 2).
    derived={"scoring_temperature": "`rollout.temperature`"},
    meaning={
        "scoring_temperature": "temperature stamped on every trained token, the one the "
        "trainer scores it at: the sampling temperature, so a value other than "
        "`rollout.temperature` is an error",
        "scoring_env_temperatures": "the stamped temperature per env name; the learning run "
        "samples every env at `rollout.temperature`, so a value other than it is an error",
    },
    max_off_policy_steps=1,
)


@attrs.frozen
class Publish:
    """The publisher, which finalizes batches in worker threads."""

    threads: int = option(
        4,
        "worker threads the run's one capacity limiter lends (finalizing, sending, "
        "checkpoints; with `trio-rl run`, the in-process trainer's reads, decoding, training)",
        validator=at_least(1),
        may_change=True,
    )


@attrs.frozen
class LearnTransport:
    """How batches reach the trainer: files in the run directory."""

    kind: Literal["files"] = option("files", "the transport (the learning run uses files)")
    fsync: bool = option(
        False, "fsync every batch file (durability against power loss)", may_change=True
    )


@attrs.frozen
class LearnTrainerKeys(ConfigSection[TrainerConfig]):
    """``[trainer]``'s keys that are no knob of ``TrainerConfig``: how the trainer is run."""

    mode: Literal["inprocess", "torchrun", "external"] = option(
        "inprocess",
        "inprocess: worker threads of this process; torchrun: a DDP job it launches; "
        "external: the same job started by hand, `trio-rl trainer CONFIG.toml` (under "
        "`torchrun` for several ranks or machines), sharing `run.out`",
    )
    connect_timeout: float = option(
        300.0,
        "seconds the run waits for a torchrun or external trainer job to start (its "
        "`trainer/ready` file in `run.out`) before it fails; logged while it waits",
        validator=positive_finite,
        may_change=True,
    )
    ranks: int = option(1, "data-parallel ranks (torchrun, external)", validator=at_least(1))
    delay: float = option(
        0.0,
        "seconds the in-process trainer waits per step (forces staleness)",
        validator=at_least(0),
        may_change=True,
    )


#: ``[trainer]`` of the learning run: how the reference GRPO trainer is run, and the knobs of
#: its :class:`~trio_rl.trainer.TrainerConfig`.
LearnTrainer = config_section(
    TrainerConfig,
    "LearnTrainer",
    "The reference GRPO trainer (trio_rl.trainer.TrainerConfig) and how it is run.",
    base=LearnTrainerKeys,
    omit={"betas": "AdamW's betas, TrainerConfig's default: no key"},
)


@attrs.frozen
class LearnCheckpointKeys(ConfigSection[CheckpointConfig]):
    """``[checkpoint]``'s key of the learning run that is no knob of ``CheckpointConfig``."""

    weights_keep: int = option(3, "published weight versions kept", validator=at_least(1))


LearnCheckpoint = config_section(
    CheckpointConfig,
    "LearnCheckpoint",
    "What is kept on disk: the orchestrator's checkpoints (trio_rl.sink.CheckpointConfig) "
    "and the published weights.",
    base=LearnCheckpointKeys,
)


#: ``[env]``: multi-turn episodes (trio_rl.envs.EnvConfig): the environment and its budgets.
LearnEnv = config_section(
    EnvConfig,
    "LearnEnv",
    "Multi-turn episodes (trio_rl.envs.EnvConfig): the environment the policy plays each "
    "record with, and the episode's budgets (docs/environments.md).",
)


@attrs.frozen
class Metrics:
    """What a person watches: the per-step console lines, ``metrics.jsonl`` (always written) and
    the plot."""

    console: bool = option(True, "show every step", may_change=True)
    display: Literal["auto", "plain", "table"] = option(
        "auto",
        "auto: a live table on a terminal with `rich` installed, else one plain line per step "
        "(fit for a log file); plain; table",
        may_change=True,
    )
    plot: bool = option(True, "draw `plot.png` into the run directory at the end", may_change=True)
    tensorboard: bool = option(
        False,
        "also write every record as TensorBoard scalars under RUN_DIR/tensorboard "
        "(trio-rl[tensorboard])",
        may_change=True,
    )
    wandb_project: str | None = option(
        None,
        "also log every record to a Weights & Biases run of this project, its files under "
        "RUN_DIR/wandb (trio-rl[wandb]; WANDB_MODE=offline keeps it local for `wandb sync`)",
        may_change=True,
    )
    wandb_name: str | None = option(
        None, "the W&B run's name (unset: the run directory's name)", may_change=True
    )
    wandb_entity: str | None = option(
        None, "the W&B entity (team or user) of the run (unset: your default)", may_change=True
    )
    wandb_tags: str | None = option(
        None, "the W&B run's tags, comma-separated (`baseline,lr-sweep`)", may_change=True
    )
    prometheus_port: int | None = option(
        None,
        "also serve the latest record's numeric fields as Prometheus gauges on this port "
        "(0: a free one, logged; trio-rl[prometheus]); below 1024 only with "
        "`allow_privileged_port`",
        validator=between(0, 65535),
        may_change=True,
    )
    prometheus_host: str = option(
        "127.0.0.1",
        "the address the Prometheus endpoint listens on (0.0.0.0: every interface)",
        may_change=True,
    )
    allow_privileged_port: bool = option(
        False, "allow a `prometheus_port` below 1024 (a privileged port)", may_change=True
    )

    def __attrs_post_init__(self) -> None:
        _check_port(self.prometheus_port, self.allow_privileged_port, "prometheus_port")


def _engine_of(command: Command) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
        if value is not None:  # an unknown name is an InvalidArgumentError listing the known
            engine_kind(value, command)

    return check


_OPTIONS = (
    "a plug-in engine's knobs (the fields of its config class), e.g. {reply = 3}; the "
    "built-in engines' knobs are keys of this section"
)


@attrs.frozen
class InferenceKeys(EngineSection):
    """``[inference]``'s keys that are no knob of the fleet: which engine, the routing, the
    logprob check."""

    engine: str | None = option(
        None,
        "the engine, by its registered name (trio_rl.engines.register_engine): torch (the "
        'policy in-process), fleet, or a plug-in\'s "package.module:NAME" (unset: fleet with '
        "`urls` or `launch`, else torch)",
        validator=_engine_of("run"),
    )
    routing_keys: Literal["none", "sample", "group"] = option(
        "group",
        "group: every sample of a group goes to one server (its prompt in that server's "
        "prefix cache; sent as X-SMG-Routing-Key); sample: a key per sample; none",
    )
    check_logprobs: int = option(
        0,
        "after every weight reload, sample this many of the run's prompts (2 completions each) "
        "from the servers and print the largest |server - trainer| logprob gap of those tokens, "
        "the trainer's model scoring them with the published weights (a float32 model: <= 1e-4); "
        "0: off",
        validator=at_least(0),
        may_change=True,
    )
    options: Mapping[str, Any] = option({}, _OPTIONS, may_change=True)

    def __attrs_post_init__(self) -> None:
        self.engine_config(FLEET, "inference")  # the fleet's checks across its knobs
        self.engine_config(self.kind, "inference")  # a plug-in's options, checked by its class

    def fleet_config(self) -> InferenceConfig:
        """The fleet's knobs of this section (what :func:`~trio_rl.engines.open_inference`
        takes, as ``attrs.asdict(...)``)."""
        config: InferenceConfig = self.engine_config(FLEET, "inference")
        return config

    @property
    def kind(self) -> EngineKind:
        """The engine this section names (unset: the fleet with servers, else torch)."""
        if self.engine is not None:
            return engine_kind(self.engine, "run")
        return FLEET if self.urls or self.launch else TORCH


#: ``[inference]`` of the learning run: which engine, and the knobs of the built-in ones (the
#: fleet's :class:`~trio_rl.engines.InferenceConfig`; the torch engine has none).
Inference = engine_section(
    "Inference",
    "The engine: the policy in-process (torch), an inference fleet "
    "(trio_rl.engines.InferenceConfig: OpenAI-compatible servers already running at `urls`, "
    "or `launch` vLLM servers started as child processes of the run), or a plug-in.",
    base=InferenceKeys,
    kinds=(FLEET, TORCH),
)


#: ``[eval]`` of the learning run (and of ``trio-rl eval``): the knobs of
#: :class:`~trio_rl.evals.EvalConfig`.
LearnEval = config_section(
    EvalConfig,
    "LearnEval",
    "Held-out evaluation (trio_rl.evals.EvalConfig): avg@k, pass@k and pass^k of one policy "
    "version, every interval steps and by trio-rl eval.",
)


@attrs.frozen(field_transformer=command_sections)
class LearnRunConfig:
    """``trio-rl run``: the learning run."""

    run: LearnRun = section()
    engine: LearnEngine = section()
    rollout: LearnRolloutKeys = section(LearnRollout)
    sink: ConfigSection[SinkConfig] = section(LearnSink)
    publish: Publish = section()
    transport: LearnTransport = section()
    trainer: LearnTrainerKeys = section(LearnTrainer)
    checkpoint: LearnCheckpointKeys = section(LearnCheckpoint)
    metrics: Metrics = section()
    model: ModelSection = section()
    data: DataSection = section()
    reward: RewardSection = section()
    inference: InferenceKeys = section(Inference)
    eval: ConfigSection[EvalConfig] = section(LearnEval)
    env: ConfigSection[EnvConfig] = section(LearnEnv)


# ------------------------------------------------------------------ trio-rl simulate


@attrs.frozen
class SimRun:
    """The run as a whole."""

    out: str | None = option(
        None, "run directory (unset: a temporary one, removed at the end)", may_change=True
    )
    steps: int = option(
        6,
        "steps to ship in this invocation (not a total: a resumed run ships this many more; "
        "the run's total across resumes is `max_steps`)",
        validator=at_least(1),
        may_change=True,
    )
    seed: int = option(0, "seed of the engine, the groups and the prompts")


@attrs.frozen
class SimEngineKeys(EngineSection):
    """``[engine]``'s keys of ``trio-rl simulate`` that are no knob of an engine."""

    kind: str = option(
        "simulated",
        "the engine, by its registered name (trio_rl.engines.register_engine): simulated, "
        "openai (an OpenAI-compatible server at `url`: vLLM, SGLang), or a plug-in's "
        '"package.module:NAME"',
        validator=_engine_of("simulate"),
    )
    max_tokens: int = option(2048, "completion cap", validator=at_least(1))
    options: Mapping[str, Any] = option({}, _OPTIONS, may_change=True)

    def __attrs_post_init__(self) -> None:
        # the engine's config, built to check it (a plug-in's options, by its own class)
        self.engine_config(engine_kind(self.kind, "simulate"), "engine")


#: ``[engine]`` of ``trio-rl simulate``: which engine, and the knobs of the built-in ones.
SimEngine = engine_section(
    "SimEngine",
    "The engine: simulated (straggler latencies, no model), an OpenAI-compatible server, or a "
    "plug-in.",
    base=SimEngineKeys,
    kinds=(SIMULATED, OPENAI),
)


SimRollout = config_section(
    RolloutConfig,
    "SimRollout",
    "The rollout driver (trio_rl.rollout.RolloutConfig).",
    base=StepShape,
    omit={
        "routing_keys": "group with engine.kind = openai (one prefix cache per group), else none"
    },
)

SimSink = config_section(
    SinkConfig,
    "SimSink",
    "The train sink (trio_rl.sink.SinkConfig): scoring, pruning and the staleness filter.",
    omit=SIZED_ELSEWHERE,
)


@attrs.frozen
class SimTransport:
    """How batches reach the trainer ranks."""

    kind: str = option(
        "files",
        "the transport, by its registered name (trio_rl.transport.register_transport): files "
        "(in the run directory), zmq or memory (this process)",
        validator=_registered_transport,
    )
    port: int = option(
        0,
        "ZeroMQ data port; READY uses port+1 (0: pick a free pair); below 1024 only with "
        "`allow_privileged_port`",
        validator=between(0, 65534),
        may_change=True,
    )
    allow_privileged_port: bool = option(
        False, "allow a `port` below 1024 (a privileged port)", may_change=True
    )

    def __attrs_post_init__(self) -> None:
        _check_port(self.port, self.allow_privileged_port, "port")


@attrs.frozen
class SimTrainer:
    """The in-process trainer ranks that read every batch back."""

    ranks: int = option(2, "data-parallel ranks", validator=at_least(1))


SimCheckpoint = config_section(
    CheckpointConfig,
    "SimCheckpoint",
    "The orchestrator's checkpoints (trio_rl.sink.CheckpointConfig; ``checkpoints/`` in the "
    "run directory).",
)


@attrs.frozen(field_transformer=command_sections)
class SimulateConfig:
    """``trio-rl simulate``: the pipeline on a simulated engine."""

    run: SimRun = section()
    engine: SimEngineKeys = section(SimEngine)
    rollout: StepShape = section(SimRollout)
    sink: ConfigSection[SinkConfig] = section(SimSink)
    publish: Publish = section()
    transport: SimTransport = section()
    trainer: SimTrainer = section()
    checkpoint: ConfigSection[CheckpointConfig] = section(SimCheckpoint)
