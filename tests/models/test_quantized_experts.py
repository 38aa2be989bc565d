"""QLoRA of a transformers 5 MoE model: its fused expert weights are no nn.Linear layers, so bitsandbytes leaves
them unquantized, and the report says so first; peft's `use_gradient_checkpointing` is a setting."""

import pytest
import transformers

from memfit import estimate
from memfit.train_setup import TrainSetup


def _mixtral():
    return transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      num_local_experts=4, dtype="bfloat16")


def test_unquantized_experts_are_said_first_with_their_bytes():
    report = estimate(_mixtral(), task="causal-lm", load_in_4bit=True, lora_r=8,
                      lora_target_modules=["q_proj", "v_proj"], max_length=32, per_device_train_batch_size=1)
    first = report.notes[0]
    assert first.startswith("NOT QUANTIZED") and "gate_up_proj" in first
    # the experts' bytes, counted from the real (CPU) model transformers builds, fp32 after peft's kbit prep
    model = transformers.MixtralForCausalLM(_mixtral())
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    assert f"{experts / 1e6:,.2f} M parameters" in first and "cast them to float32" in first
    assert report.quantization["quantized_params"] < experts  # the quantized part is the smaller one


@pytest.mark.parametrize("use", [True, False])
def test_kbit_use_gradient_checkpointing_is_peft_keyword(use):
    setup = TrainSetup(model="x", load_in_4bit=True, lora_r=8, kbit_use_gradient_checkpointing=use)
    assert setup.gradient_checkpointing is use
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   vocab_size=50)
    report = estimate(cfg, task="causal-lm", load_in_4bit=True, lora_r=4, max_length=16,
                      per_device_train_batch_size=1, kbit_use_gradient_checkpointing=use)
    assert (report.checkpointing is not None) is use  # peft's prepare_model_for_kbit_training ran with it
