"""No class in the library is over ~250 lines: a class that large holds more than one job."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "trio_rl"
LIMIT = 250

# "module:Class" -> why it may stay over the limit; an entry needs a reason a reviewer would accept.
EXCEPTIONS: dict[str, str] = {}


def class_sizes() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                key = f"{path.relative_to(SRC).as_posix()}:{node.name}"
                sizes[key] = node.end_lineno - node.lineno + 1
    return sizes


def test_no_class_is_over_the_limit() -> None:
    over = {k: n for k, n in class_sizes().items() if n > LIMIT and k not in EXCEPTIONS}
    assert over == {}, f"classes over {LIMIT} lines (split them): {over}"


def test_every_exception_is_still_needed() -> None:
    sizes = class_sizes()
    stale = [k for k in EXCEPTIONS if sizes.get(k, 0) <= LIMIT]
    assert stale == [], f"no longer over {LIMIT} lines (or gone): remove from EXCEPTIONS: {stale}"
