"""`--accelerate-config FILE.yaml` and `parallel_from_accelerate_config`: each file is also launched through
accelerate's own code (`_validate_launch_command`, `prepare_multi_gpu_env`, then the FSDP / DeepSpeed plugin built
from that environment, as the launched script builds it), and memfit's reading must agree with what accelerate gets."""

import json
import os
from unittest import mock

import pytest
import yaml

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.parallel.accelerate_config import _KNOWN_KEYS, parallel_from_accelerate_config

pytest.importorskip("accelerate")

BASE = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0, "main_training_function": "main",
        "rdzv_backend": "static", "same_network": True, "use_cpu": False, "num_machines": 1, "num_processes": 4}

FILES = {
    "fsdp2_bf16": {"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {
        "fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_offload_params": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}},
    "fsdp2_shard_grad_op_offload": {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": {
        "fsdp_version": 2, "fsdp_reshard_after_forward": False, "fsdp_offload_params": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}},
    # FSDP1 as `accelerate config` writes it: the strategy under fsdp_reshard_after_forward, which FSDP1 does not use
    "fsdp1_questionnaire": {"distributed_type": "FSDP", "mixed_precision": "fp16", "fsdp_config": {
        "fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP", "fsdp_use_orig_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch": "BACKWARD_PRE"}},
    "fsdp1_hybrid_two_nodes": {"distributed_type": "FSDP", "num_machines": 2, "num_processes": 8,
                               "main_process_ip": "10.0.0.1", "main_process_port": 29500, "fsdp_config": {
                                   "fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}},
    "fsdp_no_policy": {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}},
    "zero3_offload": {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "deepspeed_config": {
        "zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu",
        "gradient_accumulation_steps": 4, "zero3_init_flag": True}},
    "zero_default_stage": {"distributed_type": "DEEPSPEED", "deepspeed_config": {"offload_optimizer_device": "none"}},
    "ddp": {"distributed_type": "MULTI_GPU", "mixed_precision": "fp16"},
}


def _write(tmp_path, name, body):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**BASE, **body}))
    return path


def _launched_env(path):
    """The environment `accelerate launch --config_file path` gives the training script (accelerate's own code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # commands/launch.py launch_command, then deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return prepare_deepspeed_cmd_env(args)[1], args
    return prepare_multi_gpu_env(args), args


def test_known_keys_are_accelerates():
    from accelerate.commands.config.config_args import ClusterConfig

    assert _KNOWN_KEYS == set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}


@pytest.mark.parametrize("name", sorted(FILES))
def test_reads_as_accelerate_launches_it(name, tmp_path):
    path = _write(tmp_path, name, FILES[name])
    ours = parallel_from_accelerate_config(path, hidden_size=64)
    env, args = _launched_env(path)
    par = ours.parallel
    assert (par.world_size, par.nodes) == (args.num_processes, args.num_machines)
    assert ours.precision == {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}[env["ACCELERATE_MIXED_PRECISION"]]
    # FSDP1 sync_module_states (launch default true; forced by cpu_ram_efficient_loading) makes the plugin look for a
    # GPU; neither changes the training memory memfit models
    env = {**env, "FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}
    with mock.patch.dict(os.environ, env, clear=False):
        if env.get("ACCELERATE_USE_FSDP") == "true":
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
            assert (par.strategy, par.fsdp_version) == ("fsdp", plugin.fsdp_version)
            if plugin.fsdp_version == 1:  # what Accelerator.prepare_model passes
                strategy = plugin.sharding_strategy or plugin.reshard_after_forward
                assert par.fsdp1_sharding_strategy == strategy.name
                assert par.cpu_offload == plugin.cpu_offload.offload_params
                assert par.use_orig_params == plugin.use_orig_params
            else:
                assert par.reshard_after_forward == plugin.reshard_after_forward
                assert par.cpu_offload == (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy")
            assert (par.auto_wrap == "none") == (plugin.auto_wrap_policy is None)
        elif env.get("ACCELERATE_USE_DEEPSPEED") == "true":
            from accelerate.utils import DeepSpeedPlugin

            from memfit.parallel import zero_settings_from_deepspeed

            plugin = DeepSpeedPlugin()
            plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])  # as TrainingArguments does
            theirs, _ = zero_settings_from_deepspeed(plugin.deepspeed_config, hidden_size=64, precision=ours.precision)
            assert par.zero == theirs and par.strategy == f"zero{plugin.zero_stage}"
            gas = plugin.deepspeed_config["gradient_accumulation_steps"]
            assert ours.gradient_accumulation_steps == (gas if isinstance(gas, int) else None)
        else:
            assert par.strategy == "ddp"


def test_fsdp1_notes_the_strategy_accelerate_does_not_use(tmp_path):
    acc = parallel_from_accelerate_config(_write(tmp_path, "q", FILES["fsdp1_questionnaire"]))
    assert acc.parallel.fsdp1_sharding_strategy == "FULL_SHARD"
    assert any("fsdp_sharding_strategy: SHARD_GRAD_OP" in n for n in acc.notes)
    hyb = parallel_from_accelerate_config(_write(tmp_path, "h", FILES["fsdp1_hybrid_two_nodes"])).parallel
    assert hyb.hybrid_shard and hyb.shard_size == 4 and hyb.fsdp_version == 1  # fsdp_version absent: 1


def test_deepspeed_config_file_with_auto(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": "auto"}, "gradient_accumulation_steps": 8,
                              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                    "zero_hpz_partition_size": 4}}))
    acc = parallel_from_accelerate_config({**BASE, "distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                                           "deepspeed_config": {"deepspeed_config_file": str(ds)}}, hidden_size=64)
    z = acc.parallel.zero
    assert (z.stage, z.dtype, z.reduce_bucket_size, z.hpz_partition_size) == (3, "bf16", 64 * 64, 4)
    assert acc.gradient_accumulation_steps == 8 and acc.deepspeed_config_file == str(ds)


def test_fsdp2_hybrid_from_parallelism_config():
    acc = parallel_from_accelerate_config({**BASE, "num_processes": 16, "num_machines": 2, "distributed_type": "FSDP",
                                           "fsdp_config": {"fsdp_version": 2},
                                           "parallelism_config": {"parallelism_config_dp_replicate_size": 2,
                                                                  "parallelism_config_dp_shard_size": 8}})
    assert acc.parallel.hybrid_shard and acc.parallel.shard_size == 8 and acc.parallel.fsdp_version == 2


@pytest.mark.parametrize("body,match", [
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 3}}, "must be 1 or 2"),
    ({"distributed_type": "XLA"}, "not modelled"),
    ({"distributed_type": "FSDP", "colour": "blue"}, "`colour`"),
    ({"mixed_precision": "bf16"}, "distributed_type"),
    ({"distributed_type": "MULTI_GPU", "num_processes": -1}, "num_processes"),
    ({"distributed_type": "MULTI_GPU", "num_processes": 6, "num_machines": 4}, "multiple"),
    ({"distributed_type": "MULTI_GPU", "mixed_precision": "fp8"}, "fp8"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "x.json", "zero_stage": 2}},
     "refuses both"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3, "offload_param_device": "disk"}},
     "none, cpu or nvme"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1, "fsdp_sharding_strategy": "SIDEWAYS"}},
     "SIDEWAYS"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}}, "SIZE_BASED_WRAP"),
    ({"distributed_type": "MULTI_GPU", "use_cpu": True}, "use_cpu"),
])
def test_bad_files_are_one_line_errors(body, match):
    with pytest.raises(MemfitError, match=match) as err:
        parallel_from_accelerate_config({**BASE, **body})
    assert "\n" not in str(err.value)


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: [FSDP\n")
    with pytest.raises(MemfitError, match="not valid YAML"):
        parallel_from_accelerate_config(bad)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(MemfitError, match="mapping"):
        parallel_from_accelerate_config(tmp_path / "list.yaml")
    with pytest.raises(MemfitError, match="does not exist"):
        parallel_from_accelerate_config(tmp_path / "missing.yaml")


def test_estimate_cli_with_an_accelerate_config(tiny_bert_dir, tmp_path, capsys):
    path = _write(tmp_path, "fsdp", FILES["fsdp2_bf16"])
    assert main(["estimate", tiny_bert_dir, "--batch-size", "2", "--max-length", "16", "--eval-strategy", "no",
                 "--gpu", "A100-80GB", "--accelerate-config", str(path), "--json", "--no-cache"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["parallel"]["strategy"], data["parallel"]["world_size"], data["parallel"]["param_dtype"]) == ("fsdp", 4, "bf16")
    assert data["setup"]["precision"] == "bf16"  # the file's mixed_precision, the Trainer's being unset
    assert main(["estimate", tiny_bert_dir, "--max-length", "16", "--accelerate-config", str(path),
                 "--strategy", "zero2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--accelerate-config and --strategy" in err and len(err.splitlines()) == 1
    assert main(["estimate", tiny_bert_dir, "--max-length", "16", "--accelerate-config", str(path),
                 "--world-size", "8"]) == 2
    assert "differ" in capsys.readouterr().err


def test_deepspeed_accumulation_from_the_file(tiny_bert_dir, tmp_path, capsys):
    path = _write(tmp_path, "z3", FILES["zero3_offload"])  # gradient_accumulation_steps: 4, bf16
    flags = ["estimate", tiny_bert_dir, "--max-length", "16", "--eval-strategy", "no", "--gpu", "A100-80GB",
             "--accelerate-config", str(path), "--no-cache"]
    assert main([*flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["gradient_accumulation_steps"] == 4 and data["parallel"]["strategy"] == "zero3"
    assert main([*flags, "--grad-accum", "2"]) == 2
    assert "differ" in capsys.readouterr().err
