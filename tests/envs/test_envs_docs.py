"""The calculator example in docs/environments.md runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).parents[2] / "docs" / "environments.md"


def test_the_calculator_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    example = next(b for b in blocks if "calculator = ToolEnv" in b)
    script = tmp_path / "calculator.py"
    script.write_text(example, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["1.0 done 2", "1 84"]
