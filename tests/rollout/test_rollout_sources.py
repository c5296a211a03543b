"""Data sources and the group factory: recycling, exhaustion, cursors, JSONL errors."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rollout_helpers import prompts

from trio_rl.rollout import (
    DataSource,
    DataSourceError,
    GroupFactory,
    InMemorySource,
    JsonlSource,
    SourceExhaustedError,
    prompt_to_dict,
)
from trio_rl.rollout._sources import prompt_from_dict
from trio_rl.samples import Prompt


def test_sources_satisfy_the_protocol(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"key": "a", "tokens": [1]}\n')
    assert isinstance(InMemorySource(prompts(1)), DataSource)
    assert isinstance(JsonlSource(path), DataSource)


def test_in_order_then_exhausted() -> None:
    src = InMemorySource(prompts(2))
    assert [src.take().key, src.take().key] == ["p0", "p1"]
    assert src.exhausted
    with pytest.raises(SourceExhaustedError, match="1 epoch"):
        src.take()


def test_recycled_prompts_are_served_first_and_revive_an_exhausted_source() -> None:
    src = InMemorySource(prompts(3))
    a, b = src.take(), src.take()
    src.recycle(b)
    src.recycle(a)
    assert [src.take().key for _ in range(3)] == ["p1", "p0", "p2"]
    exhausted = src.exhausted  # read into locals: recycling changes it, mypy cannot know
    assert exhausted
    src.recycle(a)
    revived = not src.exhausted
    assert revived
    assert src.take() is a


def test_epochs_wrap() -> None:
    src = InMemorySource(prompts(2), epochs=2)
    assert [src.take().key for _ in range(4)] == ["p0", "p1", "p0", "p1"]
    assert src.exhausted
    endless = InMemorySource(prompts(2), epochs=None)
    assert [endless.take().key for _ in range(5)] == ["p0", "p1", "p0", "p1", "p0"]
    assert endless.epoch == 2
    with pytest.raises(ValueError, match="at least one prompt"):
        InMemorySource([], epochs=None)


@given(
    n=st.integers(1, 6),
    epochs=st.one_of(st.none(), st.integers(1, 3)),
    ops=st.lists(st.one_of(st.just("take"), st.just("recycle")), max_size=25),
)
def test_cursor_round_trip_resumes_the_exact_sequence(
    n: int, epochs: int | None, ops: list[str]
) -> None:
    """Saving after any history and restoring into a fresh source continues identically."""
    original = InMemorySource(prompts(n), epochs=epochs)
    taken: list[Prompt] = []
    for op in ops:
        if op == "take" and not original.exhausted:
            taken.append(original.take())
        elif op == "recycle" and taken:
            original.recycle(taken.pop(0))
    state = msgpack.unpackb(msgpack.packb(original.state()))  # plain values only
    restored = InMemorySource(prompts(n), epochs=epochs)
    restored.load_state(state)
    for _ in range(2 * n + 3):
        assert original.exhausted == restored.exhausted
        if original.exhausted:
            break
        assert original.take() == restored.take()


def test_load_state_rejects_mismatches() -> None:
    src = InMemorySource(prompts(3))
    with pytest.raises(DataSourceError, match="saved for 5 prompts"):
        src.load_state({"num_prompts": 5, "epoch": 0, "position": 0, "recycled": []})
    with pytest.raises(DataSourceError, match="'position'"):
        src.load_state({"num_prompts": 3, "epoch": 0, "position": -1})
    with pytest.raises(DataSourceError, match="out of range"):
        src.load_state({"num_prompts": 3, "epoch": 0, "position": 3})
    with pytest.raises(DataSourceError, match=r"recycled\[0\]: field 'tokens'"):
        src.load_state(
            {
                "num_prompts": 3,
                "epoch": 0,
                "position": 0,
                "recycled": [{"key": "x", "tokens": "ab"}],
            }
        )
    # a failed load changes nothing
    assert src.take().key == "p0"


def test_factory_counters_and_seeds_survive_save_and_restore() -> None:
    factory = GroupFactory(group_size=3, seed=42)
    first = factory.make(Prompt(key="a", tokens=(1,)), policy_version=4)
    assert [s.index for s in first.samples] == [0, 1, 2]
    assert {s.group_index for s in first.samples} == {0}
    assert [s.seed for s in first.samples] == [42, 43, 44]
    assert first.policy_version_at_start == 4
    assert all(s.routing_key is None for s in first.samples)
    state = msgpack.unpackb(msgpack.packb(factory.state()))
    again = GroupFactory(group_size=3, seed=42)
    again.load_state(state)
    second = again.make(Prompt(key="b", tokens=(2,)))
    assert [s.index for s in second.samples] == [3, 4, 5]
    assert second.group_index == 1
    assert second.group_id != first.group_id
    with pytest.raises(DataSourceError, match="next_group_index"):
        again.load_state({"next_sample_index": 1, "next_group_index": "x"})


def test_group_ids_are_unique_within_a_factory_across_factories_and_resumes() -> None:
    prompt = Prompt(key="a", tokens=(1,))
    factory = GroupFactory(group_size=1)
    ids = [factory.make(prompt).group_id for _ in range(100)]
    # a resumed run restores the counters: its ids must not repeat the first run's
    resumed = GroupFactory(group_size=1)
    resumed.load_state({"next_sample_index": 0, "next_group_index": 0})
    ids += [resumed.make(prompt).group_id for _ in range(100)]
    ids += [GroupFactory(group_size=1).make(prompt).group_id for _ in range(100)]
    assert len(set(ids)) == len(ids)
    assert all(isinstance(i, str) and i for i in ids)
    with pytest.raises(ValueError, match="group_size"):
        GroupFactory(group_size=0)


def test_routing_keys_are_per_sample_and_survive_retry() -> None:
    group = GroupFactory(group_size=3, routing_keys=True).make(Prompt(key="a", tokens=(1,)))
    keys = [s.routing_key for s in group.samples]
    assert len(set(keys)) == 3
    for s in group.samples:
        s.reset_for_retry()
    assert [s.routing_key for s in group.samples] == keys


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_reads_the_schema(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        json.dumps({"key": "a", "tokens": [1, 2], "label": "42", "env_name": "math"}),
        "",
        json.dumps({"key": "b", "tokens": [], "metadata": {"level": 3}}),
    )
    src = JsonlSource(path)
    assert len(src) == 2
    a, b = src.take(), src.take()
    assert a == Prompt(key="a", tokens=(1, 2), label="42", env_name="math")
    assert b.metadata == {"level": 3}
    assert b.env_name == "default"
    assert prompt_from_dict(prompt_to_dict(a)) == a


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected an object"),
        ('{"tokens": [1]}', "field 'key'"),
        ('{"key": "a", "tokens": [1, -2]}', "field 'tokens'"),
        ('{"key": "a", "tokens": [1, true]}', "field 'tokens'"),
        ('{"key": "a", "tokens": [1], "env_name": 3}', "field 'env_name'"),
        ('{"key": "a", "tokens": [1], "metadata": []}', "field 'metadata'"),
        ('{"key": "a", "tokens": [1], "extra": 1}', "unknown field"),
        ('{"key": "p0", "tokens": [1]}', "duplicate key 'p0' \\(first on line 1\\)"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, '{"key": "p0", "tokens": [0]}', "", line)
    with pytest.raises(DataSourceError, match=message) as info:
        JsonlSource(path)
    assert str(info.value).startswith(f"{path}:3: ")


def test_jsonl_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match="cannot read"):
        JsonlSource(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(DataSourceError, match="cannot read"):
        JsonlSource(bad)
