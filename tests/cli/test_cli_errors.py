"""The CLI's failure modes: one line on stderr, the right exit status, nothing destroyed."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

_LAUNCH = (
    "import importlib.util as u, sys; f = u.find_spec; "
    "u.find_spec = lambda n, *a: None if n == 'torch' else f(n, *a); "
    "from trio_rl.cli import main; sys.exit(main())"
)
_SMALL = ["--batch-groups", "2", "--group-size", "4"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _LAUNCH, "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (["--steps", "-1"], 2),
        (["--group-size", "0"], 2),
        (["--tokens-per-second", "nan"], 2),
        (["--ranks", "x"], 2),
    ],
)
def test_bad_knobs_are_one_line_without_traceback(
    args: list[str], status: int, tmp_path: Path
) -> None:
    done = _run("--out", str(tmp_path), *args)
    assert done.returncode == status
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[0].startswith("trio-rl")
    assert args[0] in lines[0]


def test_all_unusable_checkpoints_exit_1_untouched_then_fresh_moves_them_aside(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    assert _run("--out", str(out), "--steps", "3", *_SMALL).returncode == 0
    ckpts = out / "checkpoints"
    damaged = {}
    for path in ckpts.glob("step_*.ckpt"):
        data = path.read_bytes()
        damaged[path.name] = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
        path.write_bytes(damaged[path.name])
    assert len(damaged) == 3

    done = _run("--out", str(out), "--steps", "2", *_SMALL)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert str(ckpts) in lines[0]
    assert "--fresh" in lines[0]
    assert "Traceback" not in done.stderr
    assert {p.name: p.read_bytes() for p in ckpts.glob("step_*.ckpt")} == damaged

    fresh = _run("--out", str(out), "--steps", "2", "--fresh", *_SMALL)
    assert fresh.returncode == 0, fresh.stderr
    assert "steps 1..2" in fresh.stdout
    (aside,) = out.glob("checkpoints.old-*")
    assert {p.name: p.read_bytes() for p in aside.glob("step_*.ckpt")} == damaged
    assert sorted(p.name for p in ckpts.glob("step_*.ckpt")) == [
        "step_00000001.ckpt",
        "step_00000002.ckpt",
    ]


def test_a_run_never_deletes_checkpoints_it_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert _run("--out", str(out), "--steps", "3", *_SMALL).returncode == 0
    first = {p.name: p.read_bytes() for p in (out / "checkpoints").glob("step_*.ckpt")}
    # keep is 3: the resumed run writes steps 4..7 and prunes only its own files
    done = _run("--out", str(out), "--steps", "4", *_SMALL)
    assert done.returncode == 0, done.stderr
    now = {p.name: p.read_bytes() for p in (out / "checkpoints").glob("step_*.ckpt")}
    assert {k: now.get(k) for k in first} == first
    # the newest 3 of its own, and (incremental checkpoints) the full one they replay from
    written = sorted(k for k in now if k not in first)
    assert written[-3:] == ["step_00000005.ckpt", "step_00000006.ckpt", "step_00000007.ckpt"]
    assert set(written[:-3]) <= {"step_00000004.ckpt"}


def _trio_rl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _LAUNCH, *args], capture_output=True, text=True, timeout=120
    )


def test_a_port_in_use_is_one_line_exit_1_and_v_adds_the_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--out", str(tmp_path / "run"), "--transport", "zmq", "--port", str(port)]
        done = _run(*args, "--steps", "1", *_SMALL)
        verbose = _run(*args, "--steps", "1", *_SMALL, "-v")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr
    assert "Address already in use" in done.stderr
    assert "pick another port (--port, or 0 for a free pair)" in done.stderr
    assert "Traceback" not in done.stderr
    assert verbose.returncode == 1
    assert "Traceback" in verbose.stderr
    assert verbose.stderr.strip().splitlines()[-1] == done.stderr.strip()


def test_inspect_and_plot_are_subcommands_and_a_damaged_checkpoint_is_one_line(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    assert _run("--out", str(out), "--steps", "2", *_SMALL).returncode == 0
    (ckpt, *_) = sorted((out / "checkpoints").glob("step_*.ckpt"))
    good = _trio_rl("inspect", str(ckpt))
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip()
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[:40] + bytes([data[40] ^ 0xFF]) + data[41:])
    bad = _trio_rl("inspect", str(ckpt))
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("trio-rl: error: ")
    assert str(ckpt) in bad.stderr
    assert "Traceback" not in bad.stderr
    assert "plot" in _trio_rl("--help").stdout


def test_an_unreachable_engine_ends_in_one_error_line_exit_1(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = closed.getsockname()[1]
        done = _run(
            "--out", str(tmp_path / "run"), "--steps", "1", *_SMALL,
            "--set", "engine.kind=openai", "--set", f"engine.url=http://127.0.0.1:{port}",
            "--set", "engine.max_attempts=1",
        )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    empty = [line for line in lines if "no admitted train payload" in line]
    assert len(empty) <= 3, done.stderr  # the sink's zero-output warnings: the first 3 only
    # at most 3 failed groups and the "not shown" line, then the error
    assert len(lines) - len(empty) <= 5, done.stderr
    assert lines[-1].startswith("trio-rl: error: the engine failed every request, e.g. ")
    assert f"127.0.0.1:{port}" in lines[-1]
    assert lines[-1].endswith("; check the engine's URL and that the server is up")


def test_help_shows_what_an_unset_key_does() -> None:
    text = " ".join(_trio_rl("run", "--help").stdout.split())
    assert (
        "--out DIR shorthand for --set run.out=... (default unset: "
        "runs/<YYYYmmdd-HHMMSS> under the current directory)" in text
    )
    assert "run.max_steps=... (default unset: no limit)" in text
