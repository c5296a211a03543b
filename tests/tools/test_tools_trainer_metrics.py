"""The trainer's fields (``trainer/loss``, ``trainer/kl``, ...) reach every sink like the
orchestrator's: metrics.jsonl, TensorBoard (a ``trainer`` section of its own), an offline W&B
run (charted against ``step`` even when a trainer record arrives after a later step's) and
the Prometheus endpoint. Synthetic records with exactly the keys the trainers write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from tools_helpers import extra, tf_scalars, wandb_history, wandb_rows

from trio_rl.tools import (
    TRAINER_FIELDS,
    JsonlSink,
    PrometheusSink,
    TensorBoardSink,
    WandbSink,
    open_sinks,
    read_metrics,
)

KEYS = (
    "trainer/loss",
    "trainer/clip_frac",
    "trainer/ratio_mean",
    "trainer/kl",
    "trainer/entropy",
    "trainer/grad_norm",
    "trainer/lr",
    "trainer/tokens_per_s",
)


def _trainer(step: int) -> dict[str, Any]:
    """A trainer's record of ``step``: each key a value that names the key and the step."""
    return {"step": step, **{key: step + i / 10 for i, key in enumerate(KEYS, 1)}}


def _orchestrator(step: int) -> dict[str, Any]:
    return {"step": step, "reward_mean": 0.1 * step, "samples_per_s": 50.0}


#: What a run's stream may look like: the orchestrator's record of a step, the trainer's
#: reports of steps 1 and 2 after step 2 shipped (the trainer trails), and one step whose
#: record carries both.
STREAM: list[dict[str, Any]] = [
    _orchestrator(1),
    _orchestrator(2),
    _trainer(1),
    _trainer(2),
    {**_orchestrator(3), **_trainer(3)},
]


def test_the_trainer_fields_are_the_ones_the_trainers_write() -> None:
    assert tuple(TRAINER_FIELDS) == KEYS
    assert all(TRAINER_FIELDS[k] for k in KEYS)


def test_jsonl_keeps_the_trainer_fields(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for r in STREAM:
        sink.write(r)
    sink.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == STREAM


def test_tensorboard_shows_a_trainer_section(tmp_path: Path) -> None:
    extra("tensorboardX")
    sink = TensorBoardSink(tmp_path / "tb")
    for r in STREAM:
        sink.write(r)
    sink.close()
    scalars = tf_scalars(tmp_path / "tb")
    for i, key in enumerate(KEYS, 1):
        # its own section, every trained step, the late report included
        assert scalars[key] == pytest.approx({s: s + i / 10 for s in (1, 2, 3)}), key
        assert f"trio_rl/{key}" not in scalars
    assert scalars["trio_rl/reward_mean"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})


def test_wandb_charts_every_trainer_field_against_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(project="trio-rl-test", dir=str(tmp_path))
    run_dir = Path(sink.run.dir).parent
    for r in STREAM:
        sink.write(r)
    sink.close()
    (run_file,) = run_dir.glob("*.wandb")
    # every record is a row (none dropped for arriving after a later step's), in order
    assert [row["step"] for row in wandb_rows(run_file)] == [r["step"] for r in STREAM]
    history = wandb_history(run_file)
    for step in (1, 2, 3):
        for i, key in enumerate(KEYS, 1):
            assert history[step][key] == pytest.approx(step + i / 10), (step, key)
        assert history[step]["reward_mean"] == pytest.approx(0.1 * step)


def test_prometheus_serves_the_trainer_gauges(tmp_path: Path) -> None:
    extra("prometheus_client")
    sink = PrometheusSink(port=0)
    try:
        for r in STREAM:
            sink.write(r)
        body = httpx.get(f"http://127.0.0.1:{sink.port}/metrics", timeout=10).text
    finally:
        sink.close()
    for i, key in enumerate(KEYS, 1):
        name = "trio_rl_" + key.replace("/", "_")
        assert f"{name} {3 + i / 10}\n" in body, key  # the latest report: step 3's
        assert f"# HELP {name} {TRAINER_FIELDS[key]}\n" in body


def test_open_sinks_feeds_the_trainer_fields_to_each_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra("tensorboardX")
    extra("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import io

    sinks = open_sinks(
        tmp_path, stream=io.StringIO(), tensorboard=True, wandb={"project": "trio-rl-test"}
    )
    for r in STREAM:
        sinks.write(r)
    sinks.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == STREAM
    assert set(KEYS) <= set(tf_scalars(tmp_path / "tensorboard"))
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/*.wandb")
    assert all(key in wandb_history(run_file)[3] for key in KEYS)
