"""Which operation an out-of-memory error happened in, read from the innermost traceback frames.

`detect_phase` (memfit.diagnosis.phase) says *when* in training an OOM happened (forward,
backward, optimizer step, ...); `detect_operation` says *what* allocated: the logits over the
vocabulary, the S x S attention matrix, a bitsandbytes dequantization, an FSDP / ZeRO-3
parameter gather, a KV cache during generation, NCCL's own buffers. Each operation has its
own advice (`OPERATION_ADVICE`), ranked before the phase's generic advice.

Frames are read innermost first. A frame of a torch.distributed collective (`collective`) is
generic: it only names the operation when no frame outside it is more specific (FSDP's
unshard or ZeRO-3's fetch call the same collectives). The operations found further out are
kept as context (`Operation.context`): an attention OOM inside ``generate`` is an attention
OOM whose memory grows with the KV cache.

Besides full ``File "...", line N, in f`` frames, a frame cut at its start (``line N, in f``,
as users paste them), rich's boxed tracebacks (the code line marked ``❱``) and, when no frame
is left at all, the code line just before the message are read: a pasted OOM is often just
that.

Sources of the rules, next to each: the function names and code lines are those of the
installed packages (transformers 5.24, trl 1.16, peft 0.21, bitsandbytes 0.50, deepspeed
0.19, torch 2.13) and of the real tracebacks in tests/data/oom/llm_stack.json.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from memfit.oom_text import normalize_log

__all__ = ["Operation", "detect_operation", "traceback_frames", "nccl_oom_line", "OPERATIONS", "OPERATION_ADVICE",
           "NCCL_OOM_RE", "logits_shape_for"]


@dataclass(frozen=True, slots=True)
class Operation:
    """The operation an OOM happened in, the frame (or code line) that decided it, and the
    other operations found further out in the traceback (outermost last)."""

    name: str = "unknown"
    frame: str = ""
    context: tuple[str, ...] = ()


#: Every `Operation.name` detect_operation gives, most specific rules first within a frame.
OPERATIONS = ("lm_loss", "lm_head", "attention_scores", "attention_sdpa", "bnb_dequant", "kbit_prep",
              "dpo_reference", "generation", "fsdp_unshard", "zero3_fetch", "zero_buckets", "collective",
              "nccl", "unknown")

#: Advice ids per operation, most effective first (texts in memfit.diagnosis.strings, ``advice.<id>``). An id
#: that recommends a memory remedy is the remedy's id (memfit.remedies `Remedy.advice`: liger, flash_attention,
#: micro_batch, truncation, gradient_checkpointing); the others are advice no remedy of this version simulates.
OPERATION_ADVICE: dict[str, tuple[str, ...]] = {
    "lm_loss": ("liger", "logits_to_keep", "micro_batch", "truncation"),
    "lm_head": ("liger", "logits_to_keep", "micro_batch", "truncation"),
    "attention_scores": ("flash_attention", "truncation", "micro_batch"),
    "attention_sdpa": ("flash_attention", "truncation", "micro_batch"),
    "bnb_dequant": ("bnb_compute_dtype", "micro_batch", "gradient_checkpointing"),
    "kbit_prep": ("kbit_prep_cast", "smaller_model_load"),
    "dpo_reference": ("precompute_ref_log_probs", "peft_reference"),
    "generation": ("generation_kv_cache",),
    "fsdp_unshard": ("fsdp_reshard", "fsdp_cpu_offload", "more_gpus"),
    "zero3_fetch": ("zero3_live_params", "zero_offload_param", "more_gpus"),
    "zero_buckets": ("zero_bucket_sizes",),
    "collective": ("collective_output",),
    "nccl": ("nccl_buffers",),
    "unknown": (),
}

# ----------------------------------------------------------------------------- frames

_FILE_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')
# A frame cut before its file ("line 3479, in cross_entropy", hiyouga/LlamaFactory#6800) or after
# the file's closing quote ('efficient_cross_entropy.py", line 108, in forward').
_PART_FRAME_RE = re.compile(r'^\s*(?:(?P<file>[^\s"]+)", )?line (?P<line>\d+), in (?P<func>\S+)\s*$')
# rich's boxed traceback (`rich.traceback`, as accelerate and kohya print it): a frame is a box line
# `│ /path/file.py:629 in _attention │`, its path wrapped onto the next box line when long
# (`... zero/partitioned_param_coordin │` / `│ ator.py:338 in fetch_sub_module │`, hiyouga/LlamaFactory#70),
# and the failing line is marked ❱ (`│ ❱  629 │   │   attention_probs = ... │`, bitsandbytes#758).
_RICH_CODE_RE = re.compile(r"❱\s*\d+\s*[│|]\s*(?P<code>.*?)\s*[│|]?\s*$")
_RICH_HEADER_RE = re.compile(r"^(?P<file>\S+?):(?P<line>\d+) in (?P<func>\S+)$")
_NOISE_RE = re.compile(r"^[\s^~▔]*$")


def _box_content(line: str) -> str | None:
    """The text inside one rich box line (`│ ... │`), else None."""
    stripped = line.strip()
    if not stripped.startswith("│"):
        return None
    return stripped.strip("│").strip()


def traceback_frames(traceback_text: str) -> list[tuple[str, str, str, str]]:
    """(file, func, code, frame line) per frame, outermost first, from plain Python tracebacks
    (``File "...", line N, in f`` and frames pasted without their start) and rich's boxed ones;
    code-only frames have file = func = "" and no frame line; when no frame is left at all, the
    last line is taken as the code line (see the module doc). The frame line reads as
    memfit.diagnosis.phase writes the phase's frame."""
    out: list[tuple[str, str, str, str]] = []
    want_code = False
    lines = traceback_text.splitlines()
    skip = -1  # the second half of a wrapped rich header, already read
    for i, raw in enumerate(lines):
        if i == skip:
            continue
        line = raw.rstrip()
        m = _FILE_FRAME_RE.match(line) or _PART_FRAME_RE.match(line)
        if m:
            out.append(((m.group("file") or "").replace("\\", "/"), m.group("func"), "", " ".join(line.split())))
            want_code = True
            continue
        r = _RICH_CODE_RE.search(line)
        if r:
            code = r.group("code").replace("│", "").strip()
            if out and out[-1][3].startswith("rich:") and not out[-1][2]:
                file, func, _, where = out[-1]
                out[-1] = (file, func, code, where)
            else:
                out.append(("", "", code, ""))
            want_code = False
            continue
        box = _box_content(line)
        if box is not None:
            h = _RICH_HEADER_RE.match(box)
            if h is None and box and " " not in box and i + 1 < len(lines):
                nxt = _box_content(lines[i + 1])
                h = _RICH_HEADER_RE.match(box + nxt) if nxt else None
                skip = i + 1 if h is not None else skip
            if h is not None:
                file = h.group("file").replace("\\", "/")
                out.append((file, h.group("func"), "", f'rich: {file}:{h.group("line")} in {h.group("func")}'))
            want_code = False
            continue
        if want_code and line.strip() and not _NOISE_RE.match(line):
            file, func, _, where = out[-1]
            out[-1] = (file, func, line.strip(), where)
            want_code = False
    if not out:  # a bare code line pasted above the message (huggingface/autotrain-advanced#376)
        for raw in reversed(lines):
            line = raw.strip()
            if line and not _NOISE_RE.match(line):
                if not re.match(r"^[\w.]*(?:Error|Exception|Warning)\b", line):
                    out.append(("", "", line, ""))
                break
    return out


# ----------------------------------------------------------------------------- rules
# Each rule: (file, func, code) -> bool. Sources in the comment above each.

Rule = Callable[[str, str, str], bool]

# transformers/loss/loss_utils.py: ForCausalLMLoss upcasts (`logits = logits.float()`) and calls
# fixed_cross_entropy -> nn.functional.cross_entropy; the models call `self.loss_function(`.
# torch/nn/functional.py cross_entropy -> torch._C._nn.cross_entropy_loss; log_softmax / nll_loss.
# trl/trainer/utils.py selective_log_softmax, entropy_from_logits, selective_log_softmax_and_entropy;
# trl/trainer/grpo_trainer.py _get_per_token_logps_and_entropies; TRL 0.x DPOTrainer.get_batch_logps
# `per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, ...)` (reused by ms-swift:
# modelscope/ms-swift#2044) and concatenated_forward `...logits.to(torch.float32)` (the chosen and
# rejected halves in one batch of 2 B).
_LOSS_FUNCS = {"cross_entropy", "nll_loss", "log_softmax", "cross_entropy_loss", "selective_log_softmax",
               "entropy_from_logits", "selective_log_softmax_and_entropy", "_get_per_token_logps",
               "_get_per_token_logps_and_entropies", "get_batch_logps", "fixed_cross_entropy", "ForCausalLMLoss"}
_LOSS_CODE_RE = re.compile(r"\blogits\s*\.\s*float\(\)|\blogits\s*\.\s*to\(\s*torch\.float32|\bcross_entropy(?:_loss)?\("
                           r"|\blogits\s*\.\s*log_softmax\("
                           r"|log_softmax\(\s*logits|\bself\.loss_function\(|\bselective_log_softmax\("
                           r"|\bentropy_from_logits\(")


def _is_lm_loss(file: str, func: str, code: str) -> bool:
    if "loss/loss_utils.py" in file:
        return True
    if func in _LOSS_FUNCS and (not file or "torch/nn/functional.py" in file or "/trl/" in file
                                or "loss_utils" in file):
        return True
    return bool(_LOSS_CODE_RE.search(code))


# modeling_*.py: `logits = self.lm_head(hidden_states[:, slice_indices, :])`; BART-like models
# `lm_logits = self.lm_head(outputs[0]) + self.final_logits_bias` (huggingface/autotrain-advanced#376).
def _is_lm_head(file: str, func: str, code: str) -> bool:
    return bool(re.search(r"\blm_head\(", code))


# transformers/models/*/modeling_*.py eager_attention_forward: `attn_weights = torch.matmul(query,
# key_states.transpose(2, 3)) * scaling` and `nn.functional.softmax(attn_weights, dim=-1,
# dtype=torch.float32)` (hiyouga/LlamaFactory#3398); diffusers-style `attention_scores.softmax(`
# (bitsandbytes-foundation/bitsandbytes#758).
_ATTN_CODE_RE = re.compile(r"torch\.matmul\(\s*query\w*\s*,\s*key\w*\.transpose|softmax\(\s*attn_weights"
                           r"|attn_weights\s*\.\s*softmax\(|attention_scores\s*\.\s*softmax\(|softmax\(\s*attention_scores"
                           r"|\bquery\w*\s*@\s*key\w*\.transpose")


def _is_attention_scores(file: str, func: str, code: str) -> bool:
    return func == "eager_attention_forward" or bool(_ATTN_CODE_RE.search(code))


# transformers/integrations/sdpa_attention.py sdpa_attention_forward ->
# torch.nn.functional.scaled_dot_product_attention.
def _is_attention_sdpa(file: str, func: str, code: str) -> bool:
    return func == "sdpa_attention_forward" or "scaled_dot_product_attention(" in code


# bitsandbytes 0.50: nn/modules.py Linear4bit.forward -> bnb.matmul_4bit; autograd/_functions.py MatMul4Bit
# (backward: `F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)`; matmul_4bit: `B_dq =
# F.dequantize_4bit(B, quant_state).to(A.dtype)`), MatMul8bitLt; functional.py dequantize_4bit /
# dequantize_blockwise; backends/cuda/ops.py _dequant_linear_fallback (`B_dq = torch.empty(shapeB, ...)`).
_BNB_FUNCS = {"dequantize_4bit", "dequantize_blockwise", "dequantize_nf4", "dequantize_fp4", "matmul_4bit",
              "int8_vectorwise_dequant", "int8_mm_dequant", "mm_dequant", "matmul", "_dequant_linear_fallback",
              "_dequantize_4bit_impl", "gemm_4bit"}


def _is_bnb_dequant(file: str, func: str, code: str) -> bool:
    if "bitsandbytes/" in file and (func in _BNB_FUNCS or "autograd/_functions.py" in file):
        return True
    return bool(re.search(r"\bdequantize_4bit\(|\bmatmul_4bit\(|\bMatMul4Bit\b|\bMatMul8bitLt\b|\bbnb\.matmul\(", code))


# peft/utils/other.py prepare_model_for_kbit_training: `param.data = param.data.to(torch.float32)`
# for every fp16/bf16 parameter that is not Params4bit.
def _is_kbit_prep(file: str, func: str, code: str) -> bool:
    return func == "prepare_model_for_kbit_training" or "prepare_model_for_kbit_training(" in code


# trl 1.16 trl/trainer/dpo_trainer.py: the per-batch reference forward in _compute_loss
# (`ref_outputs = self.ref_model(**ref_model_kwargs, ...)`, or with peft `ref_outputs = self.model(...)` under
# use_adapter(..., adapter_name=None)); compute_ref_log_probs / _precompute_ref_logps when precomputing;
# older TRL null_ref_context / concatenated_forward(self.ref_model, ...).
def _is_dpo_reference(file: str, func: str, code: str) -> bool:
    return (func in {"compute_ref_log_probs", "null_ref_context", "_precompute_ref_logps", "_compute_ref_log_probs"}
            or bool(re.search(r"\bref_model\(|concatenated_forward\(\s*self\.ref_model|\bref_outputs\s*=\s*self\.", code)))


# transformers/generation/utils.py generate -> _sample / _beam_search (older: beam_sample, sample,
# greedy_search: oobabooga/textgen#4557); cache_utils.py DynamicLayer.update (`torch.cat`);
# trl grpo_trainer.py _generate / _generate_single_turn / _generate_and_score_completions;
# Seq2SeqTrainer.prediction_step (`self.model.generate(`).
_GEN_FUNCS = {"generate", "_sample", "_beam_search", "beam_sample", "beam_search", "greedy_search", "sample",
              "_assisted_decoding", "_contrastive_search", "_generate", "_generate_single_turn",
              "_generate_and_score_completions"}


def _is_generation(file: str, func: str, code: str) -> bool:
    if func in _GEN_FUNCS and ("/generation/" in file or "/trl/" in file or func.startswith("_generate")):
        return True
    if "cache_utils.py" in file and func in {"update", "lazy_initialization"}:
        return True
    return bool(re.search(r"\.generate\(", code))


# FSDP2 torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py unshard / wait_for_unshard,
# _fsdp_collectives.py foreach_all_gather / foreach_all_gather_copy_out (torch <= 2.5:
# torch/distributed/_composable/fsdp/, meta-pytorch/torchtune#2071); FSDP1 _runtime_utils.py _unshard,
# _flat_param.py unshard / _alloc_padded_unsharded_flat_param (huggingface/trl#3436).
_FSDP_FUNCS = {"unshard", "_unshard", "wait_for_unshard", "foreach_all_gather", "foreach_all_gather_copy_out",
               "_alloc_padded_unsharded_flat_param", "_all_gather_flat_param", "alloc_all_gather_outputs",
               "init_unsharded_param", "_pre_forward_unshard", "_prefetch_handle", "pre_forward"}


def _is_fsdp_unshard(file: str, func: str, code: str) -> bool:
    in_fsdp = "torch/distributed/fsdp/" in file or "torch/distributed/_composable/fsdp/" in file
    return in_fsdp and (func in _FSDP_FUNCS or "_fsdp_collectives.py" in file)


# deepspeed/runtime/zero/partitioned_param_coordinator.py fetch_sub_module -> __all_gather_params
# (name-mangled _PartitionedParameterCoordinator__all_gather_params); partition_parameters.py
# _all_gather, all_gather_coalesced, _allgather_params*; parameter_offload.py
# pre_sub_module_forward_function / pre_sub_module_backward_function (dhcode-cpp/X-R1#14).
def _is_zero3_fetch(file: str, func: str, code: str) -> bool:
    if "partitioned_param_coordinator.py" in file:
        return True
    if "deepspeed/runtime/zero/partition_parameters.py" in file and ("all_gather" in func or "allgather" in func):
        return True
    return (func in {"fetch_sub_module", "pre_sub_module_forward_function", "pre_sub_module_backward_function"}
            or "fetch_sub_module(" in code)


# deepspeed/runtime/zero/stage_1_and_2.py: the IPG bucket (`torch.empty(int(self.reduce_bucket_size)`),
# reduce_ipg_grads, average_tensor, allreduce_bucket, allreduce_and_copy, gradient_reduction_w_predivide;
# stage3.py __reduce_and_partition_ipg_grads, partition_grads.
_ZERO_BUCKET_FUNCS = {"reduce_ipg_grads", "average_tensor", "allreduce_bucket", "allreduce_and_copy",
                      "allreduce_and_copy_with_multiple_ranks", "gradient_reduction_w_predivide",
                      "buffered_reduce_fallback", "all_gather_dp_groups", "partition_grads"}


def _is_zero_buckets(file: str, func: str, code: str) -> bool:
    in_zero = "deepspeed/runtime/zero/stage_1_and_2.py" in file or "deepspeed/runtime/zero/stage3.py" in file
    return in_zero and (func in _ZERO_BUCKET_FUNCS or func.endswith("__reduce_and_partition_ipg_grads"))


# torch/distributed/distributed_c10d.py all_gather / all_reduce / ... (deepspeedai/DeepSpeed#1624).
def _is_collective(file: str, func: str, code: str) -> bool:
    return "torch/distributed/distributed_c10d.py" in file or "torch/distributed/c10d_logger.py" in file


_SPECIFIC: tuple[tuple[str, Rule], ...] = (
    ("lm_loss", _is_lm_loss),
    ("lm_head", _is_lm_head),
    ("attention_scores", _is_attention_scores),
    ("attention_sdpa", _is_attention_sdpa),
    ("bnb_dequant", _is_bnb_dequant),
    ("kbit_prep", _is_kbit_prep),
    ("dpo_reference", _is_dpo_reference),
    ("generation", _is_generation),
    ("fsdp_unshard", _is_fsdp_unshard),
    ("zero3_fetch", _is_zero3_fetch),
    ("zero_buckets", _is_zero_buckets),
)
_GENERIC: tuple[tuple[str, Rule], ...] = (("collective", _is_collective),)
# Functions that name the operation only as the innermost frame: an OOM on a line of TRL 0.x
# DPOTrainer.concatenated_forward itself is on its logits (the model's forward has returned), but
# the frame around an attention or LM-head OOM says nothing about them.
_INNERMOST_ONLY: tuple[tuple[str, Rule], ...] = (("lm_loss", lambda file, func, code: func == "concatenated_forward"),)

# NCCL's own allocation failures (they bypass PyTorch's allocator): `include/alloc.h:178 NCCL WARN
# Cuda failure 'out of memory'` (NVIDIA/nccl#1235), `enqueue.cc:1085 NCCL WARN Cuda failure 'out of
# memory'` (PKU-YuanGroup/Open-Sora-Plan#386), NCCL 1.x `init.cu:218 WARN Cuda failure 'out of
# memory'` (pytorch/pytorch#4921), and torch's `ncclUnhandledCudaError: Call to CUDA function
# failed. Last error: Cuda failure 'out of memory'` (torch/csrc/distributed/c10d/NCCLUtils).
NCCL_OOM_RE = re.compile(r"(?:NCCL )?WARN Cuda failure (?:2 )?'out of memory'"
                         r"|ncclUnhandledCudaError[^\n]*\n(?:[^\n]*\n){0,3}?[^\n]*Cuda failure (?:2 )?'out of memory'")
#: `include/alloc.h:185 NCCL WARN Failed to CUDA calloc 6291456 bytes` (NVIDIA/nccl#1235): the request.
NCCL_ALLOC_RE = re.compile(r"NCCL WARN Failed to CUDA (?:calloc|malloc|alloc) (\d+) bytes")


def nccl_oom_line(text: str) -> tuple[int, str, int | None] | None:
    """(offset, the matching text, bytes NCCL failed to allocate or None) of the last NCCL
    out-of-memory report in `text`, else None."""
    last = None
    for m in NCCL_OOM_RE.finditer(text):
        last = m
    if last is None:
        return None
    sizes = [int(a.group(1)) for a in NCCL_ALLOC_RE.finditer(text)]
    return last.start(), " ".join(last.group(0).split()), (sizes[-1] if sizes else None)


def _describe(where: str, code: str) -> str:
    return " | ".join(p for p in (where, code) if p)


def detect_operation(traceback_text: str, *, nccl: bool = False) -> Operation:
    """The operation the innermost frames of `traceback_text` point at (see the module doc).

    Args:
        traceback_text: the traceback (or the lines) just before the OOM message.
        nccl: the OOM message itself is NCCL's: the operation is ``nccl`` whatever the frames say.
    """
    frames = traceback_frames(normalize_log(traceback_text))  # rank prefixes, ANSI codes and CRLF go
    found: list[tuple[str, str]] = []  # (operation, frame), innermost first, one per operation
    if frames:
        file, func, code, where = frames[-1]
        found += [(name, _describe(where, code)) for name, rule in _INNERMOST_ONLY if rule(file, func, code)][:1]
    for file, func, code, where in reversed(frames):
        for name, rule in _SPECIFIC:
            if rule(file, func, code):
                if all(name != n for n, _ in found):
                    found.append((name, _describe(where, code)))
                break
    if nccl:
        return Operation("nccl", found[0][1] if found else "", tuple(n for n, _ in found))
    if found:
        return Operation(found[0][0], found[0][1], tuple(n for n, _ in found[1:]))
    for file, func, code, where in reversed(frames):
        for name, rule in _GENERIC:
            if rule(file, func, code):
                return Operation(name, _describe(where, code))
    return Operation()


# ----------------------------------------------------------------------------- logits size


def logits_shape_for(tried_bytes: int, tolerance_bytes: int, *, batch: int, seq: int, vocab: int,
                     element_bytes: tuple[int, ...] = (4, 2)) -> tuple[int, int, int] | None:
    """(tokens, vocabulary, bytes per element) when `tried_bytes` is one B x S x V logits tensor.

    transformers' ForCausalLMLoss upcasts the logits to float32 (4 bytes; loss_utils.py
    `logits = logits.float()`) after the model produced them in its dtype (2 bytes in bf16 /
    fp16); the shifted labels drop one position per sequence (S - 1). A request within
    `tolerance_bytes` of tokens x V x bytes for tokens in (B S, B (S - 1)) is that tensor.

    Args:
        tried_bytes: the message's "Tried to allocate".
        tolerance_bytes: how far the printed figure can be from the true one.
        batch: per-device batch size B.
        seq: sequence length S.
        vocab: vocabulary size V (the model config's vocab_size).
        element_bytes: the element sizes the logits can have in this run (float32 only in fp32 runs).
    """
    for per in element_bytes:
        for tokens in (batch * seq, batch * (seq - 1)):
            if tokens > 0 and abs(tokens * vocab * per - tried_bytes) <= tolerance_bytes:
                return tokens, vocab, per
    return None
