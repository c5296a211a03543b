"""docs/operations.md says what the program does: its configuration reference is generated from
the config classes (a key, default or meaning changed in code without regenerating the page
fails here); every row of its "Waits and retries" table names tests that exist, and each line
a row quotes is checked by one of them against what the program logged; the signal
acknowledgements it quotes are the ones printed."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

from operations_waits import pattern, row, waits_table
from trio_rl._jobs import Stop, _stopping
from trio_rl.config import LearnRunConfig, SimulateConfig, flatten, update_reference

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "operations.md"


def test_the_reference_in_the_docs_is_up_to_date(tmp_path: Path) -> None:
    copy = tmp_path / "operations.md"
    shutil.copy(PAGE, copy)
    assert not update_reference(copy), (
        'docs/operations.md is out of date: run python -c "from trio_rl.config import '
        "update_reference as u; from pathlib import Path; u(Path('docs/operations.md'))\""
    )


def test_the_reference_lists_every_key_with_its_default() -> None:
    text = PAGE.read_text()
    for schema in (LearnRunConfig, SimulateConfig):
        for key in flatten(schema()):
            section, name = key.split(".")
            assert f"`[{section}]`" in text
            assert f"| `{name}` |" in text, key


def test_a_drifted_page_is_detected_and_regenerated(tmp_path: Path) -> None:
    copy = tmp_path / "operations.md"
    text = PAGE.read_text()
    stale = text.replace("| `group_size` | int | `16` |", "| `group_size` | int | `15` |")
    assert stale != text
    copy.write_text(stale)
    assert update_reference(copy)
    assert copy.read_text() == text


def test_every_wait_and_retry_loop_names_tests_that_exist() -> None:
    rows = waits_table()
    assert len(rows) >= 20
    for r in rows:
        assert r.budget, r.where
        assert r.test_files, f"{r.where}: no test named"
        for name in r.test_files:
            assert (ROOT / name).is_file(), f"{r.where}: {name} does not exist"


def test_every_line_the_waits_table_quotes_is_checked_against_what_a_test_saw() -> None:
    # A row that quotes what the program logs has, among the tests it names, one that checks
    # a line the program logged against the quote (`operations_waits.documented`): a changed
    # log line fails that test, a changed quote too.
    checked: set[str] = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for where in re.findall(r"documented\(\s*\"([^\"]+)\"", path.read_text()):
            quoted_row = row(where)
            assert str(path.relative_to(ROOT)) in quoted_row.test_files, (
                f"{path.relative_to(ROOT)} checks the row {quoted_row.where!r}, which does "
                "not name it"
            )
            checked.add(quoted_row.where)
    for r in waits_table():
        if r.quoted:
            assert r.where in checked, f"no test checks what {r.where!r} quotes"


def test_a_quoted_line_stands_for_the_lines_it_describes() -> None:
    quoted = pattern("waiting for http://127.0.0.1:9/health (connection refused, 1 attempt), ...")
    assert quoted.match(
        "waiting for http://127.0.0.1:4711/health (connection refused, 1 attempt), giving up in 6 s"
    )
    assert not quoted.match("waiting for http://127.0.0.1:9/health (HTTP 503, 1 attempt)")
    assert not pattern("a is up after 12 s").match("a is up after s")


def test_the_signal_acknowledgements_are_the_lines_the_page_quotes() -> None:
    text = " ".join(PAGE.read_text().split())  # quotes may be wrapped in the page's source
    stop = Stop(signals=[signal.SIGINT])
    assert f"trio-rl: SIGINT: {_stopping(stop)}" in text
    stop.started.set()
    assert f"trio-rl: SIGINT: {_stopping(stop)}" in text
