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
    # the Trainer's two param groups (create_optimizer: decay, then no decay), as memfit simulates them; ZeRO-1/2
    # flattens and partitions each group on its own
    from memfit.sim.optimizers import decay_parameter_names

    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay]},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    with memory_budget(1 << 40, count=[model]) as budget:
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=groups)
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
    per_rank = {rank: d["peak_allocated_bytes"] - 512 for d in r.ranks for rank in d["ranks"]}
    live = peak = 0
    init = None
    for e in r.sim.trace:
        if init is None and e.phase != "setup":
            init = live
        live += round_size(e.size_bytes) if e.action == "alloc" else -round_size(e.size_bytes)
        peak = max(peak, live)
    # the simulation is of a Trainer, whose running loss (`tr_loss = torch.tensor(0.0)` on the device, one 512-byte
    # block from the setup on) this bare DeepSpeed loop does not have
    return {"init": init - 512, "final": live - 512, "peak": peak - 512, "per_rank": per_rank}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_emulation_matches_real_deepspeed(stage):
    """The worker passes the Trainer's two param groups (decay / no decay), as memfit simulates. Measured (runs of
    this test's code): ZeRO-2 init exact (674304 B on both ranks), final 1126400 against 1123328; the backward peaks
    differ by rank, 2040832 / 2103296 B, against memfit's per-rank 2033152 / 2049536 (-0.4% / -2.6%): each rank's
    `grads_in_partition` holds the whole parameters its partition of each flat group cuts (rank 0 62336 elements,
    rank 1 66432; memfit's earlier single figure, one partition of ceil(T/N), was 2008576 for both). Tried and
    refuted: making the buffer when the ipg bucket holding the rank's first parameter is reduced (rank 0 would
    then peak at 1822208, -10.7%). ZeRO-3: init 705536 / final 1159680 / peak 2267648 B against 694272 / 1143296 /
    2229760 (1.6% / 1.4% / 1.7% under; its step holds one partition-sized temporary more than modelled). Bounds: 2%
    for what stays, 4% for each rank's ZeRO-2 peak, 3% for the ZeRO-3 peak."""
    real = _real(stage)
    pred = _predicted(stage)
    if stage == 2:
        assert [r["init"] for r in real] == [pred["init"]] * 2  # bit16 flat groups + fp32 master partition
        assert pred["per_rank"][1] > pred["per_rank"][0] and real[1]["peak"] > real[0]["peak"]  # the same rank larger
    for rank, r in enumerate(real):
        for key in ("init", "final"):
            assert abs(r[key] - pred[key]) <= r[key] * 0.02, (key, r[key], pred[key])
        expected = pred["per_rank"][rank] if stage == 2 else pred["peak"]
        assert abs(r["peak"] - expected) <= r["peak"] * (0.04 if stage == 2 else 0.03), (rank, r["peak"], expected)


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


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"stage3_max_reuse_distance": 0}, {"stage3_max_live_parameters": 30000},
                                   {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 30000}])
def test_zero3_live_parameters_against_real_deepspeed(extra):
    """Which parameters ZeRO-3 keeps gathered once its trace is complete (memfit.parallel.zero, ZeRO-3 live
    parameters). Measured, real peaks on both ranks: 2267648 B with DeepSpeed's defaults, and the same with
    `stage3_max_reuse_distance: 0`, with 40000, and with `stage3_max_live_parameters: 30000` (counting gathered
    non-persistent parameters after each module fetch: the whole 110592 elements, or 90112 with distance 0): the
    prefetcher runs ahead and keeps what it passed, and max_live_parameters gates only the prefetch, not the
    reuse-distance retention. With distance 0 and max_live 30000 together: 1960448 B (24576 elements gathered at
    most); with distance 0 and `stage3_prefetch_bucket_size: 0`: 1895424 B (16384: one module). memfit's rule
    before (retention capped by max_live, no run-ahead) gave 1868800 / 1907712 for the first two (-17.6% / -15.9%);
    now 2229760, 2229760 and 1907712 (-1.7%, -1.7%, -2.7%); the 3% bound of the default run."""
    real = _real(3, extra)
    pred = _predicted(3, extra)
    for r in real:
        assert abs(r["peak"] - pred["peak"]) <= r["peak"] * 0.03, (extra, r["peak"], pred["peak"])
