"""Builders shared by the tests: one version of each (import as ``from builders import ...``).

- :func:`make_sample` and :func:`make_group`: *finished* samples and groups (rewards set,
  completions filled), as the train, publish and trainer layers receive them;
- :func:`pending_group`: a group fresh from a :class:`~trio_rl.rollout.GroupFactory`, every
  sample still PENDING, as the rollout layer runs it;
- :func:`scripted_engine`: the library's :class:`~trio_rl.testing.ScriptedEngine` scripted to
  end every call by itself after ``delay`` (virtual) seconds with a finish reason looked up by
  the request's seed;
- :class:`WatchedCell`: a policy-version cell that records every wait on it, so a test sees
  the ship gate hold without sleeping;
- :func:`make_sink` and :func:`one_per_sample_packer`: the publisher tests' sink (groups with
  2-token prompts: with 4 completion tokens a sample is 6 tokens) and a packer whose 8-token
  bins hold one such sample each;
- :class:`Releases`: an injected memory release that records each call and can be gated;
- :func:`micro_batch` and :func:`grid`: wire micro-batches whose values name their step, rank
  and index, one or a step's worth;
- :func:`write_open_groups_checkpoint`, :func:`open_one_prompt_orchestrator` and
  :func:`resume_watchdog`: a run resumed from a checkpoint of open groups over one prompt
  (:data:`RESUME_PROMPTS`), guarded by a watchdog thread, for the resume-deadline and the
  cross-layer cancellation tests;
- :func:`reward_worker_processes`: the reward worker processes a running ``trio-rl`` started
  (its children running ``trio_rl/workers/_child.py``).
"""

from __future__ import annotations

import _thread
import functools
import itertools
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from trio_rl.engines import FinishReason, GenerateRequest, SamplingParams, SimulatedEngine
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.policy import PolicyVersionCell
from trio_rl.publish import pack_samples, release_containers
from trio_rl.rollout import GroupFactory, InMemorySource
from trio_rl.samples import Group, OpenGroup, Prompt, Sample, SampleStatus, new_group_id
from trio_rl.sink import (
    CheckpointManager,
    CheckpointSnapshot,
    PruneMode,
    SinkConfig,
    SinkCounters,
    SinkState,
    SinkWindow,
    TrainingSample,
    TrainSink,
)
from trio_rl.testing import Fate, ScriptedEngine
from trio_rl.transport import MemorySender
from trio_rl.wire import MicroBatch, RoutedExperts

__all__ = [
    "PROMPT",
    "Releases",
    "WatchedCell",
    "grid",
    "make_group",
    "make_sample",
    "make_sink",
    "micro_batch",
    "one_per_sample_packer",
    "pending_group",
    "scripted_engine",
]

#: The prompt :func:`pending_group` makes groups from by default.
PROMPT = Prompt(key="q", tokens=(5, 6, 7), label="answer")

# One counter for sample and group indices: unique across every builder call of a test run.
_index = itertools.count()


def make_sample(
    group_index: int,
    reward: float,
    *,
    version: int = 0,
    prompt: Sequence[int] = (1, 2, 3),
    completion: int = 4,
    status: SampleStatus = SampleStatus.COMPLETED,
    env_name: str = "default",
    index: int | None = None,
) -> Sample:
    """A finished sample: ``completion`` trained tokens generated at policy ``version``.

    ``reward`` is kept only for a finished ``status`` (None otherwise, as the scorer leaves it).
    """
    return Sample(
        index=next(_index) if index is None else index,
        group_index=group_index,
        prompt_tokens=tuple(prompt),
        completion_tokens=[100 + i for i in range(completion)],
        logprobs=[-0.5 - i / 10 for i in range(completion)],
        loss_mask=[True] * completion,
        reward=reward if status.is_finished else None,
        status=status,
        policy_versions=[version],
        env_name=env_name,
    )


def make_group(
    rewards: Sequence[float] = (1.0, 0.0),
    *,
    group_id: str | None = None,
    version: int = 0,
    completion: int = 4,
    prompt_len: int = 3,
    env: str = "default",
    statuses: Sequence[SampleStatus] | None = None,
) -> Group:
    """A finished group: one sample per reward, ``completion`` trained tokens each.

    The prompt is ``1..prompt_len``; ``group_id`` defaults to a fresh id; ``statuses`` (one
    per reward) default to COMPLETED.
    """
    gi = next(_index)
    chosen = list(statuses) if statuses is not None else [SampleStatus.COMPLETED] * len(rewards)
    prompt = Prompt(key=f"p{gi}", tokens=tuple(range(1, prompt_len + 1)), label="42", env_name=env)
    samples = [
        make_sample(
            gi,
            reward,
            version=version,
            prompt=prompt.tokens,
            completion=completion,
            status=status,
            env_name=env,
        )
        for reward, status in zip(rewards, chosen, strict=True)
    ]
    return Group(
        group_id=group_id or new_group_id(),
        prompt=prompt,
        samples=samples,
        policy_version_at_start=version,
    )


def pending_group(
    size: int = 4,
    prompt: Prompt = PROMPT,
    *,
    seed: int | None = None,
    routing_keys: bool = False,
) -> Group:
    """A group of ``size`` PENDING samples from a fresh :class:`GroupFactory`."""
    return GroupFactory(group_size=size, seed=seed, routing_keys=routing_keys).make(prompt)


def scripted_engine(
    finish_reasons: Mapping[int | None, FinishReason] | None = None,
    *,
    delay: float = 1.0,
    version: int = 3,
    tokens: int = 2,
) -> ScriptedEngine:
    """An engine whose every call ends by itself after ``delay`` seconds, with ``tokens``
    completion tokens, stamped with policy ``version``; the finish reason is
    ``finish_reasons[request.params.seed]`` (default ``stop``). ``engine.requests`` lists what
    it was asked."""
    reasons = dict(finish_reasons or {})

    def script(request: GenerateRequest) -> Fate:
        return Fate(reasons.get(request.params.seed, "stop"), after=delay, tokens=tokens)

    return ScriptedEngine(script, policy_version=version)


class WatchedCell(PolicyVersionCell):
    """A :class:`~trio_rl.policy.PolicyVersionCell` (pass it as ``open_orchestrator(...,
    version=cell)``) that records each wait that parks: ``floors`` lists the versions waited
    for. Only the orchestrator's ship gate waits on the cell, so :meth:`start_held` tells a
    test the gate holds a batch without any sleep."""

    __slots__ = ("_woken", "floors")

    def __init__(self, version: int = 0) -> None:
        super().__init__(version)
        self.floors: list[int] = []
        self._woken = trio.Event()

    async def wait_at_least(self, floor: int) -> int:
        if self.value < floor:
            self.floors.append(floor)
            self._woken.set()
        return await super().wait_at_least(floor)

    async def start_held(self, nursery: trio.Nursery, run: Callable[[], Awaitable[object]]) -> None:
        """Start ``run()`` in ``nursery``; return once a task parks on the cell (the ship gate
        holds a batch) or ``run()`` returned without that, when ``floors`` is unchanged: a
        gate that fails to hold fails the test's assertion on ``floors`` instead of hanging."""
        self._woken = trio.Event()

        async def go() -> None:
            await run()
            self._woken.set()

        nursery.start_soon(go)
        await self._woken.wait()


def make_sink(
    batch_size: int, groups: int = 0, *, prune: PruneMode = PruneMode.BEFORE_QUEUE
) -> TrainSink:
    """A sink with ``groups`` two-sample groups ``g0``, ``g1``, ... queued (rewards 1 and 0: both
    train), 6 tokens a sample."""
    sink = TrainSink(SinkConfig(batch_size=batch_size, prune=prune, max_off_policy_steps=None))
    for g in range(groups):
        sink.add_group(make_group([1.0, 0.0], group_id=f"g{g}", prompt_len=2))
    return sink


def one_per_sample_packer(
    world_size: int, seq_len: int = 8
) -> Callable[[Sequence[TrainingSample]], list[list[MicroBatch]]]:
    """The library's packer with bins so short that each test sample (6 tokens) gets its own."""
    return functools.partial(pack_samples, seq_len=seq_len, num_ranks=world_size)


class Releases:
    """An injected release: records each call (and its containers' sizes), can be gated."""

    def __init__(self, gated: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.started = threading.Event()
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def __call__(self, containers: Sequence[Any]) -> None:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.calls.append([len(c) for c in containers])
        self.started.set()
        self.gate.wait(30)
        release_containers(containers)
        with self._lock:
            self.active -= 1


def micro_batch(step: int, rank: int, index: int, tokens: int = 16, experts: int = 0) -> MicroBatch:
    """A micro-batch of ``tokens`` tokens whose every value says its step, rank and index
    (``experts``: with routed experts of that many per token)."""
    base = step * 1000 + rank * 100 + index
    routed = None
    if experts:
        arr = np.arange(tokens * experts * 2, dtype=np.int32).reshape(tokens, experts, 2) + base
        routed = RoutedExperts(data=arr.tobytes(), shape=list(arr.shape), dtype="int32")
    return MicroBatch(
        input_ids=[base + i for i in range(tokens)],
        loss_mask=[i % 2 == 0 for i in range(tokens)],
        advantages=[float(base) / 7] * tokens,
        inference_logprobs=[-0.5 - i / tokens for i in range(tokens)],
        position_ids=list(range(tokens)),
        sequence_lengths=[tokens],
        temperatures=[1.0] * tokens,
        env_names=[f"env-{rank}"],
        seq_lens=[tokens],
        routed_experts=routed,
    )


def grid(step: int, world: int, per_rank: int = 2, **kw: int) -> list[list[MicroBatch]]:
    """Step ``step``'s micro-batches: ``per_rank`` of :func:`micro_batch` for each of ``world``
    ranks."""
    return [[micro_batch(step, r, i, **kw) for i in range(per_rank)] for r in range(world)]


#: The one prompt of the resume tests' runs (a source of it never runs dry).
RESUME_PROMPTS = [Prompt(key="k", tokens=(1, 2))]
_RESUME_WATCHDOG = 120.0


@contextmanager
def resume_watchdog() -> Iterator[None]:
    """Fail the test if the block is still running after a long while: a loop that lets no
    cancellation in would hold the event loop past any trio deadline, so a thread interrupts
    the main thread and the test fails loudly instead of hanging."""
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        _thread.interrupt_main()

    timer = threading.Timer(_RESUME_WATCHDOG, interrupt)
    timer.start()
    try:
        yield
    except KeyboardInterrupt:
        if fired.is_set():
            pytest.fail(
                f"no deadline fired within {_RESUME_WATCHDOG} s: a loop let no cancellation in"
            )
        raise
    finally:
        timer.cancel()


def write_open_groups_checkpoint(
    directory: Path, groups: list[OpenGroup], *, samples_made: int, groups_made: int
) -> Path:
    """A checkpoint in ``directory`` whose sink holds ``groups`` open (and nothing queued), with
    a cursor that says ``samples_made`` samples and ``groups_made`` groups were made."""
    held = sum(len(g.arrived) for g in groups)
    state = SinkState(
        step=1,
        next_arrival=0,
        counters=SinkCounters(dispatched=held),
        window=SinkWindow(),
        queued=(),
        open_groups=tuple(groups),
    )
    cursor = {
        "source": InMemorySource(RESUME_PROMPTS, epochs=None).state(),
        "factory": {"next_sample_index": samples_made, "next_group_index": groups_made},
    }
    manager = CheckpointManager(directory)
    return manager.write(CheckpointSnapshot(0, {"policy_version": 0}, cursor, state))


def open_one_prompt_orchestrator(
    tmp_path: Path, group_size: int, max_tokens: int = 16, **kw: object
) -> object:
    """`open_orchestrator` over `RESUME_PROMPTS` resuming from ``tmp_path / "ckpt"`` (``kw``
    go to `open_orchestrator`)."""
    return open_orchestrator(
        SimulatedEngine(seconds_per_token=1e-6),
        InMemorySource(RESUME_PROMPTS, epochs=None),
        MemorySender(1),
        config=OrchestratorConfig(
            batch_groups=2,
            group_size=group_size,
            sampling=SamplingParams(max_tokens=max_tokens),
        ),
        checkpoint_dir=tmp_path / "ckpt",
        # a resume that finishes before the deadline goes on running: its new members need a
        # reward to be accepted by the sink
        sample_reward=_parity_reward,
        **kw,  # type: ignore[arg-type]
    )


def _parity_reward(sample: Sample) -> float:
    return float(sample.index % 2)


def reward_worker_processes(pid: int) -> list[str]:
    """The command lines of process ``pid``'s children that are reward worker processes (the
    pool's template, which forks the workers; Linux ``/proc``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue  # the thread ended in between
        for child in children:
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # the child ended in between
            line = " ".join(a.decode(errors="replace") for a in argv if a)
            if "trio_rl/workers/_child.py" in line:
                found.append(line)
    return found
