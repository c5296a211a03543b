"""The package layout follows the data flow: lower layers never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "trio_rl"

# layer -> the layers of ours it may import (besides itself)
# `errors` is the ground floor: every layer may import it, and it imports nothing of ours, not
# even for annotations (the errors that carry a Group or an Invariant live on those floors).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    # the shared argument checks raise the errors' InvalidArgumentError: every layer above may
    # import them
    "_validation": set(),
    # the one atomic writer of files that must survive a crash: every layer above may import it
    "_durable": set(),
    # by-handle payloads sit next to errors: everything above may import them
    "payloads": set(),
    "samples": {"payloads"},
    # the configuration schema is attrs classes of values; its [rollout], [sink] and
    # [checkpoint] sections are generated from those layers' own configs (one declaration per
    # knob), as is [trainer] from the trainer's, and [transport] kind names a registered
    # transport, so it sees those layers; its engine sections are generated from the registered
    # engines' configs, [eval] from the evals' config, [env] from the environments', and
    # [reward] the workers' modes and size
    "config": {
        *("rollout", "sink", "trainer", "transport", "rundir", "engines", "evals", "envs"),
        "workers",
    },
    "policy": {"samples"},
    "wire": {"payloads"},
    "engines": {"samples", "policy"},
    # user code in killable workers of its own: it knows nothing above the errors
    "workers": set(),
    "rollout": {"payloads", "samples", "policy", "engines", "workers"},
    # multi-turn episodes: an environment drives the engine turn by turn; its runner is the
    # rollout layer's generate function
    "envs": {"payloads", "samples", "policy", "engines", "rollout"},
    "sink": {"payloads", "samples", "wire"},
    "transport": {"wire"},
    # the run directory's layout: it asks the checkpoint manager and the file transport
    "rundir": {"sink", "transport"},
    "publish": {"payloads", "samples", "wire", "sink", "transport"},
    "trainer": {"payloads", "wire", "transport"},
    # the harness also drives multi-turn episodes (an EpisodeRunner over its scripted engine)
    "testing": {"payloads", "samples", "policy", "engines", "rollout", "envs"},
    # evaluation: its runner generates through the engines and the rollout layer's group
    # nursery and priority lane; its journal keeps the run directory's eval files
    "evals": {"payloads", "samples", "policy", "engines", "rollout", "envs", "rundir"},
    "orchestrator": {
        *("payloads", "samples", "policy", "wire", "engines", "rollout", "sink", "publish"),
        "transport",
    },
    # the operations tools read what the pipeline writes (batches, checkpoints, metrics records)
    "tools": {"payloads", "samples", "wire", "sink", "transport", "publish", "rundir"},
    "learn": {
        "envs",
        # the run's plot is the figure of `trio-rl plot` (tools reads records, never learns)
        "tools",
        "config",
        "payloads",
        "policy",
        *("samples", "wire", "engines", "rollout", "sink", "publish", "transport", "trainer"),
        "orchestrator",
        "rundir",
        "evals",
    },
    # what the commands share: the signal watcher, the run log, the flags, failure reporting
    "_jobs": {"rundir"},
    "_failures": {"_jobs", "config", "sink"},
    "_flags": {"config", "engines", "transport"},
    # the learning run's commands: torch-free glue that imports `learn` once torch is checked
    "_learn_cmd": {"_flags", "_jobs", "config", "rundir", "learn", "rollout", "tools"},
    # `trio-rl simulate`, beside `learn`: its job and its trainer ranks
    "simulate": {
        *("_flags", "_jobs", "config", "rundir", "engines", "orchestrator", "publish"),
        *("rollout", "samples", "sink", "trainer", "transport", "wire", "tools"),
    },
    "cli": {
        *("_failures", "_flags", "_jobs", "_learn_cmd", "simulate"),
        "payloads",
        "policy",
        *("samples", "wire", "engines", "rollout", "sink", "publish", "transport", "trainer"),
        *("orchestrator", "learn", "config", "tools", "rundir"),
    },
    "__main__": {"cli"},
}


#: The ground floor: every layer may import these, and they import only the errors.
GROUND = ("errors", "_validation", "_durable")


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
    ground = {"errors", "_validation", "_durable"} if layer not in GROUND else {"errors"}
    imported = _imported_layers(path) - {layer} - (ground if layer != "errors" else set())
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, ``TYPE_CHECKING`` blocks included."""
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in paths:
                        edges.add(f"{target}.{alias.name}")
                    elif target in paths:
                        edges.add(target)
        graph[name] = edges - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_circle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_between_modules_type_checking_imports_included() -> None:
    assert _circles(_module_graph()) == []
