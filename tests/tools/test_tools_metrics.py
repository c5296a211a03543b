"""Metrics sinks: the JSONL file, TensorBoard, Weights & Biases (offline) and a Prometheus
endpoint scraped over real HTTP, all fed the same records."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from tools_helpers import extra, tf_events, wandb_history

from trio_rl.errors import TrioRLError
from trio_rl.tools import (
    FanOut,
    JsonlSink,
    MetricsFileError,
    MetricsSink,
    MissingExtraError,
    PrometheusSink,
    TensorBoardSink,
    WandbSink,
    read_metrics,
)
from trio_rl.tools.console import ConsoleDisplay

RECORDS: list[dict[str, Any]] = [
    {
        "step": s,
        "reward_mean": 0.1 * s,
        "samples_per_s": 100.0 + s,
        "slot_occupancy": 0.5,
        "loop_lag_p95_ms": 1.5,
        "queue_depth": 3 * s,
        "off_policy_max": 1,
        "reward_none": None,
        "flag": True,
        "note": "text",
    }
    for s in (1, 2, 3)
]


def test_every_sink_is_a_metrics_sink(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "m.jsonl")
    assert isinstance(sink, MetricsSink)
    assert isinstance(ConsoleDisplay(plain=True), MetricsSink)
    sink.close()


def test_jsonl_round_trip_and_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    for r in RECORDS:
        sink.write(r)
    sink.close()
    assert read_metrics(path) == RECORDS
    # a writer killed mid-line: the partial line is not a record (yet)
    with path.open("a") as f:
        f.write('{"step": 4, "rew')
    assert read_metrics(path) == RECORDS


def test_a_bad_line_names_file_line_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = json.dumps(RECORDS[0]) + "\n"
    path.write_text(first + "[1, 2]\n")
    with pytest.raises(MetricsFileError) as caught:
        read_metrics(path)
    assert caught.value.line == 2
    assert caught.value.offset == len(first.encode())
    assert str(path) in str(caught.value)
    path.write_text(first + '{"reward_mean": 1}\n')
    with pytest.raises(MetricsFileError, match=r"line 2 .*'step'"):
        read_metrics(path)
    path.write_text("not json\n")
    with pytest.raises(MetricsFileError, match="line 1 \\(byte offset 0\\): not JSON"):
        read_metrics(path)


def test_nan_and_infinity_are_written_as_null(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.write({"step": 1, "ratio": float("nan"), "lag": float("inf"), "ok": 1.5})
    sink.close()
    assert read_metrics(path) == [{"step": 1, "ratio": None, "lag": None, "ok": 1.5}]


def test_a_record_without_a_step_is_refused(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="'step'"):
        sink.write({"reward_mean": 1.0})
    sink.close()


def test_tensorboard_scalars_at_each_step(tmp_path: Path) -> None:
    extra("tensorboardX")  # the `tensorboard` extra; CI's test group installs it
    from tensorboardX.proto.event_pb2 import Event

    sink = TensorBoardSink(tmp_path / "tb")
    for r in RECORDS:
        sink.write(r)
    sink.close()
    scalars: dict[str, dict[int, float]] = {}
    for raw in tf_events(tmp_path / "tb"):
        event = Event.FromString(raw)
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    assert scalars["trio_rl/reward_mean"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert scalars["trio_rl/queue_depth"] == {1: 3.0, 2: 6.0, 3: 9.0}
    # non-numeric, null and boolean fields are not scalars; the step is the x axis
    assert not {"trio_rl/note", "trio_rl/flag", "trio_rl/reward_none", "trio_rl/step"} & set(
        scalars
    )


def test_wandb_offline_run_gets_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra("wandb")  # the `wandb` extra; CI's test group installs it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(project="trio-rl-test", dir=str(tmp_path), config={"group_size": 8})
    run_dir = Path(sink.run.dir).parent
    for r in RECORDS:
        sink.write(r)
    sink.close()
    (run_file,) = run_dir.glob("*.wandb")  # what `wandb sync` uploads
    rows = wandb_history(run_file)
    assert sorted(rows) == [1, 2, 3]
    for r in RECORDS:
        row = rows[r["step"]]
        assert row["step"] == r["step"]
        assert row["reward_mean"] == pytest.approx(r["reward_mean"])
        assert row["queue_depth"] == r["queue_depth"]
        assert not {"note", "flag", "reward_none"} & set(row)


def test_prometheus_endpoint_over_http(tmp_path: Path) -> None:
    extra("prometheus_client")  # the `prometheus` extra; CI installs it
    sink = PrometheusSink(port=0)
    url = f"http://127.0.0.1:{sink.port}/metrics"
    try:
        sink.write(RECORDS[0])
        sink.write(RECORDS[1])
        body = httpx.get(url, timeout=10).text
    finally:
        sink.close()
    assert "trio_rl_reward_mean 0.2\n" in body
    assert "trio_rl_queue_depth 6.0\n" in body
    assert "trio_rl_step 2.0\n" in body
    assert "# HELP trio_rl_slot_occupancy busy fraction" in body
    assert "trio_rl_note" not in body
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=5)


def test_fan_out_feeds_every_sink(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    sink = FanOut([JsonlSink(a), JsonlSink(b)])
    for r in RECORDS:
        sink.write(r)
    sink.close()
    assert read_metrics(a) == read_metrics(b) == RECORDS


@pytest.mark.parametrize(
    ("module", "build", "extra"),
    [
        ("tensorboardX", lambda p: TensorBoardSink(p), "tensorboard"),
        ("wandb", lambda p: WandbSink(dir=str(p)), "wandb"),
        ("prometheus_client", lambda p: PrometheusSink(), "prometheus"),
    ],
)
def test_a_missing_extra_is_one_clear_error(
    module: str, build: Any, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(MissingExtraError, match=f"trio-rl\\[{extra}\\]") as caught:
        build(tmp_path)
    assert isinstance(caught.value, TrioRLError)


async def test_a_run_feeds_every_sink_the_same_records(tmp_path: Path) -> None:
    """Shipments of a real orchestrator run -> step_record -> open_sinks (JSONL, console,
    Prometheus): the file, the console and the endpoint all show the same steps."""
    extra("prometheus_client")
    import io

    import trio

    from trio_rl.engines import SamplingParams, SimulatedEngine
    from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
    from trio_rl.publish import Shipment
    from trio_rl.rollout import InMemorySource
    from trio_rl.samples import Prompt, Sample
    from trio_rl.sink import SinkConfig
    from trio_rl.tools import open_sinks, step_record
    from trio_rl.trainer import BatchReceiver
    from trio_rl.transport import MemorySender

    console = io.StringIO()
    sinks = open_sinks(tmp_path, stream=console, prometheus_port=0)
    (prometheus,) = [s for s in sinks.sinks if isinstance(s, PrometheusSink)]
    engine = SimulatedEngine(distribution="long-cot", slots=16, seed=3, seconds_per_token=1e-7)
    config = OrchestratorConfig(
        batch_groups=2,
        group_size=4,
        max_async_level=1000,
        sink=SinkConfig(batch_size=8, max_off_policy_steps=None),
        sampling=SamplingParams(max_tokens=64),
    )
    send, receive = trio.open_memory_channel[Shipment](8)
    started = trio.current_time()

    def reward(sample: Sample) -> float:
        return float(sample.index % 4)

    async def consume() -> None:
        last = started
        async with receive:
            async for shipment in receive:
                now = trio.current_time()
                rec = step_record(
                    shipment.record,
                    wall_s=now - started,
                    interval_s=now - last,
                    policy_version=orch.policy_version,
                    slot_occupancy=engine.statistics().occupancy,
                    queue_depth=orch.sink.queued,
                )
                last = now
                await trio.to_thread.run_sync(sinks.write, rec)

    async def rank() -> None:
        async with BatchReceiver(sender.receiver(0, start_step=1), stop_step=4) as batches:
            async for _ in batches:
                pass

    sender = MemorySender(1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank)
            async with (
                sender,
                open_orchestrator(
                    engine,
                    InMemorySource([Prompt(key=f"k{i}", tokens=(i, 7)) for i in range(50)]),
                    sender,
                    config=config,
                    sample_reward=reward,
                    monitor=send,
                ) as orch,
            ):
                nursery.start_soon(consume)
                await orch.run(3)
                await send.aclose()
    async with httpx.AsyncClient() as client:
        got = await client.get(f"http://127.0.0.1:{prometheus.port}/metrics", timeout=10)
    body = got.text
    sinks.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["samples"] == 8
        assert 0.0 < r["slot_occupancy"] <= 1.0
        assert r["queue_depth"] >= 0
        assert r["reward_mean"] == pytest.approx(1.5)
        # the publication record's flat keys ride along: threads, selection, the all side
        assert isinstance(r["step"], int)
        assert r["threads/limit"] >= 1.0
        assert 1.0 <= r["threads/busy_max"] <= r["threads/limit"]
        assert r["train/selected/samples"] == 8.0
        assert r["train/all/reward/max"] == 3.0
        assert r["train/all/completion_length/count"] == r["reward_count"]
        assert r["train/effective/samples"] == 8.0
        assert "time/total" in r
    assert "trio_rl_train_all_reward_max 3.0\n" in body
    assert [line.split(" | ")[0] for line in console.getvalue().splitlines()] == [
        "step 1",
        "step 2",
        "step 3",
    ]
    assert "trio_rl_step 3.0\n" in body
    assert f"trio_rl_queue_depth {float(records[-1]['queue_depth'])}\n" in body


def test_trio_rl_run_feeds_the_adapters_its_config_asks_for(tmp_path: Path) -> None:
    """`trio-rl run` with `[metrics]` tensorboard, wandb_project and prometheus_port: every
    step of metrics.jsonl reaches TensorBoard and the offline W&B run too, and so does the
    held-out eval of the initial policy."""
    extra("tensorboardX")
    extra("wandb")
    extra("prometheus_client")
    import os
    import subprocess

    from tensorboardX.proto.event_pb2 import Event

    out = tmp_path / "run"
    quick = Path(__file__).parents[2] / "examples" / "learn-quick.toml"
    done = subprocess.run(
        [sys.executable, "-m", "trio_rl", "run", str(quick), "--out", str(out), "--steps", "3",
         "--set", "metrics.tensorboard=true", "--set", "metrics.wandb_project=trio-rl-test",
         "--set", "metrics.prometheus_port=0"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "metrics: Prometheus endpoint on port " in done.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    tb_steps = {
        event.step
        for raw in tf_events(out / "tensorboard")
        for event in [Event.FromString(raw)]
        if any(v.tag == "trio_rl/reward_mean" for v in event.summary.value)
    }
    assert tb_steps == set(steps)
    (run_file,) = (out / "wandb").glob("offline-run-*/*.wandb")
    history = wandb_history(run_file)
    # the held-out eval before training (step 0) reaches the sinks too, under eval/
    assert sorted(history) == [0, *steps]
    assert "eval/avg@8" in history[0]
    eval_tags = {
        v.tag: event.step
        for raw in tf_events(out / "tensorboard")
        for event in [Event.FromString(raw)]
        for v in event.summary.value
        if v.tag.startswith("eval/")
    }
    assert eval_tags["eval/pass_at_8"] == 0


def _eval_record() -> dict[str, object]:
    from trio_rl.evals import EvalResult

    return EvalResult(
        step=4, policy_version=4, k=8, prompts=3, samples=24, avg_at_k=0.5, pass_at_1=0.25,
        pass_at_k=0.75, pass_hat_k=0.125, truncated=0.0, failed=0.0, wall_s=1.5,
    ).sink_record()  # fmt: skip


def test_an_eval_record_reaches_every_adapter_under_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pass@8 and pass^8 stay two series in TensorBoard, W&B and Prometheus alike."""
    extra("tensorboardX")
    extra("prometheus_client")
    extra("wandb")
    from tensorboardX.proto.event_pb2 import Event

    rec = _eval_record()
    assert {"eval/avg@8", "eval/pass@1", "eval/pass@8", "eval/pass^8", "eval/cut"} <= set(rec)
    tb = TensorBoardSink(tmp_path / "tb")
    tb.write(rec)
    tb.close()
    scalars = {
        v.tag: (e.step, v.simple_value)
        for raw in tf_events(tmp_path / "tb")
        for e in [Event.FromString(raw)]
        for v in e.summary.value
    }
    assert scalars["eval/pass_at_8"] == (4, 0.75)
    assert scalars["eval/pass_hat_8"] == (4, 0.125)
    prom = PrometheusSink(port=0)
    try:
        prom.write(rec)
        body = httpx.get(f"http://127.0.0.1:{prom.port}/metrics", timeout=10).text
    finally:
        prom.close()
    assert "trio_rl_eval_pass_at_8 0.75\n" in body
    assert "trio_rl_eval_pass_hat_8 0.125\n" in body
    assert "trio_rl_eval_avg_at_8 0.5\n" in body
    assert "# HELP trio_rl_eval_pass_at_1 " in body
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wb = WandbSink(project="trio-rl-test", dir=str(tmp_path))
    run_dir = Path(wb.run.dir).parent
    wb.write(rec)
    wb.close()
    (run_file,) = run_dir.glob("*.wandb")
    row = wandb_history(run_file)[4]
    assert row["eval/pass@8"] == pytest.approx(0.75)
    assert row["eval/pass^8"] == pytest.approx(0.125)
