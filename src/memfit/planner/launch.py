"""What to launch for a multi-GPU plan: the engine's config file, the accelerate config, the
`TrainingArguments` change and the command.

The files are the ones the per-rank simulation read: a strategy's `ParallelSetup` is made from them by
memfit's own readers (`parallel_setup_for`: memfit.parallel.setup `zero_settings_from_deepspeed`,
`parallel_from_fsdp_args`), as `memfit estimate --deepspeed FILE` / `--fsdp ... --fsdp-config FILE` read
them, so what is launched is what was simulated.

* DeepSpeed JSON: transformers' `"auto"` for the batch sizes, accumulation, clipping and precision
  (transformers/integrations/deepspeed.py `HfTrainerDeepSpeedConfig.trainer_config_process` fills them
  from TrainingArguments) and for the bucket sizes where the model has a `hidden_size`
  (`trainer_config_finalize`); `overlap_comm` and `contiguous_gradients` on, as transformers' DeepSpeed
  guide's ZeRO-2 and ZeRO-3 examples set them. With `offload_optimizer` an `optimizer` section of type
  AdamW: DeepSpeed then steps DeepSpeedCPUAdam on the host (deepspeed/runtime/engine.py
  `_configure_basic_optimizer`); a client optimizer with offload is refused unless
  `zero_force_ds_cpu_optimizer` is false.
* FSDP2: `TrainingArguments(fsdp="full_shard auto_wrap", fsdp_config=...)` with `version: 2`,
  `reshard_after_forward` and `cpu_offload` (transformers training_args.py `_process_fsdp_args`), and the
  same as an accelerate config (`distributed_type: FSDP`, `fsdp_config.fsdp_version: 2`,
  `fsdp_reshard_after_forward`, `fsdp_offload_params`: accelerate/commands/config/cluster.py).
* FSDP2 with gradient accumulation: `TrainingArguments(accelerator_config={"gradient_accumulation_kwargs":
  {"sync_each_batch": True}})`, so that the Trainer reduce-scatters every micro-step (transformers trainer.py
  `_inner_training_loop`: `sync_each_batch` -> no `no_sync`) as memfit.parallel.fsdp simulates; under `no_sync`
  FSDP2 keeps unsharded gradients between micro-steps (`set_requires_gradient_sync(False)`).
* Commands: `torchrun --nproc_per_node G [--nnodes M --node_rank R --rdzv_backend c10d --rdzv_endpoint
  HOST:PORT] train.py`, or `accelerate launch --config_file FILE train.py` whose `--num_processes` is the
  total over machines (accelerate/commands/launch.py: "The total number of processes to be launched in
  parallel").

* `training_args.json`: the plan's `TrainingArguments` change that both launchers need (batch, accumulation,
  kernels, precision, `accelerator_config`), the engine keys left out (`deepspeed`, `fsdp`, `fsdp_config`:
  `torchrun` takes them in `TrainingArguments`, `accelerate launch` from its config file). It is the one place
  that carries `sync_each_batch` (no accelerate config key does, accelerate 1.15 `GradientAccumulationPlugin`),
  so `memfit estimate ... --accelerate-config accelerate_config.yaml --args training_args.json` (or
  `--deepspeed ds_config.json` / `--fsdp ... --fsdp-config fsdp_config.json` with the same `--args`) gives the
  per-rank figures the plan verified, without the flags the file sets (a flag wins over `--args`).

`write_launch` writes the files whole or not at all (a temporary file moved into place with `os.replace`)
and refuses to replace a file that exists unless asked to.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.parallel.setup import ParallelSetup, parallel_from_fsdp_args, zero_settings_from_deepspeed

__all__ = ["Variant", "VARIANTS", "HYBRID_VARIANTS", "deepspeed_config", "fsdp_arguments", "accelerate_config", "parallel_setup_for",
           "Launch", "launch_for", "write_launch", "DS_FILE", "FSDP_FILE", "ACCELERATE_FILE", "TRAINING_ARGS_FILE",
           "ENGINE_KEYS"]

DS_FILE = "ds_config.json"
FSDP_FILE = "fsdp_config.json"
ACCELERATE_FILE = "accelerate_config.yaml"
TRAINING_ARGS_FILE = "training_args.json"
#: TrainingArguments keys that choose the engine: in `training_args.json` only for torchrun (module docstring)
ENGINE_KEYS = ("deepspeed", "fsdp", "fsdp_config")


@dataclass(frozen=True)
class Variant:
    """One way to spread the run: an engine and its memory-for-speed switches."""

    key: str
    strategy: str  #: ddp, fsdp, zero1, zero2, zero3
    tier: int  #: 0: on the GPUs; 1: CPU offload (a last resort)
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False
    hybrid: bool = False  #: several nodes: FSDP2 HSDP (shard in the node, replicate across) / ZeRO-3 hpZ

    @property
    def label(self) -> str:
        if self.strategy == "ddp":
            return "DDP"
        if self.hybrid:
            return "FSDP2 HSDP" if self.strategy == "fsdp" else "ZeRO-3 hpZ"
        if self.strategy == "fsdp":
            name = "FSDP2 " + ("full_shard" if self.reshard_after_forward else "shard_grad_op")
            return name + (" + CPU offload" if self.cpu_offload else "")
        off = [w for w, on in (("optimizer", self.offload_optimizer), ("params", self.offload_param)) if on]
        return f"ZeRO-{self.strategy[-1]}" + (f" + offload {' + '.join(off)}" if off else "")


#: The strategies the planner weighs; the order breaks ties in modelled time (simpler first)
VARIANTS = (
    Variant("ddp", "ddp", 0),
    Variant("zero1", "zero1", 0),
    Variant("zero2", "zero2", 0),
    Variant("fsdp_shard_grad_op", "fsdp", 0, reshard_after_forward=False),
    Variant("fsdp_full_shard", "fsdp", 0),
    Variant("zero3", "zero3", 0),
    Variant("zero2_offload_optimizer", "zero2", 1, offload_optimizer=True),
    Variant("fsdp_full_shard_offload", "fsdp", 1, cpu_offload=True),
    Variant("zero3_offload_optimizer", "zero3", 1, offload_optimizer=True),
    Variant("zero3_offload_all", "zero3", 1, offload_optimizer=True, offload_param=True),
)

#: With several nodes (memfit.planner.parallel_plan adds them where the network is slower than the node's links):
#: FSDP2 HSDP, launched by `accelerate launch` with `parallelism_config` dp_replicate_size = nodes, dp_shard_size =
#: GPUs per node (accelerate's ParallelismConfig builds the 2-D mesh; TrainingArguments' `fsdp` cannot ask for
#: it with FSDP2: memfit.parallel.setup `parallel_from_fsdp_args`), and ZeRO++ hpZ (`zero_hpz_partition_size` =
#: GPUs per node in the DeepSpeed JSON)
HYBRID_VARIANTS = (
    Variant("fsdp_hybrid", "fsdp", 0, hybrid=True),
    Variant("zero3_hpz", "zero3", 0, hybrid=True),
)


def deepspeed_config(v: Variant, *, hidden_size: int | None, gpus_per_node: int | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON of a ZeRO variant (module docstring); numbers where `"auto"` cannot be filled.
    `gpus_per_node`: hpZ's partition size (a hybrid variant)."""
    stage = int(v.strategy[-1])
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if v.hybrid:
        if not gpus_per_node:
            raise MemfitError("ZeRO++ hpZ needs the GPUs per node (`zero_hpz_partition_size`)")
        zero["zero_hpz_partition_size"] = gpus_per_node
    if hidden_size:
        zero["reduce_bucket_size"] = "auto"
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = "auto"
            zero["stage3_param_persistence_threshold"] = "auto"
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if v.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if v.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    out: dict[str, Any] = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }
    if v.offload_optimizer:
        out["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
    return out


def fsdp_arguments(v: Variant) -> tuple[str, dict[str, Any]]:
    """`TrainingArguments(fsdp=..., fsdp_config=...)` of an FSDP2 variant."""
    opts = ("full_shard" if v.reshard_after_forward else "shard_grad_op") + " auto_wrap" + (
        " offload" if v.cpu_offload else "")
    return opts, {"version": 2, "reshard_after_forward": v.reshard_after_forward, "cpu_offload": v.cpu_offload}


def accelerate_config(v: Variant, *, world_size: int, nodes: int, precision: str) -> dict[str, Any]:
    """An accelerate config (`accelerate launch --config_file`) for the variant."""
    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": nodes,
                           "num_processes": world_size, "main_training_function": "main",
                           "mixed_precision": precision if precision in ("fp16", "bf16") else "no",
                           "rdzv_backend": "static" if nodes == 1 else "c10d", "same_network": True,
                           "use_cpu": False}
    if v.strategy == "ddp":
        out["distributed_type"] = "MULTI_GPU"
    elif v.strategy == "fsdp":
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_reshard_after_forward": v.reshard_after_forward,
                              "fsdp_offload_params": v.cpu_offload, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                              "fsdp_cpu_ram_efficient_loading": True, "fsdp_activation_checkpointing": False}
        if v.hybrid:  # accelerate ParallelismConfig: the 2-D (replicate, shard) mesh of HSDP
            out["parallelism_config"] = {"parallelism_config_dp_replicate_size": nodes,
                                         "parallelism_config_dp_shard_size": world_size // nodes}
    else:
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {"deepspeed_config_file": DS_FILE, "zero3_init_flag": v.strategy == "zero3"}
        out.pop("mixed_precision")  # the DeepSpeed file's fp16/bf16 sections decide
    if nodes > 1:
        out["main_process_ip"] = "MASTER_ADDR"
        out["main_process_port"] = 29500
    return out


def parallel_setup_for(v: Variant, *, world_size: int, nodes: int, hidden_size: int | None,
                       precision: str) -> ParallelSetup:
    """The ParallelSetup memfit's readers make of the variant's launch files (module docstring).

    Args:
        v: the variant.
        world_size: ranks in all.
        nodes: nodes.
        hidden_size: the model config's hidden size (DeepSpeed's `"auto"` bucket sizes), or None.
        precision: the Trainer's mixed precision, which DeepSpeed's `"auto"` fp16/bf16 take.
    """
    if v.strategy == "ddp":
        return ParallelSetup(world_size=world_size, nodes=nodes, strategy="ddp")
    if v.strategy == "fsdp":
        opts, cfg = fsdp_arguments(v)
        # the launch sets accelerator_config sync_each_batch (launch_for), so memfit simulates that
        par = parallel_from_fsdp_args(opts, cfg, world_size=world_size, nodes=nodes)[0].replace(sync_each_batch=True)
        if precision in ("fp16", "bf16"):
            # the Trainer's mixed precision becomes FSDP's policy (accelerate state.py: fsdp_plugin.set_mixed_precision:
            # param_dtype = reduce_dtype = the precision's dtype), as `memfit estimate --fsdp` and the accelerate config
            # reader (memfit.parallel.accelerate_config) apply it
            par = par.replace(param_dtype=precision, reduce_dtype=precision)
        if v.hybrid:
            par = par.replace(hybrid_shard=True)
        return par
    zero, notes = zero_settings_from_deepspeed(deepspeed_config(v, hidden_size=hidden_size,
                                                                gpus_per_node=world_size // nodes),
                                               hidden_size=hidden_size, precision=precision)
    return ParallelSetup(world_size=world_size, nodes=nodes, strategy=v.strategy, zero=zero, notes=tuple(notes))


@dataclass(frozen=True)
class Launch:
    """Exactly what to run: files (name -> text), the TrainingArguments change, env and commands."""

    files: dict[str, str]
    training_args: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    code: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"files": dict(self.files), "training_args": dict(self.training_args), "env": dict(self.env),
                "code": list(self.code), "commands": list(self.commands)}


def _yaml(obj: dict[str, Any]) -> str:
    import yaml  # PyYAML: a dependency of accelerate

    return yaml.safe_dump(obj, sort_keys=False)


def launch_for(v: Variant, *, world_size: int, nodes: int, hidden_size: int | None, precision: str,
               training_args: dict[str, Any], env: dict[str, str] | None = None, code: list[str] | None = None,
               script: str = "train.py", accumulation: int = 1) -> Launch:
    """Files, TrainingArguments change and commands for a variant (module docstring).

    Args:
        v: the variant.
        world_size: ranks in all.
        nodes: nodes.
        hidden_size: the model config's hidden size, or None.
        precision: the Trainer's mixed precision.
        training_args: the single-GPU TrainingArguments changes of the plan (batch, checkpointing, kernels).
        env: environment variables of the plan (allocator settings).
        code: code lines of the plan (memfit's own checkpointing).
        script: the training script in the commands.
        accumulation: gradient accumulation steps of the plan (FSDP2 with more than one: `sync_each_batch`).
    """
    files: dict[str, str] = {}
    args = dict(training_args)
    if v.strategy == "fsdp" and v.hybrid:  # the accelerate config carries FSDP2 and its 2-D mesh
        code = list(code or []) + ["# FSDP2 HSDP: launch with `accelerate launch --config_file "
                                   f"{ACCELERATE_FILE}` (its parallelism_config makes the 2-D mesh); torchrun with "
                                   "TrainingArguments(fsdp=...) would shard over all GPUs instead"]
        if accumulation > 1:  # as below: reduce every micro-step, as simulated
            args["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    elif v.strategy == "fsdp":
        opts, cfg = fsdp_arguments(v)
        files[FSDP_FILE] = json.dumps(cfg, indent=2) + "\n"
        args.update(fsdp=opts, fsdp_config=FSDP_FILE)
        if accumulation > 1:  # reduce-scatter every micro-step, as memfit.parallel.fsdp simulates (memfit.planner.comm)
            args["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    elif v.strategy.startswith("zero"):
        files[DS_FILE] = json.dumps(deepspeed_config(v, hidden_size=hidden_size, gpus_per_node=world_size // nodes),
                                    indent=2) + "\n"
        args["deepspeed"] = DS_FILE
    files[ACCELERATE_FILE] = _yaml(accelerate_config(v, world_size=world_size, nodes=nodes, precision=precision))
    common = {k: val for k, val in args.items() if k not in ENGINE_KEYS}
    if common:  # what both launchers' TrainingArguments need, sync_each_batch included (module docstring)
        files[TRAINING_ARGS_FILE] = json.dumps(common, indent=2) + "\n"
    per_node = world_size // nodes
    if nodes == 1:
        torchrun = f"torchrun --nproc_per_node {per_node} {script}"
        accel = f"accelerate launch --config_file {ACCELERATE_FILE} --num_processes {world_size} {script}"
    else:
        torchrun = (f"torchrun --nnodes {nodes} --nproc_per_node {per_node} --node_rank $NODE_RANK "
                    f"--rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 {script}   # on each node")
        accel = (f"accelerate launch --config_file {ACCELERATE_FILE} --num_machines {nodes} --num_processes "
                 f"{world_size} --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 "
                 f"{script}   # on each node")
    commands = [accel] if (v.strategy == "fsdp" and v.hybrid) else [torchrun, accel]
    return Launch(files, args, dict(env or {}), list(code or []), commands)


def write_launch(folder: str | os.PathLike[str], launch: Launch, *, force: bool = False) -> list[str]:
    """Write the launch files into `folder` (made if missing), each whole or not at all; returns their paths.

    A file that exists is an error (nothing is written) unless `force`; memfit never removes anything else.
    """
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise MemfitError(f"--write-launch `{folder}` is a file, not a folder; give a folder for the launch files")
    existing = [name for name in launch.files if (target / name).exists()]
    if existing and not force:
        raise MemfitError(f"`{target / existing[0]}` exists; memfit does not overwrite it: pass --force to replace "
                          "it or choose another --write-launch folder")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise MemfitError(f"cannot make the folder `{folder}`: {err.strerror or err}") from err
    written = []
    umask = os.umask(0)
    os.umask(umask)
    for name, text in launch.files.items():
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".tmp-", suffix="-" + name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.chmod(tmp, 0o666 & ~umask)  # as open() would make it (mkstemp makes 0600)
            os.replace(tmp, target / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)  # memfit's own temporary file
            raise
        written.append(str(target / name))
    return written
