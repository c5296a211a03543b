"""A resumed group is judged stale by the rule the sink scores by, in the driver too.

The group opened at v1 and resumes at v5 (the checkpoint's version) while batch 6 is collected
with ``max_off_policy_steps = 1``: its start version is stale (1 < 6 - 1 - 1), but the members
it regenerates are judged by the version their attempt started at (5), so the sink trains
them. The driver's early expiry must agree: the group keeps running under its id and ships in
batch 6, and nothing is cancelled as stale.
"""

from __future__ import annotations

from pathlib import Path

import trio

from trio_rl.engines import SimulatedEngine
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.policy import PolicyVersionCell
from trio_rl.rollout import InMemorySource, RolloutConfig, engine_generate
from trio_rl.samples import RESUMED_AT, Prompt, Sample
from trio_rl.sink import CheckpointManager, SinkConfig, TrainSink
from trio_rl.transport import MemorySender

G = 2
PROMPTS = [Prompt(key=f"k{i}", tokens=(1, 2, i)) for i in range(4)]


def _checkpoint(directory: Path) -> None:
    """Step 5 shipped at policy v5; group ``resumed`` (opened at v1) has nothing arrived."""
    sink = TrainSink(SinkConfig(batch_size=G, max_off_policy_steps=1), step=6)
    sink.open_group("resumed", Prompt(key="old", tokens=(7, 8)), G, policy_version_at_start=1)
    manager = CheckpointManager(directory)
    cursor = {
        "source": InMemorySource(PROMPTS).state(),
        "factory": {"next_sample_index": G, "next_group_index": 1},
    }
    manager.write(manager.snapshot(sink, step=5, cursor=cursor, progress={"policy_version": 5}))


async def test_a_resumed_group_is_not_cancelled_as_stale_by_its_old_start(
    tmp_path: Path,
) -> None:
    _checkpoint(tmp_path / "ckpt")
    version = PolicyVersionCell(5)
    engine = SimulatedEngine(seconds_per_token=1e-4, version=version)
    real = engine_generate(engine)
    started: list[Sample] = []
    go, all_started = trio.Event(), trio.Event()

    async def gated(sample: Sample) -> None:
        # every generation waits until the expiry has looked at the running groups
        started.append(sample)
        if len(started) == G:
            all_started.set()
        await go.wait()
        await real(sample)

    config = OrchestratorConfig(
        batch_groups=1,
        group_size=G,
        sink=SinkConfig(batch_size=G, max_off_policy_steps=1),
        rollout=RolloutConfig(max_groups_in_flight=1),
    )
    shipped: list[str] = []
    with trio.fail_after(30):
        async with open_orchestrator(
            engine,
            InMemorySource(PROMPTS),
            MemorySender(1),
            config=config,
            checkpoint_dir=tmp_path / "ckpt",
            generate=gated,
            sample_reward=lambda s: float(s.index % 2),  # one of two right: both train
            version=version,
            monitor=lambda shipment: shipped.extend(s.group_id for s in shipment.samples),
        ) as orch:
            assert orch.restore is not None
            assert [r.group_id for r in orch.restore.resumed] == ["resumed"]
            await all_started.wait()  # the resumed group runs, its members regenerating
            assert {s.metadata["prompt_key"] for s in started} == {"old"}
            assert all(s.metadata[RESUMED_AT] == 5 for s in started)
            assert orch.sink.step == 6
            # what a shipped batch or a scored group triggers: the expiry looks at it now
            orch.driver.expiry.reconsider("test")
            go.set()
            summary = await orch.run(1)
            stats = orch.driver.statistics()
    assert stats.cancelled_stale == 0
    assert summary.last_step == 6
    # the group kept its id ("open groups keep their id") and its fresh members trained
    assert shipped == ["resumed"] * G
    assert summary.counters.stale == 0
