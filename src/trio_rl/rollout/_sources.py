"""Data sources: where prompts come from, where unused prompts go back to.

A :class:`DataSource` hands out :class:`~trio_rl.samples.Prompt` values one at a time,
takes prompts back (recycled prompts are served before fresh ones), and saves and restores its
cursor as a dict of plain msgpack-able values. Sources are synchronous and never block: drivers
call them between awaits.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .._validation import check_optional_int
from ..samples import Prompt
from ._errors import DataSourceError, RolloutConfigError, SourceExhaustedError

__all__ = [
    "DataSource",
    "InMemorySource",
    "JsonlSource",
    "prompt_from_dict",
    "prompt_to_dict",
]


@runtime_checkable
class DataSource(Protocol):
    """Hands out prompts; takes unused ones back; saves and restores its position."""

    def take(self) -> Prompt:
        """The next prompt: a recycled one if any is waiting, else a fresh one.

        Raises :class:`SourceExhaustedError` when there is none (a later :meth:`recycle` can make
        prompts available again).
        """
        ...

    def recycle(self, prompt: Prompt) -> None:
        """Give a prompt back; it is served again before any fresh prompt (FIFO)."""
        ...

    @property
    def exhausted(self) -> bool:
        """True when :meth:`take` would raise :class:`SourceExhaustedError`."""
        ...

    def state(self) -> dict[str, Any]:
        """The cursor (and recycled prompts) as plain msgpack-able values."""
        ...

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore a cursor saved by :meth:`state`; raises :class:`DataSourceError` if invalid."""
        ...


def prompt_to_dict(prompt: Prompt) -> dict[str, Any]:
    """A prompt as plain values (the JSONL schema; ``label`` and ``metadata`` must be plain)."""
    return {
        "key": prompt.key,
        "tokens": list(prompt.tokens),
        "label": prompt.label,
        "env_name": prompt.env_name,
        "metadata": dict(prompt.metadata),
    }


_FIELDS = {"key", "tokens", "label", "env_name", "metadata"}


def prompt_from_dict(data: Any, where: str = "prompt") -> Prompt:
    """Build a prompt from plain values, checking every field.

    Schema: ``{"key": str, "tokens": [int, ...], "label": any (optional), "env_name": str
    (optional, default "default"), "metadata": object (optional)}``. Unknown fields are errors.
    Raises :class:`DataSourceError` naming ``where`` and the field at fault.
    """
    if not isinstance(data, Mapping):
        raise DataSourceError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = set(data) - _FIELDS
    if unknown:
        raise DataSourceError(f"{where}: unknown field(s) {sorted(unknown)}")
    key = data.get("key")
    if not isinstance(key, str) or not key:
        raise DataSourceError(f"{where}: field 'key' must be a non-empty string, got {key!r}")
    tokens = data.get("tokens")
    if not isinstance(tokens, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise DataSourceError(
            f"{where}: field 'tokens' must be a list of non-negative integers, got {tokens!r:.80}"
        )
    env_name = data.get("env_name", "default")
    if not isinstance(env_name, str):
        raise DataSourceError(f"{where}: field 'env_name' must be a string, got {env_name!r}")
    metadata = data.get("metadata", {})
    if not isinstance(metadata, Mapping):
        raise DataSourceError(f"{where}: field 'metadata' must be an object, got {metadata!r}")
    return Prompt(
        key=key,
        tokens=tuple(tokens),
        label=data.get("label"),
        env_name=env_name,
        metadata=dict(metadata),
    )


class InMemorySource:
    """Prompts from a sequence, in order, for ``epochs`` passes (None: wrap forever).

    The cursor is ``(epoch, position)`` plus the recycled prompts; :meth:`state` saves all of
    it and the number of prompts, so restoring onto a different list is detected.
    """

    def __init__(self, prompts: Iterable[Prompt], *, epochs: int | None = 1) -> None:
        self._prompts: tuple[Prompt, ...] = tuple(prompts)
        check_optional_int(type(self).__name__, "epochs", epochs, minimum=1)
        if epochs is None and not self._prompts:
            raise RolloutConfigError(
                f"{type(self).__name__}: an endless source (epochs=None) needs at least one prompt"
            )
        self._epochs = epochs
        self._epoch = 0
        self._position = 0
        self._recycled: deque[Prompt] = deque()
        self.taken = 0

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def exhausted(self) -> bool:
        if self._recycled:
            return False
        return not self._prompts or (self._epochs is not None and self._epoch >= self._epochs)

    def take(self) -> Prompt:
        if self._recycled:
            self.taken += 1
            return self._recycled.popleft()
        if self.exhausted:
            raise SourceExhaustedError(
                f"data source exhausted after {self._epoch} epoch(s) of {len(self._prompts)} "
                "prompt(s)"
            )
        prompt = self._prompts[self._position]
        self._position += 1
        if self._position == len(self._prompts):
            self._position = 0
            self._epoch += 1
        self.taken += 1
        return prompt

    def recycle(self, prompt: Prompt) -> None:
        self._recycled.append(prompt)

    @property
    def recycled(self) -> int:
        """Prompts waiting to be served again."""
        return len(self._recycled)

    def state(self) -> dict[str, Any]:
        return {
            "num_prompts": len(self._prompts),
            "epoch": self._epoch,
            "position": self._position,
            "recycled": [prompt_to_dict(p) for p in self._recycled],
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        num = _int_field(state, "num_prompts", "source state")
        if num != len(self._prompts):
            raise DataSourceError(
                f"source state: saved for {num} prompts, this source has {len(self._prompts)}"
            )
        epoch = _int_field(state, "epoch", "source state")
        position = _int_field(state, "position", "source state")
        if position >= max(1, num):
            raise DataSourceError(f"source state: position {position} out of range 0..{num - 1}")
        recycled_raw = state.get("recycled", [])
        if not isinstance(recycled_raw, Sequence):
            raise DataSourceError("source state: field 'recycled' must be a list")
        recycled = [
            prompt_from_dict(p, f"source state: recycled[{i}]") for i, p in enumerate(recycled_raw)
        ]
        self._epoch, self._position = epoch, position
        self._recycled = deque(recycled)


def _int_field(state: Mapping[str, Any], name: str, where: str) -> int:
    value = state.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DataSourceError(
            f"{where}: field {name!r} must be a non-negative integer, got {value!r}"
        )
    return value


class JsonlSource(InMemorySource):
    """Prompts from a JSONL file: one JSON object per line.

    Schema of a line: ``{"key": str, "tokens": [int, ...], "label": any (optional),
    "env_name": str (optional, default "default"), "metadata": object (optional)}``; unknown
    fields are errors. Example line: ``{"key": "gsm8k-17", "tokens": [1, 2, 3], "label": "42",
    "env_name": "math"}``. Blank lines are skipped. The file is read and validated when the
    source is built (a blocking read: construct it before the run or in
    ``trio.to_thread.run_sync``); a malformed line raises :class:`DataSourceError` naming the
    file and the 1-based line number.
    Duplicate keys are errors too, since resume matches groups on the key.
    """

    def __init__(self, path: str | PathLike[str], *, epochs: int | None = 1) -> None:
        self.path = Path(path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataSourceError(f"{self.path}: cannot read: {exc}") from exc
        prompts: list[Prompt] = []
        seen: dict[str, int] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{self.path}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataSourceError(
                    f"{where}: invalid JSON: {exc.msg} (column {exc.colno})"
                ) from exc
            prompt = prompt_from_dict(data, where)
            if prompt.key in seen:
                raise DataSourceError(
                    f"{where}: duplicate key {prompt.key!r} (first on line {seen[prompt.key]})"
                )
            seen[prompt.key] = number
            prompts.append(prompt)
        super().__init__(prompts, epochs=epochs)
