"""The usage example in docs/rollout.md runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).parents[2] / "docs" / "rollout.md"


def test_rollout_doc_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert blocks, "docs/rollout.md has no python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[-1], encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("sync: [")
    assert "accepted=4" in lines[0]  # exactly T groups
    assert sum(line.startswith("async: ") for line in lines) == 3
    assert "stale_dropped=0" in lines[-1]
