"""Every bundled model estimates offline with its default task, the head its family is fine-tuned with."""

import pytest

from memfit import TrainSetup, estimate
from memfit.cli import main
from memfit.models.catalog import bundled_model_ids

#: Expected default task by model type, written out here (not derived from memfit's rule):
#: decoder-only LMs -> causal-lm, encoder-decoders -> seq2seq-lm, encoders (and XLNet) -> seq-cls.
_EXPECTED = {
    "llama": "causal-lm", "mistral": "causal-lm", "qwen2": "causal-lm", "phi": "causal-lm", "phi3": "causal-lm",
    "gpt2": "causal-lm", "t5": "seq2seq-lm", "bart": "seq2seq-lm",
    "bert": "seq-cls", "roberta": "seq-cls", "xlm-roberta": "seq-cls", "distilbert": "seq-cls", "albert": "seq-cls",
    "electra": "seq-cls", "deberta-v2": "seq-cls", "xlnet": "seq-cls",
    # the models people fine-tune now
    "qwen3": "causal-lm", "qwen3_moe": "causal-lm", "gemma2": "causal-lm", "gemma3_text": "causal-lm",
    "olmo2": "causal-lm", "olmoe": "causal-lm", "mixtral": "causal-lm", "gpt_oss": "causal-lm",
    "deepseek_v2": "causal-lm", "smollm3": "causal-lm", "modernbert": "seq-cls",
    # image and speech models: their inputs made by their own processors
    "vit": "image-cls", "dinov2": "image-cls", "convnext": "image-cls", "swin": "image-cls",
    "whisper": "speech-seq2seq", "wav2vec2": "ctc", "hubert": "ctc", "qwen2_5_vl": "image-text-to-text", "qwen3_vl": "image-text-to-text",
    "gemma3": "image-text-to-text", "llava": "image-text-to-text", "smolvlm": "image-text-to-text",
    "mllama": "image-text-to-text", "paligemma": "image-text-to-text", "llava_next": "image-text-to-text",
}

#: Large bundled configs whose estimate takes 5-17 s each on the shared 2-core machine (measured with
#: max_length 64, batch 1): slow. The fast run keeps one small model of each new family.
_SLOW = {
    "meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-72B-Instruct",
    "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B", "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B",
    "google/gemma-2-9b", "google/gemma-2-27b", "google/gemma-3-4b-pt", "google/gemma-3-12b-pt", "google/gemma-3-27b-pt",
    "mistralai/Mistral-Nemo-Base-2407", "mistralai/Mistral-Small-24B-Base-2501", "microsoft/phi-4",
    "openai/gpt-oss-20b", "allenai/OLMo-2-1124-7B", "answerdotai/ModernBERT-large", "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "deepseek-ai/DeepSeek-V2-Lite", "HuggingFaceTB/SmolLM3-3B", "google/gemma-2-2b",
    "openai/whisper-large-v3", "openai/whisper-large-v3-turbo",
    "facebook/wav2vec2-large-960h-lv60-self", "facebook/hubert-large-ls960-ft",
    "google/gemma-3-4b-it", "google/gemma-3-12b-it", "llava-hf/llava-1.5-7b-hf",
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct", "meta-llama/Llama-3.2-11B-Vision-Instruct",
    "google/paligemma2-3b-pt-224", "HuggingFaceTB/SmolVLM2-2.2B-Instruct", "llava-hf/llava-v1.6-mistral-7b-hf",
    "google/paligemma2-3b-pt-448",
    # the 32-block vision tower runs whole (its full-attention blocks differ from the windowed ones):
    # 140-175 s each under a load of 5
    "Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct",
}

#: Bundled configs whose estimate here is left out, and where what it would check is checked instead.
_LEFT_OUT = {
    # 4,096 image tokens: 54 s (45 s past the imports) on the shared 2-core machine; the 448 checkpoint's estimate
    # above runs the same code, and tests/models/test_image_text_families.py checks its 4,096 tokens and weights
    "google/paligemma2-3b-pt-896": "the 448 checkpoint's estimate runs the same code; its tokens and weights are "
                                   "checked in tests/models/test_image_text_families.py",
    # the 3B's SigLIP tower and processor with Gemma 2 9B's 42 blocks: 65 s here; the 3B's estimate runs the same code
    # and gemma-2-9b's that language model
    "google/paligemma2-10b-pt-224": "the 3B checkpoints' estimates run the same code; its weights are checked in "
                                    "tests/models/test_model_catalog.py",
}


def _marks(model_id: str) -> list:
    if model_id in _LEFT_OUT:
        return [pytest.mark.skip(reason=_LEFT_OUT[model_id])]
    return [pytest.mark.slow] if model_id in _SLOW else []


@pytest.mark.parametrize("model_id", [pytest.param(m, marks=_marks(m)) for m in bundled_model_ids()])
def test_bundled_model_estimates_with_its_default_task(model_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = estimate(TrainSetup(model=model_id, per_device_train_batch_size=1, max_length=64, precision="bf16"),
                 gpu="A100-80GB")
    assert r.task == _EXPECTED[r.model_type], model_id
    assert any(n.startswith(f"task `{r.task}` chosen from") for n in r.notes)
    assert r.params > 1_000_000
    assert r.breakdown["weights"] > 0
    assert r.phase_breakdowns["optimizer"]["gradients"] > 0 and r.phase_breakdowns["optimizer"]["optimizer_state"] > 0
    if r.fits:
        assert r.device_used_bytes >= r.peak_reserved_bytes >= r.peak_allocated_bytes
    else:  # a model too large to fine-tune fully on one A100-80GB (Llama-3.1-70B): the OOM is predicted
        assert r.oom is not None and r.shortfall_bytes > 0 and r.peak_reserved_bytes <= r.capacity_bytes


@pytest.mark.parametrize("model_id", ["t5-small", "facebook/bart-base"])
def test_seq2seq_models_run_from_the_command_line_with_no_task(model_id, capsys, monkeypatch):
    """`memfit estimate t5-small` used to end in a DynamicOutputShapeException traceback (seq-cls head)."""
    import json

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["estimate", model_id, "--batch-size", "1", "--max-length", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["task"] == "seq2seq-lm"
    assert any("`seq2seq-lm` chosen from the config's architectures" in n for n in data["notes"])
