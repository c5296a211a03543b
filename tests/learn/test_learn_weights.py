"""Weight publication (atomic, versioned, last K kept); the watcher loads, then counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio
from learn_helpers import learn_config

from trio_rl.engines import TorchEngine
from trio_rl.learn import (
    TASKS,
    CharTransformer,
    ModelConfig,
    latest_weights,
    publish_weights,
    watch_weights,
)
from trio_rl.tools import FIELDS

torch.set_num_threads(1)


def _model(seed: int) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(ModelConfig(TASKS["repeat"].tokenizer.vocab_size, max_len=16))


def test_publish_writes_versioned_directories_and_keeps_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    assert latest_weights(root) is None
    state = _model(0).state_dict()
    for version in (1, 2, 3, 4):
        published = publish_weights(root, version, state, keep=2, meta={"step": version})
        assert published.path == root / f"step_{version}"
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]  # no temp dirs left
    latest = latest_weights(root)
    assert latest is not None
    assert latest.version == 4
    meta = json.loads((latest.path / "meta.json").read_text())
    assert meta == {
        "version": 4,
        "format": "safetensors",
        "files": ["model.safetensors"],
        "step": 4,
    }
    # a half-written version (no rename yet) is invisible to readers
    (root / ".tmp-step_5-1").mkdir()
    assert latest_weights(root) == latest
    # publishing a version again replaces it
    publish_weights(root, 4, _model(1).state_dict(), keep=2)
    assert latest_weights(root) == latest


def test_publish_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        publish_weights(tmp_path, 1, {}, keep=0)
    with pytest.raises(ValueError, match="version"):
        publish_weights(tmp_path, -1, {})


async def test_the_watcher_loads_every_engine_before_the_version_counts(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    reported: list[tuple[int, list[int]]] = []
    trained = _model(1)
    with trio.fail_after(30):
        async with (
            TorchEngine.open(_model(0).eval(), eos_token_id=1) as first,
            TorchEngine.open(_model(0).eval(), eos_token_id=1) as second,
            trio.open_nursery() as nursery,
        ):

            def report(version: int) -> None:
                # every engine already serves the version being reported
                reported.append((version, [first.policy_version, second.policy_version]))

            nursery.start_soon(
                lambda: watch_weights(root, [first, second], report, poll_interval=0.005)
            )
            await trio.sleep(0.05)
            assert reported == []
            await trio.to_thread.run_sync(lambda: publish_weights(root, 1, trained.state_dict()))
            while not reported:  # noqa: ASYNC110 - waiting on a plain list
                await trio.sleep(0.01)
            # two more versions in a row: the watcher catches up with the newest
            await trio.to_thread.run_sync(lambda: publish_weights(root, 2, trained.state_dict()))
            await trio.to_thread.run_sync(lambda: publish_weights(root, 3, trained.state_dict()))
            while reported[-1][0] != 3:  # noqa: ASYNC110
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert reported[0] == (1, [1, 1])
    assert reported[-1] == (3, [3, 3])
    for name, value in trained.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], value)


async def test_a_previous_runs_weights_and_batches_are_cleared(tmp_path: Path) -> None:
    from trio_rl.learn import run_learning

    # leftovers of an earlier run: a far newer version the watcher would otherwise load
    publish_weights(tmp_path / "weights", 500, _model(3).state_dict())
    (tmp_path / "batches" / "step_1").mkdir(parents=True)
    (tmp_path / "batches" / "step_1" / "rank_0.bin").write_bytes(b"not a batch")
    config = learn_config(tmp_path, run__steps=2, metrics__console=False, metrics__plot=False)
    with trio.fail_after(300):
        result = await run_learning(config)
    assert [m["step"] for m in result.metrics] == [1, 2]
    assert all(m["policy_version"] < 3 for m in result.metrics)
    # metrics.jsonl carries the publication record's flat keys (threads, selection, all side)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == result.metrics
    for m in lines:
        assert m["threads/limit"] == float(config.publish.threads)
        assert m["threads/busy_max"] >= 1.0
        assert m["train/selected/samples"] >= m["samples"]
        assert m["train/all/completion_length/count"] >= m["samples"]
        assert m["train/all/attempts"] >= m["samples"]
        assert "time/total" in m
        flat = ("warnings/", "train/", "trainer/", "threads/", "time/", "batch/", "counters/")
        assert all(k.startswith(flat) or k in {*FIELDS, "open_groups"} for k in m)
    latest = latest_weights(tmp_path / "weights")
    assert latest is None or latest.version <= 2
