"""The learning figures of docs/learning.md: default runs over several seeds, one table, one plot.

``python benchmarks/learning_seeds.py --out runs/seeds`` runs ``trio-rl run --seed S --plain``
for seeds 0-4 one after the other (each into ``OUT/seedS``), then prints one row per run, read
from the run's own ``metrics.jsonl`` and ``logs/run.log``, and draws every reward curve into
``OUT/learning-seeds.png``. ``--summarise`` skips the runs and reads what is already there;
arguments after ``--`` go to every ``trio-rl run``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The learning goals, per run: how a row is judged.
FIRST_AT_MOST, BEST_AT_LEAST, FINAL_AT_LEAST, WASTE_AT_MOST = 0.1, 0.85, 0.8, 0.10


def _records(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if isinstance(r.get("reward_mean"), int | float)]


def _ending(run: Path, steps: int) -> str:
    log = run / "logs" / "run.log"
    text = log.read_text() if log.is_file() else ""
    found = re.findall(r"stopping: (\w+ at reward [0-9.]+)", text)
    return f"step {steps}, {found[-1]}" if found else f"all {steps} steps"


def _evals(run: Path) -> list[dict[str, Any]]:
    path = run / "eval.jsonl"
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line]
        if path.is_file()
        else []
    )
    return [r for r in rows if isinstance(r.get("pass@1"), int | float)]


def summarise(run: Path) -> dict[str, Any]:
    evals = _evals(run)
    records = _records(run)
    rewards = [float(r["reward_mean"]) for r in records]
    means = [statistics.fmean(rewards[i : i + 3]) for i in range(max(len(rewards) - 2, 0))]
    reach = next((i for i, m in enumerate(means) if m >= 0.6), None)
    last = records[-1]
    return {
        "run": run.name,
        "rewards": rewards,
        "first": rewards[0],
        "reach": None
        if reach is None
        else (records[reach + 2]["step"], records[reach + 2].get("wall_s")),
        "best": max(means, default=float("nan")),
        "final": rewards[-1],
        "ending": _ending(run, int(last["step"])),
        "waste": float(last.get("waste_total", float("nan"))),
        "wall": float(last.get("wall_s", float("nan"))),
        "evals": evals,
        "held_first": _held(evals[0]) if evals else None,
        "held_last": _held(evals[-1]) if evals else None,
    }


def _held(rec: dict[str, Any]) -> tuple[int, float, float]:
    """(step, avg@k, pass@1) of an eval record."""
    return int(rec["step"]), float(rec[f"avg@{rec['k']}"]), float(rec["pass@1"])


def _held_text(held: tuple[int, float, float] | None) -> str:
    return "-" if held is None else f"{held[1]:.3f} / {held[2]:.3f} (step {held[0]})"


def _passes(row: dict[str, Any]) -> bool:
    return bool(
        row["first"] <= FIRST_AT_MOST
        and row["best"] >= BEST_AT_LEAST
        and row["final"] >= FINAL_AT_LEAST
        and row["waste"] <= WASTE_AT_MOST
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | step 1 | 3-step mean >= 0.6 | best 3-step mean | final | held-out avg@k / "
        "pass@1, first | held-out, last | how it ended | waste | wall | goals |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        reach = "never" if r["reach"] is None else f"step {r['reach'][0]}, {r['reach'][1]:.0f} s"
        lines.append(
            f"| {r['run']} | {r['first']:.3f} | {reach} | {r['best']:.3f} | {r['final']:.3f} | "
            f"{_held_text(r['held_first'])} | {_held_text(r['held_last'])} | {r['ending']} | {100 * r['waste']:.2f} % | {r['wall']:.0f} s | "
            f"{'met' if _passes(r) else 'MISSED'} |"
        )

    def med(key: str) -> str:
        values = [float(r[key]) for r in rows]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    lines.append(
        f"| median (range) | {med('first')} | | {med('best')} | {med('final')} | | | | "
        f"{med('waste')} | {med('wall')} | {sum(map(_passes, rows))}/{len(rows)} met |"
    )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, held) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, r in enumerate(rows):
        color = f"C{i}"
        ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], label=r["run"], linewidth=1,
                color=color)  # fmt: skip
        if r["evals"]:
            steps = [e["step"] for e in r["evals"]]
            k = r["evals"][0]["k"]
            held.plot(steps, [e[f"avg@{k}"] for e in r["evals"]], color=color, marker="o",
                      markersize=3, linewidth=1, label=f"{r['run']} avg@{k}")  # fmt: skip
            held.plot(steps, [e["pass@1"] for e in r["evals"]], color=color, linestyle=":",
                      linewidth=1)  # fmt: skip
    ax.set(xlabel="step", ylabel="mean reward", ylim=(0, 1.02), title="training mean reward")
    held.set(xlabel="step (trained)", title="held-out prompts: avg@k (solid), pass@1 (dotted)")
    for a in (ax, held):
        a.axhline(BEST_AT_LEAST, color="grey", linestyle=":", linewidth=0.8)
    ax.legend(loc="lower right")
    fig.suptitle("trio-rl run, default config")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="parent of the run directories")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated (default 0-4)")
    parser.add_argument("--summarise", action="store_true", help="only read existing runs")
    parser.add_argument("rest", nargs="*", help="after --: more arguments to trio-rl run")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in [] if args.summarise else seeds:
        run = args.out / f"seed{seed}"
        started = time.monotonic()
        cmd = ["trio-rl", "run", "--out", str(run), "--seed", str(seed), "--plain", *args.rest]
        print("$", " ".join(cmd), f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        print(f"  {time.monotonic() - started:.0f} s", flush=True)
    rows = [summarise(args.out / f"seed{s}") for s in seeds]
    print(table(rows))
    plot(rows, args.out / "learning-seeds.png")
    print(f"plot: {args.out / 'learning-seeds.png'}")
    return 0 if all(map(_passes, rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
