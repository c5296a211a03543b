"""``trio-rl eval``: one held-out eval of a run's ``[eval]`` section, offline, against the
engines the configuration names, of the initial policy, published weights or a model
directory."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import attrs
import trio

from ..config import ConfigError, LearnRunConfig
from ..engines import WeightLoader
from ..evals import EvalResult
from ._engine import open_engine
from ._evals import eval_prompts, eval_runner
from ._settings import build_policy
from ._weights import META_FILE, WEIGHTS_FILE

__all__ = ["ProgressBar", "evaluate_offline", "weights_version"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def weights_version(weights: Path) -> int:
    """The policy version (trained steps) of a published weights directory: its
    ``meta.json`` ``version``, else its ``step_<S>`` name. A directory that holds no weights is
    a `ConfigError` naming ``--weights`` (exit 2)."""
    if not (weights / WEIGHTS_FILE).is_file():
        raise ConfigError(
            "--weights", "", f"{weights}: no {WEIGHTS_FILE} (expected RUN_DIR/weights/step_S)"
        )
    try:
        meta = json.loads((weights / META_FILE).read_text(encoding="utf-8"))
        return int(meta["version"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _STEP_DIR.match(weights.name)
        if m is None:
            raise ConfigError(
                "--weights", "", f"{weights}: no {META_FILE} and not named step_<S>"
            ) from None
        return int(m.group(1))


@attrs.define(eq=False)
class ProgressBar:
    """``(prompts done, prompts planned)`` drawn as a bar with an ETA on ``stream`` (a
    terminal: redrawn in place; otherwise a line every tenth of the way)."""

    stream: IO[str] = attrs.field(factory=lambda: sys.stderr)
    width: int = 30
    _started: float = attrs.field(factory=time.monotonic)
    _last_tenth: int = -1

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self._started
        eta = elapsed / done * (total - done) if done else float("nan")
        filled = self.width * done // max(total, 1)
        line = (
            f"eval [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} prompts  "
            f"{elapsed:.0f} s  ETA {eta:.0f} s"
        )
        if self.stream.isatty():
            self.stream.write("\r" + line + ("\n" if done == total else ""))
        elif (tenth := 10 * done // max(total, 1)) != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(line + "\n")
        self.stream.flush()


async def evaluate_offline(
    config: LearnRunConfig,
    *,
    weights: Path | None = None,
    model: Path | None = None,
    progress: ProgressBar | None = None,
) -> EvalResult:
    """One eval of ``config``'s ``[eval]``: of ``weights`` (a published ``step_S``
    directory: the eval's step is S), of the model directory ``model``, or of the initial
    policy (step 0), through the engine ``[inference]`` names. Bad input is a `ConfigError`."""
    if model is not None:
        config = attrs.evolve(config, model=attrs.evolve(config.model, path=str(model)))
    version = 0 if weights is None else await trio.to_thread.run_sync(weights_version, weights)
    policy = await trio.to_thread.run_sync(build_policy, config)
    prompts = await trio.to_thread.run_sync(eval_prompts, config, policy)
    if not prompts:
        raise ConfigError(
            "eval.prompts",
            "eval.prompts",
            "no held-out prompts: name a JSONL file (the run trains on its own [data] prompts)",
        )
    with tempfile.TemporaryDirectory(prefix="trio-rl-eval-") as scratch:
        out = config.run.out if config.run.out is not None else scratch
        config = attrs.evolve(config, run=attrs.evolve(config.run, out=os.fspath(out)))
        async with open_engine(config, policy, 0) as engine:
            if weights is not None:
                if not isinstance(engine, WeightLoader):
                    raise ConfigError("--weights", "", "the engine loads no weights")
                await engine.load_weights(weights, version)
            limiter = trio.CapacityLimiter(config.publish.threads)
            runner = eval_runner(config, policy, engine, limiter)
            return await runner.run(
                prompts,
                step=version,
                deadline=config.eval.timeout,
                policy_version=version,
                progress=progress,
            )
