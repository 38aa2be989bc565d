"""The remedies of image models: `smaller_images` (each side halved: a quarter of the image tokens where the
processor keeps the resolution) and `freeze_vision_tower`; each variant is simulated, never assumed."""

from __future__ import annotations

import pytest
from helpers import tiny_qwen2_5_vl_dir

from memfit.estimator import estimate
from memfit.models.resolve import resolve
from memfit.remedies import OPT_IN, REGISTRY
from memfit.train_setup import TrainSetup


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return tiny_qwen2_5_vl_dir(tmp_path_factory.mktemp("qwen_vl"))


def test_both_are_opt_in_and_apply_to_image_models_only(tiny_bert_dir):
    assert {"smaller_images", "freeze_vision_tower"} <= set(OPT_IN)
    text = resolve(TrainSetup(model=tiny_bert_dir))
    for name in ("smaller_images", "freeze_vision_tower"):
        verdict = REGISTRY[name].check(text, None)
        assert not verdict.applies and "only" in verdict.reason
        assert REGISTRY[name].variants(text, None) == []


def test_smaller_images_quarter_the_image_tokens_and_lower_the_peak(qwen_vl):
    setup = resolve(TrainSetup(model=qwen_vl, image_size="448x448", max_length=8, per_device_train_batch_size=2,
                               eval_strategy="no"))
    r = REGISTRY["smaller_images"]
    assert r.check(setup, None).applies
    [variant] = r.variants(setup, None)
    assert variant == {"image_size": "224x224"}
    before, after = estimate(setup), estimate(setup.replace(**variant))
    tokens = before.media_inputs["image_tokens_per_image"], after.media_inputs["image_tokens_per_image"]
    assert tokens == (256, 64)  # the processor's: (448 / 28)^2 and (224 / 28)^2 merged patches
    assert after.peak_allocated_bytes < before.peak_allocated_bytes
    assert after.breakdown["activations"] < before.breakdown["activations"]
    _, _, code = r.apply(variant, setup)
    assert "224x224" in code[0] and "max_pixels = 50176" in code[0]
    small = setup.replace(image_size="100x80")
    assert not r.check(small, None).applies and r.variants(small, None) == []


def test_freeze_vision_tower_lowers_the_trained_state(qwen_vl):
    setup = resolve(TrainSetup(model=qwen_vl, image_size="100x80", max_length=8, per_device_train_batch_size=1,
                               eval_strategy="no"))
    r = REGISTRY["freeze_vision_tower"]
    [variant] = r.variants(setup, None)
    before, after = estimate(setup), estimate(setup.replace(**variant))
    assert after.trainable_params < before.trainable_params
    assert after.breakdown["optimizer_state"] < before.breakdown["optimizer_state"]
    assert not r.check(setup.replace(**variant), None).applies  # frozen already
    assert not r.check(setup.replace(lora_r=4), None).applies  # LoRA freezes the tower already


@pytest.mark.slow
def test_a_vlm_plan_runs_and_says_why_liger_does_not_apply(qwen_vl):
    """liger-kernel's patch of a model type may not import with the installed transformers (its qwen2_5_vl module
    in liger-kernel 0.8): then Liger does not apply, for that reason, and the plan still runs."""
    from memfit.planner.search import plan
    from memfit.sim.kernels.liger import liger_import_error

    setup = TrainSetup(model=qwen_vl, image_size="224x224", max_length=8, per_device_train_batch_size=2,
                       eval_strategy="no")
    result = plan(setup, gpu="A100-80GB", allow=("smaller_images",))
    assert result.chosen is not None or result.fits_as_is
    broken = liger_import_error("qwen2_5_vl")
    if broken is not None:
        assert REGISTRY["liger"].check(resolve(setup), None).reason == broken
        assert result.not_applicable["liger"] == broken


@pytest.mark.slow
def test_a_plan_searches_both_when_allowed(qwen_vl):
    """Allowed, each is an axis of the search: a candidate with the images halved and one with the tower frozen are
    ranked (and not without `allow`)."""
    from memfit.planner.search import plan

    setup = TrainSetup(model=qwen_vl, image_size="448x448", max_length=8, per_device_train_batch_size=2,
                       eval_strategy="no")
    allowed = plan(setup, gpu="A100-80GB", allow=("smaller_images", "freeze_vision_tower"))
    changes = [c.setup_changes for c in allowed.searched]
    assert {"image_size": "224x224"} in changes and {"freeze_vision_tower": True} in changes
    plain = plan(setup, gpu="A100-80GB")
    assert not any("image_size" in c.setup_changes or "freeze_vision_tower" in c.setup_changes
                   for c in plain.searched)
