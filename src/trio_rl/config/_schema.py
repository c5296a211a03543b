"""The configuration of ``trio-rl run`` (`LearnRunConfig`) and ``trio-rl simulate``
(`SimulateConfig`): one section per component.

``[rollout]``, ``[sink]``, ``[checkpoint]`` and the learning run's ``[trainer]`` are generated
from the library's own configs (:class:`~trio_rl.rollout.RolloutConfig`,
:class:`~trio_rl.train.SinkConfig`, :class:`~trio_rl.train.CheckpointConfig`,
:class:`~trio_rl.trainer.TrainerConfig`; see `config_section`), their defaults and checks
included; a command's own keys beside them are written here. The other defaults are the
commands' own; a test pins those the library's configs also hold to them."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ..envs import EnvConfig
from ..errors import InvalidArgumentError
from ..rollout import RolloutConfig
from ..train import CheckpointConfig, SinkConfig
from ..trainer import TrainerConfig
from ..transport import transport_kind
from ._deploy import DataSection, ModelSection, RewardSection
from ._load import at_least, between, option, positive
from ._sections import SIZED_ELSEWHERE, ConfigSection, config_section

__all__ = ["Inference", "LearnRunConfig", "SimulateConfig"]

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
        "steps to ship in this invocation (not a total: a resumed run ships this many more)",
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
        "stop after this many seconds even if not every step shipped",
        validator=positive,
        may_change=True,
    )
    stop_at_reward: float | None = option(
        None, "stop once `stop_window` consecutive steps reach this mean reward", may_change=True
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


@attrs.frozen
class LearnRolloutKeys(ConfigSection[RolloutConfig]):
    """``[rollout]``'s keys of the learning run that are no knob of ``RolloutConfig``: the
    task's prompts, the step's shape and the sampling temperature."""

    task: Task = option(  # noqa: RUF009
        "repeat", "the verifiable task (copy, repeat, reverse; lookup: a tool, two turns)"
    )
    prompts: int = option(4096, "prompts drawn from the task (cycled)", validator=at_least(1))
    batch_groups: int = option(8, "groups per step", validator=at_least(1))
    group_size: int = option(16, "samples per group", validator=at_least(2))
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
)

#: ``[sink]`` of the learning run: the knobs of :class:`~trio_rl.train.SinkConfig`. The learning
#: run keeps at most one version of staleness by default: its tiny model moves fast, and samples
#: older than that train it the wrong way.
LearnSink = config_section(
    SinkConfig,
    "LearnSink",
    "The train sink (trio_rl.train.SinkConfig): scoring, pruning and the staleness filter.",
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
        validator=positive,
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
    "What is kept on disk: the orchestrator's checkpoints (trio_rl.train.CheckpointConfig) "
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


def _urls(_: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for url in value:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"{url!r} is not an http:// or https:// URL")
    if len(set(value)) != len(value):
        raise InvalidArgumentError(f"a server is listed twice in {list(value)}")


@attrs.frozen
class Inference:
    """The inference fleet (:class:`~trio_rl.engines.EngineFleet`): OpenAI-compatible servers
    already running (``urls``), or ``launch`` vLLM servers started as child processes of the
    run; unset both for the in-process engine."""

    urls: tuple[str, ...] = option(
        (),
        "OpenAI-compatible servers already running (vLLM with VLLM_SERVER_DEV_MODE=1), e.g. "
        '["http://10.0.0.2:8000"]; they serve the model and read the weights the trainer '
        "publishes from the shared path",
        validator=_urls,
        may_change=True,
    )
    launch: int = option(
        0,
        "start this many vLLM servers serving [model] path as child processes the run owns, on "
        "free "
        "loopback ports: health-checked, restarted if they die, stopped with the run",
        validator=at_least(0),
        may_change=True,
    )
    vllm: str = option(
        "",
        "the command that starts a launched server, before `--model PATH --host --port` "
        "(empty: `python -m vllm.entrypoints.openai.api_server` with this Python)",
        may_change=True,
    )
    vllm_args: tuple[str, ...] = option(
        (),
        'extra arguments of launched servers, e.g. ["--dtype", "float32", "--enforce-eager"]',
        may_change=True,
    )
    served_name: str | None = option(
        None,
        "the model name requests ask for (unset: what the servers list at `/v1/models`)",
        may_change=True,
    )
    routing_keys: Literal["none", "sample", "group"] = option(
        "group",
        "group: every sample of a group goes to one server (its prompt in that server's "
        "prefix cache; sent as X-SMG-Routing-Key); sample: a key per sample; none",
    )
    start_timeout: float = option(
        600.0,
        "seconds every server may take to answer /health at the start (a vLLM-CPU server "
        "takes about 40 s)",
        validator=positive,
        may_change=True,
    )
    min_servers: int | None = option(
        None,
        "start once this many of the servers answer /health (unset: all of them); the others "
        "join when they answer (same model, after loading the current weights)",
        validator=at_least(1),
        may_change=True,
    )
    timeout: float = option(
        600.0,
        "seconds a request may take, retries on other servers included",
        validator=positive,
        may_change=True,
    )
    max_attempts: int = option(
        3, "servers a request is tried on", validator=at_least(1), may_change=True
    )
    wait_for_server: float = option(
        600.0,
        "seconds a request waits for a live server when none is",
        validator=positive,
        may_change=True,
    )
    probe_interval: float = option(
        2.0, "seconds between health probes of each server", validator=positive, may_change=True
    )
    probe_timeout: float = option(
        10.0, "seconds a health probe may take", validator=positive, may_change=True
    )
    probe_failures: int = option(
        2,
        "failed probes in a row that take a server out (a refused connection takes it out at once)",
        validator=at_least(1),
        may_change=True,
    )
    admin_timeout: float = option(
        300.0,
        "seconds a weight reload of one server may take",
        validator=positive,
        may_change=True,
    )
    restarts: int = option(
        3, "restarts of each launched server that exits", validator=at_least(0), may_change=True
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

    def inference_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`trio_rl.engines.open_inference` this section sets
        (all but ``routing_keys``, which is the orchestrator's, and ``check_logprobs``, the
        learning run's)."""
        kwargs = attrs.asdict(self, recurse=False)
        del kwargs["routing_keys"]
        del kwargs["check_logprobs"]
        return kwargs

    def __attrs_post_init__(self) -> None:
        if self.urls and self.launch:
            raise InvalidArgumentError("set `urls` (servers already running) or `launch`, not both")
        servers = len(self.urls) or self.launch
        if self.min_servers is not None and servers and self.min_servers > servers:
            raise InvalidArgumentError(
                f"min_servers = {self.min_servers} is more than the {servers} servers of "
                "[inference]"
            )


@attrs.frozen
class LearnRunConfig:
    """``trio-rl run``: the learning run."""

    run: LearnRun = attrs.field(factory=LearnRun)
    engine: LearnEngine = attrs.field(factory=LearnEngine)
    rollout: LearnRolloutKeys = attrs.field(factory=LearnRollout)
    sink: ConfigSection[SinkConfig] = attrs.field(factory=LearnSink)
    publish: Publish = attrs.field(factory=Publish)
    transport: LearnTransport = attrs.field(factory=LearnTransport)
    trainer: LearnTrainerKeys = attrs.field(factory=LearnTrainer)
    checkpoint: LearnCheckpointKeys = attrs.field(factory=LearnCheckpoint)
    metrics: Metrics = attrs.field(factory=Metrics)
    model: ModelSection = attrs.field(factory=ModelSection)
    data: DataSection = attrs.field(factory=DataSection)
    reward: RewardSection = attrs.field(factory=RewardSection)
    inference: Inference = attrs.field(factory=Inference)
    env: ConfigSection[EnvConfig] = attrs.field(factory=LearnEnv)


# ------------------------------------------------------------------ trio-rl simulate


@attrs.frozen
class SimRun:
    """The run as a whole."""

    out: str | None = option(
        None, "run directory (unset: a temporary one, removed at the end)", may_change=True
    )
    steps: int = option(
        6,
        "steps to ship in this invocation (not a total: a resumed run ships this many more)",
        validator=at_least(1),
        may_change=True,
    )
    seed: int = option(0, "seed of the engine, the groups and the prompts")


@attrs.frozen
class SimEngine:
    """The engine: simulated (straggler latencies, no model) or an OpenAI-compatible server."""

    kind: Literal["simulated", "openai"] = option(
        "simulated", "simulated, or openai: an OpenAI-compatible server at `url` (vLLM, SGLang)"
    )
    url: str = option("http://127.0.0.1:8000", "the server's base URL (openai)")
    model: str = option("default", "the served model's name (openai)")
    timeout: float = option(
        600.0,
        "seconds a request may take, retries included (openai)",
        validator=positive,
        may_change=True,
    )
    max_attempts: int = option(
        4,
        "attempts of a request on connection errors and 5xx answers (openai)",
        validator=at_least(1),
        may_change=True,
    )

    distribution: Literal["correlated", "heavy-tail", "long-cot", "swe"] = option(
        "long-cot", "completion-length distribution"
    )
    slots: int = option(64, "decode slots", validator=at_least(1))
    tokens_per_second: float = option(
        2e6,
        "simulated decode speed per slot; simulated time runs tokens_per_second/30 times "
        "faster than real time",
        validator=positive,
        may_change=True,
    )
    max_tokens: int = option(2048, "completion cap", validator=at_least(1))


@attrs.frozen
class SimRolloutKeys(ConfigSection[RolloutConfig]):
    """``[rollout]``'s keys of ``trio-rl simulate`` that are no knob of ``RolloutConfig``: the
    step's shape."""

    batch_groups: int = option(8, "groups per step", validator=at_least(1))
    group_size: int = option(8, "samples per group", validator=at_least(1))


SimRollout = config_section(
    RolloutConfig,
    "SimRollout",
    "The rollout driver (trio_rl.rollout.RolloutConfig).",
    base=SimRolloutKeys,
    omit={
        "routing_keys": "group with engine.kind = openai (one prefix cache per group), else none"
    },
)

SimSink = config_section(
    SinkConfig,
    "SimSink",
    "The train sink (trio_rl.train.SinkConfig): scoring, pruning and the staleness filter.",
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
    "The orchestrator's checkpoints (trio_rl.train.CheckpointConfig; ``checkpoints/`` in the "
    "run directory).",
)


@attrs.frozen
class SimulateConfig:
    """``trio-rl simulate``: the pipeline on a simulated engine."""

    run: SimRun = attrs.field(factory=SimRun)
    engine: SimEngine = attrs.field(factory=SimEngine)
    rollout: SimRolloutKeys = attrs.field(factory=SimRollout)
    sink: ConfigSection[SinkConfig] = attrs.field(factory=SimSink)
    publish: Publish = attrs.field(factory=Publish)
    transport: SimTransport = attrs.field(factory=SimTransport)
    trainer: SimTrainer = attrs.field(factory=SimTrainer)
    checkpoint: ConfigSection[CheckpointConfig] = attrs.field(factory=SimCheckpoint)
