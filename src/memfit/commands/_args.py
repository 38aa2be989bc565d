"""The one reader of `--args FILE` for every verb (estimate, plan, diagnose, train).

An arguments file is a JSON object of `transformers.TrainingArguments` kwargs; memfit's
TrainSetup fields (`"model"`, `"max_length"`, `"task"`, ...) may be in it too. Its names are
checked by `memfit.train_setup.normalize_arg_names`, the same for every verb:

* a legacy name (`evaluation_strategy`, `no_cuda`, `max_seq_length`, ...) is read as its
  current name, with a note; a removed setting is dropped, with a note;
* an unknown name is a one-line MemfitError naming the closest valid name (difflib).

When a command-line flag sets what the file sets too (`--batch-size 4` and
`"per_device_train_batch_size": 8`; `--output-dir` and `"output_dir"`), **the flag wins**, and
a note says so: a flag is the more specific, later choice (as with `python train.py
--config c.json --lr ...` scripts), and a run never stops over an argument it can honour.
Settings memfit itself controls in `memfit train` (`report_to`, `disable_tqdm`) are noted
when the file sets them otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.errors import MemfitError
from memfit.train_setup import normalize_arg_names, read_args_file

__all__ = ["read_args", "train_kwargs_from_file", "FORCED_BY_TRAIN"]

#: TrainingArguments memfit train sets whatever the file says (its progress bar and report replace them).
FORCED_BY_TRAIN = {"report_to": "none", "disable_tqdm": True}

#: TrainSetup fields that `memfit train` takes from a file (it has flags for them; the flag wins).
_TRAIN_SETUP_FIELDS = ("max_length", "num_labels")


def read_args(path: str, trainer: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Read and name-check an arguments file. Returns (settings, notes). `trainer` `sft` / `dpo`: that TRL
    config's names are valid too (TRL)."""
    return normalize_arg_names(read_args_file(path), source=f"`{path}`", trainer=trainer)


def train_kwargs_from_file(path: str, setup_names: set[str],
                           trainer: str | None = None) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """`memfit train --args FILE`: (TrainingArguments kwargs, the TrainSetup fields train uses, notes).

    Args:
        path: the JSON file.
        setup_names: TrainSetup's field names (a memfit setting `memfit train` does not take is an error).
        trainer: `sft` / `dpo` (`memfit train --trainer`): SFTConfig / DPOConfig names go into the kwargs too.
    """
    from memfit.train_setup import TRAINING_ARGS_NAMES, TRL_CONFIG_CLASS_NAMES, TRL_CONFIG_NAMES

    data, notes = read_args(path, trainer)
    trl_names = TRL_CONFIG_NAMES.get(trainer, frozenset()) if trainer else frozenset()  # TRL
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if key == "trainer" and trainer is not None:  # TRL: the file may say which trainer
            if value != trainer:
                raise MemfitError(f"`trainer: {value!r}` in `{path}` differs from `--trainer {trainer}`; "
                                  "give one of them")
        elif key in TRAINING_ARGS_NAMES or (key in trl_names and key not in _TRAIN_SETUP_FIELDS):
            kwargs[key] = value
        elif key in _TRAIN_SETUP_FIELDS:
            extra[key] = value
        elif key == "model":
            raise MemfitError(f"`model` in `{path}`: `memfit train` takes the model as its first argument "
                              "(`memfit train MODEL --data FILE`); remove it from the file")
        elif key in setup_names or key == "quantization_config":  # quantization: estimate/plan only
            owners = [TRL_CONFIG_CLASS_NAMES[t] for t, names in TRL_CONFIG_NAMES.items() if key in names]
            if trainer in TRL_CONFIG_CLASS_NAMES and owners:  # another TRL config's name (RLOOConfig: no loss_type)
                have = ", ".join(owners[:-1]) + " and " + owners[-1] if len(owners) > 1 else owners[0]
                raise MemfitError(f"`{key}` in `{path}` is not a setting of {TRL_CONFIG_CLASS_NAMES[trainer]} ({have} "
                                  f"{'have' if len(owners) > 1 else 'has'} it); remove it from the file")
            raise MemfitError(f"`{key}` in `{path}` is a memfit estimate setting that `memfit train` does not take; "
                              "remove it from the file")
    for key, forced in FORCED_BY_TRAIN.items():
        if key in kwargs and kwargs[key] != forced:
            notes.append(f"`{key}` of `{path}` is replaced by {forced!r}: memfit train reports progress itself")
    return kwargs, extra, notes


def flag_wins(kwargs: dict[str, Any], name: str, value: Any, flag: str, notes: list[str], source: str | None) -> None:
    """Set `kwargs[name] = value` from a flag, with a note when the file had another value."""
    if source is not None and name in kwargs and kwargs[name] != value:
        notes.append(f"`{flag} {value}` overrides `{name}: {kwargs[name]!r}` of `{source}` (the flag wins)")
    kwargs[name] = value


def args_source(args: argparse.Namespace) -> str | None:
    return getattr(args, "args_file", None)


# -- multi-GPU flags: --gpus, --world-size, --nodes, --strategy, --deepspeed, --fsdp, --fsdp-config --
def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    from memfit.commands._setup_flags import add_parallel_flags

    g = p.add_argument_group("multi-GPU (rank 0 of a DDP / FSDP2 / DeepSpeed ZeRO run)")
    g.add_argument("--gpus", default=None, metavar="NxGPU", help="e.g. 8xA100-80GB: world size and GPU in one")
    add_parallel_flags(g)  # --world-size, --nodes, --strategy: ParallelSetup's fields
    g.add_argument("--deepspeed", default=None, metavar="DS.json", help="DeepSpeed config (\"auto\" filled as transformers fills it)")
    g.add_argument("--fsdp", default=None, help="TrainingArguments fsdp options, e.g. \"full_shard auto_wrap\"")
    g.add_argument("--fsdp-config", default=None, metavar="FILE", help="TrainingArguments fsdp_config JSON")
    # accelerate config files: `accelerate config` output, as `accelerate launch` reads it
    g.add_argument("--accelerate-config", default=None, metavar="FILE.yaml",
                   help="accelerate config file (distributed_type MULTI_GPU / FSDP / DEEPSPEED, num_processes, ...)")


def _engine_settings(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """TrainingArguments' engine settings (memfit.parallel.setup ENGINE_ARGS) from the flags and the `--args` file:
    a flag wins over the file, with a note; `--fsdp-config` alone turns FSDP on."""
    from memfit.parallel.setup import ENGINE_ARGS

    path = args_source(args)
    data = read_args_file(path) if path else {}
    engine = {k: data[k] for k in ENGINE_ARGS if data.get(k) not in (None, "", [], False)}
    notes: list[str] = []
    for name in ("deepspeed", "fsdp", "fsdp_config"):
        value = getattr(args, name, None)
        if value is not None:
            flag = "--" + name.replace("_", "-")
            flag_wins(engine, name, value, flag, notes, path)
    if "deepspeed" in engine and getattr(args, "fsdp", None) is not None and getattr(args, "deepspeed", None) is None:
        engine.pop("deepspeed")  # `--fsdp` replaces the file's engine
    if "fsdp" in engine and getattr(args, "deepspeed", None) is not None and getattr(args, "fsdp", None) is None:
        engine.pop("fsdp")
    if "fsdp_config" in engine and "fsdp" not in engine and "deepspeed" not in engine:
        engine["fsdp"] = True
    return engine, notes


def parallel_from_args(args: argparse.Namespace, setup) -> tuple[Any, str | None]:
    """(ParallelSetup or None, the GPU name --gpus gave or None) from the multi-GPU flags and the engine settings of
    `--args FILE` (`deepspeed`, `fsdp`, `fsdp_config`, `ddp_bucket_cap_mb`: the same reader,
    memfit.parallel.setup `parallel_from_training_args`, as for a TrainingArguments object)."""
    from pathlib import Path

    from memfit.parallel.setup import ParallelSetup, parallel_from_training_args, parse_gpus, \
        zero_settings_from_deepspeed

    gpu = None
    world = getattr(args, "world_size", None)
    if world is not None and world < 1:
        raise MemfitError(f"--world-size `{world}` must be at least 1 (ranks in all, one GPU each)")
    if getattr(args, "gpus", None):
        count, gpu = parse_gpus(args.gpus)
        if world is not None and world != count:
            raise MemfitError(f"--gpus `{args.gpus}` and --world-size `{world}` differ; give one of them")
        world = count
    engine, engine_notes = _engine_settings(args)
    if getattr(args, "accelerate_config", None):  # read by accelerate_from_args
        if engine.get("deepspeed") or engine.get("fsdp"):
            raise MemfitError(f"--accelerate-config and `{'deepspeed' if engine.get('deepspeed') else 'fsdp'}` of "
                              f"`{args_source(args)}` both set the multi-GPU engine; give one of them")
        return None, gpu
    given = [f for f in ("strategy", "nodes") if getattr(args, f, None) is not None]
    if world is None and not given and not engine.get("deepspeed") and not engine.get("fsdp"):
        return None, gpu
    world = world or 1
    nodes = args.nodes or 1
    if engine.get("deepspeed") and engine.get("fsdp"):
        raise MemfitError("--deepspeed and --fsdp are two engines; give one")
    path = args_source(args)
    if engine.get("deepspeed") or engine.get("fsdp"):
        hidden = None
        if engine.get("deepspeed"):
            from memfit.models.build import resolve_config
            from memfit.models.catalog import hidden_size

            hidden = hidden_size(resolve_config(setup.model).config)
        par, _ = parallel_from_training_args(engine, world_size=world, nodes=nodes, precision=setup.precision,
                                             hidden_size=hidden, base_dir=Path(path).parent if path else None)
        if par.strategy == "fsdp" and args.strategy not in (None, "fsdp"):
            raise MemfitError(f"--strategy `{args.strategy}` with --fsdp: give --strategy fsdp or leave it out")
        if par.zero is not None:
            if args.strategy and args.strategy != par.strategy:
                raise MemfitError(f"--strategy `{args.strategy}` and `zero_optimization.stage` `{par.zero.stage}` of "
                                  f"`{engine['deepspeed']}` differ; drop --strategy or change the file")
            check_deepspeed_batch(engine["deepspeed"], setup, world, base_dir=Path(path).parent if path else None)
        return par.replace(notes=tuple(engine_notes) + par.notes), gpu
    strategy = args.strategy or "ddp"
    if strategy.startswith("zero"):  # no DeepSpeed file: DeepSpeed's defaults, in the Trainer's precision ("auto")
        zero, notes = zero_settings_from_deepspeed({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                                                    "zero_optimization": {"stage": int(strategy[-1])}},
                                                   hidden_size=None, precision=setup.precision)
        return ParallelSetup(world_size=world, nodes=nodes, strategy=strategy, zero=zero, notes=tuple(notes)), gpu
    return ParallelSetup(world_size=world, nodes=nodes, strategy=strategy,
                         bucket_cap_mb=engine.get("ddp_bucket_cap_mb"), notes=tuple(engine_notes)), gpu


def check_deepspeed_batch(config: Any, setup, world_size: int, *, base_dir=None) -> None:
    """memfit.parallel.deepspeed_rules `check_batch_keys` on a DeepSpeed JSON (a dict or its path)."""
    from pathlib import Path

    from memfit.parallel.deepspeed_rules import check_batch_keys
    from memfit.parallel.setup import read_json_file

    source = "the DeepSpeed config"
    if not isinstance(config, dict):
        source = f"`{config}`"
        path = Path(config)
        if not path.is_absolute() and not path.exists() and base_dir is not None and (Path(base_dir) / path).exists():
            path = Path(base_dir) / path
        config = read_json_file(path, "DeepSpeed config")
    check_batch_keys(config, micro_batch=setup.per_device_train_batch_size,
                     accumulation=setup.gradient_accumulation_steps, world_size=world_size, source=source)


# -- FSDP gradient accumulation: `accelerator_config` of the --args file --
def sync_each_batch_from_args(args: argparse.Namespace) -> bool:
    """`accelerator_config.gradient_accumulation_kwargs.sync_each_batch` of `--args FILE` (False when unset)."""
    from memfit.parallel.setup import sync_each_batch_from

    path = args_source(args)
    return sync_each_batch_from(read_args_file(path).get("accelerator_config")) if path else False


# -- accelerate config files --
def accelerate_from_args(args: argparse.Namespace, setup) -> tuple[Any, Any]:
    """(ParallelSetup or None, the TrainSetup with the file's mixed precision and FSDP activation checkpointing)
    from `--accelerate-config`. The Trainer's own fp16/bf16 win over the file's `mixed_precision`
    (transformers TrainingArguments: `ACCELERATE_MIXED_PRECISION` first, then `if self.fp16` / `self.bf16`)."""
    from memfit.parallel.accelerate_config import parallel_from_accelerate_config

    for flag in ("strategy", "deepspeed", "fsdp", "fsdp_config", "nodes"):
        if getattr(args, flag, None) is not None:
            raise MemfitError(f"--accelerate-config and --{flag.replace('_', '-')} both set the multi-GPU setup; "
                              "give one of them")
    world_size = getattr(args, "world_size", None)
    if getattr(args, "gpus", None):
        from memfit.parallel.setup import parse_gpus

        world_size = parse_gpus(args.gpus)[0]
    hidden = None
    try:
        from memfit.models.build import resolve_config
        from memfit.models.catalog import hidden_size

        hidden = hidden_size(resolve_config(setup.model).config)
    except MemfitError:
        hidden = None
    acc = parallel_from_accelerate_config(args.accelerate_config, hidden_size=hidden, world_size=world_size,
                                          trainer_precision=None if setup.precision == "fp32" else setup.precision)
    changes = {}
    if setup.precision == "fp32" and acc.precision != "fp32":
        changes["precision"] = acc.precision
    if acc.gradient_checkpointing and not setup.gradient_checkpointing:
        changes["gradient_checkpointing"] = True
    gas = acc.gradient_accumulation_steps
    if gas is not None and gas != setup.gradient_accumulation_steps:
        if getattr(args, "gradient_accumulation_steps", None) is not None:
            from memfit.commands._setup_flags import flag_name

            # transformers HfTrainerDeepSpeedConfig.trainer_config_process: fill_match, then a mismatch error
            flag = flag_name(args, "gradient_accumulation_steps")
            raise MemfitError(f"{flag} `{args.gradient_accumulation_steps}` and the DeepSpeed "
                              f"`gradient_accumulation_steps` `{gas}` of the accelerate config differ (transformers "
                              "refuses the mismatch); give one")
        changes["gradient_accumulation_steps"] = gas
    par = acc.parallel
    new_setup = setup.replace(**changes) if changes else setup
    if acc.deepspeed_config_file is not None:
        from pathlib import Path

        check_deepspeed_batch(acc.deepspeed_config_file, new_setup, par.world_size,
                              base_dir=Path(args.accelerate_config).parent)
    if par is not None and par.strategy == "fsdp":  # the file has no key for it
        par = par.replace(sync_each_batch=sync_each_batch_from_args(args))
    return par, new_setup
