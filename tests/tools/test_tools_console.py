"""The live console display: plain lines off a terminal, a rich table on one."""

from __future__ import annotations

import io
import json
import re
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest
from tools_helpers import extra

from trio_rl.tools import JsonlSink, MissingExtraError
from trio_rl.tools.console import ConsoleDisplay, format_line

RECORD = {
    "step": 3,
    "reward_mean": 0.5161,
    "samples_per_s": 812.04,
    "slot_occupancy": 0.874,
    "loop_lag_p95_ms": 1.234,
    "queue_depth": 34,
    "off_policy_max": 1,
}
LINE = (
    "step 3 | reward 0.516 | samples/s 812.0 | slots 87% | lag p95 ms 1.2 | queue 34 | off-policy 1"
)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_off_a_terminal() -> None:
    out = io.StringIO()
    display = ConsoleDisplay(out)
    assert display.plain
    display.write(RECORD)
    display.write({"step": 4, "reward_mean": None})
    display.close()
    assert out.getvalue().splitlines() == [
        LINE,
        "step 4 | reward - | samples/s - | slots - | lag p95 ms - | queue - | off-policy -",
    ]
    assert format_line(RECORD) == LINE
    assert format_line({"step": 5.0, "queue_depth": 7.5}).split(" | ")[::5] == [
        "step 5",
        "queue 7.5",
    ]


def test_a_live_table_on_a_terminal() -> None:
    extra("rich")  # the `console` extra; CI's test group installs it
    out = _Tty()
    display = ConsoleDisplay(out)
    assert not display.plain
    display.write(RECORD)
    display.write({**RECORD, "step": 4, "reward_mean": 0.75})
    display.close()
    text = out.getvalue()
    assert "\x1b[" in text  # drawn with terminal control sequences, redrawn in place
    for title in ("step", "reward", "samples/s", "slots", "lag p95 ms", "queue", "off-policy"):
        assert title in text
    assert "0.516" in text
    assert "0.750" in text
    assert "87%" in text


def test_plain_is_forced_on_a_terminal_too() -> None:
    out = _Tty()
    display = ConsoleDisplay(out, plain=True)
    display.write(RECORD)
    display.close()
    assert out.getvalue() == LINE + "\n"


def test_the_table_without_rich_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "rich" else real(name, *a)
    )
    with pytest.raises(MissingExtraError, match=r"trio-rl\[console\]"):
        ConsoleDisplay(_Tty(), plain=False)
    assert ConsoleDisplay(_Tty()).plain  # undecided: falls back to plain lines


def _readline(stream: IO[str], timeout: float) -> str:
    # the next record comes after we append it, so nothing is left in the reader's buffer
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    return stream.readline()


def test_following_a_run_that_appends(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write(RECORD)
    cmd = [sys.executable, "-m", "trio_rl", "watch", str(tmp_path), "--follow"]
    with subprocess.Popen(
        [*cmd, "--interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            # stdout is a pipe, not a terminal: plain lines, one per record, as they arrive
            assert _readline(proc.stdout, 30).rstrip("\n") == LINE
            sink.write({**RECORD, "step": 4})
            assert _readline(proc.stdout, 30).startswith("step 4 | reward 0.516")
        finally:
            sink.close()
            proc.send_signal(signal.SIGINT)
            try:
                assert proc.wait(timeout=30) == 130
            finally:
                proc.kill()  # never leave Popen's exit waiting for a child that did not stop


def test_a_damaged_metrics_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps(RECORD) + "\n{oops\n")
    done = subprocess.run(
        [sys.executable, "-m", "trio_rl", "watch", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stdout == LINE + "\n" or done.stdout == ""
    (err,) = done.stderr.strip().splitlines()
    assert "metrics.jsonl: line 2 (byte offset" in err


def _counted(step: int, shipped: int, stale: int, pruned: int) -> dict[str, object]:
    """A record with the sink's cumulative counters, as `step_record` writes them."""
    return {
        **RECORD,
        "step": step,
        "stale": stale,
        "pruned": pruned,
        "counters/dispatched": 10_000,
        "counters/shipped": shipped,
        "counters/stale": stale,
        "counters/pruned": pruned,
        "counters/failed": 0,
    }


def test_stale_pruned_and_waste_are_per_step_not_cumulative() -> None:
    from trio_rl.tools.console import StepRates

    rates = StepRates()
    # pruned samples are not waste: the reward gave them no signal
    assert rates.update(_counted(1, 32, 0, 8)) == {"stale": 0, "pruned": 8, "waste": 0.0}
    # cumulative 40 stale: 40 more this step, against 32 shipped and 8 pruned
    assert rates.update(_counted(2, 64, 40, 16)) == pytest.approx(
        {"stale": 40, "pruned": 8, "waste": 0.5}
    )
    assert rates.update(_counted(3, 96, 40, 16)) == {"stale": 0, "pruned": 0, "waste": 0.0}
    assert rates.update({"step": 4}) == {}
    # the publisher's own figure for the step, when the record has it, is shown as it is
    got = rates.update({**_counted(5, 128, 48, 16), "waste": 0.125})
    assert got == {"stale": 8, "pruned": 0, "waste": 0.125}


def test_the_plain_line_shows_progress_rates_trainer_fields_and_eta() -> None:
    out = io.StringIO()
    logged: list[str] = []
    display = ConsoleDisplay(out, total=3, log=logged.append)
    display.write(_counted(7, 32, 0, 8))
    display.write({"step": 7, "trainer/loss": 0.25, "trainer/kl": 0.001, "trainer/entropy": 1.5})
    display.write(_counted(8, 64, 40, 16))
    display.close()
    lines = out.getvalue().splitlines()
    assert lines == logged  # the log gets exactly the lines the terminal shows
    first, trainer, second = lines
    assert first.startswith(LINE.replace("step 3", "step 7/9") + " | stale 0 | pruned 8 | waste 0%")
    assert re.search(r" \| ETA \d+s$", first), first
    assert trainer == "trainer step 7 | loss 0.2500 | kl 0.0010 | entropy 1.500"
    assert " | stale 40 | pruned 8 | waste 50% | " in second


def test_a_progress_bar_under_the_table_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    extra("rich")
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: every column title in full
    out = _Tty()
    logged: list[str] = []
    before = sys.stdout
    display = ConsoleDisplay(out, total=4, log=logged.append)
    display.write(_counted(1, 32, 0, 8))
    print("a line the program prints meanwhile")  # shown above the table, and logged
    display.write({"step": 1, "trainer/loss": 0.25})
    display.write(_counted(2, 64, 40, 16))
    display.close()
    assert sys.stdout is before
    text = out.getvalue()
    assert "a line the program prints meanwhile" in text
    assert "step 2/4" in text
    assert "ETA " in text
    assert "━" in text  # the bar
    for title in ("stale", "pruned", "waste", "loss"):
        assert title in text
    assert "50%" in text
    assert logged[0].startswith("step 1/4 | ")  # the log still gets plain lines
    assert logged[1] == "a line the program prints meanwhile"
    assert len(logged) == 4
