"""``trio-rl run`` with an ``[inference]`` fleet: bad servers at the start are one line, exit 1,
and nothing is left running."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import write_tiny_llama

TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))
STAND_IN = str(Path(__file__).parents[1] / "engines" / "vllm_stand_in.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp: Path, urls: list[str]) -> Path:
    write_tiny_llama(tmp / "model")
    config = tmp / "run.toml"
    listed = ", ".join(f'"{u}"' for u in urls)
    config.write_text(
        textwrap.dedent(
            f"""\
            [run]
            out = "{tmp / "run"}"
            steps = 2

            [model]
            path = "{tmp / "model"}"

            [rollout]
            task = "repeat"
            batch_groups = 2
            group_size = 4

            [inference]
            urls = [{listed}]
            start_timeout = 3.0

            [metrics]
            plot = false
            display = "plain"
            """
        )
    )
    return config


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in done.stderr.strip().splitlines() if x.startswith("trio-rl: error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_an_unreachable_server_at_the_start_is_one_line_exit_1(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    config = _config(tmp_path, [url])
    done = subprocess.run(
        [TRIO_RL, "run", str(config)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stderr
    line = _one_line(done)
    assert f"{url}/health did not answer 200 within 3.0s" in line


def test_servers_that_disagree_on_the_model_are_one_line_exit_1(tmp_path: Path) -> None:
    ports = [_free_port(), _free_port()]
    servers = [
        subprocess.Popen(
            [sys.executable, STAND_IN, "--port", str(port), "--served-model-name", name],
            stdout=subprocess.DEVNULL,
        )
        for port, name in zip(ports, ["tiny", "another"], strict=True)
    ]
    try:
        time.sleep(0.5)
        config = _config(tmp_path, [f"http://127.0.0.1:{p}" for p in ports])
        done = subprocess.run(
            [TRIO_RL, "run", str(config)], capture_output=True, text=True, timeout=300
        )
    finally:
        for server in servers:
            server.kill()
            server.wait()
    assert done.returncode == 1, done.stderr
    line = _one_line(done)
    assert "inference servers disagree on the model" in line
    assert "['another']" in line
