"""GRPO settings memfit refuses or flags in one line (memfit.estimator / memfit.gpus.vllm), and vLLM modelled
without being installed. num_generations that does not divide the generation batch: tests/sim/test_grpo.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest

pytest.importorskip("trl")

from transformers import LlamaConfig  # noqa: E402

from memfit import TrainSetup, estimate  # noqa: E402

LLAMA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)


def _setup(**kw) -> TrainSetup:
    base = dict(model=LLAMA, task="causal-lm", trainer="grpo", per_device_train_batch_size=4,
                gradient_accumulation_steps=2, num_generations=4, max_length=16, max_completion_length=24,
                optim="adamw_torch", attn_implementation="sdpa", use_vllm=True)
    return TrainSetup(**{**base, **kw})


def test_vllm_is_modelled_without_being_installed():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: this checks an environment without it")
    r = estimate(_setup(vllm_gpu_memory_utilization=0.3), gpu="A100-80GB")
    assert r.rl["vllm"]["generation_bytes"] == int(0.3 * r.gpu["total_bytes"]) and r.fits is True
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("utilization, refused", [(0.3, False), (0.99, False),
                                                   pytest.param(1.0, True, marks=pytest.mark.slow)])
def test_a_colocate_share_above_what_the_card_has_left_at_start_up(utilization, refused):
    """TRL starts vLLM after the policy is on the GPU: a share above total - weights - memory outside PyTorch
    never starts (vLLM's start-up check); the tiny model's weights leave 0.99 of an A100-80GB, not 1.0."""
    r = estimate(_setup(vllm_gpu_memory_utilization=utilization), gpu="A100-80GB")
    notes = [n for n in r.notes if "vLLM stops at start-up" in n]
    assert bool(notes) == refused and (r.fits is False) == refused
    if refused:
        (note,) = notes
        assert "\n" not in note and f"vllm_gpu_memory_utilization `{utilization}`" in note
        largest = float(note.rsplit("use at most ", 1)[1])
        free = r.gpu["total_bytes"] - r.rl["vllm"]["weights_bytes"] - r.non_pytorch_bytes
        assert largest * r.gpu["total_bytes"] <= free < (largest + 0.01) * r.gpu["total_bytes"]
        ok = estimate(_setup(vllm_gpu_memory_utilization=largest), gpu="A100-80GB")
        assert not [n for n in ok.notes if "vLLM stops at start-up" in n]


def test_server_mode_takes_nothing_at_start_up():
    r = estimate(_setup(vllm_mode="server", vllm_gpu_memory_utilization=1.0), gpu="A100-80GB")
    assert not [n for n in r.notes if "vLLM stops at start-up" in n]
