"""docs/api.md documents every name a facade exports.

Autodoc of a facade picks up classes and functions; a type alias or constant re-exported from
a private module has no doc comment there, so docs/api.md lists it with a ``py:data``
directive. This checks that none is missing (the docs build itself checks the rest).
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
FACADES = [
    *("trio_rl.samples", "trio_rl.payloads", "trio_rl.wire", "trio_rl.policy"),
    *("trio_rl.engines", "trio_rl.rollout", "trio_rl.sink", "trio_rl.publish"),
    *("trio_rl.transport", "trio_rl.trainer", "trio_rl.testing", "trio_rl.evals"),
]


def _sections() -> dict[str, str]:
    """Facade -> the text of its section of docs/api.md."""
    text = API.read_text()
    parts = re.split(r"(?m)^\.\. automodule:: (\S+)$", text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _data_exports(name: str) -> dict[str, object]:
    module = importlib.import_module(name)
    return {
        n: v
        for n, v in vars(module).items()
        if not n.startswith("_")
        and not isinstance(v, types.ModuleType)
        and not inspect.isclass(v)
        and not inspect.isroutine(v)
        and not isinstance(v, __future__._Feature)  # `from __future__ import annotations`
    }


@pytest.mark.parametrize("name", FACADES)
def test_every_alias_and_constant_a_facade_exports_is_in_the_api_page(name: str) -> None:
    sections = _sections()
    assert name in sections, f"docs/api.md has no automodule for {name}"
    # an object re-exported by a higher layer is documented once, where it is first listed
    earlier = {
        id(v)
        for f in FACADES[: FACADES.index(name)]
        for n, v in _data_exports(f).items()
        if f".. py:data:: {n}\n" in sections.get(f, "")
    }
    missing = [
        n
        for n, v in _data_exports(name).items()
        if f".. py:data:: {n}\n" not in sections[name] and id(v) not in earlier
    ]
    assert missing == [], f"docs/api.md, section {name}: no py:data entry for {missing}"
