"""`EvalJournal`: ``eval.jsonl`` and the marker of an eval in progress, in a run directory.

An eval writes its marker (``eval.pending``: its step and policy version) before it starts and
appends its record to ``eval.jsonl`` when it ends, then removes the marker. A run killed in
between leaves the marker and no record; on resume the journal names that eval
(:meth:`EvalJournal.interrupted`) and the run redoes it or records it as dropped. A record is
appended only if its step has none yet, so a kill between the append and the marker's removal
never duplicates a record either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs

from ..errors import EvalError
from ..rundir import RunDirectory
from ._result import EvalResult

__all__ = ["EvalJournal", "PendingEval"]


@attrs.frozen
class PendingEval:
    """An eval that started and has no record yet: its step, the version it pinned, its k."""

    step: int
    policy_version: int | None
    k: int = 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@attrs.define(slots=True, eq=False)
class EvalJournal:
    """The eval files of the run directory ``directory`` (blocking: call it in a worker
    thread from the event loop)."""

    directory: Path = attrs.field(converter=Path)

    @property
    def path(self) -> Path:
        return RunDirectory(self.directory).eval_log

    @property
    def pending_path(self) -> Path:
        return RunDirectory(self.directory).eval_pending

    def results(self) -> list[EvalResult]:
        """Every record of ``eval.jsonl`` (none: an empty list), in file order. A damaged line
        raises :class:`~trio_rl.errors.EvalError` naming the file and line."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        out: list[EvalResult] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{self.path}:{number}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalError(f"{where}: not valid JSON: {exc.msg}") from None
            if not isinstance(rec, dict):
                raise EvalError(f"{where}: not a JSON object")
            out.append(EvalResult.from_record(rec, where))
        return out

    def steps(self) -> set[int]:
        """The steps that have a record."""
        return {r.step for r in self.results()}

    def begin(self, pending: PendingEval) -> None:
        """Mark the eval ``pending`` as in progress (written atomically)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.pending_path.with_name(self.pending_path.name + ".tmp")
        tmp.write_text(json.dumps(attrs.asdict(pending)))
        os.replace(tmp, self.pending_path)
        _fsync_dir(self.directory)

    def pending(self) -> PendingEval | None:
        """The marker's eval, or None."""
        try:
            raw = json.loads(self.pending_path.read_text(encoding="utf-8"))
            return PendingEval(int(raw["step"]), raw.get("policy_version"), int(raw.get("k", 1)))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise EvalError(f"{self.pending_path}: damaged eval marker: {exc!r}") from None

    def interrupted(self) -> PendingEval | None:
        """The eval a killed run left unfinished (marked, with no record), or None. A marker
        whose step has a record (the kill came just after the append) is removed."""
        pending = self.pending()
        if pending is not None and pending.step in self.steps():
            self.clear_pending()
            return None
        return pending

    def finish(self, result: EvalResult) -> bool:
        """Append ``result``'s record unless its step has one, then remove the marker; return
        whether it was appended."""
        written = result.step not in self.steps()
        if written:
            self.directory.mkdir(parents=True, exist_ok=True)
            line = json.dumps(result.record()) + "\n"
            # one write of one line, then fsync: a kill leaves the whole line or none of it
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        self.clear_pending()
        return written

    def drop(self, pending: PendingEval) -> bool:
        """Record the interrupted eval ``pending`` as dropped (status ``dropped``, no figures)."""
        return self.finish(
            EvalResult(
                step=pending.step,
                policy_version=pending.policy_version,
                k=pending.k,
                status="dropped",
            )
        )

    def clear_pending(self) -> None:
        try:
            self.pending_path.unlink()
        except FileNotFoundError:
            return
        _fsync_dir(self.directory)
