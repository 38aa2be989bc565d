"""Why an out-of-memory error happened, from the message's own arithmetic.

T request, F free, U reserved-but-unallocated, R reserved, C capacity; a figure the message
does not print is unknown, never 0:

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
  X + R exceeds what is in use (C - F), or when X is R plus a context's worth. A message cut
  off before PyTorch's own figures (no R) whose one listed process holds all that is in use
  allows two readings: it is this process (under a container's PID), or another one while
  this process holds less than a CUDA context; both are said.
* F < T <= U + F decides this allocation; with the unused cache a sliver of the reserved
  memory and unused cache plus free memory a sliver of the card (`FRAGMENTATION_RUN_MAX_SHARE`)
  the card is effectively full, and defragmenting buys the run at most U.

MPS messages are read with MPSAllocator.mm's arithmetic: MPS allocated + other
allocations + T > max allowed is the high-watermark limit; below it Metal itself refused.
NCCL's own out-of-memory reports (``NCCL WARN Cuda failure 'out of memory'``) bypass
PyTorch's allocator, so they carry no allocator figures.

Each reading also names the advice ids the arithmetic puts first (`MessageCauses.first`);
memfit.diagnosis.advice ranks them with the phase's and the operation's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.allocator.caching import K_SMALL_BUFFER
from memfit.diagnosis.operations import Operation, logits_shape_for
from memfit.diagnosis.strings import t
from memfit.oom_text import ALLOCATOR_FORMATS, OomMessage
from memfit.units import GiB, KiB, MiB, format_bytes

__all__ = [
    "Cause",
    "CAUSE_KINDS",
    "MessageCauses",
    "message_causes",
    "operation_causes",
    "MONITOR_TOOLS",
    "FRAGMENTATION_MIN_BYTES",
    "FRAGMENTATION_MIN_SHARE",
    "CUDA_CONTEXT_TYPICAL_BYTES",
    "OTHER_PROCESSES_MIN_BYTES",
    "ONE_PROCESS_SLACK_BYTES",
    "FRAGMENTATION_RUN_MAX_SHARE",
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
#: A listed process within this of all the memory in use (total - free) accounts for all of it: less than the
#: smallest CUDA context (about 300 MiB with the CUDA runtime and cuBLAS loaded, the low end of
#: `CUDA_CONTEXT_TYPICAL_BYTES`), so no second process that has touched CUDA fits beside it.
ONE_PROCESS_SLACK_BYTES = 256 * MiB
#: Unused cache below this share of reserved memory, with unused cache and free memory together below this
#: share of the card, decides one allocation but not the run: the card is effectively full, and defragmenting
#: returns at most that sliver. memfit's threshold: the corpus message it is meant for (tests/data/oom/corpus.json
#: pt16417c, pytorch/pytorch#16417: 0.8% of the cache unused, 0.9% of the card unused or free) lies below it,
#: the corpus' other fragmentation messages (2.1-91% of the cache unused, or 1.2% with 8% of the card free:
#: zimage103) above it.
FRAGMENTATION_RUN_MAX_SHARE = 0.02
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
               "nccl", "logits", "operation", "one_process")



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


#: The tool that shows what holds the memory of each backend's device (named in cause and advice texts).
MONITOR_TOOLS = {"cuda": "nvidia-smi", "rocm": "rocm-smi", "xpu": "xpu-smi", "mps": "Activity Monitor", None: "nvidia-smi"}


def _allocator_causes(m: OomMessage, lang: str, log_text: str) -> tuple[list[Cause], list[str]]:
    """Causes and cause-specific advice ids for a caching-allocator message (CUDA, HIP, XPU)."""
    T, C, F = m.tried_to_allocate_bytes, m.total_bytes, m.free_bytes
    A, R, U = m.allocated_bytes, m.reserved_bytes, m.reserved_unallocated_bytes
    L = m.allowed_bytes
    backend = m.backend or "cuda"
    fm = lambda n: _fmt(n, lang)  # noqa: E731
    f = {"total": fm(C), "free": fm(F), "reserved": fm(R), "allocated": fm(A), "unalloc": fm(U), "tried": fm(T),
         "ctx": fm(CUDA_CONTEXT_TYPICAL_BYTES), "share": _pct(A, C, lang), "tool": MONITOR_TOOLS.get(backend, "nvidia-smi")}

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
    # Cut off before PyTorch's figures: one listed process holding all that is in use is this process or
    # another one beside which this process holds less than a CUDA context; the figures cannot tell.
    one_process: tuple[int, int] | None = None
    if P is None and R is None and len(others) == 1 and C is not None and F_ok is not None:
        in_use = C - F_ok
        if abs(in_use - others[0][1]) <= ONE_PROCESS_SLACK_BYTES + _print_tol(C, F_ok, others[0][1]):
            one_process = others.pop()
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
    elif one_process is not None:
        primary = "one_process"
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
    full = (frag == "fits" and free_known and R is not None and C is not None
            and U < FRAGMENTATION_RUN_MAX_SHARE * R and U + F_ok < FRAGMENTATION_RUN_MAX_SHARE * C)
    if full:
        add("fragmentation", U, "cause.fragmentation.fits_full", **frag_kw)
    elif frag == "fits":
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
    if one_process is not None:
        pid, held = one_process
        rest = max(0, C - F_ok - held)
        key = "cause.one_process.short" if deficit else "cause.one_process.fits"
        add("one_process", held, key, pid=pid, bytes=fm(held), used=fm(C - F_ok), rest=fm(rest),
            deficit=fm(deficit))
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
        first.append("allocator")
    if primary == "free_exceeds_request":
        first.append(f"check_driver.{_free_exceeds_variant(m, log_text, R)}")
    if primary in ("unknown_free", "inconsistent_free", "one_process"):
        first.append("check_nvidia_smi")
    if outside_significant and not exceeds_total and primary != "free_exceeds_request":
        first.append("stop_other_processes" if others else "check_nvidia_smi")
    if frag == "contributes":
        first.append("allocator")  # helps, but after the shortfall remedies
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


@dataclass(frozen=True, slots=True)
class MessageCauses:
    """What a message's arithmetic says: its causes (the primary one first) and the advice ids it puts first."""

    causes: list[Cause]
    first: list[str]  #: cause-specific advice ids, before the operation's and the phase's
    shortfall: bool  #: a true shortfall: the phase's remedies come before a merely contributing fragmentation
    last: tuple[str, ...] = ()  #: advice ids after all others
    gpu_advice: bool = True  #: False: host RAM ran out, so the GPU's phase and operation advice does not apply


def message_causes(m: OomMessage, lang: str, log_text: str) -> MessageCauses:
    """The causes of OOM message `m` (its format's arithmetic) and the advice ids they put first.

    Args:
        m: the parsed message.
        lang: language of the texts.
        log_text: the whole log (Windows paths in it explain free memory above the request).
    """
    tried = _fmt(m.tried_to_allocate_bytes, lang)
    if m.format == "cpu_allocator":
        return MessageCauses([Cause("cpu_ram", m.tried_to_allocate_bytes, t("cause.cpu", lang, tried=tried), True)],
                             ["cpu_ram"], False, gpu_advice=False)
    if m.format == "mps":
        causes, first = _mps_causes(m, lang)
        return MessageCauses(causes, first, False)
    if m.format == "mps_buffer_size":
        return MessageCauses([Cause("backend_limit", m.tried_to_allocate_bytes,
                                    t("cause.backend_limit.mps", lang, tried=tried), True)],
                             ["split_allocation.mps"], False)
    if m.has_numbers:
        causes, first = _allocator_causes(m, lang, log_text)
        # one process holding the card is most likely this one (a shortfall); the phase's remedies come next
        shortfall = causes[0].kind == "shortfall" or (causes[0].kind == "one_process" and any(
            c.kind == "shortfall" and c.bytes for c in causes))
        return MessageCauses(causes, first, shortfall)
    if m.format == "nccl":  # NCCL's buffers first, then what else holds the GPU, then the phase's remedies
        return MessageCauses([Cause("nccl", m.tried_to_allocate_bytes, t("cause.no_numbers.nccl", lang, tried=tried),
                                    True)], ["nccl_buffers", "check_nvidia_smi"], True)
    kind = "truncated" if m.format in ALLOCATOR_FORMATS + ("truncated",) else m.format
    first = ["cudnn_check"] if m.format == "cudnn_not_supported" else ["check_nvidia_smi"]
    return MessageCauses([Cause(kind, None, t(f"cause.no_numbers.{kind}", lang, tried=tried), True)], first, True,
                         last=("cuda_launch_blocking",) if m.backend in ("cuda", None) else ())


def operation_causes(m: OomMessage, op: Operation, setup: object, lang: str) -> list[Cause]:
    """The causes the operation that allocated adds: what it is, and (with a setup) whether the request is
    exactly its B x S x V logits."""
    if op.name == "unknown" or m.format == "cpu_allocator":
        return []
    out = [Cause("operation", None, t(f"operation.{op.name}.why", lang))]
    logits = _logits_cause(m, op, setup, lang) if setup is not None else None
    return out + ([logits] if logits is not None else [])


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

