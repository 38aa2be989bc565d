"""Tensors saved for backward kept in host memory: `torch.autograd.graph.save_on_cpu` and TRL's activation
offloading, as the simulator sees them.

On a GPU, `save_on_cpu(pin_memory=True)` (torch/autograd/graph.py) packs every tensor saved for backward
into a new pinned host tensor (`torch.empty(size, dtype, layout, pin_memory=True).copy_(t)`) and unpacks it
with `.to(device, non_blocking=True)`: a fresh device tensor in the backward. The device copy is freed as
soon as nothing else references it. In the simulation every tensor is a "device" tensor, so the pack here
allocates the host copy and files it under the `host` category (left out of the GPU trace), and the unpack
allocates the device copy the real `.to(device)` makes.

transformers 5.24 `activation_checkpointing_enable(offload=True)` wraps each checkpointed call in
`save_on_cpu(pin_memory=True, device_type=...)` (modeling_utils.py): with non-reentrant checkpointing only
the inputs the checkpoint saves (`_NoopSaveInputs`, torch/utils/checkpoint.py) go through the hooks, so the
block inputs (the residual stream) move to the host; `host_offload_patch` routes that call here.

TRL `get_act_offloading_ctx_manager(model)` (trl/models/activation_offloading.py `OffloadActivations.
pack_tensor`): offloads every saved tensor of at least `min_offload_size` (1024) bytes that is not a
parameter or buffer and not saved while the output head (`lm_head`) runs; a storage already offloaded is
not offloaded twice. `trl_activation_offloading` follows that rule. Known limitation: TRL's stream mode keeps
up to `max_fwd_stash_size` (5) offloaded tensors alive on the device until their copy completes; the
simulation frees them at once (a few activations of one layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["host_saved_tensors", "host_offload_patch", "trl_activation_offloading", "runner_activation_offloading"]

#: trl get_act_offloading_ctx_manager(min_offload_size=1024): smaller tensors stay on the device.
TRL_MIN_OFFLOAD_BYTES = 1024


@contextlib.contextmanager
def host_saved_tensors(tracker: Any, *, min_bytes: int = 0, skip: Any = None) -> Iterator[None]:
    """Saved tensors move to host memory (save_on_cpu semantics) inside the block.

    Args:
        tracker: the simulation's StorageTracker (files the host copies under `host`).
        min_bytes: tensors of fewer bytes stay on the device (TRL's `min_offload_size`).
        skip: callable(tensor) -> True for tensors that stay on the device (parameters, the head's).
    """
    seen: dict[int, Any] = {}

    def pack(t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or (skip is not None and skip(t)) or \
                t.numel() * t.element_size() < min_bytes:
            return t
        rec = tracker.record_of(t)
        if rec is not None and rec.id in seen and min_bytes:
            return t  # TRL: a storage already offloaded is kept on the device, not offloaded twice
        packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)  # pinned host tensor
        host = tracker.record_of(packed)
        if host is not None:
            host.category = "host"
        packed.copy_(t)
        if rec is not None:
            seen[rec.id] = True
        return ("host", packed)

    def unpack(p):
        if isinstance(p, torch.Tensor):
            return p
        _, packed = p
        out = torch.empty_like(packed)  # packed.to(device, non_blocking=True): a new device tensor
        out.copy_(packed)
        return out

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextlib.contextmanager
def host_offload_patch(tracker: Any) -> Iterator[None]:
    """transformers' `save_on_cpu` (checkpointing with `offload=True`) routed to `host_saved_tensors`."""
    import transformers.modeling_utils as mu

    from memfit.sim.patching import patched

    def save_on_cpu(pin_memory: bool = False, device_type: str = "cuda"):
        return host_saved_tensors(tracker)

    with patched(mu, "save_on_cpu", save_on_cpu):
        yield


def trl_activation_offloading(model: nn.Module, tracker: Any):
    """A factory of the forward context TRL's `activation_offloading=True` gives (see module docstring), for
    the simulator: call it for a fresh context each forward (the head hooks are registered once).

    Args:
        model: the trained model (peft wrappers looked through for `lm_head`, as TRL does).
        tracker: the simulation's StorageTracker.
    """
    state = {"in_head": 0}
    head = None
    inner = model
    if hasattr(inner, "base_model") and hasattr(inner, "peft_config"):
        inner = inner.base_model
    inner = getattr(inner, "model", inner) if not hasattr(inner, "lm_head") else inner
    head = getattr(inner, "lm_head", None) or getattr(model, "lm_head", None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(lambda *a: state.__setitem__("in_head", 1))
        head.register_forward_hook(lambda *a: state.__setitem__("in_head", 0), always_call=True)

    def skip(t: torch.Tensor) -> bool:
        rec = tracker.record_of(t)  # parameters' storages (and views of them) are filed as weights
        return bool(state["in_head"]) or isinstance(t, nn.Parameter) or (rec is not None and rec.category == "weights")

    return lambda: host_saved_tensors(tracker, min_bytes=TRL_MIN_OFFLOAD_BYTES, skip=skip)


def runner_activation_offloading(runner: Any):
    """TRL's `activation_offloading=True` context of a simulated run (`runner`: memfit.sim.engine's), built once
    on its forward model (`trl_activation_offloading`); a null context when the setting is off. SFTTrainer,
    DPOTrainer, RewardTrainer and KTOTrainer (TRL 1.16) run `training_step` inside it."""
    if not runner.setup.activation_offloading:
        return contextlib.nullcontext()
    if getattr(runner, "_act_offload", None) is None:
        runner._act_offload = trl_activation_offloading(runner.fwd_model, runner.tracker)
    return runner._act_offload()
