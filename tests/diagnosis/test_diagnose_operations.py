"""The operation an OOM happened in (memfit.diagnosis.operations) and its advice, on real
tracebacks of the LLM fine-tuning stack (tests/data/oom/llm_stack.json) and on frames taken
from the installed packages' own code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import DATA_DIR
from memfit.cli import main
from memfit.diagnosis import CAUSE_KINDS, detect_phase, diagnose
from memfit.diagnosis.operations import (OPERATION_ADVICE, OPERATIONS, detect_operation,
                                         logits_shape_for, traceback_frames)
from memfit.diagnosis.strings import MESSAGES
from memfit.units import GiB, MiB

DATA = DATA_DIR / "oom"
STACK = json.loads((DATA / "llm_stack.json").read_text(encoding="utf-8"))["entries"]
BY_ID = {e["id"]: e for e in STACK}
WITH_MESSAGE = [e["id"] for e in STACK if e["has_message"]]
FRAMES_ONLY = [e["id"] for e in STACK if not e["has_message"]]

MSG = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of 79.19 GiB "
       "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. Of the "
       "allocated memory 75.40 GiB is allocated by PyTorch, and 2.10 GiB is reserved by PyTorch but unallocated.")
SP = "/opt/venv/lib/python3.12/site-packages"


def tb(*frames: tuple[str, str, str], tried: str = "4.00 GiB") -> str:
    lines = ["Traceback (most recent call last):"]
    for file, func, code in frames:
        lines += [f'  File "{file}", line 1, in {func}', f"    {code}"]
    return "\n".join(lines + [MSG.format(tried=tried), ""])


TRAIN = [(f"{SP}/transformers/trainer.py", "training_step", "loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)"),
         (f"{SP}/transformers/trainer.py", "compute_loss", "outputs = model(**inputs)")]


# ------------------------------------------------------------------ the real corpus


def test_corpus_is_real_and_sized():
    assert len(STACK) >= 15 and len(WITH_MESSAGE) >= 12
    assert all(e["source"].startswith("https://github.com/") for e in STACK)
    assert {e["operation"] for e in STACK} >= {"lm_loss", "lm_head", "attention_scores", "nccl", "fsdp_unshard",
                                                "zero3_fetch", "generation", "collective", "unknown"}


@pytest.mark.parametrize("cid", WITH_MESSAGE)
def test_corpus_phase_and_operation(cid):
    e = BY_ID[cid]
    d = diagnose(e["text"])
    assert d.is_oom, cid
    assert (d.phase, d.operation) == (e["phase"], e["operation"])
    if d.operation != "unknown":
        op_advice = OPERATION_ADVICE[d.operation]
        assert op_advice[0] in d.advice_ids
        assert any(c.kind == "operation" for c in d.causes)
    zh = diagnose(e["text"], lang="zh")
    assert zh.advice_ids == d.advice_ids and zh.operation == d.operation and len(zh.causes) == len(d.causes)


@pytest.mark.parametrize("cid", FRAMES_ONLY)
def test_corpus_frames_without_message(cid):
    e = BY_ID[cid]
    assert detect_operation(e["text"]).name == e["operation"]
    assert detect_phase(e["text"])[0] == e["phase"]


def test_lm_loss_advice_comes_before_the_phase_advice():
    d = diagnose(BY_ID["ms_swift_2044"]["text"])
    assert d.advice_ids[:2] == ("liger", "logits_to_keep")
    assert "use_liger_kernel=True" in d.advice[0] and "pip install liger-kernel" in d.advice[0]


def test_fragmentation_advice_still_leads_when_it_decides():
    # 5.51 GiB unallocated + 1.41 GiB free > the 4.64 GiB request: expandable_segments is the fix
    d = diagnose(BY_ID["llamafactory_6800"]["text"])
    assert d.causes[0].kind == "fragmentation" and d.advice_ids[:2] == ("allocator", "liger")


def test_nccl_oom_is_found_and_sized():
    d = diagnose(BY_ID["nccl_1235"]["text"])
    assert d.message.format == "nccl" and d.message.tried_to_allocate_bytes == 6291456
    assert d.causes[0].kind == "nccl" and d.causes[0].primary and d.advice_ids[0] == "nccl_buffers"
    assert "cuda_launch_blocking" not in d.advice_ids
    assert "NCCL_BUFFSIZE" in d.advice[0]
    assert diagnose("NCCL INFO all fine\nNCCL WARN Cuda failure 'invalid argument'\n").is_oom is False


def test_torch_nccl_error_with_out_of_memory():
    # torch.distributed's wording of NCCL's failure (c10d NCCLUtils: ncclUnhandledCudaError ... Last error:)
    text = ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, "
            "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.26.2\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'\n")
    d = diagnose(text)
    assert d.is_oom and d.operation == "nccl" and d.message.tried_to_allocate_bytes is None


# ------------------------------------------------------------------ frames from the packages' own code


PACKAGE_FRAMES = [
    (TRAIN + [(f"{SP}/transformers/models/llama/modeling_llama.py", "forward",
               "loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)"),
              (f"{SP}/transformers/loss/loss_utils.py", "ForCausalLMLoss", "logits = logits.float()")], "lm_loss"),
    (TRAIN + [(f"{SP}/transformers/loss/loss_utils.py", "fixed_cross_entropy",
               "loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction=reduction)"),
              (f"{SP}/torch/nn/functional.py", "cross_entropy", "return torch._C._nn.cross_entropy_loss(")], "lm_loss"),
    (TRAIN + [(f"{SP}/trl/trainer/utils.py", "selective_log_softmax",
               "logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])")], "lm_loss"),
    (TRAIN + [(f"{SP}/trl/trainer/utils.py", "entropy_from_logits", "logps = F.log_softmax(chunk, dim=-1)")],
     "lm_loss"),
    (TRAIN + [(f"{SP}/transformers/models/llama/modeling_llama.py", "forward", "logits = self.lm_head(hidden_states)")],
     "lm_head"),
    (TRAIN + [(f"{SP}/transformers/models/llama/modeling_llama.py", "eager_attention_forward",
               "attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling")], "attention_scores"),
    (TRAIN + [(f"{SP}/transformers/integrations/sdpa_attention.py", "sdpa_attention_forward",
               "attn_output = torch.nn.functional.scaled_dot_product_attention(")], "attention_sdpa"),
    (TRAIN + [(f"{SP}/bitsandbytes/nn/modules.py", "forward",
               "return bnb.matmul_4bit(x, self.weight, bias=bias, quant_state=quant_state).to(inp_dtype)"),
              (f"{SP}/bitsandbytes/autograd/_functions.py", "matmul_4bit",
               "B_dq = F.dequantize_4bit(B, quant_state).to(A.dtype)"),
              (f"{SP}/bitsandbytes/functional.py", "dequantize_4bit",
               "out = torch.ops.bitsandbytes.dequantize_4bit.default(")], "bnb_dequant"),
    ([(f"{SP}/torch/autograd/function.py", "apply", "return user_fn(self, *args)"),
      (f"{SP}/bitsandbytes/autograd/_functions.py", "backward",
       "grad_A = torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype))")], "bnb_dequant"),
    ([("train.py", "<module>", "model = prepare_model_for_kbit_training(model)"),
      (f"{SP}/peft/utils/other.py", "prepare_model_for_kbit_training", "param.data = param.data.to(torch.float32)")],
     "kbit_prep"),
    (TRAIN + [(f"{SP}/trl/trainer/dpo_trainer.py", "_compute_loss",
               "ref_outputs = self.ref_model(**ref_model_kwargs, labels=labels, fused_lm_head=True)")], "dpo_reference"),
    (TRAIN + [(f"{SP}/trl/trainer/dpo_trainer.py", "_compute_loss",
               "ref_outputs = self.model(**ref_model_kwargs, labels=labels, fused_lm_head=True)")], "dpo_reference"),
    (TRAIN + [(f"{SP}/transformers/generation/utils.py", "generate", "result = decoding_method("),
              (f"{SP}/transformers/generation/utils.py", "_sample", "outputs = self(**model_inputs, return_dict=True)"),
              (f"{SP}/transformers/cache_utils.py", "update",
               "self.keys = torch.cat([self.keys, key_states], dim=-2)")], "generation"),
    ([(f"{SP}/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "unshard",
       "self._all_gather_result = foreach_all_gather("),
      (f"{SP}/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather",
       "flat_foreach_copy_input = torch.empty("),
      (f"{SP}/torch/distributed/distributed_c10d.py", "all_gather_into_tensor",
       "work = group.all_gather_single(output_tensor, input_tensor, opts)")], "fsdp_unshard"),
    ([(f"{SP}/deepspeed/runtime/zero/partitioned_param_coordinator.py", "fetch_sub_module",
       "self.__all_gather_params(params_to_fetch, forward)"),
      (f"{SP}/deepspeed/runtime/zero/partition_parameters.py", "all_gather_coalesced",
       "flat_tensor = torch.empty(partition_sz * world_size,")], "zero3_fetch"),
    ([(f"{SP}/deepspeed/runtime/zero/stage_1_and_2.py", "reduce_ipg_grads",
       "self.average_tensor(bucket.buffer[bucket.index].narrow(0, 0, bucket.elements), comm_dtype)")],
     "zero_buckets"),
]


@pytest.mark.parametrize("frames, operation", PACKAGE_FRAMES)
def test_operation_from_package_frames(frames, operation):
    op = detect_operation(tb(*frames))
    assert op.name == operation
    d = diagnose(tb(*frames))
    assert d.operation == operation and d.operation_frame == op.frame
    assert d.advice_ids[0] == OPERATION_ADVICE[operation][0]


def _installed_source(rel: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(rel.split("/", 1)[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).parent / rel
    return path.read_text(encoding="utf-8") if path.is_file() else None


def test_package_frames_quote_the_installed_code():
    """Each code line the rules are tested on is in the installed package (an upgrade that moves
    the allocation fails here); the function it is attributed to is defined in that file."""
    for frames, _ in PACKAGE_FRAMES:
        for file, func, code in frames:
            if not file.startswith(SP):
                continue
            source = _installed_source(file[len(SP) + 1 :])
            if source is None:  # the package is an optional extra not installed here
                continue
            assert code in source, (file, code)
            assert f"def {func}(" in source or func == "<module>", (file, func)


def test_innermost_wins_and_outer_operations_are_context():
    # GRPO generating: eager attention inside _sample inside the trainer's generation step
    frames = TRAIN + [(f"{SP}/trl/trainer/grpo_trainer.py", "_generate_single_turn", "unwrapped_model.generate("),
                      (f"{SP}/transformers/generation/utils.py", "_sample",
                       "outputs = self(**model_inputs, return_dict=True)"),
                      (f"{SP}/transformers/models/llama/modeling_llama.py", "eager_attention_forward",
                       "attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling")]
    d = diagnose(tb(*frames))
    assert d.operation == "attention_scores" and d.operation_context == ("generation",)
    assert d.advice_ids.index("flash_attention") < d.advice_ids.index("generation_kv_cache")


def test_trl_0x_dpo_concatenated_forward_names_the_logits_only_as_innermost_frame():
    # TRL 0.x DPOTrainer.concatenated_forward (code search: `all_logits = model(...).logits.to(torch.float32)`);
    # not in the installed TRL 1.16, so not in PACKAGE_FRAMES
    dpo = (f"{SP}/trl/trainer/dpo_trainer.py", "concatenated_forward",
           "all_logits = model(batch['concatenated_input_ids'], attention_mask=batch['concatenated_attention_mask'])"
           ".logits.to(torch.float32)")
    assert detect_operation(tb(*TRAIN, dpo)).name == "lm_loss"
    bare = (f"{SP}/trl/trainer/dpo_trainer.py", "concatenated_forward", "len_chosen = batch['chosen_labels'].shape[0]")
    assert detect_operation(tb(*TRAIN, bare)).name == "lm_loss"
    attention = (f"{SP}/transformers/models/llama/modeling_llama.py", "eager_attention_forward",
                 "attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling")
    op = detect_operation(tb(*TRAIN, bare, attention))
    assert op.name == "attention_scores" and op.context == ()


# hiyouga/LlamaFactory#70 (Llama-65B with DeepSpeed ZeRO-3): a rich traceback whose frame path wraps onto a
# second box line; copied as the thread has it, cut where the thread's excerpt ends
RICH_ZERO3 = """\
│    24 │   │   @functools.wraps(func)                                                             │
│    25 │   │   def decorate_context(*args, **kwargs):                                             │
│    26 │   │   │   with self.clone():                                                             │
│ ❱  27 │   │   │   │   return func(*args, **kwargs)                                               │
│    28 │   │   return cast(F, decorate_context)                                                   │
│    29 │                                                                                          │
│    30 │   def _wrap_generator(self, func):                                                       │
│                                                                                                  │
│ /home/jovyan/.local/lib/python3.7/site-packages/deepspeed/runtime/zero/partitioned_param_coordin │
│ ator.py:338 in fetch_sub_module                                                                  │
│                                                                                                  │
│   335 │   │   │   │   if logger.isEnabledFor(logging.DEBUG):                                     │
│   336 │   │   │   │   │   for param in params_to_prefetch:                                       │
"""


def test_rich_traceback_with_a_wrapped_path():
    op = detect_operation(RICH_ZERO3)
    assert op.name == "zero3_fetch" and "partitioned_param_coordinator.py:338 in fetch_sub_module" in op.frame
    frames = [f for f in traceback_frames(RICH_ZERO3) if f[0]]
    assert [f[1] for f in frames] == ["fetch_sub_module"]  # the wrapped second half is not a frame of its own
    # the rich frame of a training step decides the phase as a plain one does
    rich_step = ("│ /opt/venv/lib/python3.11/site-packages/torch/optim/adamw.py:420 in _multi_tensor_adamw │\n"
                 "│ ❱ 420 │   exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs) │\n")
    assert detect_phase(rich_step)[0] == "optimizer"
    d = diagnose(rich_step + MSG.format(tried="1.00 GiB"))
    assert d.phase == "optimizer" and d.operation == "unknown"


def test_collective_only_when_nothing_outside_is_specific():
    inner = (f"{SP}/torch/distributed/distributed_c10d.py", "all_gather_into_tensor",
             "work = group.all_gather_single(output_tensor, input_tensor, opts)")
    assert detect_operation(tb(inner)).name == "collective"
    outer = (f"{SP}/deepspeed/runtime/zero/partition_parameters.py", "_all_gather",
             "handle = self._allgather_param(param, async_op=async_op, hierarchy=hierarchy)")
    assert detect_operation(tb(outer, inner)).name == "zero3_fetch"


def test_eval_phase_keeps_eval_advice_first_and_drops_liger():
    d = diagnose((DATA / "trainer_eval.log").read_text(encoding="utf-8"))
    assert d.phase == "eval" and d.operation == "lm_head"
    assert d.advice_ids[:3] == ("eval_settings.batch_size", "eval_settings.accumulation_steps",
                             "eval_settings.preprocess_logits")
    assert "liger" not in d.advice_ids and "logits_to_keep" in d.advice_ids


def test_plain_training_traceback_has_no_operation():
    d = diagnose(tb(*TRAIN, (f"{SP}/torch/nn/modules/linear.py", "forward", "return F.linear(input, self.weight, self.bias)")))
    assert d.phase == "forward" and d.operation == "unknown" and d.operation_frame == ""
    assert not any(c.kind == "operation" for c in d.causes)


# ------------------------------------------------------------------ logits size with a setup


def test_logits_shape_arithmetic():
    # Llama 3 vocabulary 128256, batch 2 x 4096 tokens, float32: 2 * 4096 * 128256 * 4 bytes = 3.91 GiB
    n = 2 * 4096 * 128256 * 4
    assert logits_shape_for(n, 0, batch=2, seq=4096, vocab=128256) == (8192, 128256, 4)
    assert logits_shape_for(2 * 4095 * 128256 * 2, 0, batch=2, seq=4096, vocab=128256) == (8190, 128256, 2)
    assert logits_shape_for(n + 10 * MiB, 5 * MiB, batch=2, seq=4096, vocab=128256) is None


@pytest.mark.slow  # imports transformers (about 5 s when it is the first test to)
def test_logits_cause_needs_a_setup_and_the_vocab(monkeypatch):
    from transformers import LlamaConfig

    from memfit.train_setup import TrainSetup

    config = LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4)
    monkeypatch.setattr("memfit.diagnosis.gpu_match.plan_for", lambda setup, m: None)  # the planner is tested elsewhere
    frames = TRAIN + [(f"{SP}/transformers/loss/loss_utils.py", "ForCausalLMLoss", "logits = logits.float()")]
    text = tb(*frames, tried="3.91 GiB")
    assert not any(c.kind == "logits" for c in diagnose(text).causes)  # no setup: nothing claimed
    setup = TrainSetup(model=config, task="causal-lm", per_device_train_batch_size=2, max_length=4096)
    d = diagnose(text, setup=setup)
    logits = next(c for c in d.causes if c.kind == "logits")
    assert "8192 tokens" in logits.text and "128256" in logits.text and "float32" in logits.text
    # batch 4 in fp32 would be 7.83 GiB of float32 logits: not this request
    other = TrainSetup(model=config, task="causal-lm", per_device_train_batch_size=4, max_length=4096)
    assert not any(c.kind == "logits" for c in diagnose(text, setup=other).causes)
    # ... but under bf16 the model's own 4 x 4096 x 128256 x 2-byte logits are exactly 3.91 GiB
    bf16 = TrainSetup(model=config, task="causal-lm", per_device_train_batch_size=4, max_length=4096, precision="bf16")
    assert "bf16/fp16" in next(c for c in diagnose(text, setup=bf16).causes if c.kind == "logits").text


# ------------------------------------------------------------------ strings, JSON and text output


def test_every_operation_and_advice_has_both_languages():
    for name in OPERATIONS:
        assert f"operation.{name}" in MESSAGES
        if name != "unknown":
            assert f"operation.{name}.why" in MESSAGES
        for a in OPERATION_ADVICE[name]:
            assert f"advice.{a}" in MESSAGES
    assert {"nccl", "logits", "operation"} <= set(CAUSE_KINDS)


def test_cli_json_and_text_show_the_operation(tmp_path, capsys):
    log = tmp_path / "grpo.log"
    log.write_text(BY_ID["llamafactory_3398"]["text"], encoding="utf-8")
    assert main(["diagnose", "--json", str(log)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["operation"] == "attention_scores" and "softmax" in out["operation_frame"]
    assert out["operation_context"] == [] and out["advice_ids"][1] == "flash_attention"
    assert main(["diagnose", str(log)]) == 0
    text = capsys.readouterr().out
    assert "Operation:" in text and "S × S" in text and "flash_attention_2" in text
    assert main(["diagnose", str(log), "--lang", "zh"]) == 0
    assert "操作" in capsys.readouterr().out


def test_cli_nccl_log(tmp_path, capsys):
    log = tmp_path / "nccl.log"
    log.write_text(BY_ID["opensora_386"]["text"], encoding="utf-8")
    assert main(["diagnose", "--json", str(log)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "nccl" and out["operation"] == "nccl" and out["advice_ids"][0] == "nccl_buffers"


def test_advice_that_recommends_a_remedy_is_named_by_the_remedy():
    from memfit.diagnosis.advice import PHASE_ADVICE
    from memfit.remedies import REGISTRY, remedy_for_advice

    ids = {a for advice in (*OPERATION_ADVICE.values(), *PHASE_ADVICE.values()) for a in advice}
    for advice_id in ids:  # an id under a remedy's name is one that remedy declares (its `advice`)
        head = advice_id.split(".")[0]
        if head in REGISTRY:
            assert remedy_for_advice(advice_id) is REGISTRY[head], advice_id
        else:
            assert remedy_for_advice(advice_id) is None, advice_id
    d = diagnose(tb(*TRAIN, (f"{SP}/transformers/loss/loss_utils.py", "ForCausalLMLoss", "logits = logits.float()")))
    assert "micro_batch" in d.remedies and "truncation" in d.remedies and "liger" in d.remedies


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('│❱╭╰ File"line,in:0123456789ab./_\n^')), max_size=300))
def test_frame_reading_never_crashes(text):
    op = detect_operation(text)
    assert op.name in OPERATIONS
    assert all(len(f) == 4 for f in traceback_frames(text))
