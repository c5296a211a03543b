"""Exactly-once, checked from what a run directory holds: every step the orchestrator shipped
(``metrics.jsonl``) was trained once by the trainer job (``trainer/trained.jsonl``, one line per
trained step, fsynced before the step's batch file is deleted), with as many samples as were
shipped; a shipped step not trained yet must still have its batch file (``batches/step_<S>/``).

Without ``trainer/trained.jsonl`` (the in-process trainer, or no step trained yet) there is
nothing to check.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import InspectError, TrioRLError
from ..rundir import RunDirectory
from ..transport import STEP_DIR

__all__ = ["check_exactly_once"]


def _ranges(steps: Sequence[int]) -> str:
    """``1..4, 7, 9..10``: sorted steps as runs."""
    out: list[str] = []
    ordered = sorted(set(steps))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}..{ordered[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"


def _trained(path: Path, damage: list[TrioRLError]) -> dict[int, list[tuple[int, int | None]]]:
    """Each trained step's lines: (line number, sequences)."""
    lines: dict[int, list[tuple[int, int | None]]] = defaultdict(list)
    text = path.read_bytes().decode(errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
            step = int(record["step"])
            sequences = record.get("sequences")
        except (ValueError, KeyError, TypeError):
            damage.append(
                InspectError(
                    f"{path}:{number}",
                    "not a trained-step line (a JSON object with a 'step'): the log is damaged",
                )
            )
            continue
        lines[step].append((number, sequences if isinstance(sequences, int) else None))
    return lines


def _shipped(records: Sequence[Mapping[str, Any]]) -> dict[int, int | None]:
    """Each shipped step's sample count (a resumed run's repeated step: its last record)."""
    shipped: dict[int, int | None] = {}
    for r in records:
        if "samples" in r or "wall_s" in r:
            samples = r.get("samples")
            shipped[int(r["step"])] = samples if isinstance(samples, int) else None
    return shipped


def check_exactly_once(
    root: Path, records: Sequence[Mapping[str, Any]], damage: list[TrioRLError]
) -> dict[str, Any] | None:
    """The exactly-once section of a run directory's summary (None without
    ``trainer/trained.jsonl``); every violation is appended to ``damage`` as an
    :class:`~trio_rl.errors.InspectError` naming the file, the step and the figures."""
    run = RunDirectory(root)
    log = run.trained_log
    if not log.is_file():
        return None
    found: list[TrioRLError] = []
    trained = _trained(log, found)
    shipped = _shipped(records)
    pending = {s for s, d in _steps(run.batches) if any(d.iterdir())}
    last_shipped = max(shipped, default=0)
    for step, lines in sorted(trained.items()):
        if len(lines) > 1:
            found.append(
                InspectError(
                    str(log),
                    f"step {step} was trained {len(lines)} times (lines "
                    f"{', '.join(str(n) for n, _ in lines)}): not exactly once",
                )
            )
        if step not in shipped:
            if step < last_shipped:
                found.append(
                    InspectError(
                        str(log),
                        f"step {step} was trained but {run.metrics.name} has no such step",
                    )
                )
            continue
        samples, sequences = shipped[step], lines[-1][1]
        if samples is not None and sequences is not None and samples != sequences:
            found.append(
                InspectError(
                    f"{log}:{lines[-1][0]}",
                    f"step {step} trained {sequences} samples, but {samples} were shipped",
                )
            )
    untrained = sorted(set(shipped) - set(trained))
    lost = [s for s in untrained if s not in pending]
    if lost:
        found.append(
            InspectError(
                str(log),
                f"step(s) {_ranges(lost)} were shipped but neither trained nor waiting in "
                f"{run.batches.name}/: lost",
            )
        )
    damage.extend(found)
    out: dict[str, Any] = {
        "verdict": (
            "every shipped step trained once, with the samples shipped"
            if not found
            else f"VIOLATED: {found[0]}"
        ),
        "shipped": _ranges(list(shipped)),
        "trained": _ranges(list(trained)),
    }
    waiting = [s for s in untrained if s in pending]
    if waiting:
        out["not_trained_yet"] = f"{_ranges(waiting)} (batch files waiting for the trainer)"
    return out


def _steps(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    return sorted(
        (int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name))
    )
