"""The tests mirror the packages: a folder per package, one file-name convention.

The test folders are not packages (pytest and mypy see each test module by its bare name), so
every test file carries its folder's name, ``tests/<folder>/test_<folder>_<what>.py`` (or
``test_<folder>.py``): two folders can then never hold modules of the same name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SRC = ROOT / "src" / "trio_rl"

# folders that test something other than one module or package of src/trio_rl: the package as
# a whole, and the multi-process cluster run
_NOT_A_PACKAGE = {"package", "cluster"}


def _folders() -> list[Path]:
    return sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("*.py")))


def test_every_test_file_is_named_for_its_folder() -> None:
    wrong = [
        str(path.relative_to(TESTS))
        for folder in _folders()
        for path in folder.glob("test_*.py")
        if not (
            path.name == f"test_{folder.name}.py" or path.name.startswith(f"test_{folder.name}_")
        )
    ]
    assert wrong == []


def test_every_test_folder_is_named_for_a_package() -> None:
    for folder in _folders():
        if folder.name in _NOT_A_PACKAGE:
            continue
        name = folder.name
        assert (SRC / name).is_dir() or (SRC / f"{name}.py").is_file(), folder


def test_the_config_tests_live_with_the_config_package() -> None:
    assert not list((TESTS / "cli").glob("test_config*.py"))
    assert list((TESTS / "config").glob("test_config*.py"))


def test_no_test_or_benchmark_cites_an_issue_or_a_session() -> None:
    # a comment says why; which issue or session asked for the code is the history's business
    cite = re.compile(r"\b[Ii]ssue\s+\d+|\bthe issue\b|\bsession \d+|\bsession's\b")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for folder in (TESTS, ROOT / "benchmarks")
        for path in sorted(folder.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if cite.search(line)
    ]
    assert found == []
