"""No module in the library is over 600 lines and no function over 120: a module that large
holds more than one subject, a function that long more than one step."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "trio_rl"
MODULE_LIMIT = 600
FUNCTION_LIMIT = 120


def module_sizes() -> dict[str, int]:
    return {
        path.relative_to(SRC).as_posix(): len(path.read_text().splitlines())
        for path in sorted(SRC.rglob("*.py"))
    }


def function_sizes() -> dict[str, int]:
    """``module:qualified.name`` -> lines from its ``def`` to its last line."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    sizes[f"{module}:{name}"] = child.end_lineno - child.lineno + 1
                visit(child, module, f"{name}.")
            else:
                visit(child, module, prefix)

    for path in sorted(SRC.rglob("*.py")):
        visit(ast.parse(path.read_text(), filename=str(path)), path.relative_to(SRC).as_posix(), "")
    return sizes


def test_no_module_is_over_the_limit() -> None:
    over = {k: n for k, n in module_sizes().items() if n > MODULE_LIMIT}
    assert over == {}, f"modules over {MODULE_LIMIT} lines (move a part out): {over}"


def test_no_function_is_over_the_limit() -> None:
    over = {k: n for k, n in function_sizes().items() if n > FUNCTION_LIMIT}
    assert over == {}, f"functions over {FUNCTION_LIMIT} lines (split into steps): {over}"


def test_the_counts_see_a_long_function() -> None:
    """The walk finds nested functions and methods: a check that sees nothing passes anything."""
    sizes = function_sizes()
    assert sizes["learn/run.py:run_learning"] > 20
    assert any(k.startswith("learn/run.py:_Start.") for k in sizes)
    assert module_sizes()["errors/__init__.py"] > 100
