"""The default task follows the model; an impossible sequence length is a clear error naming the limit."""

from __future__ import annotations

import json
import warnings

import pytest
from transformers import BertConfig, BertForMaskedLM, GPT2Config, LlamaConfig, T5Config

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models.limits import position_limits
from memfit.models.build import build_meta_model, default_task
from memfit.models.resolve import resolve
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# -- default task ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "task"), [
    ("gpt2", "causal-lm"), ("meta-llama/Llama-3.2-1B", "causal-lm"), ("microsoft/phi-2", "causal-lm"),
    ("t5-small", "seq2seq-lm"), ("facebook/bart-base", "seq2seq-lm"),  # BART's architectures say `BartModel`
    ("bert-base-uncased", "seq-cls"), ("roberta-base", "seq-cls"), ("google/electra-base-discriminator", "seq-cls"),
    ("microsoft/deberta-v3-base", "seq-cls"),  # no architectures in its config
    ("xlnet-large-cased", "seq-cls"),  # XLNetLMHeadModel, but fine-tuned like BERT (and the seed case)
])
def test_default_task_of_bundled_models(model, task):
    setup = resolve(TrainSetup(model=model))
    assert setup.task == task
    assert setup.notes[-1].startswith(f"task `{task}` chosen from ")


def test_default_task_of_configs_without_architectures():
    assert default_task(GPT2Config())[0] == "causal-lm"
    assert default_task(LlamaConfig())[0] == "causal-lm"
    assert default_task(T5Config())[0] == "seq2seq-lm"
    assert default_task(BertConfig())[0] == "seq-cls"


@pytest.mark.parametrize(("arch", "task"), [
    ("BertForSequenceClassification", "seq-cls"), ("BertForTokenClassification", "token-cls"),
    ("BertForQuestionAnswering", "qa"), ("BertForMaskedLM", "seq-cls"), ("BertModel", "seq-cls"),
])
def test_a_fine_tuned_checkpoint_keeps_its_head(arch, task):
    assert default_task(BertConfig(architectures=[arch]))[0] == task


def test_a_module_has_its_own_head():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=100))
    assert default_task(model)[0] == "mlm"
    assert resolve(TrainSetup(model=model)).task == "mlm"


def test_an_explicit_task_is_kept_and_adds_no_note():
    setup = TrainSetup(model="gpt2", task="seq-cls")
    assert setup.task == "seq-cls" and setup.notes == []


def test_the_default_task_note_does_not_touch_the_callers_list():
    notes = ["mine"]
    setup = resolve(TrainSetup(model="gpt2", notes=notes))
    assert notes == ["mine"] and setup.notes[0] == "mine" and len(setup.notes) == 2


def test_estimate_of_a_causal_lm_gets_no_classification_head():
    from memfit.estimator import estimate

    r = estimate(TrainSetup(model="gpt2", per_device_train_batch_size=1, max_length=16))
    assert r.task == "causal-lm"
    assert r.params == 124_439_808  # GPT2LMHeadModel, tied; GPT2ForSequenceClassification has 124,441,344


# -- position limits ---------------------------------------------------------------------------------------

def test_gpt2_2048_tokens_is_an_error_naming_the_limit():
    with pytest.raises(MemfitError) as err:
        simulate(TrainSetup(model="gpt2", per_device_train_batch_size=1, max_length=2048))
    assert str(err.value) == ("`max_length` 2048 exceeds gpt2's position limit of 1024 (`n_positions` in its "
                              "config); use --max-length <= 1024")


def test_gpt2_at_its_limit_runs():
    """At exactly 1024 positions the step runs: the forward allocates the float32 logits of all 1024 tokens."""
    sim = simulate(TrainSetup(model="gpt2", per_device_train_batch_size=1, max_length=1024, eval_strategy="no"),
                   optimizer_steps=0)
    logits_bytes = 1 * 1024 * 50257 * 4  # batch x positions x GPT-2's vocabulary x float32
    assert any(e.action == "alloc" and e.phase == "forward" and e.size_bytes == logits_bytes for e in sim.trace)
    assert max(e.size_bytes for e in sim.trace if e.action == "alloc") == logits_bytes


@pytest.mark.parametrize(("model", "limit"), [("bert-base-uncased", 512), ("roberta-base", 512),
                                              ("distilbert-base-uncased", 512), ("albert-base-v2", 512),
                                              ("facebook/bart-base", 1024), ("gpt2", 1024)])
def test_position_limits_of_bundled_models(model, limit):
    setup = TrainSetup(model=model, max_length=16)
    limits = position_limits(build_meta_model(setup))
    assert limits and {lim.max_tokens for lim in limits} == {limit}


@pytest.mark.parametrize("model", ["t5-small", "xlnet-base-cased", "microsoft/deberta-v3-base",
                                   "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"])
def test_relative_and_rotary_models_have_no_position_table(model):
    assert position_limits(build_meta_model(TrainSetup(model=model, max_length=16))) == []


def test_roberta_limit_counts_its_offset():
    """RoBERTa numbers positions from padding_idx + 1 (create_position_ids_from_input_ids): 514 rows, 512 tokens."""
    with pytest.raises(MemfitError, match=r"position limit of 512 \(`max_position_embeddings` = 514 in its config"):
        simulate(TrainSetup(model="roberta-base", per_device_train_batch_size=1, max_length=513))


def test_bart_decoder_limit_applies_to_the_target_length():
    with pytest.raises(MemfitError, match=r"^`target_length` 1025 exceeds facebook/bart-base's decoder position "
                                          r"limit of 1024 .*use --target-length <= 1024$"):
        simulate(TrainSetup(model="facebook/bart-base", per_device_train_batch_size=1, max_length=16,
                            target_length=1025))


def test_an_untruncated_long_example_is_named():
    setup = TrainSetup(model="bert-base-uncased", per_device_train_batch_size=1, max_length=128,
                       example_lengths=[100, 600], truncation=False)
    with pytest.raises(MemfitError, match=r"^the longest example \(600 tokens, not truncated\) exceeds .* 512"):
        simulate(setup)


def test_rope_beyond_max_position_embeddings_is_a_note_not_an_error():
    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    sim = simulate(TrainSetup(model=config, task="causal-lm", per_device_train_batch_size=1, max_length=48,
                              eval_strategy="no"), optimizer_steps=0)
    assert any("48 tokens exceed" in n and "`max_position_embeddings` of 32" in n for n in sim.notes)


def test_bert_513_on_the_command_line_is_one_line(capsys):
    """It used to be a 159-line traceback (a broadcast error from the token_type_ids buffer)."""
    assert main(["estimate", "bert-base-uncased", "--max-length", "513"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "`max_length` 513 exceeds bert-base-uncased's position limit of 512" in err
    assert "use --max-length <= 512" in err


def test_t5_takes_long_sequences(capsys):
    """Relative positions: T5 has no limit (the real model runs 2048 tokens)."""
    assert main(["estimate", "t5-small", "--max-length", "1024", "--target-length", "64", "--batch-size", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["task"] == "seq2seq-lm"


def test_building_does_not_change_the_callers_config():
    """preflight passes a live model's config: the head settings memfit makes must not leak into it."""
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    assert config.pad_token_id is None
    build_meta_model(TrainSetup(model=config, task="seq-cls", num_labels=3, max_length=16))
    assert config.pad_token_id is None and config.num_labels == 2 and config.problem_type is None


def test_an_unreachable_hub_fails_fast_with_the_reason(monkeypatch):
    """Without a connection memfit reads only the local hub cache instead of letting huggingface_hub
    retry for ~20 s, and says why."""
    import time

    from memfit.errors import MemfitError
    from memfit.models.build import _hub_reachable, resolve_config

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert _hub_reachable() is False
    started = time.perf_counter()
    with pytest.raises(MemfitError, match="no connection to the Hugging Face hub"):
        resolve_config("no-such-org/no-such-model-xyz")
    assert time.perf_counter() - started < 10  # generous: before, 20-25 s of retries
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _hub_reachable() is False
