"""Explain an out-of-memory error: where it happened, why, and what helps.

`diagnose` is pure: text, a log file's path or an exception in, a frozen `Diagnosis` out;
the CLI prints it.

Where: the traceback frames just before the last OOM message are matched against
transformers 5's Trainer (trainer.py: ``_run_epoch`` -> ``training_step`` ->
``compute_loss`` / ``accelerator.backward``; ``optimizer.step`` and ``_clip_grad_norm``;
``_maybe_log_save_evaluate`` -> ``_evaluate`` -> ``evaluate`` -> ``evaluation_loop`` ->
``prediction_step``; ``_save_checkpoint`` / ``save_model`` / ``_save``;
``_load_best_model``), DeepSpeed (deepspeed/runtime/engine.py ``step`` ->
``_take_model_step``, zero/stage_1_and_2.py and stage3.py ``step`` / ``_optimizer_step``;
``backward``, ``allreduce_gradients`` and the ZeRO gradient-reduction hooks), torch
(``torch/autograd``, ``torch/optim``, ``torch/utils/data/_utils/collate.py``,
``nn.Module._apply``) and plain PyTorch loops. The most specific phase wins, in
`_PHASE_ORDER` order (a forward inside evaluation is evaluation; recomputation inside
backward is backward; accelerate's DeepSpeed wrapper calls ``engine.step()`` from inside
``backward``, and that is the optimizer step).

Why, from the message's own arithmetic (T request, F free, U reserved-but-unallocated,
R reserved, C capacity; a figure the message does not print is unknown, never 0):

* the caching allocator first searches its cache, then asks the driver for T, and at
  the moment it raises every whole free segment has already gone back to the driver
  ("The only remaining cached memory is split from a larger block that is partially
  in-use", c10/cuda/CUDACachingAllocator.cpp, next to the OOM message). So:
* T > C: no setting makes one allocation larger than the device fit.
* F < T <= U + F (and T is a large-pool request): fragmentation decides it; the
  allocation would have fit had the unused cache been in one piece.
* F >= T + headroom: the device had the memory; the driver refused for another reason:
  a per-process memory fraction (``allowed``), a single allocation above a backend
  limit (Intel GPUs), the HIP allocator (ROCm), the WDDM driver (Windows), a limit
  PyTorch does not print. It is not a shortfall and not fragmentation.
* otherwise a shortfall of T - F, unless other processes or memory outside PyTorch
  (C - F - R) would have made room.
* "Process N has X in use" without a "this process" line is this very process when
  X + R exceeds what is in use (C - F), or when X is R plus a context's worth.

What allocated: the innermost frames name the operation (memfit.diagnosis.operations: the
logits over the vocabulary, the S x S attention matrix, a bitsandbytes dequantization, an FSDP /
ZeRO-3 parameter gather, generation's KV cache, NCCL's buffers), whose advice comes before the
phase's. NCCL's own out-of-memory reports (``NCCL WARN Cuda failure 'out of memory'``) are
diagnosed too: they bypass PyTorch's allocator, so they carry no allocator figures.

MPS messages are read with MPSAllocator.mm's arithmetic: MPS allocated + other
allocations + T > max allowed is the high-watermark limit; below it Metal itself refused.
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

from memfit.allocator.caching import K_SMALL_BUFFER
from memfit.errors import MemfitError
from memfit.diagnosis.operations import (OPERATION_ADVICE, Operation, detect_operation, logits_shape_for,
                                         nccl_oom_line, traceback_frames)
from memfit.diagnosis.strings import t
from memfit.oom_text import ALLOCATOR_FORMATS, OomMessage, decode_log, find_ooms, normalize_log
from memfit.trace import DIAGNOSED_PHASES
from memfit.units import GiB, KiB, MiB, format_bytes

__all__ = [
    "Cause",
    "Diagnosis",
    "diagnose",
    "detect_phase",
    "detect_operation",
    "read_log",
    "PHASES",
    "FRAGMENTATION_MIN_BYTES",
    "FRAGMENTATION_MIN_SHARE",
    "CUDA_CONTEXT_TYPICAL_BYTES",
    "OTHER_PROCESSES_MIN_BYTES",
    "ALLOCATION_HEADROOM_MIN_BYTES",
    "ALLOCATION_HEADROOM_SHARE",
    "XPU_MAX_SINGLE_ALLOCATION_BYTES",
]

#: Unused cache that does not decide the allocation is called a contributing
#: fragmentation from this size ...
FRAGMENTATION_MIN_BYTES = 256 * MiB
#: ... and this share of PyTorch's reserved memory (the seed case: 0.47 of 14.78 GiB = 3%).
FRAGMENTATION_MIN_SHARE = 0.10
#: A CUDA context plus cuBLAS/cuDNN workspaces: typically 0.3-1.5 GiB per process.
CUDA_CONTEXT_TYPICAL_BYTES = int(1.5 * GiB)
#: Other processes holding less than this together are not worth stopping.
OTHER_PROCESSES_MIN_BYTES = 256 * MiB
#: A listed process at most this far above PyTorch's reserved memory is taken to be this
#: process seen through a container's PID namespace (PyTorch compares NVML's PID with getpid()).
SELF_PID_SLACK_BYTES = 2 * GiB
#: Free memory less than this above the request is no real headroom: cudaMemGetInfo's free
#: figure is more than one allocation can get (ComputationalRadiationPhysics/cuda_memtest#39
#: measured the largest possible allocation 33 MiB below the reported free memory of a
#: 64 GiB GPU, after a 16 MiB allowance proved too small); memfit allows about twice that ...
ALLOCATION_HEADROOM_MIN_BYTES = 64 * MiB
#: ... or 1% of the request when that is larger (page tables grow with the allocation).
ALLOCATION_HEADROOM_SHARE = 0.01
#: Intel GPUs other than the Data Center GPU Max refuse one allocation above the device's
#: max_mem_alloc_size, just under 4 GiB on Arc (4294959104 bytes measured on an A770 in
#: CHIP-SPV/chipStar#1186; intel/compute-runtime#627), even with free memory left
#: (pytorch/pytorch#176868). UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1 lifts it
#: (oneapi-src/unified-runtime#1245).
XPU_MAX_SINGLE_ALLOCATION_BYTES = 4 * GiB - 8 * KiB

PHASES = DIAGNOSED_PHASES  # memfit.trace: one vocabulary for every part of memfit


@dataclass(frozen=True, slots=True)
class Cause:
    """One reason, with the bytes it accounts for (None when the message does not say)."""

    kind: str  #: see `CAUSE_KINDS`
    bytes: int | None
    text: str
    primary: bool = False


#: Every `Cause.kind` diagnose gives.
CAUSE_KINDS = ("shortfall", "fragmentation", "memory_cap", "free_exceeds_request", "backend_limit",
               "non_pytorch", "other_processes", "self_pid", "inconsistent_free", "unknown_free",
               "mps_watermark", "mps_other_allocations", "mps_system", "cpu_ram", "truncated", "cuda_error",
               "xpu_runtime_error", "cublas_alloc_failed", "cudnn_alloc_failed", "cudnn_not_supported",
               "nccl", "logits", "operation")


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What `diagnose` found. `advice` is ranked, most effective first."""

    is_oom: bool
    message: OomMessage | None
    phase: str
    causes: tuple[Cause, ...]
    advice: tuple[str, ...]
    oom_count: int
    advice_ids: tuple[str, ...] = ()
    phase_frame: str = ""  #: the traceback frame that decided the phase
    lang: str = "en"
    plan: object = None  #: memfit.planner.search.PlanResult when a setup was given
    operation: str = "unknown"  #: memfit.diagnosis.operations.OPERATIONS: what allocated
    operation_frame: str = ""  #: the frame (or code line) that decided the operation
    operation_context: tuple[str, ...] = ()  #: operations further out in the traceback, innermost first

    @property
    def non_pytorch_bytes(self) -> int | None:
        return self.message.non_pytorch_bytes if self.message else None

    @property
    def remedies(self) -> tuple[str, ...]:
        """The memfit.remedies the advice recommends, in its order (the names `memfit plan` uses)."""
        from memfit.remedies import remedy_for_advice

        return tuple(dict.fromkeys(r.name for r in map(remedy_for_advice, self.advice_ids) if r is not None))


# --------------------------------------------------------------------------- phase


_FRAME_RE = re.compile(r'^[ \t]*File "(?P<file>[^"]+)", line \d+, in (?P<func>[^\s]+)[ \t]*$', re.M)
# A frame pasted without its start: 'efficient_cross_entropy.py", line 108, in forward' (the file's
# opening `File "` cut off, mgmalek/efficient_cross_entropy#9) or `line 3479, in cross_entropy`.
_PART_FRAME_RE = re.compile(r'^[ \t]*(?:(?P<file>[^\s"]+)", )?line \d+, in (?P<func>[^\s]+)[ \t]*$', re.M)

_SAVE_FUNCS = {"_save_checkpoint", "save_model", "_save", "save_pretrained", "_save_optimizer_and_scheduler",
               "save_state", "_save_rng_state", "save_file"}
_EVAL_FUNCS = {"evaluate", "_evaluate", "evaluation_loop", "prediction_step", "predict", "prediction_loop"}
_LOAD_FUNCS = {"from_pretrained", "_load_from_checkpoint", "_move_model_to_device", "_load_pretrained_model",
               "_load_state_dict_into_meta_model", "load_state_dict", "dispatch_model",
               "load_checkpoint_and_dispatch", "load_checkpoint_in_model"}
# FSDP's forward hooks (FSDP2 _fsdp_state.py _pre_forward, _fsdp_param_group.py pre_forward) run in the forward.
_FORWARD_FUNCS = {"forward", "_call_impl", "_wrapped_call_impl", "compute_loss", "training_step", "_pre_forward",
                  "pre_forward"}
# DeepSpeed (deepspeedai/DeepSpeed edaa7221): runtime/engine.py DeepSpeedEngine.step -> _take_model_step;
# zero/stage_1_and_2.py and zero/stage3.py step -> _optimizer_step, unscale_and_clip_grads, update_lp_params,
# stage3 _pre_step/_post_step; pipe/engine.py _exec_optimizer_step; fp16/fused_optimizer.py and
# bf16_optimizer.py step; ops/adam etc. step.
_DEEPSPEED_OPTIMIZER_FUNCS = {"step", "_take_model_step", "_optimizer_step", "_exec_optimizer_step",
                              "unscale_and_clip_grads", "update_lp_params", "_pre_step", "_post_step",
                              "scaled_global_norm", "get_grad_norm_direct"}
# engine.py backward, allreduce_gradients, _backward_prologue/_epilogue; stage_1_and_2.py reduce_gradients,
# reduce_ipg_grads, average_tensor, reduce_ready_partitions_and_remove_grads,
# reduce_independent_p_g_buckets_and_remove_grads, grad_handling_hook; stage3.py partition_grads,
# reduce_partition_and_remove_grads, __reduce_and_partition_ipg_grads (name-mangled); pipe _exec_backward_pass.
_BACKWARD_FUNCS = {"backward", "_engine_run_backward", "allreduce_gradients", "_backward_prologue",
                   "_backward_epilogue", "reduce_gradients", "reduce_ipg_grads", "average_tensor",
                   "reduce_ready_partitions_and_remove_grads", "reduce_independent_p_g_buckets_and_remove_grads",
                   "grad_handling_hook", "partition_grads", "reduce_partition_and_remove_grads",
                   "_exec_backward_pass",
                   # FSDP1 torch/distributed/fsdp/_runtime_utils.py _pre_backward_hook; FSDP2 _fsdp_state.py
                   # _pre_backward and _fsdp_param_group.py pre_backward (unshard for the backward pass).
                   "_pre_backward_hook", "_pre_backward", "pre_backward"}


def _is_load_best(file: str, func: str, code: str) -> bool:
    return func == "_load_best_model"


def _is_save(file: str, func: str, code: str) -> bool:
    return (func in _SAVE_FUNCS or bool(re.search(r"\btorch\.save\(|\bsave_file\(|\bsave_model\(", code))
            or ("safetensors" in file and func.startswith("save")))


def _is_collate(file: str, func: str, code: str) -> bool:
    return "collat" in file.lower() or "collat" in func.lower() or "collate_fn(" in code


def _is_eval(file: str, func: str, code: str) -> bool:
    return func in _EVAL_FUNCS


def _is_model_load(file: str, func: str, code: str) -> bool:
    return (func in _LOAD_FUNCS or (file.endswith("torch/nn/modules/module.py") and func in {"_apply", "to", "cuda"})
            or bool(re.search(r"\bmodel\s*\.\s*(?:to|cuda)\(|\.from_pretrained\(", code)))


def _is_deepspeed(file: str) -> bool:
    return "/deepspeed/" in file or file.startswith("deepspeed/")


def _is_optimizer(file: str, func: str, code: str) -> bool:
    return ("torch/optim/" in file or "clip_grad" in file or func in {"_clip_grad_norm", "clip_grad_norm_"}
            or ("optim" in file.lower() and func == "step")
            or (_is_deepspeed(file) and "lr_schedules" not in file and func in _DEEPSPEED_OPTIMIZER_FUNCS)
            or bool(re.search(r"optimizer\.step\(|clip_grad_norm_?\(", code)))


def _is_backward(file: str, func: str, code: str) -> bool:
    return ("torch/autograd/" in file or func in _BACKWARD_FUNCS or func.endswith("__reduce_and_partition_ipg_grads")
            or bool(re.search(r"\.backward\(", code)))


def _is_forward(file: str, func: str, code: str) -> bool:
    return (func in _FORWARD_FUNCS or "/modeling_" in file
            or bool(re.search(r"\bmodel\(|\bself\.model\(", code)))


_PHASE_ORDER = (
    ("load_best", _is_load_best),
    ("save", _is_save),
    ("data_collation", _is_collate),
    ("eval", _is_eval),
    ("model_loading", _is_model_load),
    ("optimizer", _is_optimizer),
    ("backward", _is_backward),
    ("forward", _is_forward),
)


def _frames(text: str) -> list[tuple[str, str, str, str]]:
    """(file, func, code, frame line) for each ``File "...", line N, in f`` frame in `text` (file "" for a
    frame pasted without it)."""
    out = []
    # _PART_FRAME_RE never matches a whole frame line (its file part has no quote or space before `", `)
    for m in sorted([*_FRAME_RE.finditer(text), *_PART_FRAME_RE.finditer(text)], key=lambda m: m.start()):
        rest = text[m.end() + 1 :]
        nxt = rest.split("\n", 1)[0]
        code = "" if _FRAME_RE.match(nxt) else nxt.strip()
        file = (m.group("file") or "").replace("\\", "/")
        out.append((file, m.group("func"), code, " ".join(m.group(0).split())))
    return out


def detect_phase(traceback_text: str) -> tuple[str, str]:
    """The training phase a traceback points at, and the deciding frame line (``unknown``, ""). A
    traceback without plain frames is read as rich's boxed one (memfit.diagnosis.operations)."""
    text = normalize_log(traceback_text)
    frames = _frames(text) or [f for f in traceback_frames(text) if f[0]]
    for phase, test in _PHASE_ORDER:
        for file, func, code, line in reversed(frames):  # innermost first
            if test(file, func, code):
                return phase, (line + (f" | {code}" if code else ""))
    return "unknown", ""


def _traceback_for(text: str, oom: OomMessage, previous_end: int, next_start: int) -> str:
    """The traceback that belongs to `oom`: the one just before it, else the one just after."""
    before = text[previous_end : oom.offset]
    head = before.rfind("Traceback (most recent call last)")
    if head >= 0:
        return before[head:]
    tail = before[-20000:]
    if _FRAME_RE.search(tail) or _PART_FRAME_RE.search(tail) or "❱" in tail:  # ❱: rich's boxed traceback
        return tail
    return text[oom.offset : min(next_start, oom.offset + 20000)]


# --------------------------------------------------------------------------- numbers


def _fmt(n: int | None, lang: str = "en") -> str:
    """GiB with two decimals from 0.1 GiB up (as the OOM message reads), else binary units; None is unknown."""
    if n is None:
        return t("unknown", lang)
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else format_bytes(n)


def _pct(part: int | None, whole: int | None, lang: str = "en") -> str:
    return f"{100 * part / whole:.0f}%" if part is not None and whole else t("unknown", lang)


def _print_tol(*values: int | None) -> int:
    """How far the true sum of these printed figures can be from the printed one: half a unit
    of the second decimal each (format_size prints two decimals of KiB / MiB / GiB)."""
    tol = 0
    for n in values:
        if n is None or n <= 1024:
            continue
        scale = KiB if n <= MiB else MiB if n <= GiB else GiB
        tol += int(0.005 * scale) + 1
    return tol


def _headroom(tried: int) -> int:
    return max(ALLOCATION_HEADROOM_MIN_BYTES, int(ALLOCATION_HEADROOM_SHARE * tried))


_WINDOWS_RE = re.compile(r"(?:^|[\s\"'(])[A-Za-z]:\\[^\s\\]|\bWDDM\b|\bwin32\b|\bPS [A-Za-z]:\\", re.M)


def _on_windows(log_text: str) -> bool:
    """The log shows Windows: drive-letter paths in frames or prompts (``C:\\...``, ``PS C:\\``), or WDDM."""
    return bool(_WINDOWS_RE.search(log_text))


_TOOLS = {"cuda": "nvidia-smi", "rocm": "rocm-smi", "xpu": "xpu-smi", "mps": "Activity Monitor", None: "nvidia-smi"}


def _allocator_causes(m: OomMessage, lang: str, log_text: str) -> tuple[list[Cause], list[str]]:
    """Causes and cause-specific advice ids for a caching-allocator message (CUDA, HIP, XPU)."""
    T, C, F = m.tried_to_allocate_bytes, m.total_bytes, m.free_bytes
    A, R, U = m.allocated_bytes, m.reserved_bytes, m.reserved_unallocated_bytes
    L = m.allowed_bytes
    backend = m.backend or "cuda"
    fm = lambda n: _fmt(n, lang)  # noqa: E731
    f = {"total": fm(C), "free": fm(F), "reserved": fm(R), "allocated": fm(A), "unalloc": fm(U), "tried": fm(T),
         "ctx": fm(CUDA_CONTEXT_TYPICAL_BYTES), "share": _pct(A, C, lang), "tool": _TOOLS.get(backend, "nvidia-smi")}

    # A free figure above the capacity is no measurement of this device (ROCm APUs count system memory).
    free_bad = F is not None and C is not None and F > C + _print_tol(F, C)
    F_ok = None if free_bad else F

    # Processes: drop NVML "not available" values (> capacity); find this process behind a PID namespace.
    others = [(pid, b) for pid, b in m.other_processes if C is None or b <= C]
    P = m.process_used_bytes
    self_pid: tuple[int, int] | None = None
    self_sure = False
    if P is None and R and others:
        used = C - F_ok if C is not None and F_ok is not None else None
        # A process holding less than this process's cache is another process. One whose memory and this
        # process's cache cannot both fit in what is in use is this process (sure); else the one closest
        # above the cache by at most a context's worth is taken to be it (likely).
        candidates = [(pid, b) for pid, b in others if b + _print_tol(b, R) >= R]
        sure = [pb for pb in candidates if used is not None and pb[1] + R > used + _print_tol(pb[1], R, C, F_ok)]
        likely = [pb for pb in candidates if pb[1] - R <= SELF_PID_SLACK_BYTES]
        if sure or likely:
            self_sure = bool(sure)
            self_pid = min(sure or likely, key=lambda pb: abs(pb[1] - R))
        if self_pid:
            others.remove(self_pid)
            P = self_pid[1]
    others_bytes = sum(b for _, b in others)

    # What the message's arithmetic says.
    exceeds_total = T is not None and C is not None and T > C
    free_known = F_ok is not None and T is not None
    headroom = _headroom(T or 0)
    free_covers = free_known and F_ok >= T + headroom
    near_full = free_known and T <= F_ok < T + headroom
    deficit = max(0, T - F_ok) if free_known else None
    small_pool = T is not None and T <= K_SMALL_BUFFER
    cap = L is not None and R is not None and T is not None and R + T > L - _print_tol(L, R, T)
    if U is None or T is None or exceeds_total:
        frag = "unknown" if U is None or T is None else "small"
    elif free_covers:
        frag = "moot"
    elif free_known and U + F_ok >= T and (F_ok < T or U >= T):
        # With F >= T (inside the headroom) only a cached piece of T could have spared the driver call.
        frag = "small_pool" if small_pool else "fits"
    elif free_known and U + F_ok >= T:
        frag = "headroom"  # free memory alone covered the request: too little headroom, not the cache, failed it
    elif not free_known and U >= T:
        frag = "fits"
    elif not free_known:
        frag = "unknown"
    elif U >= FRAGMENTATION_MIN_BYTES and U >= FRAGMENTATION_MIN_SHARE * max(R or 0, 1):
        frag = "contributes"
    else:
        frag = "small"
    outside = C - F_ok - R if C is not None and F_ok is not None and R is not None else None
    own_extra = P - R if P and R is not None and P >= R else None  # this process outside its cache
    foreign = None if outside is None else max(0, outside - (own_extra or 0))
    outside_significant = foreign is not None and (foreign > CUDA_CONTEXT_TYPICAL_BYTES
                                                   or others_bytes >= OTHER_PROCESSES_MIN_BYTES)
    others_fit = free_known and others_bytes >= OTHER_PROCESSES_MIN_BYTES and F_ok + others_bytes >= T
    outside_fit = (free_known and foreign is not None and foreign > CUDA_CONTEXT_TYPICAL_BYTES
                   and F_ok + foreign - CUDA_CONTEXT_TYPICAL_BYTES >= T)
    xpu_limit = backend == "xpu" and T is not None and T >= XPU_MAX_SINGLE_ALLOCATION_BYTES

    if exceeds_total:
        primary = "shortfall"
    elif m.format == "ipex_4gb" or (xpu_limit and (not free_known or F_ok >= T)):
        primary = "backend_limit"
    elif cap and (not free_known or F_ok >= T):
        primary = "memory_cap"
    elif frag == "fits":
        primary = "fragmentation"
    elif free_covers:
        # Other processes' memory changes while they run; PyTorch reads the free figure after the failure.
        primary = "other_processes" if others_bytes >= OTHER_PROCESSES_MIN_BYTES else "free_exceeds_request"
    elif not free_known:
        primary = "inconsistent_free" if free_bad else "unknown_free"
    elif others_fit:
        primary = "other_processes"
    elif outside_fit:
        primary = "non_pytorch"
    else:
        primary = "shortfall"

    causes: list[Cause] = []
    add = lambda kind, n, key, **kw: causes.append(  # noqa: E731
        Cause(kind, n, t(key, lang, **{**f, **kw}), primary == kind))

    if free_bad:
        add("inconsistent_free", F, "cause.inconsistent_free")
    if m.format == "ipex_4gb":
        add("backend_limit", T, "cause.backend_limit.ipex")
    elif xpu_limit and not exceeds_total:
        add("backend_limit", T, "cause.backend_limit.xpu", limit=fm(XPU_MAX_SINGLE_ALLOCATION_BYTES))
    if cap:
        add("memory_cap", L, "cause.memory_cap", allowed=fm(L),
            sum=fm(R + T) if R is not None and T is not None else fm(None))
    if exceeds_total:
        add("shortfall", T - C, "cause.shortfall.exceeds_total")
    elif free_covers:
        variant = ("explained" if primary in ("memory_cap", "backend_limit")
                   else "others" if primary == "other_processes" else _free_exceeds_variant(m, log_text, R))
        add("free_exceeds_request", F_ok - T, f"cause.free_exceeds.{variant}", margin=fm(F_ok - T))
    elif free_known and frag == "fits":
        add("shortfall", deficit, "cause.shortfall.fragmented", bytes=fm(deficit))
    elif near_full:
        add("shortfall", 0, "cause.shortfall.headroom", margin=fm(F_ok - T), headroom=fm(headroom))
    elif free_known:
        add("shortfall", deficit, "cause.shortfall", bytes=fm(deficit))
    elif not free_bad:
        add("unknown_free", None, "cause.unknown_free")

    frag_kw = {"share_unalloc": _pct(U, R, lang)}
    if frag == "fits":
        add("fragmentation", U, "cause.fragmentation.fits" if free_known else "cause.fragmentation.fits_cache",
            **frag_kw)
    elif frag == "small_pool":
        add("fragmentation", U, "cause.fragmentation.small_pool", **frag_kw)
    elif frag == "contributes":
        add("fragmentation", U, "cause.fragmentation.contributes", **frag_kw)
    elif frag == "headroom":
        add("fragmentation", U, "cause.fragmentation.headroom", **frag_kw)
    elif frag == "moot":
        add("fragmentation", U, "cause.fragmentation.moot", **frag_kw)
    elif frag == "small" and U is not None:
        key = "cause.fragmentation.exceeds_total" if exceeds_total else "cause.fragmentation.small"
        add("fragmentation", U, key, **frag_kw)
    elif U is not None:
        add("fragmentation", U, "cause.fragmentation.unknown", **frag_kw)

    if outside is not None and outside < 0:
        key = "cause.non_pytorch.windows" if backend == "cuda" else "cause.non_pytorch.negative"
        add("non_pytorch", None, key)
    elif outside is not None:
        if own_extra is not None:
            extra = t("cause.non_pytorch.split", lang, own=fm(own_extra), foreign=fm(foreign),
                      process=fm(P), reserved=f["reserved"])
        else:
            extra = ""
        verdict = "cause.non_pytorch.large" if outside_significant else (
            "cause.non_pytorch.own_large" if own_extra is not None and own_extra > CUDA_CONTEXT_TYPICAL_BYTES
            else "cause.non_pytorch.typical")
        add("non_pytorch", outside, "cause.non_pytorch", bytes=fm(outside),
            extra=extra + t(verdict, lang, **f))
    elif not free_bad and C is not None and R is not None:
        add("non_pytorch", None, "cause.non_pytorch.unknown")
    if others:
        listing = ", ".join(f"PID {pid} {fm(b)}" for pid, b in others)
        add("other_processes", others_bytes, "cause.other_processes", bytes=fm(others_bytes), processes=listing)
    if self_pid:
        key = "cause.self_pid.sure" if self_sure else "cause.self_pid"
        add("self_pid", self_pid[1], key, pid=self_pid[0], bytes=fm(self_pid[1]),
            used=fm(C - F_ok if C is not None and F_ok is not None else None),
            sum=fm(self_pid[1] + R), own=fm(self_pid[1] - R))
    causes.sort(key=lambda c: not c.primary)  # stable: primary first, the rest in the order above

    first: list[str] = []
    if primary == "backend_limit":
        first.append("split_allocation.ipex" if m.format == "ipex_4gb" else "split_allocation.xpu")
    if cap and not exceeds_total:
        first.append("raise_cap")
    if frag == "fits":
        first.append("expandable_segments")
    if primary == "free_exceeds_request":
        first.append(f"check_driver.{_free_exceeds_variant(m, log_text, R)}")
    if primary in ("unknown_free", "inconsistent_free"):
        first.append("check_nvidia_smi")
    if outside_significant and not exceeds_total and primary != "free_exceeds_request":
        first.append("stop_other_processes" if others else "check_nvidia_smi")
    if frag == "contributes":
        first.append("expandable_segments")  # helps, but after the shortfall remedies
    return causes, first


def _free_exceeds_variant(m: OomMessage, log_text: str, reserved: int | None) -> str:
    """Which explanation fits free memory above the request: xpu_estimated, xpu, rocm, windows or cuda."""
    if m.backend == "xpu":
        if (m.total_bytes is not None and m.free_bytes is not None and reserved is not None
                and abs(m.total_bytes - reserved - m.free_bytes) <= _print_tol(m.total_bytes, reserved, m.free_bytes)):
            return "xpu_estimated"
        return "xpu"
    if m.backend == "rocm":
        return "rocm"
    if _on_windows(log_text):
        return "windows"
    return "cuda"


def _mps_causes(m: OomMessage, lang: str) -> tuple[list[Cause], list[str]]:
    """MPSAllocator.mm: the watermark trips when Metal's total for the process + the request > max allowed."""
    T, R, O, L = m.tried_to_allocate_bytes, m.reserved_bytes, m.other_allocations_bytes, m.allowed_bytes
    fm = lambda n: _fmt(n, lang)  # noqa: E731
    used = R + O if R is not None and O is not None else None
    f = {"tried": fm(T), "mps": fm(R), "other": fm(O), "allowed": fm(L), "used": fm(used),
         "sum": fm(used + T if used is not None and T is not None else None)}
    watermark = L is not None and used is not None and T is not None and used + T > L - _print_tol(R, O, T, L)
    primary = "mps_watermark" if watermark else "mps_system"
    causes = []
    if watermark:
        causes.append(Cause("mps_watermark", L, t("cause.mps_watermark", lang, **f), True))
    elif L is not None:
        causes.append(Cause("mps_system", None, t("cause.mps_system.below", lang, **f), True))
    else:
        causes.append(Cause("mps_system", None, t("cause.mps_system.no_limit", lang, **f), True))
    if O is not None:
        key = "cause.mps_other.large" if R is not None and O >= R else "cause.mps_other"
        causes.append(Cause("mps_other_allocations", O, t(key, lang, **f)))
    causes.append(Cause("fragmentation", None, t("cause.fragmentation.mps", lang, **f)))
    first = ["mps_empty_cache"] + (["mps_watermark"] if watermark else [])
    return causes, first


# --------------------------------------------------------------------------- advice

_PHASE_ADVICE = {
    "forward": ("shorter_sequences", "micro_batch", "gradient_checkpointing", "lora"),
    "backward": ("gradient_checkpointing", "micro_batch", "shorter_sequences", "lora"),
    "optimizer": ("optimizer_8bit", "lora"),
    "eval": ("eval_batch_size", "eval_accumulation_steps", "preprocess_logits"),
    "save": ("save_only_model",),
    "load_best": ("load_best_fresh",),
    "data_collation": ("collator_cpu", "shorter_sequences", "micro_batch"),
    "model_loading": ("smaller_model_load", "lora"),
    "unknown": ("micro_batch", "shorter_sequences", "gradient_checkpointing", "optimizer_8bit"),
}


#: Advice that only helps while training: Liger's fused linear cross-entropy skips the logits only
#: in training mode with labels (liger-kernel 0.8.5 liger_kernel/transformers/model/llama.py
#: lce_forward: `skip_logits = self.training and (labels is not None or shift_labels is not None)`);
#: evaluation still materialises them.
_TRAINING_ONLY_ADVICE = {"liger_kernel"}


def _operation_advice(op: Operation, phase: str) -> list[str]:
    """The operation's advice, then that of the operations around it (outermost last)."""
    ids = [a for name in (op.name, *op.context) for a in OPERATION_ADVICE.get(name, ())]
    if phase == "eval":
        ids = [a for a in ids if a not in _TRAINING_ONLY_ADVICE]
    return ids


def _rank_advice(first: list[str], phase: str, primary_is_shortfall: bool, op: Operation = Operation()) -> list[str]:
    """Cause-specific remedies first (the message's arithmetic, then the operation's); on a true
    shortfall the phase's remedies come before expandable_segments, which then only trims a
    contributing fragmentation. In the evaluation loop the phase's remedies (eval batch size,
    accumulation, preprocess_logits) come before the operation's."""
    late = ["expandable_segments"] if primary_is_shortfall and "expandable_segments" in first else []
    op_ids = _operation_advice(op, phase)
    phase_ids = list(_PHASE_ADVICE[phase])
    middle = phase_ids + op_ids if phase == "eval" else op_ids + phase_ids
    ids = [a for a in first if a not in late] + middle + late
    return list(dict.fromkeys(ids))


def _without_hf_checkpointing(log_text: str, setup: object) -> bool:
    """The model is one transformers 5 gives no gradient checkpointing (XLNet), by the log or the setup."""
    if re.search(r"modeling_xlnet\.py|does not support (?:gradient|activation) checkpointing", log_text):
        return True
    model = getattr(setup, "model", None)
    if model is None:
        return False
    name = model if isinstance(model, str) else (getattr(model, "model_type", "") or type(model).__name__)
    return "xlnet" in str(name).lower()


# --------------------------------------------------------------------------- entry point


def read_log(path: str | os.PathLike[str]) -> str:
    """The text of a log file in any encoding `memfit.oom_text.decode_log` reads (UTF-8, UTF-16 with BOM, ...)."""
    p = Path(path)
    if not p.exists():
        raise MemfitError(f"log file `{p}` does not exist; pass the path of the training log or traceback")
    if p.is_dir():
        raise MemfitError(f"`{p}` is a directory; pass the log file inside it (e.g. `{p}/train.log`)")
    try:
        return decode_log(p.read_bytes())
    except OSError as err:
        raise MemfitError(f"cannot read log file `{p}` ({err.strerror}); check its permissions") from err


def _source_text(source: object) -> str:
    if isinstance(source, BaseException):
        return "".join(traceback.format_exception(type(source), source, source.__traceback__))
    if isinstance(source, os.PathLike):
        return read_log(source)
    if isinstance(source, bytes):
        return decode_log(source)
    text = str(source)
    if "\n" not in text and 0 < len(text) < 4096:
        try:
            if Path(text).is_file():
                return read_log(text)
        except (OSError, ValueError):  # not a usable path (too long, NUL byte): it is text
            pass
    return text


def diagnose(source: str | os.PathLike[str] | bytes | BaseException, *, lang: str = "en",
             setup: object = None) -> Diagnosis:
    """Diagnose the last out-of-memory error in a log, a traceback, a message or an exception.

    Args:
        source: the text of a log, traceback or message; or the path of a log file (a
            `str` that names an existing file, or a `pathlib.Path`), read in any encoding a
            log comes in (UTF-8, UTF-16 with BOM as Windows PowerShell writes it); or the
            log's bytes; or the exception itself.
        lang: language of the texts, one of `memfit.diagnosis.strings.LANGS`.
        setup: a TrainSetup (the model and arguments of the run that failed): the
            diagnosis is then handed to the planner (memfit.planner.search) for the GPU the message
            describes. Its total capacity picks the GPU (a catalog entry of that size, else a
            generic GPU of that size) and the memory it shows outside PyTorch's cache replaces
            memfit's estimate of it. The result is in `Diagnosis.plan`.
    """
    t("title", lang)  # validates lang
    raw = _source_text(source)
    text = normalize_log(raw)
    ooms = find_ooms(raw)
    if not ooms:
        nccl = nccl_oom_line(text)
        if nccl is None:
            return Diagnosis(False, None, "unknown", (), (), 0, lang=lang)
        offset, line, n = nccl
        ooms = [OomMessage(format="nccl", raw=line, offset=offset, backend="cuda", tried_to_allocate_bytes=n)]
    m = ooms[-1]
    prev_end = ooms[-2].offset + 1 if len(ooms) > 1 else 0
    phase_tb = _traceback_for(text, m, prev_end, len(text))
    phase, frame = detect_phase(phase_tb)
    op = _operation_for(text, m, prev_end, phase_tb)

    tried = _fmt(m.tried_to_allocate_bytes, lang)
    first: list[str] = []
    if m.format == "cpu_allocator":
        causes = [Cause("cpu_ram", m.tried_to_allocate_bytes, t("cause.cpu", lang, tried=tried), True)]
        ids = ["cpu_ram"]
    elif m.format == "mps":
        causes, first = _mps_causes(m, lang)
        ids = _rank_advice(first, phase, False, op)
    elif m.format == "mps_buffer_size":
        causes = [Cause("backend_limit", m.tried_to_allocate_bytes, t("cause.backend_limit.mps", lang, tried=tried),
                        True)]
        ids = _rank_advice(["split_allocation.mps"], phase, False, op)
    elif m.has_numbers:
        causes, first = _allocator_causes(m, lang, raw)
        ids = _rank_advice(first, phase, causes[0].kind == "shortfall", op)
    elif m.format == "nccl":  # NCCL's buffers first, then what else holds the GPU, then the phase's remedies
        causes = [Cause("nccl", m.tried_to_allocate_bytes, t("cause.no_numbers.nccl", lang, tried=tried), True)]
        ids = list(dict.fromkeys(["nccl_buffers", "check_nvidia_smi"] + _rank_advice([], phase, True, op)))
    else:
        kind = "truncated" if m.format in ALLOCATOR_FORMATS + ("truncated",) else m.format
        causes = [Cause(kind, None, t(f"cause.no_numbers.{kind}", lang, tried=tried), True)]
        first = ["cudnn_check"] if m.format == "cudnn_not_supported" else ["check_nvidia_smi"]
        ids = _rank_advice(first, phase, True, op) + (["cuda_launch_blocking"] if m.backend in ("cuda", None) else [])
    if op.name != "unknown" and m.format != "cpu_allocator":
        causes.append(Cause("operation", None, t(f"operation.{op.name}.why", lang)))
        logits = _logits_cause(m, op, setup, lang) if setup is not None else None
        if logits is not None:
            causes.append(logits)
    pids = ", ".join(str(pid) for pid, _ in m.other_processes) or "?"
    no_hf_ckpt = _without_hf_checkpointing(text, setup)
    advice = tuple(_advice_text(a, lang, pids=pids, tool=_TOOLS.get(m.backend, "nvidia-smi"), no_hf_ckpt=no_hf_ckpt)
                   for a in ids)
    planned = _plan_for(setup, m) if setup is not None else None
    return Diagnosis(True, m, phase, tuple(causes), advice, len(ooms), tuple(ids), frame, lang, planned,
                     op.name, op.frame, op.context)


def _operation_for(text: str, m: OomMessage, previous_end: int, phase_traceback: str) -> Operation:
    """The operation of the lines just before `m` (from the last traceback header, if any, up to the
    message's own line), else of the traceback the phase was read from."""
    before = text[previous_end : m.offset]
    before = before[: before.rfind("\n") + 1] if "\n" in before else ""
    head = before.rfind("Traceback (most recent call last)")
    region = before[head:] if head >= 0 else before[-20000:]
    op = detect_operation(region, nccl=m.format == "nccl")
    if op.name == "unknown" and phase_traceback != region:
        op = detect_operation(phase_traceback, nccl=m.format == "nccl")
    return op


def _logits_cause(m: OomMessage, op: Operation, setup: object, lang: str) -> Cause | None:
    """With a setup: the request is exactly the B x S x V logits (float32 or the model's dtype)."""
    if op.name not in ("lm_loss", "lm_head") or not m.tried_to_allocate_bytes:
        return None
    from memfit.models.build import resolve_config

    config = resolve_config(getattr(setup, "model", None)).config
    text_config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    vocab = getattr(text_config, "vocab_size", None)
    batch = getattr(setup, "per_device_train_batch_size", None)
    seq = getattr(setup, "sequence_length", None)
    if not isinstance(vocab, int) or not isinstance(batch, int) or not isinstance(seq, int):
        return None
    # the model's own logits are in its compute dtype (2 bytes under bf16 / fp16 autocast), the loss's upcast
    # in float32; an fp32 run has float32 logits only
    per = (4,) if getattr(setup, "precision", "fp32") == "fp32" else (4, 2)
    shape = logits_shape_for(m.tried_to_allocate_bytes, _print_tol(m.tried_to_allocate_bytes),
                             batch=batch, seq=seq, vocab=vocab, element_bytes=per)
    if shape is None:
        return None
    tokens, vocab, per = shape
    return Cause("logits", m.tried_to_allocate_bytes,
                 t("cause.logits", lang, tried=_fmt(m.tried_to_allocate_bytes, lang), tokens=tokens, vocab=vocab,
                   dtype="float32" if per == 4 else "bf16/fp16", per=per))


def _advice_text(advice_id: str, lang: str, *, pids: str, tool: str, no_hf_ckpt: bool) -> str:
    text = t(f"advice.{advice_id}", lang, pids=pids, tool=tool)
    if advice_id == "gradient_checkpointing" and no_hf_ckpt:
        text += t("advice.gradient_checkpointing.memfit", lang)
    return text


def gpu_from_message(m: OomMessage):
    """The GPU an OOM message describes: the closest catalog entry of that total capacity (within
    0.3 %), with the message's exact capacity; else a generic GPU of that size.

    Several cards share a capacity (L40 / L40S / RTX 6000 Ada, H100 SXM / PCIe): the closest one is
    taken and the others are named in the spec's notes, since their speeds differ.
    """
    import dataclasses

    from memfit.gpus.catalog import CATALOG, resolve_gpu

    if not m.total_bytes:
        raise MemfitError("the message has no total capacity; pass the GPU to `memfit plan --gpu` instead")
    near = sorted((abs(g.total_bytes - m.total_bytes), i, g) for i, g in enumerate(CATALOG.values())
                  if abs(g.total_bytes - m.total_bytes) <= 0.003 * g.total_bytes)
    if not near:
        return resolve_gpu(f"{m.total_bytes}B")
    best = near[0][2]
    notes = best.notes
    if len(near) > 1:
        others = ", ".join(g.name for _, _, g in near[1:])
        notes += (f"the message's {format_bytes(m.total_bytes)} also fits {others}; {best.name} assumed "
                  "(pass --gpu to choose)",)
    return dataclasses.replace(best, total_bytes=m.total_bytes, notes=notes)


def _plan_for(setup, m: OomMessage):
    from memfit.planner.search import plan
    from memfit.train_setup import TrainSetup

    if not isinstance(setup, TrainSetup):
        raise MemfitError(f"`setup` must be a memfit.TrainSetup, not `{type(setup).__name__}`")
    outside = m.non_pytorch_bytes if m.has_numbers else None
    return plan(setup, gpu=gpu_from_message(m), non_pytorch_bytes=outside)
