"""A deadline around a resume fires whatever the checkpoint holds, and a checkpoint that holds
more than the run could have produced is refused before anything is restored or started.

Every resume here is guarded by a watchdog thread: a loop that lets no cancellation in would
hold the event loop past any trio deadline, so the watchdog interrupts the main thread and the
test fails loudly instead of hanging.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from builders import (
    RESUME_PROMPTS,
    make_sample,
    open_one_prompt_orchestrator,
    resume_watchdog,
    write_open_groups_checkpoint,
)
from trio_rl.payloads import PayloadStore
from trio_rl.samples import OpenGroup, Sample
from trio_rl.sink import CheckpointError
from trio_rl.wire import PayloadSegment


async def test_an_open_group_claiming_a_million_members_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    path = write_open_groups_checkpoint(
        tmp_path / "ckpt",
        [OpenGroup("g-0", RESUME_PROMPTS[0], 1_000_000)],
        samples_made=0,
        groups_made=1,
    )
    calls = 0

    async def generate(sample: Sample) -> None:  # pragma: no cover - must never run
        nonlocal calls
        calls += 1

    started = time.perf_counter()
    with resume_watchdog(), pytest.raises(CheckpointError) as info:
        async with open_one_prompt_orchestrator(tmp_path, 4, generate=generate):  # type: ignore[attr-defined]
            pass  # pragma: no cover - the resume refuses first
    elapsed = time.perf_counter() - started
    message = str(info.value)
    assert message == (
        f"checkpoint {path}: sink.open_groups[0].group_size: 1000000 in the checkpoint, "
        "4 configured: a configuration change (the group size may not change on resume); "
        "resume with the configuration that wrote the checkpoint, or start over"
    )
    assert calls == 0
    print(f"refused in {elapsed * 1e3:.1f} ms")


def _member(index: int, completion: int = 4, files: int = 0) -> Sample:
    m = make_sample(0, 1.0, index=index, completion=completion)
    m.payload = tuple(
        PayloadSegment("routed_experts", f"/payload/v0/r{k}.bin", 0, 0, 1, "<i4", [2])
        for k in range(files)
    )
    return m


@pytest.mark.parametrize(
    ("groups", "made", "message"),
    [
        (
            [OpenGroup("g-0", RESUME_PROMPTS[0], 4)],
            (0, 0),
            "sink.open_groups: 1 open groups in the checkpoint, 0 groups made",
        ),
        (
            [OpenGroup("g-0", RESUME_PROMPTS[0], 4, [_member(7)])],
            (5, 1),
            "sink.open_groups[0].members[0].index: 7 in the checkpoint, 5 samples made",
        ),
        (
            [OpenGroup("g-0", RESUME_PROMPTS[0], 4, [_member(0, completion=40)])],
            (5, 1),
            "sink.open_groups[0].members[0].completion_tokens: 40 tokens in the checkpoint, "
            "32 configured",
        ),
        (
            [OpenGroup("g-0", RESUME_PROMPTS[0], 4, [_member(0, files=3)])],
            (5, 1),
            "sink.open_groups[0].members[0].payload: 3 payload files in the checkpoint, "
            "1 engine calls",
        ),
    ],
)
async def test_more_than_the_run_could_have_produced_is_refused(
    tmp_path: Path, groups: list[OpenGroup], made: tuple[int, int], message: str
) -> None:
    path = write_open_groups_checkpoint(
        tmp_path / "ckpt", groups, samples_made=made[0], groups_made=made[1]
    )
    payloads = PayloadStore(tmp_path / "payload")
    with pytest.raises(CheckpointError) as info:
        async with open_one_prompt_orchestrator(tmp_path, 4, payloads=payloads, max_tokens=32):  # type: ignore[attr-defined]
            pass  # pragma: no cover
    assert str(info.value).startswith(f"checkpoint {path}: {message}: "), str(info.value)


@pytest.mark.parametrize("deadline", [0.0, 0.01, 0.1, 0.5])
@pytest.mark.parametrize("shape", ["many empty groups", "groups with members", "a large group"])
async def test_a_deadline_around_a_huge_resume_fires(
    tmp_path: Path, shape: str, deadline: float
) -> None:
    """A legitimately huge checkpoint: wherever the deadline falls (reading, checking,
    restoring, making the resumed groups, starting their samples), it fires."""
    # (the group size is the run's configuration, not the checkpoint's: a large one costs the
    # factory a list of that many samples per group, as any new group does)
    size, n, members = {
        "many empty groups": (2, 20_000, 0),
        "groups with members": (8, 2_000, 4),
        "a large group": (5_000, 1, 0),
    }[shape]
    groups = [
        OpenGroup(
            f"g-{i}", RESUME_PROMPTS[0], size, [_member(members * i + j) for j in range(members)]
        )
        for i in range(n)
    ]
    write_open_groups_checkpoint(tmp_path / "ckpt", groups, samples_made=members * n, groups_made=n)
    with resume_watchdog():
        started = time.perf_counter()
        with trio.move_on_after(deadline) as scope:
            async with open_one_prompt_orchestrator(tmp_path, size) as orch:  # type: ignore[attr-defined]
                await orch.run(10**6)
        late = time.perf_counter() - started - deadline
    assert scope.cancelled_caught
    print(f"{shape}, deadline {deadline} s: fired {late * 1e3:.0f} ms late")
