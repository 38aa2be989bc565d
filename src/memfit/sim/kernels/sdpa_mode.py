"""Route `F.scaled_dot_product_attention` to the CUDA backend emulation during a simulation.

The function is replaced for the duration of the simulation (models look it up at call
time), which also covers recomputation inside the backward under checkpointing. CUDA
autocast puts `scaled_dot_product_attention` on its lower-precision list (autocast_mode.h),
so under emulated AMP the floating inputs (mask included) are cast first, then the
emulated backend runs with autocast off, as the CUDA kernel runs below the autocast key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["cuda_sdpa"]

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@contextlib.contextmanager
def cuda_sdpa(*, compute_capability: tuple[int, int], log: list[str]) -> Iterator[None]:
    from memfit.sim.kernels.sdpa import choose_backend, emulated_sdpa

    cc = tuple(compute_capability)
    original = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        call = dict(zip(_NAMES, args))
        call.update(kwargs)
        if torch.is_autocast_enabled("cpu"):
            low = torch.get_autocast_dtype("cpu")
            for name in ("query", "key", "value", "attn_mask"):
                t = call.get(name)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64:
                    call[name] = t.to(low)
        with torch.autocast("cpu", enabled=False):
            q, k, v, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
            choice = choose_backend(
                q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape), dtype=q.dtype,
                has_mask=mask is not None, mask_dtype=None if mask is None else mask.dtype,
                dropout_p=float(call.get("dropout_p", 0.0) or 0.0), is_causal=bool(call.get("is_causal", False)),
                enable_gqa=bool(call.get("enable_gqa", False)),
                requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
                compute_capability=cc,
            )
            log.append(choice.backend)
            return emulated_sdpa(**call, compute_capability=cc)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
