"""The learning run's end: every shipped step is trained before the run reports done (or the
run says loudly why not), each trained step's record carries the trainer's metrics, and
``deterministic`` runs give the same rewards bit for bit."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from learn_helpers import learn_config

from trio_rl.learn import TRAINER_KEYS, latest_weights, run_learning

torch.set_num_threads(1)

#: A small, fast shape: the end of a run is what is tested here, not learning.
SMALL: dict[str, Any] = {
    "rollout__batch_groups": 2,
    "rollout__group_size": 4,
    "engine__d_model": 32,
    "engine__n_layers": 1,
}


def _trainer_log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "trainer" / "stats.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "steps", [1, *(pytest.param(n, marks=pytest.mark.heavy) for n in (2, 3)), 5]
)
async def test_every_shipped_step_is_trained_before_the_run_reports_done(
    tmp_path: Path, steps: int
) -> None:
    # a trainer slower than the rollouts: when the last step ships, it is still behind
    config = learn_config(
        tmp_path,
        run__steps=steps,
        run__seed=steps,
        trainer__delay=0.3,
        metrics__console=False,
        metrics__plot=False,
        **SMALL,
    )
    with trio.fail_after(300):
        result = await run_learning(config)
    assert result.stopped == "steps"
    shipped = [m["step"] for m in result.metrics]
    assert shipped == list(range(1, steps + 1))
    # the trainer's own records: its log, its saved state, its published weights
    assert [t["step"] for t in _trainer_log(tmp_path)] == shipped
    state = torch.load(tmp_path / "trainer" / "state.pt", weights_only=True)
    assert state["step"] == steps
    latest = latest_weights(tmp_path / "weights")
    assert latest is not None
    assert latest.version == steps
    assert result.trained_through == steps
    # every trained step's record holds the trainer's metrics, computed in the trainer
    for m in result.metrics:
        assert set(TRAINER_KEYS) <= m.keys()
        assert all(m[k] is not None for k in TRAINER_KEYS), m
        assert m["trainer/lr"] == config.trainer.lr
        assert m["trainer/entropy"] > 0
        assert m["trainer/grad_norm"] >= 0
        assert 0 <= m["trainer/clip_frac"] <= 1
        assert m["trainer/kl"] >= 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == result.metrics


async def test_a_trainer_that_misses_the_deadline_is_reported_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    config = learn_config(
        tmp_path,
        run__steps=3,
        trainer__delay=2.0,  # far slower than the deadline below
        metrics__console=False,
        metrics__plot=False,
        **SMALL,
    )
    with trio.fail_after(300):
        result = await run_learning(config, trainer_timeout=0.05)
    assert result.trained_through < 3
    message = "the trainer did not report step 3, the last shipped step"
    assert any(message in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert message in capsys.readouterr().err
    # the records of steps never trained are written, without trainer metrics
    assert [m["step"] for m in result.metrics] == [1, 2, 3]
    assert result.metrics[-1].get("trainer/loss") is None


def _reward_columns(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in m.items() if k == "reward_mean" or k.startswith("train/all/reward")}
        for m in metrics
    ]


async def test_a_deterministic_run_repeats_its_rewards_bit_for_bit(tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        config = learn_config(
            tmp_path / name,
            run__steps=6,
            run__seed=7,
            run__deterministic=True,
            metrics__console=False,
            metrics__plot=False,
        )
        with trio.fail_after(600):
            result = await run_learning(config)
        assert [m["step"] for m in result.metrics] == [1, 2, 3, 4, 5, 6]
        lines = [
            json.loads(line)
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        runs.append(_reward_columns(lines))
        # each step generated with exactly policy S - 1 - max_async_level (version 0 twice)
        versions = [m["train/effective/off_policy/max"] for m in result.metrics]
        assert versions == [0.0] + [1.0] * 5, versions
    assert runs[0] == runs[1]
    # the rewards moved: the comparison is of a run that trained, not of constants
    assert len({r["reward_mean"] for r in runs[0]}) > 1
