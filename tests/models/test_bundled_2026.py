"""The configs of the models people fine-tune now: sources, aliases, Gemma 3's vision tower.

The published parameter count of every bundled config is checked in tests/models/test_model_catalog.py
(`test_param_count_matches_published`, within each record's `params_rel_tol`); this module checks what is
particular to the new ones.
"""

from __future__ import annotations

import inspect
import json
import warnings
from importlib import resources

import pytest
import torch
import transformers

from memfit.models.catalog import ALIASES, bundled_info, bundled_model_ids, find_bundled, load_bundled_config

_DIR = resources.files("memfit.models.configs")


def _sources_rows() -> dict[str, str]:
    """hub id -> config source, from the table of configs/SOURCES.md."""
    rows = {}
    for line in _DIR.joinpath("SOURCES.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells[1]
    return rows


NEW = sorted(_sources_rows())

#: The models the issue names (item 6), by the hub id each is bundled or aliased under.
NAMED = [
    "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.2-1B-Instruct",
    "meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.3-70B-Instruct", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-14B",
    "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B",
    "Qwen/Qwen3-8B", "Qwen/Qwen3-14B", "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B", "google/gemma-2-2b", "google/gemma-2-9b",
    "google/gemma-2-27b", "google/gemma-3-1b-it", "google/gemma-3-4b-it", "google/gemma-3-12b-it", "google/gemma-3-27b-it",
    "mistralai/Mistral-Nemo-Base-2407", "mistralai/Mistral-Small-24B-Base-2501", "microsoft/Phi-3.5-mini-instruct",
    "microsoft/phi-4", "HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM3-3B", "openai/gpt-oss-20b",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "allenai/OLMo-2-1124-7B", "answerdotai/ModernBERT-base",
    "answerdotai/ModernBERT-large", "mistralai/Mixtral-8x7B-Instruct-v0.1", "allenai/OLMoE-1B-7B-0924",
    "deepseek-ai/DeepSeek-V2-Lite",
    # the four found later (configs/SOURCES.md)
    "Qwen/Qwen2.5-Coder-7B", "Qwen/Qwen2.5-Coder-7B-Instruct", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "HuggingFaceTB/SmolLM2-360M", "HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-1.7B",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct",
]


def test_at_least_25_new_configs_each_with_its_source():
    assert len(NEW) >= 25
    rows = _sources_rows()
    for hub_id in NEW:
        info = bundled_info(hub_id)
        assert info["hub_id"] == hub_id
        assert rows[hub_id] == info["source"], hub_id  # SOURCES.md and the file agree
        assert "params_rel_tol" in info, hub_id  # the tolerance is stated, not the 1 % default


@pytest.mark.parametrize("hub_id", NAMED)
def test_every_model_the_issue_names_resolves_offline(hub_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolved = find_bundled(hub_id)
    assert resolved is not None, hub_id
    assert load_bundled_config(hub_id).model_type


def test_aliases_point_at_bundled_configs_and_shadow_none():
    ids = set(bundled_model_ids())
    for alias, target in ALIASES.items():
        assert target in ids, alias
        assert alias not in ids, f"{alias} is bundled as a file and aliased"
        assert find_bundled(alias) == target
        assert find_bundled(alias.rsplit("/", 1)[-1].lower()) == target  # the bare name too
        assert find_bundled(alias.replace("/", "--")) == target
    assert find_bundled("llama-3.3-70b-instruct") == "meta-llama/Llama-3.1-70B"
    assert load_bundled_config("google/gemma-3-27b-it").model_type == "gemma3_text"
    assert load_bundled_config("google/gemma-3-4b-it").model_type == "gemma3"  # bundled: the multimodal model
    assert find_bundled("someone/Llama-3.1-8B-Instruct") is None  # another organisation is another model


@pytest.mark.parametrize("hub_id", ["google/gemma-3-4b-pt", "google/gemma-3-12b-pt", "google/gemma-3-27b-pt"])
def test_gemma3_published_count_is_text_model_plus_the_vision_tower(hub_id):
    """The hub model is Gemma3ForConditionalGeneration; memfit bundles its text config. The record's
    `params_excluded` (vision tower + projector) is rebuilt here on meta from the recorded vision_config."""
    info = bundled_info(hub_id)
    excluded = info["params_excluded"]
    text = load_bundled_config(hub_id)
    full_config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=excluded["vision_config"],
                                            mm_tokens_per_image=excluded["mm_tokens_per_image"])
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        full = transformers.Gemma3ForConditionalGeneration(full_config)
        text_only = transformers.Gemma3ForCausalLM(text)
    n_full = sum(p.numel() for p in full.parameters())
    n_text = sum(p.numel() for p in text_only.parameters())
    assert n_full - n_text == excluded["count"]
    assert abs(n_full - info["params"]) / info["params"] <= info["params_rel_tol"]


def test_mistral_small_is_exact():
    from memfit.models.build import build_meta_model
    from memfit.train_setup import TrainSetup

    info = bundled_info("mistralai/Mistral-Small-24B-Base-2501")
    assert info["params_rel_tol"] == 0.0
    model = build_meta_model(TrainSetup(model="mistralai/Mistral-Small-24B-Base-2501", task="causal-lm", max_length=16))
    assert sum(p.numel() for p in model.parameters()) == info["params"] == 23_572_403_200


def test_mxfp4_rule_read_from_the_installed_transformers():
    """gpt-oss is bundled without its MXFP4 quantization_config: transformers cannot train MXFP4 and dequantizes
    into the parameters' dtype (memfit.sim.moe.mxfp4_note). An upgrade that changes either fails here."""
    from transformers.integrations import mxfp4
    from transformers.quantizers import quantizer_mxfp4

    trainable = inspect.getsource(quantizer_mxfp4.Mxfp4HfQuantizer.is_trainable.fget)
    assert "return False" in trainable
    convert = inspect.getsource(mxfp4.Mxfp4Dequantize)
    assert "to the dtype of the parameter they load into" in convert
    raw = json.loads(_DIR.joinpath("openai--gpt-oss-20b.json").read_text(encoding="utf-8"))
    assert "quantization_config" not in raw


def test_gpt_oss_estimate_notes_the_dequantized_experts():
    from memfit.sim.engine import simulate
    from memfit.train_setup import TrainSetup

    config = transformers.GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    r = simulate(TrainSetup(model=config, task="causal-lm", per_device_train_batch_size=1, max_length=16,
                            precision="bf16", weights_dtype="bf16"), fake=True)
    assert any(n.startswith("gpt-oss:") and "bfloat16" in n for n in r.notes)
    assert any(n.startswith("MoE: 2 expert layers, 4 experts, top-2") for n in r.notes)
