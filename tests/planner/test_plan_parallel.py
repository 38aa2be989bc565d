"""`memfit plan --gpus NxGPU`: the fastest multi-GPU strategy that rank 0's simulation verifies fits, the
communication it costs, and the files to launch it."""

import json
from pathlib import Path

import pytest

from conftest import save_bert_config
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.estimator import estimate
from memfit.gpus.interconnect import Interconnect, interconnect_for
from memfit.planner import comm
from memfit.planner.launch import (ACCELERATE_FILE, DS_FILE, FSDP_FILE, HYBRID_VARIANTS, VARIANTS, Launch, launch_for,
                                   write_launch)
from memfit.planner.parallel_plan import plan_gpu_budget, plan_parallel
from memfit.train_setup import TrainSetup

MiB = 2**20


@pytest.fixture(scope="module")
def states_heavy_bert(tmp_path_factory):
    """82.7M parameters (fp32: 1.2 GiB of weights, gradients and Adam's state) and small activations: sharding
    matters."""
    return save_bert_config(tmp_path_factory, "bert1024", hidden_size=1024, num_hidden_layers=4,
                            num_attention_heads=16, intermediate_size=4096, vocab_size=30000)


def _setup(model, **kw):
    base = dict(model=model, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=64,
                eval_strategy="no")
    base.update(kw)
    return TrainSetup(**base)


# -- the communication model, by hand ---------------------------------------------------------------------------

def test_volumes_equal_the_ring_formulas_by_hand():
    S, P, n = 400 * MiB, 200 * MiB, 4
    (ar,) = comm.collectives(strategy="ddp", world_size=n, param_bytes=P, grad_bytes=S, ddp_bucket_bytes=25 * MiB)
    assert ar.op == "all_reduce" and ar.bytes_per_call == 600 * MiB and not ar.every_micro_step  # 2(n-1)/n x S
    assert ar.launches == 1 + 16  # the 1 MiB first bucket, then ceil(399 / 25) buckets of 25 MiB
    fsdp = comm.collectives(strategy="fsdp", world_size=n, param_bytes=P, grad_bytes=S, groups=5)
    assert [(c.op, c.bytes_per_call, c.every_micro_step) for c in fsdp] == [
        ("all_gather", 150 * MiB, True), ("all_gather", 150 * MiB, True), ("reduce_scatter", 300 * MiB, True)]
    assert len(comm.collectives(strategy="fsdp", world_size=n, param_bytes=P, grad_bytes=S,
                                reshard_after_forward=False)) == 2  # one all-gather: kept for the backward
    z1 = comm.collectives(strategy="zero1", world_size=n, param_bytes=P, grad_bytes=S)
    assert [(c.op, c.bytes_per_call, c.every_micro_step) for c in z1] == [
        ("reduce_scatter", 300 * MiB, False), ("all_gather", 150 * MiB, False)]
    z2 = comm.collectives(strategy="zero2", world_size=n, param_bytes=P, grad_bytes=S)
    assert z2[0].every_micro_step and not z2[1].every_micro_step
    z3 = comm.collectives(strategy="zero3", world_size=n, param_bytes=P, grad_bytes=S, offload_optimizer=True,
                          offload_param=True)
    host = [(c.op, c.bytes_per_call) for c in z3 if c.on_host_link]
    assert host == [("host_to_device", 50 * MiB), ("host_to_device", 50 * MiB), ("device_to_host", 100 * MiB)]
    assert comm.collectives(strategy="ddp", world_size=1, param_bytes=P, grad_bytes=S) == []


def test_step_time_by_hand_overlap_latency_and_the_network():
    ic = Interconnect("nvlink", 300.0, 31.5, 100.0, 4)
    (ar,) = comm.collectives(strategy="ddp", world_size=4, param_bytes=10**9, grad_bytes=10**9,
                             ddp_bucket_bytes=10**10)
    assert ar.bytes_per_call == 1_500_000_000 and ar.launches == 2
    t = comm.comm_step_time([ar], micro_compute_s=0.006, accumulation=3, optimizer_s=0.001, ic=ic, nodes=1)
    wire = 1.5e9 / (300e9 * 0.65)  # 7.692 ms over NVLink at the assumed 65 %
    exposed = (wire - 2 / 3 * 0.006) + 2 * 15e-6  # hidden behind the last backward (4 ms), plus two calls' latency
    assert t.comm_s == pytest.approx(wire + 2 * 15e-6)
    assert t.exposed_comm_s == pytest.approx(exposed)
    assert t.total_s == pytest.approx(3 * 0.006 + 0.001 + exposed)
    two_nodes = comm.comm_step_time([ar], micro_compute_s=0.006, accumulation=3, optimizer_s=0.001, ic=ic, nodes=2)
    assert two_nodes.comm_s == pytest.approx(1.5e9 / (100e9 / 8 * 0.65) + 2 * 15e-6)  # 100 Gb/s per node bounds it


def test_interconnect_defaults_and_errors():
    assert interconnect_for("A100-80GB").intra_node_gbps == 300.0  # 600 GB/s NVLink 3, both directions
    assert interconnect_for("A100-80GB", kind="pcie").intra_node_gbps == 31.5
    assert interconnect_for("T4").kind == "pcie" and interconnect_for("T4").pcie_gen == 3
    assert interconnect_for("generic-24GiB").note
    with pytest.raises(MemfitError, match="no NVLink figure"):
        interconnect_for("T4", kind="nvlink")
    with pytest.raises(MemfitError, match="Gb/s"):
        interconnect_for("T4", network_gbps=0)


# -- plans, verified by rank 0's simulation ----------------------------------------------------------------------

def test_a_model_that_fits_uses_ddp_with_launch_in_json(tiny_bert_dir, capsys):
    assert main(["plan", tiny_bert_dir, "--batch-size", "4", "--grad-accum", "2", "--max-length", "64",
                 "--eval-strategy", "no", "--gpus", "4xA100-40GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    chosen = out["candidates"][out["chosen"]]
    assert (chosen["variant"], chosen["fits"], out["world_size"]) == ("ddp", True, 4)
    assert out["global_batch"] == 32 and chosen["per_device_train_batch_size"] * chosen["gradient_accumulation_steps"] == 8
    assert out["launch"]["commands"][0] == "torchrun --nproc_per_node 4 train.py"
    assert "deepspeed" not in out["launch"]["training_args"] and "fsdp" not in out["launch"]["training_args"]
    ddp_step = chosen["step"]["total_s"]
    assert all(c["step"]["total_s"] >= ddp_step * 0.95 for c in out["candidates"] if c["fits"])  # none clearly faster


def test_a_model_that_does_not_fit_one_gpu_gets_a_sharded_plan_that_fits(states_heavy_bert):
    s = _setup(states_heavy_bert)
    gpu = "1800MiB"
    assert estimate(s, gpu=gpu).fits is False  # one GPU: Adam's state, gradients and weights do not fit
    r = plan_parallel(s, gpus=f"4x{gpu}")
    best = r.chosen_candidate
    assert best is not None and best.fits and best.variant != "ddp"
    assert r.simulations <= 8
    # the same per-rank simulation, from the launch file memfit's own reader reads, fits the same capacity
    v = next(x for x in VARIANTS if x.key == best.variant)
    from memfit.planner.launch import parallel_setup_for

    chosen = s.replace(**best.setup_changes)  # precision is searched too: the candidate's, not the setup's
    par = parallel_setup_for(v, world_size=4, nodes=1, hidden_size=1024, precision=chosen.precision)
    check = estimate(chosen, gpu=gpu, parallel=par, capacity_bytes=r.capacity_bytes)
    assert check.fits and check.peak_allocated_bytes == best.peak_allocated_bytes
    ddp = estimate(s.replace(**best.setup_changes), gpu=gpu, parallel=par.replace(strategy="ddp"),
                   capacity_bytes=r.capacity_bytes)
    assert ddp.fits is False  # what sharding bought
    assert (best.per_device_train_batch_size * best.gradient_accumulation_steps) * 4 == r.global_batch


def _estimate_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("strategy,engine_file", [("zero3", DS_FILE), ("fsdp", FSDP_FILE)])
def test_launch_files_parse_and_round_trip_to_the_same_estimate(states_heavy_bert, tmp_path, capsys, strategy,
                                                                engine_file):
    yaml = pytest.importorskip("yaml")
    common = [states_heavy_bert, "--batch-size", "4", "--grad-accum", "2", "--max-length", "64", "--eval-strategy", "no"]
    out = _estimate_json(capsys, ["plan", *common, "--gpus", "4x1800MiB", "--strategy", strategy, "--json",
                                  "--write-launch", str(tmp_path)])
    chosen = out["candidates"][out["chosen"]]
    assert sorted(Path(p).name for p in out["written"]) == sorted([engine_file, ACCELERATE_FILE, "training_args.json"])
    text = (tmp_path / engine_file).read_text()
    assert json.loads(text) == json.loads(out["launch"]["files"][engine_file])
    acc = yaml.safe_load((tmp_path / ACCELERATE_FILE).read_text())
    assert acc["num_processes"] == 4 and acc["num_machines"] == 1
    from accelerate.commands.config.config_args import load_config_from_file

    cluster = load_config_from_file(str(tmp_path / ACCELERATE_FILE))  # accelerate's own reader
    assert cluster.num_processes == 4
    b, a = chosen["per_device_train_batch_size"], chosen["gradient_accumulation_steps"]
    again = [*common[:1], "--batch-size", str(b), "--grad-accum", str(a), *common[5:], "--gpus", "4x1800MiB"]
    changes = dict(chosen["setup_changes"])
    changes.pop("per_device_train_batch_size", None), changes.pop("gradient_accumulation_steps", None)
    if changes.pop("gradient_checkpointing", False):
        again.append("--gradient-checkpointing")
    if "precision" in changes:  # searched across GPUs too (and with it FlashAttention-2)
        again += ["--precision", changes.pop("precision")]
    if "attn_implementation" in changes:
        again += ["--attn", changes.pop("attn_implementation")]
    if changes.pop("use_liger_kernel", False):
        again.append("--liger")
    assert changes == {}  # every change of the plan is passed on
    if strategy == "zero3":
        assert str(cluster.distributed_type).endswith("DEEPSPEED")
        assert cluster.deepspeed_config["deepspeed_config_file"] == DS_FILE
        flags = ["--deepspeed", str(tmp_path / DS_FILE)]
    else:
        assert str(cluster.distributed_type).endswith("FSDP") and cluster.fsdp_config["fsdp_version"] == 2
        assert cluster.fsdp_config["fsdp_reshard_after_forward"] == json.loads(text)["reshard_after_forward"]
        flags = ["--fsdp", out["launch"]["training_args"]["fsdp"], "--fsdp-config", str(tmp_path / FSDP_FILE)]
    est = _estimate_json(capsys, ["estimate", *again, *flags, "--json", "--no-cache"])
    assert est["parallel"]["strategy"] == strategy
    assert est["peak_allocated_bytes"] == chosen["peak_allocated_bytes"]


def test_gpu_budget_picks_the_fastest_kind_that_fits(tiny_bert_dir):
    s = _setup(tiny_bert_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_length=16)
    results, best = plan_gpu_budget(s, [(2, "T4"), (2, "A100-40GB"), (3, "A100-40GB")])
    assert isinstance(results[2], MemfitError) and "does not split" in str(results[2])  # 4 samples over 3 GPUs
    assert best == 1 and results[1].global_batch == results[0].global_batch == 4
    assert results[1].chosen_candidate.step.total_s < results[0].chosen_candidate.step.total_s


# -- launch commands and files ------------------------------------------------------------------------------------

def test_multi_node_commands_and_deepspeed_auto_values():
    v = next(x for x in VARIANTS if x.key == "zero3_offload_optimizer")
    L = launch_for(v, world_size=8, nodes=2, hidden_size=64, precision="bf16", training_args={})
    assert L.commands[0].startswith("torchrun --nnodes 2 --nproc_per_node 4 --node_rank $NODE_RANK")
    assert "--num_machines 2 --num_processes 8" in L.commands[1]
    ds = json.loads(L.files[DS_FILE])
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and ds["optimizer"]["type"] == "AdamW"
    assert ds["bf16"] == {"enabled": "auto"} and L.training_args == {"deepspeed": DS_FILE}


def test_fsdp_with_accumulation_syncs_each_micro_step_as_simulated():
    full = next(x for x in VARIANTS if x.key == "fsdp_full_shard")
    L = launch_for(full, world_size=4, nodes=1, hidden_size=64, precision="bf16", training_args={}, accumulation=4)
    assert L.training_args["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    assert L.training_args["fsdp"] == "full_shard auto_wrap" and json.loads(L.files[FSDP_FILE]) == {
        "version": 2, "reshard_after_forward": True, "cpu_offload": False}
    one = launch_for(full, world_size=4, nodes=1, hidden_size=64, precision="bf16", training_args={}, accumulation=1)
    assert "accelerator_config" not in one.training_args


def test_multi_node_plan_from_the_cli(tiny_bert_dir, capsys):
    assert main(["plan", tiny_bert_dir, "--batch-size", "2", "--max-length", "16", "--eval-strategy", "no",
                 "--gpus", "4xA100-40GB", "--nodes", "2", "--network-gbps", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["nodes"], out["interconnect"]["network_gbps"], out["global_batch"]) == (2, 200.0, 8)
    assert "--nnodes 2 --nproc_per_node 2" in out["launch"]["commands"][0]
    chosen = out["candidates"][out["chosen"]]
    assert chosen["fits"] and chosen["step"]["comm_s"] > 0


def test_write_launch_never_overwrites_silently(tmp_path):
    L = Launch({DS_FILE: "{}\n", ACCELERATE_FILE: "a: 1\n"}, {})
    (tmp_path / DS_FILE).write_text("mine")
    with pytest.raises(MemfitError, match="--force"):
        write_launch(tmp_path, L)
    assert (tmp_path / DS_FILE).read_text() == "mine" and not (tmp_path / ACCELERATE_FILE).exists()
    write_launch(tmp_path, L, force=True)
    assert (tmp_path / DS_FILE).read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [ACCELERATE_FILE, DS_FILE]  # no temporary file left


@pytest.mark.parametrize("flags,match", [
    (["--gpus", "A100"], "COUNTxGPU"),
    (["--gpus", "0xA100-40GB"], "COUNTxGPU"),
    (["--gpus", "4xNOPE-GPU"], "NOPE"),
    (["--gpus", "4xT4", "--world-size", "2"], "differ"),
    (["--gpus", "4xT4", "--gpu", "A100-40GB"], "both name GPUs"),
    (["--gpus", "6xT4", "--nodes", "4"], "multiple"),
    (["--gpus", "4xT4", "--deepspeed", "ds.json"], "chooses the engine"),
    (["--gpus", "4xT4", "--force"], "--write-launch"),
    (["--world-size", "4"], "needs the GPUs"),
    (["--gpu", "T4", "--strategy", "zero3"], "across GPUs"),
    (["--gpus", "4xT4", "--network-gbps", "-5"], "Gb/s"),
])
def test_bad_gpus_flags_are_one_line_errors(tiny_bert_dir, flags, match, capsys):
    assert main(["plan", tiny_bert_dir, "--max-length", "16", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_write_launch_refuses_an_existing_file_before_simulating(tiny_bert_dir, tmp_path, capsys):
    (tmp_path / ACCELERATE_FILE).write_text("mine")
    assert main(["plan", tiny_bert_dir, "--max-length", "16", "--gpus", "2xT4", "--write-launch", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err and (tmp_path / ACCELERATE_FILE).read_text() == "mine"


# -- precision and the optimizer, searched across GPUs -------------------------------------------------------------

@pytest.mark.slow
def test_only_mixed_precision_makes_zero3_fit_and_the_launch_carries_it(states_heavy_bert):
    """ZeRO-3 with checkpointing already on and one sample per GPU: in fp32 rank 0 needs about 940 MiB reserved,
    in bf16 (DeepSpeed casts the model: bf16 partitions and gathers, half the activations) about 680 MiB."""
    s = _setup(states_heavy_bert, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_length=512,
               gradient_checkpointing=True)
    r = plan_parallel(s, gpus="4x1450MiB", strategies=("zero3",))
    best = r.chosen_candidate
    assert best is not None and best.fits and best.variant == "zero3"  # on the GPUs, not the offload tier
    assert best.setup_changes["precision"] == "bf16"  # generic GPUs are compute capability 8.0
    v = next(x for x in VARIANTS if x.key == "zero3")
    from memfit.planner.launch import parallel_setup_for

    fp32 = parallel_setup_for(v, world_size=4, nodes=1, hidden_size=1024, precision="fp32")
    as_is = estimate(s.replace(**{k: x for k, x in best.setup_changes.items() if k not in ("precision",
                                                                                          "attn_implementation")}),
                     gpu="1450MiB", parallel=fp32, capacity_bytes=r.capacity_bytes)
    assert as_is.fits is False  # what precision bought
    assert r.launch.training_args["bf16"] is True and r.launch.training_args["deepspeed"] == DS_FILE
    ds = json.loads(r.launch.files[DS_FILE])
    assert ds["bf16"] == {"enabled": "auto"}  # transformers fills it from TrainingArguments(bf16=True)
    assert r.simulations <= 4


@pytest.mark.slow
def test_only_a_smaller_optimizer_state_makes_ddp_fit(states_heavy_bert):
    """DDP keeps AdamW's 8 bytes per parameter on every GPU (82.7M parameters: 631 MiB); no micro-batch,
    checkpointing or precision fits, 8-bit AdamW or Adafactor does (tried only then: another optimizer)."""
    s = _setup(states_heavy_bert)
    r = plan_parallel(s, gpus="4x2150MiB", strategies=("ddp",))
    best = r.chosen_candidate
    assert best is not None and best.fits and best.variant == "ddp"
    assert best.setup_changes["optim"] in ("adamw_bnb_8bit", "adafactor")
    same_optimizer = [c for c in r.candidates if "optim" not in c.setup_changes]
    assert same_optimizer and not any(c.fits for c in same_optimizer)
    # the leanest of the setup's optimizer (checkpointing, micro-batch 1) was simulated and did not fit
    assert any(c.setup_changes.get("gradient_checkpointing") and c.per_device_train_batch_size == 1
               and "precision" not in c.setup_changes for c in same_optimizer)
    assert r.launch.training_args["optim"] == best.setup_changes["optim"]
    if best.setup_changes["optim"] == "adamw_bnb_8bit":
        assert "# pip install bitsandbytes" in r.launch.code


def test_optimizers_the_engines_simulation_does_not_model_are_refused_with_a_reason():
    from memfit.planner.parallel_plan import _optimizer_refusal

    assert "AdamW's partitioned state" in _optimizer_refusal("zero2", "adamw_bnb_8bit")
    assert "DTensor" in _optimizer_refusal("fsdp", "adafactor")
    assert _optimizer_refusal("fsdp", "adamw_bnb_8bit") is None and _optimizer_refusal("ddp", "adafactor") is None


# -- the accelerate config the plan writes, read back ----------------------------------------------------------------

@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_every_variants_accelerate_config_reads_back_to_the_simulated_setup(tmp_path, precision, nodes):
    """memfit.parallel.accelerate_config reads what `accelerate launch --config_file` would launch: the same
    ParallelSetup the plan simulated, for every strategy and precision (the DeepSpeed JSON through the YAML's
    `deepspeed_config_file`, the Trainer's fp16/bf16 as `trainer_precision`)."""
    from memfit.parallel.accelerate_config import parallel_from_accelerate_config
    from memfit.planner.launch import parallel_setup_for

    args = {} if precision == "fp32" else {precision: True}
    for v in VARIANTS + (HYBRID_VARIANTS if nodes > 1 else ()):
        folder = tmp_path / v.key
        L = launch_for(v, world_size=8, nodes=nodes, hidden_size=64, precision=precision, training_args=dict(args))
        write_launch(folder, L)
        back = parallel_from_accelerate_config(folder / ACCELERATE_FILE, hidden_size=64,
                                               trainer_precision=None if precision == "fp32" else precision)
        want = parallel_setup_for(v, world_size=8, nodes=nodes, hidden_size=64, precision=precision)
        # sync_each_batch: no accelerate config key carries it (accelerate 1.15); the plan's TrainingArguments
        # `accelerator_config` does when it accumulates (test_fsdp_with_accumulation_syncs_each_micro_step...)
        assert back.parallel.replace(sync_each_batch=want.sync_each_batch) == want, v.key
        assert back.precision == precision and back.gradient_checkpointing is False


@pytest.mark.slow
def test_the_chosen_plans_accelerate_config_gives_the_same_per_rank_estimate(tiny_bert_dir, tmp_path):
    from memfit.parallel.accelerate_config import parallel_from_accelerate_config

    s = _setup(tiny_bert_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_length=16)
    r = plan_parallel(s, gpus="2xA100-40GB", strategies=("fsdp",))
    best = r.chosen_candidate
    assert best is not None and best.setup_changes.get("precision") == "bf16"  # A100: bf16 is modelled faster
    write_launch(tmp_path, r.launch)
    back = parallel_from_accelerate_config(tmp_path / ACCELERATE_FILE, hidden_size=64, trainer_precision="bf16")
    assert back.parallel.param_dtype == "bf16"  # accelerate's MixedPrecisionPolicy, as simulated
    again = estimate(s.replace(**best.setup_changes), gpu="A100-40GB", parallel=back.parallel,
                     capacity_bytes=r.capacity_bytes)
    assert again.peak_allocated_bytes == best.peak_allocated_bytes
    assert again.peak_reserved_bytes == best.peak_reserved_bytes


# -- `--allow` opt-ins across GPUs ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_only_lora_makes_ddp_fit_when_allowed(states_heavy_bert):
    """bf16 and Adafactor already (no precision or optimizer left to search): DDP's replicated weights, gradients
    and buckets do not fit 4 x 1650 MiB at any micro-batch; LoRA's frozen base does, and only with `--allow lora`."""
    s = _setup(states_heavy_bert, precision="bf16", optim="adafactor", compute_capability=(8, 0))
    r = plan_parallel(s, gpus="4x1650MiB", strategies=("ddp",), allow=("lora",))
    best = r.chosen_candidate
    assert best is not None and best.fits and best.setup_changes["lora_r"] == 16
    same_method = [c for c in r.candidates if "lora_r" not in c.setup_changes]
    assert len(same_method) == 2 and not any(c.fits for c in same_method)  # the largest micro-batch, the leanest
    assert any("get_peft_model" in line for line in r.launch.code)  # the single-GPU remedy's change
    assert r.simulations <= 5


def test_qlora_is_searched_sharded_and_offload_is_an_error(tiny_bert_dir, capsys):
    from memfit.planner.parallel_plan import _refusal, _sharded_qlora

    q = {"load_in_4bit": True, "lora_r": 16, "bnb_4bit_compute_dtype": "bf16"}
    assert all(_refusal(s, q) is None for s in ("ddp", "fsdp", "zero3"))
    # sharded: the 4-bit storage in the compute dtype, no kbit prep (peft's FSDP-QLoRA guide, TRL's sharded QLoRA)
    assert _sharded_qlora("fsdp", q) == {**q, "bnb_4bit_quant_storage": "bfloat16", "kbit_prep": False}
    assert _sharded_qlora("zero3", {**q, "bnb_4bit_compute_dtype": "fp16"})["bnb_4bit_quant_storage"] == "float32"
    assert _sharded_qlora("ddp", q) == q and _sharded_qlora("fsdp", {"lora_r": 16}) == {"lora_r": 16}
    assert main(["plan", tiny_bert_dir, "--max-length", "16", "--gpus", "2xT4", "--allow", "offload"]) == 2
    err = capsys.readouterr().err.strip()
    assert "engines' own CPU offload" in err and len(err.splitlines()) == 1
    assert main(["plan", tiny_bert_dir, "--max-length", "16", "--gpus", "2xT4", "--allow", "nope"]) == 2
    assert "cannot allow `nope`" in capsys.readouterr().err


# -- hybrid sharding over several nodes ---------------------------------------------------------------------------

def test_hybrid_volumes_and_times_by_hand():
    S, P, n, g = 400 * MiB, 200 * MiB, 8, 4
    hsdp = comm.collectives(strategy="fsdp", world_size=n, param_bytes=P, grad_bytes=S, hybrid=True, gpus_per_node=g)
    assert [(c.op, c.scope, c.bytes_per_call) for c in hsdp] == [
        ("all_gather", "node", 150 * MiB), ("all_gather", "node", 150 * MiB),  # (g-1)/g P, forward and backward
        ("reduce_scatter", "node", 300 * MiB),  # (g-1)/g S
        ("all_reduce", "across_nodes", 100 * MiB)]  # 2 (m-1)/m x S/g, m = 2 nodes
    assert hsdp[-1].concurrent == 4 and all(c.every_micro_step for c in hsdp)
    hpz = comm.collectives(strategy="zero3", world_size=n, param_bytes=P, grad_bytes=S, hybrid=True, gpus_per_node=g)
    assert [(c.op, c.scope, c.bytes_per_call) for c in hpz] == [
        ("reduce_scatter", "world", 350 * MiB), ("all_gather", "world", 175 * MiB),  # (n-1)/n
        ("all_gather", "node", 150 * MiB)]  # hpZ: the backward's gather within the node
    ic = Interconnect("nvlink", 300.0, 31.5, 100.0, 4)
    t = comm.comm_step_time(hsdp, micro_compute_s=0.0, accumulation=1, optimizer_s=0.0, ic=ic, nodes=2)
    node, net = 300e9 * 0.65, 100e9 / 8 / 4 * 0.65  # the node's 4 replicate groups share its 100 Gb/s
    assert t.comm_s == pytest.approx(600 * MiB / node + 100 * MiB / net + 4 * 15e-6)
    flat = comm.collectives(strategy="fsdp", world_size=n, param_bytes=P, grad_bytes=S)
    flat_s = comm.comm_step_time(flat, micro_compute_s=0.0, accumulation=1, optimizer_s=0.0, ic=ic, nodes=2).comm_s
    # flat: (n-1)/n of P twice and of S, every ring bounded by the node's 100 Gb/s (one crossing per ring)
    assert flat_s == pytest.approx(700 * MiB / (100e9 / 8 * 0.65) + 3 * 15e-6) and flat_s > 1.5 * t.comm_s
    with pytest.raises(ValueError, match="hybrid"):
        comm.collectives(strategy="zero2", world_size=n, param_bytes=P, grad_bytes=S, hybrid=True, gpus_per_node=g)


@pytest.mark.slow
def test_two_nodes_plan_offers_hsdp_and_writes_its_2d_mesh(states_heavy_bert, tmp_path):
    """82.7M parameters over 2 nodes x 4 A100 joined by 100 Gb/s: the flat all-gathers cross the network every
    micro-step (about 36 ms for shard_grad_op's one), HSDP's stay on NVLink and only the gradient shard's all-reduce
    crosses (about 20 ms): HSDP is the fastest FSDP2 candidate."""
    from memfit.parallel.accelerate_config import parallel_from_accelerate_config

    s = _setup(states_heavy_bert, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_length=16,
               precision="bf16", compute_capability=(8, 0))
    r = plan_parallel(s, gpus="8xA100-40GB", nodes=2, strategies=("fsdp",))
    best = r.chosen_candidate
    assert best is not None and best.variant == "fsdp_hybrid" and best.strategy == "FSDP2 HSDP"
    flat = [c for c in r.candidates if c.variant.startswith("fsdp_") and c.variant != "fsdp_hybrid"]
    assert all(c.step.comm_s > best.step.comm_s for c in flat)  # its all-gathers stay in the node
    assert [c["scope"] for c in best.collectives][-1] == "across_nodes"
    assert r.launch.commands == [next(c for c in r.launch.commands if c.startswith("accelerate launch"))]
    write_launch(tmp_path, r.launch)
    from accelerate.commands.config.config_args import load_config_from_file

    cluster = load_config_from_file(str(tmp_path / ACCELERATE_FILE))  # accelerate's own reader takes the 2-D mesh
    assert cluster.parallelism_config == {"parallelism_config_dp_replicate_size": 2,
                                          "parallelism_config_dp_shard_size": 4}
    back = parallel_from_accelerate_config(tmp_path / ACCELERATE_FILE, hidden_size=1024, trainer_precision="bf16")
    assert back.parallel.hybrid_shard and back.parallel.shard_size == 4
    again = estimate(s.replace(**best.setup_changes), gpu="A100-40GB", parallel=back.parallel,
                     capacity_bytes=r.capacity_bytes)
    assert again.peak_allocated_bytes == best.peak_allocated_bytes


def test_one_node_or_a_fast_network_gets_no_hybrid_candidates():
    from memfit.planner.parallel_plan import _network_bound

    ic = interconnect_for("A100-80GB", network_gbps=100)
    assert _network_bound(ic, 2) and not _network_bound(ic, 1)
    assert not _network_bound(interconnect_for("T4", network_gbps=1600), 2)  # PCIe 3 slower than the network
