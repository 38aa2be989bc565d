"""Ranks agree: rank 0's plan everywhere, the largest chunk count everywhere (gloo, 2 CPU processes)."""

import os
import tempfile

import torch.multiprocessing as mp

from memfit.fit_distributed import agree, agree_max, is_distributed


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        plan = agree({"per_device_train_batch_size": 4 + rank})  # ranks would disagree on their own
        chunks = agree_max(1 + 3 * rank)
        with open(os.path.join(out_dir, f"{rank}.txt"), "w") as fh:
            fh.write(f"{is_distributed()} {plan['per_device_train_batch_size']} {chunks}")
    finally:
        dist.destroy_process_group()


def test_ranks_agree():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        results = [open(os.path.join(d, f"{r}.txt")).read() for r in range(2)]
    assert results == ["True 4 4", "True 4 4"]


def test_single_process_is_a_no_op():
    assert not is_distributed()
    assert agree({"a": 1}) == {"a": 1} and agree_max(3) == 3
