"""A checkpoint that claims more than the run could have produced is refused from outside: the
real ``trio-rl simulate --out DIR`` executable, resuming from a checkpoint whose open group
claims 1,000,000 members, prints one ``CheckpointError`` line and exits 1, without starting a
sample for it (a resume that started them would never end: the subprocess deadline fails loudly).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import attrs
from test_cli_kill import _cmd

from trio_rl.samples import OpenGroup, Prompt
from trio_rl.sink import CheckpointSnapshot, read_checkpoint, write_checkpoint

_TRIO_RL = str(Path(sys.executable).with_name("trio-rl"))


def _state(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _claim_a_million(path: Path) -> str:
    """Rewrite ``path`` (well-formed, checksummed) with one open group of 1,000,000 members;
    return its id."""
    ck = read_checkpoint(path)
    groups = list(ck.sink.open_groups)
    if groups:
        groups[0] = attrs.evolve(groups[0], group_size=1_000_000)
    else:
        groups.append(OpenGroup("claims-a-million", Prompt("k", (1, 2)), 1_000_000))
    sink = attrs.evolve(ck.sink, open_groups=tuple(groups))
    write_checkpoint(path, CheckpointSnapshot(ck.step, ck.progress, ck.cursor, sink))
    assert read_checkpoint(path).sink.open_groups[0].group_size == 1_000_000  # it loads
    return groups[0].group_id


def test_a_checkpoint_claiming_a_million_members_is_one_line_and_exit_1(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = subprocess.run(_cmd(out, 2), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    latest = sorted((out / "checkpoints").glob("step_*.ckpt"))[-1]
    _claim_a_million(latest)
    before = _state(out)

    resume = [_TRIO_RL, *_cmd(out, 2)[3:]]  # the installed executable, same arguments
    assert resume[1] == "simulate"
    started = time.perf_counter()
    # A resume that starts the million sample tasks does not end: the deadline fails loudly.
    done = subprocess.run(resume, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stderr.count("\n") == 1, done.stderr
    line = done.stderr
    assert line.startswith("trio-rl: error: checkpoint "), line
    assert str(latest) in line, line  # the file
    assert "sink.open_groups[0].group_size: 1000000 in the checkpoint" in line, line  # field, value
    assert "4 configured" in line, line  # ... and the run's value
    assert "configuration change" in line, line
    assert "resumed at step" not in done.stdout, done.stdout  # nothing was restored or started
    assert _state(out) == before, "the refused resume changed the run directory"
    print(f"refused in {elapsed:.2f} s, interpreter start and imports included")
