"""The learning run with its trainer as a two-rank DDP job under torchrun (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import trio
from learn_helpers import learn_config

from trio_rl.learn import TRAINER_KEYS, latest_weights, run_learning

torch.set_num_threads(1)


async def test_a_run_with_two_torchrun_ranks_trains_publishes_and_ends_cleanly(
    tmp_path: Path,
) -> None:
    config = learn_config(
        tmp_path,
        run__steps=6,
        run__seed=0,
        trainer__mode="torchrun",
        trainer__ranks=2,
        metrics__console=False,
        metrics__plot=False,
    )
    with trio.fail_after(600):  # torchrun and three torch imports take a while on a busy machine
        result = await run_learning(config)
    assert result.stopped == "steps"
    assert [m["step"] for m in result.metrics] == [1, 2, 3, 4, 5, 6]
    # the ranks' weights reached the engine (the ship gate needs version >= S - 2 for step S)
    assert result.metrics[-1]["policy_version"] >= 4
    latest = latest_weights(tmp_path / "weights")
    assert latest is not None
    # the job trained every shipped step (it stops at the step named in the STOP file)
    assert latest.version == 6
    assert json.loads((latest.path / "meta.json").read_text())["world_size"] == 2
    # every rank consumed (and deleted) its payloads
    assert not any((tmp_path / "batches").rglob("rank_*.bin"))
    # rank 0's own record of every step, and its trainer/... metrics in every step's record
    trained = [
        json.loads(line) for line in (tmp_path / "trainer" / "stats.jsonl").read_text().splitlines()
    ]
    assert [t["step"] for t in trained] == [1, 2, 3, 4, 5, 6]
    assert result.trained_through == 6
    for m in result.metrics:
        assert all(m[k] is not None for k in TRAINER_KEYS), m
        assert m["trainer/lr"] == config.trainer.lr
