"""The built-in engines, registered as a plug-in registers its own (`register_engine`):
``simulated`` and ``openai`` for ``trio-rl simulate``, ``torch`` (the policy in-process) and
``fleet`` (servers already running or launched vLLM servers) for ``trio-rl run``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio

from .._validation import at_least, one_of, positive_finite
from ..errors import InvalidArgumentError
from ._fleet import EngineFleet
from ._fleet_config import ABORT_PATH_HELP, InferenceConfig, abort_path_check
from ._inference import open_inference
from ._openai import OpenAICompatibleEngine
from ._registry import EngineKind, EngineSetup, register_engine
from ._simulated import SimulatedEngine
from ._torch import TorchEngine

__all__ = ["FLEET", "OPENAI", "SIMULATED", "TORCH", "OpenAIConfig", "SimulatedConfig"]


def _knob(default: Any, help: str, validator: Any = None, may_change: bool = False) -> Any:
    return attrs.field(
        default=default, validator=validator, metadata={"help": help, "may_change": may_change}
    )


@attrs.frozen
class SimulatedConfig:
    """A simulated engine: decode slots and straggler latencies, no model."""

    distribution: Literal["correlated", "heavy-tail", "long-cot", "swe"] = _knob(
        "long-cot", "completion-length distribution"
    )
    slots: int = _knob(64, "decode slots", at_least(1))
    tokens_per_second: float = _knob(
        2e6,
        "simulated decode speed per slot; simulated time runs tokens_per_second/30 times "
        "faster than real time",
        positive_finite,
        may_change=True,
    )


@asynccontextmanager
async def _open_simulated(
    setup: EngineSetup, config: SimulatedConfig
) -> AsyncIterator[SimulatedEngine]:
    yield SimulatedEngine(
        distribution=config.distribution,
        slots=config.slots,
        seed=setup.seed,
        # Decoding at 30 tokens/s per slot, sped up so that tokens_per_second holds; the same
        # factor shrinks the wall-time distributions (swe, heavy-tail), whose episodes are
        # minutes long in real time.
        seconds_per_token=1.0 / 30.0,
        time_scale=30.0 / config.tokens_per_second,
    )


def _simulated_summary(engine: SimulatedEngine) -> str:
    stats = engine.statistics()
    return (
        f"engine: {stats.requests_done} requests, {stats.tokens} tokens, "
        f"slot occupancy {stats.occupancy:.2f}"
    )


@attrs.frozen
class OpenAIConfig:
    """An OpenAI-compatible server (vLLM, SGLang)."""

    url: str = _knob("http://127.0.0.1:8000", "the server's base URL (openai)")
    model: str = _knob("default", "the served model's name (openai)")
    timeout: float = _knob(
        600.0,
        "seconds a request may take, retries included (openai)",
        positive_finite,
        may_change=True,
    )
    max_attempts: int = _knob(
        4,
        "attempts of a request on connection errors and 5xx answers (openai)",
        at_least(1),
        may_change=True,
    )
    abort_path: str | None = _knob(
        None, ABORT_PATH_HELP + " (openai)", abort_path_check, may_change=True
    )


@asynccontextmanager
async def _open_openai(
    setup: EngineSetup, config: OpenAIConfig
) -> AsyncIterator[OpenAICompatibleEngine]:
    async with OpenAICompatibleEngine(
        [config.url],
        model=config.model,
        timeout=config.timeout,
        max_attempts=config.max_attempts,
        abort_path=config.abort_path,
    ) as engine:
        yield engine


@attrs.frozen
class TorchConfig:
    """The policy served in-process (its shape is ``[engine]``'s: the trainer's model too)."""

    batch_by: Literal["prompt", "length"] = _knob(
        "prompt",
        "which requests decode as one batch: prompt (a group's samples) or length (prompts of "
        "the same length: the later turns of multi-turn episodes, each with a prompt of its own)",
        one_of(("prompt", "length")),
    )


@asynccontextmanager
async def _open_torch(setup: EngineSetup, config: TorchConfig) -> AsyncIterator[TorchEngine]:
    if setup.model is None or setup.eos_token_id is None:
        raise InvalidArgumentError("the torch engine serves the learning run's model: none given")
    async with TorchEngine.open(
        setup.model,
        eos_token_id=setup.eos_token_id,
        max_len=setup.max_len,
        # its own limiter of 1: it serializes the model's forward passes
        limiter=trio.CapacityLimiter(1),
        seed=setup.seed,
        policy_version=setup.policy_version,
        # deterministic: a group's rows must always decode as one batch (one generator)
        gather_window=0.02 if setup.deterministic else 0.002,
        batch_by=config.batch_by,
    ) as engine:
        yield engine


@asynccontextmanager
async def _open_fleet(setup: EngineSetup, config: InferenceConfig) -> AsyncIterator[EngineFleet]:
    """The fleet ``config`` describes (it serves ``setup.model_path``); a resumed run's servers
    first load its newest published weights."""
    if config.launch and setup.model_path is None:
        raise InvalidArgumentError(
            "[inference] launch needs [model] path: the model the servers serve"
        )
    async with open_inference(
        **attrs.asdict(config, recurse=False), model_path=setup.model_path, log_dir=setup.log_dir
    ) as fleet:
        if setup.weights is not None:
            await fleet.load_weights(*setup.weights)
        yield fleet


SIMULATED = register_engine(
    EngineKind(
        "simulated",
        SimulatedConfig,
        _open_simulated,
        commands=("simulate",),
        summary=_simulated_summary,
    )
)
OPENAI = register_engine(
    EngineKind("openai", OpenAIConfig, _open_openai, commands=("simulate",), prefix_cache=True)
)
TORCH = register_engine(
    EngineKind("torch", TorchConfig, _open_torch, loads_weights=True, commands=("run",))
)
FLEET = register_engine(
    EngineKind(
        "fleet",
        InferenceConfig,
        _open_fleet,
        loads_weights=True,
        commands=("run",),
        prefix_cache=True,
    )
)
