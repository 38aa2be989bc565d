"""`memfit.fit` under the sharding engines: DeepSpeed ZeRO and FSDP2.

**Preflight per rank** (`parallel_for_trainer`): a Trainer configured with `deepspeed=` (a ZeRO JSON or
dict) or `fsdp=` / `fsdp_config=` (FSDP2) is estimated as rank 0 of that run: the ParallelSetup is read
from the trainer's own arguments (memfit.parallel.setup `zero_settings_from_deepspeed`,
`parallel_from_fsdp_args`), the world size from torch.distributed (else `args.world_size`), and the
estimate is memfit.parallel.rank `simulate_rank`'s.

**Recovery** (`run_agreed_chunks`, `forward_vote`). Both engines communicate inside a micro-step, so a
rank that recovers alone (more, smaller forwards and backwards) would leave the others waiting:

* DeepSpeed ZeRO-2/3 reduce (-scatter) gradients in every backward, boundary or not
  (deepspeed/runtime/engine.py `DeepSpeedEngine.allreduce_gradients`: "ZeRO stage >= 2 communicates
  during non gradient accumulation boundaries as well", called from `_backward_epilogue`), and ZeRO-3
  all-gathers parameters in every forward and backward;
* FSDP2 all-gathers in every forward (and in the backward with `reshard_after_forward=True`) and
  reduce-scatters in each backward unless `set_requires_gradient_sync(False)`
  (torch/distributed/fsdp/_fully_shard/_fully_shard.py `FSDPModule.set_requires_gradient_sync`).

So every rank runs the same number of chunks, and after each chunk's forward (before its backward,
where the collectives of the gradients are) every rank votes (`forward_vote`: one small all-reduce):
a rank whose forward ran out of memory says so, and then *every* rank drops that forward and splits
the chunk it was on, and the chunks after it, into the agreed larger count; chunks already backwarded
are not recomputed (their gradients are reduced already), so no gradient is counted twice. Each chunk's
loss is weighted by its share of the micro-batch (memfit.fitting.recovery), so the sum of the chunks'
gradients is the micro-batch's.

The engine owns the accumulation boundary; memfit keeps it on the last chunk only:

* DeepSpeed (through accelerate, accelerate/utils/deepspeed.py `DeepSpeedEngineWrapper.backward`:
  `engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)`, `engine.backward(loss)`,
  and `engine.step()` only when `sync_gradients`): for every chunk but the last of the boundary
  micro-step the wrapper is called with `sync_gradients=False` (`deepspeed_boundary_held`), so
  DeepSpeed reads `is_gradient_accumulation_boundary()` False in that backward (`_backward_prologue`
  passes it to the ZeRO optimizer) and takes no step; the last chunk has the boundary and the one
  `engine.step()` -> `_take_model_step`. The loss is scaled by 1/gradient_accumulation_steps by the
  Trainer (`scale_wrt_gas=False` is passed to `engine.backward`), and by each chunk's share by memfit.
* FSDP2: `set_requires_gradient_sync(False)` for every chunk but the last of the boundary micro-step
  (`fsdp2_gradient_sync`), as accelerate's `Accelerator.no_sync` does for FSDP2 micro-steps: one
  reduce-scatter per window, as without chunks.

Not recoverable (the run stops with an error, the other ranks too where they can be told): an OOM
inside a backward (the engine's reduce-scatter of that backward is under way on the other ranks), and,
under ZeRO-3 / FSDP2, an OOM part-way through a forward after a parameter all-gather the other ranks
are waiting in (an OOM before the forward's first collective, or anywhere in a ZeRO-1/2 forward, which
has none, is recovered). The forward case is told apart by `forward_tracker` (hooks on the model): such a
rank does not vote (its peers wait in an all-gather, not in the vote), raises `CollectiveForwardOOM` with one
line (`forward_oom_message`), and `memfit.fit` writes the report and then `abort_peers()`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from memfit.errors import MemfitError
from memfit.fitting import distributed as dist_sync

__all__ = ["engine_of", "forward_collectives", "forward_tracker", "CollectiveForwardOOM", "abort_peers", "parallel_for_trainer", "ForwardFailed", "forward_vote", "run_agreed_chunks",
           "deepspeed_boundary_held", "fsdp2_gradient_sync", "AgreedChunks", "check_can_split"]


def engine_of(trainer: Any) -> str | None:
    """`deepspeed` or `fsdp` when that engine trains `trainer` (`Trainer.is_deepspeed_enabled` / `is_fsdp_enabled`)."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "deepspeed"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "fsdp"
    return None


def forward_collectives(trainer: Any, model: Any) -> str | None:
    """The engine whose forward itself runs collectives (`DeepSpeed ZeRO-3`: parameter all-gathers in the
    submodules' pre-forward hooks, deepspeed/runtime/zero/parameter_offload.py `_pre_forward_module_hook`;
    `FSDP2`: an all-gather in each `fully_shard` module's pre-forward, FSDPState._pre_forward), else None."""
    engine = engine_of(trainer)
    if engine == "fsdp":
        return "FSDP2"
    if engine == "deepspeed":
        stage = getattr(model, "zero_optimization_stage", None)  # DeepSpeedEngine.zero_optimization_stage()
        if callable(stage) and stage() == 3:
            return "DeepSpeed ZeRO-3"
    return None


@contextlib.contextmanager
def forward_tracker(model: Any) -> Iterator[dict[str, bool]]:
    """`{"inside": True}` from `model`'s first forward pre-hook (prepended: before FSDP2's root all-gather)
    until its forward returns: an error raised while it is True was raised inside the model's forward."""
    state = {"inside": False}

    def pre(module, args):
        state["inside"] = True

    def post(module, args, output):
        state["inside"] = False

    handles = [model.register_forward_pre_hook(pre, prepend=True), model.register_forward_hook(post)]
    try:
        yield state
    finally:
        for h in handles:
            h.remove()


class CollectiveForwardOOM(torch.OutOfMemoryError):
    """An OOM inside a forward whose engine all-gathers in it: the peers wait in a collective this rank will not
    join, and cannot be told in-band. `memfit.fit` writes the report, then `abort_peers()`."""

    abort_peers = True


def forward_oom_message(*, rank: int, engine: str, step: int, timeout_s: float, cause: str) -> str:
    """The one line a rank prints when its forward ran out of memory between the engine's all-gathers."""
    return (f"memfit: rank {rank} ran out of memory inside the forward at optimizer step {step} under {engine}, "
            "between parameter all-gathers the other ranks are waiting in, so the ranks cannot split together; "
            "memfit writes the report, then destroys this process group (gloo peers then fail at once; NCCL peers "
            f"wait until their timeout, after {timeout_s:.0f} s: TrainingArguments.ddp_timeout); lower "
            "per_device_train_batch_size before launching (`memfit plan --gpus N x GPU` computes it) and resume "
            f"from the last checkpoint. Last error: {cause}")


def abort_peers() -> None:
    """Destroy this rank's process group (after its report is written), so that a peer waiting on it sees an
    error when the backend reports the closed connection (gloo does) instead of waiting until its timeout.
    NCCL peers are not told: they wait until the timeout (the limit is documented in README's memfit.fit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _world(args: Any) -> tuple[int, int]:
    """(world size, nodes): torch.distributed's world when initialised, else `args.world_size`; nodes from
    `LOCAL_WORLD_SIZE` (set by torchrun / accelerate launch / deepspeed), else one node."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(args.world_size or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    nodes = world // local if local and world % local == 0 else 1
    return max(world, 1), max(nodes, 1)


def parallel_for_trainer(trainer: Any, setup: Any) -> tuple[Any, list[str]]:
    """The ParallelSetup of the run `trainer` is configured for, or None for one GPU or DDP. Returns (setup, notes).

    Args:
        trainer: the Trainer; its `args.deepspeed` (dict or JSON path) or `args.fsdp` / `args.fsdp_config`
            (as `TrainingArguments._process_fsdp_args` left them) are read.
        setup: the TrainSetup memfit read from the trainer (its precision fills DeepSpeed's `"auto"` dtypes).
    """
    from memfit.models.catalog import hidden_size
    from memfit.parallel.setup import ParallelSetup, parallel_from_fsdp_args, sync_each_batch_from, \
        zero_settings_from_deepspeed

    args = trainer.args
    ds = getattr(args, "deepspeed", None)
    if ds:
        world, nodes = _world(args)
        model = getattr(trainer.model, "module", trainer.model)
        zero, notes = zero_settings_from_deepspeed(ds, hidden_size=hidden_size(getattr(model, "config", None)),
                                                   precision=setup.precision)
        notes = notes + [f"preflight per rank: DeepSpeed ZeRO-{zero.stage} over {world} rank(s) on {nodes} node(s), "
                         "from the trainer's `deepspeed` config; the estimate is rank 0's"]
        return ParallelSetup(world_size=world, nodes=nodes, strategy=f"zero{zero.stage}", zero=zero,
                             notes=tuple(notes)), notes
    if getattr(args, "fsdp", None):
        if not getattr(trainer, "is_fsdp_enabled", False):
            # accelerate/state.py AcceleratorState.__init__ turns FSDP on only for GPU-like multi-device types
            # (MULTI_GPU, MULTI_NPU, ...), never for MULTI_CPU: on the CPU the Trainer trains with DDP
            return None, ["`fsdp` is set but accelerate does not enable FSDP here (it does not on the CPU): the "
                          "trainer trains without FSDP, and the preflight estimates that"]
        fsdp_config = getattr(args, "fsdp_config", None) or {}
        version = fsdp_config.get("version", 2) if isinstance(fsdp_config, dict) else 2
        if str(version) != "2":
            return None, [f"fsdp_config `version` `{version}`: memfit's per-rank estimate models FSDP2 only; "
                          "the preflight estimates one GPU"]
        world, nodes = _world(args)
        parallel, notes = parallel_from_fsdp_args(True, fsdp_config, world_size=world, nodes=nodes)
        # the Trainer's no_sync unless accelerator_config's sync_each_batch
        parallel = parallel.replace(sync_each_batch=sync_each_batch_from(getattr(args, "accelerator_config", None)))
        notes = notes + [f"preflight per rank: FSDP2 (`fully_shard`, reshard_after_forward="
                         f"{parallel.reshard_after_forward}) over {world} rank(s), from the trainer's `fsdp_config`; "
                         "the estimate is rank 0's"]
        return parallel.replace(notes=tuple(notes)), notes
    return None, []


# -- recovery: every rank runs the same chunks ------------------------------------------------------------

class ForwardFailed(Exception):
    """A forward of this micro-step ran out of memory on some rank: every rank drops it and splits further."""

    def __init__(self, chunks: int, cause: str, tried: int | None, here: bool) -> None:
        super().__init__(cause)
        self.chunks, self.cause, self.tried, self.here = chunks, cause, tried, here


def forward_vote(*, failure: tuple[str, int | None] | None, fatal: bool, wanted_chunks: int, remaining: int) -> None:
    """Every rank, after each chunk's forward (before its backward): one all-reduce of five integers.

    Args:
        failure: this rank's forward ran out of memory: (diagnosis, bytes tried), else None.
        fatal: this rank stops for good (an error other than an OOM, or no smaller chunk left).
        wanted_chunks: the chunk count this rank asks for from now on (doubled after its OOM).
        remaining: chunks of this micro-step still to run, this one included (must be equal on all ranks:
            each one is a forward and a backward with the engine's collectives).

    Raises PeerFailed when another rank stopped for good, MemfitError when the ranks' chunks differ, and
    ForwardFailed (with the agreed chunk count) when any rank's forward ran out of memory.
    """
    fatal_any, oom_any, chunks, most, neg_least = dist_sync.agree_flags(
        [int(fatal), int(failure is not None), int(wanted_chunks), int(remaining), -int(remaining)])
    if fatal_any:
        if fatal:
            return  # the caller raises its own error
        raise dist_sync.PeerFailed("memfit: another process of this run stopped with an error in this micro-step "
                                   "(see its log); this process stops too instead of waiting for it")
    if most != -neg_least:
        raise MemfitError(f"the ranks run different numbers of chunks in this micro-step (`{-neg_least}` to "
                          f"`{most}`): their micro-batches differ in size; keep accelerate's even_batches=True")
    if oom_any:
        cause, tried = failure if failure is not None else ("another rank ran out of memory in this forward", None)
        raise ForwardFailed(chunks, cause, tried, here=failure is not None)


@dataclass
class AgreedChunks:
    """What `run_agreed_chunks` needs to know of the run: the chunk count (shared by all ranks, kept across
    micro-steps), the recovery limit and how to record a recovery."""

    chunks: int = 1
    max_recoveries: int = 4
    recoveries_used: Callable[[], int] = lambda: 0
    #: called as on_recover(cause, tried, old_chunks, new_chunks, here) after each agreed split
    on_recover: Callable[[str, int | None, int, int, bool], None] = lambda *a: None


def run_agreed_chunks(state: AgreedChunks, inputs: Any, *, split: Callable[[Any, int], list[Any]],
                      shares: Callable[[list[Any]], list[float]],
                      run_chunk: Callable[[Any, float, bool, int], Any]) -> Any:
    """Run one micro-batch as `state.chunks` chunks on every rank, splitting further together after an OOM.

    Args:
        state: the agreed chunk count and the recovery bookkeeping (updated in place).
        inputs: the micro-batch.
        split: split(inputs, c) -> up to c chunks (memfit.fitting.recovery's `_split`).
        shares: shares(chunks) -> each chunk's share of the loss of what was split (sums to 1; all 1 where
            the loss is already normalised by the micro-batch's item count).
        run_chunk: run_chunk(chunk, weight, last, remaining) runs a forward (which must call `forward_vote`
            before returning its loss) and the backward of one chunk; `last` is True for the micro-step's
            last chunk (the one that keeps the engine's accumulation boundary).

    Returns the sum of the chunks' (weighted) losses.
    """
    parts = split(inputs, state.chunks) if state.chunks > 1 else [inputs]
    queue = list(zip(parts, shares(parts)))
    total = None
    while queue:
        part, weight = queue[0]
        try:
            loss = run_chunk(part, weight, len(queue) == 1, len(queue))
        except ForwardFailed as failed:
            old, new = state.chunks, max(failed.chunks, state.chunks)
            factor = max(2, -(-new // max(old, 1)))
            state.chunks = max(new, old * 2)
            state.on_recover(failed.cause, failed.tried, old, state.chunks, failed.here)
            finer = []
            for p, w in queue:  # the failed chunk and the ones after it: none has been backwarded
                sub = split(p, factor)
                finer.extend((s, w * x) for s, x in zip(sub, shares(sub)))
            queue = finer
            continue
        queue.pop(0)
        total = loss if total is None else total + loss
    return total


def check_can_split(state: AgreedChunks, part: Any, splittable: Callable[[Any], int]) -> str | None:
    """Why this rank cannot split `part` further after an OOM (None: it can)."""
    if state.recoveries_used() >= state.max_recoveries:
        return f"recoveries: {state.recoveries_used()} of {state.max_recoveries}"
    if splittable(part) <= 1:
        return "the chunk holds one example"
    return None


@contextlib.contextmanager
def deepspeed_boundary_held(trainer: Any) -> Iterator[None]:
    """The backward inside keeps DeepSpeed off its accumulation boundary and takes no `engine.step()`.

    accelerate's `DeepSpeedEngineWrapper.backward(loss, sync_gradients=...)` (accelerate/utils/deepspeed.py)
    is what `Accelerator.backward` calls with the Trainer's `sync_gradients`; here it is called with
    `sync_gradients=False`: `engine.set_gradient_accumulation_boundary(False)`, `engine.backward(loss)`, no step.
    """
    wrapper = getattr(getattr(trainer, "accelerator", None), "deepspeed_engine_wrapped", None)
    if wrapper is None:
        yield
        return
    original = wrapper.backward

    def backward(loss, sync_gradients=True, **kwargs):
        return original(loss, sync_gradients=False, **kwargs)

    wrapper.backward = backward
    try:
        yield
    finally:
        del wrapper.backward  # the class's method again


@contextlib.contextmanager
def fsdp2_gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """FSDP2 `set_requires_gradient_sync(False)` inside when not `enabled`, True again after (as accelerate's
    `Accelerator.no_sync` does for FSDP2). Only for chunks of a micro-step that syncs (the window's last):
    the earlier micro-steps are under accelerate's `no_sync` already."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None or enabled:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)
