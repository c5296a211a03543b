"""One DDP trainer rank for test_learn_ddp.py, launched by torchrun: one step, rank 0 saves."""

from __future__ import annotations

import gc
import os
import pickle
import sys

import torch
import torch.distributed as dist

from trio_rl.learn import CharTransformer, GRPOTrainer


def main(job_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    with open(job_file, "rb") as f:
        job = pickle.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = CharTransformer(job["model_config"])
    model.load_state_dict(job["state"])
    trainer = GRPOTrainer(model, job["trainer_config"])
    assert trainer.distributed
    assert trainer.world_size == 2
    stats = trainer.train_step(1, job["per_rank"][rank])
    if rank == 0:
        with open(out_file, "wb") as f:
            pickle.dump({"state": model.state_dict(), "stats": stats}, f)
    # The DDP wrapper goes before the group it holds; both ranks reach the barrier before either
    # tears gloo down (destroying the group while the peer still uses it aborts the process:
    # "terminate called without an active exception").
    del trainer, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown of torch's C++ statics, which once aborted a rank (SIGABRT
    # in CI) after everything above had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
