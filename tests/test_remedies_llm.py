"""The LLM-stack remedies of the planner (issue 12 item 7): FlashAttention-2, Liger kernels, QLoRA.

Each is proposed only where it can run (GPU, packages, model type), is simulated like every other
remedy (the plan's numbers come from the emulated kernels), and says what to install."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from memfit.gpus import as_gpu_spec
from memfit.planner import plan
from memfit.planner.search import _kernel_axis
from memfit.planner.throughput import StepCost, step_time_s
from memfit.remedies import REGISTRY
from memfit.train_setup import TrainSetup


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048).save_pretrained(path)
    return str(path)


def _verdicts(setup, gpu):
    return {name: r.check(setup, gpu) for name, r in REGISTRY.items()}


@pytest.mark.parametrize("gpu,applies", [("V100-16GB", False), ("T4", False), ("A100-80GB", True), ("L4", True)])
def test_flash_attention_only_where_flash_attn_runs(tiny_llama, gpu, applies):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="fp16")
    verdict = REGISTRY["flash_attention"].check(setup, as_gpu_spec(gpu))
    assert verdict.applies is applies, verdict.reason
    if not applies:
        assert "8.0" in verdict.reason


def test_flash_attention_not_proposed_twice(tiny_llama):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", attn_implementation="flash_attention_2")
    assert not REGISTRY["flash_attention"].check(setup, as_gpu_spec("A100-80GB")).applies


def test_liger_by_model_type(tiny_llama, tiny_bert_dir):
    gpu = as_gpu_spec("A100-80GB")
    assert REGISTRY["liger"].check(TrainSetup(model=tiny_llama, task="causal-lm"), gpu).applies
    bert = REGISTRY["liger"].check(TrainSetup(model=tiny_bert_dir, task="seq-cls"), gpu)
    from memfit.sim.kernels.liger import liger_supported_model_types

    assert bert.applies is ("bert" in liger_supported_model_types())
    assert not REGISTRY["liger"].check(TrainSetup(model=tiny_llama, task="causal-lm", use_liger_kernel=True),
                                       gpu).applies


def test_kernel_axis_is_short_and_qlora_needs_consent(tiny_llama):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16")
    gpu = as_gpu_spec("A100-80GB")
    verdicts = _verdicts(setup, gpu)
    axis = _kernel_axis(setup, gpu, verdicts, allow=(), exclude=())
    assert axis == [{}, {"attn_implementation": "flash_attention_2", "use_liger_kernel": True}]
    allowed = _kernel_axis(setup, gpu, verdicts, allow=("qlora",), exclude=())
    assert len(allowed) == 3 and allowed[2]["load_in_4bit"] and "lora_r" not in allowed[2]  # LoRA: its own axis
    assert allowed[2]["bnb_4bit_compute_dtype"] == "bf16" and allowed[2]["attn_implementation"] == "flash_attention_2"
    assert _kernel_axis(setup, gpu, verdicts, allow=(), exclude=("flash_attention", "liger")) == [{}]
    v100 = as_gpu_spec("V100-16GB")
    fp16 = setup.replace(precision="fp16")
    assert _kernel_axis(fp16, v100, _verdicts(fp16, v100), allow=(), exclude=()) == [{}, {"use_liger_kernel": True}]


def test_apply_names_the_packages_and_the_auto_class(tiny_llama):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16")
    _, _, code = REGISTRY["flash_attention"].apply({"attn_implementation": "flash_attention_2"}, setup)
    assert code[0].startswith("# pip install flash-attn") and "AutoModelForCausalLM" in code[1]
    args, _, code = REGISTRY["liger"].apply({"use_liger_kernel": True}, setup)
    assert args == {"use_liger_kernel": True} and "liger-kernel" in code[0]
    _, _, code = REGISTRY["qlora"].apply({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                          "bnb_4bit_compute_dtype": "bf16", "bnb_4bit_use_double_quant": True}, setup)
    text = "\n".join(code)
    assert "pip install bitsandbytes" in text and "torch.bfloat16" in text and "prepare_model_for_kbit_training" in text


def test_dequantization_makes_steps_slower():
    gpu = as_gpu_spec("A100-80GB")
    base = StepCost(8_000_000_000, 40_000_000, 32, 4096, 2048, 1, 1, "bf16", True, "adamw_torch_fused")
    q = StepCost(8_000_000_000, 40_000_000, 32, 4096, 2048, 1, 1, "bf16", True, "adamw_torch_fused",
                 quantized_params=8_000_000_000 - 40_000_000, quantized_bits=4)
    # 3 passes x 7.96e9 params x 2.5 B / 2.039e12 B/s (A100-80GB bandwidth in the catalog) on top
    extra = step_time_s(q, gpu) - step_time_s(base, gpu)
    assert extra == pytest.approx(3 * (8_000_000_000 - 40_000_000) * 2.5 / (gpu.memory_bandwidth_gbps * 1e9))


def test_plan_uses_flash_and_liger_where_they_fit(tiny_llama):
    """A tiny Llama whose logits (4096 vocab x 1024 tokens x batch 8, float32 in the loss) dominate: the plan
    verifies the lean kernels by simulation and keeps the method; on a V100 flash is never proposed."""
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", per_device_train_batch_size=8,
                       max_length=1024)
    base = plan(setup, gpu="A100-80GB").baseline
    need = base.peak_allocated_bytes
    outside = base.device_used_bytes - base.peak_reserved_bytes
    result = plan(setup, gpu=f"{int((outside + 0.8 * base.peak_reserved_bytes) / 0.95)}B")
    assert not result.fits_as_is
    chosen = result.plans[result.chosen]
    assert chosen.verified and chosen.fits
    assert {"flash_attention", "liger"} & set(chosen.remedies), chosen.remedies
    assert chosen.peak_allocated_bytes < need
    on_v100 = plan(setup.replace(precision="fp16"), gpu="V100-16GB")
    assert all("flash_attention" not in p.remedies for p in on_v100.plans)


def test_qlora_allows_lora_and_a_bare_4bit_base_is_refused(tiny_llama):
    """`--allow qlora` lets a full fine-tune become QLoRA (LoRA comes with it); a 4-bit base without adapters is
    refused by TrainSetup (as Trainer refuses it), so the planner skips such combinations."""
    from memfit.errors import MemfitError
    from memfit.planner.search import _check_options

    assert "lora" in _check_options(margin=0.05, allow=("qlora",), exclude=())
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16")
    with pytest.raises(MemfitError):
        setup.replace(**REGISTRY["qlora"].variants(setup, as_gpu_spec("A100-80GB"))[0])
    assert setup.replace(lora_r=16, **REGISTRY["qlora"].variants(setup, as_gpu_spec("A100-80GB"))[0]).load_in_4bit
