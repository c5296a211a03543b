"""A run over one prompt: every group of it, in every step and across a resume, samples with
seeds of its own, and the run seed reproduces them."""

from __future__ import annotations

from pathlib import Path

import trio

from trio_rl.engines import SamplingParams
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.publish import Shipment
from trio_rl.rollout import InMemorySource
from trio_rl.samples import Group, Prompt
from trio_rl.sink import SinkConfig
from trio_rl.testing import Fate, ScriptedEngine
from trio_rl.transport import MemorySender

G = 4
T = 2
PROMPT = Prompt(key="only", tokens=(3, 4, 5))


def _by_position(group: Group) -> list[float]:
    # distinct within the group, so no sample is pruned for a zero advantage
    return [float(i) for i in range(len(group.samples))]


async def _run(out: Path, seed: int, steps: int) -> tuple[dict[int, int | None], list[Shipment]]:
    """``steps`` more steps of the run in ``out`` (resumed from its checkpoint): the seed of
    every sample index the engine was asked for, and the shipments."""
    # members of a group finish at different times, so a checkpoint holds groups half-arrived
    engine = ScriptedEngine(lambda r: Fate("stop", after=0.002 * ((r.params.seed or 0) % G)))
    shipments: list[Shipment] = []
    config = OrchestratorConfig(
        batch_groups=T,
        group_size=G,
        max_async_level=1000,
        sampling=SamplingParams(max_tokens=8),
        seed=seed,
        sink=SinkConfig(batch_size=T * G, max_off_policy_steps=None),
    )
    with trio.fail_after(30):
        async with (
            MemorySender(1) as sender,
            open_orchestrator(
                engine,
                InMemorySource([PROMPT], epochs=None),
                sender,
                config=config,
                checkpoint_dir=out / "ckpt",
                group_reward=_by_position,
                monitor=shipments.append,
            ) as orch,
        ):
            await orch.run(steps)
    seeds = {r.sample_index: r.params.seed for r in engine.requests if r.sample_index is not None}
    return seeds, shipments


def _shipped(runs: list[tuple[dict[int, int | None], list[Shipment]]]) -> dict[int, list[int]]:
    """The seeds each step shipped. A sample is looked up in the run that shipped it, then in
    the one before (an open group's member that arrived before the resume, which the resumed
    run does not ask for again)."""
    out: dict[int, list[int]] = {}
    for k, (_, shipments) in enumerate(runs):
        for shipment in shipments:
            for s in shipment.samples:
                seed = next(r[0][s.sample_index] for r in runs[k::-1] if s.sample_index in r[0])
                assert seed is not None
                out.setdefault(shipment.record.step, []).append(seed)
    return out


async def test_every_group_of_one_prompt_draws_its_own_seeds_across_steps_and_a_resume(
    tmp_path: Path,
) -> None:
    first = await _run(tmp_path / "a", seed=5, steps=3)
    resumed = await _run(tmp_path / "a", seed=5, steps=4)
    steps = _shipped([first, resumed])
    assert sorted(steps) == [1, 2, 3, 4, 5, 6, 7]
    shipped = [seed for step in steps.values() for seed in step]
    # every step is the same prompt, and no two shipped samples drew the same seed
    assert len(shipped) == len(set(shipped)) == 7 * T * G
    for a in steps:
        for b in steps:
            assert a == b or not set(steps[a]) & set(steps[b]), (a, b)
    # the same run seed asks for the same seed for every sample index, another run seed not
    seeds = first[0]
    again, _ = await _run(tmp_path / "b", seed=5, steps=3)
    common = set(seeds) & set(again)
    assert len(common) >= 3 * T * G
    assert {i: seeds[i] for i in common} == {i: again[i] for i in common}
    other, _ = await _run(tmp_path / "c", seed=6, steps=1)
    assert all(other[i] != seeds[i] for i in set(other) & set(seeds))
