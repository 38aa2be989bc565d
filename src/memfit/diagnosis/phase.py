"""Where in training an error happened: the one table of traceback frames and phase detection.

Used by diagnose (on a traceback's text) and by memfit.fit's report of a failed run (on the
exception's own frames); both read the same frames the same way. Phase names are memfit.trace's.

The traceback frames are matched against transformers 5's Trainer (trainer.py: ``_run_epoch`` ->
``training_step`` -> ``compute_loss`` / ``accelerator.backward``; ``optimizer.step`` and
``_clip_grad_norm``; ``_maybe_log_save_evaluate`` -> ``_evaluate`` -> ``evaluate`` ->
``evaluation_loop`` -> ``prediction_step``; ``_save_checkpoint`` / ``save_model`` / ``_save``;
``_load_best_model``; at ``train(resume_from_checkpoint=...)`` ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``), DeepSpeed
(deepspeed/runtime/engine.py ``step`` -> ``_take_model_step``, zero/stage_1_and_2.py and stage3.py
``step`` / ``_optimizer_step``; ``backward``, ``allreduce_gradients`` and the ZeRO gradient-reduction
hooks, the ZeRO-3 parameter fetch ``fetch_sub_module(sub_module, forward=True|False)``), torch
(``torch/autograd``, ``torch/optim``, ``torch/utils/data/_utils/collate.py``, ``nn.Module._apply``) and
plain PyTorch loops. The most specific phase wins, in `_PHASE_ORDER` order
(a forward inside evaluation is evaluation; recomputation inside backward is backward; accelerate's
DeepSpeed wrapper calls ``engine.step()`` from inside ``backward``, and that is the optimizer step;
``optimizer.load_state_dict`` inside a resume is the resume).

``_load_from_checkpoint`` is the resume, not model loading: transformers 5.24 calls it only from
``train(resume_from_checkpoint=...)`` (``train`` before accelerate's prepare, ``_prepare_for_training``
after it for FSDP), where it loads the checkpoint's weights into the model that is about to train,
next to the optimizer and scheduler state (``_load_optimizer_and_scheduler``).
"""

from __future__ import annotations

import re
import traceback
from types import TracebackType

from memfit.diagnosis.operations import traceback_frames
from memfit.oom_text import OomMessage, normalize_log
from memfit.trace import (BACKWARD, DATA_COLLATION, EVAL, FORWARD, LOAD_BEST, MODEL_LOADING, OPTIMIZER, RESUME,
                          SAVE, UNKNOWN)

__all__ = ["detect_phase", "phase_of_exception", "traceback_for", "has_frames"]

_FRAME_RE = re.compile(r'^[ \t]*File "(?P<file>[^"]+)", line \d+, in (?P<func>[^\s]+)[ \t]*$', re.M)
# A frame pasted without its start: 'efficient_cross_entropy.py", line 108, in forward' (the file's
# opening `File "` cut off, mgmalek/efficient_cross_entropy#9) or `line 3479, in cross_entropy`.
_PART_FRAME_RE = re.compile(r'^[ \t]*(?:(?P<file>[^\s"]+)", )?line \d+, in (?P<func>[^\s]+)[ \t]*$', re.M)

_SAVE_FUNCS = {"_save_checkpoint", "save_model", "_save", "save_pretrained", "_save_optimizer_and_scheduler",
               "save_state", "_save_rng_state", "save_file"}
_EVAL_FUNCS = {"evaluate", "_evaluate", "evaluation_loop", "prediction_step", "predict", "prediction_loop"}
# transformers 5.24 trainer.py: what `train(resume_from_checkpoint=...)` calls to restore a checkpoint
# (integrations/deepspeed.py `deepspeed_load_checkpoint` for DeepSpeed; inside `_load_best_model` it is load_best,
# which comes first in `_PHASE_ORDER`).
_RESUME_FUNCS = {"_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state",
                 "_load_callback_state", "deepspeed_load_checkpoint"}
_LOAD_FUNCS = {"from_pretrained", "_move_model_to_device", "_load_pretrained_model",
               "_load_state_dict_into_meta_model", "load_state_dict", "dispatch_model",
               "load_checkpoint_and_dispatch", "load_checkpoint_in_model"}
# FSDP's forward hooks (FSDP2 _fsdp_state.py _pre_forward, _fsdp_param_group.py pre_forward) run in the forward.
_FORWARD_FUNCS = {"forward", "_call_impl", "_wrapped_call_impl", "compute_loss", "training_step", "_pre_forward",
                  "pre_forward"}
# Trainer's `_clip_grad_norm`, torch's `clip_grad_norm_`; `optimizer_step` / `_optimizer_step` of training loops
# that wrap the step (accelerate-style and Lightning-style loops).
_OPTIMIZER_FUNCS = {"_clip_grad_norm", "clip_grad_norm_", "optimizer_step", "_optimizer_step"}
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


# DeepSpeed ZeRO-3 (deepspeedai/DeepSpeed runtime/zero/parameter_offload.py): the forward pre-hook
# `_pre_forward_module_hook` -> `pre_sub_module_forward_function` gathers a module's parameters with
# `param_coordinator.fetch_sub_module(sub_module, forward=True)`; the backward one,
# `pre_sub_module_backward_function`, with `forward=False`. The call's own argument names the pass.
_DS_FETCH_RE = re.compile(r"\bfetch_sub_module\([^)]*\bforward\s*=\s*(True|False)\b")
_DS_FORWARD_FUNCS = {"pre_sub_module_forward_function", "_pre_forward_module_hook"}
_DS_BACKWARD_FUNCS = {"pre_sub_module_backward_function"}


def _ds_fetch_pass(file: str, func: str, code: str) -> str | None:
    """"forward" / "backward" for a DeepSpeed ZeRO-3 parameter fetch frame, else None."""
    m = _DS_FETCH_RE.search(code)
    if m:
        return "forward" if m.group(1) == "True" else "backward"
    if _is_deepspeed(file) or "parameter_offload" in file:
        if func in _DS_FORWARD_FUNCS:
            return "forward"
        if func in _DS_BACKWARD_FUNCS:
            return "backward"
    return None


def _is_load_best(file: str, func: str, code: str) -> bool:
    return func == "_load_best_model"


def _is_resume(file: str, func: str, code: str) -> bool:
    return func in _RESUME_FUNCS


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
    return ("torch/optim/" in file or "clip_grad" in file or func in _OPTIMIZER_FUNCS
            or ("optim" in file.lower() and func == "step")
            or (_is_deepspeed(file) and "lr_schedules" not in file and func in _DEEPSPEED_OPTIMIZER_FUNCS)
            or bool(re.search(r"optimizer\.step\(|clip_grad_norm_?\(", code)))


def _is_backward(file: str, func: str, code: str) -> bool:
    return ("torch/autograd/" in file or func in _BACKWARD_FUNCS or func.endswith("__reduce_and_partition_ipg_grads")
            or bool(re.search(r"\.backward\(", code)) or _ds_fetch_pass(file, func, code) == "backward")


def _is_forward(file: str, func: str, code: str) -> bool:
    return (func in _FORWARD_FUNCS or "/modeling_" in file
            or bool(re.search(r"\bmodel\(|\bself\.model\(", code)) or _ds_fetch_pass(file, func, code) == "forward")


#: The one frame table: (phase, rule on (file, func, code)), most specific phase first.
_PHASE_ORDER = (
    (LOAD_BEST, _is_load_best),
    (RESUME, _is_resume),
    (SAVE, _is_save),
    (DATA_COLLATION, _is_collate),
    (EVAL, _is_eval),
    (MODEL_LOADING, _is_model_load),
    (OPTIMIZER, _is_optimizer),
    (BACKWARD, _is_backward),
    (FORWARD, _is_forward),
)

Frame = tuple[str, str, str, str]  #: (file, func, code, frame line), as memfit.diagnosis.operations reads them


def _frames(text: str) -> list[Frame]:
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


def _phase_of_frames(frames: list[Frame]) -> tuple[str, str]:
    """The phase of frames listed outermost first, and the deciding frame line (``unknown``, "")."""
    for phase, test in _PHASE_ORDER:
        for file, func, code, line in reversed(frames):  # innermost first
            if test(file, func, code):
                return phase, (line + (f" | {code}" if code else ""))
    return UNKNOWN, ""


def detect_phase(traceback_text: str) -> tuple[str, str]:
    """The training phase a traceback points at, and the deciding frame line (``unknown``, ""). A
    traceback without plain frames is read as rich's boxed one (memfit.diagnosis.operations)."""
    text = normalize_log(traceback_text)
    return _phase_of_frames(_frames(text) or [f for f in traceback_frames(text) if f[0]])


def phase_of_exception(exc: BaseException) -> str:
    """The phase the frames of `exc`'s own traceback point at (``unknown`` when none says), read with the same
    table as a traceback's text."""
    tb: TracebackType | None = exc.__traceback__
    frames = [(s.filename.replace("\\", "/"), s.name, (s.line or "").strip(),
               f'File "{s.filename}", line {s.lineno}, in {s.name}') for s in traceback.extract_tb(tb)]
    return _phase_of_frames(frames)[0]


def has_frames(text: str) -> bool:
    """Whether `text` holds a traceback frame: a plain one, one pasted without its start, or rich's boxed one."""
    return bool(_FRAME_RE.search(text) or _PART_FRAME_RE.search(text) or "❱" in text)  # ❱: rich's boxed traceback


def traceback_for(text: str, oom: OomMessage, previous_end: int, next_start: int) -> str:
    """The traceback that belongs to `oom`: the one just before it, else the one just after."""
    before = text[previous_end : oom.offset]
    head = before.rfind("Traceback (most recent call last)")
    if head >= 0:
        return before[head:]
    tail = before[-20000:]
    if has_frames(tail):
        return tail
    return text[oom.offset : min(next_start, oom.offset + 20000)]
