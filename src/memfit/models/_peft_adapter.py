"""The one module that touches peft's private internals (peft 0.21.2), for peft methods under fake tensors (issue 12).

Two host-side computations in peft read tensor values that meta / fake tensors do not have. Neither touches GPU
memory on a real run, so each is replaced by a value-free stand-in of the same shape:

* BOFT's permutation matrices (tuners/boft/layer.py `BOFTLayer.perm2mat`): `perm_mat[i, idx] = 1` for each index
  of a permutation built under the meta device, which needs the index's value. The stand-in returns a tensor of the
  same shape and dtype (`torch.zeros((n, n))`, float32, on the device being built on); only its size matters: it
  becomes the `boft_P` buffer.
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


@contextlib.contextmanager
def run_patches() -> Iterator[None]:
    """While the training step runs: LoHa / LoKr module dropout decided on the host without a tensor."""
    saved = []
    for name in _HOST_RAND_MODULES:
        module = importlib.import_module(name)
        saved.append((module, module.torch))
        module.torch = _TorchWithHostRand()
    try:
        yield
    finally:
        for module, original in saved:
            module.torch = original
