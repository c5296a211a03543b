"""docs/quickstart.md runs verbatim: every ``python`` block, extracted and run in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from trio_rl.tools.inspect_cmd import inspect_path

DOC = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _blocks() -> list[str]:
    return _BLOCK.findall(DOC.read_text())


def test_the_quickstart_has_a_complete_program_with_a_trainer() -> None:
    blocks = _blocks()
    assert blocks, "docs/quickstart.md has no python block"
    program = blocks[0]
    # a snippet that once skipped them: it must open an in-process engine and a trainer
    assert "TorchEngine.open" in program
    assert "BatchReceiver" in program
    assert "set_policy_version" in program
    assert "trio.run(main)" in program


def test_every_python_block_runs_verbatim(tmp_path: Path) -> None:
    for i, code in enumerate(_blocks()):
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # its run directory lands here
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, f"block {i} failed:\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr
        if "mean reward" in code:
            rewards = [float(x) for x in re.findall(r"mean reward (\d\.\d+)", done.stdout)]
            assert len(rewards) == 12, done.stdout
            # the policy learns: the last steps beat chance (1/8) clearly
            assert max(rewards[-4:]) > 0.3, rewards
            # and what it points to: trio-rl inspect on the run directory it left
            run_dir = Path(re.findall(r"run directory: (\S+)", done.stdout)[0])
            assert run_dir.parent == tmp_path
            summary = inspect_path(run_dir).data
            assert summary["checkpoints"]["newest"]["step"] == 12
            assert summary["checkpoints"]["newest"]["counters"]["shipped"] == 12 * 4 * 8
