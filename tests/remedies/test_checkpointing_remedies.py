"""Reentrant checkpointing for an 8-bit base (`reentrant_checkpointing`): where it applies, which change is its own
in the field it shares with checkpoint offload, and the plan that uses it saving what the simulation of
bitsandbytes' own layers says."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from memfit.estimator import estimate
from memfit.gpus.catalog import CATALOG
from memfit.models.resolve import resolve
from memfit.remedies import REGISTRY
from memfit.train_setup import TrainSetup

REENTRANT = REGISTRY["reentrant_checkpointing"]


def _setup(**kw) -> TrainSetup:
    config = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    base = dict(model=config, task="causal-lm", per_device_train_batch_size=4, max_length=256, precision="fp16",
                lora_r=4, load_in_8bit=True, eval_strategy="no")
    return resolve(TrainSetup(**{**base, **kw}))


def test_applies_only_to_an_8bit_base_under_non_reentrant_checkpointing():
    s = _setup()
    assert s.gradient_checkpointing  # peft's kbit prep turns it on, non-reentrant (transformers 5's default)
    assert REENTRANT.check(s, None).applies
    [variant] = REENTRANT.variants(s, None)
    assert variant == {"gradient_checkpointing_kwargs": {"use_reentrant": True}}
    done = s.replace(**variant)
    assert not REENTRANT.check(done, None).applies and REENTRANT.variants(done, None) == []
    four_bit = _setup(load_in_8bit=False, load_in_4bit=True)
    assert "8-bit" in REENTRANT.check(four_bit, None).reason and REENTRANT.variants(four_bit, None) == []
    plain = _setup(load_in_8bit=False, lora_r=None)
    assert not REENTRANT.check(plain, None).applies
    offloaded = s.replace(gradient_checkpointing_kwargs={"offload": True})
    assert not REENTRANT.check(offloaded, None).applies


def test_the_shared_field_has_one_owner_per_change():
    s = _setup()
    [reentrant] = REENTRANT.variants(s, None)
    [offload] = REGISTRY["checkpoint_offload"].variants(s, None)
    owners = {name: [r.name for r in REGISTRY.values() if "gradient_checkpointing_kwargs" in r.fields
                     and r.owns(v, s)] for name, v in (("reentrant", reentrant), ("offload", offload))}
    assert owners == {"reentrant": ["reentrant_checkpointing"], "offload": ["checkpoint_offload"]}


@pytest.mark.slow
def test_a_plan_chooses_it_and_saves_what_the_simulation_says():
    """A GPU between the two needs: the plan is reentrant checkpointing alone (no slower, same method), and it
    predicts less memory than the setup by exactly the difference of the two full simulations."""
    from memfit.planner.search import plan

    s = _setup()
    [variant] = REENTRANT.variants(s, None)
    gpu = CATALOG["a100-80gb"]
    before, after = estimate(s, gpu=gpu), estimate(s.replace(**variant), gpu=gpu)
    assert after.breakdown["activations"] < before.breakdown["activations"]
    need = [r.required_bytes or r.peak_reserved_bytes for r in (before, after)]
    assert need[1] < need[0]
    small = dataclasses.replace(gpu, total_bytes=int(sum(need) / 2 / 0.95))
    result = plan(s, gpu=small, non_pytorch_bytes=0, workers=1)
    assert not result.fits_as_is and result.chosen is not None
    chosen = result.plans[result.chosen]
    assert chosen.remedies == ["reentrant_checkpointing"] and chosen.verified
    assert chosen.changes == {"gradient_checkpointing_kwargs": {"use_reentrant": True}}
    assert chosen.peak_allocated_bytes == after.peak_allocated_bytes
    assert result.baseline.peak_allocated_bytes - chosen.peak_allocated_bytes \
        == before.peak_allocated_bytes - after.peak_allocated_bytes > 0


@pytest.mark.parametrize("trainer", ["grpo", "distill"])
def test_checkpoint_offload_is_not_offered_to_trainers_that_generate(trainer, tmp_path):
    """TRL turns checkpointing off around generation and back on with the whole gradient_checkpointing_kwargs
    (trl/models/utils.py `disable_gradient_checkpointing`), `offload` included, which torch.utils.checkpoint
    rejects: GRPO, RLOO and distillation runs never get it."""
    offload = REGISTRY["checkpoint_offload"]
    sft = _setup(load_in_8bit=False, lora_r=None, gradient_checkpointing=True, trainer="sft")
    assert offload.check(sft, None).applies
    extra = {"per_device_train_batch_size": 8}  # GRPO: whole groups of num_generations (8)
    if trainer == "distill":
        sft.model.to_json_file(str(tmp_path / "config.json"))  # the teacher: a directory with its config
        extra = {"teacher_model": str(tmp_path)}
    s = sft.replace(trainer=trainer, max_length=64, max_completion_length=32, **extra)
    why = offload.check(s, None)
    assert not why.applies and "hands `offload` to torch.utils.checkpoint" in why.reason
