"""The one module that touches peft's private internals (peft 0.21.2), for peft methods under fake tensors.

Three places in peft need help under fake tensors. Two are host-side computations that read tensor values meta /
fake tensors do not have; neither touches GPU memory on a real run, so each is replaced by a value-free stand-in of
the same shape. The third is peft's test of memfit's stand-in bitsandbytes parameters:

* BOFT's permutation matrices (tuners/boft/layer.py `BOFTLayer.perm2mat`): `perm_mat[i, idx] = 1` for each index
  of a permutation built under the meta device, which needs the index's value. The stand-in returns a tensor of the
  same shape and dtype (`torch.zeros((n, n))`, float32, on the device being built on); only its size matters: it
  becomes the `boft_P` buffer.
* DoRA on 4-/8-bit weights (tuners/lora/dora.py `forward` -> utils/integrations.py `dequantize_module_weight`): see
  `_dequantize_module_weight`; the dequantization itself is bitsandbytes' op, emulated by memfit.sim.kernels.bnb.
* LoHa / LoKr module dropout (tuners/loha/layer.py and tuners/lokr/layer.py `forward`: `torch.rand(1) >
  module_dropout`): a one-element host tensor (no `device=`: the CPU) compared with a float. The stand-in is the
  number 1.0, so the adapter always runs (with `module_dropout > 0` a real run skips it in some steps: the
  estimate is the step that runs it, the larger).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def build_patches() -> Iterator[None]:
    """While peft builds adapters on the meta device: BOFT's permutation matrix without reading index values."""
    import torch
    from peft.tuners.boft.layer import BOFTLayer

    original = BOFTLayer.perm2mat

    def perm2mat(self, indices):
        n = len(indices)
        return torch.zeros((n, n))  # same shape and dtype as peft's; device: the `torch.device` being built on

    BOFTLayer.perm2mat = perm2mat
    try:
        yield
    finally:
        BOFTLayer.perm2mat = original


class _TorchWithHostRand:
    """The `torch` module as seen by a LoHa/LoKr layer, but `torch.rand(1)` is the host number 1.0."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def rand(*size: Any, **kwargs: Any) -> Any:
        import torch

        if tuple(size) in ((1,), ((1,),)) and not kwargs:
            return 1.0  # the host tensor `torch.rand(1)` of the module-dropout test; > any dropout < 1
        return torch.rand(*size, **kwargs)


#: peft modules whose `torch.rand(1)` is module dropout on the host.
_HOST_RAND_MODULES = ("peft.tuners.loha.layer", "peft.tuners.lokr.layer")


def _dequantize_module_weight(original):
    """peft's `dequantize_module_weight` (utils/integrations.py) for memfit's quantized parameters.

    memfit's simulated bitsandbytes weights are plain Parameters carrying the attributes bitsandbytes reads
    (`quant_state`, `bnb_quantized`; `CB`, `SCB`: memfit.models.quantization `restore`, since the bnb subclasses
    cannot wrap a FakeTensor), so peft's test of the class name (`Params4bit` / `Int8Params`) misses them and DoRA
    would use the packed storage as the weight. This does what peft's `dequantize_bnb_weight` does for those classes:
    `bnb.functional.dequantize_4bit(weight.data, weight.quant_state)`, or `int8_vectorwise_dequant(weight.data, SCB)`.
    """
    def dequantize_module_weight(module):
        import bitsandbytes as bnb
        import torch

        w = getattr(module, "weight", None)
        if isinstance(w, torch.nn.Parameter) and type(w).__name__ not in ("Params4bit", "Int8Params"):
            if getattr(w, "bnb_quantized", False) and getattr(w, "quant_state", None) is not None:
                return bnb.functional.dequantize_4bit(w.data, w.quant_state)
            if w.dtype == torch.int8 and getattr(w, "SCB", None) is not None:
                return bnb.functional.int8_vectorwise_dequant(w.data, w.SCB)
        return original(module)

    return dequantize_module_weight


@contextlib.contextmanager
def run_patches(*, quantized: bool = False) -> Iterator[None]:
    """While the training step runs: LoHa / LoKr module dropout decided on the host without a tensor; with quantized
    base weights, DoRA's dequantization of memfit's bitsandbytes parameters.

    Args:
        quantized: the base weights are bitsandbytes 4-/8-bit (memfit.models.quantization).
    """
    saved = []
    for name in _HOST_RAND_MODULES:
        module = importlib.import_module(name)
        saved.append((module, "torch", module.torch))
        module.torch = _TorchWithHostRand()
    if quantized:
        dora = importlib.import_module("peft.tuners.lora.dora")
        saved.append((dora, "dequantize_module_weight", dora.dequantize_module_weight))
        dora.dequantize_module_weight = _dequantize_module_weight(dora.dequantize_module_weight)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def has_default_lora_targets(model_type: str) -> bool:
    """Whether peft picks LoRA's target modules itself for `model_type` (peft/utils/constants.py
    `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`, which `LoraConfig(target_modules=None)` reads; without an
    entry, get_peft_model raises "Please specify `target_modules` in `peft_config`")."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    return model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
