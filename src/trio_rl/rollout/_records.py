"""Records and record rewards: a run described by a JSONL file of records and a reward
function ``fn(record, completion) -> float``.

A *record* is one JSON object of the file: ``"prompt"`` (text) or ``"messages"`` (a chat) is
what the model is asked; every field, those included, is handed to the reward. The record
travels with its prompt as :attr:`~trio_rl.samples.Prompt.label`, so a checkpointed group keeps
it. :class:`RecordReward` turns such a function into the sample reward the group runner calls:
the completion decoded to text, a plain function run in a killable worker process of its own
pool (:func:`open_record_reward`), and a failure failing that one sample (counted), never the
run, unless a whole failure budget of samples fails in a row.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from ..errors import RewardFailuresError, collapse_single
from ..samples import Sample, SampleStatus
from ..workers import (
    DEFAULT_WORKERS,
    WorkerCallError,
    WorkerDiedError,
    WorkerMode,
    WorkerPool,
    WorkerTimeoutError,
    open_worker_pool,
)
from ._errors import DataSourceError, RolloutConfigError
from ._group import reward_started

__all__ = [
    "RecordReward",
    "RecordRewardFn",
    "describe_record",
    "import_reward",
    "open_record_reward",
    "read_records",
]

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


def describe_record(record: Mapping[str, Any]) -> str:
    """How a record is named in the log: ``record id 'r3'`` (its ``"id"`` field), else its
    first characters as JSON."""
    if "id" in record:
        return f"record id {record['id']!r}"
    try:
        text = json.dumps(record, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        text = repr(record)
    return f"record {text[:60]}{'...' if len(text) > 60 else ''}"


@attrs.define(eq=False)
class RecordReward:
    """The sample reward of a record reward ``fn``: ``fn(sample.label, decode(completion))``.

    A plain ``fn`` runs in ``pool`` (:class:`~trio_rl.workers.WorkerPool`: killable worker
    processes, or threads under the pool's own limiter; the pool's timeout bounds a call),
    or without a pool in a worker thread under ``limiter``; an async one on the loop.
    ``timeout`` bounds a call that is not in a pool. A call that raises, returns a value that
    is not a finite number, or times out *fails its sample* (status ``FAILED``: the sink
    counts it, its group trains on the rest); :attr:`failed` counts them and the first few
    are logged with their error. After ``failure_budget`` failures in a row (None: no
    budget), :attr:`budget_spent` is set and :attr:`verdict` says why; the run opened by
    :func:`open_record_reward` then stops with :class:`~trio_rl.errors.RewardFailuresError`.
    Cancellation of the run propagates.
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
    pool: WorkerPool | None = None
    failure_budget: int | None = None
    #: Failures since the last success.
    failed_in_a_row: int = attrs.field(init=False, default=0)
    #: Set once ``failure_budget`` failures came in a row.
    budget_spent: trio.Event = attrs.field(init=False, factory=trio.Event)
    #: Why the budget was spent: one line naming the reward, the first failure of the streak
    #: (its exception and record) and the count.
    verdict: str = attrs.field(init=False, default="")
    _first_in_a_row: str = attrs.field(init=False, default="")
    _async: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._async = _is_async(self.fn)

    def slow_calls(self) -> int:
        """Calls running slow in the pool now (see :attr:`WorkerPool.slow`; 0 without a
        process pool): a call that hangs counts until its timeout."""
        return 0 if self.pool is None else self.pool.slow

    def _call(self, record: Mapping[str, Any], tokens: Sequence[int]) -> Any:
        return self.fn(record, self.decode(tokens))

    async def _value(self, record: Mapping[str, Any], tokens: list[int]) -> Any:
        if self.pool is not None and not self._async:
            # decoded here: a tokenizer need not be picklable, and the worker gets plain text
            text = self.decode(tokens)
            return await self.pool.run(
                record, text, label=describe_record(record), on_start=reward_started
            )
        with trio.fail_after(math.inf if self.timeout is None else self.timeout):
            if self._async:
                return await self.fn(record, self.decode(tokens))  # type: ignore[misc]
            return await trio.to_thread.run_sync(
                self._call, record, tokens, limiter=self.limiter, abandon_on_cancel=True
            )

    async def __call__(self, sample: Sample) -> float:
        record = sample.label if isinstance(sample.label, Mapping) else {}
        tokens = list(sample.completion_tokens)
        try:
            value = await self._value(record, tokens)
            reward = float(value)
            if not math.isfinite(reward):
                raise ValueError(f"returned {value!r}, not a finite number")
        except Exception as exc:
            self._count_failure(sample, record, exc)
            sample.status = SampleStatus.FAILED
            return 0.0
        self.failed_in_a_row = 0
        return reward

    def _count_failure(self, sample: Sample, record: Mapping[str, Any], exc: Exception) -> None:
        self.failed += 1
        self.failed_in_a_row += 1
        if isinstance(exc, WorkerCallError):
            what = exc.line + (f" ({exc.where})" if exc.where else "")
        elif isinstance(exc, WorkerTimeoutError):
            killed = self.pool is not None and self.pool.mode == "process"
            limit = self.pool.timeout if self.pool is not None else self.timeout
            what = f"took longer than {limit:g} s, {'killed' if killed else 'abandoned'}"
        elif isinstance(exc, WorkerDiedError):
            what = "its worker process died"
        elif isinstance(exc, trio.TooSlowError):
            what = f"took longer than {self.timeout:g} s"
        else:
            what = f"{type(exc).__name__}: {' '.join(str(exc).split()) or '(no message)'}"
        if self.failed_in_a_row == 1:
            self._first_in_a_row = f"{what} on {describe_record(record)}"
        if self.failed <= self.log_first:
            logger.warning(
                "%s failed sample %d on %s: %s; the sample is failed, the run goes on%s",
                self.name,
                sample.index,
                describe_record(record),
                what,
                "; further failures are only counted" if self.failed == self.log_first else "",
            )
        budget = self.failure_budget
        if budget is not None and self.failed_in_a_row >= budget and not self.budget_spent.is_set():
            self.verdict = (
                f"{self.name} failed on {self.failed_in_a_row} samples in a row (the failure "
                f"budget: {budget}); the first: {self._first_in_a_row}; nothing can train: "
                "fix the reward"
            )
            self.budget_spent.set()

    async def _stop_when_spent(self) -> None:
        await self.budget_spent.wait()
        raise RewardFailuresError(self.verdict)


@contextlib.asynccontextmanager
async def open_record_reward(
    fn: RecordRewardFn,
    decode: Callable[[Sequence[int]], str],
    *,
    mode: WorkerMode = "process",
    workers: int = DEFAULT_WORKERS,
    call_timeout: float | None = 60.0,
    failure_budget: int | None = None,
    name: str = "reward",
) -> AsyncIterator[RecordReward]:
    """A :class:`RecordReward` whose plain ``fn`` runs in a worker pool of its own (``mode``
    ``"process"``: killable worker processes; ``"thread"``: threads under the pool's own
    limiter, unsafe against a call that hangs), ``workers`` calls at a time, each bounded by
    ``call_timeout`` seconds. After ``failure_budget`` failures in a row the block fails with
    :class:`~trio_rl.errors.RewardFailuresError` (one line: the reward, the first failure's
    exception and record, the count). On exit every worker process is ended."""
    pool_cm: contextlib.AbstractAsyncContextManager[WorkerPool | None] = (
        contextlib.nullcontext(None)
        if _is_async(fn)
        else open_worker_pool(fn, mode=mode, size=workers, call_timeout=call_timeout, name=name)
    )
    async with pool_cm as pool:
        reward = RecordReward(
            fn, decode, timeout=call_timeout, name=name, pool=pool, failure_budget=failure_budget
        )
        with collapse_single():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reward._stop_when_spent)
                yield reward
                nursery.cancel_scope.cancel()
