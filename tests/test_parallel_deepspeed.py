"""memfit's ZeRO-2/3 emulation (memfit.parallel.zero) against REAL DeepSpeed 0.19 runs: 2 processes on
DeepSpeed's CPU accelerator (gloo), each rank's live tensor bytes counted as memory_budget counts them."""

import json
import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from memfit.testing import round_size

pytest.importorskip("deepspeed")

ZERO = {"reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686, "stage3_param_persistence_threshold": 640}
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def _config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)


def _worker(rank, world, port, out, stage, extra):
    os.environ.update(DS_ACCELERATOR="cpu", WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from transformers import GPT2LMHeadModel

    from memfit.testing import memory_budget

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config())
    ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[-1, -1] = 0
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "optimizer": OPTIMIZER,
           "zero_optimization": {"stage": stage, **ZERO, **extra}}
    res = {}
    with memory_budget(1 << 40, count=[model]) as budget:
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        res["init"] = budget.live_bytes
        for _ in range(2):
            loss = engine(input_ids=ids, attention_mask=mask, labels=ids).loss
            engine.backward(loss)
            engine.step()
        del loss
        res["final"] = budget.live_bytes
        res["peak"] = budget.peak_bytes
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(res, fh)
    # Leave together and skip the interpreter's teardown: a rank that exits while its peer still talks to it,
    # or C++ threads destroyed at exit, abort the process ("terminate called without an active exception",
    # SIGABRT, seen once in a full CI run after both results were complete).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real(stage, extra=None):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, _free_port(), d, stage, extra or {}), nprocs=2, join=True)
        return [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(2)]


def _predicted(stage, extra=None):
    from memfit.parallel import ParallelSetup, zero_settings_from_deepspeed
    from memfit.parallel.rank import simulate_rank
    from memfit.train_setup import TrainSetup

    setup = TrainSetup.from_kwargs(_config(), task="causal-lm", per_device_train_batch_size=2, max_length=16,
                                   optim="adamw_torch", eval_strategy="no", weights_dtype="fp32")
    z, _ = zero_settings_from_deepspeed({"optimizer": OPTIMIZER, "zero_optimization": {"stage": stage, **ZERO,
                                                                                        **(extra or {})}},
                                        hidden_size=64)
    r = simulate_rank(setup, ParallelSetup(world_size=2, strategy=f"zero{stage}", zero=z))
    live = peak = 0
    init = None
    for e in r.sim.trace:
        if init is None and e.phase != "setup":
            init = live
        live += round_size(e.size_bytes) if e.action == "alloc" else -round_size(e.size_bytes)
        peak = max(peak, live)
    # the simulation is of a Trainer, whose running loss (`tr_loss = torch.tensor(0.0)` on the device, one 512-byte
    # block from the setup on) this bare DeepSpeed loop does not have
    return {"init": init - 512, "final": live - 512, "peak": peak - 512}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_emulation_matches_real_deepspeed(stage):
    """Measured (/tmp runs of this test's code, deterministic across runs): ZeRO-2 init exact (674304 B), after
    the two steps 2560 B under (1125888 real), peaks of the two ranks 1836544 / 2102784 B against 2008576 predicted
    (the ranks differ: their partitions hold different parameters, whose gradients reach the ipg bucket at
    different times; memfit models rank 0's shard sizes and leaves out autograd's transient gradients). ZeRO-3:
    init 11264 B and final 15872 B under (705536 / 1159168 real), peak 2266624 B against 2229760 (1.6% under;
    its step holds one partition-sized temporary more than modelled, not the peak here). Bounds: 2% for what
    stays, 10% for each rank's peak."""
    real = _real(stage)
    pred = _predicted(stage)
    if stage == 2:
        assert [r["init"] for r in real] == [pred["init"]] * 2  # bit16 flat groups + fp32 master partition
    for r in real:
        for key in ("init", "final"):
            assert abs(r[key] - pred[key]) <= r[key] * 0.02, (key, r[key], pred[key])
        assert abs(r["peak"] - pred["peak"]) <= r["peak"] * 0.10, (r["peak"], pred["peak"])


@pytest.mark.slow
def test_zero_plus_plus_hpz_against_real_deepspeed():
    """ZeRO++ hpZ (`zero_hpz_partition_size: 2`, the two ranks as one node) in a real DeepSpeed run: each parameter
    gets its secondary partition (checked: 28 `ds_secondary_tensor`s of 56192 elements after init, none after the
    step). Measured: init 935936 B on both ranks (230400 more than without hpZ) against 915456 predicted (2.2% under:
    DeepSpeed's secondaries are 28 tensors, each rounded, memfit's one buffer); final 1159168 B, the same as without
    (invalidated by `_post_step`), against 1143296; peak 2267136 B, only 512 B above the run without hpZ, against
    2450944 predicted (8.1% over: the secondaries are not all alive at the real peak; not attributed). qwZ and qgZ
    need DeepSpeed's CUDA quantizer kernels (QuantizerBuilder) and do not run on the CPU accelerator."""
    extra = {"zero_hpz_partition_size": 2}
    real = _real(3, extra)
    pred = _predicted(3, extra)
    base = _predicted(3)
    assert pred["init"] - base["init"] > 200_000  # the secondary partitions (fp32 here) are in memfit's trace
    for r in real:
        assert abs(r["init"] - pred["init"]) <= r["init"] * 0.03, (r["init"], pred["init"])
        assert abs(r["final"] - pred["final"]) <= r["final"] * 0.02, (r["final"], pred["final"])
        assert abs(r["peak"] - pred["peak"]) <= r["peak"] * 0.10, (r["peak"], pred["peak"])
