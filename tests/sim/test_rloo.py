"""TRL's RLOOTrainer (memfit.sim.rloo_steps): RLOOConfig's names and defaults against the installed TRL, the code path
shared with GRPOTrainer checked in TRL's source, the whole step on real CPU tensors against FakeTensors, and the
closed forms (the reference copy, the generation batch)."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap

import pytest

trl = pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from helpers import real_and_fake  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from memfit import TrainSetup, estimate  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.sim import grpo_steps  # noqa: E402
from memfit.train_setup import TRAINING_ARGS_NAMES, TRL_CONFIG_NAMES  # noqa: E402

LLAMA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)


def _setup(**kw) -> TrainSetup:
    base = dict(model=LLAMA, task="causal-lm", trainer="rloo", per_device_train_batch_size=4,
                gradient_accumulation_steps=2, num_generations=4, max_length=16, max_completion_length=24,
                optim="adamw_torch", attn_implementation="sdpa")
    return TrainSetup(**{**base, **kw})


def test_rloo_config_names_match_installed_trl():
    from trl import RLOOConfig

    assert TRL_CONFIG_NAMES["rloo"] == {f.name for f in dataclasses.fields(RLOOConfig)} - TRAINING_ARGS_NAMES


def test_rloo_shares_grpo_log_prob_code():
    """memfit scores RLOO's completions with GRPOTrainer's `_get_per_token_logps_and_entropies`: the two methods'
    source is the same in the installed TRL."""
    from trl import GRPOTrainer, RLOOTrainer

    def source(cls):
        return textwrap.dedent(inspect.getsource(inspect.unwrap(cls._get_per_token_logps_and_entropies)))

    assert source(RLOOTrainer) == source(GRPOTrainer)


def test_rloo_defaults_are_rloo_configs(tmp_path):
    """Left out, `beta` and `num_generations` are RLOOConfig's (0.05 and 2, not GRPO's 0.0 and 8); an RLOOConfig
    object is read as `trainer="rloo"` with its settings and TRL's base-config defaults."""
    from trl import RLOOConfig

    cfg = RLOOConfig(output_dir=str(tmp_path), use_cpu=True)
    s = TrainSetup(model=LLAMA, task="causal-lm", trainer="rloo", per_device_train_batch_size=4)
    assert (s.beta, s.num_generations) == (cfg.beta, cfg.num_generations) == (0.05, 2)
    assert TrainSetup(model=LLAMA, task="causal-lm", trainer="grpo").num_generations == 8
    args = RLOOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      steps_per_generation=2, max_completion_length=64, beta=0.0)
    s = TrainSetup.from_training_args(args, model=LLAMA)
    assert (s.trainer, s.num_generations, s.max_completion_length, s.beta, s.grpo_sizes) == ("rloo", 4, 64, 0.0, (2, 8))
    s = TrainSetup.from_kwargs(LLAMA, training_args={"trainer": "rloo", "normalize_advantages": True})
    assert s.gradient_checkpointing and s.precision == "bf16"  # RLOOConfig's base-config defaults, with notes
    assert any("RLOOConfig's default" in n for n in s.notes)


@pytest.mark.parametrize("kw, fragment", [
    (dict(num_generations=3), "not divisible by num_generations `3`, as RLOOConfig requires"),
    (dict(num_generations=1), "RLOO needs at least 2 completions"),
    (dict(generation_batch_size=8, steps_per_generation=2), "both set"),
])
def test_bad_rloo_input_is_one_line(kw, fragment):
    with pytest.raises(MemfitError) as err:
        _setup(**kw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_rloo_args_file_reader_names_the_closest(tmp_path):
    with pytest.raises(MemfitError, match="did you mean `normalize_advantages`") as err:
        TrainSetup.from_kwargs(LLAMA, training_args={"trainer": "rloo", "normalise_advantages": True})
    assert "\n" not in str(err.value)
    with pytest.raises(MemfitError, match="RLOOConfig setting; say which trainer"):
        TrainSetup.from_kwargs(LLAMA, training_args={"reward_clip_range": [-1, 1]})


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(beta=0.0), dict(lora_r=4), dict(use_vllm=True),
                                dict(gradient_accumulation_steps=1, steps_per_generation=2)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_rloo_step_on_real_tensors_matches_fake(kw):
    """Generation, scoring, forward, backward and optimizer of RLOO on real (zero) CPU tensors and on FakeTensors:
    the same trace, event for event."""
    real, fake = real_and_fake(_setup(**kw))
    phases = {ev.phase for ev in fake.trace}
    assert ("generation" in phases) != bool(kw.get("use_vllm")) and "scoring" in phases


@pytest.fixture(scope="module")
def reports():
    return {name: estimate(_setup(**kw), gpu="A100-80GB")
            for name, kw in (("default", {}), ("beta0", dict(beta=0.0)), ("lora", dict(lora_r=4)),
                             ("lora_beta0", dict(lora_r=4, beta=0.0)))}


@pytest.mark.slow
def test_rloo_reference_is_exactly_one_copy_of_the_weights(reports):
    """RLOOConfig's default beta=0.05 keeps a reference copy; beta=0 drops exactly one copy of the weights; with
    peft the adapter disabled is the reference (no copy)."""
    weights_bytes = sum(p.numel() * p.element_size() for p in LlamaForCausalLM(LLAMA).parameters())
    w = {k: r.phase_breakdowns["forward"]["weights"] for k, r in reports.items()}
    assert 0 <= w["default"] - w["beta0"] - weights_bytes <= 512 * 32  # each tensor rounded up to 512 bytes
    assert w["lora"] == w["lora_beta0"]
    assert reports["default"].rl["reference_copy"] and not reports["beta0"].rl["reference_copy"]
    assert not reports["lora"].rl["reference_copy"]


@pytest.mark.slow
def test_rloo_report_rows(reports):
    r = reports["default"]
    assert r.rl["trainer"] == "rloo" and r.rl["old_log_probs"]  # RLOO always scores the old log-probs
    assert r.phases["generation"] > 0 and r.phases["scoring"] > 0
    assert (r.rl["generation_batch_size"], r.rl["steps_per_generation"]) == (8, 2)
    assert r.rl["kv_cache_bytes"] == grpo_steps.kv_cache_bytes(LLAMA, sequences=8, tokens=16 + 24 - 1, dtype_bytes=4)
