"""Run every benchmark in turn, each printing its figures side by side with its reference.

    python benchmarks/run_all.py [--quick | --full] [name ...]     # e.g. scheduler publish
    nox -s bench -- [--quick | --full] [name ...]

Three profiles (the options each script gets are printed before it runs):

* default (~20 min on 2 cores): every benchmark goal with >= 3 repetitions, median and
  spread: scheduler part A (virtual time), part B at 1k / 10k / 100k in flight x 3, 3N
  finished per run (GC on and off, memory per in-flight sample, growth 1k -> 100k), part C (real time, 3 runs per latency
  scale, scales 1.25x apart, loop lag at the reference's highest >= 0.95 rate); publication x 3
  with the asyncio reference design; encoding x 3; transport x 3; checkpoint 1k, 10k and 100k
  queued x 3 (4.3 GB per save at 100k: needs ~4.5 GB free under the temp dir); incremental
  checkpoints (base + 20 deltas + a background compaction) at 10k and 100k queued;
  multi-turn episodes: CPU per turn at 1k and 10k episodes in flight x 3 against single-turn
  samples of the same tokens, memory per episode at 1k, 5k and 10k; reward workers: the
  per-call cost x 3, then 3 pairs of 160-step ``trio-rl run`` (a reward hanging on 2 of 32
  records against a control, at the same time).
* ``--full`` (~30 min more): as default, plus part B at 1M in flight x 3 (every size with 2N
  finished per run), so the 1k -> 1M growth is printed from one process.
* ``--quick``: tiny sizes, one repetition: a smoke test that every script runs, not figures.

Lines starting ``goal N:`` are collected and printed again at the end, one block per run.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALL = [
    "scheduler",
    "publish",
    "encode",
    "transport",
    "checkpoint",
    "checkpoint_incremental",
    "episodes",
    "reward_workers",
]

PROFILES: dict[str, dict[str, list[str]]] = {
    "default": {
        "scheduler": ["--sizes", "1000,10000,100000", "--repeat", "3"],
        "publish": ["--repeat", "3"],
        "encode": ["--trials", "3"],
        "transport": ["--repeat", "3"],
        "checkpoint": ["--sizes", "1000,10000,100000", "--repeat", "3"],
        "checkpoint_incremental": ["--sizes", "10000,100000", "--steps", "20"],
        "episodes": ["--sizes", "1000,10000", "--memory", "1000,5000,10000", "--repeat", "3"],
        "reward_workers": ["--calls", "2000", "--repeat", "3"],
    },
    "full": {
        "scheduler": ["--sizes", "1000,10000,100000,1000000", "--repeat", "3", "--factor", "2"],
        "publish": ["--repeat", "3"],
        "encode": ["--trials", "3"],
        "transport": ["--repeat", "3"],
        "checkpoint": ["--sizes", "1000,10000,100000", "--repeat", "3"],
        "checkpoint_incremental": ["--sizes", "10000,100000", "--steps", "20"],
        "episodes": ["--sizes", "1000,10000", "--memory", "1000,5000,10000", "--repeat", "3"],
        "reward_workers": ["--calls", "2000", "--repeat", "3"],
    },
    "quick": {
        "scheduler": [
            "--scale", "0.02", "--sizes", "1000", "--minimum", "2000", "--repeat", "1",
            "--rt-seconds", "0.3", "--rt-scales", "1", "--rt-loads", "5",
        ],
        "publish": ["--samples", "32", "--tokens", "512", "--repeat", "1"],
        "encode": ["--trials", "1", "--list-mib", "1"],
        "transport": ["--size-mib", "4", "--messages", "4", "--repeat", "1"],
        "checkpoint": ["--sizes", "100", "--tokens", "256", "--repeat", "1"],
        "checkpoint_incremental": ["--sizes", "200", "--tokens", "256", "--steps", "3"],
        "episodes": ["--sizes", "100", "--memory", "100,200", "--delay", "0.01", "--repeat", "1"],
        "reward_workers": [
            "--calls", "64", "--callers", "4", "--repeat", "1", "--pace-steps", "12",
        ],
    },
}  # fmt: skip


def _machine() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"{platform.platform()}, load average {load}"
    )


def main(argv: list[str]) -> int:
    profile = "default"
    names = []
    for arg in argv:
        if arg in ("--quick", "--full"):
            profile = arg[2:]
        elif arg in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            names.append(arg)
    names = names or ALL
    unknown = sorted(set(names) - set(ALL))
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(ALL)}")
        return 2
    print(f"run_all ({profile}) started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(_machine(), flush=True)
    failed, goals, took = [], [], {}
    start = time.perf_counter()
    for name in names:
        options = PROFILES[profile][name]
        print(f"\n===== bench_{name}.py {' '.join(options)} =====", flush=True)
        t0 = time.perf_counter()
        with subprocess.Popen(
            [sys.executable, "-u", str(HERE / f"bench_{name}.py"), *options],
            stdout=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                if line.startswith("goal "):
                    goals.append(f"[{name}] {line.rstrip()}")
        took[name] = time.perf_counter() - t0
        print(f"----- bench_{name}.py: {took[name] / 60:.1f} min, exit {proc.returncode}")
        if proc.returncode:
            failed.append(name)
    print(f"\n===== summary ({profile}): the benchmark goals, from this run =====")
    for line in goals:
        print(line)
    print(
        "wall time: "
        + ", ".join(f"{n} {t / 60:.1f} min" for n, t in took.items())
        + f"; total {(time.perf_counter() - start) / 60:.1f} min"
    )
    print(f"finished {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {_machine()}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
