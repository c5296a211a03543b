"""A fifth engine, registered from outside the library as a plug-in registers its own: the
built-in engines behind a log of what happened to it (opened, weights loaded). Named in a
configuration as ``"fifth_engine:LOGGED"`` with this directory on ``PYTHONPATH``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs

from trio_rl.engines import (
    SIMULATED,
    TORCH,
    Completion,
    EngineKind,
    EngineSetup,
    GenerateRequest,
    SimulatedConfig,
    TorchConfig,
)
from trio_rl.samples import PolicyVersion


@attrs.frozen
class LoggedConfig:
    """The logged engine's knobs: they are the ``options`` table of the engine's section."""

    log: str = attrs.field(default="", metadata={"help": "the file it logs what happened to"})
    slots: int = attrs.field(default=8, metadata={"help": "decode slots, without a model"})


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")


@attrs.define(eq=False)
class LoggedEngine:
    inner: Any
    log: Path

    async def generate(self, request: GenerateRequest) -> Completion:
        completion: Completion = await self.inner.generate(request)
        return completion

    async def load_weights(self, path: Any, version: PolicyVersion) -> None:
        await self.inner.load_weights(path, version)
        _append(self.log, f"loaded {version}")

    def set_policy_version(self, version: PolicyVersion) -> None:
        self.inner.set_policy_version(version)


@asynccontextmanager
async def open_logged(setup: EngineSetup, config: LoggedConfig) -> AsyncIterator[LoggedEngine]:
    log = Path(config.log)
    # the learning run gives its model: served in-process; without one, simulated slots
    served = "model" if setup.model is not None else "simulated"
    _append(log, f"opened {served} seed {setup.seed}")
    if setup.model is not None:
        async with TORCH.open(setup, TorchConfig()) as inner:
            yield LoggedEngine(inner, log)
    else:
        async with SIMULATED.open(setup, SimulatedConfig(slots=config.slots)) as inner:
            yield LoggedEngine(inner, log)
    _append(log, "closed")


LOGGED = EngineKind("logged", LoggedConfig, open_logged, loads_weights=True)
