"""Configuration files for ``trio-rl run`` and ``trio-rl simulate``.

One TOML file whose sections mirror the components (``[run]``, ``[engine]``, ``[rollout]``,
``[sink]``, ``[publish]``, ``[transport]``, ``[trainer]``, ``[checkpoint]``, ``[metrics]``);
later files, then flags, then ``--set section.key=value`` override earlier values. Loading
validates every value and names the key and the file and line (or the flag) of a bad one. The
effective configuration is stored in the run directory (``config.toml``); a resumed run whose
configuration differs in a key not allowed to change is refused (`check_resume`).

Hand-written on attrs rather than cattrs or pydantic-settings: the library's configs are attrs
classes already, the options are scalars, and the error must name the file *and line* of a
value, which neither tool knows (tomllib drops positions); this is some 300 lines and no new
runtime dependency.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from ._errors import ConfigChangedError, ConfigError
from ._load import Override, flatten, key_line, load, may_change, reference_markdown, to_toml
from ._schema import LearnRunConfig, SimulateConfig

__all__ = [
    "STORED_FILE",
    "ConfigChangedError",
    "ConfigError",
    "LearnRunConfig",
    "Override",
    "SimulateConfig",
    "check_resume",
    "flatten",
    "key_line",
    "load",
    "reference_markdown",
    "store",
    "to_toml",
]

T = TypeVar("T")

#: The effective configuration of a run, in its run directory.
STORED_FILE = "config.toml"


def store(config: Any, out: Path) -> Path:
    """Write ``config`` to ``out/config.toml`` (atomically: a crash leaves the old one)."""
    path = out / STORED_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_toml(config))
    tmp.replace(path)
    return path


def check_resume(schema: type[T], config: T, out: Path, allow: Iterable[str] = ()) -> None:
    """Refuse to resume the run in ``out`` with ``config`` if its stored configuration differs
    in a key that may not change (see the reference) and is not in ``allow``.

    No stored configuration (a new run, or one from before configurations were stored): no
    check. A stored file that does not load is a `ConfigError` naming it."""
    path = out / STORED_FILE
    if not path.exists():
        return
    allowed = set(allow)
    stored, _ = load(schema, [path])
    old, new = flatten(stored), flatten(config)
    changes = [
        (key, old[key], new[key])
        for key in new
        if old[key] != new[key] and key not in allowed and not may_change(schema, key)
    ]
    if changes:
        raise ConfigChangedError(str(path), changes)
