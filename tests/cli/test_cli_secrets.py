"""``trio-rl run`` against servers that want an API key: the key and a secret header come from
the environment, reach every server call, and are written and printed nowhere (the run
directory, the logs, stdout, stderr, ``trio-rl config``); a wrong or missing key is one line,
exit 1, naming the variable and not the value."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import write_tiny_llama

TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))
STAND_IN = str(Path(__file__).parents[1] / "engines" / "vllm_stand_in.py")
KEY = "sk-planted-3c9e1f07a2d64b58b1e0"
TENANT = "tenant-planted-58d2a9c4e7"
KEY_ENV = "TRIO_RL_TEST_API_KEY"
TENANT_ENV = "TRIO_RL_TEST_TENANT"
SECRETS = (KEY, TENANT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def guarded_server() -> Iterator[str]:
    """A stand-in server process that wants ``KEY`` (``VLLM_API_KEY``, as vLLM reads it) and
    answers with token ids the tiny model knows."""
    port = _free_port()
    args = ["--port", str(port), "--served-model-name", "tiny", "--vocab", "15"]
    server = subprocess.Popen(
        [sys.executable, STAND_IN, *args],
        stdout=subprocess.PIPE,
        env={**os.environ, "VLLM_API_KEY": KEY},
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == b"ready\n"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


def _config(tmp: Path, inference: str) -> Path:
    write_tiny_llama(tmp / "model")
    config = tmp / "run.toml"
    body = f"""\
        [run]
        out = "{tmp / "run"}"
        steps = 2

        [model]
        path = "{tmp / "model"}"

        [rollout]
        task = "repeat"
        batch_groups = 2
        group_size = 4

        [metrics]
        plot = false
        display = "plain"

        [inference]
        api_key_env = "{KEY_ENV}"
        headers = {{ "X-Tenant" = "${{{TENANT_ENV}}}" }}
        start_timeout = 30.0
        """
    config.write_text(textwrap.dedent(body) + textwrap.dedent(inference))
    return config


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TRIO_RL, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


def _holding(root: Path, secrets: tuple[str, ...]) -> list[str]:
    """Every file under ``root`` (any bytes, binary included) that holds one of ``secrets``."""
    return [
        str(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets)
    ]


def _printed(done: subprocess.CompletedProcess[str], secrets: tuple[str, ...]) -> list[str]:
    return [s for s in secrets if s in done.stdout or s in done.stderr]


def _seen_by(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/stand_in/log", timeout=30) as answer:
        log: list[dict[str, Any]] = json.loads(answer.read())
    return log


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in done.stderr.strip().splitlines() if x.startswith("trio-rl: error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_planted_key_reaches_every_call_and_nothing_the_run_writes_or_prints(
    tmp_path: Path, guarded_server: str
) -> None:
    config = _config(tmp_path, f'urls = ["{guarded_server}"]\n')
    env = {KEY_ENV: KEY, TENANT_ENV: TENANT}
    shown = _run("config", str(config), env=env)
    assert shown.returncode == 0, shown.stderr
    assert f'api_key_env = "{KEY_ENV}"' in shown.stdout
    assert f"${{{TENANT_ENV}}}" in shown.stdout
    done = _run("run", str(config), env=env)
    assert done.returncode == 0, done.stderr
    seen = _seen_by(guarded_server)
    paths = {entry["path"] for entry in seen}
    assert {"/health", "/v1/models", "/v1/completions", "/collective_rpc"} <= paths
    assert all(e["headers"].get("authorization") == f"Bearer {KEY}" for e in seen), seen[:3]
    assert all(e["headers"].get("x-tenant") == TENANT for e in seen)
    run = tmp_path / "run"
    assert (run / "config.toml").read_text().count(KEY_ENV) == 1
    assert _holding(run, SECRETS) == []
    assert _printed(done, SECRETS) == []
    assert _printed(shown, SECRETS) == []


@pytest.mark.heavy
def test_a_wrong_or_missing_key_is_one_line_exit_1_naming_the_variable(
    tmp_path: Path, guarded_server: str
) -> None:
    config = _config(tmp_path, f'urls = ["{guarded_server}"]\n')
    wrong = "sk-wrong-0d51b7e2c94f"
    done = _run("run", str(config), env={KEY_ENV: wrong, TENANT_ENV: TENANT})
    assert done.returncode == 1, done.stderr
    line = _one_line(done)
    assert "HTTP 401" in line
    assert f"the environment variable {KEY_ENV}" in line
    assert _printed(done, (wrong, KEY, TENANT)) == []
    assert _holding(tmp_path / "run", (wrong, KEY, TENANT)) == []
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    missing = subprocess.run(
        [TRIO_RL, "run", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, TENANT_ENV: TENANT},
    )
    assert missing.returncode == 1, missing.stderr
    assert f"{KEY_ENV} (api_key_env) is not set" in _one_line(missing)


@pytest.mark.heavy
def test_launched_servers_get_the_key_from_the_environment_and_no_file_holds_it(
    tmp_path: Path,
) -> None:
    config = _config(
        tmp_path,
        f"""\
        launch = 1
        vllm = {json.dumps(f"{sys.executable} {STAND_IN}")}
        vllm_args = ["--vocab", "15"]
        served_name = "tiny"
        """,
    )
    done = _run("run", str(config), env={KEY_ENV: KEY, TENANT_ENV: TENANT})
    assert done.returncode == 0, done.stderr
    logs = list((tmp_path / "run").rglob("vllm-0.log"))
    assert logs, "the launched server's log is in the run directory"
    assert _holding(tmp_path / "run", SECRETS) == []
    assert _printed(done, SECRETS) == []
