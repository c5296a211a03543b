"""prime-rl's configuration habits, each pinned: ``TRIO_RL_<SECTION>__<KEY>`` environment
overrides between the files and the flags, ``run.max_steps`` as a total beside ``--steps``,
``trio-rl config`` taking every flag of ``run``, help texts that read right, ``--out``
refused up front, privileged ports refused unless allowed, ``metrics.prometheus_host``, and
jittered retry pauses in the HTTP engines."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from trio_rl.cli import _parser, main
from trio_rl.config import ConfigError, LearnRunConfig, SimulateConfig, env_overrides, load
from trio_rl.engines._backoff import retry_delay

QUICK = str(Path(__file__).parents[2] / "examples" / "learn-quick.toml")


def _config(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["config", *args]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_environment_overrides_sit_between_the_files_and_the_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "a.toml"
    file.write_text("[rollout]\nbatch_groups = 4\ngroup_size = 4\n[run]\nseed = 3\n")
    monkeypatch.setenv("TRIO_RL_ROLLOUT__BATCH_GROUPS", "16")  # beats the file
    monkeypatch.setenv("TRIO_RL_RUN__SEED", "7")  # loses to the flag
    monkeypatch.setenv("TRIO_RL_METRICS__WANDB_TAGS", "a,b")  # a bare word: a string
    monkeypatch.setenv("TRIO_RL_ENGINE__SLOTS", "3")  # simulate's key: left to simulate
    monkeypatch.setenv("TRIO_RL_THOROUGH", "1")  # no __: not a key
    got = _config(capsys, str(file), "--seed", "9")
    assert got["rollout"]["batch_groups"] == 16
    assert got["rollout"]["group_size"] == 4
    assert got["run"]["seed"] == 9
    assert got["metrics"]["wandb_tags"] == "a,b"
    got = _config(capsys, str(file), "--set", "rollout.batch_groups=2")  # --set beats it
    assert got["rollout"]["batch_groups"] == 2
    assert _config(capsys, "--for", "simulate")["engine"]["slots"] == 3
    # the origin of a bad value is the variable
    monkeypatch.setenv("TRIO_RL_ROLLOUT__BATCH_GROUPS", "0")
    with pytest.raises(ConfigError, match=r"TRIO_RL_ROLLOUT__BATCH_GROUPS.*must be >= 1"):
        load(LearnRunConfig, [file], env_overrides(LearnRunConfig, {
            "TRIO_RL_ROLLOUT__BATCH_GROUPS": "0"}))  # fmt: skip
    # a variable that names no key of either command is an error naming it: exit 2
    monkeypatch.delenv("TRIO_RL_ROLLOUT__BATCH_GROUPS")
    monkeypatch.setenv("TRIO_RL_ROLLOUT__BATCH_GROUP", "3")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "TRIO_RL_ROLLOUT__BATCH_GROUP" in err
    assert "did you mean 'batch_groups'" in err
    with pytest.raises(ConfigError, match="TRIO_RL_NOPE__X"):
        env_overrides(SimulateConfig, {"TRIO_RL_NOPE__X": "1"}, [LearnRunConfig])


def _steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if "samples" in json.loads(line)]


def test_max_steps_is_a_total_and_steps_this_many_more(tmp_path: Path) -> None:
    out = tmp_path / "run"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "trio_rl", "run", QUICK, "--out", str(out), "--plain", *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    first = run("--steps", "2", "--max-steps", "3")
    assert first.returncode == 0, first.stderr
    assert _steps(out) == [1, 2]
    # two more asked for, one left before the total
    second = run("--steps", "2", "--max-steps", "3")
    assert second.returncode == 0, second.stderr
    assert _steps(out) == [1, 2, 3]
    third = run("--steps", "2", "--max-steps", "3")
    assert third.returncode == 0, third.stderr
    assert "has shipped step 3, its run.max_steps (3): nothing to do" in third.stdout
    assert _steps(out) == [1, 2, 3]


def test_config_accepts_every_flag_of_run(capsys: pytest.CaptureFixture[str]) -> None:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    choices: dict[str, Any] = sub.choices  # type: ignore[assignment]
    run_flags = {o for a in choices["run"]._actions for o in a.option_strings}
    config_flags = {o for a in choices["config"]._actions for o in a.option_strings}
    assert run_flags <= config_flags, run_flags - config_flags
    got = _config(capsys, QUICK, "--steps", "5", "--max-steps", "9", "--task", "copy",
                  "--no-plot", "--plain", "--log-level", "debug", "--fresh",
                  "--allow-change", "run.seed")  # fmt: skip
    assert got["run"]["steps"] == 5
    assert got["run"]["max_steps"] == 9
    assert got["rollout"]["task"] == "copy"
    assert got["metrics"]["plot"] is False
    assert got["metrics"]["display"] == "plain"
    assert got["run"]["log_level"] == "debug"


def _help(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "trio_rl", *command, "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def test_help_texts_read_right() -> None:
    run = _help("run")
    assert "--no-plot do not draw RUN_DIR/plot.png at the end; shorthand for --set " \
        "metrics.plot=false" in run  # fmt: skip
    assert "(default True)" not in run
    assert "--plain one plain line per step" in run
    assert "--max-steps MAX_STEPS the run's last step, a total across resumes" in run
    watch = _help("watch")
    assert "show a run's metrics records" in watch  # a description of its own
    assert "--interval INTERVAL seconds between polls with --follow (default 0.5)" in watch


def test_watch_names_a_missing_path(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_rl", "watch", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"trio-rl: error: {tmp_path / 'nope'}: no such file (pass a run directory or its "
        "metrics.jsonl)"
    )
    assert "line 0" not in line


@pytest.mark.parametrize("command", ["run", "simulate"])
def test_an_unwritable_out_is_a_usage_error_naming_the_option(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # /proc takes no new directory, whoever asks (root included)
    assert main([command, "--out", "/proc/trio-rl-test/run", "--steps", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trio-rl: error: --out /proc/trio-rl-test/run: cannot write there")


def test_privileged_ports_are_refused_unless_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--for", "simulate", "--set", "transport.port=80"]) == 2
    err = capsys.readouterr().err
    assert "transport" in err
    assert "port 80 is below 1024" in err
    assert "allow_privileged_port" in err
    got = _config(capsys, "--for", "simulate", "--set", "transport.port=80",
                  "--set", "transport.allow_privileged_port=true")  # fmt: skip
    assert got["transport"]["port"] == 80
    assert main(["config", "--set", "metrics.prometheus_port=443"]) == 2
    assert "prometheus_port 443 is below 1024" in capsys.readouterr().err
    for ok in ("0", "1024", "9100"):  # 0: a free port
        assert _config(capsys, "--set", f"metrics.prometheus_port={ok}")["metrics"]


def test_prometheus_host_is_where_the_endpoint_listens(capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    from trio_rl._learn_cmd import open_metric_sinks

    got = _config(capsys, "--set", "metrics.prometheus_host=127.0.0.2",
                  "--set", "metrics.prometheus_port=0")  # fmt: skip
    assert got["metrics"]["prometheus_host"] == "127.0.0.2"
    cfg, _ = load(LearnRunConfig, [], [])
    metrics = type(cfg.metrics)(prometheus_port=0, prometheus_host="127.0.0.2")
    sinks = open_metric_sinks(metrics, Path("."))
    try:
        (prometheus,) = sinks.sinks
        assert prometheus.host == "127.0.0.2"
        sinks.write({"step": 1, "reward_mean": 0.5})
        body = httpx.get(f"http://127.0.0.2:{prometheus.port}/metrics", timeout=10).text
        assert "trio_rl_reward_mean 0.5" in body
        with pytest.raises(httpx.TransportError):  # not on the default address
            httpx.get(f"http://127.0.0.1:{prometheus.port}/metrics", timeout=5)
    finally:
        sinks.close()
    assert "http://127.0.0.2:" in capsys.readouterr().out


def test_retry_pauses_are_jittered_exponential_and_capped() -> None:
    rng = random.Random(5)
    for attempt, (low, high) in enumerate([(0.125, 0.25), (0.25, 0.5), (0.5, 1.0)], 1):
        draws = [retry_delay(attempt, 0.25, draw=rng.random) for _ in range(200)]
        assert all(low <= d <= high for d in draws)
        assert len(set(draws)) == 200  # spread, not one instant for every client
        assert max(draws) - min(draws) > 0.8 * (high - low)
    assert all(4.0 <= retry_delay(10, 0.25, cap=8.0) <= 8.0 for _ in range(50))
    assert retry_delay(1, 0.0) == 0.0  # backoff=0: no pause
    assert retry_delay(2, 1.0, draw=lambda: 0.0) == 1.0
