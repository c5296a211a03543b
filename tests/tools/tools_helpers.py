"""Real run directories for the tools' tests, made by the library's own commands."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_LEARN = (
    "import sys, torch, trio; torch.set_num_threads(1); "
    "from trio_rl.learn import LearnConfig, run_learning; "
    "trio.run(run_learning, LearnConfig(out=sys.argv[1], steps=4, batch_groups=2, "
    "group_size=8, verbose=False, plot=False))"
)


def simulate(out: Path, steps: int = 2) -> Path:
    """``trio-rl simulate`` for ``steps`` steps into ``out`` (checkpoints, trainer logs)."""
    done = subprocess.run(
        [sys.executable, "-m", "trio_rl", "simulate", "--steps", str(steps), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return out


def learn(out: Path) -> Path:
    """A short learning run into ``out`` (run.json, metrics.jsonl, weights/, batches/)."""
    done = subprocess.run(
        [sys.executable, "-c", _LEARN, str(out)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    return out


def trio_rl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The real ``trio-rl`` command (``python -m trio_rl``)."""
    cmd = [sys.executable, "-m", "trio_rl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def extra(module: str) -> Any:
    """Import an optional extra's package for a test. The test dependency group installs every
    extra, so a missing one fails the test (naming the package) instead of passing by skipping."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module!r} is not installed: install the test dependency group ({exc})")
