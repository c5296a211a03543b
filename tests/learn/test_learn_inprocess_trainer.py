"""The learning run's in-process trainer borrows the run's one capacity limiter: its file reads,
decoding and training step wait for a token of the limiter it is given, never a private one."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import trio
from learn_helpers import learn_config

from trio_rl.learn import TASKS, build_model
from trio_rl.learn._inprocess import InProcessTrainer
from trio_rl.publish import pack_samples
from trio_rl.sink import TrainingSample
from trio_rl.transport import FileSender
from trio_rl.wire import encode

torch.set_num_threads(1)


def _samples(n: int) -> list[TrainingSample]:
    rng = random.Random(0)
    tokenizer = TASKS["repeat"].tokenizer
    out = []
    for i in range(n):
        prompt = list(tokenizer.encode("abc="))
        completion = [rng.randrange(2, tokenizer.vocab_size) for _ in range(3)]
        ids = prompt + completion
        out.append(
            TrainingSample(
                token_ids=ids,
                mask=[False] * len(prompt) + [True] * len(completion),
                logprobs=[0.0] * len(prompt) + [-1.0] * len(completion),
                temperatures=[1.0] * len(ids),
                env_name="default",
                advantages=[rng.uniform(-1, 1)] * len(ids),
                group_id=f"g{i // 2}",
                sample_index=i,
            )
        )
    return out


async def test_the_in_process_trainer_waits_for_the_limiter_it_is_given(tmp_path: Path) -> None:
    config = learn_config(
        tmp_path, run__steps=1, metrics__console=False, metrics__plot=False, publish__threads=1
    )
    model, _ = build_model(config)
    (rank,) = pack_samples(_samples(4), seq_len=64)
    limiter = trio.CapacityLimiter(config.publish.threads)
    async with FileSender(tmp_path, 1, fsync=False) as sender:
        await sender.send(1, [encode(rank)])
        await sender.end_stream(2)  # the trainer returns after step 1
    (step_file,) = await trio.Path(tmp_path).rglob("*.bin")
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await limiter.acquire()  # the run's only token, held here
            trainer = InProcessTrainer(config, model, limiter)
            stats = trainer.stats
            nursery.start_soon(trainer.run)
            with trio.fail_after(30):  # the trainer queues for the run's token ...
                while limiter.statistics().tasks_waiting == 0:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            # ... and waits: the step is on disk, but it has no token to read, decode or train
            await trio.sleep(0.2)
            assert stats == []
            assert await step_file.exists()
            limiter.release()
    # trained on the run's limiter, acknowledged (the file is gone), and the stream ended
    assert len(stats) == 1
    assert limiter.borrowed_tokens == 0
    assert not await step_file.exists()
