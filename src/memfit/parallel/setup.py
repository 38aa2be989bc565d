"""The settings of a multi-GPU run: strategy, world size, and each engine's own knobs.

* DDP (`torch.nn.parallel.DistributedDataParallel.__init__`): `bucket_cap_mb` (default 25), the
  first bucket of 1 MiB (`dist._DEFAULT_FIRST_BUCKET_BYTES`), `gradient_as_bucket_view` (default False).
* FSDP2 (`torch.distributed.fsdp.fully_shard`), as transformers configures it from
  `TrainingArguments(fsdp=..., fsdp_config=...)` (`TrainingArguments._process_fsdp_args` and
  `_apply_legacy_fsdp_to_config`): `"full_shard"` -> `reshard_after_forward=True`, `"shard_grad_op"`
  -> False, `"offload"` -> `cpu_offload`, `"auto_wrap"` a no-op (each decoder block is wrapped);
  `fsdp_config` keys with or without the `fsdp_` prefix; the hybrid strategies are FSDP1-only there.
* FSDP1 (`fsdp_config["version"] = 1`): `FullyShardedDataParallel` with the strategy accelerate actually
  passes (`fsdp1_effective_strategy`); hybrid sharding (FSDP1 `HYBRID_SHARD` / `_HYBRID_SHARD_ZERO2`, FSDP2
  HSDP from an accelerate config's `parallelism_config`) shards within a node and replicates across nodes.
* DeepSpeed ZeRO from the JSON passed as `TrainingArguments(deepspeed=...)`, `"auto"` filled as
  transformers fills it (transformers/integrations/deepspeed.py, `HfTrainerDeepSpeedConfig.
  trainer_config_process`: `fp16.enabled` / `bf16.enabled` from the Trainer's precision;
  `trainer_config_finalize`: `reduce_bucket_size` = hidden^2, and for stage 3
  `stage3_prefetch_bucket_size` = int(0.9 * hidden^2), `stage3_param_persistence_threshold` =
  10 * hidden), and DeepSpeed's defaults for what the JSON leaves out
  (deepspeed/runtime/zero/config.py `DeepSpeedZeroConfig`).

Pure Python: no torch import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.files import read_json_object
from memfit.train_setup import ENGINE_ARG_NAMES

__all__ = ["STRATEGIES", "ParallelSetup", "ZeroSettings", "parse_gpus", "zero_settings_from_deepspeed",
           "parallel_from_fsdp_args", "read_json_file", "fsdp1_strategy", "fsdp_parallel", "FSDP1_STRATEGIES",
           "sync_each_batch_from", "parallel_from_training_args", "ENGINE_ARGS"]

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")

#: DDP defaults: `DistributedDataParallel.__init__(bucket_cap_mb=None)` -> 25 MiB
#: (torch/nn/parallel/distributed.py: `bucket_cap_mb = 25` when None; `_DEFAULT_FIRST_BUCKET_BYTES` = 1 MiB).
DDP_BUCKET_CAP_MB = 25.0

#: DeepSpeed's defaults (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig fields), in elements.
_DS_REDUCE_BUCKET_SIZE = int(5e8)       # reduce_bucket_size: Field(pp_int(5e8))
_DS_ALLGATHER_BUCKET_SIZE = int(5e8)    # allgather_bucket_size: Field(pp_int(5e8))
_DS_PREFETCH_BUCKET_SIZE = int(5e7)     # prefetch_bucket_size (stage3_prefetch_bucket_size): pp_int(5e7)
_DS_PERSISTENCE_THRESHOLD = int(1e5)    # param_persistence_threshold: pp_int(1e5)
_DS_MAX_LIVE_PARAMETERS = int(1e9)      # max_live_parameters: pp_int(1e9)
_DS_SUB_GROUP_SIZE = int(1e9)           # sub_group_size: pp_int(1e9)
_DS_MAX_REUSE_DISTANCE = int(1e9)       # max_reuse_distance (stage3_max_reuse_distance): pp_int(1e9)

_ZERO_KEYS = {"stage", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
              "stage3_max_live_parameters", "stage3_param_persistence_threshold", "contiguous_gradients",
              "overlap_comm", "offload_optimizer", "offload_param", "sub_group_size", "reduce_scatter",
              "allgather_partitions", "round_robin_gradients", "stage3_max_reuse_distance",
              "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
              "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
              "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "mics_shard_size",
              "memory_efficient_linear", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory",
              "stage3_model_persistence_threshold", "use_multi_rank_bucket_allreduce", "log_trace_cache_warnings",
              "module_granularity_threshold", "stage3_module_granularity_threshold", "zeropp_loco_param",
              "pipeline_loading_checkpoint", "override_module_apply", "leaf_module", "stage3_use_all_reduce_for_fetch_params",
              "allgather_sequential", "save_muon_momentum_buffer_in_memory", "log_trace_cache_warnings"}


@dataclass(frozen=True)
class ZeroSettings:
    """DeepSpeed ZeRO settings after `"auto"` resolution; sizes in elements, as DeepSpeed counts them."""

    stage: int
    dtype: str
    """`fp16`, `bf16` or `fp32`: the dtype DeepSpeed casts the model to (engine `_configure_distributed_model`)."""
    reduce_bucket_size: int = _DS_REDUCE_BUCKET_SIZE
    allgather_bucket_size: int = _DS_ALLGATHER_BUCKET_SIZE
    prefetch_bucket_size: int = _DS_PREFETCH_BUCKET_SIZE
    max_live_parameters: int = _DS_MAX_LIVE_PARAMETERS
    param_persistence_threshold: int = _DS_PERSISTENCE_THRESHOLD
    sub_group_size: int = _DS_SUB_GROUP_SIZE
    contiguous_gradients: bool = True
    overlap_comm: bool = False
    """DeepSpeedZeroConfig.overlap_comm_valid: None -> True for stage 3, else False."""
    offload_optimizer: bool = False
    offload_param: bool = False
    max_reuse_distance: int = _DS_MAX_REUSE_DISTANCE
    torch_adam: bool = False
    """`optimizer.params.torch_adam`: DeepSpeed steps torch's Adam (temporaries) instead of FusedAdam (none)."""
    # ZeRO++
    hpz_partition_size: int = 1
    """`zero_hpz_partition_size` (default 1): hpZ, a secondary partition of the bit16 parameters within groups of
    this many ranks (a node), so backward all-gathers stay inside the node (stage 3 only)."""
    quantized_weights: bool = False
    """`zero_quantized_weights` (qwZ): parameters all-gathered as int8 with fp32 scales (stage 3)."""
    quantized_gradients: bool = False
    """`zero_quantized_gradients` (qgZ): gradients reduce-scattered as int8 through all-to-all (stage 3)."""


@dataclass(frozen=True)
class ParallelSetup:
    """How a run is spread over GPUs. `world_size` ranks over `nodes` nodes, one GPU per rank."""

    world_size: int = 1
    """Ranks in all, one GPU each."""
    nodes: int = 1
    """Nodes the ranks are spread over, the same number of GPUs on each."""
    strategy: str = field(default="ddp", metadata={"choices": STRATEGIES})
    """ddp (DistributedDataParallel), fsdp (FSDP2 `fully_shard`), or DeepSpeed ZeRO stage 1, 2 or 3."""
    # DDP
    bucket_cap_mb: float | None = None
    """DDP `bucket_cap_mb` (TrainingArguments `ddp_bucket_cap_mb`); None: DDP's default of 25 MiB with a first
    bucket of 1 MiB (`_BucketCapacityConfig.create`: the 1 MiB first bucket only when the cap is the default)."""
    gradient_as_bucket_view: bool = False
    # FSDP2
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    """FSDP2 `CPUOffloadPolicy`: sharded parameters, gradients and optimizer state live in host memory."""
    param_dtype: str | None = None
    """FSDP2 `MixedPrecisionPolicy(param_dtype=...)`: `bf16`, `fp16`, or None (the parameters' own dtype)."""
    reduce_dtype: str | None = None
    # FSDP1 and hybrid sharding : new fields, defaults keep the FSDP2 behaviour above
    fsdp_version: int = 2
    """1: FSDP1 (`FullyShardedDataParallel`, FlatParameter per wrapped unit); 2: FSDP2 (`fully_shard`)."""
    hybrid_shard: bool = False
    """Shard within each node, replicate across nodes: FSDP2 HSDP (`fully_shard(mesh=2-D (replicate, shard))`),
    FSDP1 `HYBRID_SHARD` (with `reshard_after_forward`) / `_HYBRID_SHARD_ZERO2` (without)."""
    no_shard: bool = False
    """FSDP1 `NO_SHARD`: every rank holds the whole FlatParameters (DDP-like, all-reduce of the gradients)."""
    use_orig_params: bool = True
    """FSDP1 `use_orig_params` (transformers' and `accelerate launch`'s default: true)."""
    auto_wrap: str = "transformer"
    """`transformer`: each repeated block is a unit, then the root (TRANSFORMER_BASED_WRAP); `none`: the root only
    (NO_WRAP, accelerate's plugin default when the config names no policy)."""
    # FSDP gradient accumulation : default = what the Trainer runs
    sync_each_batch: bool = False
    """`TrainingArguments(accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": ...}})`
    (accelerate `GradientAccumulationPlugin.sync_each_batch`, default False): False runs the non-final micro-steps
    of a window under `no_sync`, keeping unsharded gradients (memfit.parallel.fsdp); True reduce-scatters each."""
    # DeepSpeed
    zero: ZeroSettings | None = None
    """Resolved ZeRO settings (`zero_settings_from_deepspeed`); None with a zero strategy: DeepSpeed's defaults in fp32
    (the CLI passes the Trainer's precision, as `"auto"` would)."""
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MemfitError(f"{name} `{v!r}` must be a whole number of at least 1")
        if self.world_size % self.nodes:
            raise MemfitError(f"world size `{self.world_size}` is not a multiple of nodes `{self.nodes}`; "
                              "give the same number of GPUs on each node")
        if self.strategy not in STRATEGIES:
            raise MemfitError(f"strategy `{self.strategy}` is not one of {', '.join(STRATEGIES)}")
        if self.bucket_cap_mb is not None and not (isinstance(self.bucket_cap_mb, (int, float))
                                                   and not isinstance(self.bucket_cap_mb, bool) and self.bucket_cap_mb > 0):
            raise MemfitError(f"bucket_cap_mb `{self.bucket_cap_mb!r}` must be a positive number of MiB (DDP's default is 25)")
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v not in (None, "fp32", "fp16", "bf16"):
                raise MemfitError(f"FSDP {name} `{v}` is not fp32, fp16 or bf16")
        if self.fsdp_version not in (1, 2):
            raise MemfitError(f"fsdp_version `{self.fsdp_version!r}` must be 1 (FSDP1) or 2 (FSDP2)")
        if self.no_shard and (self.fsdp_version != 1 or self.hybrid_shard):
            raise MemfitError("`NO_SHARD` is an FSDP1 strategy and excludes hybrid sharding; set fsdp_version 1 "
                              "or use `--strategy ddp`")
        if self.auto_wrap not in ("transformer", "none"):
            raise MemfitError(f"auto_wrap `{self.auto_wrap}` is not `transformer` or `none`")
        if self.strategy.startswith("zero"):
            stage = int(self.strategy[-1])
            if self.zero is None:
                object.__setattr__(self, "zero", ZeroSettings(stage=stage, dtype="fp32",
                                                              overlap_comm=stage == 3))
            elif self.zero.stage != stage:
                raise MemfitError(f"strategy `{self.strategy}` and the DeepSpeed config's stage `{self.zero.stage}` "
                                  f"differ; use --strategy zero{self.zero.stage} or change `zero_optimization.stage`")
            hpz = min(self.zero.hpz_partition_size, self.world_size)  # groups._create_zero_param_parallel_group: min
            if hpz > 1 and self.world_size % hpz:  # ... then _ensure_divisibility(world_size, size)
                raise MemfitError(f"`zero_hpz_partition_size` `{self.zero.hpz_partition_size}` does not divide the "
                                  f"world size `{self.world_size}` (DeepSpeed asserts it); use the GPUs of one node")

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def shard_size(self) -> int:
        """Ranks one FSDP shard group has: the node's GPUs with hybrid sharding, 1 with NO_SHARD, else all."""
        if self.no_shard:
            return 1
        return self.gpus_per_node if self.hybrid_shard else self.world_size

    @property
    def fsdp1_sharding_strategy(self) -> str:
        """The FSDP1 `ShardingStrategy` name these settings stand for."""
        if self.no_shard:
            return "NO_SHARD"
        if self.hybrid_shard:
            return "HYBRID_SHARD" if self.reshard_after_forward else "_HYBRID_SHARD_ZERO2"
        return "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"

    def replace(self, **changes: Any) -> "ParallelSetup":
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        out = asdict(self)
        out["notes"] = list(self.notes)
        return out


# the GPU part may hold spaces (`8xNVIDIA H100 80GB HBM3`): resolve_gpu reads it as it reads --gpu
_GPUS = re.compile(r"^\s*(\d+)\s*[x×*]\s*(\S.*?)\s*$", re.IGNORECASE)


def parse_gpus(text: str) -> tuple[int, str]:
    """`8xA100-80GB` -> (8, "A100-80GB"); the GPU is any name or size `--gpu` takes."""
    m = _GPUS.match(str(text))
    if not m or int(m.group(1)) < 1:
        raise MemfitError(f"--gpus `{text}` is not COUNTxGPU; write e.g. `8xA100-80GB`")
    return int(m.group(1)), m.group(2)


def read_json_file(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON object from a file, or a one-line MemfitError (memfit.files.read_json_object)."""
    return read_json_object(path, what, f"pass the {what} as a JSON object file")


def _count(value: Any, key: str, auto: int | None) -> int:
    """A DeepSpeed size (elements): an int, a float such as 5e8, or `"auto"` (filled with `auto`)."""
    if value == "auto":
        if auto is None:
            raise MemfitError(f"`zero_optimization.{key}` is `\"auto\"` but the model's config has no `hidden_size` "
                              "(transformers fills it from hidden_size); give a number")
        return int(auto)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise MemfitError(f"`zero_optimization.{key}` `{value!r}` must be a non-negative number of elements or \"auto\"")
    return int(value)


def _flag(value: Any, key: str, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    raise MemfitError(f"`{key}` `{value!r}` must be true or false")


def _offload(section: Any, key: str) -> bool:
    """`offload_optimizer` / `offload_param`: {"device": "cpu"|"none"|"nvme"}; nvme is not modelled."""
    if section is None:
        return False
    if not isinstance(section, dict):
        raise MemfitError(f"`zero_optimization.{key}` `{section!r}` must be an object such as {{\"device\": \"cpu\"}}")
    device = section.get("device", "none")
    if device in (None, "none"):
        return False
    if device == "cpu":
        return True
    if device == "nvme":
        raise MemfitError(f"`zero_optimization.{key}.device` `nvme` is not modelled by memfit; use `cpu` or `none`")
    raise MemfitError(f"`zero_optimization.{key}.device` `{device}` is not cpu, nvme or none")


def _torch_adam(config: dict[str, Any]) -> bool:
    opt = config.get("optimizer")
    if not isinstance(opt, dict):
        return False  # no optimizer section: the Trainer's own (adamw_torch_fused by default) is wrapped
    params = opt.get("params") or {}
    return bool(isinstance(params, dict) and params.get("torch_adam") is True)


def zero_settings_from_deepspeed(config: dict[str, Any] | str | Path, *, hidden_size: int | None,
                                 precision: str = "fp32", launcher_precision: str | None = None,
                                 via_accelerate: bool = False, source: str | None = None
                                 ) -> tuple[ZeroSettings, list[str]]:
    """The ZeRO settings of a DeepSpeed JSON, `"auto"` resolved as transformers resolves it.

    Args:
        config: the parsed JSON, or a path to it.
        hidden_size: the model config's `hidden_size` (or the largest of `hidden_sizes`), which the
            `"auto"` bucket sizes are computed from; None when the config has none.
        precision: the Trainer's mixed precision (`fp16`, `bf16`; `fp32`: neither set); the run's dtype is decided
            with the config's fp16 / bf16 sections by memfit.parallel.deepspeed_rules `deepspeed_precision`.
        launcher_precision: an accelerate config's `mixed_precision` (`fp16`, `bf16`, `fp32`) when one launches it.
        via_accelerate: the JSON comes from an accelerate config (`accelerate launch`), not `TrainingArguments`.
        source: where the JSON came from, for the messages (default: its path, else "the DeepSpeed config").

    Returns (settings, notes).
    """
    from memfit.parallel.deepspeed_rules import deepspeed_precision, unmodelled_key_notes

    if not isinstance(config, dict):
        source = source or f"`{config}`"
        config = read_json_file(config, "DeepSpeed config")
    notes: list[str] = []
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise MemfitError(f"`zero_optimization` `{zero!r}` in the DeepSpeed config must be an object")
    unknown = sorted(set(zero) - _ZERO_KEYS)
    if unknown:
        notes.append(f"DeepSpeed zero_optimization keys memfit does not model: {', '.join(unknown)}")
    stage = zero.get("stage", 0)
    if stage == "auto":
        raise MemfitError("`zero_optimization.stage` `\"auto\"` is not resolved by transformers; give 1, 2 or 3")
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise MemfitError(f"`zero_optimization.stage` `{stage!r}` must be 1, 2 or 3 (stage 0 is plain data "
                          "parallelism: use --strategy ddp)")
    source = source or "the DeepSpeed config"
    dtype, more = deepspeed_precision(config, trainer=precision, launcher=launcher_precision,
                                      via_accelerate=via_accelerate, source=source)
    notes += more + unmodelled_key_notes(config, source)
    h2 = hidden_size * hidden_size if hidden_size else None
    if "cpu_offload" in zero:  # legacy key (deepspeed/runtime/zero/config.py read_zero_config_deprecated)
        notes.append("`zero_optimization.cpu_offload` is DeepSpeed's deprecated spelling of offload_optimizer.device=cpu")
    settings = ZeroSettings(
        stage=int(stage), dtype=dtype,
        reduce_bucket_size=_count(zero.get("reduce_bucket_size", _DS_REDUCE_BUCKET_SIZE), "reduce_bucket_size", h2),
        allgather_bucket_size=_count(zero.get("allgather_bucket_size", _DS_ALLGATHER_BUCKET_SIZE),
                                     "allgather_bucket_size", None),
        prefetch_bucket_size=_count(zero.get("stage3_prefetch_bucket_size", _DS_PREFETCH_BUCKET_SIZE),
                                    "stage3_prefetch_bucket_size", int(0.9 * h2) if h2 else None),
        max_live_parameters=_count(zero.get("stage3_max_live_parameters", _DS_MAX_LIVE_PARAMETERS),
                                   "stage3_max_live_parameters", None),
        param_persistence_threshold=_count(zero.get("stage3_param_persistence_threshold", _DS_PERSISTENCE_THRESHOLD),
                                           "stage3_param_persistence_threshold",
                                           10 * hidden_size if hidden_size else None),
        sub_group_size=_count(zero.get("sub_group_size", _DS_SUB_GROUP_SIZE), "sub_group_size", None),
        max_reuse_distance=_count(zero.get("stage3_max_reuse_distance", _DS_MAX_REUSE_DISTANCE),
                                  "stage3_max_reuse_distance", None),
        torch_adam=_torch_adam(config),
        contiguous_gradients=_flag(zero.get("contiguous_gradients"), "zero_optimization.contiguous_gradients", True),
        overlap_comm=_flag(zero.get("overlap_comm"), "zero_optimization.overlap_comm", int(stage) == 3),
        offload_optimizer=_offload(zero.get("offload_optimizer"), "offload_optimizer") or bool(zero.get("cpu_offload")),
        offload_param=_offload(zero.get("offload_param"), "offload_param"),
        hpz_partition_size=_count(zero.get("zero_hpz_partition_size", 1), "zero_hpz_partition_size", None) or 1,
        quantized_weights=_flag(zero.get("zero_quantized_weights"), "zero_optimization.zero_quantized_weights", False),
        quantized_gradients=_flag(zero.get("zero_quantized_gradients"), "zero_optimization.zero_quantized_gradients",
                                  False),
    )
    if settings.stage != 3 and (settings.hpz_partition_size > 1 or settings.quantized_weights
                                or settings.quantized_gradients):
        # only DeepSpeedZeroOptimizer_Stage3 / zero.Init read them (stage3.py __init__, partition_parameters.py Init)
        notes.append(f"ZeRO++ settings (zero_hpz_partition_size, zero_quantized_weights/gradients) apply to stage 3 "
                     f"only; DeepSpeed ignores them at stage {stage}")
        settings = replace(settings, hpz_partition_size=1, quantized_weights=False, quantized_gradients=False)
    if settings.offload_param and settings.stage != 3:
        raise MemfitError(f"`zero_optimization.offload_param` needs stage 3 (the config has stage `{stage}`); "
                          "remove it or set `\"stage\": 3`")
    return settings, notes


_FSDP_OPTIONS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap")

#: FSDP1 strategies in `ShardingStrategy`'s order: accelerate/utils/constants.py FSDP_SHARDING_STRATEGY (an int n
#: names the n-th, as FullyShardedDataParallelPlugin.__post_init__ reads it), with (reshard_after_forward, hybrid,
#: no_shard) for each (torch/distributed/fsdp/api.py ShardingStrategy docs).
FSDP1_STRATEGIES = {"FULL_SHARD": (True, False, False), "SHARD_GRAD_OP": (False, False, False),
                    "NO_SHARD": (True, False, True), "HYBRID_SHARD": (True, True, False),
                    "HYBRID_SHARD_ZERO2": (False, True, False)}


def _bool_text(value: Any, key: str) -> bool:
    """transformers' `str_to_bool(str(value).lower())`."""
    text = str(value).lower()
    if text in ("true", "1", "yes", "y", "on", "t"):
        return True
    if text in ("false", "0", "no", "n", "off", "f"):
        return False
    raise MemfitError(f"fsdp_config `{key}` `{value!r}` must be true or false")


def fsdp1_strategy(value: Any, key: str = "sharding_strategy") -> str:
    """An FSDP1 strategy name (`FULL_SHARD`, `shard_grad_op`, `_HYBRID_SHARD_ZERO2`, or 1-5) as accelerate reads it."""
    text = str(value).strip().upper().removeprefix("SHARDINGSTRATEGY.").lstrip("_")
    names = list(FSDP1_STRATEGIES)
    if text.isdigit() and 1 <= int(text) <= len(names):
        return names[int(text) - 1]
    if text not in FSDP1_STRATEGIES:
        raise MemfitError(f"FSDP `{key}` `{value}` is not one of {', '.join(names)} (or 1-5)")
    return text


def _mixed_precision(mp: Any) -> tuple[str | None, str | None]:
    names = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}
    if mp is None:
        return None, None
    if isinstance(mp, str):
        mp = {"param_dtype": mp, "reduce_dtype": mp}
    if not isinstance(mp, dict):
        raise MemfitError(f"fsdp_config `mixed_precision_policy` `{mp!r}` must be an object or a dtype name")
    out = []
    for key in ("param_dtype", "reduce_dtype"):
        v = mp.get(key)
        if v is not None and str(v).removeprefix("torch.") not in names:
            raise MemfitError(f"fsdp_config mixed precision `{key}` `{v}` is not bfloat16, float16 or float32")
        out.append(names[str(v).removeprefix("torch.")] if v is not None else None)
    return out[0], out[1]


def _auto_wrap(cfg: dict[str, Any], default: str) -> str:
    """`auto_wrap_policy` (accelerate/utils/constants.py FSDP_AUTO_WRAP_POLICY) as memfit's `auto_wrap`."""
    policy = str(cfg.get("auto_wrap_policy", default)).upper()
    if policy == "TRANSFORMER_BASED_WRAP":
        return "transformer"
    if policy == "NO_WRAP":
        return "none"
    if policy == "SIZE_BASED_WRAP":
        raise MemfitError("fsdp `auto_wrap_policy` `SIZE_BASED_WRAP` is not modelled by memfit; use "
                          "`TRANSFORMER_BASED_WRAP` (each decoder block a unit) or `NO_WRAP`")
    raise MemfitError(f"fsdp `auto_wrap_policy` `{cfg.get('auto_wrap_policy')}` is not TRANSFORMER_BASED_WRAP, "
                      "SIZE_BASED_WRAP or NO_WRAP")


def fsdp1_effective_strategy(requested: str | None, env: Mapping[str, str] | None) -> tuple[str, list[str]]:
    """The FSDP1 strategy accelerate 1.15 runs, and a note when it is not the one asked for.

    `FullyShardedDataParallelPlugin.__post_init__` (accelerate/utils/dataclasses.py) sets `sharding_strategy` from
    the environment's `FSDP_SHARDING_STRATEGY` (default `FULL_SHARD`) whenever it is not passed, before the
    `reshard_after_forward` fallback, and `Accelerator.prepare_model` passes `sharding_strategy or
    reshard_after_forward`: transformers' `reshard_after_forward` (from `fsdp="shard_grad_op"` or
    fsdp_config) and an accelerate config's `fsdp_reshard_after_forward` do not reach FSDP1 (checked by building
    the plugin: `FullyShardedDataParallelPlugin(fsdp_version=1, reshard_after_forward="SHARD_GRAD_OP")
    .sharding_strategy` is `FULL_SHARD`)."""
    env = os.environ if env is None else env
    effective = fsdp1_strategy(env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD"), "FSDP_SHARDING_STRATEGY")
    notes = []
    if requested is not None and requested != effective:
        notes.append(f"FSDP1 runs `{effective}`, not the `{requested}` asked for: accelerate's plugin takes "
                     f"`sharding_strategy` from FSDP_SHARDING_STRATEGY (default FULL_SHARD) before "
                     f"`reshard_after_forward`; set `FSDP_SHARDING_STRATEGY={requested}` (or an accelerate config's "
                     f"`fsdp_sharding_strategy`) to get it")
    return effective, notes


def fsdp_parallel(*, version: int, reshard_after_forward: bool, hybrid: bool, no_shard: bool, cfg: dict[str, Any],
                  world_size: int, nodes: int, auto_wrap: str, notes: list[str]) -> ParallelSetup:
    """A ParallelSetup for FSDP from resolved strategy flags and the un-prefixed fsdp_config `cfg` (offload, mixed
    precision, use_orig_params, activation checkpointing)."""
    offload = _bool_text(cfg.get("cpu_offload", cfg.get("offload_params", False)), "cpu_offload")
    param_dtype, reduce_dtype = _mixed_precision(cfg.get("mixed_precision_policy") or cfg.get("mixed_precision"))
    if _bool_text(cfg.get("activation_checkpointing", False), "activation_checkpointing"):
        notes.append("fsdp_config activation_checkpointing: simulated as gradient checkpointing of each block")
    use_orig = _bool_text(cfg.get("use_orig_params", True), "use_orig_params")
    if hybrid and nodes == 1:
        notes.append("hybrid sharding on one node: the shard group is the node, as full sharding")
    return ParallelSetup(world_size=world_size, nodes=nodes, strategy="fsdp", reshard_after_forward=reshard_after_forward,
                         cpu_offload=offload, param_dtype=param_dtype, reduce_dtype=reduce_dtype, fsdp_version=version,
                         hybrid_shard=hybrid, no_shard=no_shard, use_orig_params=use_orig, auto_wrap=auto_wrap,
                         notes=tuple(notes))


def parallel_from_fsdp_args(fsdp: str | list[str] | bool, fsdp_config: dict[str, Any] | str | Path | None = None, *,
                            world_size: int = 1, nodes: int = 1,
                            env: Mapping[str, str] | None = None) -> tuple[ParallelSetup, list[str]]:
    """`TrainingArguments(fsdp=..., fsdp_config=...)` as memfit's FSDP settings (transformers 5.24
    `TrainingArguments._process_fsdp_args` and `_apply_legacy_fsdp_to_config`).

    `fsdp_config["version"]` defaults to 2 (`int(self.fsdp_config.get("version", 2))`). FSDP2: `"full_shard"` ->
    `reshard_after_forward=True`, `"shard_grad_op"` -> False; the other strategies raise there ("only available with
    FSDP1"). FSDP1: the strategy name is passed as `reshard_after_forward`, which accelerate 1.15 does not use
    (`fsdp1_effective_strategy`); `use_orig_params` defaults to true. `auto_wrap_policy` defaults to
    TRANSFORMER_BASED_WRAP (each `_no_split_modules` block a unit).

    Args:
        fsdp: `"full_shard auto_wrap"`, a list of such options, or True (everything from fsdp_config).
        fsdp_config: a dict, or the path of a JSON file, as TrainingArguments takes it.
        world_size: ranks in all.
        nodes: nodes the ranks are spread over.
        env: the environment FSDP1's strategy is read from (`FSDP_SHARDING_STRATEGY`; default os.environ).

    Returns (settings, notes); `activation_checkpointing: true` is a note telling the caller to turn on
    gradient checkpointing in the TrainSetup (FSDP's own checkpointing recomputes each block as HF's does).
    """
    if fsdp_config is None:
        cfg: dict[str, Any] = {}
    elif isinstance(fsdp_config, dict):
        cfg = dict(fsdp_config)
    else:
        cfg = read_json_file(fsdp_config, "fsdp_config")
    cfg = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in cfg.items()}
    notes: list[str] = []
    version = cfg.get("version", 2)
    if str(version) not in ("1", "2"):
        raise MemfitError(f"fsdp_config `version` `{version}` must be 1 (FSDP1) or 2 (FSDP2, transformers' default)")
    version = int(version)
    if fsdp is True:
        items: list[str] = []
    elif isinstance(fsdp, str):
        items = fsdp.split()
    elif isinstance(fsdp, (list, tuple)):
        items = [str(x) for x in fsdp]
    else:
        raise MemfitError(f"fsdp `{fsdp!r}` must be options such as `full_shard auto_wrap`, or true")
    for item in items:
        if item not in _FSDP_OPTIONS:
            raise MemfitError(f"fsdp option `{item}` is not one of {', '.join(_FSDP_OPTIONS)}")
        if item in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"):
            if version == 2:
                if item not in ("full_shard", "shard_grad_op"):
                    raise MemfitError(f"fsdp option `{item}` is FSDP1-only in transformers 5 "
                                      "(`_apply_legacy_fsdp_to_config`); set fsdp_config `\"version\": 1`, or use "
                                      "`full_shard` / `shard_grad_op` with FSDP2")
                cfg.setdefault("reshard_after_forward", item == "full_shard")
            else:
                cfg.setdefault("reshard_after_forward", item)
        elif item == "offload":
            cfg.setdefault("cpu_offload", True)
    auto_wrap = _auto_wrap(cfg, "TRANSFORMER_BASED_WRAP")  # transformers' default (FSDP_AUTO_WRAP_POLICY[0])
    if version == 2:
        reshard = _bool_text(cfg.get("reshard_after_forward", True), "reshard_after_forward")
        par = fsdp_parallel(version=2, reshard_after_forward=reshard, hybrid=False, no_shard=False, cfg=cfg,
                            world_size=world_size, nodes=nodes, auto_wrap=auto_wrap, notes=notes)
        return par, notes
    requested = fsdp1_strategy(cfg.get("reshard_after_forward", "full_shard"), "reshard_after_forward")
    strategy, more = fsdp1_effective_strategy(requested, env)
    notes += more
    reshard, hybrid, no_shard = FSDP1_STRATEGIES[strategy]
    par = fsdp_parallel(version=1, reshard_after_forward=reshard, hybrid=hybrid, no_shard=no_shard, cfg=cfg,
                        world_size=world_size, nodes=nodes, auto_wrap=auto_wrap, notes=notes)
    return par, notes


# -- FSDP gradient accumulation  --------------------------------------------------------
def sync_each_batch_from(accelerator_config: Any) -> bool:
    """`TrainingArguments(accelerator_config=...)`'s `gradient_accumulation_kwargs["sync_each_batch"]`: a dict, the
    path of a JSON file (TrainingArguments reads one: `AcceleratorConfig.from_json_file`), an `AcceleratorConfig`, or
    None; False when unset (accelerate `GradientAccumulationPlugin.sync_each_batch` default). An accelerate config
    file has no key for it (accelerate 1.15 `accelerate config` / `launch` pass only the step count,
    `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`)."""
    if accelerator_config is None:
        return False
    if isinstance(accelerator_config, (str, Path)):
        accelerator_config = read_json_file(accelerator_config, "accelerator_config")
    if isinstance(accelerator_config, Mapping):
        kwargs = accelerator_config.get("gradient_accumulation_kwargs")
    else:
        kwargs = getattr(accelerator_config, "gradient_accumulation_kwargs", None)
    if kwargs is None:
        return False
    if not isinstance(kwargs, Mapping):
        raise MemfitError(f"accelerator_config `gradient_accumulation_kwargs` `{kwargs!r}` must be an object such as "
                          "{\"sync_each_batch\": true}")
    return _flag(kwargs.get("sync_each_batch"), "gradient_accumulation_kwargs.sync_each_batch", False)


# -- TrainingArguments' engine settings: one reader for a flag, an arguments file and a TrainingArguments object --
#: TrainingArguments names that choose or configure the multi-GPU engine (not TrainSetup fields).
ENGINE_ARGS = ENGINE_ARG_NAMES


def _arg(args: Any, name: str) -> Any:
    value = args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)
    if name == "fsdp" and isinstance(value, (list, tuple)):  # TrainingArguments holds FSDPOption enums
        value = [str(getattr(v, "value", v)) for v in value]
    return None if value in (None, "", [], False) else value


def parallel_from_training_args(args: Any, *, world_size: int, nodes: int = 1, precision: str = "fp32",
                                hidden_size: int | None = None, base_dir: str | Path | None = None,
                                env: Mapping[str, str] | None = None) -> tuple[ParallelSetup | None, list[str]]:
    """The ParallelSetup `TrainingArguments(deepspeed=..., fsdp=..., fsdp_config=..., ddp_bucket_cap_mb=...)` runs,
    from a dict of its kwargs (an `--args` file) or the object itself; None when it sets no engine and
    `world_size` is 1. The same readers as the `--deepspeed` / `--fsdp` / `--fsdp-config` flags.

    Args:
        args: a Mapping of TrainingArguments kwargs, or a TrainingArguments (TRL config) object.
        world_size: ranks in all (TrainingArguments does not know it before launch).
        nodes: nodes the ranks are spread over.
        precision: the Trainer's precision (`fp16`, `bf16`; `fp32`: neither), for DeepSpeed's dtype.
        hidden_size: the model config's hidden size, for DeepSpeed's `"auto"` bucket sizes.
        base_dir: a relative `deepspeed` / `fsdp_config` path not found as given is looked up here (the
            arguments file's folder), with a note.
        env: the environment FSDP1 reads its strategy from (default os.environ).
    """
    notes: list[str] = []

    def located(value: Any, name: str) -> Any:
        if isinstance(value, (str, Path)) and base_dir is not None:
            path = Path(value)
            if not path.is_absolute() and not path.exists() and (Path(base_dir) / path).exists():
                notes.append(f"`{name}` `{value}` read from the arguments file's folder")
                return str(Path(base_dir) / path)
        return value

    ds, fsdp = _arg(args, "deepspeed"), _arg(args, "fsdp")
    fsdp_config = located(_arg(args, "fsdp_config"), "fsdp_config")
    for name, value, kinds, what in (("deepspeed", ds, (str, Path, dict), "the path of a DeepSpeed JSON or its dict"),
                                     ("fsdp", fsdp, (str, list, tuple, bool), "options such as `full_shard auto_wrap`"),
                                     ("fsdp_config", fsdp_config, (str, Path, dict), "the path of a JSON or its dict")):
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and name != "fsdp")):
            raise MemfitError(f"TrainingArguments `{name}` `{value!r}` must be {what}")
    cap = _arg(args, "ddp_bucket_cap_mb")
    if ds is not None and fsdp is not None:
        raise MemfitError("`deepspeed` and `fsdp` are both set: they are two engines (transformers runs one); "
                          "give one")
    if ds is not None:
        zero, more = zero_settings_from_deepspeed(located(ds, "deepspeed"), hidden_size=hidden_size,
                                                  precision=precision)
        return ParallelSetup(world_size=world_size, nodes=nodes, strategy=f"zero{zero.stage}", zero=zero,
                             notes=tuple(notes + more)), notes + more
    if fsdp is not None:
        par, more = parallel_from_fsdp_args(True if fsdp is True else fsdp, fsdp_config, world_size=world_size,
                                            nodes=nodes, env=env)
        par = par.replace(sync_each_batch=sync_each_batch_from(_arg(args, "accelerator_config")))
        if par.param_dtype is None and precision in ("fp16", "bf16"):
            # accelerate state.py: fsdp_plugin.set_mixed_precision(mixed_precision) unless fsdp_config gives a policy
            par = par.replace(param_dtype=precision, reduce_dtype=precision)
        return par.replace(notes=tuple(notes + more)), notes + more
    if world_size == 1 and nodes == 1:
        return None, notes
    return ParallelSetup(world_size=world_size, nodes=nodes, strategy="ddp", bucket_cap_mb=cap), notes
