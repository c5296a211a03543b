"""The configuration's error: every one is a :class:`~trio_rl.errors.TrioRLError`."""

from __future__ import annotations

from ..errors import TrioRLError

__all__ = ["ConfigChangedError", "ConfigError"]


class ConfigError(TrioRLError, ValueError):
    """A configuration that cannot be used: a malformed TOML file, an unknown section or key, a
    value of the wrong type or out of range. ``where`` names the file and line (or the
    ``--set`` / flag it came from), ``key`` the dotted key (empty for a whole file)."""

    def __init__(self, where: str, key: str, message: str) -> None:
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")
        self.where = where
        self.key = key


class ConfigChangedError(ConfigError):
    """A resumed run's configuration differs from the one stored in its run directory in keys
    that were not allowed to change (``--allow-change``); ``changes`` lists them."""

    def __init__(self, where: str, changes: list[tuple[str, object, object]]) -> None:
        shown = ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, old, new in changes)
        keys = " ".join(f"--allow-change {k}" for k, _, _ in changes)
        super().__init__(
            where,
            "",
            f"the run's stored configuration differs: {shown}; resume with the stored values, "
            f"pass {keys} to accept, or use another --out",
        )
        self.changes = changes


def _show(value: object) -> str:
    return "unset" if value is None else repr(value)
