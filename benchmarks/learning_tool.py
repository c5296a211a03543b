"""The multi-turn figures of docs/learning.md: the lookup tool task over seeds, and its control.

``python benchmarks/learning_tool.py --out runs/tool`` runs ``trio-rl run examples/tool.toml
--seed S`` for seeds 0-4 one after the other (each into ``OUT/seedS``), then the control (the
tool's reply blanked, ``env.function = trio_rl.learn.tasks:lookup_blind``, seed 0, into
``OUT/control``), prints one row per run from its ``metrics.jsonl`` and draws every reward
curve into ``OUT/learning-tool.png``. ``--summarise`` skips the runs and reads what is there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The goals: a run starts at most FIRST, reaches a 3-step mean of GOAL within LIMIT seconds;
#: the control never has a 3-step mean above CONTROL.
FIRST, GOAL, LIMIT, CONTROL = 0.1, 0.6, 600.0, 0.3
CONTROL_ENV = "trio_rl.learn.tasks:lookup_blind"
CONTROL_SECONDS = 240


def _records(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if isinstance(r.get("reward_mean"), int | float)]


def summarise(run: Path) -> dict[str, Any]:
    records = _records(run)
    rewards = [r["reward_mean"] for r in records]
    means = [sum(rewards[i - 3 : i]) / 3 for i in range(3, len(rewards) + 1)]
    reached = next((i for i, m in enumerate(means) if m >= GOAL), None)
    last = records[-1]
    return {
        "run": run.name,
        "first": rewards[0],
        "reached": None if reached is None else (reached + 3, records[reached + 2]["wall_s"]),
        "best3": max(means),
        "final": rewards[-1],
        "steps": len(records),
        "wall": last["wall_s"],
        "calls": last.get("episodes/tool_calls"),
        "episodes": last.get("episodes/ended"),
        "rewards": rewards,
    }


def _row(s: dict[str, Any]) -> str:
    reached = "-" if s["reached"] is None else f"step {s['reached'][0]}, {s['reached'][1]:.0f} s"
    calls = "" if not s["episodes"] else f"{s['calls'] / s['episodes']:.2f}"
    return (
        f"| {s['run']} | {s['first']:.3f} | {reached} | {s['best3']:.3f} | {s['final']:.3f} | "
        f"{s['steps']} | {s['wall']:.0f} s | {calls} |"
    )


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in summaries:
        control = s["run"] == "control"
        ax.plot(
            range(1, len(s["rewards"]) + 1),
            s["rewards"],
            label=f"{s['run']} (reply blanked)" if control else s["run"],
            color="black" if control else None,
            linewidth=1.6 if control else 1.0,
        )
    ax.axhline(GOAL, color="grey", linestyle=":", linewidth=0.8)
    ax.axhline(CONTROL, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("lookup tool task: seeds 0-4 and the control")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    parser.add_argument("--summarise", action="store_true")
    parser.add_argument("--no-control", action="store_true")
    args, extra = parser.parse_known_args()
    trio_rl = str(Path(sys.executable).with_name("trio-rl"))
    runs = [(f"seed{s}", ["--seed", str(s)]) for s in args.seeds]
    # the control never reaches the goal: it runs for CONTROL_SECONDS, about as long as a run
    # takes to reach it
    runs.append(
        (
            "control",
            ["--seed", "0", "--set", f"env.function={CONTROL_ENV}",
             "--set", f"run.time_limit={CONTROL_SECONDS}"],
        )
    )  # fmt: skip
    if args.no_control:
        runs = runs[:-1]
    if not args.summarise:
        for name, flags in runs:
            out = args.out / name
            command = [trio_rl, "run", "examples/tool.toml", "--out", str(out), "--plain", *flags]
            subprocess.run([*command, *extra], check=True)
    summaries = [summarise(args.out / name) for name, _ in runs if (args.out / name).is_dir()]
    print("| run | step 1 | 3-step mean >= 0.6 | best 3-step mean | final | steps | wall | calls |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(_row(s))
    plot(summaries, args.out / "learning-tool.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
