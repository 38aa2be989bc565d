"""memfit.parallel against REAL 2-process CPU runs (gloo) of DDP and FSDP2: each rank's live tensor bytes
(memory_budget's counting, rounded to 512; DTensors counted as their local shards; FSDP2's resize-based
frees and re-allocations seen through the same hook memfit's simulation uses) vs memfit's rank-0 trace."""

import json
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from memfit.testing import round_size

STEP_TENSORS_BYTES = 28 * 512
"""Adam's `step` counters: one scalar per parameter (the tiny GPT-2 has 28) that CUDA keeps on the host
(torch/optim/adam.py `_init_group`, not capturable / fused), which memfit leaves out of the GPU trace and
this CPU run counts. The rest of the gap is held under 1% of the peak (measured: DDP peak 26112 B of
2.73 MB above the prediction, final 15360 B; FSDP2 peak 2048 B of 1.86 MB, final 18432 B): scalars of the
CPU code paths (loss, grad-norm parts), not explained one by one."""


def _config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)


def _worker(rank, world, init, out, strategy):
    import contextlib

    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    from helpers import shard_budget
    from memfit.parallel import _dist_adapter as da

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config())
    ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[-1, -1] = 0  # memfit's simulated batch: one pad token
    res = {}
    accumulation, no_sync = ACCUMULATION.get(strategy, (1, False))
    strategy = strategy.split("+")[0]
    budget = shard_budget(1 << 40, count=[model])
    before = budget.live_bytes
    with budget, da.fsdp_storage_hooks(budget.on_alloc, budget.on_free), \
            da.fsdp1_storage_hooks(budget.on_alloc, budget.on_free):
        if strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif strategy.startswith("fsdp1"):  # FSDP1 as accelerate's prepare_model builds it (TRANSFORMER_BASED_WRAP)
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            model = da.fsdp1_wrap(model, block_classes={GPT2Block}, sharding_strategy=FSDP1[strategy][0], mesh=None,
                                  use_orig_params=FSDP1[strategy][1], cpu_offload=False, param_dtype=None,
                                  reduce_dtype=None)
        else:
            for block in model.transformer.h:
                da.fully_shard(block)
            da.fully_shard(model)
        res["wrap"] = budget.live_bytes - before
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        for _ in range(2):
            for micro in range(accumulation):
                # the Trainer's window: accelerate's no_sync (FSDP2 set_requires_gradient_sync(False), FSDP1
                # no_sync()) for all micro-steps but the last, unless sync_each_batch
                sync = not no_sync or micro == accumulation - 1
                with contextlib.nullcontext() if sync else \
                        da.fsdp_no_sync(model, 1 if strategy.startswith("fsdp1") else 2):
                    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        res["final"] = budget.live_bytes
        res["peak"] = budget.peak_bytes
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.destroy_process_group()


ACCUMULATION = {"fsdp+ga2_nosync": (2, True), "fsdp+ga2_sync": (2, False), "fsdp1+ga2_nosync": (2, True)}
"""Gradient accumulation runs: (micro-steps per optimizer step, no_sync for all but
the last); memfit's simulation of the same: `gradient_accumulation_steps` and `ParallelSetup.sync_each_batch`."""

FSDP1 = {"fsdp1": ("FULL_SHARD", True), "fsdp1_flat": ("FULL_SHARD", False), "fsdp1_zero2": ("SHARD_GRAD_OP", True)}
"""FSDP1 variants run for real: (sharding strategy, use_orig_params)."""


def _model_params():
    from transformers import GPT2LMHeadModel

    return list(GPT2LMHeadModel(_config()).parameters())


def _named_params():
    from transformers import GPT2LMHeadModel

    return list(GPT2LMHeadModel(_config()).named_parameters())


def _real(strategy, world=2):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), d, strategy), nprocs=world, join=True)
        return [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]


def _predicted(strategy, world=2):
    from memfit.parallel import ParallelSetup
    from memfit.parallel.rank import simulate_rank
    from memfit.train_setup import TrainSetup

    accumulation, no_sync = ACCUMULATION.get(strategy, (1, False))
    setup = TrainSetup.from_kwargs(_config(), task="causal-lm", per_device_train_batch_size=2, max_length=16,
                                   optim="adamw_torch", eval_strategy="no", weights_dtype="fp32",
                                   gradient_accumulation_steps=accumulation)
    strategy = strategy.split("+")[0]
    if strategy in FSDP1:
        strategy_name, orig = FSDP1[strategy]
        par = ParallelSetup(world_size=world, strategy="fsdp", fsdp_version=1, use_orig_params=orig,
                            reshard_after_forward=strategy_name == "FULL_SHARD", sync_each_batch=not no_sync)
    else:
        par = ParallelSetup(world_size=world, strategy=strategy, sync_each_batch=not no_sync)
    r = simulate_rank(setup, par)
    live = peak = 0
    for e in r.sim.trace:
        live += round_size(e.size_bytes) if e.action == "alloc" else -round_size(e.size_bytes)
        peak = max(peak, live)
    return {"peak": peak, "final": live, "buckets": sum(round_size(b) for b in (r.buffers[0]["sizes_bytes"] if r.buffers else []))}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp1", "fsdp1_flat", "fsdp1_zero2", *ACCUMULATION])
def test_per_rank_prediction_matches_a_real_gloo_run(strategy):
    """FSDP1 (memfit runs FullyShardedDataParallel itself under fake tensors), measured: FULL_SHARD with
    use_orig_params peaks 1859584 / 1850368 B on the two ranks (final 921600 / 912384) against 1857024 predicted
    (final 912896): rank 0 within 0.2%; the ranks differ by 9216 B because each rank's shard of the root
    FlatParameter cuts the original parameters differently (rank 0: a view of wte; rank 1: the rest of wte, wpe,
    ln_f), and Adam keeps one state per original-parameter view, each rounded to 512 B. use_orig_params=False:
    1843712 B on both ranks against 1847808 predicted (4096 B over, 0.2%). SHARD_GRAD_OP measures as FULL_SHARD on
    this 2-block model (1859584 / 1850368) against 1855488.

    Gradient accumulation 2 (ACCUMULATION), measured: FSDP2 with the first micro-step under no_sync peaks 2285056 B
    on both ranks against 2283008 predicted, with sync_each_batch 2082816 against 2080768 (the no-sync window holds
    202240 B more in both); FSDP1 FULL_SHARD under no_sync 2309632 / 2300416 against 2307072."""
    real = _real(strategy)
    if strategy.split("+")[0] not in ("fsdp1", "fsdp1_zero2"):  # FSDP1 with original-parameter views: see the docstring
        assert real[0]["final"] == real[1]["final"], real  # ranks agree
        # and their peaks agree up to one late-freed collective buffer: gloo's work object holds its tensors until
        # it is destroyed, which may happen on gloo's own thread after the next allocation (seen once under load:
        # rank 0 117 KB above rank 1); bounded by the largest unsharded FSDP unit / DDP bucket (one GPT2Block)
        block = round_size(4 * sum(p.numel() for n, p in _named_params() if n.startswith("transformer.h.0.")))
        assert abs(real[0]["peak"] - real[1]["peak"]) <= block, (real, block)
        real = sorted(real, key=lambda r: r["peak"])  # the rank without a late free: the deterministic figure
    pred = _predicted(strategy)
    if strategy.split("+")[0] in FSDP1:
        for key in ("peak", "final"):
            assert abs(real[0][key] - pred[key]) <= STEP_TENSORS_BYTES + real[0]["peak"] // 100, (key, real, pred)
        return
    if strategy == "ddp":
        # DDP's gradient buckets: exact. A rank may still hold the flat tensor of DDP's initial broadcast
        # (`_sync_module_states`: one flat tensor of all parameters, freed when the C++ side lets go of it: seen
        # on either rank or on both, in no fixed order), so each rank holds the buckets, or the buckets + that tensor
        flat = round_size(4 * sum(p.numel() for p in {id(p): p for p in _model_params()}.values()))
        assert all(r["wrap"] - pred["buckets"] in (0, flat) for r in real), ([r["wrap"] for r in real], pred, flat)
    # FSDP2's all-gather / reduce-scatter buffers of gloo's async work may be freed late on every rank (seen in a
    # CI run: both ranks 119 KB above the prediction): the peak may hold one extra unsharded block, no more
    late = block if strategy.startswith("fsdp") else 0
    for key in ("peak", "final"):
        gap = real[0][key] - pred[key]
        assert 0 <= gap <= STEP_TENSORS_BYTES + real[0]["peak"] // 100 + (late if key == "peak" else 0), \
            (key, real[0][key], pred[key])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_four_processes(strategy):
    """The same comparison with 4 gloo processes (2 and 4 processes): every rank holds the
    same final bytes, the peaks agree up to one late-freed collective buffer, and rank 0's prediction at world
    size 4 meets the rank without it within the bound above."""
    real = _real(strategy, world=4)
    assert len({r["final"] for r in real}) == 1, real
    block = round_size(4 * sum(p.numel() for n, p in _named_params() if n.startswith("transformer.h.0.")))
    peaks = sorted(r["peak"] for r in real)
    assert peaks[-1] - peaks[0] <= block, (real, block)
    pred = _predicted(strategy, world=4)
    low = min(real, key=lambda r: r["peak"])
    late = block if strategy == "fsdp" else 0  # one late-freed gloo buffer on every rank (see the 2-process test)
    for key in ("peak", "final"):
        gap = low[key] - pred[key]
        assert 0 <= gap <= STEP_TENSORS_BYTES + low["peak"] // 100 + (late if key == "peak" else 0), \
            (key, low[key], pred[key])
