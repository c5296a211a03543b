"""Group-sticky routing: the orchestrator turns routing keys on, the HTTP engines send them as
the ``X-SMG-Routing-Key`` header (what SGLang's router reads), one key per group."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import trio
from vllm_stand_in import serve

from trio_rl.engines import OpenAICompatibleEngine, SamplingParams, open_vllm_engine
from trio_rl.errors import DataSourceError
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.rollout import GroupFactory, InMemorySource, RolloutConfig
from trio_rl.samples import OpenGroup, Prompt, Sample, SampleStatus
from trio_rl.transport import FileSender


def _reward(sample: Sample) -> float:
    return float(sample.index % 3)


def _keys_by_prompt(state: object) -> dict[tuple[int, ...], set[str | None]]:
    seen: dict[tuple[int, ...], set[str | None]] = defaultdict(set)
    for (_, path, body), headers in zip(state.requests, state.headers, strict=True):  # type: ignore[attr-defined]
        if path == "/v1/completions":
            seen[tuple(body["prompt"])].add(headers.get("x-smg-routing-key"))
    return seen


@pytest.mark.parametrize("kind", ["openai", "vllm"])
async def test_the_orchestrator_sends_one_routing_key_per_group_as_the_header(
    tmp_path: Path, kind: str
) -> None:
    config = OrchestratorConfig(
        batch_groups=2,
        group_size=4,
        max_async_level=1000,
        sampling=SamplingParams(max_tokens=8),
        seed=5,
        rollout=RolloutConfig(routing_keys="group"),
    )
    prompts = [Prompt(key=f"k{i}", tokens=(10 + i, 1)) for i in range(16)]
    with serve() as (state, url):
        state.lengths = [3] * 4
        sender = FileSender(tmp_path, 1)
        with trio.fail_after(30):
            if kind == "openai":
                engine_cm = OpenAICompatibleEngine(url, abort_path=None)
            else:
                engine_cm = open_vllm_engine(url)  # type: ignore[assignment]
            async with (
                engine_cm as engine,
                sender,
                open_orchestrator(
                    engine,
                    InMemorySource(prompts),
                    sender,
                    config=config,
                    sample_reward=_reward,
                ) as orch,
            ):
                await orch.run(2)
    seen = _keys_by_prompt(state)
    assert len(seen) >= 4  # at least the two steps' groups reached the server
    for keys in seen.values():
        assert len(keys) == 1  # every request of a group carries the same key ...
        (key,) = keys
        assert key  # ... and it is sent
    all_keys = [next(iter(k)) for k in seen.values()]
    assert len(set(all_keys)) == len(all_keys)  # each group its own


async def test_without_routing_keys_no_header_is_sent(tmp_path: Path) -> None:
    config = OrchestratorConfig(
        batch_groups=1, group_size=2, max_async_level=1000, sampling=SamplingParams(max_tokens=4)
    )
    with serve() as (state, url):
        sender = FileSender(tmp_path, 1)
        with trio.fail_after(30):
            async with (
                OpenAICompatibleEngine(url, abort_path=None) as engine,
                sender,
                open_orchestrator(
                    engine,
                    InMemorySource([Prompt(key="a", tokens=(3, 1))], epochs=None),
                    sender,
                    config=config,
                    sample_reward=_reward,
                ) as orch,
            ):
                await orch.run(1)
    seen = _keys_by_prompt(state)
    assert seen
    assert all(keys == {None} for keys in seen.values())


def test_group_keys_are_the_group_id_and_a_resumed_group_keeps_them() -> None:
    factory = GroupFactory(group_size=3, routing_keys="group")
    group = factory.make(Prompt(key="a", tokens=(1,)))
    assert {s.routing_key for s in group.samples} == {group.group_id}
    other = factory.make(Prompt(key="b", tokens=(2,)))
    assert other.samples[0].routing_key != group.samples[0].routing_key
    first = group.samples[0]
    first.status = SampleStatus.COMPLETED
    resumed = GroupFactory(group_size=3, routing_keys="group").resume(
        OpenGroup(
            group_id=group.group_id,
            prompt=group.prompt,
            group_size=3,
            arrived=[first],
        )
    )
    assert {s.routing_key for s in resumed.samples} == {group.group_id}


def test_per_sample_keys_and_the_old_boolean_spelling() -> None:
    assert GroupFactory(group_size=2, routing_keys=True).routing_keys == "sample"
    assert GroupFactory(group_size=2, routing_keys=False).routing_keys == "none"
    group = GroupFactory(group_size=3, routing_keys="sample").make(Prompt(key="a", tokens=(1,)))
    assert len({s.routing_key for s in group.samples}) == 3
    with pytest.raises(DataSourceError, match="routing_keys = 'groups'"):
        GroupFactory(group_size=2, routing_keys="groups")


def test_the_rollout_config_refuses_an_unknown_routing_mode() -> None:
    with pytest.raises(ValueError, match="routing_keys"):
        RolloutConfig(routing_keys="groups")  # type: ignore[arg-type]


def test_simulate_against_an_openai_server_sends_one_routing_key_per_group(
    tmp_path: Path,
) -> None:
    # `trio-rl simulate` as its own process against a loopback server that records headers
    with serve() as (state, url):
        cmd = [
            sys.executable, "-c", "import sys; from trio_rl.cli import main; sys.exit(main())",
            "simulate", "--out", str(tmp_path / "run"), "--steps", "1",
            "--batch-groups", "2", "--group-size", "4",
            "--set", "engine.kind=openai", "--set", f"engine.url={url}",
            "--set", "engine.max_tokens=4",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    by_key: dict[str | None, set[tuple[int, ...]]] = defaultdict(set)
    requests = 0
    for (_, path, body), headers in zip(state.requests, state.headers, strict=True):
        if path == "/v1/completions":
            requests += 1
            by_key[headers.get("x-smg-routing-key")].add(tuple(body["prompt"]))
    assert requests >= 8  # at least the shipped step's two groups of four
    assert None not in by_key  # every request carries the header ...
    assert len(by_key) >= 2  # ... one key per group ...
    assert all(len(prompts) == 1 for prompts in by_key.values())  # ... for one prompt only
