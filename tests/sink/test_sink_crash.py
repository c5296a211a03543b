"""Crash safety: a checkpoint writer killed with SIGKILL at random moments never costs more
than the checkpoint being written; the latest complete one loads and holds exactly what it
recorded.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sink_helpers import crash_sink_steps

from conftest import scaled
from trio_rl.sink import CheckpointManager, CheckpointSnapshot, encode_checkpoint

HERE = Path(__file__).parent

WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
from sink_helpers import crash_sink_steps
from trio_rl.sink import CheckpointManager
incremental = sys.argv[3] == "1"
# incremental: deltas, compacted in the background often (a kill lands in one too)
mgr = CheckpointManager(sys.argv[1], keep=3, incremental=incremental, compact_ratio=0.3)
print("ready", flush=True)
for step, snap in crash_sink_steps(10_000, mgr):
    mgr.write(snap)
    print("saved", step, flush=True)
"""


def expected_bytes(step: int) -> bytes:
    for s, snap in crash_sink_steps(step):  # type: ignore[attr-defined]
        if s == step:
            return encode_checkpoint(snap)
    raise AssertionError(step)


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_sigkilled_writer_never_loses_a_complete_checkpoint(
    tmp_path: Path, incremental: bool
) -> None:
    rng = random.Random(1234)
    for trial in range(scaled(5)):
        d = tmp_path / f"trial{trial}"
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(d), str(HERE), str(int(incremental))],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 1.0))
        finally:
            proc.send_signal(signal.SIGKILL)
            out = proc.stdout.read()
            proc.stdout.close()
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        reported = [int(line.split()[1]) for line in out.splitlines() if line.startswith("saved")]
        ck = CheckpointManager(d).read_latest()
        if not reported:
            if ck is None:
                continue
        else:
            assert ck is not None, f"trial {trial}: nothing loads after {reported[-1]} saves"
            assert ck.step >= reported[-1]
        assert ck is not None
        loaded = CheckpointSnapshot(
            step=ck.step, progress=ck.progress, cursor=ck.cursor, sink=ck.sink
        )
        assert encode_checkpoint(loaded) == expected_bytes(ck.step), (
            f"trial {trial}, step {ck.step}"
        )
        if not incremental:  # keep=3, plus one mid-rotation (incremental: and what they replay)
            assert len(CheckpointManager(d).list_checkpoints()) <= 4
        # the next save clears whatever the killed writer left behind
        mgr = CheckpointManager(d, keep=3)
        mgr.write(loaded)
        assert not [n for n in os.listdir(d) if n.endswith((".tmp", ".compact"))]
        assert mgr.read_latest() is not None
