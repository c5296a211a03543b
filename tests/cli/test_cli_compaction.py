"""A checkpoint compaction that keeps failing ends ``trio-rl simulate`` with one line naming
the file and what to do (not ``--fresh``: nothing is damaged); the run that follows, the
cause gone, resumes from the newest step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_cli_kill import _LAUNCH, _cmd

# The real command, in a process that first puts a directory where each compaction of this
# process writes its temporary file (named with the pid): every compaction fails for real.
_BLOCKED = (
    "import os, sys; d = sys.argv[sys.argv.index('--out') + 1] + '/checkpoints'; "
    "[os.makedirs(f'{d}/step_{s:08d}.ckpt.{os.getpid()}.compact') for s in range(64)]; "
) + _LAUNCH


def test_a_compaction_failing_at_every_write_ends_the_run_with_the_file_named(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cmd = [*_cmd(out, 8), "--set", "checkpoint.max_chain=1"]
    assert cmd[1:3] == ["-c", _LAUNCH]
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED, *cmd[3:]], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("trio-rl: error: checkpoint "), done.stderr
    assert str(out / "checkpoints" / "step_") in last, last
    assert "compacting this delta into a full file failed 3 times in a row" in last, last
    assert "Is a directory" in last, last
    assert "--fresh" not in last, last
    named = re.search(r"step_(\d+)\.ckpt: ", last)
    assert named is not None, last
    # the compaction of the named delta failed (in the background); the write that raised
    # it had written its own step first: the newest checkpoint, at or after the named one
    written = sorted((out / "checkpoints").glob("step_*.ckpt"))
    newest = int(written[-1].name[5:13])
    assert newest >= int(named.group(1)), written

    # nothing is lost: the next run (nothing in the way) resumes after the newest step
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resumed at step {newest + 1}:" in again.stdout, again.stdout
