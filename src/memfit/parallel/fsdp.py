"""FSDP2 and FSDP1 per rank from their real code, under FakeTensorMode on a fake process group.

FSDP1 (`FullyShardedDataParallel`) runs too: on the materialized fake model (its
FlatParameters flatten real storages), wrapped as accelerate's `prepare_model` wraps it, so its own
`_flat_param.py` makes each unit's FlatParameter (padded to a multiple of the shard group:
`FlatParamHandle._get_shard`), shards it, and all-gathers the padded unsharded FlatParameter before each
unit runs (freed after it with FULL_SHARD / HYBRID_SHARD, kept from forward to backward with SHARD_GRAD_OP);
NO_SHARD keeps whole FlatParameters; `use_orig_params` decides whether Adam sees the FlatParameters or views
of them. One FSDP1 behaviour the engine's replay of later micro-steps would miss is redone here: with
`use_orig_params` the FlatParameter keeps its sharded gradient after `zero_grad` until the next forward
(`_reset_flat_param_grad_info_if_needed`). Hybrid sharding (FSDP2 HSDP, FSDP1 HYBRID_SHARD) runs on a 2-D
(replicate, shard) mesh: shards are of the node's GPUs, the replicas all-reduce.

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

Layer splicing (memfit.sim.splice): FSDP2 runs the cut model (5 blocks per repeated stack), sharded as the model
is, and writes the full model's trace; the blocks' tags enclose FSDP2's own hooks, so each block's all-gather,
reshard and reduce-scatter belong to it, and the backward prefetch of block i - 1 from block i is a reference one
block back, which the splice resolves by offset (tests/parallel/test_fsdp_splice.py: the spliced trace is the full
model's, event for event). Not spliced (`splice_allowed`): FSDP1 (its FlatParameters span a unit's real storages),
CPU offload, quantized weights, `no_sync` micro-steps (their unsharded gradients outlive the micro-step), and the
trainers whose second model the splice does not tag (DPO, KTO, distillation).

Known limitations: FSDP1 with CPU offload is refused (its pinned host shards do not run on fake tensors); with
`cpu_offload` the sharded parameters and optimizer state are moved out of the trace (host), and the sharded
gradients are still counted on the GPU (a bound).

Gradient accumulation : the Trainer runs every micro-step but the window's last
under `accelerator.no_sync(model)` unless `accelerator_config={"gradient_accumulation_kwargs":
{"sync_each_batch": True}}` (transformers 5.24 trainer.py `_inner_training_loop`: `sync_each_batch`, DeepSpeed or
the last batch -> `nullcontext`, else `functools.partial(self.accelerator.no_sync, model=model)`), and accelerate
1.15 `Accelerator.no_sync` calls `model.set_requires_gradient_sync(False)` for FSDP2 (`model.no_sync()` for
FSDP1). So does the simulation (`ParallelSetup.sync_each_batch`): with accumulation > 1 its first micro-step runs
without gradient sync, keeping the unsharded gradients (FSDP2 `_fsdp_param_group.py` `post_backward`: no
reduce-scatter when not `reduce_grads`; `_fsdp_param.py` `to_accumulated_grad_if_needed` /
`unsharded_accumulated_grad` with a reduce dtype; FSDP1 `_runtime_utils.py` `_post_backward_hook` returns
before `_reduce_grad` when not `_sync_gradients`), and its second one is the window's last (reduce-scatter of
the accumulated gradients). The micro-steps between (accumulation > 2) repeat the first with the unsharded
gradients already held and accumulate into them; the last one holds them too and adds the reduce-scatter,
so it bounds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from memfit.errors import MemfitError
from memfit.models.blocks import repeated_layer_lists
from memfit.models.resolve import resolve
from memfit.parallel import _dist_adapter as dadapter
from memfit.parallel.setup import ParallelSetup
from memfit.sim import trl_steps
from memfit.sim.engine import Simulation, _Runner
from memfit.sim.splice import SpliceRefused
from memfit.sim.tracker import StorageTracker
from memfit.sim.quiet import isolated_simulation
from memfit.train_setup import TrainSetup

if TYPE_CHECKING:
    from memfit.gpus.catalog import GpuSpec

__all__ = ["simulate_fsdp", "ShardTracker", "accumulation_note"]

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
            self._new(storage, "weights", tensor)
        else:
            rec.category = "weights"


def _fsdp1_dtype_error(message: str, setup: TrainSetup) -> str:
    """One line for FSDP1's refusal to flatten a unit (`_flat_param.py` `_validate_tensors_to_flatten`: "Cannot
    flatten integer dtype tensors", "Must flatten tensors with uniform dtype but got A and B")."""
    if "but got" in message:
        got = "tensors of " + message.split("but got", 1)[-1].strip().rstrip(".")
    else:
        got = "integer tensors (FSDP1 flattens floating ones only)"
    fix = "load the model in one dtype (`--weights-dtype`)"
    if setup.load_in_4bit:
        fix = ("with QLoRA set `bnb_4bit_quant_storage` to the model's dtype (`--bnb-4bit-quant-storage bfloat16 "
               "--weights-dtype bf16`, peft's FSDP-QLoRA guide) and leave out prepare_model_for_kbit_training's fp32 "
               "casts (`--no-kbit-prep`; TRL's SFTTrainer skips it for sharded QLoRA), or use FSDP2")
    elif setup.kbit_prep and setup.load_in_8bit:
        fix = "8-bit weights cannot share an FSDP1 unit with floating parameters; use FSDP2 or DDP"
    return f"FSDP1 flattens each wrapped unit into one FlatParameter of one dtype, and a unit holds {got}; {fix}"


def _whole_4bit_note(count: int, storage: str) -> str:
    return (f"FSDP2 leaves the {count} 4-bit weights of `bnb_4bit_quant_storage` `{storage}` out of its sharding "
            "(accelerate `fsdp2_prepare_model`: non-floating Params4bit -> `ignored_params`), so every rank holds the "
            "whole quantized model; `bnb_4bit_quant_storage` bf16 (the compute dtype, as peft's and accelerate's "
            "FSDP-QLoRA guides set it) shards them")


def _peft_fsdp1_policies(model, setup: TrainSetup, parallel: ParallelSetup):
    """(auto-wrap policy or None, param dtype, reduce dtype) of FSDP1 as the Trainer prepares a peft model.

    transformers 5.24 trainer.py `_inner_training_loop`: with FSDP1 (`delay_optimizer_creation`; FSDP2 does not
    delay it) and a `PeftModel`, `update_fsdp_plugin_peft` (transformers/distributed/fsdp.py) runs before
    `accelerator.prepare`: the plugin's policy becomes peft's `fsdp_auto_wrap_policy(model)` (peft utils/other.py:
    each leaf module with a trainable `weight`, the adapters, is a unit of its own, or-ed with the
    `_no_split_modules` blocks), whatever the config named; and a bitsandbytes model whose `bnb_4bit_quant_storage`
    is a floating dtype gets that dtype as its mixed precision (`set_mixed_precision(storage, override=True)`:
    param, reduce and buffer dtype)."""
    param_dtype, reduce_dtype = _DTYPES.get(parallel.param_dtype), _DTYPES.get(parallel.reduce_dtype)
    if setup.lora_r is None and not setup.peft_config:
        return None, param_dtype, reduce_dtype
    from peft import PeftModel
    from peft.utils.other import fsdp_auto_wrap_policy

    if not isinstance(model, PeftModel):
        return None, param_dtype, reduce_dtype
    storage = getattr(torch, setup.bnb_4bit_quant_storage)
    if (setup.load_in_4bit or setup.load_in_8bit) and storage.is_floating_point:
        param_dtype = reduce_dtype = storage
    return fsdp_auto_wrap_policy(model), param_dtype, reduce_dtype


def _upcast_trainable(model: torch.nn.Module) -> int:
    """accelerate 1.16 `fsdp2_prepare_model` under mixed precision (not for a model with 4-bit weights): every
    trainable parameter that is not fp32 becomes fp32 before `fully_shard` ("Upcast to fp32 master weights;
    MixedPrecisionPolicy.param_dtype handles compute cast"). Returns the number of parameters upcast."""
    from memfit.sim import _torch_adapter as adapter

    count = 0
    with adapter.outside_fake_mode():  # the model is still on the meta device: its parameters stay meta tensors
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
                count += 1
    return count


class _FsdpRunner(_Runner):
    def __init__(self, setup: TrainSetup, parallel: ParallelSetup, mesh, gpu: GpuSpec | None = None, *,
                 splice: bool = False) -> None:
        super().__init__(setup, fake=True, splice=splice, gpu=gpu)
        self.tracker = ShardTracker()
        if self.cut is not None:
            self.tagger.tracker = self.tracker
            self.tracker.tag_fn = self.tagger.current
        if parallel.param_dtype is None and parallel.reduce_dtype is None and setup.precision in ("fp16", "bf16"):
            # accelerate state.py: `fsdp_plugin.set_mixed_precision(mixed_precision)` unless a policy is given
            # (as parallel_from_training_args does; `--strategy fsdp` alone comes here without one)
            parallel = parallel.replace(param_dtype=setup.precision, reduce_dtype=setup.precision)
        self.parallel = parallel
        self.mesh = mesh
        self._micro_steps_run = 0

    def _shard(self) -> None:
        p = self.parallel
        kwargs = {"mesh": self.mesh, "reshard_after_forward": p.reshard_after_forward}
        if p.param_dtype or p.reduce_dtype:
            kwargs["mp_policy"] = dadapter.mixed_precision_policy(_DTYPES.get(p.param_dtype), _DTYPES.get(p.reduce_dtype))
        if p.cpu_offload:
            kwargs["offload_policy"] = dadapter.cpu_offload_policy()
        if self.quant is not None and self.quant.bits == 4:
            # 4-bit weights shard as plain parameters of their packed storage; those of a storage that is not
            # floating stay whole on every rank (memfit.models.quantization.plain_4bit_weights)
            from memfit.models.quantization import plain_4bit_weights

            whole = plain_4bit_weights(self.model)
            if whole:
                kwargs["ignored_params"] = set(whole)
                self.notes.append(_whole_4bit_note(len(whole), self.setup.bnb_4bit_quant_storage))
        upcast = self.setup.precision in ("fp16", "bf16") and not (self.quant is not None and self.quant.bits == 4)
        if upcast:
            self._note_upcast(_upcast_trainable(self.model))
        for model in (self.model, self.cut):  # the cut model (spliced: `splice_allowed`) is sharded as the model is
            if model is None:
                continue
            if model is self.cut and upcast:
                _upcast_trainable(model)
            if p.auto_wrap == "transformer":  # NO_WRAP: the root only (accelerate fsdp2_prepare_auto_wrap_policy: None)
                for _, blocks in repeated_layer_lists(model):
                    for block in blocks:
                        dadapter.fully_shard(block, **kwargs)
            dadapter.fully_shard(model, **kwargs)
        if self.cut is not None:
            # the blocks' tags enclose FSDP2's own hooks (its pre-forward hook is prepended, its post-forward hook
            # appended: torch/distributed/fsdp/_fully_shard/_fsdp_state.py), so that each block's all-gather,
            # reshard and post-backward reduce-scatter are tagged with the block
            self.tagger.rehook()

    def _wrap_fsdp1(self) -> None:
        """FSDP1 on the materialized (fake) model: FlatParameters built and sharded by FSDP1's own code, with the
        policies the Trainer gives a peft model (`_peft_fsdp1_policies`)."""
        p = self.parallel
        classes = None
        if p.auto_wrap == "transformer":
            classes = {type(b) for _, blocks in repeated_layer_lists(self.model) for b in blocks} or None
        policy, param_dtype, reduce_dtype = _peft_fsdp1_policies(self.model, self.setup, p)
        try:
            self.model = dadapter.fsdp1_wrap(self.model, block_classes=classes,
                                             sharding_strategy=p.fsdp1_sharding_strategy, mesh=self.mesh,
                                             use_orig_params=p.use_orig_params, cpu_offload=p.cpu_offload,
                                             param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                             auto_wrap_policy=policy)
        except ValueError as err:
            if "uniform dtype" not in str(err) and "integer dtype" not in str(err):
                raise
            raise MemfitError(_fsdp1_dtype_error(str(err), self.setup)) from err
        if self.setup.precision in ("fp16", "bf16"):
            self._note_upcast(dadapter.fsdp1_upcast_flat_params(self.model))
        self.fwd_model = self.model  # the Trainer calls the wrapped model (accelerator.prepare)

    def _note_upcast(self, count: int) -> None:
        if count:
            self.notes.append(f"FSDP keeps fp32 master weights: accelerate upcasts the {count} trainable "
                              f"{'FlatParameters' if self.parallel.fsdp_version == 1 else 'parameters'} that are not "
                              f"fp32 under `{self.setup.precision}` mixed precision, so their shards, gradients and "
                              "optimizer states are fp32; compute runs in the mixed-precision param dtype")

    def _materialize(self) -> None:
        self.tracker.paused = True
        if self.parallel.fsdp_version == 1:
            # FSDP1 flattens real storages: materialize first (paused: a real rank moves one unit at a time to its GPU
            # and keeps only the shard), wrap, then the base registers what the wrapped model holds
            from unittest import mock

            from memfit.models.build import to_empty_tied
            from memfit.sim import engine

            # (4-bit weights become plain Parameters of their storage here; memfit.models.quantization `capture`
            # reads their quantization state from the module)
            to_empty_tied(self.model, device="cpu")
            self._wrap_fsdp1()
            self.tracker.paused = False
            with mock.patch.object(engine, "to_empty_tied", lambda module, device: module):
                super()._materialize()
            return
        self._shard()
        self.tracker.paused = False
        super()._materialize()

    def _no_sync(self, accumulation: int) -> bool:
        """Whether this micro-step runs under accelerate's `no_sync` (module docstring: the simulated window is
        one such micro-step, then the last, which syncs)."""
        return accumulation > 1 and not self.parallel.sync_each_batch and self._micro_steps_run == 0

    def micro_step(self, accumulation: int) -> None:
        if not self._no_sync(accumulation):
            self._micro_steps_run += 1
            super().micro_step(accumulation)
            return
        self._micro_steps_run += 1
        with dadapter.fsdp_no_sync(self.model, self.parallel.fsdp_version):
            super().micro_step(accumulation)
        tr = self.tracker
        for grad in dadapter.fsdp_unsharded_grads(self.model):  # kept to the window's last micro-step
            rec = tr.record_of(grad)
            if rec is not None:
                rec.category = "gradients"
        # the gradients the optimizer steps on (and that replayed windows bind) are those of the syncing micro-step:
        # under no-sync the parameters have none (FSDP2) or views of the unsharded FlatParameter gradient (FSDP1)
        self.grad_recs = None

    def _release_fsdp1_grads(self) -> None:
        """FSDP1 with use_orig_params keeps the sharded gradients after zero_grad until the next forward (of training
        or evaluation) begins; the engine replays later micro-steps instead of running them, so it is done here."""
        if self.parallel.fsdp_version == 1 and self.parallel.use_orig_params:
            dadapter.fsdp1_release_flat_grads(self.model)

    def replay(self, first: int, last: int) -> None:
        self._release_fsdp1_grads()
        super().replay(first, last)
        if self.parallel.fsdp_version == 1 and self.parallel.use_orig_params:
            dadapter.fsdp1_flat_grads_from_orig(self.model, self.tracker)

    def evaluate(self):
        self._release_fsdp1_grads()
        return super().evaluate()

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


def simulate_fsdp(setup: TrainSetup, parallel: ParallelSetup, *, optimizer_steps: int = 2,
                  gpu: GpuSpec | None = None, splice: bool = True) -> Simulation:
    """Rank 0's simulated trace under FSDP2 or FSDP1 (module docstring); `gpu`: the target GPU's GpuSpec."""
    if parallel.fsdp_version == 1 and parallel.cpu_offload:
        # FSDP1's CPUOffload pins its host shards and gradients (`_flat_param.py` `pin_memory`), which a FakeTensor
        # cannot do, and memfit's fake run has one device: not emulated
        raise MemfitError("FSDP1 with CPU offload (`fsdp_offload_params` / `offload`) is not modelled by memfit; "
                          "estimate it with FSDP2 (`fsdp_version: 2`), whose CPUOffloadPolicy memfit models")
    setup = resolve(setup)
    sim = None
    if splice and splice_allowed(setup, parallel):
        try:
            sim = _simulate(setup, parallel, optimizer_steps, gpu, splice=True)
        except SpliceRefused:
            sim = None
    if sim is None:
        sim = _simulate(setup, parallel, optimizer_steps, gpu, splice=False)
    if setup.gradient_accumulation_steps > 1:
        sim.notes.append(accumulation_note(parallel, setup.gradient_accumulation_steps))
    return sim


def splice_allowed(setup: TrainSetup, parallel: ParallelSetup) -> bool:
    """Whether the cut model (memfit.sim.splice) may stand for the full one under `parallel` (module docstring):
    FSDP2 without CPU offload or quantized weights, and without `no_sync` micro-steps (their unsharded gradients
    outlive the micro-step, which the splice would free all at once)."""
    if parallel.fsdp_version != 2 or parallel.cpu_offload or setup.load_in_4bit or setup.load_in_8bit:
        return False
    if setup.gradient_accumulation_steps > 1 and not parallel.sync_each_batch:
        return False
    return trl_steps.wants_splice(setup)


def _simulate(setup: TrainSetup, parallel: ParallelSetup, optimizer_steps: int, gpu: GpuSpec | None, *,
              splice: bool) -> Simulation:
    replicas = parallel.world_size // parallel.shard_size if parallel.hybrid_shard else 1
    with isolated_simulation(), dadapter.fake_process_group(parallel.world_size, replicas=replicas) as mesh:
        runner = _FsdpRunner(setup, parallel, mesh, gpu, splice=splice)
        tracker = runner.tracker
        with dadapter.fsdp_storage_hooks(tracker.storage_allocated, tracker.storage_freed), \
                dadapter.fsdp1_storage_hooks(tracker.storage_allocated, tracker.storage_freed):
            return runner.run(optimizer_steps=optimizer_steps)


def accumulation_note(parallel: ParallelSetup, accumulation: int) -> str:
    """What the estimate assumed of FSDP gradient accumulation (module docstring)."""
    if parallel.sync_each_batch:
        return (f"FSDP gradient accumulation ({accumulation} micro-steps): gradients reduce-scattered every "
                "micro-step (`accelerator_config={\"gradient_accumulation_kwargs\": {\"sync_each_batch\": true}}`)")
    return (f"FSDP gradient accumulation ({accumulation} micro-steps): the Trainer runs all but the last under "
            "accelerate's `no_sync`, so each rank holds its units' unsharded gradients until the last; "
            "`accelerator_config={\"gradient_accumulation_kwargs\": {\"sync_each_batch\": true}}` reduce-scatters "
            "every micro-step instead (less memory, more communication)")
