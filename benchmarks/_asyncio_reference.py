"""The asyncio comparator: miles' own scheduler file, unmodified, or a labelled fallback.

:func:`load_scheduler` reads ``miles/rollout/submission_scheduler.py`` exactly as upstream has
it (kept beside the reference notes at ``../shared/reference/miles_submission_scheduler.py``
from the project root, or a path given on the command line) and imports it with a stub for
``miles.utils.types``; the stub's ``Sample`` is a dataclass with the fields of miles' own
``Sample`` (``miles/utils/types.py``), so the asyncio side allocates what the reference
allocates per sample. Only when that file is absent does the benchmark fall back to the
re-implementation below (``GroupLevelSubmission`` / ``SampleBackfillSubmission`` in this module),
and it says so in its output.

:func:`generate_and_rm_group` and :func:`fully_async_worker` drive a scheduler the way miles'
``generate_and_rm_group`` and ``FullyAsyncRolloutFn._worker_loop`` do (one task per sample, the
credit callback registered as a done-callback before ``gather``'s own, submit while
``has_capacity``, ``wait_for_progress``, reap).

asyncio is allowed here only because this is a benchmark comparator; ``src/`` is trio only.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import enum
import importlib.util
import logging
import sys
import types
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("asyncio_reference")

#: Where the reference file lives relative to the project root (a sibling checkout).
DEFAULT_REFERENCE = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "reference"
    / "miles_submission_scheduler.py"
)


class MilesStatus(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclasses.dataclass
class MilesSample:
    """The fields of miles' ``Sample`` dataclass (``miles/utils/types.py``) with its defaults."""

    Status = MilesStatus

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    status: MilesStatus = MilesStatus.PENDING
    routing_key: str | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    remove_sample: bool = False
    generate_function_path: str | None = None


def load_scheduler(path: Path | None = None) -> tuple[types.ModuleType, str]:
    """The scheduler module and a label saying what it is.

    ``path`` (default :data:`DEFAULT_REFERENCE`) is imported unmodified, with
    ``miles.utils.types`` stubbed; when it does not exist, this module's re-implementation is
    returned, labelled as such.
    """
    path = DEFAULT_REFERENCE if path is None else path
    if not path.is_file():
        return sys.modules[__name__], f"RE-IMPLEMENTATION (reference file not found at {path})"
    for name in ("miles", "miles.utils", "miles.utils.types", "miles.rollout"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["miles.utils.types"].Sample = MilesSample  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location("miles.rollout.submission_scheduler", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, f"miles' own submission_scheduler.py, unmodified ({path})"


def miles_group(prompt: MilesSample, group_size: int, counter: Callable[[], int]) -> list[Any]:
    """A prompt group as miles' data source builds it: deep copies of one prompt sample with
    consecutive indices and a shared group index."""
    group_index = counter()
    group = []
    for _ in range(group_size):
        sample = copy.deepcopy(prompt)
        sample.group_index = group_index
        sample.index = counter()
        group.append(sample)
    return group


class GroupLevelSubmission:
    """(Fallback re-implementation) Group granularity: admit while fewer than ``group_budget`` groups are pending."""

    sample_done_callback = None

    def has_capacity(self, *, pending_groups: int, group_budget: int) -> bool:
        return pending_groups < group_budget

    def on_submit(self, groups: list[Any]) -> None:
        pass

    async def wait_for_progress(
        self, pendings: set[asyncio.Task[Any]]
    ) -> tuple[set[Any], set[Any]]:
        return await asyncio.wait(pendings, return_when=asyncio.FIRST_COMPLETED)


class SampleBackfillSubmission:
    """(Fallback re-implementation) Sample backfill: a credit counter of samples in flight against ``B x G``."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.samples_in_flight = 0
        self._wakeup = asyncio.Event()

    def sample_done_callback(self) -> None:
        self.samples_in_flight -= 1
        self._wakeup.set()

    def has_capacity(self, *, pending_groups: int, group_budget: int) -> bool:
        if pending_groups == 0 and self.samples_in_flight != 0:
            logger.warning(
                "samples_in_flight=%d with no pending groups; resetting to 0",
                self.samples_in_flight,
            )
            self.samples_in_flight = 0
        if self.samples_in_flight + self.group_size <= group_budget * self.group_size:
            return True
        # A False answer arms the wakeup: only completions after this decision wake the wait.
        self._wakeup.clear()
        return False

    def on_submit(self, groups: list[Any]) -> None:
        self.samples_in_flight += sum(len(g) for g in groups)

    async def wait_for_progress(
        self, pendings: set[asyncio.Task[Any]]
    ) -> tuple[set[Any], set[Any]]:
        helper = asyncio.ensure_future(self._wakeup.wait())
        try:
            done, pending = await asyncio.wait(
                pendings | {helper}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            helper.cancel()
        done.discard(helper)
        pending.discard(helper)
        return done, pending


async def generate_and_rm_group(
    group: list[Any],
    generate: Callable[[Any], Awaitable[Any]],
    sample_done_callback: Callable[[], None] | None,
) -> list[Any]:
    """One task per sample; the zero-argument credit callback is registered on each as a
    done-callback ignoring the task (as miles does), before gather's own."""
    tasks = [asyncio.create_task(generate(sample)) for sample in group]
    if sample_done_callback is not None:
        callback = sample_done_callback
        for task in tasks:
            task.add_done_callback(lambda _task: callback())
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        # Cancel and settle siblings before the group ends (the #1673 fix).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def fully_async_worker(
    scheduler: Any,
    make_group: Callable[[], list[Any]],
    generate: Callable[[Any], Awaitable[Any]],
    *,
    group_budget: int,
    target_samples: int,
    on_target: Callable[[int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> int:
    """Keep ``group_budget`` groups' worth of work in flight until ``target_samples`` finished
    samples were produced; returns the number of finished samples. Finished groups go into an
    output buffer that a consumer drains at once (the trainer never lags here). ``on_target``
    is called with that number once the target is reached, before the tasks still in flight
    are cancelled; ``on_progress`` with the running count after each wake-up."""
    pendings: set[asyncio.Task[Any]] = set()
    output: deque[list[Any]] = deque()
    finished = 0
    try:
        while finished < target_samples:
            while scheduler.has_capacity(pending_groups=len(pendings), group_budget=group_budget):
                group = make_group()
                scheduler.on_submit([group])
                pendings.add(
                    asyncio.create_task(
                        generate_and_rm_group(group, generate, scheduler.sample_done_callback)
                    )
                )
            done, pendings = await scheduler.wait_for_progress(pendings)
            for task in done:
                output.append(task.result())
            while output:
                finished += len(output.popleft())
            if on_progress is not None:
                on_progress(finished)
        if on_target is not None:
            on_target(finished)
    finally:
        for task in pendings:
            task.cancel()
        await asyncio.gather(*pendings, return_exceptions=True)
    return finished
