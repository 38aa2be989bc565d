"""An accelerate config file (`accelerate config` output, `accelerate launch --config_file`) as memfit's settings.

Read as accelerate 1.15 reads and launches it:

* the file: `yaml.safe_load` (accelerate/commands/config/config_args.py `BaseConfig.from_yaml_file`), a
  `distributed_type` required, unknown top-level keys refused (`extra_keys`), `mixed_precision` absent ->
  `"no"` (`process_config`, then `_validate_launch_command`: `defaults.mixed_precision is None` -> "no");
* `num_processes` is the total over all machines (utils/launch.py `prepare_multi_gpu_env`:
  `nproc_per_node = num_processes // num_machines`); `-1` (the default for a cluster config) has to be
  given at launch (`_validate_launch_command`: "You need to manually pass in `--num_processes`");
* FSDP (`fsdp_config`, keys with the `fsdp_` prefix, passed to the launcher as `--fsdp_*` and to the plugin
  through `FSDP_*` variables: utils/launch.py): `fsdp_version` absent -> 1 (commands/launch.py
  `--fsdp_version` default "1"); FSDP2: `fsdp_reshard_after_forward` (default "true"); FSDP1: the strategy is
  `fsdp_sharding_strategy` (launch default FULL_SHARD), `fsdp_reshard_after_forward` is not used
  (setup.fsdp1_effective_strategy); `fsdp_offload_params` (default false), `fsdp_use_orig_params` (default
  true), `fsdp_activation_checkpointing` (default false), `fsdp_auto_wrap_policy` (absent: the plugin's
  `NO_WRAP`, `FullyShardedDataParallelPlugin.__post_init__`); `mixed_precision` becomes the FSDP policy
  (`set_mixed_precision`: param and reduce dtype; state.py); FSDP2 HSDP from `parallelism_config`
  (`parallelism_config_dp_replicate_size` x `parallelism_config_dp_shard_size`);
* DeepSpeed (`deepspeed_config`, `DeepSpeedPlugin.__post_init__`): without `deepspeed_config_file` the JSON
  accelerate builds (`zero_optimization.stage` = `zero_stage`, default 2; `offload_optimizer_device` /
  `offload_param_device`, default "none"; `gradient_accumulation_steps`), with it that file, and then
  none of those keys may be in the YAML (`_deepspeed_config_checks`); fp16/bf16 from `mixed_precision`
  (`DeepSpeedPlugin.set_mixed_precision`), `"auto"` bucket sizes as transformers fills them.

Pure Python (PyYAML): no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.files import read_user_text
from memfit.parallel.setup import (FSDP1_STRATEGIES, ParallelSetup, _auto_wrap, _bool_text, fsdp1_strategy,
                                   fsdp_parallel, read_json_file, zero_settings_from_deepspeed)

__all__ = ["AccelerateConfig", "parallel_from_accelerate_config", "read_accelerate_config"]

#: Top-level keys accelerate's loader accepts: `ClusterConfig` and `BaseConfig` fields
#: (accelerate/commands/config/config_args.py), plus the legacy `fp16` and `dynamo_backend` it converts.
_KNOWN_KEYS = {"compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
               "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
               "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
               "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16",
               "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm",
               "tpu_env", "dynamo_config", "fp16", "dynamo_backend"}

#: DeepSpeed keys `_deepspeed_config_checks` refuses next to `deepspeed_config_file`
#: (ACCELERATE_GRADIENT_ACCUMULATION_STEPS ... ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL, as YAML keys).
_DS_FILE_EXCLUSIVE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                      "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                      "zero3_save_16bit_model")

_PRECISION = {None: "fp32", "no": "fp32", "fp16": "fp16", "bf16": "bf16"}


@dataclass(frozen=True)
class AccelerateConfig:
    """What an accelerate config file sets for memfit."""

    parallel: ParallelSetup | None
    """None for `distributed_type: NO` (one process, no wrapper)."""
    precision: str
    """`fp32`, `fp16` or `bf16` (memfit's names for accelerate's `no`, `fp16`, `bf16`); for DeepSpeed the dtype it
    trains in (memfit.parallel.deepspeed_rules `deepspeed_precision`)."""
    gradient_checkpointing: bool = False
    """`fsdp_activation_checkpointing`: FSDP's checkpointing of each block (simulated as gradient checkpointing)."""
    gradient_accumulation_steps: int | None = None
    """DeepSpeed's `gradient_accumulation_steps` when the file sets it (DeepSpeed's engine then owns accumulation)."""
    deepspeed_config_file: str | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)


def read_accelerate_config(path: str | Path) -> dict[str, Any]:
    """The YAML mapping of an accelerate config file (`yaml.safe_load`), or a one-line MemfitError."""
    import yaml

    text = read_user_text(path, "accelerate config", "write one with `accelerate config`")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise MemfitError(f"accelerate config `{path}` is not valid YAML{where}; write it with `accelerate config`") from err
    except RecursionError as err:  # yaml's composer recurses per nesting level
        raise MemfitError(f"accelerate config `{path}` is nested too deeply to read; write it with `accelerate "
                          "config`") from err
    if not isinstance(data, dict):
        raise MemfitError(f"accelerate config `{path}` must hold a mapping of settings, not a {type(data).__name__}")
    return data


def _int(value: Any, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MemfitError(f"accelerate config `{key}` `{value!r}` must be a whole number of at least {low}")
    return value


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    sec = data.get(key)
    if sec is None:
        return {}
    if not isinstance(sec, dict):
        raise MemfitError(f"accelerate config `{key}` `{sec!r}` must be a mapping")
    return sec


def _world(data: dict[str, Any], world_size: int | None) -> int:
    n = data.get("num_processes")
    if n is None or n == -1:
        if world_size is None:
            raise MemfitError("the accelerate config sets no `num_processes` (accelerate asks for it at launch); "
                              "add `num_processes: N` (all GPUs of all machines) or pass --world-size N")
        return world_size
    n = _int(n, "num_processes", 1)
    if world_size is not None and world_size != n:
        raise MemfitError(f"--world-size / --gpus `{world_size}` and the accelerate config's `num_processes` `{n}` "
                          "differ; give one of them")
    return n


def _offload_device(value: Any, key: str) -> dict[str, str]:
    device = "none" if value is None else str(value).lower()
    if device not in ("none", "cpu", "nvme"):
        raise MemfitError(f"accelerate config `deepspeed_config.{key}` `{value}` is not none, cpu or nvme")
    return {"device": device}


def _deepspeed(ds: dict[str, Any], trainer_precision: str | None, file_precision: str, hidden_size: int | None,
               base: Path | None) -> tuple[Any, int | None, str | None, list[str]]:
    """ZeRO settings, the file's accumulation, its DeepSpeed JSON path and notes. The dtype is decided by
    memfit.parallel.deepspeed_rules `deepspeed_precision` from the Trainer's precision and the file's
    `mixed_precision` (`accelerate launch` passes it as ACCELERATE_MIXED_PRECISION)."""
    notes: list[str] = []
    file = ds.get("deepspeed_config_file")
    if file not in (None, "none"):
        clash = [k for k in _DS_FILE_EXCLUSIVE if k in ds]
        if clash:
            raise MemfitError(f"the accelerate config sets `deepspeed_config_file` and `{clash[0]}`; accelerate refuses "
                              "both (DeepSpeedPlugin._deepspeed_config_checks): move it into the DeepSpeed JSON")
        path = Path(str(file))
        if not path.is_absolute() and not path.exists() and base is not None and (base / path).exists():
            path = base / path  # accelerate opens it from the launch directory; memfit also looks next to the YAML
            notes.append(f"deepspeed_config_file `{file}` read from the accelerate config's folder")
        config = read_json_file(path, "DeepSpeed config")
        gas = config.get("gradient_accumulation_steps")
        gas = gas if isinstance(gas, int) and not isinstance(gas, bool) else None
        zero, more = zero_settings_from_deepspeed(config, hidden_size=hidden_size, precision=trainer_precision or "fp32",
                                                  launcher_precision=file_precision, via_accelerate=True,
                                                  source=f"`{file}`")
        return zero, gas, str(file), notes + more
    stage = ds.get("zero_stage", 2)  # DeepSpeedPlugin: ACCELERATE_DEEPSPEED_ZERO_STAGE default 2
    if stage == 0:
        raise MemfitError("accelerate config `deepspeed_config.zero_stage` `0` is DeepSpeed without ZeRO; memfit "
                          "models stages 1-3 (or use `distributed_type: MULTI_GPU` for DDP)")
    gas = ds.get("gradient_accumulation_steps")
    if gas is not None:
        gas = _int(gas, "deepspeed_config.gradient_accumulation_steps", 1)
    config = {"zero_optimization": {"stage": stage,
                                    "offload_optimizer": _offload_device(ds.get("offload_optimizer_device"),
                                                                         "offload_optimizer_device"),
                                    "offload_param": _offload_device(ds.get("offload_param_device"),
                                                                     "offload_param_device")}}
    # no fp16 / bf16 sections: DeepSpeedPlugin.set_mixed_precision adds them from mixed_precision
    zero, more = zero_settings_from_deepspeed(config, hidden_size=hidden_size, precision=trainer_precision or "fp32",
                                              launcher_precision=file_precision, via_accelerate=True)
    return zero, gas, None, notes + more


def _fsdp(fsdp_cfg: dict[str, Any], par_cfg: dict[str, Any], precision: str, world: int,
          nodes: int) -> tuple[ParallelSetup, bool]:
    cfg = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in fsdp_cfg.items()}
    notes: list[str] = []
    version = cfg.get("version", 1)  # commands/launch.py: --fsdp_version default "1"
    if str(version) not in ("1", "2"):
        raise MemfitError(f"accelerate config `fsdp_config.fsdp_version` `{version}` must be 1 or 2")
    version = int(version)
    auto_wrap = _auto_wrap(cfg, "NO_WRAP")
    if auto_wrap == "none":
        notes.append("fsdp_auto_wrap_policy NO_WRAP (or none given: accelerate's default): the whole model is one "
                     "FSDP unit, all-gathered at once")
    if precision != "fp32" and "mixed_precision_policy" not in cfg:  # FullyShardedDataParallelPlugin.set_mixed_precision
        cfg["mixed_precision_policy"] = precision
    checkpointing = _bool_text(cfg.pop("activation_checkpointing", False), "fsdp_activation_checkpointing")
    if checkpointing:
        notes.append("fsdp_activation_checkpointing: simulated as gradient checkpointing of each block")
    replicate = par_cfg.get("parallelism_config_dp_replicate_size", 1)
    shard = par_cfg.get("parallelism_config_dp_shard_size", None)
    for key in ("parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_sp_size"):
        if par_cfg.get(key, 1) not in (1, None):
            raise MemfitError(f"accelerate config `parallelism_config.{key}` `{par_cfg[key]}` (tensor / context "
                              "parallelism) is not modelled by memfit; leave it at 1")
    if version == 1:
        requested = cfg.get("sharding_strategy", "FULL_SHARD")  # commands/launch.py --fsdp_sharding_strategy default
        strategy = fsdp1_strategy(requested, "fsdp_sharding_strategy")
        ignored = cfg.get("reshard_after_forward")
        if ignored is not None and str(ignored).upper().lstrip("_") in FSDP1_STRATEGIES \
                and fsdp1_strategy(ignored, "fsdp_reshard_after_forward") != strategy:
            notes.append(f"FSDP1 runs `{strategy}` (fsdp_sharding_strategy, default FULL_SHARD): accelerate's plugin "
                         f"does not use fsdp_reshard_after_forward `{ignored}` for FSDP1; set "
                         f"`fsdp_sharding_strategy: {fsdp1_strategy(ignored)}` to get it")
        reshard, hybrid, no_shard = FSDP1_STRATEGIES[strategy]
        if replicate not in (1, None):
            raise MemfitError("accelerate config `parallelism_config` needs FSDP2 (`fsdp_version: 2`); with FSDP1 "
                              "use `fsdp_sharding_strategy: HYBRID_SHARD`")
    else:
        reshard = _bool_text(cfg.get("reshard_after_forward", True), "fsdp_reshard_after_forward")
        no_shard = False
        replicate = _int(replicate if replicate is not None else 1, "parallelism_config_dp_replicate_size", 1)
        hybrid = replicate > 1
        if hybrid:
            shard = _int(shard if shard is not None else world // replicate, "parallelism_config_dp_shard_size", 1)
            if replicate * shard != world:
                raise MemfitError(f"accelerate config dp_replicate_size `{replicate}` x dp_shard_size `{shard}` is "
                                  f"not num_processes `{world}`")
            if shard != world // nodes:
                raise MemfitError(f"accelerate config dp_shard_size `{shard}` is not the GPUs of one node "
                                  f"(`{world // nodes}`); memfit models hybrid sharding within each node")
    par = fsdp_parallel(version=version, reshard_after_forward=reshard, hybrid=hybrid, no_shard=no_shard, cfg=cfg,
                        world_size=world, nodes=nodes, auto_wrap=auto_wrap, notes=notes)
    return par, checkpointing


def parallel_from_accelerate_config(config: str | Path | dict[str, Any], *, hidden_size: int | None = None,
                                    world_size: int | None = None,
                                    trainer_precision: str | None = None) -> AccelerateConfig:
    """The settings an accelerate config file launches (module docstring for each rule).

    Args:
        config: the YAML file's path, or its mapping (e.g. one a planner wrote, to check it round-trips).
        hidden_size: the model config's `hidden_size`, for `"auto"` bucket sizes in a DeepSpeed JSON.
        world_size: GPUs in all when given on the command line (required when the file sets no `num_processes`;
            an error when it differs from the file).
        trainer_precision: the Trainer's `fp16` / `bf16` when it sets one: it wins over the file's
            `mixed_precision` (transformers TrainingArguments: `ACCELERATE_MIXED_PRECISION` first, then
            `if self.fp16` / `elif self.bf16`), also for DeepSpeed's fp16/bf16 sections.
    """
    base = None
    if not isinstance(config, dict):
        base = Path(config).parent
        data = read_accelerate_config(config)
    else:
        data = dict(config)
    unknown = sorted(set(data) - _KNOWN_KEYS)
    if unknown:
        raise MemfitError(f"accelerate config key `{unknown[0]}` is not one accelerate 1.15 knows (its loader refuses "
                          "unknown keys); remove it or write the file with `accelerate config`")
    if "distributed_type" not in data:
        raise MemfitError("the accelerate config has no `distributed_type` (accelerate requires it); add "
                          "`distributed_type: MULTI_GPU`, `FSDP` or `DEEPSPEED`")
    kind = str(data["distributed_type"]).upper()
    if data.get("use_cpu") is True:
        raise MemfitError("the accelerate config sets `use_cpu: true` (training on the CPU); memfit estimates GPU "
                          "memory: set it to false")
    mp = data.get("mixed_precision")
    if mp is None and data.get("fp16"):  # process_config: the legacy `fp16: true`
        mp = "fp16"
    mp = None if mp is None else str(mp).lower()
    if mp == "fp8":
        raise MemfitError("accelerate config `mixed_precision` `fp8` is not modelled by memfit; use bf16")
    if mp not in _PRECISION:
        raise MemfitError(f"accelerate config `mixed_precision` `{data.get('mixed_precision')}` is not no, fp16, bf16 "
                          "or fp8")
    precision = _PRECISION[mp]
    if trainer_precision is not None:
        if trainer_precision not in ("fp16", "bf16"):
            raise MemfitError(f"trainer_precision `{trainer_precision}` must be fp16, bf16 or None")
        precision = trainer_precision
    nodes = _int(data.get("num_machines", 1), "num_machines", 1)
    notes: list[str] = []
    if kind == "NO":
        if nodes > 1 or (data.get("num_processes") not in (None, 1)):
            raise MemfitError("accelerate config `distributed_type: NO` runs one process; set MULTI_GPU, FSDP or "
                              "DEEPSPEED for several")
        return AccelerateConfig(None, precision, notes=("distributed_type NO: one process on one GPU",))
    if kind not in ("MULTI_GPU", "FSDP", "DEEPSPEED"):
        raise MemfitError(f"accelerate config `distributed_type` `{data['distributed_type']}` is not modelled by memfit; "
                          "it models MULTI_GPU (DDP), FSDP and DEEPSPEED")
    world = _world(data, world_size)
    if world % nodes:
        raise MemfitError(f"accelerate config `num_processes` `{world}` is not a multiple of `num_machines` `{nodes}` "
                          "(accelerate starts num_processes // num_machines per machine)")
    if kind == "MULTI_GPU":
        return AccelerateConfig(ParallelSetup(world_size=world, nodes=nodes, strategy="ddp"), precision)
    if kind == "FSDP":
        par, ckpt = _fsdp(_section(data, "fsdp_config"), _section(data, "parallelism_config"), precision, world, nodes)
        return AccelerateConfig(par, precision, gradient_checkpointing=ckpt, notes=tuple(par.notes))
    zero, gas, file, more = _deepspeed(_section(data, "deepspeed_config"), trainer_precision, _PRECISION[mp],
                                       hidden_size, base)
    notes += more
    par = ParallelSetup(world_size=world, nodes=nodes, strategy=f"zero{zero.stage}", zero=zero, notes=tuple(notes))
    return AccelerateConfig(par, zero.dtype, gradient_accumulation_steps=gas, deepspeed_config_file=file,
                            notes=tuple(notes))
