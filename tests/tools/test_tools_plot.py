"""``trio-rl plot``: the standard figures from a real learning run's metrics.jsonl, as PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tools_helpers import extra, learn, trio_rl

from trio_rl.tools import InspectError, MissingExtraError, read_metrics
from trio_rl.tools.plot_cmd import PANELS, build_figure, run_facts, write_figure

extra("matplotlib")  # in the test dependency group: never skipped in CI


@pytest.fixture(scope="module")
def learn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return learn(tmp_path_factory.mktemp("learn") / "run")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_panels_of_a_learning_run(learn_run: Path) -> None:
    records = read_metrics(learn_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    fig = build_figure(records)
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == list(PANELS)
    panel = dict(zip(PANELS, axes, strict=True))
    (line,) = panel["reward"].get_lines()
    assert list(line.get_xdata()) == [1, 2, 3, 4]
    assert list(line.get_ydata()) == pytest.approx([r["reward_mean"] for r in records])
    assert len(panel["throughput"].get_lines()) >= 1
    # each quantity on its own axis, with its unit in the label
    assert panel["off-policy lag"].get_ylabel().endswith("(versions)")
    assert panel["loop lag"].get_ylabel().endswith("(ms)")
    # the mean lag varies where the largest sits at max_async_level: the mean is the line,
    # the largest a dotted one
    mean, largest = panel["off-policy lag"].get_lines()
    key = "train/effective/off_policy/mean"
    assert list(mean.get_ydata()) == [r[key] for r in records]
    assert list(largest.get_ydata()) == [r["off_policy_max"] for r in records]
    assert largest.get_linestyle() == ":"


def test_the_title_names_the_run_task_and_seed_and_marks_the_stop(tmp_path: Path) -> None:
    run = tmp_path / "myrun"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "reward_mean": 0.1 * s, "samples": 8, "wall_s": 2.0 * s}) + "\n"
            for s in (1, 2, 3)
        )
    )
    (run / "config.toml").write_text('[run]\nseed = 7\n\n[rollout]\ntask = "reverse"\n')
    why = "reached reward 0.300 >= stop_at_reward 0.3 (the last 1 steps)"
    (run / "ended.json").write_text(json.dumps({"step": 3, "stopped": "reward", "message": why}))
    about, ended = run_facts(run)
    fig = build_figure(read_metrics(run / "metrics.jsonl"), "myrun", about=about, ended=ended)
    assert fig._suptitle.get_text() == (
        f"trio-rl run myrun | task reverse | seed 7 | 6 s wall\nstopped at step 3: {why}"
    )
    for ax in fig.get_axes():  # a dashed line at the stop on every panel
        assert any(list(line.get_xdata()) == [3, 3] for line in ax.get_lines())
    # `trio-rl plot` writes the same figure `trio-rl run` does (one title format)
    assert write_figure(run) == run / "plot.png"


def test_the_trainer_panels_plot_the_trainer_s_records() -> None:
    records: list[dict[str, float]] = [
        {"step": 1, "reward_mean": 0.1, "samples": 8},
        {"step": 2, "reward_mean": 0.2, "samples": 8},
        {"step": 1, "trainer/loss": -0.5, "trainer/kl": 0.01, "trainer/entropy": 2.0},
        {"step": 2, "trainer/loss": 0.25, "trainer/kl": 0.02, "trainer/entropy": 1.9},
    ]
    panel = dict(zip(PANELS, build_figure(records).get_axes(), strict=True))
    for name, key in (("trainer loss", "trainer/loss"), ("trainer KL", "trainer/kl"),
                      ("trainer entropy", "trainer/entropy")):  # fmt: skip
        (line,) = panel[name].get_lines()
        assert list(line.get_xdata()) == [1, 2]
        assert list(line.get_ydata()) == [r[key] for r in records[2:]]
    # a trainer's own record is not a step of the reward panel
    (line,) = panel["reward"].get_lines()
    assert list(line.get_xdata()) == [1, 2]


def test_one_outlier_does_not_squash_its_panel() -> None:
    lags = [950.0] + [2.0 + 0.1 * (i % 5) for i in range(39)]
    records = [{"step": i + 1, "loop_lag_p95_ms": v} for i, v in enumerate(lags)]
    ax = dict(zip(PANELS, build_figure(records).get_axes(), strict=True))["loop lag"]
    low, high = ax.get_ylim()
    assert low <= 0.0  # a lag's axis starts at zero
    assert 2.4 <= high < 5.0  # the bulk fills the panel; 950 ms would make it 1000
    assert [t.get_text() for t in ax.texts] == ["1 off scale (950)"]
    # the outlier is still shown, as a marker on the top edge
    _, marker = ax.get_lines()
    assert list(marker.get_ydata()) == [high]
    assert list(marker.get_xdata()) == [1]


def test_a_panel_without_its_fields_says_so() -> None:
    fig = build_figure([{"step": 1, "reward_mean": 0.5}, {"step": 2, "reward_mean": 0.6}])
    occupancy = fig.get_axes()[2]
    assert occupancy.get_lines() == []
    assert [t.get_text() for t in occupancy.texts] == ["no slot_occupancy in metrics.jsonl"]
    full = build_figure([{"step": 1, "reward_mean": 0.5, "slot_occupancy": 0.9}])
    (line,) = full.get_axes()[2].get_lines()
    assert list(line.get_ydata()) == [0.9]


def test_throughput_is_scored_samples_over_a_window() -> None:
    records: list[dict[str, float | None]] = [
        {"step": 1, "wall_s": 1.0, "reward_count": 10},
        {"step": 2, "wall_s": 2.0, "samples": 30},  # no reward_count: what shipped
        {"step": 3, "wall_s": 4.0, "reward_count": None},  # null: nothing scored
    ]
    (line,) = build_figure(records).get_axes()[1].get_lines()
    assert list(line.get_ydata()) == pytest.approx([10.0, 20.0, 10.0])


def test_the_command_writes_a_png(learn_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "figure.png"
    done = trio_rl("plot", str(learn_run), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(str(out))
    assert _png_size(out) == (1100, 1200)
    # the default target is the run's own plot.png: the figure `trio-rl run` draws at its end
    default = write_figure(learn_run)
    assert default == learn_run / "plot.png"
    assert _png_size(default) == (1100, 1200)


def test_the_run_s_plot_is_the_plot_command_s_figure(tmp_path: Path) -> None:
    from trio_rl.learn import write_plot

    records = [{"step": s, "reward_mean": 0.1 * s, "loop_lag_p95_ms": 1.0} for s in (1, 2, 3)]
    write_plot(records, tmp_path / "plot.png", "repeat")
    assert _png_size(tmp_path / "plot.png") == (1100, 1200)


def test_errors_are_one_line(tmp_path: Path) -> None:
    done = trio_rl("plot", str(tmp_path))
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert f"{tmp_path / 'metrics.jsonl'}: no metrics file" in line
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + "{bad\n")
    done = trio_rl("plot", str(tmp_path))
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "metrics.jsonl: line 2 (byte offset 12)" in line
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(InspectError, match="no records yet"):
        write_figure(tmp_path)


def test_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"trio-rl\[learn\]"):
        build_figure([{"step": 1}])


def test_inspect_reads_the_same_learning_run(learn_run: Path) -> None:
    """(Here to share the learning run.) run.json, metrics.jsonl and weights/ summarised."""
    done = trio_rl("inspect", str(learn_run), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["run"]["steps"] == 4
    assert data["run"]["group_size"] == 8
    metrics = data["metrics"]
    assert metrics["records"] == 4
    assert metrics["steps"] == "1..4"
    assert metrics["samples"] == sum(
        r["samples"] for r in read_metrics(learn_run / "metrics.jsonl")
    )
    published = sorted(int(p.name.removeprefix("step_")) for p in (learn_run / "weights").iterdir())
    assert data["weights"]["versions"] == published


def test_the_reward_panel_draws_the_held_out_evals(tmp_path: Path) -> None:
    from trio_rl.evals import EvalJournal, EvalResult
    from trio_rl.tools.plot_cmd import read_evals

    records = [{"step": s, "reward_mean": 0.1 * s, "samples": 8} for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    journal = EvalJournal(tmp_path)
    for step, status in ((0, "done"), (2, "done"), (4, "done"), (6, "cut")):
        journal.finish(
            EvalResult(
                step=step,
                policy_version=step,
                k=8,
                status=status,  # type: ignore[arg-type]
                avg_at_k=0.05 * step,
                pass_at_1=0.04 * step,
            )
        )
    evals = read_evals(tmp_path / "eval.jsonl")
    panel = dict(zip(PANELS, build_figure(records, evals=evals).get_axes(), strict=True))
    lines = {line.get_label(): line for line in panel["reward"].get_lines()}
    assert list(lines["held-out avg@8"].get_xdata()) == [0, 2, 4, 6]
    assert list(lines["held-out avg@8"].get_ydata()) == pytest.approx([0, 0.1, 0.2, 0.3])
    assert list(lines["held-out pass@1"].get_ydata()) == pytest.approx([0, 0.08, 0.16, 0.24])
    assert list(lines["cut"].get_xdata()) == [6]
    assert write_figure(tmp_path) == tmp_path / "plot.png"
    (tmp_path / "eval.jsonl").write_text('{"no": "step"}\n')
    with pytest.raises(InspectError, match=r"eval\.jsonl:1"):
        write_figure(tmp_path)
