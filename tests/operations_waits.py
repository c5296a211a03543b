"""docs/operations.md's "Waits and retries" table, as the tests of its rows read it: each row's
test checks that what the program logs is what the row quotes (``documented``)."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

PAGE = Path(__file__).parents[1] / "docs" / "operations.md"
COLUMNS = ("where", "waits for / retries", "budget", "what it logs", "test")


@attrs.frozen
class Row:
    where: str
    waits_for: str
    budget: str
    logs: str
    tests: str

    @property
    def quoted(self) -> list[str]:
        """The lines the row quotes in its "what it logs" cell (in backticks)."""
        return re.findall(r"`([^`]+)`", self.logs)

    @property
    def test_files(self) -> list[str]:
        return re.findall(r"`([^`]+\.py)`", self.tests)


def waits_table(text: str | None = None) -> list[Row]:
    """The rows of the table, in the page's order."""
    text = PAGE.read_text() if text is None else text
    section = text.split("\n## Waits and retries\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert tuple(header) == COLUMNS, header
    rows = []
    for line in lines[2:]:  # the header and its rule
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        rows.append(Row(*cells))
    return rows


def row(where: str) -> Row:
    """The one row whose "where" cell starts with ``where``."""
    found = [r for r in waits_table() if r.where.startswith(where)]
    assert len(found) == 1, (where, [r.where for r in found])
    return found[0]


def pattern(quoted: str) -> re.Pattern[str]:
    """A quoted line as a pattern: ``...`` stands for anything, a number for any number (the
    page's figures are examples); a line the program logs starts with what the page quotes
    (which may leave its end out)."""
    parts = []
    for piece in re.split(r"(\.\.\.|\d+(?:\.\d+)*)", quoted):
        if piece == "...":
            parts.append(".*")
        elif re.fullmatch(r"\d+(?:\.\d+)*", piece):
            parts.append(r"\d+(?:\.\d+)*")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


def documented(where: str, line: str, index: int = 0) -> None:
    """Assert that ``line``, as logged, is the ``index``-th line the row ``where`` quotes."""
    quoted = row(where).quoted[index]
    assert pattern(quoted).match(line), f"the docs quote {quoted!r}, the program logs {line!r}"
