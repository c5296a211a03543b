"""eval.jsonl and the in-progress marker: an eval a kill cut short is named on resume, and
no record is ever written twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trio_rl.errors import EvalError
from trio_rl.evals import (
    EVAL_LOG,
    EVAL_PENDING_FILE,
    EvalConfig,
    EvalJournal,
    EvalResult,
    PendingEval,
)


def _result(step: int) -> EvalResult:
    return EvalResult(step=step, policy_version=step, k=4, prompts=2, samples=8, pass_at_1=0.5)


def test_a_finished_eval_is_one_record_and_no_marker(tmp_path: Path) -> None:
    journal = EvalJournal(tmp_path)
    journal.begin(PendingEval(2, 2, 4))
    assert journal.pending() == PendingEval(2, 2, 4)
    assert journal.finish(_result(2))
    assert not (tmp_path / EVAL_PENDING_FILE).exists()
    assert journal.interrupted() is None
    # the same step again (a resumed run redoing what it already wrote) is not appended
    assert not journal.finish(_result(2))
    lines = (tmp_path / EVAL_LOG).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2]
    assert journal.results() == [_result(2)]


def test_a_kill_mid_eval_leaves_the_marker_and_resume_redoes_or_drops(tmp_path: Path) -> None:
    journal = EvalJournal(tmp_path)
    journal.finish(_result(0))
    journal.begin(PendingEval(2, 2, 4))
    # killed here: a new journal (the resumed run) sees the eval of step 2 unfinished
    resumed = EvalJournal(tmp_path)
    assert resumed.interrupted() == PendingEval(2, 2, 4)
    assert resumed.drop(PendingEval(2, 2, 4))
    records = [json.loads(line) for line in (tmp_path / EVAL_LOG).read_text().splitlines()]
    assert [(r["step"], r["status"], r["k"]) for r in records] == [
        (0, "done", 4),
        (2, "dropped", 4),
    ]
    assert records[1]["pass@1"] is None
    assert resumed.interrupted() is None


def test_a_kill_between_the_record_and_the_marker_removal_is_no_duplicate(tmp_path: Path) -> None:
    journal = EvalJournal(tmp_path)
    journal.begin(PendingEval(4, 4, 4))
    journal.finish(_result(4))
    journal.begin(PendingEval(4, 4, 4))  # as if the marker's removal was lost
    assert journal.interrupted() is None  # the record exists: nothing to redo
    assert not (tmp_path / EVAL_PENDING_FILE).exists()
    assert journal.steps() == {4}


def test_damaged_files_name_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / EVAL_LOG).write_text(json.dumps(_result(0).record()) + "\n{not json\n")
    with pytest.raises(EvalError, match=rf"{EVAL_LOG}:2: not valid JSON"):
        EvalJournal(tmp_path).results()
    (tmp_path / EVAL_LOG).write_text('{"step": 1}\n')
    with pytest.raises(EvalError, match=rf"{EVAL_LOG}:1: not an eval record"):
        EvalJournal(tmp_path).results()
    (tmp_path / EVAL_PENDING_FILE).write_text("[]")
    with pytest.raises(EvalError, match="damaged eval marker"):
        EvalJournal(tmp_path).pending()


def test_the_schedule_is_step_zero_then_every_interval() -> None:
    assert EvalConfig(interval=2).schedule(0, 6) == [0, 2, 4, 6]
    assert EvalConfig(interval=2, before_train=False).schedule(0, 6) == [2, 4, 6]
    assert EvalConfig(interval=0).schedule(0, 6) == [0]
    assert EvalConfig(interval=4).schedule(3, 9) == [4, 8]
