"""The package layout follows the data flow: lower layers never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "trio_rl"

# layer -> the layers of ours it may import (besides itself)
# `errors` is the ground floor: every layer may import it, and it imports nothing of ours at run
# time (under TYPE_CHECKING only: `samples` for GroupFailedError's annotation, `testing` for
# InvariantViolationError's).
ALLOWED: dict[str, set[str]] = {
    "errors": {"samples", "testing"},
    # by-handle payloads sit next to errors: everything above may import them
    "payloads": set(),
    "samples": {"payloads"},
    # the configuration schema is plain attrs classes of values: it knows no component
    "config": set(),
    "policy": {"samples"},
    "wire": {"payloads"},
    "engines": {"samples", "policy"},
    "rollout": {"payloads", "samples", "policy", "engines"},
    "train": {"payloads", "samples", "wire"},
    "transport": {"wire"},
    "publish": {"payloads", "samples", "wire", "train", "transport"},
    "trainer": {"payloads", "wire", "transport"},
    "testing": {"payloads", "samples", "policy", "engines", "rollout"},
    "orchestrator": {
        *("payloads", "samples", "policy", "wire", "engines", "rollout", "train", "publish"),
        "transport",
    },
    # the operations tools read what the pipeline writes (batches, checkpoints, metrics records)
    "tools": {"payloads", "samples", "wire", "train", "transport", "publish"},
    "learn": {
        # the run's plot is the figure of `trio-rl plot` (tools reads records, never learns)
        "tools",
        "config",
        "payloads",
        "policy",
        *("samples", "wire", "engines", "rollout", "train", "publish", "transport", "trainer"),
        "orchestrator",
    },
    "cli": {
        "payloads",
        "policy",
        *("samples", "wire", "engines", "rollout", "train", "publish", "transport", "trainer"),
        *("orchestrator", "learn", "config", "tools"),
    },
    "__main__": {"cli"},
}


def _layer_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imported_layers(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel_parts = path.relative_to(SRC).parts
    package_depth = len(rel_parts) - 1  # directories between trio_rl and the module
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "trio_rl" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "trio_rl":
                    if len(parts) > 1:
                        found.add(parts[1])
                    else:
                        found.update(a.name for a in node.names)
            else:
                up = node.level - 1
                base = list(rel_parts[:package_depth])
                if up > len(base):
                    continue
                base = base[: len(base) - up]
                mod = [*base, *((node.module or "").split(".") if node.module else [])]
                if mod:
                    found.add(mod[0])
                else:
                    found.update(a.name for a in node.names)
    return found


MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_module_imports_only_lower_layers(path: Path) -> None:
    layer = _layer_of(path)
    assert layer in ALLOWED, f"{path}: layer {layer!r} is not in the layering table"
    imported = _imported_layers(path) - {layer, "errors"}
    illegal = imported - ALLOWED[layer]
    assert not illegal, f"{path.relative_to(SRC)} ({layer}) imports higher layers {sorted(illegal)}"


def test_no_asyncio_in_the_library() -> None:
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "asyncio" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "asyncio")
            for n in ast.walk(ast.parse(p.read_text()))
        )
    ]
    assert offenders == []
