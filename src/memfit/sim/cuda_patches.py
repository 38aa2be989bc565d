"""Every process-global patch the simulator makes, each undone on exit.

A simulation runs the real model code on fake CPU tensors; where a CUDA run would take
another code path, the Python-level function is replaced for the duration of the run
(models look these functions up at call time, which also covers recomputation inside the
backward under gradient checkpointing). Each patch is a context manager built on
memfit.sim.patching.patched, so no replacement outlives the simulation, even when it raises:

* `cuda_one_hot`: `F.one_hot` as aten runs it on a CUDA tensor.
* `cuda_sdpa`: `F.scaled_dot_product_attention` routed to the CUDA backend emulation
  (memfit.sim.kernels.sdpa).
* `cuda_grouped_mm` (memfit.sim.moe): `F.grouped_mm`, the MoE experts' GEMM, as CUDA allocates it.
* `flash_patches` (memfit.sim.kernels.flash_attn): the flash-attn kernels transformers' flash path
  loads (`lazy_import_flash_attention`) replaced by emulations, with fake-tensor-safe unpadding.
* memfit.sim.autocast replaces `torch.clear_autocast_cache` through `patched` as well.

Known limitations: patches are process-global, so two simulations must not run at the same
time in one process (threads); the engine runs one at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from memfit.sim import moe  # MoE topic: the experts' grouped GEMM
from memfit.sim.kernels import flash_attn
from memfit.sim.patching import patched

__all__ = ["cuda_one_hot", "cuda_sdpa", "cuda_patches"]


def cuda_one_hot() -> contextlib.AbstractContextManager[Any]:
    """`F.one_hot` as aten runs it on a CUDA tensor: `zeros(..., num_classes)` then `scatter_`.

    aten/src/ATen/native/Onehot.cpp takes a functional path for FakeTensors (arange, eq, to(long):
    two temporaries CUDA never allocates) and checks min/max with `.item()` on the CPU. XLNet
    one-hot encodes its segment matrix in every forward.
    """
    plain = F.one_hot

    def one_hot(tensor: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
        if num_classes < 0 or tensor.numel() == 0:
            return plain(tensor, num_classes)
        out = torch.zeros(*tensor.shape, num_classes, dtype=tensor.dtype, device=tensor.device)
        return out.scatter_(-1, tensor.unsqueeze(-1), 1)

    return patched(torch.nn.functional, "one_hot", one_hot)


_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def cuda_sdpa(*, compute_capability: tuple[int, int], log: list[str],
              sm_count: int | None = None) -> contextlib.AbstractContextManager[Any]:
    """Route `F.scaled_dot_product_attention` to the CUDA backend emulation.

    CUDA autocast puts `scaled_dot_product_attention` on its lower-precision list
    (autocast_mode.h), so under emulated AMP the floating inputs (mask included) are cast
    first, then the emulated backend runs with autocast off, as the CUDA kernel runs below the
    autocast key. The backend chosen for each call is appended to `log`.

    Args:
        compute_capability: the emulated GPU's (major, minor); it decides the backends.
        log: receives the name of the backend of every call.
        sm_count: the GPU's SMs (flash's split-KV heuristic); None: the fallback count.
    """
    from memfit.sim.kernels.sdpa import choose_backend, emulated_sdpa

    cc = tuple(compute_capability)

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = dict(zip(_SDPA_NAMES, args))
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
            return emulated_sdpa(**call, compute_capability=cc, sm_count=sm_count)

    return patched(F, "scaled_dot_product_attention", sdpa)


@contextlib.contextmanager
def cuda_patches(*, compute_capability: tuple[int, int], sdpa_log: list[str],
                 flash_log: list[str] | None = None, sm_count: int | None = None) -> Iterator[None]:
    """All the function-level patches of a simulation run, entered together.

    Args:
        compute_capability: the emulated GPU's (major, minor).
        sdpa_log: receives the SDPA backend of every SDPA call.
        flash_log: receives the flash kernel of every flash-attention call (None: flash not patched).
        sm_count: the GPU's SMs (GpuSpec.sm_count; None: unknown, memfit.gpus.catalog.FALLBACK_SM_COUNT).
    """
    flash = (flash_attn.flash_patches(compute_capability=compute_capability, log=flash_log, sm_count=sm_count)
             if flash_log is not None else contextlib.nullcontext())
    with cuda_sdpa(compute_capability=compute_capability, log=sdpa_log, sm_count=sm_count), cuda_one_hot(), \
            moe.cuda_grouped_mm(), flash:
        yield
