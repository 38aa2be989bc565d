"""A smaller optimizer state, or one outside PyTorch's allocator: 8-bit AdamW (bitsandbytes), Adafactor
(factored second moment), and bitsandbytes' paged AdamW (8- or 32-bit).

AdamW keeps 8 bytes per trainable parameter; 8-bit AdamW about 2; Adafactor without momentum about
4/sqrt(n) per matrix. A paged optimizer keeps its state buffers (parameters of at least 100k elements) in
CUDA managed memory (bitsandbytes `F.get_paged` -> cudaMallocManaged; memfit.sim.optimizers
`EmulatedBnbOptimizer`): outside PyTorch's caching allocator, on the GPU while it has room, evicted to host
memory when it has not and paged back for each update, so it cannot run out of memory but steps get slower
when the GPU is short (the page traffic is charged by memfit.planner.throughput). `paged_adamw_32bit` keeps
AdamW's 32-bit states, `paged_adamw_8bit` bitsandbytes' 8-bit ones. All change the optimizer's implementation
(8-bit and Adafactor: a small accuracy risk).
"""

from memfit.remedies.base import Applicability, Remedy

__all__ = ["REMEDY", "smaller_optimizers"]

_CHEAPER = ("adamw_bnb_8bit", "adafactor")
#: transformers 5.24 `OptimizerNames.PAGED_ADAMW_8BIT` / `PAGED_ADAMW` -> bitsandbytes.optim.AdamW with
#: `is_paged=True` and `optim_bits` 8 / 32 (trainer_optimizer.py `_get_bitsandbytes_optimizer`)
_PAGED = ("paged_adamw_8bit", "paged_adamw_32bit")
_BNB = ("adamw_bnb_8bit", "adamw_8bit") + _PAGED


def _small_state(optim: str) -> bool:
    """Already 8-bit or factored: transformers 5.24 `_get_bitsandbytes_optimizer` (trainer_optimizer.py) gives
    every name with "8bit" 8-bit states (`optim_bits = 8 if "8bit" in optim_name`), so `adamw_8bit` (an alias
    of `adamw_bnb_8bit`, training_args.py `OptimizerNames`), `paged_adamw_8bit` and `lion_8bit` are 8-bit
    already: proposing `adamw_bnb_8bit` to them would change nothing (or only move the state into PyTorch's
    allocator)."""
    return optim in _CHEAPER or optim == "sgd" or "8bit" in optim


def _paged_ok(gpu) -> bool:
    """bitsandbytes' managed memory is CUDA's (cudaMallocManaged): modelled for NVIDIA GPUs."""
    return gpu is None or getattr(gpu, "vendor", "nvidia") == "nvidia"


def smaller_optimizers(current: str, *, paged: bool = True, bitsandbytes: bool = True) -> tuple[str, ...]:
    """The optimizers with a smaller or paged state that replace `current`, most preferred first: the one answer
    to "which smaller optimizer" for the planner (this remedy's variants), the multi-GPU search
    (memfit.planner.parallel_plan) and memfit.fit's switch at the first optimizer step
    (memfit.fitting.optimizer_step). Empty: `current` already has a small (or paged) state.

    Args:
        current: the setup's `TrainingArguments.optim` (a name of transformers' `OptimizerNames`).
        paged: offer bitsandbytes' paged optimizers (their state lives in CUDA managed memory, outside PyTorch's
            allocator: only on NVIDIA GPUs, and only where that memory is modelled).
        bitsandbytes: offer bitsandbytes' optimizers at all (False: it is not installed, or the parameters are
            not on a CUDA GPU); Adafactor is transformers' own.
    """
    out = [] if _small_state(current) else [o for o in _CHEAPER if o != current]
    # paged AdamW for the Adam / Lion family (sgd / Adafactor users would gain a state); an 8-bit user gains
    # only the paging, so paged_adamw_8bit alone
    if paged and not current.startswith("paged_") and ("adam" in current or "lion" in current):
        out += [o for o in _PAGED if not (_small_state(current) and o == "paged_adamw_32bit")]
    elif paged and current == "paged_adamw_32bit":
        out.append("paged_adamw_8bit")
    return tuple(o for o in out if bitsandbytes or o not in _BNB)


def _variants(setup, gpu):
    return [{"optim": o} for o in smaller_optimizers(setup.optim, paged=_paged_ok(gpu))]


def _check(setup, gpu):
    if not _variants(setup, gpu):
        paged = " paged" if setup.optim.startswith("paged_") else ""
        return Applicability(False, f"`{setup.optim}` already has a small{paged} state")
    return Applicability(True, "8 bytes/param of AdamW state is often the largest single item")


def _apply(changes, setup, **_):
    optim = changes["optim"]
    code = ["# pip install bitsandbytes"] if optim in _BNB else []
    if optim in _PAGED:
        code.append("# the optimizer state lives in CUDA managed memory: it never runs out of memory, but steps slow "
                    "down when the GPU is short and the state is paged to host memory")
    return {"optim": optim}, {}, code


def _apply_to_trainer(trainer, changes, log, adapter):
    old = trainer.args.optim
    trainer.args.optim = changes["optim"]
    log.append(f"optim {getattr(old, 'value', old)} -> {changes['optim']}")
    return {"optim": changes["optim"]}


REMEDY = Remedy(
    name="optimizer", title="smaller or paged optimizer state",
    saves="optimizer state (8-bit AdamW: ~6 of 8 bytes/param; Adafactor: most of it; paged AdamW: all of it "
          "leaves PyTorch's allocator, paged to host memory when the GPU is short)",
    costs="a different optimizer; bitsandbytes ones need bitsandbytes and a CUDA GPU; paged ones page over PCIe "
          "when the GPU is short",
    check=_check, variants=_variants, apply=_apply,
    fields=("optim",), apply_to_trainer=_apply_to_trainer, advice=("optimizer",),
)
