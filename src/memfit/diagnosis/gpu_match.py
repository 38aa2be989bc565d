"""The GPU an out-of-memory message describes, and the plan for a setup on it (diagnose's `setup=`)."""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.oom_text import OomMessage
from memfit.units import format_bytes

__all__ = ["gpu_from_message", "plan_for"]


def gpu_from_message(m: OomMessage):
    """The GPU an OOM message describes: the closest catalog entry of that total capacity (within
    0.3 %), with the message's exact capacity; else a generic GPU of that size.

    Several cards share a capacity (L40 / L40S / RTX 6000 Ada, H100 SXM / PCIe): the closest one is
    taken and the others are named in the spec's notes, since their speeds differ.
    """
    import dataclasses

    from memfit.gpus.catalog import CATALOG, resolve_gpu

    if not m.total_bytes:
        raise MemfitError("the message has no total capacity; pass the GPU to `memfit plan --gpu` instead")
    near = sorted((abs(g.total_bytes - m.total_bytes), i, g) for i, g in enumerate(CATALOG.values())
                  if abs(g.total_bytes - m.total_bytes) <= 0.003 * g.total_bytes)
    if not near:
        return resolve_gpu(f"{m.total_bytes}B")
    best = near[0][2]
    notes = best.notes
    if len(near) > 1:
        others = ", ".join(g.name for _, _, g in near[1:])
        notes += (f"the message's {format_bytes(m.total_bytes)} also fits {others}; {best.name} assumed "
                  "(pass --gpu to choose)",)
    return dataclasses.replace(best, total_bytes=m.total_bytes, notes=notes)


def plan_for(setup, m: OomMessage):
    """memfit.planner.search's plan for `setup` on the GPU of `m`, with the memory the message shows outside
    PyTorch's cache in place of memfit's estimate of it."""
    from memfit.planner.search import plan
    from memfit.train_setup import TrainSetup

    if not isinstance(setup, TrainSetup):
        raise MemfitError(f"`setup` must be a memfit.TrainSetup, not `{type(setup).__name__}`")
    outside = m.non_pytorch_bytes if m.has_numbers else None
    return plan(setup, gpu=gpu_from_message(m), non_pytorch_bytes=outside)
