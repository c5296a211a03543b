"""Shared pieces of the publisher tests: finished groups, the sink, a small packer."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable, Sequence

import attrs

from trio_rl.samples import Group, Prompt, Sample, SampleStatus
from trio_rl.train import (
    DetachedBatch,
    PruneMode,
    PruneResult,
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


class Sink(TrainSink):
    """The train sink plus the one method the publisher needs that it does not expose yet."""

    def requeue_batch(self, detached: DetachedBatch, pruned: PruneResult | None = None) -> None:
        self._requeue(detached, pruned or PruneResult(kept=list(detached.samples), pruned=[]))


def make_sink(
    batch_size: int, groups: int = 0, *, prune: PruneMode = PruneMode.BEFORE_QUEUE
) -> Sink:
    """A sink with ``groups`` two-sample groups queued (rewards 1 and 0: both train)."""
    sink = Sink(SinkConfig(batch_size=batch_size, prune=prune, max_off_policy_steps=None))
    for g in range(groups):
        sink.add_group(make_group(f"g{g}", [1.0, 0.0]))
    return sink


def one_per_sample_packer(
    world_size: int,
) -> Callable[[Sequence[TrainingSample]], list[list[MicroBatch]]]:
    """One micro-batch per sample, dealt round-robin; short ranks get a zero-loss filler."""

    def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
        mbs = [
            MicroBatch(
                input_ids=list(s.token_ids),
                loss_mask=list(s.mask),
                advantages=list(s.advantages or [0.0] * s.num_tokens),
                inference_logprobs=list(s.logprobs),
                position_ids=list(range(s.num_tokens)),
                sequence_lengths=[s.num_tokens],
                temperatures=list(s.temperatures),
                env_names=[s.env_name] * s.num_tokens,
                seq_lens=[s.num_tokens],
                rl_weights=None if s.rl_weights is None else list(s.rl_weights),
            )
            for s in samples
        ]
        grid: list[list[MicroBatch]] = [mbs[r::world_size] for r in range(world_size)]
        longest = max(len(g) for g in grid)
        for rank in grid:
            while len(rank) < longest:
                rank.append(attrs.evolve(mbs[0], loss_mask=[False] * len(mbs[0].loss_mask)))
        return grid

    return pack


def free_port_pair() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are both free on 127.0.0.1 right now."""
    for _ in range(200):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair found")
