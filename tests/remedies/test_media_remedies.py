"""The remedies of image models: `smaller_images` (each side halved: a quarter of the image tokens where the
processor keeps the resolution), `freeze_vision_tower` and `no_pan_and_scan` (Gemma 3's crops off); each variant
is simulated, never assumed."""

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


# -- no_pan_and_scan: Gemma 3's crops off ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (as tests/sim/test_host_values.py's): one language block of width 64,
    one SigLIP block of width 32 on 56 x 56 views (4 x 4 patches of 14 px, pooled into 4 image tokens), with the
    processor's settings (image_seq_length 4): a 1200x400 image with pan-and-scan is the image and 3 crops."""
    import json

    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = tmp_path_factory.mktemp("gemma3")
    transformers.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=4096,
                         sliding_window=8, layer_types=["full_attention"], query_pre_attn_scalar=32),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=4, boi_token_index=250, eoi_token_index=251, image_token_index=262,
        architectures=["Gemma3ForConditionalGeneration"]).save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 4,
                                                              "processor_class": "Gemma3Processor"}))
    return str(folder)


def _gemma3_setup(folder, **fields):
    return TrainSetup(model=folder, **{"image_size": "1200x400", "pan_and_scan": True, "max_length": 16,
                                       "per_device_train_batch_size": 1, "eval_strategy": "no", **fields})


def test_no_pan_and_scan_applies_to_gemma3_with_pan_and_scan_only(gemma3, qwen_vl, tiny_bert_dir):
    r = REGISTRY["no_pan_and_scan"]
    assert "no_pan_and_scan" in OPT_IN
    on = resolve(_gemma3_setup(gemma3))
    assert r.check(on, None).applies and r.variants(on, None) == [{"pan_and_scan": False}]
    off = on.replace(pan_and_scan=False)
    assert not r.check(off, None).applies and "off already" in r.check(off, None).reason
    for other in (resolve(TrainSetup(model=qwen_vl, image_size="448x448")), resolve(TrainSetup(model=tiny_bert_dir))):
        verdict = r.check(other, None)
        assert not verdict.applies and "Gemma 3" in verdict.reason and r.variants(other, None) == []
    _, _, code = r.apply({"pan_and_scan": False}, on)
    assert "do_pan_and_scan=False" in code[0] and "--pan-and-scan" in code[0]


@pytest.mark.slow
def test_a_gemma3_plan_ranks_no_pan_and_scan_only_when_allowed_and_it_saves_the_estimates_difference(gemma3):
    """Every other remedy excluded and a batch of 1, the only candidate is pan-and-scan off: on a GPU between the
    two estimates' needs the setup does not fit, the candidate is verified, fits and is chosen; its saving is the
    difference of the estimates with and without pan-and-scan. Without `allow` nothing is searched."""
    from memfit.estimator import estimate
    from memfit.planner.search import plan

    setup = _gemma3_setup(gemma3)
    gpu = dict(gpu="256MiB", non_pytorch_bytes=0)  # a GPU's smallest size; nothing outside PyTorch
    on, off = estimate(setup, **gpu), estimate(setup.replace(pan_and_scan=False), **gpu)
    assert (on.media_inputs["crops_per_image"], on.media_inputs["image_tokens_per_image"]) == (3, 16)
    assert off.media_inputs["image_tokens_per_image"] == 4
    assert off.peak_reserved_bytes < on.peak_reserved_bytes
    # the memory outside PyTorch stands in for the rest of the GPU: PyTorch gets the midpoint of the two needs
    capacity_bytes = (off.peak_reserved_bytes + on.peak_reserved_bytes) // 2
    others = tuple(n for n in REGISTRY if n != "no_pan_and_scan")
    kwargs = dict(gpu="256MiB", margin=0.0, non_pytorch_bytes=256 * 2**20 - capacity_bytes, exclude=others,
                  cache=False)
    allowed = plan(setup, allow=("no_pan_and_scan",), **kwargs)
    assert {"pan_and_scan": False} in [c.setup_changes for c in allowed.searched]
    assert not allowed.fits_as_is and allowed.chosen is not None
    chosen = allowed.plans[allowed.chosen]
    assert chosen.remedies == ["no_pan_and_scan"] and chosen.setup_changes == {"pan_and_scan": False}
    assert any("do_pan_and_scan=False" in line for line in chosen.code)
    assert allowed.baseline.peak_allocated_bytes == on.peak_allocated_bytes
    assert (allowed.baseline.peak_allocated_bytes - chosen.peak_allocated_bytes
            == on.peak_allocated_bytes - off.peak_allocated_bytes > 0)
    plain = plan(setup, **kwargs)
    assert not any("pan_and_scan" in c.setup_changes for c in plain.searched)
    assert plain.chosen is None and any("allow `no_pan_and_scan`" in s for s in plain.suggestions)
