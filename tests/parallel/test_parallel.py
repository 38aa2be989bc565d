"""memfit.parallel: settings, DeepSpeed's "auto", ZeRO rules vs DeepSpeed's own estimators, DDP buckets."""

import json
import re

import pytest

from memfit.errors import MemfitError
from memfit.parallel import ParallelSetup, parallel_from_fsdp_args, parse_gpus, zero_settings_from_deepspeed
from memfit.parallel.nccl import nccl_buffer_bytes
from memfit.parallel.zero import ParamInventory, deepspeed_model_states_bytes, zero_buffers


def test_deepspeed_auto_is_resolved_as_transformers_does():
    cfg = {"bf16": {"enabled": "auto"}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"}}}
    z, notes = zero_settings_from_deepspeed(cfg, hidden_size=1024, precision="bf16")
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (1024**2, int(0.9 * 1024**2), 10240)
    assert z.dtype == "bf16" and z.offload_optimizer and z.offload_param and z.overlap_comm  # stage 3 default
    z2, _ = zero_settings_from_deepspeed({"zero_optimization": {"stage": 2}}, hidden_size=None)
    assert (z2.reduce_bucket_size, z2.overlap_comm, z2.dtype) == (int(5e8), False, "fp32")  # DeepSpeed's defaults


@pytest.mark.parametrize("cfg,match", [
    ({"zero_optimization": {"stage": 4}}, "must be 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, "no `hidden_size`"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs stage 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "nvme"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, "non-negative"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "both"),
])
def test_bad_deepspeed_configs_are_one_line_errors(cfg, match):
    with pytest.raises(MemfitError, match=match) as err:
        zero_settings_from_deepspeed(cfg, hidden_size=None)
    assert "\n" not in str(err.value)


def test_deepspeed_file_errors(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(MemfitError, match="not valid JSON"):
        zero_settings_from_deepspeed(bad, hidden_size=8)
    with pytest.raises(MemfitError, match="does not exist"):
        zero_settings_from_deepspeed(tmp_path / "missing.json", hidden_size=8)
    latin = tmp_path / "latin.json"
    latin.write_bytes('{"zero_optimization": {"stage": 2}, "note": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(MemfitError, match="not UTF-8"):  # was a UnicodeDecodeError traceback
        zero_settings_from_deepspeed(latin, hidden_size=8)


def test_fsdp_training_args():
    p, _ = parallel_from_fsdp_args("shard_grad_op auto_wrap offload", {"fsdp_version": 2}, world_size=8, nodes=2)
    assert (p.strategy, p.reshard_after_forward, p.cpu_offload, p.gpus_per_node) == ("fsdp", False, True, 4)
    p, notes = parallel_from_fsdp_args(True, {"reshard_after_forward": "true", "activation_checkpointing": True,
                                              "mixed_precision_policy": {"param_dtype": "bfloat16"}})
    assert p.reshard_after_forward and p.param_dtype == "bf16" and any("checkpointing" in n for n in notes)
    for bad, match in (("hybrid_shard", "FSDP1-only"), ("full_shard sideways", "not one of")):
        with pytest.raises(MemfitError, match=match):
            parallel_from_fsdp_args(bad)
    with pytest.raises(MemfitError, match="version"):
        parallel_from_fsdp_args("full_shard", {"version": 3})


def test_parallel_setup_errors():
    assert parse_gpus("8xA100-80GB") == (8, "A100-80GB")
    for kwargs, match in (({"world_size": 0}, "at least 1"), ({"world_size": 6, "nodes": 4}, "multiple"),
                          ({"strategy": "zero4"}, "not one of"), ({"bucket_cap_mb": -1}, "positive")):
        with pytest.raises(MemfitError, match=match):
            ParallelSetup(**kwargs)
    with pytest.raises(MemfitError, match="COUNTxGPU"):
        parse_gpus("A100")


@pytest.mark.parametrize("gpus_per_node,nodes", [(1, 1), (8, 1), (8, 8)])
def test_deepspeed_estimators_are_reproduced(gpus_per_node, nodes, capsys):
    """DeepSpeed's own functions (real, on the CPU) against memfit's copy of their formulas."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from transformers import GPT2Config, GPT2LMHeadModel
    import torch

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64))
    from memfit.parallel.rank import param_inventory

    inv = param_inventory(model)
    for off in (True, False):
        assert deepspeed_model_states_bytes(2, inv, gpus_per_node=gpus_per_node, nodes=nodes, offload_optimizer=off) == \
            estimate_zero2_model_states_mem_needs(inv.total_params, gpus_per_node, nodes, cpu_offload=off)
        for off_p in ((True, False) if off else (False,)):
            for zi in (True, False):
                assert deepspeed_model_states_bytes(3, inv, gpus_per_node=gpus_per_node, nodes=nodes, offload_optimizer=off,
                                                    offload_param=off_p, zero_init=zi) == \
                    estimate_zero3_model_states_mem_needs(inv.total_params, inv.largest_layer_params, gpus_per_node, nodes,
                                                          off, off_p, zi)[:2]
    # the `_all_live` entry point reads the model itself: same counts as memfit's inventory
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
    printed = capsys.readouterr().out
    total_m, largest_m = map(int, re.search(r"Model with (\d+)M total params, (\d+)M largest", printed).groups())
    assert (total_m, largest_m) == (int(inv.total_params / 1e6), int(inv.largest_layer_params / 1e6))
    gpu_gb = float(re.findall(r"\|\s+([\d.]+)GB \| offload_param=none, offload_optimizer=none, zero_init=1", printed)[0])
    ours = deepspeed_model_states_bytes(3, inv, gpus_per_node=gpus_per_node, nodes=nodes, offload_optimizer=False)[1]
    assert round(ours / 2**30, 2) == gpu_gb


def test_zero_buffers_partition_by_world_size():
    inv = ParamInventory(total_params=8_000_000, trainable_params=8_000_000, largest_layer_params=1_000_000,
                         largest_param_numel=1_000_000, persistent_params=0)
    z2, _ = zero_settings_from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}},
                                         hidden_size=None)
    by = {b.name: b for b in zero_buffers(z2, inv, 8)}
    assert by["fp32 master partition"].size_bytes == 4 * 1_000_000
    assert by["Adam exp_avg + exp_avg_sq"].size_bytes == 8 * 1_000_000
    assert by["grads_in_partition"].size_bytes == 2 * 1_000_000 and by["ipg buffer x1"].size_bytes == 2000
    z3, _ = zero_settings_from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
                                         hidden_size=None)
    assert {b.device for b in zero_buffers(z3, inv, 8) if b.category == "optimizer_state"} == {"host"}


def test_nccl_buffers():
    assert nccl_buffer_bytes(1) == 0
    assert nccl_buffer_bytes(8) == 16 * 2 * 4 * 2**20
    assert nccl_buffer_bytes(8, env={"NCCL_BUFFSIZE": str(2**20)}) == 16 * 2 * 2**20
    with pytest.raises(MemfitError, match="NCCL_BUFFSIZE"):
        nccl_buffer_bytes(8, env={"NCCL_BUFFSIZE": "lots"})


def test_ddp_buckets_follow_ddp_assignment():
    import torch
    from memfit.parallel.rank import ddp_bucket_bytes

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4096))
    sizes = ddp_bucket_bytes(model, None)  # 1 MiB first bucket, then up to 25 MiB
    assert sum(sizes) == sum(p.numel() * 4 for p in model.parameters()) and len(sizes) == 2
    assert ddp_bucket_bytes(model, 100.0) == [sum(sizes)]


def test_hybrid_shard_shards_within_a_node_only():
    """FSDP2 HSDP and FSDP1 HYBRID_SHARD on 4 ranks over 2 nodes hold the shards of a 2-rank group (run by FSDP's
    own code on a 2-D fake mesh): the same optimizer state as full sharding over 2 ranks, more than over 4."""
    from transformers import GPT2Config

    from memfit.parallel.fsdp import simulate_fsdp
    from memfit.train_setup import TrainSetup

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    setup = TrainSetup.from_kwargs(cfg, task="causal-lm", per_device_train_batch_size=2, max_length=16,
                                   optim="adamw_torch", eval_strategy="no", weights_dtype="fp32")

    def state(**kw):
        trace = simulate_fsdp(setup, ParallelSetup(strategy="fsdp", **kw)).trace
        return sum(e.size_bytes if e.action == "alloc" else -e.size_bytes for e in trace if e.category == "optimizer_state")

    for version in (1, 2):
        hybrid = state(world_size=4, nodes=2, hybrid_shard=True, fsdp_version=version)
        assert hybrid == state(world_size=2, fsdp_version=version) > state(world_size=4, fsdp_version=version)
    p = ParallelSetup(world_size=16, nodes=2, strategy="fsdp", hybrid_shard=True, fsdp_version=1,
                      reshard_after_forward=False)
    assert (p.shard_size, p.fsdp1_sharding_strategy) == (8, "_HYBRID_SHARD_ZERO2")


def test_zero2_partition_buffer_per_rank():
    """stage_1_and_2.py: each group padded to a multiple of 2N and split evenly; a parameter cut by a boundary counts
    whole in both ranks' grads_in_partition."""
    from memfit.parallel.zero import zero2_rank_layouts

    # group of 10 + 6 (padded to 16: partitions [0, 8) and [8, 16)): the 10 straddles
    assert [x.grads_in_partition_numel for x in zero2_rank_layouts([[10, 6]], 2)] == [10, 16]
    # two groups partitioned on their own; 4 ranks, 7 elements padded to 8 (partitions of 2)
    assert [x.grads_in_partition_numel for x in zero2_rank_layouts([[8], [3, 4]], 4)] == [8 + 3, 8 + 3 + 4, 8 + 4, 8 + 4]
