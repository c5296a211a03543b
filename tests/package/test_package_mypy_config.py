"""mypy checks the tests too, each test folder a base of its own (see pyproject.toml)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mypy() -> dict[str, list[str]]:
    config: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "mypy"
    ]
    return config


def test_the_tests_are_checked() -> None:
    assert "tests" in _mypy()["files"]


def test_every_test_folder_is_on_the_mypy_path() -> None:
    # a folder missing here makes its bare-name helper imports unresolvable to mypy
    folders = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")} - {"tests"}
    assert folders, "no test folders found"
    assert folders <= set(_mypy()["mypy_path"]), sorted(folders - set(_mypy()["mypy_path"]))
