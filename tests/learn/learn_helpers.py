"""The learning run's configuration, as tests write it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trio_rl.config import LearnRunConfig, configure


def learn_config(out: Path | str, **values: Any) -> LearnRunConfig:
    """``trio-rl run``'s configuration with its run directory ``out`` and ``values`` by key,
    the section and the key joined by ``__`` (``run__steps=2`` is ``run.steps = 2``)."""
    keys = {key.replace("__", "."): value for key, value in values.items()}
    return configure(LearnRunConfig, {"run.out": str(out), **keys}, where="test")
