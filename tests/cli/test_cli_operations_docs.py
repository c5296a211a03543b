"""docs/operations.md's configuration reference is generated from the config classes: a key,
default or meaning changed in code without regenerating the page fails here."""

from __future__ import annotations

import shutil
from pathlib import Path

from trio_rl.config import LearnRunConfig, SimulateConfig, flatten, update_reference

PAGE = Path(__file__).parents[2] / "docs" / "operations.md"


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
