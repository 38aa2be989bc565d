"""Liger kernels (`use_liger_kernel`) in the simulation: Liger's own patching and Python code, Triton emulated.

The one adapter module for Liger-Kernel's private APIs (liger-kernel 0.8.5; source read under
site-packages/liger_kernel and the linkedin/Liger-Kernel mirror). What runs for real:

* `liger_kernel.transformers._apply_liger_kernel_to_instance(model=base, **liger_kernel_config)`, as
  transformers 5.24 `Trainer` calls it (`integrations/liger.py apply_liger_kernel`, on the peft-unwrapped
  model): per model type `apply_liger_kernel_to_<model>` binds `LigerRMSNorm.forward` /
  `LigerSwiGLUMLP.forward` (or GeGLU) to the existing modules, sets the module-level
  `apply_rotary_pos_emb = liger_rotary_pos_emb`, and replaces the model's `forward` by `lce_forward`
  (fused linear cross-entropy: `LigerForCausalLMLoss` -> `LigerFusedLinearCrossEntropyFunction`).
* Liger's `autograd.Function`s (what they save for backward) and their Python wrappers
  (`rms_norm_forward/backward`, `swiglu_forward/backward`, `geglu_*`, `rope_*`,
  `fused_linear_cross_entropy_forward/backward`): every `torch.empty/zeros` they make is a real
  (fake) allocation in the trace.

What is emulated (`liger_emulation`):

* every Triton kernel object in `liger_kernel.ops.*` (a `triton.runtime.jit.KernelInterface`) becomes a
  launch that does nothing: Liger's kernels write only into buffers the wrappers allocated before the
  launch, so the allocations are Liger's own;
* the CUDA branches the wrappers take by `x.device.type == "cuda"` (the simulation's tensors are CPU
  tensors): `_can_use_mm_out` (fused_linear_cross_entropy.py: `out=` matmuls into one (chunk, V)
  logits buffer, no per-chunk logits / grad_input temporaries), the weight-gradient accumulation
  by `addmm(out=grad_weight)` (sm80+, no (V, H) temporary per chunk), and `rms_norm_backward`'s
  `_dW = empty((sm_count, n_cols), fp32)` with the GPU's SM count;
* scalar reads of FakeTensors (`target_mask.sum().item()` in FLCE, `torch.equal(grad_output, 1.0)` in
  its backward) return a placeholder: they decide no allocation.

Module-level replacements Liger makes are undone when the context exits (they would otherwise leak
into every later simulation in the process).

The FLCE chunking rule (`fused_linear_cross_entropy_forward`): `inc_factor = cdiv(V, chunk_mem_const * H)`,
`chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT)` with `_CHUNK_MEM_CONST = 1`
(`flce_chunk_size`; tests/sim/test_liger.py reads the installed source so a change fails loudly).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import MemfitError

__all__ = ["liger_emulation", "flce_chunk_size", "liger_supported_model_types"]


def flce_chunk_size(tokens: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> int:
    """Rows of the (chunk, V) logits buffer Liger's fused linear cross-entropy materializes at once.

    Args:
        tokens: BT, the rows of the flattened hidden states.
        hidden: H.
        vocab: V.
        chunk_mem_const: Liger's `_CHUNK_MEM_CONST` (1 in 0.8.5).
    """
    # fused_linear_cross_entropy_forward: inc_factor = triton.cdiv(V, chunk_mem_const * H);
    # chunk_size = triton.next_power_of_2(triton.cdiv(BT, inc_factor)); chunk_size = min(chunk_size, BT)
    inc = -(-vocab // (chunk_mem_const * hidden))
    rows = -(-tokens // inc)
    p2 = 1 << (rows - 1).bit_length() if rows > 1 else 1
    return min(p2, tokens)


@functools.lru_cache(maxsize=None)
def liger_import_error(model_type: str) -> str | None:
    """Why Liger's patch for `model_type` cannot run with the installed transformers (None: it can).

    Each `apply_liger_kernel_to_<model>` imports its forward and output classes from
    `liger_kernel.transformers.model.<module>` when called (liger_kernel/transformers/monkey_patch.py); a module
    written for other transformers versions fails there (liger-kernel 0.8's qwen2_5_vl and qwen2_vl modules ask
    `output_classes` for classes it defines only for some transformers versions). Those imports, read from the
    function's source, are tried here without patching anything.
    """
    import importlib
    import inspect
    import re

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        return f"Liger has no kernels for model type `{model_type}`"
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    for module in sorted(set(re.findall(r"from (liger_kernel\.transformers\.model\.\w+) import", source))):
        try:
            importlib.import_module(module)
        except ImportError as err:
            return f"liger-kernel's `{module}` does not import with the installed transformers ({err})"
    return None


def liger_supported_model_types() -> list[str]:
    """The model types Liger patches: the keys of liger-kernel's `MODEL_TYPE_TO_APPLY_LIGER_FN`.

    Read from the dict literal in the installed `liger_kernel/transformers/monkey_patch.py` without importing it:
    the import (liger_kernel.transformers imports peft, bitsandbytes and Triton) took 0.8 s of a 10 s seed `plan`,
    whose liger check only asks whether `xlnet` is a key. Imported when liger is loaded already or the
    literal is not found as expected (tests/sim/test_liger.py checks the two agree).
    """
    loaded = sys.modules.get("liger_kernel.transformers.monkey_patch")
    names = None if loaded is not None else _model_types_from_source()
    if names is None:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        names = sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)
    return list(names)


@functools.lru_cache(maxsize=1)
def _model_types_from_source() -> tuple[str, ...] | None:
    """The string keys of the top-level `MODEL_TYPE_TO_APPLY_LIGER_FN = {...}` literal; None when not found so."""
    spec = importlib.util.find_spec("liger_kernel")  # the top package only: finding a submodule imports its parents
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "transformers", "monkey_patch.py")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return None
    return model_types_in_source(text)


def model_types_in_source(text: str) -> tuple[str, ...] | None:
    """The keys of the `MODEL_TYPE_TO_APPLY_LIGER_FN = {...}` literal in monkey_patch.py's `text`; None unless it is
    one top-level literal of string keys that nothing in the file changes afterwards."""
    start = text.find("\nMODEL_TYPE_TO_APPLY_LIGER_FN = {")
    end = text.find("\n}", start)
    if start < 0 or end < 0 or text.count("MODEL_TYPE_TO_APPLY_LIGER_FN =") != 1:
        return None
    if re.search(r"MODEL_TYPE_TO_APPLY_LIGER_FN\s*(\[[^\]]*\]\s*=[^=]|\.update\(|\.setdefault\(|\|=)", text):
        return None  # the dict is changed after the literal: only the import tells its keys
    try:
        tree = ast.parse(text[start + 1:end + 2])
    except SyntaxError:
        return None
    value = tree.body[0].value if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assign) else None
    if not isinstance(value, ast.Dict) or not value.keys:
        return None
    keys = [k.value if isinstance(k, ast.Constant) else None for k in value.keys]
    if not all(isinstance(k, str) for k in keys):
        return None
    return tuple(sorted(set(keys)))


class _NoLaunch:
    """A Triton kernel whose launch does nothing (`kernel[grid](...)` and `kernel.run(...)`)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append(self.name)

        return launch

    def run(self, *args: Any, **kwargs: Any) -> None:
        self.log.append(self.name)


class _ScalarReads(TorchDispatchMode):
    """Answer the value reads of FakeTensors that decide no allocation (see module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        if any(isinstance(a, FakeTensor) for a in args):
            if func is torch.ops.aten._local_scalar_dense.default:
                t = args[0]
                return True if t.dtype is torch.bool else (1 if not t.is_floating_point() else 1.0)
            if func is torch.ops.aten.equal.default:
                return False
            if func is torch.ops.aten.is_nonzero.default:
                return True
        return func(*args, **kwargs)


def _liger_op_modules() -> list[Any]:
    import liger_kernel.ops as ops

    mods = []
    for info in pkgutil.iter_modules(ops.__path__, prefix="liger_kernel.ops."):
        if info.ispkg:
            continue
        try:
            mods.append(importlib.import_module(info.name))
        except Exception:  # noqa: BLE001 - an optional op whose extra (cute, cutile) is not installed
            continue
    return mods


@contextlib.contextmanager
def _saved_attrs(targets: list[tuple[Any, str]]) -> Iterator[None]:
    saved = [(o, n, o.__dict__.get(n, _MISSING) if isinstance(o.__dict__, dict) else getattr(o, n)) for o, n in targets]
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


_MISSING = object()


@contextlib.contextmanager
def liger_emulation(models: list[torch.nn.Module], config: dict | None, *, num_sms: int,
                    compute_capability: tuple[int, int], log: list[str]) -> Iterator[None]:
    """Apply Liger to `models` (Trainer's way) and emulate its Triton kernels for the enclosed code.

    Args:
        models: the model(s) of the simulation (the full one and the cut one; peft wrappers are unwrapped).
        config: `liger_kernel_config` (None: Liger's defaults for the model type).
        num_sms: the GPU's streaming multiprocessors (rms_norm_backward's `_dW` rows).
        compute_capability: the GPU's; Liger's sm80+ branches.
        log: receives `liger:<kernel>` for every emulated launch kind.
    """
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:  # pragma: no cover - liger-kernel is in the llm extra
        raise MemfitError("`use_liger_kernel` needs liger-kernel: `pip install liger-kernel`") from err
    import liger_kernel.ops.fused_linear_cross_entropy as flce
    import liger_kernel.ops.rms_norm as rms
    from triton.runtime.jit import KernelInterface

    bases = [_unwrap(m) for m in models]
    model_type = getattr(getattr(bases[0], "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise MemfitError(f"Liger has no kernels for model type `{model_type}` (liger-kernel supports "
                          f"{', '.join(liger_supported_model_types()[:12])}, ...); drop `--liger`")
    broken = liger_import_error(model_type)
    if broken is not None:
        raise MemfitError(f"{broken}; drop `--liger` for this model")
    launches: list[str] = []
    # what Liger replaces at module level: the model's modeling module and torch's cross_entropy
    modeling = sys.modules[type(bases[0]).__module__]
    targets = [(modeling, n) for n in list(vars(modeling))]
    targets += [(torch.nn.functional, "cross_entropy")]
    op_mods = _liger_op_modules()
    kernel_targets = [(m, n) for m in op_mods for n, v in list(vars(m).items()) if isinstance(v, KernelInterface)]
    targets += kernel_targets + [(flce, "_can_use_mm_out"), (flce, "fused_linear_cross_entropy_forward"),
                                 (flce, "fused_linear_cross_entropy_backward"), (rms, "rms_norm_backward")]
    import liger_kernel.transformers.functional  # noqa: F401  (import before patching what it binds)

    _discover_backends()
    with _saved_attrs(targets):
        for base in bases:
            _apply_liger_kernel_to_instance(model=base, **(config or {}))
        for owner, name in kernel_targets:
            setattr(owner, name, _NoLaunch(name, launches))
        _patch_flce(flce, compute_capability)
        _patch_rms_backward(rms, num_sms)
        try:
            yield
        finally:
            log.extend(sorted({f"liger:{_kernel_family(n)}" for n in launches}))


def _discover_backends() -> None:
    """Liger's backend registry imports each op's alternative backends at its first dispatch
    (liger_kernel/backends/registry.py `_discover`); do it now, outside the simulation's modes, so that
    no import-time tensor lands in the first simulation's trace only."""
    import logging

    from liger_kernel.backends import registry

    log = logging.getLogger("liger_kernel.backends.registry")
    level = log.level
    log.setLevel(logging.ERROR)  # "Backend impl ... could not be imported" (cutedsl, ascend): not ours to report
    try:
        for op in list(getattr(registry, "_DISCOVERY_MAP", {})):
            registry._discover(op)
    finally:
        log.setLevel(level)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # transformers trainer_utils.unwrap_peft_model: PeftModel.get_base_model()
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _kernel_family(name: str) -> str:
    for fam in ("cross_entropy", "rms_norm", "swiglu", "geglu", "rope", "layer_norm", "element_mul"):
        if fam in name:
            return "fused_linear_cross_entropy" if fam in ("cross_entropy", "element_mul") else fam
    return name.strip("_")


def _patch_flce(flce: Any, cc: tuple[int, int]) -> None:
    plain_forward = flce.fused_linear_cross_entropy_forward
    plain_backward = flce.fused_linear_cross_entropy_backward

    def can_use_mm_out(_input, weight):
        # fused_linear_cross_entropy.py `_can_use_mm_out` with `_input.device.type == "cuda"` (not HIP);
        # autocast is emulated on the CPU key (memfit.sim.autocast)
        if torch.is_grad_enabled() or _input.dtype != weight.dtype or \
                _input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        if torch.is_autocast_enabled("cpu"):
            return _input.dtype == torch.get_autocast_dtype("cpu")
        return True

    def forward(*args, **kwargs):
        names = ("_input", "weight", "target", "ce_weight", "bias")
        call = dict(zip(names, args))
        call.update(kwargs)
        weight = call["weight"]
        wants = call.get("weight_requires_grad")
        wants = weight.requires_grad if wants is None else wants
        compute = call.get("compute_gradients")
        compute = call["_input"].requires_grad if compute is None else compute
        grad_weight = None
        if wants and compute and cc[0] >= 8:
            # CUDA sm80+: grad_weight = zeros_like(weight[, accum_dtype]) accumulated by addmm(out=grad_weight),
            # no (V, H) temporary per chunk (the CPU path's legacy `mm(...).float()` fallback)
            accum = call.get("accum_dtype")
            grad_weight = torch.zeros_like(weight) if accum is None else torch.zeros_like(weight, dtype=accum)
            call["weight_requires_grad"] = False
        with _ScalarReads():
            out = plain_forward(**call)
        if grad_weight is not None:
            loss, z, acc, pred, gi, _, gb = out
            out = (loss, z, acc, pred, gi, grad_weight.to(weight.dtype), gb)
        return out

    def backward(grad_output, grad_input, grad_weight, grad_bias):
        with _ScalarReads():
            return plain_backward(grad_output, grad_input, grad_weight, grad_bias)

    flce._can_use_mm_out = can_use_mm_out
    flce.fused_linear_cross_entropy_forward = forward
    flce.fused_linear_cross_entropy_backward = backward


def _patch_rms_backward(rms: Any, num_sms: int) -> None:
    plain = rms.rms_norm_backward

    def rms_norm_backward(dY, X, W, RSTD, *args, **kwargs):
        # rms_norm.py: `_dW = torch.empty((sm_count, n_cols), fp32)` with sm_count =
        # get_device_properties(X.device).multi_processor_count on CUDA; 1 on a CPU tensor: the other rows here
        extra = None
        if W is not None and W.requires_grad and num_sms > 1:
            extra = torch.empty((num_sms - 1, dY.shape[-1]), dtype=torch.float32, device=dY.device)
        out = plain(dY, X, W, RSTD, *args, **kwargs)
        del extra
        return out

    rms.rms_norm_backward = rms_norm_backward
