"""docs/metrics.md stays in step with the code: every standard field, every sink, the example
console line."""

from __future__ import annotations

import re
from pathlib import Path

import trio_rl.tools as tools
from trio_rl.tools import FIELDS, TRAINER_FIELDS
from trio_rl.tools.console import format_line
from trio_rl.tools.plot_cmd import PANELS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()


def test_the_field_table_is_the_code_s() -> None:
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", DOC, re.MULTILINE)
    assert dict(rows) == dict(FIELDS)


def test_the_trainer_field_table_is_the_code_s() -> None:
    rows = re.findall(r"^\| `(trainer/\w+)` \| (.+?) \|$", DOC, re.MULTILINE)
    assert dict(rows) == dict(TRAINER_FIELDS)


def test_every_sink_is_documented() -> None:
    for name in ("JsonlSink", "ConsoleDisplay", "TensorBoardSink", "WandbSink", "PrometheusSink"):
        assert hasattr(tools, name)
        assert f"`{name}(" in DOC, name


def test_the_plain_line_example_is_what_the_display_prints() -> None:
    example = DOC.split("```text\n", 1)[1].split("\n```", 1)[0]
    record = {
        "step": 3,
        "reward_mean": 0.516,
        "samples_per_s": 812.0,
        "slot_occupancy": 0.87,
        "loop_lag_p95_ms": 1.2,
        "queue_depth": 34,
        "off_policy_max": 1,
    }
    assert format_line(record) == example


def test_the_plot_panels_are_named() -> None:
    for panel in PANELS:
        assert f"**{panel}**" in DOC


def test_the_eval_field_table_is_the_code_s() -> None:
    from trio_rl.tools import EVAL_FIELDS

    rows = re.findall(r"^\| `(eval/[\w@^]+)` \| (.+?) \|$", DOC, re.MULTILINE)
    assert dict(rows) == dict(EVAL_FIELDS)
