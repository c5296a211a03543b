"""``trio-rl inspect PATH``: a readable summary of a batch file, a checkpoint or a run directory.

- a batch file (``batches/step_<S>/rank_<R>.bin``, the wire format): micro-batches, tokens,
  loss tokens, sequences, environments, optional fields carried, payload files referenced and
  whether they exist;
- a checkpoint (``checkpoints/step_<N>.ckpt``): the step, the policy version, the data-source
  cursor, the sink's counters, queued samples and open groups (samples, tokens, policy
  versions), payload files referenced and whether they exist; an outbox
  (``outbox_step_<N>.bin``): its ranks and their batches;
- a run directory (learning run: ``run.json``, ``metrics.jsonl``, ``weights/``, ``batches/``;
  simulated run: ``checkpoints/``, ``batches/``, ``trainer/``): each part summarised, every
  checkpoint and pending batch file verified; with a trainer job's ``trainer/trained.jsonl``,
  exactly-once: every shipped step trained once, with the samples shipped (a violation exits 1).

A damaged file raises the library's own error (:class:`~trio_rl.errors.WireFormatError` with the
byte offset and field, :class:`~trio_rl.errors.CheckpointError` with the file, field and byte
offset); for a run directory the summary is printed first, then the first damage is raised.
``--json`` prints the summary as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..errors import TrioRLError
from ..rundir import RunDirectory
from ..samples import Sample
from ..sink import CheckpointManager, TrainingSample, read_checkpoint
from ..sink._checkpoint_format import CHECKPOINT_MAGIC, CHECKPOINT_NAME, file_schema_version
from ..sink._outbox import OUTBOX_MAGIC, OUTBOX_NAME
from ..sink._sink_state import payload_files_of_state
from ..transport import CONSUMED_FILE, RANK_FILE, STEP_DIR, consumed_dir, end_marker_path
from ..wire import MicroBatch, decode
from ._errors import InspectError
from ._exactly_once import check_exactly_once
from ._main import tool_main
from .metrics import read_metrics

__all__ = ["Summary", "add_arguments", "inspect_path", "main", "render", "run"]

#: ``weights/step_<S>/``, as trio_rl.learn publishes them (read here without importing torch).
_WEIGHTS_DIR = re.compile(r"^step_(\d+)$")
_OPTIONAL = tuple(f.name for f in attrs.fields(MicroBatch) if f.default is not attrs.NOTHING)
_LAYOUT = RunDirectory(Path())
_RUN_PARTS = tuple(
    p.name
    for p in (
        _LAYOUT.run_file,
        _LAYOUT.metrics,
        _LAYOUT.checkpoints,
        _LAYOUT.batches,
        _LAYOUT.weights,
        _LAYOUT.trainer,
    )
)
_RUN_KEYS = ("task", "steps", "batch_groups", "group_size", "ranks", "trainer_mode", "seed")


@attrs.frozen
class Summary:
    """What inspect found: ``data`` (JSON-able, rendered as text) and ``damage``, the errors of
    damaged files inside a run directory (a single damaged file raises instead)."""

    data: dict[str, Any]
    damage: tuple[TrioRLError, ...] = ()


def _versions(values: Iterable[int]) -> str | None:
    vs = sorted(set(values))
    if not vs:
        return None
    return str(vs[0]) if len(vs) == 1 else f"{vs[0]}..{vs[-1]}"


def _payload_files(files: Iterable[str]) -> dict[str, Any]:
    referenced = sorted(set(files))
    missing = [f for f in referenced if not Path(f).exists()]
    return {"referenced": len(referenced), "missing": missing}


def summarize_micro_batches(micro_batches: Sequence[MicroBatch]) -> dict[str, Any]:
    """Counts over a decoded batch: micro-batches, tokens, sequences, payload files."""
    tokens = [mb.num_tokens for mb in micro_batches]
    sequences = sum(len(mb.sequence_lengths) for mb in micro_batches)
    loss_tokens = sum(sum(mb.loss_mask) for mb in micro_batches)
    envs = sorted({name for mb in micro_batches for name in mb.env_names})
    optional = [
        name for name in _OPTIONAL if any(getattr(mb, name) is not None for mb in micro_batches)
    ]
    files = (seg.file for mb in micro_batches for seg in mb.payload or ())
    return {
        "micro_batches": len(micro_batches),
        "tokens": sum(tokens),
        "tokens_per_micro_batch": tokens,
        "sequences": sequences,
        "loss_tokens": loss_tokens,
        "env_names": envs,
        "optional_fields": optional,
        "payload_files": _payload_files(files),
    }


def inspect_batch(path: Path) -> dict[str, Any]:
    """A batch file's summary; a damaged file raises :class:`~trio_rl.errors.WireFormatError`
    naming the file, the byte offset and the field."""
    data = _read(path)
    micro_batches = decode(data, source=str(path))
    out: dict[str, Any] = {"kind": "batch file", "file": str(path), "bytes": len(data)}
    step, rank = STEP_DIR.match(path.parent.name), RANK_FILE.match(path.name)
    if step and rank:
        out["step"], out["rank"] = int(step.group(1)), int(rank.group(1))
    out.update(summarize_micro_batches(micro_batches))
    return out


def _queued(samples: Sequence[TrainingSample]) -> dict[str, Any]:
    return {
        "samples": len(samples),
        "tokens": sum(s.num_tokens for s in samples),
        "groups": len({s.group_id for s in samples}),
        "policy_versions": _versions(s.policy_version for s in samples),
    }


def _arrived(group: Any) -> tuple[Sample, ...]:
    # an open group's finished members: ``arrived`` on OpenGroup, ``members`` on a record
    # from an older release
    found = getattr(group, "arrived", None)
    return tuple(getattr(group, "members", ()) if found is None else found)


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's summary; a damaged one raises :class:`~trio_rl.errors.CheckpointError`
    naming the file, the field and the byte offset."""
    ckpt = read_checkpoint(path)
    sink = ckpt.sink
    members = [m for og in sink.open_groups for m in _arrived(og)]
    return {
        "kind": "checkpoint",
        "file": str(path),
        "bytes": path.stat().st_size,
        "schema_version": file_schema_version(path),
        "step": ckpt.step,
        "next_step": sink.step,
        "progress": dict(ckpt.progress),
        "cursor": ckpt.cursor,
        "counters": attrs.asdict(sink.counters),
        "queued": _queued(sink.queued),
        "open_groups": {
            "groups": len(sink.open_groups),
            "members_arrived": len(members),
            "members_expected": sum(og.group_size for og in sink.open_groups),
            "started_at_versions": _versions(og.policy_version_at_start for og in sink.open_groups),
            "member_versions": _versions(v for m in members for v in m.policy_versions),
        },
        "payload_files": _payload_files(payload_files_of_state(sink)),
    }


def inspect_outbox(path: Path) -> dict[str, Any]:
    """An outbox file (a step's payloads whose delivery was not confirmed) and its batches."""
    m = OUTBOX_NAME.match(path.name)
    if m is None:
        raise InspectError(str(path), "an outbox file must be named outbox_step_<N>.bin")
    step = int(m.group(1))
    payloads = CheckpointManager(path.parent).read_outbox(step)
    if payloads is None:
        raise InspectError(str(path), "no such file or directory")
    ranks = {}
    for rank, data in enumerate(payloads):
        source = f"{path} rank {rank}"
        ranks[f"rank {rank}"] = {
            "bytes": len(data),
            **summarize_micro_batches(decode(data, source=source)),
        }
    return {"kind": "outbox", "file": str(path), "step": step, "ranks": ranks}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InspectError(str(path), f"cannot read: {exc.strerror or exc}") from exc


def _inspect_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise InspectError(str(path), f"cannot read: {exc.strerror or exc}") from exc
    if head == CHECKPOINT_MAGIC or CHECKPOINT_NAME.match(path.name):
        return inspect_checkpoint(path)
    if head == OUTBOX_MAGIC:
        return inspect_outbox(path)
    if path.suffix == ".jsonl":
        records = read_metrics(path)
        return {"kind": "metrics file", "file": str(path), **_metrics_summary(records)}
    return inspect_batch(path)


def _count(value: Any) -> int:
    # a field a record lacks, or holds as null, counts nothing
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _metrics_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"records": len(records)}
    if records:
        last = records[-1]
        out["steps"] = _versions(int(r["step"]) for r in records)
        out["samples"] = sum(_count(r.get("samples")) for r in records)
        out["tokens"] = sum(_count(r.get("tokens")) for r in records)
        out["last"] = {
            k: last[k]
            for k in ("step", "reward_mean", "samples_per_s", "policy_version", "wall_s")
            if k in last
        }
    return out


def _steps_in(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), Path(e.path))
        for e in os.scandir(directory)
        if (m := pattern.match(e.name))
    ]
    return sorted(found)


def _trainer_log(path: Path) -> dict[str, Any]:
    steps: list[int] = []
    torn = 0
    for line in _read(path).decode(errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            torn += 1  # a line torn by a crash: the step after the last whole line was not trained
    out: dict[str, Any] = {"steps": _versions(steps), "lines": len(steps)}
    if torn:
        out["unreadable_lines"] = torn
    return out


def _guarded(damage: list[TrioRLError], fn: Any, path: Path) -> dict[str, Any] | str:
    try:
        result: dict[str, Any] = fn(path)
        return result
    except TrioRLError as exc:
        damage.append(exc)
        return f"DAMAGED: {exc}"


def inspect_run_directory(path: Path) -> Summary:
    """A run directory's summary; every checkpoint and pending batch file is verified, and the
    errors of damaged ones are returned in :attr:`Summary.damage`."""
    present = [p for p in _RUN_PARTS if (path / p).exists()]
    if not present:
        # a checkpoint directory on its own is fine too
        if _steps_in(path, CHECKPOINT_NAME):
            return _checkpoint_dir(path, {"kind": "checkpoint directory", "path": str(path)})
        raise InspectError(
            str(path), f"not a run directory (none of {', '.join(_RUN_PARTS)} is there)"
        )
    damage: list[TrioRLError] = []
    out: dict[str, Any] = {"kind": "run directory", "path": str(path)}
    run = RunDirectory(path)
    run_file = run.run_file
    if run_file.is_file():
        try:
            config = json.loads(_read(run_file))
        except (InspectError, ValueError) as exc:
            damage.append(InspectError(str(run_file), f"not a JSON run description ({exc})"))
            out["run"] = "DAMAGED"
        else:
            out["run"] = {
                k: config[k] for k in _RUN_KEYS if isinstance(config, dict) and k in config
            }
    metrics = run.metrics
    records: list[dict[str, Any]] = []
    if metrics.is_file():
        try:
            records = read_metrics(metrics)
            out["metrics"] = _metrics_summary(records)
        except TrioRLError as exc:
            damage.append(exc)
            out["metrics"] = f"DAMAGED: {exc}"
    checked = check_exactly_once(path, records, damage)
    if checked is not None:
        out["exactly_once"] = checked
    if run.checkpoints.is_dir():
        sub = _checkpoint_dir(run.checkpoints, {})
        damage.extend(sub.damage)
        out["checkpoints"] = sub.data
    aside = sorted(p.name for p in path.glob(f"{run.checkpoints.name}.old-*"))
    if aside:
        out["set_aside"] = aside
    if run.batches.is_dir():
        out["batches"] = _batches(path, damage)
    weights = _steps_in(run.weights, _WEIGHTS_DIR)
    if run.weights.is_dir():
        out["weights"] = {
            "versions": [s for s, _ in weights],
            "latest": weights[-1][0] if weights else None,
        }
    logs = _steps_in(run.trainer, re.compile(r"^rank_(\d+)\.jsonl$"))
    if logs:
        out["trainer"] = {f"rank {r}": _guarded(damage, _trainer_log, p) for r, p in logs}
    return Summary(out, tuple(damage))


def _checkpoint_dir(directory: Path, out: dict[str, Any]) -> Summary:
    damage: list[TrioRLError] = []
    ckpts = _steps_in(directory, CHECKPOINT_NAME)
    out["files"] = len(ckpts)
    out["steps"] = [s for s, _ in ckpts]
    for _, p in ckpts[:-1]:
        verdict = _guarded(damage, inspect_checkpoint, p)
        if isinstance(verdict, str):
            out[p.name] = verdict
    if ckpts:
        out["newest"] = _guarded(damage, inspect_checkpoint, ckpts[-1][1])
    outboxes = _steps_in(directory, OUTBOX_NAME)
    if outboxes:
        out["outboxes"] = {p.name: _guarded(damage, inspect_outbox, p) for _, p in outboxes}
    return Summary(out, tuple(damage))


def _batches(run: Path, damage: list[TrioRLError]) -> dict[str, Any]:
    root = RunDirectory(run).batches
    out: dict[str, Any] = {}
    pending: dict[str, Any] = {}
    for step, step_dir in _steps_in(root, STEP_DIR):
        for rank, file in _steps_in(step_dir, RANK_FILE):
            verdict = _guarded(damage, inspect_batch, file)
            if isinstance(verdict, dict):
                verdict = {
                    k: verdict[k]
                    for k in ("bytes", "micro_batches", "tokens", "sequences", "payload_files")
                }
            pending[f"step {step} rank {rank}"] = verdict
    out["pending"] = pending or "none (every batch was read)"
    end = end_marker_path(run)
    if end.is_file():
        out["end_of_stream"] = _read(end).decode(errors="replace").strip()
    consumed = _steps_in(consumed_dir(run), CONSUMED_FILE)
    if consumed:
        out["consumed"] = {
            f"rank {r}": _read(p).decode(errors="replace").strip() for r, p in consumed
        }
    return out


def inspect_path(path: str | os.PathLike[str]) -> Summary:
    """Summarise ``path``: a batch file, a checkpoint, an outbox, a metrics file or a run
    directory. A damaged single file raises its error; a missing path raises
    :class:`InspectError`."""
    p = Path(path)
    if p.is_dir():
        return inspect_run_directory(p)
    if not p.exists():
        raise InspectError(str(p), "no such file or directory")
    return Summary(_inspect_file(p))


def _scalar(value: Any) -> str:
    if isinstance(value, list) and len(value) > 12:
        head = ", ".join(map(str, value[:12]))
        return f"[{head}, ... ({len(value)} in all)]"
    if isinstance(value, list | dict):
        return json.dumps(value, default=str)
    return "-" if value is None else str(value)


def render(data: Mapping[str, Any], indent: int = 0) -> list[str]:
    """The summary as indented ``key: value`` lines (nested sections indented)."""
    lines = []
    pad = "  " * indent
    for key, value in data.items():
        label = key.replace("_", " ")
        if isinstance(value, dict) and value and key not in ("progress", "cursor", "counters"):
            lines.append(f"{pad}{label}:")
            lines.extend(render(value, indent + 1))
        elif key == "missing" and isinstance(value, list):
            lines.append(f"{pad}missing: {len(value)}" + (f" {_scalar(value)}" if value else ""))
        else:
            lines.append(f"{pad}{label}: {_scalar(value)}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``inspect`` subcommand's arguments."""
    parser.add_argument(
        "path", type=Path, help="a batch file, a checkpoint, an outbox or a run directory"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the summary of ``args.path``; 0 if everything read, else the first damage (a
    :class:`~trio_rl.errors.TrioRLError`) is raised after the summary is printed."""
    summary = inspect_path(args.path)
    if args.json:
        print(json.dumps(summary.data, indent=1, default=str))
    else:
        print("\n".join(render(summary.data)))
    sys.stdout.flush()
    if summary.damage:
        raise summary.damage[0]
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trio_rl.tools.inspect_cmd``: errors are one line on stderr, status 1."""
    return tool_main("trio-rl inspect", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
