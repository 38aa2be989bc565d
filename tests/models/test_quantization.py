"""Quantized base weights: bitsandbytes 4-bit / 8-bit storage against real CPU quantization, the
CUDA kernels' allocation rules read from the installed bitsandbytes source, the simulated temporaries,
peft's prepare_model_for_kbit_training, paged optimizers, TrainSetup / CLI inputs."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from memfit import TrainSetup  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.models.quantization import (QuantSpec, quant_state_tensors, quantize_meta_model,  # noqa: E402
                                        quantized_storage)


def _tiny_config(**kw):
    from transformers import LlamaConfig

    base = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096, dtype="bfloat16",
                architectures=["LlamaForCausalLM"])
    base.update(kw)
    return LlamaConfig(**base)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device.type) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes() if t.device.type != "meta" else t.numel() * t.element_size()
    return total


def _real_cpu_4bit(out_f, in_f, *, quant_type, double_quant, storage):
    from bitsandbytes.nn import Linear4bit

    layer = Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, compress_statistics=double_quant,
                       quant_type=quant_type, quant_storage=getattr(torch, storage))
    layer.weight.data = torch.randn(out_f, in_f).to(torch.bfloat16)
    layer = layer.to("cpu")  # Params4bit.to -> _quantize on bitsandbytes' CPU backend
    qs = layer.weight.quant_state
    tensors = [layer.weight.data, qs.absmax, qs.code]
    if qs.nested:
        tensors += [qs.offset, qs.state2.absmax, qs.state2.code]
    return tensors


@pytest.mark.parametrize("quant_type,double_quant,storage,shape", [
    ("nf4", True, "uint8", (384, 128)), ("fp4", False, "uint8", (128, 384)),
    ("nf4", False, "bfloat16", (96, 200)), ("nf4", True, "float32", (1000, 72)),
])
def test_4bit_storage_matches_real_cpu_quantization(quant_type, double_quant, storage, shape):
    out_f, in_f = shape
    real = _real_cpu_4bit(out_f, in_f, quant_type=quant_type, double_quant=double_quant, storage=storage)
    spec = QuantSpec(bits=4, quant_type=quant_type, double_quant=double_quant, quant_storage=storage)
    assert sum(quantized_storage(out_f, in_f, spec).values()) == _storage_bytes(real)
    # memfit's meta quantization (bitsandbytes' own code on meta tensors) gives the same tensors
    from transformers import LlamaForCausalLM

    cfg = _tiny_config(hidden_size=in_f, intermediate_size=out_f, num_attention_heads=1, num_key_value_heads=1,
                       num_hidden_layers=1)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    quantize_meta_model(model, spec)
    up = model.model.layers[0].mlp.up_proj  # (intermediate, hidden) = (out_f, in_f)
    qs = up.weight.quant_state
    fake = [up.weight, qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]
    assert type(model.lm_head) is torch.nn.Linear  # get_keys_to_not_convert: the LM head stays unquantized


def test_8bit_storage_matches_real_cpu_quantization():
    from bitsandbytes.nn import Linear8bitLt

    layer = Linear8bitLt(200, 96, bias=True, has_fp16_weights=False, threshold=6.0)
    layer.weight.data = torch.randn(96, 200).to(torch.bfloat16)
    layer = layer.to("cpu")  # Int8Params.to -> _quantize (int8_vectorwise_quant)
    real = [layer.weight.data, layer.weight.SCB]
    assert layer.weight.dtype == torch.int8
    assert sum(quantized_storage(96, 200, QuantSpec(bits=8)).values()) == _storage_bytes(real)


# -- the CUDA allocation rules memfit emulates, read from the installed bitsandbytes --------------------------------
def test_bitsandbytes_source_still_has_the_rules_memfit_emulates():
    """memfit.sim.kernels.bnb and memfit.models.quantization copy these rules; an upgrade that changes one fails here."""
    import ast
    from pathlib import Path

    from bitsandbytes.autograd import _functions as fn
    from bitsandbytes.nn import Params4bit
    from bitsandbytes.optim import optimizer as bopt

    from memfit.models.quantization import BLOCKSIZE_4BIT
    from memfit.sim.kernels.bnb import GEMM_4BIT_CUSTOM_FLOOR_M, GEMM_4BIT_CUSTOM_MAX_M
    from memfit.sim.optimizers import PAGED_MIN_NUMEL

    # the CUDA backend does not import without CUDA: its source is read as text
    src = (Path(bnb.__file__).parent / "backends" / "cuda" / "ops.py").read_text(encoding="utf-8")
    assert f"_gemm_4bit_custom_max_m = {GEMM_4BIT_CUSTOM_MAX_M}" in src
    assert f"_GEMM_4BIT_CUSTOM_FLOOR_M = {GEMM_4BIT_CUSTOM_FLOOR_M}" in src
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_dequant_linear_fallback")
    fallback = ast.get_source_segment(src, node)
    for line in ("absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)", "absmax = absmax_dq + absmax_offset",
                 "B_dq = torch.empty(shapeB, dtype=A.dtype, device=A.device)",
                 "return torch.nn.functional.linear(A, B_dq, bias)"):
        assert line in fallback, line
    fwd, bwd = inspect.getsource(fn.MatMul4Bit.forward), inspect.getsource(fn.MatMul4Bit.backward)
    assert "ctx.tensors = (None, B)" in fwd  # nothing but the (already resident) weight is saved
    assert "F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)" in bwd
    bwd8 = inspect.getsource(fn.MatMul8bitLt.backward)
    assert "state.CB.to(ctx.dtype_A, copy=True).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))" in bwd8
    assert 'A.device.type in ("cpu", "xpu")' in inspect.getsource(fn.matmul)  # why memfit routes to MatMul8bitLt
    assert inspect.signature(Params4bit.__new__).parameters["blocksize"].default is None
    assert f"blocksize = {BLOCKSIZE_4BIT}" in inspect.getsource(Params4bit.__new__)
    assert PAGED_MIN_NUMEL == 100_000 and "p.numel() < 1e5" in inspect.getsource(bopt.Optimizer8bit.get_state_buffer)


# -- the simulation -------------------------------------------------------------------------------------------------
def _sim(gpu=None, **kw):
    from memfit.sim.engine import simulate

    fields = dict(model=_tiny_config(), task="causal-lm", per_device_train_batch_size=1, max_length=2048,
                  precision="bf16", lora_r=8)
    fields.update(kw)
    return simulate(TrainSetup(**fields), gpu=gpu)


def _op_allocs(sim, op, phase):
    return [e.size_bytes for e in sim.trace if e.action == "alloc" and e.phase == phase
            and e.module == f"bitsandbytes::{op}"]


@pytest.mark.slow
def test_4bit_forward_and_backward_temporaries_follow_the_cuda_rules():
    sim = _sim(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bf16",
               bnb_4bit_use_double_quant=True, kbit_prep=False)
    M = 2048  # tokens: past _gemm_4bit_custom_max_m, gemm_4bit dequantizes (backends/cuda/ops.py)
    shapes = [(128, 128), (64, 128), (64, 128), (128, 128), (384, 128), (384, 128), (128, 384)]  # q k v o gate up down
    expected = []
    for n, k in shapes:
        blocks = n * k // 64
        # absmax_dq (float32), absmax_dq + offset, B_dq in bf16, the bf16 output of F.linear
        expected += [4 * blocks, 4 * blocks, 2 * n * k, 2 * M * n]
    got = _op_allocs(sim, "gemm_4bit", "forward")
    assert got == expected * 2 * 2  # 2 layers, 2 optimizer steps
    # backward: dequantize_blockwise (float32 absmax) and dequantize_4bit (the weight in its bf16 load dtype)
    bwd = _op_allocs(sim, "dequantize_4bit", "backward")
    assert sorted(set(bwd)) == sorted({2 * n * k for n, k in shapes})
    assert sim.quantization["gemm_4bit_paths"] == ["fallback"]


@pytest.mark.slow
def test_kbit_prep_casts_to_float32_and_turns_checkpointing_on():
    with_prep = _sim(load_in_4bit=True)
    without = _sim(load_in_4bit=True, kbit_prep=False)
    assert set(with_prep.quantization["higher_precision"]) == {"float32"}  # embeddings, norms, LM head, LoRA
    assert "bfloat16" in without.quantization["higher_precision"]
    assert with_prep.checkpointing == "huggingface" and without.checkpointing is None
    cast = 2 * 1000 * 128 + 5 * 128  # embeddings, LM head, norms: bf16 -> float32
    assert any(f"cast {cast / 1e6:,.1f} M" in n for n in with_prep.notes)
    assert not any("prepare_model_for_kbit_training was run" in n for n in without.notes)
    q = with_prep.quantization
    assert q["modules_not_converted"] == ["lm_head"] and q["quantized_modules"] == 14
    assert q["quantized_params"] == 2 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 384 * 128)
    # real parameter counts: embeddings + LM head + 5 norms + the quantized weights (two per packed byte) + LoRA
    assert with_prep.params == without.params == 2 * 1000 * 128 + 5 * 128 + q["quantized_params"] \
        + with_prep.trainable_params


def test_paged_optimizer_state_is_outside_the_trace():
    from memfit.sim.engine import simulate

    cfg = _tiny_config()
    setup = TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=1, max_length=64,
                       optim="paged_adamw_32bit")
    sim = simulate(setup, optimizer_only=True)
    # get_state_buffer: only parameters of >= 1e5 elements are paged (embed_tokens and lm_head: 1000 x 128)
    assert sim.paged_bytes == 2 * 2 * 4 * 1000 * 128
    unpaged = simulate(setup.replace(optim="adamw_torch"), optimizer_only=True)
    assert unpaged.paged_bytes == 0


# -- inputs ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(load_in_4bit=True, load_in_8bit=True, lora_r=8), "only one"),
    (dict(load_in_4bit=True), "purely quantized"),
    (dict(load_in_4bit=True, lora_r=8, bnb_4bit_quant_type="int4"), "nf4"),
    (dict(load_in_4bit=True, lora_r=8, bnb_4bit_compute_dtype="int8"), "fp32, fp16, bf16"),
    (dict(load_in_4bit=True, lora_r=8, bnb_4bit_quant_storage="int4"), "quant_storage"),
    (dict(load_in_8bit=True, lora_r=8, llm_int8_threshold=-1.0), "llm_int8_threshold"),
    (dict(load_in_4bit="yes", lora_r=8), "true or false"),
    (dict(optim="paged_adamw_16bit"), "paged_adamw_16bit"),
])
def test_bad_quantization_inputs_are_one_line_errors(kwargs, match):
    with pytest.raises(MemfitError, match=match) as err:
        TrainSetup(model="gpt2", task="causal-lm", **kwargs)
    assert "\n" not in str(err.value)


def test_kbit_prep_turns_gradient_checkpointing_on_in_the_setup():
    on = TrainSetup(model="gpt2", task="causal-lm", load_in_4bit=True, lora_r=8)
    assert on.gradient_checkpointing and any("prepare_model_for_kbit_training" in n for n in on.notes)
    off = TrainSetup(model="gpt2", task="causal-lm", load_in_4bit=True, lora_r=8, kbit_prep=False)
    assert not off.gradient_checkpointing
    assert not TrainSetup(model="gpt2", task="causal-lm", lora_r=8).gradient_checkpointing


def test_quantization_config_dict_and_bitsandbytes_config():
    from transformers import BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                             bnb_4bit_use_double_quant=True)
    s = TrainSetup.from_kwargs("gpt2", task="causal-lm", lora_r=8, quantization_config=cfg)
    assert (s.load_in_4bit, s.bnb_4bit_quant_type, s.bnb_4bit_compute_dtype, s.bnb_4bit_use_double_quant) == \
        (True, "nf4", "bfloat16", True)
    s = TrainSetup.from_kwargs("gpt2", task="causal-lm", lora_r=8,
                               training_args={"quantization_config": {"load_in_8bit": True}})
    assert s.load_in_8bit and not s.load_in_4bit
    with pytest.raises(MemfitError, match="unknown `quantization_config` key `load_in_3bit`"):
        TrainSetup.from_kwargs("gpt2", task="causal-lm", lora_r=8, quantization_config={"load_in_3bit": True})
    with pytest.raises(MemfitError, match="quant_method `gptq`"):
        TrainSetup.from_kwargs("gpt2", task="causal-lm", lora_r=8, quantization_config={"quant_method": "gptq"})


def test_args_file_quantization_config(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 1, "quantization_config": {
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}}))
    s = TrainSetup.from_json(path, "gpt2", task="causal-lm", lora_r=8)
    assert s.load_in_4bit and s.bnb_4bit_quant_type == "nf4" and s.bnb_4bit_compute_dtype == "bfloat16"


def test_cli_flags_reach_the_setup(tmp_path):
    import argparse

    from memfit.commands.estimate import add_setup_arguments, build_setup

    p = argparse.ArgumentParser()
    add_setup_arguments(p)
    args = p.parse_args(["gpt2", "--task", "causal-lm", "--load-in-4bit", "--bnb-4bit-quant-type", "nf4",
                         "--bnb-4bit-compute-dtype", "bf16", "--double-quant", "--no-kbit-prep", "--lora-r", "4",
                         "--optim", "paged_adamw_8bit"])
    args.func = None
    setup, _, _ = build_setup(args)
    assert (setup.load_in_4bit, setup.bnb_4bit_quant_type, setup.bnb_4bit_compute_dtype,
            setup.bnb_4bit_use_double_quant, setup.kbit_prep, setup.optim) == \
        (True, "nf4", "bfloat16", True, False, "paged_adamw_8bit")
    args_file = tmp_path / "a.json"
    args_file.write_text(json.dumps({"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                                     "optim": "paged_adamw_32bit"}))
    args = p.parse_args(["gpt2", "--task", "causal-lm", "--lora-r", "4", "--args", str(args_file)])
    args.func = None
    setup, _, _ = build_setup(args)
    assert (setup.load_in_4bit, setup.bnb_4bit_quant_type, setup.optim) == (True, "nf4", "paged_adamw_32bit")
    args = p.parse_args(["gpt2", "--task", "causal-lm", "--load-in-8bit"])
    args.func = None
    with pytest.raises(MemfitError, match="purely quantized"):
        build_setup(args)


@pytest.mark.slow
def test_estimate_json_has_the_quantization_object(tmp_path, capsys):
    from memfit.cli import main

    d = tmp_path / "tiny"
    _tiny_config().save_pretrained(d)
    rc = main(["estimate", str(d), "--task", "causal-lm", "--load-in-4bit", "--lora-r", "4", "--batch-size", "1",
               "--max-length", "256", "--precision", "bf16", "--no-cache", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    q = out["quantization"]
    assert q["method"] == "bitsandbytes-4bit" and q["bits"] == 4 and q["quantized_modules"] == 14
    assert q["quantized_bytes"] == 2 * sum(sum(quantized_storage(n, k, QuantSpec(bits=4)).values()) for n, k in
                                           [(128, 128), (64, 128), (64, 128), (128, 128), (384, 128), (384, 128),
                                            (128, 384)])
    assert q["dequant_temporaries_max_bytes"] > 0 and out["paged_bytes"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, eval_strategy="steps",
         eval_samples=4),
    dict(load_in_8bit=True, optim="paged_adamw_8bit"),
], ids=["4bit-dq-eval", "8bit-paged"])
def test_spliced_quantized_trace_equals_full_trace(kw):
    """The cut model (a deepcopy of meta Params4bit, memfit.models.quantization.meta_safe_deepcopy) stands for the
    full quantized model event for event, as tests/sim/test_splice.py checks for unquantized ones."""
    from memfit.peaks import peaks
    from memfit.sim import engine

    setup = TrainSetup(model=_tiny_config(num_hidden_layers=8), task="causal-lm", per_device_train_batch_size=2,
                       per_device_eval_batch_size=2, max_length=16, precision="bf16", lora_r=4, **kw)
    runner = engine._Runner(setup, fake=True, splice=True)
    assert runner.cut is not None
    spliced = runner.run()
    full = engine.simulate(setup, splice=False)

    def summary(sim):
        p = peaks(sim.trace, round_to=1)
        return (p.overall.bytes, p.phase_of_peak, p.overall.breakdown, p.final_live_bytes, len(sim.trace),
                sim.params, sim.trainable_params, sim.paged_bytes)

    assert summary(spliced) == summary(full)
    assert spliced.quantization == full.quantization


def test_gemm_4bit_kernel_choice_is_bitsandbytes_own_heuristic():
    """memfit runs `_gemm_4bit_use_custom_cuda` from the installed source; these cases follow its branches
    (bitsandbytes 0.50.2 backends/cuda/ops.py) by hand."""
    from memfit.sim.kernels.bnb import gemm_4bit_use_custom as use_custom

    bf16 = torch.bfloat16
    assert use_custom(128, (8, 9), bf16, 4, 14336, 4096)  # M <= _GEMM_4BIT_CUSTOM_FLOOR_M
    # sm89 (RTX 4090, 128 SMs), N=14336 -> 224 blocks of 64: the near-wave tier with n_blocks >= 200: M <= 128
    assert use_custom(128, (8, 9), bf16, 100, 14336, 4096) and not use_custom(128, (8, 9), bf16, 512, 14336, 4096)
    # sm90 (H100, 132 SMs), N = K = 4096 -> 64 blocks, under half a wave: dequantize + F.linear
    assert not use_custom(132, (9, 0), bf16, 64, 4096, 4096)
    assert not use_custom(128, (8, 9), torch.float32, 16, 14336, 4096)  # fp32: custom only below 8 rows


@pytest.mark.slow
def test_fused_4bit_gemm_allocates_only_its_output():
    from memfit.gpus.catalog import resolve_gpu

    fused = _sim(load_in_4bit=True, bnb_4bit_compute_dtype="bf16", kbit_prep=False, max_length=16,
                 gpu=resolve_gpu("RTX-4090"))  # 128 SMs, compute capability 8.9
    assert fused.quantization["gemm_4bit_paths"] == ["fused"]
    shapes = [(128, 128), (64, 128), (64, 128), (128, 128), (384, 128), (384, 128), (128, 384)]
    assert _op_allocs(fused, "gemm_4bit", "forward") == [2 * 16 * n for n, _ in shapes] * 2 * 2  # outputs only
    unknown = _sim(load_in_4bit=True, bnb_4bit_compute_dtype="bf16", kbit_prep=False, max_length=16)
    assert unknown.quantization["gemm_4bit_paths"] == ["fallback-assumed"]
    assert any("unknown without --gpu" in n for n in unknown.notes)


def test_train_args_file_refuses_quantization_config(tmp_path):
    """`memfit train` loads real weights and does not quantize them: the key is an error, not silently dropped."""
    from memfit.commands._args import train_kwargs_from_file
    from memfit.train_setup import TrainSetup as TS

    path = tmp_path / "a.json"
    path.write_text(json.dumps({"quantization_config": {"load_in_4bit": True}}))
    import dataclasses

    with pytest.raises(MemfitError, match="`quantization_config`.*does not take"):
        train_kwargs_from_file(str(path), {f.name for f in dataclasses.fields(TS)})


def test_8bit_layers_keep_their_inputs_under_non_reentrant_checkpointing():
    """bitsandbytes' MatMul8bitLt keeps its input as `ctx.tensors`, outside non-reentrant checkpointing's saved-tensor
    hooks: the report says so, and reentrant checkpointing (no autograd context in its checkpointed forward) keeps
    fewer activations, run by bitsandbytes' own code."""
    from memfit.peaks import peaks
    from memfit.sim.engine import simulate

    base = dict(model=_tiny_config(num_hidden_layers=4), task="causal-lm", per_device_train_batch_size=2,
                max_length=64, precision="fp16", lora_r=4, load_in_8bit=True, gradient_checkpointing=True,
                eval_strategy="no")
    plain = simulate(TrainSetup(**base), splice=False)
    reentrant = simulate(TrainSetup(**base, gradient_checkpointing_kwargs={"use_reentrant": True}), splice=False)
    assert any("MatMul8bitLt keeps each layer's input" in n for n in plain.notes)
    assert not any("MatMul8bitLt keeps each layer's input" in n for n in reentrant.notes)
    kept = [peaks(sim.trace).by_phase["backward"].breakdown["activations"] for sim in (plain, reentrant)]
    assert kept[1] < kept[0], kept
