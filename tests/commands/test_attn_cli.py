"""`memfit estimate --attn ... --liger`: the flags reach the simulation, the JSON report says which
attention ran and which kernels were emulated, and impossible combinations are one-line errors."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=500, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


def test_json_names_the_attention_and_the_emulated_kernels(tiny_llama_dir, capsys):
    pytest.importorskip("liger_kernel")
    assert main(["estimate", tiny_llama_dir, "--task", "causal-lm", "--batch-size", "2", "--max-length", "64",
                 "--precision", "bf16", "--attn", "flash_attention_2", "--liger", "--gpu", "A100-80GB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["attn_implementation"] == "flash_attention_2"
    assert "flash_attention_2:varlen" in data["emulated_kernels"]
    assert "liger:fused_linear_cross_entropy" in data["emulated_kernels"]
    assert data["setup"]["use_liger_kernel"] is True


def test_flash_on_a_t4_is_a_one_line_error(tiny_llama_dir, capsys):
    assert main(["estimate", tiny_llama_dir, "--task", "causal-lm", "--batch-size", "1", "--max-length", "32",
                 "--precision", "fp16", "--attn", "flash_attention_2", "--gpu", "T4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "flash_attention_2 needs Ampere" in err and "`7.5`" in err and "--attn sdpa" in err
    assert "Traceback" not in err


def test_flash_in_fp32_is_a_one_line_error(tiny_llama_dir, capsys):
    assert main(["estimate", tiny_llama_dir, "--task", "causal-lm", "--batch-size", "1", "--max-length", "32",
                 "--attn", "flash_attention_2", "--weights-dtype", "fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fp16 or bf16" in err and "--precision bf16" in err
