"""Multi-turn episodes driven from outside, with the real ``trio-rl`` executable: a user's
environment module named by ``[env] function``; a recording engine shows that every request's
prompt is a prefix of a shipped sequence and that the shipped batches (decoded with
``trio_rl.wire``) carry the exact loss mask; a tool that sleeps past ``tool_timeout`` ends its
episode and the run goes on; ``kill -9`` and resume keep exactly-once at the trainer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from builders import reward_worker_processes
from trio_rl.wire import decode

TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))

ENV_MODULE = '''
import json, os, random

import trio

from trio_rl.envs import CompactCalls, ToolEnv


class Recording:
    """Writes every request's prompt tokens (one JSON line each), then passes it on."""

    def __init__(self, inner, path):
        self.inner, self.path = inner, path

    async def generate(self, request):
        with open(self.path, "a") as f:
            f.write(json.dumps(list(request.prompt_tokens)) + "\\n")
        return await self.inner.generate(request)


async def recorded(episode, record):
    """Two turns around an observation, every request recorded."""
    episode.engine = Recording(episode.engine, os.environ["REQUESTS_LOG"])
    return await two_turns(episode, record)


async def two_turns(episode, record):
    first = await episode.generate()
    episode.observe("f=")
    second = await episode.generate()
    return (len(first) + len(second)) / 4  # rewards that differ within a group: steps ship


async def sleepy(key):
    if random.random() < 0.5:
        await trio.sleep(30)  # far past tool_timeout
    return "a"


async def zero(episode, record):
    """One turn, scored 0 whatever it says: nothing to learn from."""
    await episode.generate()
    return 0.0


def answered(record, answer, calls):
    return len(answer) / 3  # rewards that differ within a group: steps ship


# a turn that starts with a key calls the tool: half the calls outlive tool_timeout
slow = ToolEnv([sleepy], answered, syntax=CompactCalls(pattern="([12345])"))
'''


def _config(tmp: Path, out: Path, body: str) -> Path:
    (tmp / "envmod.py").write_text(ENV_MODULE)
    config = tmp / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{out}"
            converged_after = 100000

            [engine]
            d_model = 32
            n_layers = 1

            [rollout]
            task = "lookup"
            batch_groups = 2
            group_size = 4
            prompts = 64

            [metrics]
            plot = false
            display = "plain"
            """
        )
        + textwrap.dedent(body)
    )
    return config


def _lines(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_requests_are_prefixes_and_shipped_masks_are_exact(tmp_path: Path) -> None:
    out = tmp_path / "run"
    requests = tmp_path / "requests.jsonl"
    config = _config(
        tmp_path,
        out,
        """
        [run]
        steps = 4

        [env]
        function = "envmod:recorded"
        max_turns = 2

        [trainer]
        # the in-process trainer deletes a batch file once trained: this keeps each one on
        # disk long enough for the test to copy it
        delay = 1.0
        """.replace("[run]\n        steps = 4\n", ""),
    )
    text = config.read_text().replace(
        "converged_after = 100000", "converged_after = 100000\nsteps = 4"
    )
    config.write_text(text)
    kept = tmp_path / "kept"
    kept.mkdir()
    proc = subprocess.Popen(
        [TRIO_RL, "run", str(config)],
        cwd=tmp_path,
        env={**__import__("os").environ, "REQUESTS_LOG": str(requests)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[str] = []
    try:
        end = time.monotonic() + 240
        while proc.poll() is None:
            assert time.monotonic() < end, "the run took over 240 s"
            workers += reward_worker_processes(proc.pid)
            for path in (out / "batches").glob("step_*/rank_*.bin"):
                target = kept / f"{path.parent.name}.bin"
                if not target.exists():
                    try:
                        shutil.copyfile(path, target)
                    except FileNotFoundError:
                        pass  # trained and deleted in between: the copy below tells
            time.sleep(0.05)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    # the environment returns each episode's reward: the run starts no reward workers
    assert workers == []
    shipped = [m["step"] for m in _lines(out / "metrics.jsonl")]
    assert sorted(p.stem for p in kept.iterdir()) == [f"step_{s}" for s in shipped]
    prompts = [tuple(p) for p in _lines(requests)]
    assert prompts
    sequences: list[tuple[tuple[int, ...], tuple[bool, ...], tuple[float, ...]]] = []
    for path in kept.iterdir():
        for mb in decode(path.read_bytes()):
            start = 0
            for length in mb.seq_lens:
                end_ = start + length
                sequences.append(
                    (
                        tuple(mb.input_ids[start:end_]),
                        tuple(mb.loss_mask[start:end_]),
                        tuple(mb.inference_logprobs[start:end_]),
                    )
                )
                start = end_
    assert sequences
    multi_turn = 0
    for ids, mask, logprobs in sequences:
        # the requests for this sequence: every recorded prompt that is a prefix of it
        turns = sorted({p for p in prompts if ids[: len(p)] == p}, key=len)
        assert turns, f"no request's prompt is a prefix of the shipped sequence {ids}"
        expected = [False] * len(ids)
        # turn k sampled from the end of its prompt up to the observation before turn k + 1
        # ('f=', two tokens); the last turn to the end
        bounds = [len(p) for p in turns] + [len(ids) + 2]
        for k in range(len(turns)):
            for i in range(bounds[k], bounds[k + 1] - 2):
                expected[i] = True
        assert list(mask) == expected, (ids, mask, turns)
        assert all(lp == 0.0 for m, lp in zip(mask, logprobs, strict=True) if not m)
        assert all(lp < 0.0 for m, lp in zip(mask, logprobs, strict=True) if m)
        multi_turn += len(turns) == 2
    assert multi_turn == len(sequences)  # every episode took its two turns


def test_a_tool_past_its_timeout_ends_its_episode_and_the_run_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = _config(
        tmp_path,
        out,
        """
        [env]
        function = "envmod:slow"
        max_turns = 2
        tool_timeout = 0.2
        """,
    )
    config.write_text(
        config.read_text().replace(
            "converged_after = 100000", "converged_after = 100000\nsteps = 4"
        )
    )
    done = subprocess.run(
        [TRIO_RL, "run", str(config)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    records = _lines(out / "metrics.jsonl")
    assert records[-1]["step"] == 4
    # whether a random policy's turn calls the tool is a draw: over the run's steps, some
    # calls outlived the timeout and some episodes still ended done
    assert sum(r["episodes/stop/tool_timeout"] for r in records) > 0
    assert sum(r["episodes/stop/done"] for r in records) > 0
    for r in records:
        reasons = ("done", "max_turns", "tool_timeout", "episode_timeout", "budget", "error")
        ended = sum(r[f"episodes/stop/{reason}"] for reason in reasons)
        assert ended == r["episodes/ended"]


def test_an_environment_that_scores_every_episode_alike_is_named_with_its_episodes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    config = _config(tmp_path, out, '[env]\nfunction = "envmod:zero"\n')
    config.write_text(
        config.read_text().replace("converged_after = 100000", "converged_after = 2\nsteps = 20")
    )
    done = subprocess.run(
        [TRIO_RL, "run", str(config)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    both = done.stdout + done.stderr
    assert done.returncode == 1, both
    # the verdict reads the episodes the run played (2 batches' worth: 16), and names the
    # environment, which gave every reward
    assert both.count("nothing to learn from from the first step") == 1, both
    assert "rewards are all 0 (the last 2 batches' worth of groups (16 samples))" in both, both
    assert "check the reward (envmod:zero's scores" in both, both


def _trained(out: Path) -> list[dict[str, Any]]:
    path = out / "trainer" / "trained.jsonl"
    return _lines(path) if path.exists() else []


@pytest.mark.heavy
def test_kill_9_and_resume_keep_exactly_once_at_the_trainer(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = _config(
        tmp_path,
        out,
        """
        [env]
        # two turns around an observation in every episode, rewards that differ in a group
        function = "envmod:two_turns"

        [trainer]
        mode = "external"
        connect_timeout = 120.0
        """,
    )
    config.write_text(
        config.read_text().replace(
            "converged_after = 100000", "converged_after = 100000\nsteps = 20\nmax_steps = 8"
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
        orchestrator.kill()  # SIGKILL: episodes in flight are lost and regenerated on resume
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
    # every shipped step trained once, none skipped, across the kill
    assert [entry["step"] for entry in log] == list(range(1, last + 1))
    assert last == 8
    assert len({entry["pid"] for entry in log}) == 1  # one trainer job saw both orchestrators
