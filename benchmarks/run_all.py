"""Run every benchmark in turn with its default (CI-sized) arguments; each prints its figures.

python benchmarks/run_all.py [name ...]     # e.g. scheduler publish
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALL = ["scheduler", "publish", "encode", "transport", "checkpoint"]


def main(argv: list[str]) -> int:
    names = argv or ALL
    unknown = sorted(set(names) - set(ALL))
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(ALL)}")
        return 2
    failed = []
    for name in names:
        print(f"\n===== bench_{name}.py =====", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / f"bench_{name}.py")])
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
