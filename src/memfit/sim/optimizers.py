"""The optimizer Trainer would build, as it runs on a CUDA device.

Trainer picks the class and kwargs in `Trainer.get_optimizer_cls_and_kwargs` (transformers
5, trainer_optimizer.py) and splits parameters into a weight-decay group and a no-decay
group (`Trainer.get_decay_parameter_names`). memfit calls both. One thing differs on the
CPU: with `foreach=None`, torch.optim picks the foreach implementation only for CUDA
tensors (`_default_to_fused_or_foreach` in torch/optim/optimizer.py), so the simulation
passes `foreach=True` explicitly to reproduce the multi-tensor temporaries CUDA has.

bitsandbytes' optimizers (8-bit AdamW, paged, Lion) have no CPU kernels; `EmulatedBnbOptimizer`
allocates the state bitsandbytes allocates (bitsandbytes/optim/optimizer.py
`Optimizer2State.init_state` / `Optimizer1State.init_state`): uint8 `state1`/`state2`, fp32
`absmax1`/`absmax2` per 256-element block and the quantization maps for tensors of at least
`min_8bit_size=4096` elements, fp32 states below that. Its update runs in place.

Importing `transformers.Trainer` (or `TrainingArguments`, whose module imports peft, which imports
bitsandbytes, which builds `torch.compile` kernels) takes about as long as the whole simulated
step; for the optimizers whose class and kwargs are plain constants (`TORCH_ADAMW`) memfit builds
them without that import, from the same transformers code paths (`trainer_pt_utils.get_parameter_names`
with the Trainer's patterns); `tests/sim/test_sim_optimizers.py` checks they equal what the Trainer builds.
"""

from __future__ import annotations

import math
import tempfile
import warnings

import torch
from torch import nn

__all__ = ["build_optimizer", "EmulatedBnbOptimizer", "BNB_OPTIMIZERS", "STATE_ON_HOST",
           "PAGED_MIN_NUMEL", "TORCH_ADAMW", "import_for", "decay_parameter_names"]

#: Optimizers whose per-parameter `step` counter is a CPU tensor on a CUDA run (not fused,
#: not capturable: `_init_group` in torch/optim/adam.py). Those bytes never reach the GPU.
STATE_ON_HOST = {"step"}

_BNB_BLOCK = 256  # bitsandbytes blockwise optimizer block size (functional.py, optimizer_update_8bit_blockwise)
_BNB_MIN_8BIT = 4096  # Optimizer8bit min_8bit_size default

#: `Trainer.get_decay_parameter_names` (transformers 5 trainer.py): parameters whose lowercased name matches one
#: of these (or inside an nn.LayerNorm) get no weight decay.
_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
#: What `Trainer.get_optimizer_cls_and_kwargs` returns for these optims with memfit's TrainingArguments (all
#: defaults but optim and weight_decay): trainer_optimizer.py `_get_adamw_torch` -> torch.optim.AdamW with
#: `{"lr": learning_rate, "betas": (adam_beta1, adam_beta2), "eps": adam_epsilon}`, plus `fused=True` for
#: ADAMW_TORCH_FUSED; the defaults learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8
#: (training_args.py `TrainingArguments`). Checked against the Trainer in tests/sim/test_sim_optimizers.py.
TORCH_ADAMW = {
    "adamw_torch": {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8},
    "adamw_torch_fused": {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "fused": True},
}
#: optims whose optimizer memfit builds without transformers' Trainer (the others: BNB_OPTIMIZERS)
_WITHOUT_TRAINER = tuple(TORCH_ADAMW)


#: `optim` names Trainer maps to bitsandbytes (transformers 5.24 trainer_optimizer.py `_get_bitsandbytes_optimizer`:
#: "paged" in the name -> is_paged, "8bit" -> optim_bits=8, "adam" -> AdamW (2 states), "lion" -> Lion (1 state))
#: -> (states, bits, paged).
BNB_OPTIMIZERS = {
    "adamw_bnb_8bit": (2, 8, False), "adamw_8bit": (2, 8, False),
    "paged_adamw_32bit": (2, 32, True), "paged_adamw_8bit": (2, 8, True),
    "lion_32bit": (1, 32, False), "lion_8bit": (1, 8, False),
    "paged_lion_32bit": (1, 32, True), "paged_lion_8bit": (1, 8, True),
}
#: bitsandbytes optim/optimizer.py `Optimizer8bit.get_state_buffer`: a paged optimizer puts a state buffer in
#: CUDA managed memory (`F.get_paged` -> cudaMallocManaged, outside PyTorch's caching allocator) only when the
#: parameter has at least this many elements; smaller ones are ordinary `torch.zeros_like`.
PAGED_MIN_NUMEL = 100_000
_QMAP_ENTRIES = 256  # F.create_dynamic_map(): 256 float32 values ("dynamic", "udynamic"), moved to the device once


class EmulatedBnbOptimizer(torch.optim.Optimizer):
    """Memory stand-in for bitsandbytes' AdamW / Lion, 32- or 8-bit, paged or not (bitsandbytes
    optim/optimizer.py `Optimizer2State.init_state` / `Optimizer1State.init_state`): per parameter `state1`
    (and `state2` for Adam) of float32, or of uint8 with float32 `absmax` per 256-element block when
    8-bit and the parameter has at least `min_8bit_size=4096` elements; the two 256-entry quantization maps
    once on the device. Paged: state buffers of parameters of at least `PAGED_MIN_NUMEL` elements are in
    `paged_tensors` (managed memory: the simulator takes them out of PyTorch's allocator). The update kernels
    (`optimizer_update_32bit`, `optimizer_update_8bit_blockwise`) work in place: no temporaries."""

    def __init__(self, params, *, states: int, bits: int, paged: bool, lr: float = 1e-3,
                 weight_decay: float = 1e-2, **_: object) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.n_states, self.bits, self.paged = states, bits, paged
        self.paged_tensors: list[torch.Tensor] = []
        self.qmaps: dict[str, torch.Tensor] = {}

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.zeros_like(p, dtype=dtype)
        if self.paged and p.numel() >= PAGED_MIN_NUMEL:
            self.paged_tensors.append(buf)
        return buf

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    eight = self.bits == 8 and p.numel() >= _BNB_MIN_8BIT
                    names = ("state1", "state2")[: self.n_states]
                    if eight:
                        for q in ("dynamic", "udynamic")[: self.n_states]:
                            if q not in self.qmaps:
                                self.qmaps[q] = torch.zeros(_QMAP_ENTRIES, dtype=torch.float32, device=p.device)
                        blocks = math.ceil(p.numel() / _BNB_BLOCK)
                        for i, name in enumerate(names, 1):
                            state[name] = self._buffer(p, torch.uint8)
                            state[f"absmax{i}"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        for name in names:
                            state[name] = self._buffer(p, torch.float32)
                state["step"] += 1
        return None


def _training_args(optim: str, weight_decay: float):
    from transformers import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TrainingArguments(
            output_dir=tempfile.gettempdir(), optim=optim, weight_decay=weight_decay, report_to="none",
            use_cpu=True,
        )


def import_for(optim: str) -> None:
    """Import what `build_optimizer(model, optim, ...)` imports (call it before the simulation's modes: a
    first import under the tracker records module-level tensors as allocations)."""
    import transformers.trainer_pt_utils  # noqa: F401  (decay_parameter_names)

    if optim not in _WITHOUT_TRAINER and optim not in BNB_OPTIMIZERS:
        from transformers import Trainer  # noqa: F401


def decay_parameter_names(model: nn.Module) -> list[str]:
    """`Trainer.get_decay_parameter_names(model)`, without importing the Trainer."""
    from transformers.trainer_pt_utils import get_parameter_names

    return get_parameter_names(model, [nn.LayerNorm], list(_NO_DECAY_PATTERNS))


def build_optimizer(model: nn.Module, optim: str, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer `Trainer.create_optimizer` builds, with CUDA's foreach default."""
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if optim in BNB_OPTIMIZERS:  # bitsandbytes' 8-bit, paged and Lion optimizers
        states, bits, paged = BNB_OPTIMIZERS[optim]
        return EmulatedBnbOptimizer(groups, states=states, bits=bits, paged=paged, lr=5e-5, weight_decay=weight_decay)
    if optim in TORCH_ADAMW:
        cls, kwargs = torch.optim.AdamW, dict(TORCH_ADAMW[optim])
    else:
        from transformers import Trainer

        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(_training_args(optim, weight_decay), model)
        kwargs = dict(kwargs)
    if cls.__module__.startswith("torch.optim") and not kwargs.get("fused"):
        if "foreach" in cls.__init__.__code__.co_varnames:
            kwargs["foreach"] = True
    return cls(groups, **kwargs)
