"""Recovery from an out-of-memory error inside the optimizer step of a running Trainer.

Where an optimizer step runs out of memory:
- the first step creates the optimizer state (`torch.zeros_like` per parameter: 8 bytes per
  fp32 parameter for Adam/AdamW, torch/optim/adam.py `_init_group`);
- foreach implementations (`adamw_torch` on CUDA) allocate temporaries the size of a whole
  parameter group (`torch._foreach_sqrt(exp_avg_sqs)`, adam.py `_multi_tensor_adam`).
Both happen after the activations of the accumulation window are freed, so splitting the
micro-batch does not help; what helps is stepping fewer parameters at a time.

A failed step may have updated part of the state: torch's Adam increments the step counters
(`_foreach_add_(state_steps, 1)`) and, for foreach, updates exp_avg / exp_avg_sq in place
before the allocation that fails, and Trainer's two parameter groups (decay / no decay) are
stepped one after the other. Retrying such a step would apply it twice. So `OptimizerStepGuard`:

1. before a step, copies the step counters on their device (one `torch.stack` per device, no
   sync) and, on "risky" steps (the first one, which creates the state, and the first after
   an evaluation or any recovery), keeps a host copy of the trainable parameters and the
   optimizer state (`snapshot="auto"`; "always" / "never" to choose);
2. on an OOM: drops the state entries the failed step created, and either proves nothing was
   modified (for Adam/AdamW, whose step increments the step counters before anything else: no
   counter moved) or restores the host copy; if neither is possible it raises with the reason
   and the fix (the run's last checkpoint is intact);
3. retries in a lower-memory way:
   - "per-parameter" (each parameter stepped as its own group, with torch's public step
     pre/post hooks around the innermost `Optimizer.step`, so accelerate's and GradScaler's
     wrappers run unchanged): the temporaries of one parameter at a time; same arithmetic,
     so the same update. Kept for the rest of the run. Only where the step has group-sized
     temporaries (foreach); fused and for-loop steps have none.
   - when the state itself does not fit and none exists yet (the first step): the optimizer is
     replaced by one with a smaller state, the optimizer remedy's choice (memfit.remedies.optimizer
     `smaller_optimizers`: 8-bit AdamW with bitsandbytes on CUDA, else Adafactor; none for an optimizer
     whose state is small already), `args.optim` is set to it (saved with every checkpoint,
     memfit.fitting.resume, so a resumed run rebuilds it), and the step is
     retried: no step lost, but a different optimizer (`allow_optimizer_switch=False`
     forbids it). Not with a GradScaler (fp16).
   Freeing gradients as they are used would lower the first step's peak but not the steady
   state (the next backward holds weights, state and gradients again), so it is not offered.

In multi-process runs the ranks vote after each optimizer step (one small all-reduce): a
rank that fails for good makes the others stop instead of waiting; when a rank's state does
not fit, every rank undoes its step (from the host copy of the first step) and all switch
to the same smaller optimizer.

Known limitations: user step pre/post hooks see the per-parameter groups during the step;
DeepSpeed and FSDP optimizers (sharded, stepping with collectives) are left unguarded.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from memfit.fitting import _trainer as adapter
from memfit.fitting import distributed as dist_sync
from memfit.fitting.recovery import Meter, Recovery, free_memory, is_oom_error, oom_cause

logger = logging.getLogger("memfit.fit")

__all__ = ["OptimizerStepGuard", "MODES", "SNAPSHOT_POLICIES"]

#: Step modes, in the order a recovery tries them.
MODES = ("as built", "per-parameter")
SNAPSHOT_POLICIES = ("auto", "always", "never")
#: Host copies larger than this share of the available host memory are not made.
SNAPSHOT_HOST_SHARE = 0.5


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _host_bytes_available() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


#: Optimizers whose step increments every parameter's `state["step"]` before it modifies anything
#: else (torch/optim/adam.py: `_foreach_add_(device_state_steps, 1)` first in `_multi_tensor_adam`
#: and `_fused_adam`, `step_t += 1` first in `_single_tensor_adam`; AdamW is Adam with decoupled
#: weight decay). For these an unchanged step counter proves the parameter was not touched.
STEP_FIRST_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


@dataclass
class _Before:
    """What a step may modify, as it was before the step."""

    optimizer: torch.optim.Optimizer
    state_keys: dict[int, set[str] | None]  #: id(param) -> state keys (None: no state)
    steps: list[tuple[list[torch.Tensor], torch.Tensor]]  #: step tensors per device, stacked copies
    copy: dict[int, tuple[torch.Tensor, dict[str, Any]]] | None = None  #: id(param) -> host param, host state


def _step_tensors(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        step = (opt.state.get(p) or {}).get("step")
        if isinstance(step, torch.Tensor):
            by_device.setdefault(step.device, []).append(step)
    return by_device


def _record(opt: torch.optim.Optimizer, *, copy: bool) -> _Before:
    """State keys, a device-side copy of the step counters (no sync), and optionally a host copy."""
    params = _params(opt)
    keys = {id(p): (set(opt.state[p]) if opt.state.get(p) else None) for p in params}
    with torch.no_grad():
        steps = [(ts, torch.stack([t.reshape(()) for t in ts])) for ts in _step_tensors(opt, params).values()]
    host: dict[int, tuple[torch.Tensor, dict[str, Any]]] | None = {} if copy else None
    if host is not None:
        for p in params:
            if p.requires_grad:
                host[id(p)] = (p.detach().to("cpu", copy=True),
                               {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                                for k, v in (opt.state.get(p) or {}).items()})
    return _Before(opt, keys, steps, host)


def _modified(opt: torch.optim.Optimizer, before: _Before) -> bool:
    """Could the failed step have modified parameters or state? (False only when proven untouched.)"""
    if type(opt) not in STEP_FIRST_OPTIMIZERS:
        return True
    for p in _params(opt):
        state = opt.state.get(p) or {}
        if before.state_keys[id(p)] is None and state:  # created by the failed step: was it stepped?
            step = state.get("step")
            if step is None or float(step) != 0.0:
                return True
    with torch.no_grad():
        return any(not torch.equal(torch.stack([t.reshape(()) for t in ts]), old) for ts, old in before.steps)


def _drop_new_state(opt: torch.optim.Optimizer, before: _Before) -> None:
    """Remove state the failed step created (partially initialised entries break the next step)."""
    for p in _params(opt):
        old_keys = before.state_keys[id(p)]
        state = opt.state.get(p)
        if not state:
            continue
        if old_keys is None:
            del opt.state[p]
        else:
            for k in [k for k in state if k not in old_keys]:
                del state[k]


def _restore(opt: torch.optim.Optimizer, before: _Before) -> None:
    """Put parameters and state back from the host copy, in place where the tensors still exist."""
    assert before.copy is not None
    with torch.no_grad():
        for p in _params(opt):
            saved = before.copy.get(id(p))
            if saved is None:
                continue
            host_param, host_state = saved
            p.copy_(host_param)
            if before.state_keys[id(p)] is None:
                opt.state.pop(p, None)
                continue
            state = opt.state.setdefault(p, {})
            for k, v in host_state.items():
                if isinstance(v, torch.Tensor):
                    cur = state.get(k)
                    if isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == v.dtype:
                        cur.copy_(v)
                    else:
                        state[k] = v.to(p.device if cur is None else cur.device, copy=True)
                else:
                    state[k] = v


def _group_temporaries(opt: torch.optim.Optimizer) -> bool:
    """Does a step allocate temporaries the size of a whole group (the foreach implementation)?

    Fused kernels allocate none and the for-loop implementation one parameter's worth, so
    stepping per parameter only helps foreach, which torch picks when `foreach` is None and
    every parameter is on a CUDA device (torch/optim/optimizer.py `_default_to_fused_or_foreach`).
    """
    for group in opt.param_groups:
        if group.get("fused"):
            continue
        foreach = group.get("foreach")
        if foreach or (foreach is None and all(p.is_cuda for p in group["params"])):
            return True
    return False


def _per_parameter_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One group per parameter, with its group's hyperparameters."""
    return [dict(g, params=[p]) for g in groups for p in g["params"]]


def _smaller_optimizer(current: Any, params: list[torch.Tensor]) -> str | None:
    """The optimizer to switch to: memfit.remedies.optimizer's first smaller optimizer that runs here (8-bit AdamW
    where bitsandbytes is installed and the parameters are on a CUDA GPU, else Adafactor; never a paged one, whose
    managed memory the guard does not measure); None when `current` already has a small state."""
    import importlib.util

    from memfit.remedies.optimizer import smaller_optimizers

    bnb = all(p.is_cuda for p in params) and importlib.util.find_spec("bitsandbytes") is not None
    out = smaller_optimizers(str(getattr(current, "value", current)), paged=False, bitsandbytes=bnb)
    return out[0] if out else None


class _SwitchNeeded(Exception):
    """In a multi-process run: this rank needs a smaller optimizer (its step was undone)."""

    def __init__(self, cause: str, tried: int | None) -> None:
        super().__init__(cause)
        self.cause, self.tried = cause, tried


class OptimizerStepGuard:
    """Wraps `trainer.optimizer.step`; see the module docstring."""

    def __init__(self, trainer: Any, *, meter: Meter, recoveries: list[Recovery],
                 on_change: Callable[[str], None], snapshot: str = "auto", max_recoveries: int = 4,
                 allow_optimizer_switch: bool = True) -> None:
        if snapshot not in SNAPSHOT_POLICIES:
            raise ValueError(f"optimizer_snapshot must be one of {', '.join(SNAPSHOT_POLICIES)}; got {snapshot!r}")
        self.trainer = trainer
        self.meter = meter
        self.recoveries = recoveries
        self.on_change = on_change
        self.snapshot = snapshot
        self.max_recoveries = max_recoveries
        self.allow_optimizer_switch = allow_optimizer_switch
        self.mode = MODES[0]
        self.evaluated = False  #: set after an evaluation: the next step gets a host copy (auto)
        self._recoveries_seen = 0
        self._wrapped: Any = None
        self._original: Any = None
        self._had_instance_step = False
        self._hooks: list[Any] = []
        self._saved_groups: list[dict[str, Any]] | None = None
        self._last_before: _Before | None = None
        self._warned_host = False

    # -- installation ----------------------------------------------------------------------
    def install(self) -> None:
        """Wrap the trainer's optimizer (called before each step; a new optimizer is wrapped again)."""
        outer = self.trainer.optimizer
        if outer is None or outer is self._wrapped:
            return
        if getattr(self.trainer, "is_deepspeed_enabled", False) or getattr(self.trainer, "is_fsdp_enabled", False):
            return  # sharded optimizers step with collectives and flat partitions: not retried here
        self.uninstall()
        self._wrapped, self._original = outer, outer.step
        self._had_instance_step = "step" in vars(outer)

        # functools.wraps keeps the LR scheduler's `_wrapped_by_lr_sched` mark (torch/optim/lr_scheduler.py
        # warns "optimizer.step() has been overridden after learning rate scheduler initialization" without it)
        @functools.wraps(self._original)
        def step(*args, **kwargs):
            return self._step(*args, **kwargs)

        outer.step = step
        self._hook(adapter.inner_optimizer(outer))

    def _hook(self, inner: torch.optim.Optimizer) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = [inner.register_step_pre_hook(self._pre_hook), inner.register_step_post_hook(self._post_hook)]

    def uninstall(self) -> None:
        if self._wrapped is not None:
            if self._had_instance_step:
                self._wrapped.step = self._original
            else:
                del self._wrapped.step
        for h in self._hooks:
            h.remove()
        self._wrapped = self._original = None
        self._hooks = []

    # -- per-parameter modes (torch's step hooks, around the innermost Optimizer.step) ---------
    def _pre_hook(self, opt, args, kwargs):
        if self.mode != MODES[0]:
            self._saved_groups = opt.param_groups
            opt.param_groups = _per_parameter_groups(opt.param_groups)
        return None

    def _post_hook(self, opt, args, kwargs):
        self._put_back_groups(opt)

    def _put_back_groups(self, opt) -> None:
        if self._saved_groups is not None:
            opt.param_groups = self._saved_groups
            self._saved_groups = None

    # -- the guarded step ----------------------------------------------------------------------
    def _wants_copy(self, opt: torch.optim.Optimizer) -> bool:
        if self.snapshot == "never":
            return False
        if self.snapshot == "always":
            return True
        first = any(p.grad is not None and not opt.state.get(p) for p in _params(opt))
        return first or self.evaluated or len(self.recoveries) != self._recoveries_seen

    def _host_copy_fits(self, opt: torch.optim.Optimizer) -> bool:
        need = sum(p.numel() * p.element_size() for p in _params(opt) if p.requires_grad)
        need += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
        avail = _host_bytes_available()
        if avail is None or need <= SNAPSHOT_HOST_SHARE * avail:
            return True
        if not self._warned_host:
            logger.warning("memfit: no host copy of the optimizer state before step %s (%d MiB > half of the "
                           "available host memory); an OOM that modifies the state cannot be retried",
                           self.trainer.state.global_step, need >> 20)
            self._warned_host = True
        return False

    def _step(self, *args, **kwargs):
        if not dist_sync.is_distributed():
            return self._guarded_step(*args, **kwargs)
        while True:  # every rank votes after each attempt: failed for good / needs a smaller optimizer / cannot undo
            out = need = None
            try:
                out = self._guarded_step(*args, **kwargs)
            except _SwitchNeeded as exc:
                need = exc
            except BaseException:
                dist_sync.agree_flags([1, 0, 0])  # the others stop instead of waiting for this rank
                raise
            can_undo = need is not None or self._last_before.copy is not None
            failed, switch, stuck = dist_sync.agree_flags([0, int(need is not None), int(not can_undo)])
            if failed:
                raise dist_sync.PeerFailed("memfit: another process of this run stopped with an error in this "
                                           "optimizer step (see its log); this process stops too")
            if not switch:
                return out
            self._switch_together(need, stuck)

    def _switch_together(self, need: "_SwitchNeeded | None", stuck: int) -> None:
        """A rank's optimizer state did not fit: every rank undoes its step and switches, then all retry."""
        step = self.trainer.state.global_step
        if stuck:
            text = ("another rank cannot undo its step (no host copy of its state), so the ranks cannot switch "
                    "optimizer together")
            if need is not None:
                raise torch.OutOfMemoryError(f"memfit: out of memory in the optimizer step at step {step}: the "
                                             f"optimizer state does not fit, and {text}. Last error: {need.cause}")
            raise dist_sync.PeerFailed(f"memfit: {text}; this process stops too")
        opt = adapter.inner_optimizer(self._wrapped)
        if need is None:  # this rank's step succeeded: put it back so that all ranks switch from the same point
            _restore(opt, self._last_before)
            _drop_new_state(opt, self._last_before)
            free_memory()
        why = self._switch_refused(opt)
        if why:
            raise dist_sync.PeerFailed(f"memfit: another rank needs a smaller optimizer but {why}; stopping")
        cause, tried = (need.cause, need.tried) if need else ("the optimizer state did not fit on another rank", None)
        self._apply_switch(opt, cause, tried)

    def _guarded_step(self, *args, **kwargs):
        opt = adapter.inner_optimizer(self._wrapped)
        before = self._record(opt, copy=self._wants_copy(opt) and self._host_copy_fits(opt))
        while True:
            try:
                out = self._original(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only OOMs are handled
                self._put_back_groups(opt)
                if not is_oom_error(exc):
                    raise
                cause, tried = oom_cause(exc)
                exc = None  # drop the traceback: it holds the failed step's temporaries
                self._undo(opt, before, cause)
                opt = self._next(opt, cause, tried)
                if opt is not before.optimizer:  # a new, empty optimizer: the parameters were put back
                    before = self._record(opt, copy=before.copy is not None)
                elif before.copy is None:
                    before = self._record(opt, copy=False)
                self.meter.reset()
                continue
            self.evaluated = False
            self._recoveries_seen = len(self.recoveries)
            self._last_before = before
            return out

    def _record(self, opt: torch.optim.Optimizer, *, copy: bool) -> _Before:
        if copy and self.meter.budget is not None:
            with self.meter.budget.paused():  # the host copy is not on the (emulated) GPU
                return _record(opt, copy=True)
        return _record(opt, copy=copy)

    def _undo(self, opt: torch.optim.Optimizer, before: _Before, cause: str) -> None:
        step = self.trainer.state.global_step
        if before.copy is not None:
            _restore(opt, before)
        elif _modified(opt, before):
            raise torch.OutOfMemoryError(
                f"memfit: out of memory in the optimizer step at step {step} after the step had updated part of the "
                "optimizer state, and no host copy of the state was kept for this step, so it cannot be retried; "
                f"resume from the last checkpoint (fix: memfit.fit(..., optimizer_snapshot='always') keeps a host "
                f"copy before every step). Last error: {cause}")
        _drop_new_state(opt, before)
        free_memory()

    def _next(self, opt: torch.optim.Optimizer, cause: str, tried: int | None) -> torch.optim.Optimizer:
        """Record the next recovery and return the optimizer to retry with (the same or a smaller one)."""
        step = self.trainer.state.global_step
        if len(self.recoveries) >= self.max_recoveries:
            raise torch.OutOfMemoryError(
                f"memfit: out of memory in the optimizer step at step {step} (recoveries: {len(self.recoveries)} of "
                f"{self.max_recoveries}); the parameters and optimizer state were put back. Last error: {cause}")
        if self.mode == MODES[0] and _group_temporaries(opt):
            old, self.mode = self.mode, MODES[1]
            change = (f"optimizer step mode {old!r} -> {self.mode!r} (temporaries of one parameter at a time); the "
                      "step was undone and retried: no step lost, same update")
        else:
            why = self._switch_refused(opt)
            if why:
                raise torch.OutOfMemoryError(
                    f"memfit: out of memory in the optimizer step at step {step}: the optimizer state of "
                    f"`{type(opt).__name__}` does not fit next to the weights and gradients, and {why}. The parameters "
                    "and optimizer state were put back. Fix: a smaller optimizer state (`memfit plan` lists 8-bit and "
                    f"factored optimizers, LoRA). Last error: {cause}")
            if dist_sync.is_distributed():
                raise _SwitchNeeded(cause, tried)  # decided by all ranks together (_step)
            return self._apply_switch(opt, cause, tried)
        self.recoveries.append(Recovery(step, "optimizer", change, cause, tried))
        self.on_change(f"out of memory at optimizer step {step} (optimizer): {cause} -> {change}")
        return opt

    def _apply_switch(self, opt: torch.optim.Optimizer, cause: str, tried: int | None) -> torch.optim.Optimizer:
        step = self.trainer.state.global_step
        old_name = type(opt).__name__
        opt = self._switch(opt)
        change = (f"optimizer {old_name} -> {type(opt).__name__} (args.optim={self.trainer.args.optim}) before "
                  "any optimizer state existed: its state did not fit; no step lost, but a different optimizer")
        self.recoveries.append(Recovery(step, "optimizer", change, cause, tried))
        self.on_change(f"out of memory at optimizer step {step} (optimizer): {cause} -> {change}")
        return opt

    def _switch_refused(self, opt: torch.optim.Optimizer) -> str | None:
        """Why the optimizer cannot be replaced here (None: it can)."""
        if not self.allow_optimizer_switch:
            return "allow_optimizer_switch=False forbids replacing the optimizer"
        if any(opt.state.get(p) for p in _params(opt)):
            return "the optimizer already has state (replacing it would lose its moments)"
        if self._wrapped is opt or not isinstance(self._wrapped, torch.optim.Optimizer):
            return "the optimizer is not accelerate's AcceleratedOptimizer around a torch optimizer, which memfit replaces"
        if getattr(getattr(self.trainer, "accelerator", None), "scaler", None) is not None:
            return "fp16 mixed precision's GradScaler keeps per-optimizer state, so memfit does not replace it"
        if _smaller_optimizer(self.trainer.args.optim, _params(opt)) is None:
            return f"`{type(opt).__name__}` already has a small state"
        return None

    def _switch(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Build the smaller optimizer over the same groups (learning rates as the scheduler set them) and put it in place."""
        from transformers import Trainer

        args = self.trainer.args
        args.optim = _smaller_optimizer(args.optim, _params(opt))
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, self.trainer.model)
        groups = [{"params": g["params"], "weight_decay": g.get("weight_decay", 0.0)} for g in opt.param_groups]
        new = cls(groups, **kwargs)
        for old_group, group in zip(opt.param_groups, new.param_groups):
            for key in ("lr", "initial_lr"):  # the scheduler's current and base learning rates
                if key in old_group:
                    group[key] = old_group[key]
        adapter.replace_inner_optimizer(self.trainer, self._wrapped, opt, new)
        self._hook(new)
        return new
