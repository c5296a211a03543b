"""Records and record rewards: a run described by a JSONL file of records and a reward
function ``fn(record, completion) -> float``.

A *record* is one JSON object of the file: ``"prompt"`` (text) or ``"messages"`` (a chat) is
what the model is asked; every field, those included, is handed to the reward. The record
travels with its prompt as :attr:`~trio_rl.samples.Prompt.label`, so a checkpointed group keeps
it. :class:`RecordReward` turns such a function into the sample reward the group runner calls:
the completion decoded to text, a plain function run in a worker thread under the run's
capacity limiter, and a failure failing that one sample (counted), never the run.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import math
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from ..samples import Sample, SampleStatus
from ._errors import DataSourceError, RolloutConfigError

__all__ = ["RecordReward", "RecordRewardFn", "import_reward", "read_records"]

logger = logging.getLogger("trio_rl.rollout.reward")

#: ``fn(record, completion) -> float``, plain or async.
RecordRewardFn = Callable[[Mapping[str, Any], str], float | Awaitable[float]]


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSONL file, one JSON object per line (blank lines skipped); each has
    ``"prompt"`` (a string) or ``"messages"`` (a list of ``{"role", "content"}`` objects).

    Blocking: call it before the run or in a worker thread. Raises :class:`DataSourceError`
    naming the file and the 1-based line of the first bad one."""
    where = Path(path)
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataSourceError(f"{where}: cannot read: {exc}") from exc
    records: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        at = f"{where}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataSourceError(f"{at}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(record, dict):
            raise DataSourceError(f"{at}: expected a JSON object, got {type(record).__name__}")
        prompt, messages = record.get("prompt"), record.get("messages")
        if prompt is None and messages is None:
            raise DataSourceError(f'{at}: a record needs "prompt" (text) or "messages" (a chat)')
        if prompt is not None and not isinstance(prompt, str):
            raise DataSourceError(f'{at}: "prompt" must be a string, got {prompt!r:.60}')
        if messages is not None and not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
        ):
            raise DataSourceError(
                f'{at}: "messages" must be a non-empty list of {{"role", "content"}} objects'
            )
        records.append(record)
    if not records:
        raise DataSourceError(f"{where}: no records (one JSON object per line expected)")
    return records


def import_reward(spec: str) -> RecordRewardFn:
    """The function ``"package.module:name"`` names, imported from the working directory or
    ``sys.path``. Raises :class:`RolloutConfigError` naming it when it cannot be imported or is
    not callable."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise RolloutConfigError(f'reward {spec!r}: expected "package.module:name"')
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while importing
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise RolloutConfigError(
            f"reward {spec!r}: cannot import module {module_name!r}: {detail}"
        ) from exc
    finally:
        if added:
            sys.path.remove(cwd)
    fn = module
    for part in name.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise RolloutConfigError(
                f"reward {spec!r}: module {module_name!r} has no {name!r}"
            ) from None
    if not callable(fn):
        raise RolloutConfigError(f"reward {spec!r}: {name!r} is not callable")
    return fn


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


@attrs.define(eq=False)
class RecordReward:
    """The sample reward of a record reward ``fn``: ``fn(sample.label, decode(completion))``.

    A plain ``fn`` runs in a worker thread under ``limiter`` (the run's one capacity limiter);
    an async one on the loop. ``timeout`` bounds one call. A call that raises, returns a value
    that is not a finite number, or times out *fails its sample* (status ``FAILED``: the sink
    counts it, its group trains on the rest); :attr:`failed` counts them and the first few are
    logged with their error. Cancellation of the run propagates.
    """

    fn: RecordRewardFn
    decode: Callable[[Sequence[int]], str]
    limiter: trio.CapacityLimiter | None = None
    timeout: float | None = 60.0
    name: str = "reward"
    #: Samples failed by the reward so far.
    failed: int = 0
    #: The first few failures' messages, then only counted.
    log_first: int = 3
    _async: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._async = _is_async(self.fn)

    def _call(self, record: Mapping[str, Any], tokens: Sequence[int]) -> Any:
        return self.fn(record, self.decode(tokens))

    async def __call__(self, sample: Sample) -> float:
        record = sample.label if isinstance(sample.label, Mapping) else {}
        tokens = list(sample.completion_tokens)
        try:
            with (
                trio.fail_after(self.timeout)
                if self.timeout is not None
                else contextlib.nullcontext()
            ):
                if self._async:
                    value = await self.fn(record, self.decode(tokens))  # type: ignore[misc]
                else:
                    value = await trio.to_thread.run_sync(
                        self._call, record, tokens, limiter=self.limiter, abandon_on_cancel=True
                    )
            reward = float(value)
            if not math.isfinite(reward):
                raise ValueError(f"returned {value!r}, not a finite number")
        except Exception as exc:
            self.failed += 1
            if self.failed <= self.log_first:
                detail = " ".join(str(exc).split()) or "(no message)"
                logger.warning(
                    "%s failed sample %d (%s: %s); the sample is failed, the run goes on%s",
                    self.name,
                    sample.index,
                    type(exc).__name__,
                    detail,
                    "; further failures are only counted" if self.failed == self.log_first else "",
                )
            sample.status = SampleStatus.FAILED
            return 0.0
        return reward
