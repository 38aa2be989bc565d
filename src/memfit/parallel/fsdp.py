"""FSDP2 per rank from its real code: `fully_shard` runs under FakeTensorMode on a fake process group.

The simulated model is wrapped as transformers 5 / accelerate wrap it for FSDP2 (each repeated
block — the `_no_split_modules` decoder layers `auto_wrap` selects — then the root), with
`reshard_after_forward`, `MixedPrecisionPolicy` and `CPUOffloadPolicy` from the ParallelSetup; then
the usual simulated training step runs (memfit.sim.engine). Rank 0 of `world_size` ranks is what
runs: its parameter, gradient and optimizer-state shards, the all-gather outputs and unsharded
parameters during forward and backward (freed after each block with `reshard_after_forward=True`),
and the reduce-scatter inputs of the backward all appear in the trace as FSDP2 allocates them
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_all_gather`,
`foreach_reduce`). The fake process group's collectives move no data, so values are garbage and
shapes exact.

Known limitations: layer splicing is off (each block runs: seconds for 7B models); accelerate's
gradient accumulation is taken to reduce-scatter every micro-step (no `set_requires_gradient_sync`
saving); with `cpu_offload` the sharded parameters and optimizer state are moved out of the trace
(host), and the sharded gradients are still counted on the GPU (a bound).
"""

from __future__ import annotations

import torch

from memfit.models.blocks import repeated_layer_lists
from memfit.parallel import _dist_adapter as dadapter
from memfit.parallel.setup import ParallelSetup
from memfit.sim.engine import Simulation, _Runner
from memfit.sim.tracker import StorageTracker
from memfit.sim.quiet import quiet_upstream
from memfit.train_setup import TrainSetup

__all__ = ["simulate_fsdp", "ShardTracker"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ShardTracker(StorageTracker):
    """StorageTracker that sees a DTensor as its local shard (the bytes this rank holds)."""

    def _see(self, t):
        super()._see(dadapter.local_tensor(t))

    def register(self, tensor, category):
        return super().register(dadapter.local_tensor(tensor), category)

    def record_of(self, tensor):
        return super().record_of(dadapter.local_tensor(tensor))

    def bind(self, tensor, rec):
        return super().bind(dadapter.local_tensor(tensor), rec)

    def forget(self, tensor):
        return super().forget(dadapter.local_tensor(tensor))

    def ignore(self, tensor):
        return super().ignore(dadapter.local_tensor(tensor))

    # FSDP2's resize-based frees and re-allocations (dadapter.fsdp_storage_hooks)
    def storage_freed(self, tensor) -> None:
        rec = super().record_of(tensor)
        if rec is not None and not self.paused:
            # only unsharded parameters (all-gather outputs) are freed by a resize: weights for their whole life,
            # also the first one, which an op made (a temporary, or an activation when alive across the forward)
            rec.category = "weights"
            self._free(rec)

    def storage_allocated(self, tensor) -> None:
        if self.paused:
            return
        storage = tensor.untyped_storage()
        rec = self._ids.get(storage)
        if rec is None or not rec.alive:
            self._new(storage, "weights")
        else:
            rec.category = "weights"


class _FsdpRunner(_Runner):
    def __init__(self, setup: TrainSetup, parallel: ParallelSetup, mesh) -> None:
        super().__init__(setup, fake=True, splice=False)
        self.tracker = ShardTracker()
        self.parallel = parallel
        self.mesh = mesh

    def _shard(self) -> None:
        p = self.parallel
        kwargs = {"mesh": self.mesh, "reshard_after_forward": p.reshard_after_forward}
        if p.param_dtype or p.reduce_dtype:
            kwargs["mp_policy"] = dadapter.mixed_precision_policy(_DTYPES.get(p.param_dtype), _DTYPES.get(p.reduce_dtype))
        if p.cpu_offload:
            kwargs["offload_policy"] = dadapter.cpu_offload_policy()
        for _, blocks in repeated_layer_lists(self.model):
            for block in blocks:
                dadapter.fully_shard(block, **kwargs)
        dadapter.fully_shard(self.model, **kwargs)

    def _materialize(self) -> None:
        self.tracker.paused = True
        self._shard()
        self.tracker.paused = False
        super()._materialize()

    def optimizer_step(self) -> None:
        super().optimizer_step()
        if self.parallel.cpu_offload:  # CPUOffloadPolicy: shards and optimizer state live in host memory
            tr = self.tracker
            for param in self.model.parameters():
                rec = tr.record_of(param)
                if rec is not None:
                    rec.category = "host"
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        rec = tr.record_of(v)
                        if rec is not None:
                            rec.category = "host"


def simulate_fsdp(setup: TrainSetup, parallel: ParallelSetup, *, optimizer_steps: int = 2) -> Simulation:
    """Rank 0's simulated trace under FSDP2 (module docstring)."""
    with quiet_upstream(), dadapter.fake_process_group(parallel.world_size) as mesh:
        runner = _FsdpRunner(setup, parallel, mesh)
        tracker = runner.tracker
        with dadapter.fsdp_storage_hooks(tracker.storage_allocated, tracker.storage_freed):
            return runner.run(optimizer_steps=optimizer_steps)
