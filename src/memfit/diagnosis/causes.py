"""Explain an out-of-memory error: where it happened, why, and what helps.

`diagnose` is pure: text (or an exception) in, a frozen `Diagnosis` out; the CLI prints it.

Where: the traceback frames just before the last OOM message are matched against
transformers 5's Trainer (trainer.py: ``_run_epoch`` -> ``training_step`` ->
``compute_loss`` / ``accelerator.backward``; ``optimizer.step`` and ``_clip_grad_norm``;
``_maybe_log_save_evaluate`` -> ``_evaluate`` -> ``evaluate`` -> ``evaluation_loop`` ->
``prediction_step``; ``_save_checkpoint`` / ``save_model`` / ``_save``;
``_load_best_model``), torch (``torch/autograd``, ``torch/optim``,
``torch/utils/data/_utils/collate.py``, ``nn.Module._apply``) and plain PyTorch loops.
The most specific phase wins, in `_PHASE_ORDER` order (a forward inside evaluation is
evaluation; recomputation inside backward is backward).

Why, with the message's numbers (thresholds are module constants):

* fragmentation = reserved - allocated. Significant when at least
  `FRAGMENTATION_MIN_BYTES` and `FRAGMENTATION_MIN_SHARE` of PyTorch's cache; the main
  cause when also ``unallocated + free >= request`` (it would have fit unfragmented).
* outside PyTorch's cache = total - free - reserved (CUDA context, libraries, other
  processes). Up to `CUDA_CONTEXT_TYPICAL_BYTES` is normal; more, or other processes
  holding at least `OTHER_PROCESSES_MIN_BYTES`, is significant; the main cause when
  freeing it would have made the request fit.
* memory cap: an ``allowed`` figure and ``free >= request`` but ``reserved + request > allowed``.
* otherwise a true shortfall of ``request - free``.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.diagnosis.strings import t
from memfit.oom_text import ALLOCATOR_FORMATS, OomMessage, find_ooms, normalize_log
from memfit.units import GiB, MiB, format_bytes

__all__ = [
    "Cause",
    "Diagnosis",
    "diagnose",
    "detect_phase",
    "PHASES",
    "FRAGMENTATION_MIN_BYTES",
    "FRAGMENTATION_MIN_SHARE",
    "CUDA_CONTEXT_TYPICAL_BYTES",
    "OTHER_PROCESSES_MIN_BYTES",
]

#: Reserved-but-unallocated memory below this is never called fragmentation.
FRAGMENTATION_MIN_BYTES = 256 * MiB
#: ... nor below this share of PyTorch's reserved memory (the seed case: 0.47 of 14.78 GiB = 3%).
FRAGMENTATION_MIN_SHARE = 0.10
#: A CUDA context plus cuBLAS/cuDNN workspaces: typically 0.3-1.5 GiB per process.
CUDA_CONTEXT_TYPICAL_BYTES = int(1.5 * GiB)
#: Other processes holding less than this together are not worth stopping.
OTHER_PROCESSES_MIN_BYTES = 256 * MiB
#: A listed process this close above PyTorch's reserved memory is taken to be this process
#: seen through a container's PID namespace (PyTorch compares NVML's PID with getpid()).
SELF_PID_SLACK_BYTES = 2 * GiB

PHASES = (
    "forward",
    "backward",
    "optimizer",
    "evaluation",
    "checkpoint_save",
    "load_best_model",
    "data_collation",
    "model_loading",
    "unknown",
)


@dataclass(frozen=True, slots=True)
class Cause:
    """One reason, with the bytes it accounts for (None when the message has no figures)."""

    kind: str  #: fragmentation | non_pytorch | other_processes | memory_cap | shortfall | ...
    bytes: int | None
    text: str
    primary: bool = False


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

    @property
    def non_pytorch_bytes(self) -> int | None:
        return self.message.non_pytorch_bytes if self.message else None


# --------------------------------------------------------------------------- phase


_FRAME_RE = re.compile(r'^[ \t]*File "(?P<file>[^"]+)", line \d+, in (?P<func>[^\s]+)[ \t]*$', re.M)

_SAVE_FUNCS = {"_save_checkpoint", "save_model", "_save", "save_pretrained", "_save_optimizer_and_scheduler",
               "save_state", "_save_rng_state", "save_file"}
_EVAL_FUNCS = {"evaluate", "_evaluate", "evaluation_loop", "prediction_step", "predict", "prediction_loop"}
_LOAD_FUNCS = {"from_pretrained", "_load_from_checkpoint", "_move_model_to_device", "_load_pretrained_model",
               "_load_state_dict_into_meta_model", "load_state_dict", "dispatch_model",
               "load_checkpoint_and_dispatch", "load_checkpoint_in_model"}
_FORWARD_FUNCS = {"forward", "_call_impl", "_wrapped_call_impl", "compute_loss", "training_step"}


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


def _is_optimizer(file: str, func: str, code: str) -> bool:
    return ("torch/optim/" in file or "clip_grad" in file or func in {"_clip_grad_norm", "clip_grad_norm_"}
            or ("optim" in file.lower() and func == "step")
            or bool(re.search(r"optimizer\.step\(|clip_grad_norm_?\(", code)))


def _is_backward(file: str, func: str, code: str) -> bool:
    return ("torch/autograd/" in file or func in {"backward", "_engine_run_backward"}
            or bool(re.search(r"\.backward\(", code)))


def _is_forward(file: str, func: str, code: str) -> bool:
    return (func in _FORWARD_FUNCS or "/modeling_" in file
            or bool(re.search(r"\bmodel\(|\bself\.model\(", code)))


_PHASE_ORDER = (
    ("load_best_model", _is_load_best),
    ("checkpoint_save", _is_save),
    ("data_collation", _is_collate),
    ("evaluation", _is_eval),
    ("model_loading", _is_model_load),
    ("optimizer", _is_optimizer),
    ("backward", _is_backward),
    ("forward", _is_forward),
)


def _frames(text: str) -> list[tuple[str, str, str, str]]:
    """(file, func, code, frame line) for each ``File "...", line N, in f`` frame in `text`."""
    out = []
    for m in _FRAME_RE.finditer(text):
        rest = text[m.end() + 1 :]
        nxt = rest.split("\n", 1)[0]
        code = "" if _FRAME_RE.match(nxt) else nxt.strip()
        file = m.group("file").replace("\\", "/")
        out.append((file, m.group("func"), code, " ".join(m.group(0).split())))
    return out


def detect_phase(traceback_text: str) -> tuple[str, str]:
    """The training phase a traceback points at, and the deciding frame line (``unknown``, "")."""
    frames = _frames(traceback_text)
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
    if _FRAME_RE.search(before[-20000:]):
        return before[-20000:]
    return text[oom.offset : min(next_start, oom.offset + 20000)]


# --------------------------------------------------------------------------- numbers


def _fmt(n: int | None) -> str:
    """GiB with two decimals from 0.1 GiB up (as the OOM message reads), else binary units."""
    if n is None:
        return "?"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else format_bytes(n)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "?"


def _allocator_causes(m: OomMessage, lang: str) -> tuple[list[Cause], list[str]]:
    total, free = m.total_bytes or 0, m.free_bytes or 0
    reserved, allocated = m.reserved_bytes or 0, m.allocated_bytes or 0
    unalloc = m.reserved_unallocated_bytes or 0
    tried = m.tried_to_allocate_bytes or 0
    f = {"total": _fmt(total), "free": _fmt(free), "reserved": _fmt(reserved), "allocated": _fmt(allocated),
         "unalloc": _fmt(unalloc), "tried": _fmt(tried), "ctx": _fmt(CUDA_CONTEXT_TYPICAL_BYTES)}

    # Processes: drop NVML "not available" values (> capacity); spot this process behind a PID namespace.
    others = [(pid, b) for pid, b in m.other_processes if b <= total]
    self_pid: tuple[int, int] | None = None
    if not m.process_used_bytes and reserved:
        for pid, b in others:
            if reserved <= b <= reserved + SELF_PID_SLACK_BYTES:
                self_pid = (pid, b)
                others.remove((pid, b))
                break
    others_bytes = sum(b for _, b in others)
    outside = max(0, total - free - reserved)

    frag_significant = unalloc >= FRAGMENTATION_MIN_BYTES and unalloc >= FRAGMENTATION_MIN_SHARE * max(reserved, 1)
    frag_fits = frag_significant and unalloc + free >= tried
    outside_significant = outside > CUDA_CONTEXT_TYPICAL_BYTES or others_bytes >= OTHER_PROCESSES_MIN_BYTES
    outside_fits = outside_significant and free + max(others_bytes, outside - CUDA_CONTEXT_TYPICAL_BYTES) >= tried
    cap = m.allowed_bytes is not None and free >= tried and reserved + tried > m.allowed_bytes
    primary = ("memory_cap" if cap else "fragmentation" if frag_fits
               else ("other_processes" if others_bytes >= OTHER_PROCESSES_MIN_BYTES else "non_pytorch")
               if outside_fits else "shortfall")

    causes: list[Cause] = []
    if cap:
        causes.append(Cause("memory_cap", m.allowed_bytes, t("cause.memory_cap", lang, allowed=_fmt(m.allowed_bytes),
                                                              free=f["free"]), True))
    deficit = max(0, tried - free)
    key = "cause.shortfall" if deficit > 0 else "cause.shortfall.full"
    causes.append(Cause("shortfall", deficit, t(key, lang, bytes=_fmt(deficit), share=_pct(allocated, total), **f),
                        primary == "shortfall"))
    if frag_significant:
        fits = t("cause.fragmentation.fits", lang, **f) if frag_fits else ""
        text = t("cause.fragmentation.significant", lang, share=_pct(unalloc, reserved), fits=fits, **f)
    else:
        text = t("cause.fragmentation.small", lang, **f)
    causes.append(Cause("fragmentation", unalloc, text, primary == "fragmentation"))
    if reserved > total - free and total:
        causes.append(Cause("non_pytorch", 0, t("cause.non_pytorch.windows", lang, **f)))
    else:
        extra = t("cause.non_pytorch.large" if outside_significant else "cause.non_pytorch.typical", lang, **f)
        causes.append(Cause("non_pytorch", outside, t("cause.non_pytorch", lang, bytes=_fmt(outside), extra=extra, **f),
                            primary == "non_pytorch"))
    if others:
        listing = ", ".join(f"PID {pid} {_fmt(b)}" for pid, b in others)
        causes.append(Cause("other_processes", others_bytes,
                            t("cause.other_processes", lang, bytes=_fmt(others_bytes), processes=listing),
                            primary == "other_processes"))
    if self_pid:
        causes.append(Cause("self_pid", self_pid[1], t("cause.self_pid", lang, pid=self_pid[0], bytes=_fmt(self_pid[1]))))
    causes.sort(key=lambda c: not c.primary)  # stable: primary first, the rest in the order above

    first: list[str] = []
    if cap:
        first.append("raise_cap")
    if frag_fits:
        first.append("expandable_segments")
    if outside_significant:
        first.append("stop_other_processes" if others else "check_nvidia_smi")
    if frag_significant and not frag_fits:
        first.append("expandable_segments")  # helps, but after the shortfall remedies
    return causes, first


# --------------------------------------------------------------------------- advice

_PHASE_ADVICE = {
    "forward": ("shorter_sequences", "micro_batch", "gradient_checkpointing", "lora"),
    "backward": ("gradient_checkpointing", "micro_batch", "shorter_sequences", "lora"),
    "optimizer": ("optimizer_8bit", "lora"),
    "evaluation": ("eval_batch_size", "eval_accumulation_steps", "preprocess_logits"),
    "checkpoint_save": ("save_only_model",),
    "load_best_model": ("load_best_fresh",),
    "data_collation": ("collator_cpu", "shorter_sequences", "micro_batch"),
    "model_loading": ("smaller_model_load", "lora"),
    "unknown": ("micro_batch", "shorter_sequences", "gradient_checkpointing", "optimizer_8bit"),
}


def _rank_advice(first: list[str], phase: str, primary_is_shortfall: bool) -> list[str]:
    """Cause-specific remedies first; on a true shortfall the phase's remedies come before
    expandable_segments, which then only trims a contributing fragmentation."""
    late = ["expandable_segments"] if primary_is_shortfall and "expandable_segments" in first else []
    ids = [a for a in first if a not in late] + list(_PHASE_ADVICE[phase]) + late
    return list(dict.fromkeys(ids))


# --------------------------------------------------------------------------- entry point


def diagnose(source: str | BaseException, *, lang: str = "en", setup: object = None) -> Diagnosis:
    """Diagnose the last out-of-memory error in a log, a traceback, a message or an exception.

    With `setup` (a TrainSetup: the model and arguments of the run that failed), the diagnosis
    is handed to the planner (memfit.planner.search) for the GPU the message describes: its total
    capacity picks the GPU (a catalog entry of that size, else a generic GPU of that size) and
    the memory it shows outside PyTorch's cache replaces memfit's estimate of it. The result
    is in `Diagnosis.plan`.
    """
    t("title", lang)  # validates lang
    if isinstance(source, BaseException):
        text = "".join(traceback.format_exception(type(source), source, source.__traceback__))
    else:
        text = str(source)
    text = normalize_log(text)
    ooms = find_ooms(text)
    if not ooms:
        return Diagnosis(False, None, "unknown", (), (), 0, lang=lang)
    m = ooms[-1]
    prev_end = ooms[-2].offset + 1 if len(ooms) > 1 else 0
    phase, frame = detect_phase(_traceback_for(text, m, prev_end, len(text)))

    tried = _fmt(m.tried_to_allocate_bytes)
    first: list[str] = []
    if m.format == "cpu_allocator":
        causes = [Cause("cpu_ram", m.tried_to_allocate_bytes, t("cause.cpu", lang, tried=tried), True)]
        ids = ["cpu_ram"]
    elif m.has_numbers:
        causes, first = _allocator_causes(m, lang)
        ids = _rank_advice(first, phase, causes[0].kind == "shortfall")
    else:
        kind = "truncated" if m.format in ALLOCATOR_FORMATS else m.format  # allocator text cut short
        causes = [Cause(kind, None, t(f"cause.no_numbers.{kind}", lang, tried=tried), True)]
        first = ["cudnn_check"] if m.format == "cudnn_not_supported" else ["check_nvidia_smi"]
        ids = _rank_advice(first, phase, True) + ["cuda_launch_blocking"]
    pids = ", ".join(str(pid) for pid, _ in m.other_processes) or "?"
    advice = tuple(t(f"advice.{a}", lang, pids=pids) for a in ids)
    planned = _plan_for(setup, m) if setup is not None else None
    return Diagnosis(True, m, phase, tuple(causes), advice, len(ooms), tuple(ids), frame, lang, planned)


def gpu_from_message(m: OomMessage):
    """The GPU an OOM message describes: the catalog entry of that total capacity, else a generic one."""
    from memfit.gpus.catalog import CATALOG, resolve_gpu

    if not m.total_bytes:
        raise MemfitError("the message has no total capacity; pass the GPU to `memfit plan --gpu` instead")
    for g in CATALOG.values():
        if abs(g.total_bytes - m.total_bytes) <= 0.003 * g.total_bytes:
            return g
    return resolve_gpu(f"{m.total_bytes}B")


def _plan_for(setup, m: OomMessage):
    from memfit.planner.search import plan
    from memfit.train_setup import TrainSetup

    if not isinstance(setup, TrainSetup):
        raise MemfitError(f"`setup` must be a memfit.TrainSetup, not `{type(setup).__name__}`")
    outside = m.non_pytorch_bytes if m.has_numbers else None
    return plan(setup, gpu=gpu_from_message(m), non_pytorch_bytes=outside)
