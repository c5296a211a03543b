"""The configuration's errors, defined with every other in :mod:`trio_rl.errors`."""

from __future__ import annotations

from ..errors import ConfigChangedError, ConfigError

__all__ = ["ConfigChangedError", "ConfigError"]
