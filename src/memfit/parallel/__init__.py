"""Per-rank memory beyond one GPU: DDP, FSDP2 and DeepSpeed ZeRO-1/2/3.

    from memfit import estimate
    from memfit.parallel import ParallelSetup
    report = estimate("meta-llama/Llama-3.2-1B", gpu="A100-80GB", parallel=ParallelSetup(world_size=8, strategy="fsdp"))
    report.parallel["rank0_device_used_bytes"], report.parallel["host_bytes_per_node"]

Modules: `setup` (the settings and their parsing: DeepSpeed JSON with transformers' `"auto"`,
`TrainingArguments(deepspeed=..., fsdp=..., fsdp_config=...)`), `deepspeed_rules` (what transformers and accelerate
do to a DeepSpeed config: its precision, batch keys, the keys that change memory), `accelerate_config` (accelerate config files as `accelerate
launch` reads them), `_dist_adapter` (the one module touching private
torch.distributed), `fsdp` (FSDP2's `fully_shard` and FSDP1's `FullyShardedDataParallel`, real, under fake
tensors and a fake process group; hybrid sharding on a 2-D mesh),
`ddp` (DDP's gradient buckets, assigned by DDP's own C++ function), `zero` (ZeRO-1/2/3 emulated from
DeepSpeed's source; DeepSpeed's own model-state estimators reproduced), `nccl` (NCCL's buffers outside
PyTorch) and `rank` (the trace one rank sees). Importing this package does not import torch.
"""

from memfit.parallel.accelerate_config import AccelerateConfig, parallel_from_accelerate_config
from memfit.parallel.setup import (STRATEGIES, ParallelSetup, ZeroSettings, parallel_from_fsdp_args,
                                   parallel_from_training_args, parse_gpus, zero_settings_from_deepspeed)

__all__ = ["ParallelSetup", "ZeroSettings", "STRATEGIES", "parse_gpus", "zero_settings_from_deepspeed",
           "parallel_from_fsdp_args", "parallel_from_training_args", "parallel_from_accelerate_config",
           "AccelerateConfig"]
