"""Helpers shared by the train-layer tests (sample and group builders: tests/builders.py)."""

from __future__ import annotations

from trio_rl.sink import CheckpointManager, SinkCounters, TrainSink


def assert_accounted(sink: TrainSink, extra_held: int = 0) -> SinkCounters:
    """Every dispatched sample is either settled exactly once or still held by the sink."""
    c = sink.counters
    assert c.dispatched == c.settled + sink.held + extra_held, (c, sink.held)
    return c


def manager(tmp_path: object, **kw: object) -> CheckpointManager:
    return CheckpointManager(tmp_path, **kw)  # type: ignore[arg-type]


def crash_sink_steps(last_step: int, mgr: object = None) -> object:
    """Yield ``(step, snapshot)`` for a deterministic run: each step adds a group and saves.

    Sample indices are explicit so a writer subprocess and the test build identical states.
    ``mgr`` takes the snapshots (an incremental manager must take its own); default: a full one.
    """
    from trio_rl.samples import Group, Prompt, Sample, SampleStatus
    from trio_rl.sink import CheckpointManager, SinkConfig, TrainSink

    sink = TrainSink(SinkConfig(batch_size=10**9, max_off_policy_steps=None))
    if mgr is None:
        mgr = CheckpointManager("unused")
    assert isinstance(mgr, CheckpointManager)
    for step in range(1, last_step + 1):
        samples = [
            Sample(
                index=step * 100 + j,
                group_index=step,
                prompt_tokens=tuple(range(50)),
                completion_tokens=[(step * 7 + j + t) % 50000 for t in range(1000)],
                logprobs=[-((t % 97) / 97.0) - step / 1000 for t in range(1000)],
                loss_mask=[t % 5 != 0 for t in range(1000)],
                reward=float(j == step % 4),
                status=SampleStatus.COMPLETED,
                policy_versions=[step // 3],
            )
            for j in range(20)
        ]
        sink.add_group(Group(f"g{step}", Prompt(f"p{step}", (1, 2)), samples, step // 3))
        sink.open_group(f"open{step}", Prompt(f"o{step}", (3,)), 3, step // 3)
        sink.add_member(
            f"open{step}",
            Sample(
                index=step * 100 + 99,
                group_index=step,
                prompt_tokens=(3,),
                completion_tokens=[step],
                logprobs=[-0.1],
                loss_mask=[True],
                reward=0.5,
                status=SampleStatus.COMPLETED,
                policy_versions=[step // 3],
            ),
        )
        yield (
            step,
            mgr.snapshot(
                sink, step=step, cursor={"epoch": 1, "cursor": step}, progress={"step": step}
            ),
        )
