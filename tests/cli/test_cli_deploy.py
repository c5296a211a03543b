"""A real run from one TOML, as an operator deploys it, through the real ``trio-rl``
executable: a Hugging Face model directory, a JSONL data file and a reward module of the
user's; the trainer as its own job (``trio-rl trainer CONFIG.toml``) killed with SIGKILL and
started again with the same command; and the bad inputs, each one line, exit 2 for the
configuration and 1 at run time, nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import write_tiny_llama

TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))

REWARD_MODULE = """
import json, os

def score(record, completion):
    # every field of the record reaches the reward, the completion as text
    assert isinstance(completion, str)
    if record.get("explode"):
        raise RuntimeError("this record's reward always fails")
    answer = record["answer"]
    return sum(a == b for a, b in zip(completion, answer)) / max(len(answer), len(completion), 1)


async def ascore(record, completion):
    return score(record, completion)
"""


def _write_run(tmp: Path, *, model: bool = True, extra: str = "", data: str | None = None) -> Path:
    if model:
        write_tiny_llama(tmp / "model")
    (tmp / "myreward.py").write_text(REWARD_MODULE)
    lines = (
        data
        if data is not None
        else "\n".join(
            [
                json.dumps({"prompt": "a3=", "answer": "aaa"}),
                json.dumps({"prompt": "b2=", "answer": "bb", "explode": True}),
                json.dumps({"messages": [{"role": "user", "content": "c4"}], "answer": "cccc"}),
                json.dumps({"prompt": "d1=", "answer": "d"}),
            ]
        )
    )
    (tmp / "data.jsonl").write_text(lines + "\n")
    config = tmp / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{tmp / "run"}"
            steps = 3
            # a random model earns one reward nearly everywhere: without this the run may end
            # converged (every group pruned) before its steps
            converged_after = 100000

            [rollout]
            batch_groups = 2
            group_size = 4

            [model]
            path = "{tmp / "model"}"

            [data]
            prompts = "{tmp / "data.jsonl"}"
            max_tokens = 6

            [reward]
            function = "myreward:score"

            [metrics]
            plot = false
            display = "plain"
            """
        )
        + extra
    )
    return config


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trio_rl(tmp: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # the reward module is imported from the working directory
    return subprocess.run(
        [TRIO_RL, *args], cwd=tmp, capture_output=True, text=True, timeout=timeout
    )


def _left_behind(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (the test's directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline}")
    return found


def test_a_model_directory_a_jsonl_file_and_a_reward_module_make_a_run(tmp_path: Path) -> None:
    config = _write_run(tmp_path)
    done = _trio_rl(tmp_path, "run", str(config))
    assert done.returncode == 0, done.stderr
    records = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    # the record that makes the reward raise failed its samples: counted, shown, run went on
    assert records[-1]["counters/reward_failures"] > 0
    assert "myreward:score failed sample" in done.stderr
    assert "this record's reward always fails" in done.stderr
    assert "further failures are only counted" in done.stderr
    assert f"reward failed {records[-1]['counters/reward_failures']} samples" in done.stdout
    # the trainer published the Hugging Face model's own weight names (what vLLM reloads)
    from safetensors import safe_open

    published = sorted((tmp_path / "run" / "weights").glob("step_*/model.safetensors"))
    assert published
    with safe_open(str(published[-1]), "pt") as f:
        keys = set(f.keys())
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert keys == set(f.keys())
    assert "lm_head.weight" in keys
    assert not _left_behind(str(tmp_path))


@pytest.mark.heavy
def test_an_async_reward_is_awaited(tmp_path: Path) -> None:
    config = _write_run(tmp_path, data=json.dumps({"prompt": "a2=", "answer": "aa"}))
    done = _trio_rl(tmp_path, "run", str(config), "--set", "reward.function=myreward:ascore")
    assert done.returncode == 0, done.stderr
    records = _lines(tmp_path / "run" / "metrics.jsonl")
    assert records[-1]["counters/reward_failures"] == 0
    assert all(r["reward_mean"] is not None for r in records)


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("trio-rl: error: "), done.stderr
    return lines[0]


def test_a_model_directory_without_a_tokenizer_is_one_line_exit_2(tmp_path: Path) -> None:
    config = _write_run(tmp_path, model=False)
    write_tiny_llama(tmp_path / "model", tokenizer=False)
    done = _trio_rl(tmp_path, "run", str(config))
    assert done.returncode == 2
    line = _one_line(done)
    path_line = config.read_text().splitlines().index(f'path = "{tmp_path / "model"}"') + 1
    assert f"{config}:{path_line}: model.path:" in line
    assert "the model directory has no tokenizer" in line
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_reward_that_cannot_be_imported_is_one_line_exit_2(tmp_path: Path) -> None:
    config = _write_run(tmp_path, model=False)
    write_tiny_llama(tmp_path / "model")
    for spec, needle in (
        ("nosuchmodule:score", "cannot import module 'nosuchmodule'"),
        ("myreward:nosuchname", "module 'myreward' has no 'nosuchname'"),
    ):
        done = _trio_rl(tmp_path, "run", str(config), "--set", f"reward.function={spec}")
        assert done.returncode == 2
        line = _one_line(done)
        assert f"--set: reward.function: reward {spec!r}: {needle}" in line, line


def test_a_jsonl_line_that_does_not_parse_is_named_exit_2(tmp_path: Path) -> None:
    data = '{"prompt": "a1=", "answer": "a"}\n{"prompt": "b1=", "answer": \n'
    config = _write_run(tmp_path, model=False, data=data)
    write_tiny_llama(tmp_path / "model")
    done = _trio_rl(tmp_path, "run", str(config))
    assert done.returncode == 2
    line = _one_line(done)
    assert f"data.prompts: {tmp_path / 'data.jsonl'}:2: not valid JSON" in line, line


@pytest.mark.heavy
def test_a_trainer_job_that_never_connects_fails_the_run_at_its_deadline(tmp_path: Path) -> None:
    extra = '\n[trainer]\nmode = "external"\nconnect_timeout = 3.0\n'
    config = _write_run(tmp_path, extra=extra)
    done = _trio_rl(tmp_path, "run", str(config), timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    # what it waited for was logged before the deadline
    assert "WARNING trio_rl.learn: waiting for the trainer job (mode external): no heartbeat" in (
        done.stderr
    )
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"trio-rl: error: the trainer job did not start: no heartbeat in "
        f"{tmp_path / 'run' / 'trainer' / 'heartbeat'} for 3 s (trainer.connect_timeout)"
    ), done.stderr
    assert not _left_behind(str(tmp_path))


def _trained(out: Path) -> list[dict[str, Any]]:
    try:
        text = (out / "trainer" / "trained.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _rank_pids(parent: int) -> list[int]:
    """The trainer ranks torchrun started: its child processes."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [int(c) for c in children]


@pytest.mark.parametrize(
    "ranks", [1, pytest.param(2, marks=pytest.mark.heavy)], ids=["alone", "torchrun-2-ranks"]
)
def test_a_trainer_job_killed_and_started_again_trains_every_step_once(
    tmp_path: Path, ranks: int
) -> None:
    steps = 12
    # one rank: `trio-rl trainer` itself; two: under torchrun (gloo), one rank killed
    command = [TRIO_RL, "trainer", str(tmp_path / "run.toml")]
    if ranks > 1:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "--no-python", *command,
        ]  # fmt: skip
    config = tmp_path / "run.toml"
    out = tmp_path / "run"
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{out}"
            steps = {steps}

            [engine]
            d_model = 32
            n_layers = 1

            [rollout]
            batch_groups = 2
            group_size = 4
            prompts = 64

            [trainer]
            mode = "external"
            ranks = {ranks}
            connect_timeout = 300.0

            [metrics]
            plot = false
            display = "plain"
            """
        )
    )
    orchestrator = subprocess.Popen(
        [TRIO_RL, "run", str(config)], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    trainer = subprocess.Popen(command, cwd=tmp_path)
    try:
        end = time.monotonic() + 400
        while len(_trained(out)) < 4:
            assert time.monotonic() < end, "the trainer job trained fewer than 4 steps in 400 s"
            assert trainer.poll() is None, f"the trainer job exited with {trainer.returncode}"
            time.sleep(0.05)
        # the real process that trains (with torchrun: rank 1's, torchrun then ends the job)
        victim = trainer.pid if ranks == 1 else _rank_pids(trainer.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        assert trainer.wait(timeout=120) != 0
        killed_at = len(_trained(out))
        assert killed_at < steps
        restarted = subprocess.run(
            command, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert restarted.returncode == 0, restarted.stderr
        assert "trainer job: resumed after step" in restarted.stdout
        _, stderr = orchestrator.communicate(timeout=300)
        assert orchestrator.returncode == 0, stderr
    finally:
        for proc in (trainer, orchestrator):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
        if orchestrator.stdout is not None:
            orchestrator.communicate(timeout=60)
    log = _trained(out)
    # every shipped step trained exactly once, none skipped, in order, across the kill
    assert [entry["step"] for entry in log] == list(range(1, steps + 1))
    assert len({entry["pid"] for entry in log}) == 2
    assert {entry["world_size"] for entry in log} == {ranks}
    shipped = _lines(out / "metrics.jsonl")
    assert [m["step"] for m in shipped] == list(range(1, steps + 1))
    # ... and every sample shipped in a step is a sequence the trainer trained in that step
    assert [entry["sequences"] for entry in log] == [m["samples"] for m in shipped]
    assert not _left_behind(str(tmp_path))


def test_an_orchestrator_killed_and_resumed_beside_a_running_trainer_job(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{out}"
            steps = 20
            max_steps = 9

            [engine]
            d_model = 32
            n_layers = 1

            [rollout]
            batch_groups = 2
            group_size = 4
            prompts = 64

            [trainer]
            mode = "external"
            connect_timeout = 120.0

            [metrics]
            plot = false
            display = "plain"
            """
        )
    )
    orchestrator = subprocess.Popen(
        [TRIO_RL, "run", str(config)], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    trainer = subprocess.Popen(
        [TRIO_RL, "trainer", str(config)], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        end = time.monotonic() + 240
        while len(_trained(out)) < 3:
            assert time.monotonic() < end, "the trainer job trained fewer than 3 steps in 240 s"
            assert orchestrator.poll() is None, orchestrator.communicate()
            time.sleep(0.05)
        orchestrator.kill()  # SIGKILL: no checkpoint at exit, only the per-step ones
        orchestrator.communicate(timeout=60)
        resumed = subprocess.run(
            [TRIO_RL, "run", str(config)], cwd=tmp_path, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed at step" in resumed.stdout
        trainer.communicate(timeout=300)
        assert trainer.returncode == 0
    finally:
        for proc in (trainer, orchestrator):
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=60)
    log = _trained(out)
    last = int((out / "STOP").read_text())
    # one trainer job saw both orchestrators: every shipped step trained once, none skipped
    assert [entry["step"] for entry in log] == list(range(1, last + 1))
    # run.max_steps is the run's last step across the resume (not 9 more after the kill)
    assert last == 9
    assert not _left_behind(str(tmp_path))


@pytest.mark.heavy
def test_a_trainer_job_without_an_orchestrator_fails_at_its_deadline(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\nout = "{tmp_path / "run"}"\n\n[trainer]\nmode = "external"\n'
        "connect_timeout = 3.0\n"
    )
    done = _trio_rl(tmp_path, "trainer", str(config), timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "trainer job: waiting for the orchestrator: no heartbeat in" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"trio-rl: error: trainer job: no orchestrator heartbeat in "
        f"{tmp_path / 'run' / 'orchestrator' / 'heartbeat'} for 3 s (trainer.connect_timeout); "
        "start it with `trio-rl run CONFIG.toml` on a machine that sees the run directory"
    )
    assert not _left_behind(str(tmp_path))
