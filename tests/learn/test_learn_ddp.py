"""One DDP step on two gloo ranks (under torchrun) equals one rank's step on the global batch."""

from __future__ import annotations

import copy
import pickle
import random
import subprocess
import sys
from pathlib import Path

import torch

from trio_rl.learn import (
    TASKS,
    CharTransformer,
    GRPOTrainer,
    ModelConfig,
    TrainerConfig,
    sequence_logprobs,
)
from trio_rl.publish import pack_samples
from trio_rl.sink import TrainingSample
from trio_rl.transport import free_port_pair

HERE = Path(__file__).resolve().parent


def _batch(model: CharTransformer, n: int, seed: int) -> list[TrainingSample]:
    """Sequences of varying length with logprobs near the model's (so ratios vary and clip)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = TASKS["copy"].tokenizer
    samples = []
    for i in range(n):
        prompt = list(tokenizer.encode("".join(rng.choice("abcde") for _ in range(3)) + "="))
        completion = [rng.randrange(2, tokenizer.vocab_size) for _ in range(rng.randint(1, 7))]
        ids = prompt + completion
        with torch.no_grad():
            lp = sequence_logprobs(model, [torch.tensor(ids)])[0]
        noisy = lp + 0.3 * torch.randn(len(ids), generator=gen)
        mask = [False] * len(prompt) + [True] * len(completion)
        logprobs = [0.0] * len(prompt) + noisy[len(prompt) :].tolist()
        advantage = rng.uniform(-1, 1)
        samples.append(
            TrainingSample(
                token_ids=ids,
                mask=mask,
                logprobs=logprobs,
                temperatures=[1.0] * len(ids),
                env_name="default",
                advantages=[advantage] * len(ids),
                group_id=f"g{i // 4}",
                sample_index=i,
            )
        )
    return samples


def test_one_ddp_step_on_two_ranks_equals_one_rank_on_the_global_batch(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = ModelConfig(TASKS["copy"].tokenizer.vocab_size, max_len=16)
    model = CharTransformer(config)
    torch.nn.init.normal_(model.head.weight, std=0.3)
    start = copy.deepcopy(model.state_dict())
    samples = _batch(model, 24, seed=1)
    trainer_config = TrainerConfig()
    # several micro-batches per rank, so gradient accumulation under no_sync is exercised
    per_rank = pack_samples(samples, seq_len=32, num_ranks=2)
    single = pack_samples(samples, seq_len=32, num_ranks=1)
    assert len(per_rank[0]) >= 2

    one = GRPOTrainer(model, trainer_config)
    assert not one.distributed
    one_stats = one.train_step(1, single[0])
    assert 0 < one_stats.clipped_fraction < 1  # the clip is active on part of the batch

    job, out = tmp_path / "job.pkl", tmp_path / "out.pkl"
    job.write_bytes(
        pickle.dumps(
            {
                "model_config": config,
                "state": start,
                "trainer_config": trainer_config,
                "per_rank": per_rank,
            }
        )
    )
    port = free_port_pair()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(HERE / "ddp_worker.py"),
            str(job),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = pickle.loads(out.read_bytes())
    moved = 0.0
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result["state"][name], value, atol=1e-5, rtol=0, msg=name)
        moved = max(moved, float((value - start[name]).abs().max()))
    assert moved > 1e-3  # the step really changed the parameters
    assert result["stats"].loss_tokens == one_stats.loss_tokens
    assert abs(result["stats"].loss - one_stats.loss) < 1e-5
