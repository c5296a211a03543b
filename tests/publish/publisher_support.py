"""Shared pieces of the publisher tests: finished groups, the sink, a small packer."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

from trio_rl.publish import pack_samples
from trio_rl.samples import Group, Prompt, Sample, SampleStatus
from trio_rl.train import (
    PruneMode,
    SinkConfig,
    TrainingSample,
    TrainSink,
)
from trio_rl.wire import MicroBatch

_indices = itertools.count()


def make_group(
    group_id: str,
    rewards: Sequence[float],
    *,
    completion: int = 4,
    prompt_len: int = 2,
    version: int = 0,
    env: str = "env",
) -> Group:
    """A finished group: one sample per reward, ``completion`` trained tokens each."""
    prompt = Prompt(key=group_id, tokens=list(range(1, prompt_len + 1)), env_name=env)
    samples = [
        Sample(
            index=next(_indices),
            group_index=0,
            prompt_tokens=prompt.tokens,
            completion_tokens=[100 + i for i in range(completion)],
            logprobs=[-0.25] * completion,
            loss_mask=[True] * completion,
            reward=reward,
            status=SampleStatus.COMPLETED,
            policy_versions=[version],
            env_name=env,
        )
        for reward in rewards
    ]
    return Group(group_id=group_id, prompt=prompt, samples=samples, policy_version_at_start=version)


def make_sink(
    batch_size: int, groups: int = 0, *, prune: PruneMode = PruneMode.BEFORE_QUEUE
) -> TrainSink:
    """A sink with ``groups`` two-sample groups queued (rewards 1 and 0: both train)."""
    sink = TrainSink(SinkConfig(batch_size=batch_size, prune=prune, max_off_policy_steps=None))
    for g in range(groups):
        sink.add_group(make_group(f"g{g}", [1.0, 0.0]))
    return sink


def one_per_sample_packer(
    world_size: int, seq_len: int = 8
) -> Callable[[Sequence[TrainingSample]], list[list[MicroBatch]]]:
    """The library's packer with bins so short that each test sample (6 tokens) gets its own."""
    return functools.partial(pack_samples, seq_len=seq_len, num_ranks=world_size)
