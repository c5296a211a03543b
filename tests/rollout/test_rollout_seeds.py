"""Sampling seeds: under ``seeds="run"`` every sample of a run draws its own stream, the run seed
reproduces them, and a resumed group draws what its lost members would have; ``"group"`` is the
reference's rule."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_rl.rollout import GroupFactory, RolloutConfig
from trio_rl.samples import OpenGroup, Prompt, SampleStatus

PROMPT = Prompt(key="a", tokens=(1, 2))
OTHER = Prompt(key="b", tokens=(3,))


def _seeds(factory: GroupFactory, prompts: list[Prompt]) -> list[list[int | None]]:
    return [[s.seed for s in factory.make(p).samples] for p in prompts]


def test_the_same_prompt_in_another_step_draws_other_seeds() -> None:
    # three steps of one group each, the same prompt every step (and another prompt between)
    factory = GroupFactory(group_size=3, seed=42, seeds="run")
    step1, other, step2, step3 = _seeds(factory, [PROMPT, OTHER, PROMPT, PROMPT])
    # consecutive within a group: vLLM serves the group as one request with n
    assert step1 == [42, 43, 44]
    assert other == [45, 46, 47]
    assert step2 == [48, 49, 50]
    assert step3 == [51, 52, 53]


@given(
    seed=st.integers(-(2**31), 2**31),
    size=st.integers(1, 16),
    groups=st.integers(1, 20),
)
def test_no_two_samples_of_a_run_share_a_seed(seed: int, size: int, groups: int) -> None:
    factory = GroupFactory(group_size=size, seed=seed, seeds="run")
    seeds = [s for g in _seeds(factory, [PROMPT] * groups) for s in g]
    assert len(set(seeds)) == len(seeds) == size * groups


def test_the_run_seed_reproduces_the_seeds_across_a_restore() -> None:
    straight = GroupFactory(group_size=4, seed=7, seeds="run")
    expected = _seeds(straight, [PROMPT] * 5)
    # the same seed, counters restored after two groups: the same seeds for the next three
    first = GroupFactory(group_size=4, seed=7, seeds="run")
    before = _seeds(first, [PROMPT] * 2)
    restored = GroupFactory(group_size=4, seed=7, seeds="run")
    restored.load_state(msgpack.unpackb(msgpack.packb(first.state())))
    assert before + _seeds(restored, [PROMPT] * 3) == expected
    # another run seed draws other seeds
    other = _seeds(GroupFactory(group_size=4, seed=8, seeds="run"), [PROMPT] * 5)
    assert other != expected
    # unseeded stays unseeded
    assert _seeds(GroupFactory(group_size=2), [PROMPT]) == [[None, None]]


def test_a_resumed_group_draws_the_seeds_of_its_members_that_never_arrived() -> None:
    factory = GroupFactory(group_size=4, seed=100, seeds="run")
    factory.make(OTHER)
    original = factory.make(PROMPT)  # group 1: seeds 104-107
    assert [s.seed for s in original.samples] == [104, 105, 106, 107]
    # members 3 and 1 arrived (in that order); 0 and 2 were lost in the crash
    arrived = [original.samples[3], original.samples[1]]
    for s in arrived:
        s.status = SampleStatus.COMPLETED
    restored = GroupFactory(group_size=4, seed=100, seeds="run")
    restored.load_state(factory.state())
    group = restored.resume(
        OpenGroup(group_id=original.group_id, prompt=PROMPT, group_size=4, arrived=arrived)
    )
    assert group.samples[:2] == arrived
    new = group.samples[2:]
    assert [s.seed for s in new] == [104, 106]
    assert {s.group_index for s in new} == {1}
    assert [s.index for s in new] == [8, 9]  # fresh indices
    # nothing arrived: a new group index, so seeds no group drew
    empty = restored.resume(OpenGroup(group_id="g", prompt=PROMPT, group_size=4))
    assert [s.seed for s in empty.samples] == [108, 109, 110, 111]


def test_an_unseeded_resumed_group_takes_the_positions_after_the_arrived() -> None:
    factory = GroupFactory(group_size=3)
    recycled = Prompt(key="a", tokens=(1,), metadata={"routing_keys": ["x", "y", "z"]})
    original = factory.make(recycled)
    arrived = [original.samples[0]]
    arrived[0].status = SampleStatus.COMPLETED
    group = factory.resume(
        OpenGroup(group_id=original.group_id, prompt=original.prompt, group_size=3, arrived=arrived)
    )
    assert [s.routing_key for s in group.samples] == ["x", "y", "z"]
    assert [s.seed for s in group.samples] == [None, None, None]


def test_the_reference_rule_gives_every_group_the_same_seed_set() -> None:
    """``seeds="group"``, the default of a bare factory (miles' rule): sample ``i`` of every
    group draws ``seed + i``, a retry and a resume too; the orchestrator's default is
    ``"run"`` (``[rollout] seeds``)."""
    factory = GroupFactory(group_size=3, seed=42)
    assert factory.seeds == "group"
    assert _seeds(factory, [PROMPT, OTHER, PROMPT]) == [[42, 43, 44]] * 3
    assert RolloutConfig().seeds == "run"
    with pytest.raises(ValueError):
        GroupFactory(group_size=3, seed=42, seeds="step")  # type: ignore[arg-type]
