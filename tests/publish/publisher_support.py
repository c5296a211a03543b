"""Shared pieces of the publisher tests: the sink, a small packer (groups: tests/builders.py).

The groups here have 2-token prompts: with 4 completion tokens a sample is 6 tokens, one to
an 8-token bin of :func:`one_per_sample_packer`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from builders import make_group
from trio_rl.publish import pack_samples
from trio_rl.train import (
    PruneMode,
    SinkConfig,
    TrainingSample,
    TrainSink,
)
from trio_rl.wire import MicroBatch


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
