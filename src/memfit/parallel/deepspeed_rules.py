"""What transformers and accelerate do to a DeepSpeed config before DeepSpeed reads it, and the DeepSpeed keys
that change memory without memfit modelling them.

* Precision (`deepspeed_precision`): the one place that decides a DeepSpeed run's dtype from the Trainer's
  `fp16` / `bf16`, an accelerate config's `mixed_precision` and the JSON's `fp16` / `bf16` sections, in the
  order the libraries apply them (transformers 5.24, accelerate 1.16):

  - `TrainingArguments.__post_init__`: `mixed_precision` is `ACCELERATE_MIXED_PRECISION` (an accelerate config's
    `mixed_precision`, "no" without one), replaced by "fp16" / "bf16" when the Trainer sets `fp16` / `bf16`;
  - `HfTrainerDeepSpeedConfig.trainer_config_process` (integrations/deepspeed.py): `fp16.enabled` / `bf16.enabled`
    of a present section: `"auto"` takes the Trainer's `fp16` / `bf16`; any other value that differs from it is a
    mismatch, raised by `trainer_config_finalize` ("Please correct the following DeepSpeed config values that
    mismatch TrainingArguments values: - ds bf16.enabled=True vs hf bf16|bf16_full_eval=False");
  - `DeepSpeedPlugin.set_mixed_precision(mixed_precision)` (accelerate utils/dataclasses.py; called by
    `AcceleratorState` and, for `accelerate launch` without `TrainingArguments(deepspeed=...)`, by
    TrainingArguments first): a section missing for the mixed precision is added enabled, the other dtype
    enabled is a ValueError, missing sections become disabled, `"auto"` is filled without a check.
    With `TrainingArguments(deepspeed=...)` the Trainer's processing comes first, through `accelerate launch`
    accelerate's does (then the Trainer checks the filled values against its own flags).

  DeepSpeed then trains in bf16 when `bf16.enabled`, else fp16 when `fp16.enabled`, else fp32 (its engine casts
  the model, `_configure_distributed_model`), with its own loss scaler for fp16 (no torch GradScaler). memfit's
  precision `fp32` reads as "the Trainer sets neither": where the config then asks for fp16 / bf16 the estimate
  takes that dtype and a note says the Trainer has to set it too.
* Batch keys (`check_batch_keys`): `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps` and
  `train_batch_size` that are not `"auto"` must equal the Trainer's (trainer_config_process `fill_match`; DeepSpeed's
  own `_batch_assertion` requires train_batch_size = micro x accumulation x data-parallel world size).
* Keys that change memory (`unmodelled_key_notes`): tensor parallelism (`tensor_parallel.autotp_size`), sequence
  parallelism, pipeline stages, DeepSpeed's own autocast, ... are named in a note; NVMe offload is refused by
  memfit.parallel.setup (`offload_*.device: nvme`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import MemfitError

__all__ = ["deepspeed_precision", "check_batch_keys", "unmodelled_key_notes", "autotp_size"]

_DTYPES = ("fp16", "bf16")


def _sections(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in _DTYPES:
        sec = config.get(name)
        if sec is None:
            continue
        if not isinstance(sec, dict):
            raise MemfitError(f"`{name}` `{sec!r}` in the DeepSpeed config must be an object such as "
                              "{\"enabled\": true}")
        out[name] = dict(sec)
    return out


def _explicit_true(secs: dict[str, dict[str, Any]]) -> str | None:
    on = [name for name in ("bf16", "fp16") if secs.get(name, {}).get("enabled") is True]
    return on[0] if on else None


def deepspeed_precision(config: dict[str, Any], *, trainer: str | None, launcher: str | None = None,
                        via_accelerate: bool = False, source: str = "the DeepSpeed config") -> tuple[str, list[str]]:
    """The dtype DeepSpeed trains in (`fp16`, `bf16` or `fp32`) and notes, as the module docstring's rules give it.

    Args:
        config: the DeepSpeed JSON (not modified).
        trainer: the Trainer's `fp16` / `bf16` (`"fp16"`, `"bf16"`), or None (memfit's `fp32`: neither set).
        launcher: an accelerate config's `mixed_precision` (`"fp16"`, `"bf16"`, `"fp32"`/None for "no").
        via_accelerate: the config reaches the Trainer through `accelerate launch` (a DEEPSPEED accelerate config),
            not through `TrainingArguments(deepspeed=...)`.
        source: where the config came from, for the messages.
    """
    trainer = None if trainer in (None, "fp32") else trainer
    launcher = None if launcher in (None, "fp32", "no") else launcher
    secs = _sections(config)
    if all(secs.get(name, {}).get("enabled") is True for name in _DTYPES):  # DeepSpeed's engine refuses it too
        raise MemfitError(f"{source} enables both `fp16` and `bf16`; enable one")
    try:
        return _resolve(secs, trainer, launcher, via_accelerate, source), []
    except MemfitError:
        if trainer is not None:
            raise
        # the Trainer sets neither: the dtype the config asks for, if setting it on the Trainer makes a valid run
        implied = (launcher or _explicit_true(secs)) if via_accelerate else (_explicit_true(secs) or launcher)
        if implied is None:
            raise
        dtype = _resolve(secs, implied, launcher, via_accelerate, source)  # else its error: what to change
    why = (f"the accelerate config's mixed_precision `{launcher}`" if implied == launcher
           else f"`{implied}.enabled: true` in {source}")
    return dtype, [f"DeepSpeed runs in {dtype} ({why}); the Trainer must set `{implied}=True` too "
                   f"(`--precision {implied}`): transformers refuses a DeepSpeed `{implied}.enabled` that differs "
                   f"from TrainingArguments' (trainer_config_process: 'ds {implied}.enabled=True vs hf "
                   f"{implied}=False'); estimated in {dtype}"]


def _resolve(sections: dict[str, dict[str, Any]], trainer: str | None, launcher: str | None, via_accelerate: bool,
             source: str) -> str:
    """The dtype after transformers' and accelerate's processing (module docstring), or a MemfitError."""
    secs = {name: dict(sec) for name, sec in sections.items()}
    mixed = trainer or launcher or "no"  # TrainingArguments: ACCELERATE_MIXED_PRECISION, then fp16 / bf16
    mismatches: list[str] = []

    def trainer_process() -> None:  # HfTrainerDeepSpeedConfig.trainer_config_process: fill_match
        for name, sec in secs.items():
            value, hf = sec.get("enabled"), trainer == name
            if value == "auto":
                sec["enabled"] = hf
            elif value is not None and value != hf:
                mismatches.append(f"ds {name}.enabled={value} vs hf {name}={hf}")

    def set_mixed_precision() -> None:  # accelerate DeepSpeedPlugin.set_mixed_precision
        if mixed in _DTYPES and mixed not in secs:
            secs[mixed] = {"enabled": True}
        if mixed != "no":
            other = "bf16" if mixed == "fp16" else "fp16"
            if str(secs.get(other, {}).get("enabled", "False")).lower() == "true":
                raise MemfitError(f"mixed precision `{mixed}` and `{other}.enabled: true` in {source} conflict "
                                  f"(accelerate: '`--mixed_precision` arg cannot be set to `{mixed}` when `{other}` "
                                  f"is set in the DeepSpeed config file'); use `--precision {other}` or set "
                                  f"`{other}.enabled` to \"auto\"")
        for name in _DTYPES:
            sec = secs.setdefault(name, {"enabled": False})
            if sec.get("enabled") == "auto":
                sec["enabled"] = mixed == name

    if via_accelerate:
        set_mixed_precision()
        trainer_process()
    else:
        trainer_process()
        set_mixed_precision()
    if mismatches:
        raise MemfitError(f"{source} and the Trainer's precision (`--precision {trainer or 'fp32'}`) differ: "
                          f"{'; '.join(mismatches)} (transformers refuses this: trainer_config_finalize); use "
                          f"`--precision` to match, or set `enabled` to \"auto\"")
    enabled = {}
    for name in _DTYPES:
        value = secs[name].get("enabled", False)
        if not isinstance(value, bool):
            raise MemfitError(f"`{name}.enabled` `{value!r}` in {source} must be true, false or \"auto\"")
        enabled[name] = value
    if enabled["fp16"] and enabled["bf16"]:
        raise MemfitError(f"{source} enables both `fp16` and `bf16`; enable one")
    return "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else "fp32"


def _int_or_auto(config: dict[str, Any], key: str, source: str) -> int | None:
    value = config.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemfitError(f"`{key}` `{value!r}` in {source} must be a positive integer or \"auto\"")
    return value


def check_batch_keys(config: dict[str, Any], *, micro_batch: int, accumulation: int, world_size: int,
                     source: str = "the DeepSpeed config") -> None:
    """A one-line MemfitError when the JSON's batch keys are not the Trainer's (module docstring).

    Args:
        config: the DeepSpeed JSON.
        micro_batch: the Trainer's `per_device_train_batch_size`.
        accumulation: the Trainer's `gradient_accumulation_steps`.
        world_size: ranks in all.
        source: where the config came from, for the messages.
    """
    micro = _int_or_auto(config, "train_micro_batch_size_per_gpu", source)
    gas = _int_or_auto(config, "gradient_accumulation_steps", source)
    total = _int_or_auto(config, "train_batch_size", source)
    if micro is not None and micro != micro_batch:
        raise MemfitError(f"`train_micro_batch_size_per_gpu` `{micro}` in {source} is not the per-device batch size "
                          f"`{micro_batch}` (transformers refuses the mismatch: 'ds train_micro_batch_size_per_gpu="
                          f"{micro} vs hf per_device_train_batch_size={micro_batch}'); pass `--batch-size {micro}` "
                          "or set it to \"auto\"")
    if gas is not None and gas != accumulation:
        raise MemfitError(f"`gradient_accumulation_steps` `{gas}` in {source} is not the Trainer's `{accumulation}` "
                          f"(transformers refuses the mismatch); pass `--grad-accum {gas}` or set it to \"auto\"")
    # trainer_config_process: train_batch_size = args.world_size * per_device_train_batch_size * accumulation
    if total is not None and total != micro_batch * accumulation * world_size:
        raise MemfitError(f"`train_batch_size` `{total}` in {source} is not micro-batch {micro_batch} x accumulation "
                          f"{accumulation} x {world_size} GPUs = {micro_batch * accumulation * world_size} (DeepSpeed's "
                          "_batch_assertion and transformers both refuse it); fix the batch or GPU flags or set it "
                          "to \"auto\"")


def autotp_size(config: dict[str, Any]) -> int:
    """`tensor_parallel.autotp_size` (DeepSpeed AutoTP; the older `zero_optimization.autotp_size` too); 1 when unset."""
    tp = config.get("tensor_parallel")
    value = tp.get("autotp_size") if isinstance(tp, dict) else None
    zero = config.get("zero_optimization")
    if value is None and isinstance(zero, dict):
        value = zero.get("autotp_size")
    if value is None or value == "auto":
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemfitError(f"`tensor_parallel.autotp_size` `{value!r}` must be a positive integer")
    return value


#: Top-level DeepSpeed keys (deepspeed/runtime/config.py, constants.py) that change GPU memory and that memfit does
#: not model, with what they do. `tensor_parallel` is handled by `autotp_size`.
_MEMORY_KEYS = {
    "sequence_parallel_size": "Ulysses sequence parallelism splits each sequence over ranks",
    "pipeline": "pipeline parallelism splits the layers over stages",
    "torch_autocast": "DeepSpeed's own torch autocast keeps fp32 parameters with low-precision compute",
    "amp": "apex AMP replaces DeepSpeed's fp16 handling",
    "data_types": "`grad_accum_dtype` sets the dtype gradients accumulate in",
    "communication_data_type": "gradients are reduced in another dtype (a cast copy per bucket)",
    "activation_checkpointing": "DeepSpeed's checkpointing API (partition / CPU checkpointing), used by models that "
                                "call deepspeed.checkpointing",
    "compile": "torch.compile of the engine",
    "zenflow": "ZenFlow's asynchronous CPU optimizer updates",
    "sparse_attention": "DeepSpeed sparse attention kernels",
    "data_efficiency": "curriculum learning / random layer-token drop change the sequence lengths",
    "curriculum_learning": "curriculum learning changes the sequence lengths",
    "progressive_layer_drop": "layers are skipped in forward",
    "compression_training": "quantization-aware / pruned layers",
    "elasticity": "the batch size is chosen by DeepSpeed's elastic scheduler",
}


def unmodelled_key_notes(config: dict[str, Any], source: str = "the DeepSpeed config") -> list[str]:
    """One note per top-level key of `_MEMORY_KEYS` that the config turns on (an `enabled: false` section or a size
    of 1 is off), and one for AutoTP."""
    notes = []
    for key, what in _MEMORY_KEYS.items():
        value = config.get(key)
        if value is None or value is False or value == 1 or (isinstance(value, dict) and value.get("enabled") is False):
            continue
        notes.append(f"`{key}` in {source} changes memory but is not modelled by memfit ({what}); the estimate is "
                     "of a run without it")
    tp = autotp_size(config)
    if tp > 1:
        notes.append(f"`tensor_parallel.autotp_size` {tp} in {source} (DeepSpeed AutoTP: each linear layer split over "
                     f"{tp} GPUs) is not modelled by memfit: the estimate is of ZeRO without tensor parallelism, each "
                     f"rank holding whole layers, an upper bound of what a {tp}-way split holds per GPU")
    return notes
