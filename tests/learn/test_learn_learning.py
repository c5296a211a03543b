"""The learning run learns: a shortened default run, and one with staleness forced.

Margins. The per-step mean reward averages 128 samples; before learning starts it lies in
0.03-0.12 with a standard deviation of about 0.02 (measured over seeds 0-3), so a 5-step mean
carries about 0.01 of noise. The tests compare the first 3 steps with the best window of 5
consecutive steps and ask for +0.2, some 15 standard deviations; the runs measured reached
+0.36 to +0.41. With the advantage's sign flipped in the trainer the gain measured -0.005: a
broken link anywhere (logprobs, masks, advantages, versions, weights that never reach the
engine) leaves the reward flat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from learn_helpers import learn_config

from trio_rl.learn import run_learning

torch.set_num_threads(1)

KEYS = {"step", "reward_mean", "samples", "tokens", "off_policy_max", "loop_lag_p95_ms", "wall_s"}


def _rewards(metrics: list[dict[str, Any]]) -> list[float]:
    return [m["reward_mean"] or 0.0 for m in metrics]


def _gain(rewards: list[float]) -> float:
    start = sum(rewards[:3]) / 3
    best = max(sum(rewards[i : i + 5]) / 5 for i in range(len(rewards) - 4))
    return best - start


async def test_a_short_learning_run_improves_beyond_noise(tmp_path: Path) -> None:
    config = learn_config(
        tmp_path, run__steps=80, run__seed=0, run__stop_at_reward=0.4, metrics__console=False
    )
    with trio.fail_after(900):  # ~40 s on an idle 2-core machine; generous for a loaded one
        result = await run_learning(config)
    rewards = _rewards(result.metrics)
    assert rewards[0] <= 0.1
    assert _gain(rewards) >= 0.2, rewards
    # metrics.jsonl: one object per shipped step with the documented fields
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, len(lines) + 1))
    assert all(m.keys() >= KEYS for m in lines)
    assert lines == result.metrics
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the trainer's weights reached the engine: versions advanced with the steps
    assert lines[-1]["policy_version"] >= len(lines) - 3
    assert max(m["off_policy_max"] for m in lines) <= config.sink.max_off_policy_steps
    published = sorted((tmp_path / "weights").iterdir())
    assert len(published) == config.checkpoint.weights_keep
    assert all((p / "model.safetensors").exists() and (p / "meta.json").exists() for p in published)


async def test_forced_staleness_is_held_back_at_admission_and_still_learns(tmp_path: Path) -> None:
    config = learn_config(
        tmp_path,
        run__steps=40,
        run__seed=1,
        sink__max_off_policy_steps=0,
        trainer__delay=0.3,  # a deliberately slow trainer: rollouts would outrun it
        run__stop_at_reward=0.4,
        metrics__console=False,
        metrics__plot=False,
    )
    with trio.fail_after(900):
        result = await run_learning(config)
    # admission generated only what could still train: next to nothing was thrown away
    c = result.counters
    assert c["stale"] + c["cancelled"] <= 0.1 * c["dispatched"], c
    assert result.metrics[-1]["stale"] == c["stale"]
    assert result.metrics[-1]["waste_total"] <= 0.1
    # nothing older than the staleness limit was trained on
    assert all(m["off_policy_max"] == 0 for m in result.metrics)
    assert _gain(_rewards(result.metrics)) >= 0.2, _rewards(result.metrics)


async def test_without_stale_admission_the_sink_drops_what_went_stale(tmp_path: Path) -> None:
    config = learn_config(
        tmp_path,
        run__steps=6,
        run__seed=1,
        sink__max_off_policy_steps=0,
        trainer__delay=0.3,
        metrics__console=False,
        metrics__plot=False,
    )
    with trio.fail_after(600):
        result = await run_learning(config, stale_admission=False)
    assert result.counters["stale"] > 0
    assert result.metrics[-1]["waste_total"] > 0
    assert all(m["off_policy_max"] == 0 for m in result.metrics)


async def test_a_deterministic_wrong_policy_ends_the_run_as_a_collapse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Greedy decoding: the 16 samples of a group are identical, so every group has equal
    # rewards, zero advantage, and is pruned; no batch can ever fill. The untrained policy is
    # wrong, so that is a collapse, not convergence, and the run says so with the reward.
    config = learn_config(
        tmp_path,
        run__steps=5,
        rollout__temperature=0.0,
        metrics__console=False,
        metrics__plot=False,
    )
    with trio.fail_after(120):
        result = await run_learning(config)
    assert result.stopped == "collapsed"
    assert result.final_reward is not None
    assert result.final_reward < 0.5
    assert any(
        f"collapsed at reward {result.final_reward:.3f}" in r.getMessage() for r in caplog.records
    )
    assert result.metrics == []
    assert result.counters["shipped"] == 0
    assert result.counters["pruned"] >= 8 * 128


async def test_a_deterministic_policy_at_the_target_reward_has_converged(tmp_path: Path) -> None:
    # the same greedy policy, judged against a target it meets (stop_at_reward 0): converged
    config = learn_config(
        tmp_path,
        run__steps=5,
        rollout__temperature=0.0,
        run__stop_at_reward=0.0,
        metrics__console=False,
        metrics__plot=False,
    )
    with trio.fail_after(120):
        result = await run_learning(config)
    assert result.stopped == "converged"
    assert result.final_reward is not None
    assert result.final_reward >= 0.0


def _log(reward: float, identical: bool) -> Any:
    from trio_rl.learn._verdict import SampleLog

    log = SampleLog(32)
    for prompt in "abcd":
        for i in range(8):
            completion = "x" if identical else f"x{i}"
            log.add({"prompt": prompt}, completion, reward)
    return log


@pytest.mark.parametrize(
    ("reward", "shown", "line"),
    [
        (0.99964, "0.9996", "stopping: collapsed at reward 0.9996, below the task's maximum 1"),
        (0.5613, "0.561", "stopping: collapsed at reward 0.561, below the task's maximum 1"),
        (1.0, "1.000", "stopping: reached reward 1.000 (>= the task's maximum 1)"),
    ],
)
def test_a_collapse_just_below_the_target_does_not_print_as_the_target(
    tmp_path: Path, reward: float, shown: str, line: str
) -> None:
    from trio_rl.learn._verdict import equal_rewards_verdict

    ending = equal_rewards_verdict(_log(reward, identical=True), learn_config(tmp_path), 3)
    assert ending.stopped == ("converged" if reward == 1.0 else "collapsed")
    assert ending.message is not None
    assert ending.message.startswith(line), ending.message
    assert ending.final_reward == pytest.approx(reward)


def _varied_log(rewards: dict[str, float]) -> Any:
    """Each prompt's 8 samples all different, all scored ``rewards[prompt]``."""
    from trio_rl.learn._verdict import SampleLog

    log = SampleLog(8 * len(rewards))
    for prompt, reward in rewards.items():
        for i in range(8):
            log.add({"prompt": prompt}, f"x{i}", reward)
    return log


@pytest.mark.parametrize(
    ("rewards", "shipped", "stopped", "line"),
    [
        # trained, every group alike, prompts apart: a settled policy whose samples vary where
        # the reward does not look (each sample draws its own seed)
        (
            {"a": 1.0, "b": 0.75},
            40,
            "collapsed",
            "stopping: collapsed at reward 0.875, below the task's maximum 1: every group's "
            "samples scored alike",
        ),
        (
            {"a": 1.0, "b": 1.0},
            40,
            "converged",
            "stopping: reached reward 1.000 (>= the task's maximum 1): every group's samples "
            "scored alike",
        ),
        # one reward for every sample, or nothing trained yet: the reward is what to check
        (
            {"a": 0.0, "b": 0.0},
            40,
            "no_signal",
            "stopping: nothing to learn from after 40 steps: the samples differ but their "
            "rewards are all 0",
        ),
        (
            {"a": 1.0, "b": 0.75},
            0,
            "no_signal",
            "stopping: nothing to learn from from the first step: the samples differ but their "
            "rewards are equal within each group",
        ),
    ],
)
def test_different_samples_with_equal_rewards_end_by_what_the_rewards_say(
    tmp_path: Path, rewards: dict[str, float], shipped: int, stopped: str, line: str
) -> None:
    from trio_rl.learn._verdict import equal_rewards_verdict

    ending = equal_rewards_verdict(_varied_log(rewards), learn_config(tmp_path), shipped)
    assert ending.stopped == stopped
    assert ending.message is not None
    assert ending.message.startswith(line), ending.message


def test_equal_rewards_on_different_samples_are_no_signal_not_a_collapse(tmp_path: Path) -> None:
    from trio_rl.learn._verdict import equal_rewards_verdict

    config = learn_config(tmp_path, reward__function="mine:score")
    ending = equal_rewards_verdict(_log(0.0, identical=False), config, 0)
    assert ending.stopped == "no_signal"
    assert ending.message is not None
    assert ending.message.startswith(
        "stopping: nothing to learn from from the first step: the samples differ but their "
        "rewards are all 0"
    )
    assert "check the reward (mine:score" in ending.message
