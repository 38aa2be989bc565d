"""Recovery from out-of-memory errors inside a running `transformers.Trainer`.

Training (`ChunkedTrainingStep`): `trainer.training_step` is wrapped so one micro-batch can
run as `c` chunks, each forward+backward with its loss weighted by its share of the
micro-batch (examples, or label tokens for token-level mean losses; weight 1 where the loss
is already sum / num_items_in_batch), so the accumulated gradient equals the unchunked one.
The inputs of the current accumulation window's micro-steps are kept (on the CPU) with the
RNG state at their start. On an OOM inside a micro-step: memory is freed, the error is
diagnosed, the partial gradients are zeroed, `c` is doubled, and the window's earlier
micro-steps and the failing one are recomputed chunked: the optimizer step sees the
gradient it would have seen, no optimizer step is lost, the effective batch size and the
data order are unchanged. The loss reported for the earlier micro-steps was already
counted and is not counted again.

TRL's batches: a padding-free row (SFTTrainer with padding_free or bfd packing) is split into
chunks of whole examples, a DPO or reward batch into chunks of preference pairs (chosen and rejected together),
a KTO batch into chunks of examples with loss_type apo_zero_unpaired and not at all with its KL term (each
example's loss uses the KL estimate of the whole micro-batch: the OOM is raised with one line saying why), a
GRPO micro-batch into chunks of completions (memfit.fitting.grpo_recovery, which also recovers in GRPO's
generation and scoring), a DistillationTrainer micro-batch likewise (memfit.fitting.distill_recovery).

With DDP, the micro-steps run without collectives and memfit averages the gradients after
the window (memfit.fitting.distributed), so a rank that recovers does not leave the others
waiting inside DDP's all-reduce. Under DeepSpeed and FSDP2, whose collectives are inside every
forward and backward, every rank runs the same chunks, votes after each chunk's forward and splits
further together; the engine keeps its accumulation boundary on the last chunk (memfit.fitting.engines).

Evaluation (`guard_evaluation`): an OOM in `trainer.evaluate` halves
`per_device_eval_batch_size` and sets `eval_accumulation_steps=1`, then reruns the
evaluation; the training batch is not touched.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from memfit.fitting import _trainer as adapter
from memfit.fitting import distributed as dist_sync
from memfit.fitting import engines
from memfit import oom_text
from memfit.sim import _trl_adapter as trl_adapter

logger = logging.getLogger("memfit.fit")

__all__ = ["is_oom_error", "OOM_FRAGMENTS", "Meter", "ChunkedTrainingStep", "guard_evaluation", "free_memory",
           "Recovery", "oom_cause"]

#: The texts of out-of-memory errors raised as other types (RuntimeError, AcceleratorError, ...): the one
#: table memfit.oom_text keeps for detection and parsing alike; recovery acts on its `certain` entries.
OOM_FRAGMENTS = oom_text.OOM_FRAGMENTS


def is_oom_error(exc: BaseException) -> bool:
    """True for an out-of-memory error: `torch.OutOfMemoryError` first, then `oom_text.is_oom_text`."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, (RuntimeError, MemoryError)):
        return False
    return oom_text.is_oom_text(str(exc))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Recovery:
    """One change made after an out-of-memory error."""

    step: int  #: optimizer steps completed when it happened
    phase: str  #: train, eval, optimizer, save, load_best, or (GRPO) generation or scoring
    change: str
    diagnosis: str
    tried_to_allocate_bytes: int | None = None


class Meter:
    """Peak memory per phase: the budget's peak under memory_budget, else torch.cuda's on a GPU."""

    def __init__(self, budget: Any = None) -> None:
        self.budget = budget
        self.cuda = budget is None and torch.cuda.is_available()
        self.peaks: dict[str, int] = {}
        self.reserved: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return self.budget is not None or self.cuda

    def reset(self) -> None:
        if self.budget is not None:
            self.budget.reset_peak()
        elif self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def record(self, phase: str) -> None:
        if self.budget is not None:
            peak, reserved = self.budget.peak_bytes, self.budget.peak_bytes
        elif self.cuda:
            peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        else:
            return
        self.peaks[phase] = max(self.peaks.get(phase, 0), int(peak))
        self.reserved[phase] = max(self.reserved.get(phase, 0), int(reserved))


def oom_cause(exc: BaseException) -> tuple[str, int | None]:
    """The diagnosis's first cause and the bytes the failed allocation tried; never raises."""
    try:
        from memfit.diagnosis.verb import diagnose

        d = diagnose(exc)
        tried = d.message.tried_to_allocate_bytes if d.message else None
        return (d.causes[0].text if d.causes else str(exc).splitlines()[0][:200]), tried
    except Exception:  # a diagnosis must never hide the recovery
        return str(exc).splitlines()[0][:200], None


def _to_cpu(inputs: dict[str, Any]) -> dict[str, Any]:
    """Host copies of a micro-batch, kept for a possible recomputation of the window.

    From a GPU the copy is non-blocking (into pinned memory: no device sync per micro-step);
    `_recover` synchronises before it reads them.
    """
    return {k: (v.detach().to("cpu", non_blocking=v.is_cuda) if isinstance(v, torch.Tensor) else v)
            for k, v in inputs.items()}


def _batch_size(inputs: dict[str, Any]) -> int:
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 1


def _split(inputs: dict[str, Any], c: int, kind: str = "trainer") -> list[dict[str, Any]]:
    """Up to `c` chunks of a micro-batch; `kind` the trainer's (memfit.sim._trl_adapter.trainer_kind)."""
    if _is_padding_free(inputs):  # TRL: one flattened row of several examples
        return _split_padding_free(inputs, c)
    if _is_paired(inputs, kind):  # TRL: a DPO / reward batch, chosen then rejected
        return _split_pairs(inputs, c)
    n = _batch_size(inputs)
    c = max(1, min(c, n))
    bounds = [round(i * n / c) for i in range(c + 1)]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        parts.append({k: (v[a:b] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v)
                      for k, v in inputs.items()})
    return parts


# -- TRL: micro-batches that are not split along their first dimension -------------------------

def _splittable(inputs: dict[str, Any], kind: str = "trainer") -> int:
    """The most chunks a micro-batch splits into: examples of a padding-free row, pairs of a DPO or reward batch,
    else its batch size."""
    if _is_padding_free(inputs):
        return int(inputs["cu_seq_lens_q"].numel()) - 1
    if _is_paired(inputs, kind):
        return max(1, _batch_size(inputs) // 2)
    return _batch_size(inputs)


def _is_paired(inputs: dict[str, Any], kind: str) -> bool:
    """Rows [chosen_0..chosen_B-1, rejected_0..rejected_B-1]: DPOTrainer's batch, and RewardTrainer's
    (reward_trainer.py DataCollatorForPreference: input_ids / attention_mask (/ margin) only; `compute_loss`
    chunks the scores in two halves). KTOTrainer's unpaired batch has a completion mask and no labels like DPO's,
    but each row is its own example (kto_trainer.py DataCollatorForUnpairedPreference), as in DistillationTrainer's
    micro-batch of prompts and their completions (distillation_trainer.py `_generate_and_score_completions`)."""
    if kind == "reward":
        return True
    return kind not in ("kto", "distill") and _is_dpo_batch(inputs)


def _is_dpo_batch(inputs: dict[str, Any]) -> bool:
    """DataCollatorForPreference's batch: a completion mask, no labels; a GRPO micro-batch (prompt_ids,
    completion_ids, advantages) has one too, and splits by completions like any batch."""
    return "completion_mask" in inputs and "labels" not in inputs and "advantages" not in inputs


def _is_padding_free(inputs: dict[str, Any]) -> bool:
    """TRL's padding-free batch (DataCollatorForLanguageModeling(padding_free=True)): one row, position_ids
    and cu_seq_lens_q, no attention mask."""
    ids = inputs.get("input_ids")
    return (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 and "attention_mask" not in inputs
            and isinstance(inputs.get("cu_seq_lens_q"), torch.Tensor))


def _split_padding_free(inputs: dict[str, Any], c: int) -> list[dict[str, Any]]:
    """Chunks of whole examples of a padding-free row, each a padding-free row of its own (its cu_seq_lens,
    max lengths and seq_idx rebuilt as the collator builds them). Each example attends only to itself
    (varlen kernels, or transformers' block-diagonal mask from the restarting position_ids), so the
    chunks' per-token losses are those of the whole row."""
    cu = [int(x) for x in inputs["cu_seq_lens_q"].tolist()]
    docs = len(cu) - 1
    c = max(1, min(c, docs))
    bounds = [round(i * docs / c) for i in range(c + 1)]
    width = inputs["input_ids"].shape[1]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        start, end = cu[a], cu[b]
        part: dict[str, Any] = {}
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == (1, width):
                part[k] = v[:, start:end]
            else:
                part[k] = v
        new_cu = inputs["cu_seq_lens_q"][a:b + 1] - start
        part["cu_seq_lens_q"] = new_cu
        if "cu_seq_lens_k" in inputs:
            part["cu_seq_lens_k"] = new_cu
        longest = int(new_cu.diff().max())
        for k in ("max_length_q", "max_length_k"):
            if k in inputs:
                part[k] = longest
        if isinstance(inputs.get("seq_idx"), torch.Tensor):
            part["seq_idx"] = inputs["seq_idx"][:, start:end] - a
        parts.append(part)
    return parts


def _split_pairs(inputs: dict[str, Any], c: int) -> list[dict[str, Any]]:
    """Chunks of preference pairs of a DPO batch (DataCollatorForPreference: rows [chosen_0..chosen_B-1,
    rejected_0..rejected_B-1]); a pair's chosen and rejected stay in the same chunk, in that order."""
    n = _batch_size(inputs)
    pairs = n // 2
    c = max(1, min(c, pairs))
    bounds = [round(i * pairs / c) for i in range(c + 1)]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        part: dict[str, Any] = {}
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
                part[k] = torch.cat([v[a:b], v[pairs + a:pairs + b]])
            elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == pairs:  # ref_*_logps
                part[k] = v[a:b]
            else:
                part[k] = v
        parts.append(part)
    return parts


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class ChunkedTrainingStep:
    """The replacement for `trainer.training_step`; see the module docstring."""

    def __init__(self, trainer: Any, *, max_recoveries: int, meter: Meter, recoveries: list[Recovery],
                 on_change: Callable[[str], None]) -> None:
        self.trainer = trainer
        self.original = trainer.training_step
        self.original_compute_loss = trainer.compute_loss
        self.max_recoveries = max_recoveries
        self.meter = meter
        self.recoveries = recoveries
        self.on_change = on_change
        self.chunks = 1
        self.window: list[tuple[dict[str, Any], Any, dict[str, Any]]] = []
        self._window_done = True
        self._weight = 1.0
        self.micro_steps = 0
        self._vote: tuple[engines.AgreedChunks, int, Any] | None = None  #: engine runs: (state, remaining, chunk)
        self._voted = False  #: engine runs: this chunk's forward was voted on (an OOM now is in its backward)
        self.kind = trl_adapter.trainer_kind(trainer)  #: how a micro-batch splits (`_split`)
        #: KTOTrainer with its KL term (every loss_type but apo_zero_unpaired, kto_trainer.py `calculate_KL`): the
        #: loss of each example uses the KL estimate of the whole micro-batch (`_compute_loss`: `kl = (KL_logps -
        #: ref_KL_logps).mean()`), so a chunk's loss is not its share of the micro-batch's: not split
        self.whole_batch_loss = self.kind == "kto" and bool(getattr(trainer, "calculate_KL", False))
        trainer.compute_loss = self._compute_loss
        trainer.training_step = self

    def uninstall(self) -> None:
        self.trainer.training_step = self.original
        self.trainer.compute_loss = self.original_compute_loss

    # -- loss weighting and per-phase measurement --------------------------------------------
    def _compute_loss(self, model, inputs, *args, **kwargs):
        if self._vote is not None:  # DeepSpeed / FSDP2: every rank votes after this forward
            out = self._voted_forward(model, inputs, *args, **kwargs)
        else:
            out = self.original_compute_loss(model, inputs, *args, **kwargs)
        self.meter.record("forward")
        self.meter.reset()
        if self._weight != 1.0:
            if isinstance(out, tuple):
                return (out[0] * self._weight,) + tuple(out[1:])
            return out * self._weight
        return out

    def _voted_forward(self, model, inputs, *args, **kwargs):
        state, remaining, part = self._vote
        self._vote = None  # one vote per chunk
        gathering = engines.forward_collectives(self.trainer, model)
        tracker = engines.forward_tracker(model) if gathering else contextlib.nullcontext({"inside": False})
        try:
            with tracker as where:
                out = self.original_compute_loss(model, inputs, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an OOM is voted on, anything else stops every rank
            if not is_oom_error(exc):
                engines.forward_vote(failure=None, fatal=True, wanted_chunks=state.chunks, remaining=remaining)
                raise
            failure = oom_cause(exc)
            if where["inside"]:  # the peers are in an all-gather of this forward: a vote would not be matched
                import torch.distributed as dist

                message = engines.forward_oom_message(
                    rank=dist.get_rank() if dist.is_initialized() else 0, engine=gathering,
                    step=self.trainer.state.global_step, timeout_s=float(self.trainer.args.ddp_timeout),
                    cause=str(exc).splitlines()[0][:200] if str(exc) else failure[0])
                logger.error("%s", message)
                raise engines.CollectiveForwardOOM(message) from None
            exc = None  # drop the traceback (it holds the activations)
        else:
            engines.forward_vote(failure=None, fatal=False, wanted_chunks=state.chunks, remaining=remaining)
            self._voted = True  # every rank goes on to this chunk's backward
            return out
        free_memory()
        why = engines.check_can_split(state, part, lambda p: 1 if self.whole_batch_loss else _splittable(p, self.kind))
        if why:
            engines.forward_vote(failure=failure, fatal=True, wanted_chunks=state.chunks, remaining=remaining)
            raise torch.OutOfMemoryError(
                f"memfit: out of memory at optimizer step {self.trainer.state.global_step} in a chunk of "
                f"{_batch_size(part)} of a micro-batch split into {state.chunks} chunks ({why}); last error: {failure[0]}")
        engines.forward_vote(failure=failure, fatal=False, wanted_chunks=state.chunks * 2, remaining=remaining)
        raise AssertionError("forward_vote raises ForwardFailed after an OOM")  # pragma: no cover

    def _weights(self, parts: list[dict[str, Any]], num_items: Any, model: Any) -> list[float]:
        if len(parts) == 1:
            return [1.0]
        if adapter.loss_uses_num_items(self.trainer, model, num_items):
            return [1.0] * len(parts)
        counts = []
        for p in parts:
            labels = p.get("labels")
            if isinstance(labels, torch.Tensor) and labels.dim() > 1:  # token-level mean loss
                counts.append(int(labels.ne(-100).sum()))
            else:
                counts.append(_batch_size(p))
        total = sum(counts) or 1
        return [c / total for c in counts]

    def _run(self, model, inputs, num_items, chunks: int):
        parts = _split(inputs, chunks, self.kind) if chunks > 1 else [inputs]
        weights = self._weights(parts, num_items, model)
        total = None
        for part, w in zip(parts, weights):
            self._weight = w
            try:
                self.meter.reset()
                loss = self.original(model, part, num_items)
                self.meter.record("backward")
            finally:
                self._weight = 1.0
            total = loss if total is None else total + loss
        return total

    # -- the wrapped training_step -------------------------------------------------------------
    def __call__(self, model, inputs, num_items_in_batch=None):
        trainer = self.trainer
        if self._window_done:
            self.window = []
        sync = bool(trainer.accelerator.gradient_state.sync_gradients)
        self._window_done = sync
        engine = engines.engine_of(trainer)
        if engine is not None:  # no window kept: chunks already backwarded are never recomputed there
            self.micro_steps += 1
            return self._engine_micro_step(engine, model, inputs, num_items_in_batch, sync)
        entry = (_to_cpu(inputs), num_items_in_batch, _rng_state())
        self.window.append(entry)
        self.micro_steps += 1
        if not dist_sync.is_ddp(model):
            return self._micro_step(model, inputs, num_items_in_batch)
        # DDP: no collective inside a micro-step (a rank that recovers runs more forwards and
        # backwards than the others); gradients are averaged once, after the window, by memfit
        dist_sync.take_over_buffer_sync(model)
        with model.no_sync():
            try:
                loss = self._micro_step(model, inputs, num_items_in_batch)
            except BaseException:
                dist_sync.check_peers(failed=True)  # the other ranks stop at their window end instead of waiting
                raise
        if sync:
            dist_sync.check_peers(failed=False)
            dist_sync.average_gradients(model)
        return loss

    def _engine_micro_step(self, engine: str, model, inputs, num_items_in_batch, sync: bool):
        """One micro-step under DeepSpeed or FSDP2: agreed chunks, the boundary on the last (memfit.fitting.engines)."""
        trainer = self.trainer
        state = engines.AgreedChunks(chunks=self.chunks, max_recoveries=self.max_recoveries,
                                     recoveries_used=lambda: len(self.recoveries), on_recover=self._on_agreed_split)

        def run_chunk(part, weight, last, remaining):
            hold = sync and not last  # the engine's boundary (and DeepSpeed's step) stay on the last chunk
            if engine == "deepspeed":
                ctx = engines.deepspeed_boundary_held(trainer) if hold else contextlib.nullcontext()
            else:
                ctx = engines.fsdp2_gradient_sync(model, not hold)
            self._vote, self._weight, self._voted = (state, remaining, part), weight, False
            try:
                self.meter.reset()
                with ctx:
                    loss = self.original(model, part, num_items_in_batch)
                self.meter.record("backward")
            except engines.ForwardFailed:
                raise
            except Exception as exc:
                if self._voted and is_oom_error(exc):  # after the vote: in the backward
                    raise torch.OutOfMemoryError(
                        f"memfit: out of memory in the backward at optimizer step {trainer.state.global_step} under "
                        f"{engine}: the engine's gradient collectives of this backward are under way on the other "
                        "ranks, so the ranks cannot split this micro-batch together; resume from the last checkpoint "
                        f"with a smaller per_device_train_batch_size. Last error: {str(exc).splitlines()[0][:200]}"
                    ) from None
                raise
            finally:
                self._vote, self._weight = None, 1.0
            return loss

        try:
            return engines.run_agreed_chunks(state, inputs, split=_split, run_chunk=run_chunk,
                                             shares=lambda parts: self._weights(parts, num_items_in_batch, model))
        finally:
            self.chunks = state.chunks

    def _on_agreed_split(self, cause: str, tried: int | None, old: int, new: int, here: bool) -> None:
        step = self.trainer.state.global_step
        change = (f"micro-batch now runs as {new} chunks (was {old}) on every rank; the chunks not yet backwarded "
                  "were split further, effective batch size and data order unchanged")
        if here:
            self.recoveries.append(Recovery(step, "train", change, cause, tried))
            self.on_change(f"out of memory at optimizer step {step} (train): {cause} -> {change}")
        else:
            self.on_change(f"another rank ran out of memory at optimizer step {step} (train) -> {change}")

    def _micro_step(self, model, inputs, num_items_in_batch):
        try:
            return self._run(model, inputs, num_items_in_batch, self.chunks)
        except Exception as exc:  # noqa: BLE001 - only OOMs are handled, the rest re-raised
            if not is_oom_error(exc):
                raise
            failure = oom_cause(exc)
            exc = None  # drop the traceback (it holds the activations)
        del inputs
        return self._recover(model, failure)

    def _recover(self, model, failure: tuple[str, int | None]):
        trainer = self.trainer
        device = trainer.args.device
        while True:
            cause, tried = failure
            micro = _splittable(self.window[-1][0], self.kind)
            if self.whole_batch_loss:
                raise torch.OutOfMemoryError(
                    f"memfit: out of memory at optimizer step {trainer.state.global_step} in a KTO micro-batch of "
                    f"{micro}, which memfit does not split: KTOTrainer's loss uses the KL estimate of the whole "
                    "micro-batch (kto_trainer.py `_compute_loss`); resume from the last checkpoint with a smaller "
                    "per_device_train_batch_size (at least 2) or loss_type apo_zero_unpaired (no KL term); last "
                    f"error: {cause}")
            if len(self.recoveries) >= self.max_recoveries or self.chunks >= micro:
                raise torch.OutOfMemoryError(
                    f"memfit: out of memory at optimizer step {trainer.state.global_step} even with the micro-batch "
                    f"of {micro} split into {self.chunks} chunks (recoveries: {len(self.recoveries)} of "
                    f"{self.max_recoveries}); last error: {cause}")
            old = self.chunks
            self.chunks = min(micro, old * 2)
            per_chunk = -(-micro // self.chunks)
            change = (f"micro-batch of {micro} now runs as {self.chunks} chunks of <= {per_chunk} examples "
                      f"(was {old}); gradients of the {len(self.window)} micro-step(s) of this accumulation window "
                      "recomputed, effective batch size and data order unchanged")
            self.recoveries.append(Recovery(trainer.state.global_step, "train", change, cause, tried))
            self.on_change(f"out of memory at optimizer step {trainer.state.global_step} (train): {cause} -> {change}")
            model.zero_grad(set_to_none=True)
            free_memory()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the non-blocking host copies of the window are complete
            try:
                loss = None
                for i, (saved, num_items, rng) in enumerate(self.window):
                    _set_rng_state(rng)
                    on_device = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}
                    loss = self._run(model, on_device, num_items, self.chunks)
                    del on_device
                return loss  # the failing micro-step's loss; earlier ones were already counted
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                failure = oom_cause(exc)
                exc = None


class PeerEvalOOM(RuntimeError):
    """Another rank's evaluation ran out of memory in this eval batch: every rank reruns the evaluation smaller."""


def _agreed_prediction_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Trainer.prediction_step` followed, on every rank, by one vote (a small all-reduce) before the batch's
    gather: transformers' `evaluation_loop` calls `self.gather_function` (accelerate's `gather_for_metrics`, a
    collective) right after each `prediction_step`. A rank whose prediction step ran out of memory says so, and
    every rank then leaves the loop at that same batch (the OOM's rank with its error, the others with
    PeerEvalOOM), before any rank enters the gather its peer would never join."""

    def prediction_step(*args, **kwargs):
        try:
            out = original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            oom = is_oom_error(exc)
            dist_sync.agree_flags([int(not oom), int(oom)])
            raise
        fatal_any, oom_any = dist_sync.agree_flags([0, 0])
        if fatal_any:
            raise dist_sync.PeerFailed("memfit: another process of this run stopped with an error in evaluation "
                                       "(see its log); this process stops too instead of waiting for it")
        if oom_any:
            raise PeerEvalOOM("another rank ran out of memory in this eval batch")
        return out

    return prediction_step


def guard_evaluation(trainer: Any, *, max_recoveries: int, meter: Meter, recoveries: list[Recovery],
                     on_change: Callable[[str], None]) -> Callable[[], None]:
    """Wrap `trainer.evaluate`: an OOM lowers the eval batch size and reruns the evaluation. Returns an undo.

    Several ranks (torch.distributed initialised): each eval batch's prediction step is followed by a vote
    (`_agreed_prediction_step`), so an OOM on one rank makes every rank rerun the evaluation, all with the
    same halved `per_device_eval_batch_size` (the smallest over the ranks, halved) and
    `eval_accumulation_steps=1`; a rank that cannot go lower stops, and the others with PeerFailed.
    """
    original = trainer.evaluate
    distributed = dist_sync.is_distributed()
    original_step = trainer.prediction_step
    if distributed:
        trainer.prediction_step = _agreed_prediction_step(original_step)

    def evaluate(*args, **kwargs):
        while True:
            meter.reset()
            try:
                metrics = original(*args, **kwargs)
                meter.record("eval")
                return metrics
            except Exception as exc:  # noqa: BLE001
                peer = isinstance(exc, PeerEvalOOM)
                if not (peer or is_oom_error(exc)):
                    raise
                cause, tried = (str(exc), None) if peer else oom_cause(exc)
                exc = None
            ta = trainer.args
            old_bs, old_acc = ta.per_device_eval_batch_size, ta.eval_accumulation_steps
            evals = sum(1 for r in recoveries if r.phase == "eval")
            if distributed:  # the same settings everywhere, whatever each rank had
                neg_bs, evals = dist_sync.agree_flags([-old_bs, evals])
                old_bs = -neg_bs
            if (old_bs <= 1 and (old_acc or 1) == 1) or evals >= max_recoveries:
                if peer:
                    raise dist_sync.PeerFailed(
                        f"memfit: another process of this run ran out of memory in evaluation even at "
                        f"per_device_eval_batch_size={old_bs}; this process stops too")
                raise torch.OutOfMemoryError(
                    f"memfit: out of memory in evaluation even at per_device_eval_batch_size={old_bs}, "
                    f"eval_accumulation_steps={old_acc}; last error: {cause}")
            ta.per_device_eval_batch_size = max(1, old_bs // 2)
            ta.eval_accumulation_steps = 1
            change = (f"per_device_eval_batch_size {old_bs} -> {ta.per_device_eval_batch_size}, "
                      f"eval_accumulation_steps {old_acc} -> 1; evaluation rerun (training batch unchanged)")
            recoveries.append(Recovery(trainer.state.global_step, "eval", change, cause, tried))
            on_change(f"out of memory at optimizer step {trainer.state.global_step} (eval): {cause} -> {change}")
            adapter.reset_eval_dataloaders(trainer)
            free_memory()
            time.sleep(0)

    trainer.evaluate = evaluate

    def undo() -> None:
        trainer.evaluate = original
        if distributed:
            trainer.prediction_step = original_step

    return undo
