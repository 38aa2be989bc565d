"""memfit.models.processors: the inputs of image and speech models, made by the model's own processor.

The shapes are compared with what the installed transformers' processor returns for the same synthetic input,
computed here at test time (never a table), and with what the model cards state: ViT-Base/16 takes 224x224
images (google/vit-base-patch16-224 model card), Whisper takes 30 s windows of 80 (small) or 128 (large-v3)
log-mel bins and its encoder has 1500 positions (`max_source_positions` of the hub configs; Radford et al.
2022, sec. 2.2: 30-second chunks, a stride-2 convolution).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models.build import build_meta_model, resolve_config
from memfit.models.processors import bundled_processor_ids, load_bundled_processor, media_inputs
from memfit.models.resolve import resolve
from memfit.train_setup import TrainSetup

#: The sizes the image tests run: square images and a 1920x1080 video frame.
SIZES = ["224x224", "448x448", "672x672", "1024x1024", "1344x1344", "1920x1080"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _inputs(**fields):
    setup = resolve(TrainSetup(**fields))
    spec = resolve_config(setup.model)
    return media_inputs(setup, spec, build_meta_model(setup, spec))


def _installed_processor(data: dict, kind: str):
    """The processor transformers itself builds from these settings (its Auto class's own mapping)."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    if kind == "image":
        name = data.get("image_processor_type") or data["feature_extractor_type"].replace("FeatureExtractor",
                                                                                          "ImageProcessor")
        return get_image_processor_class_from_name(name)(**data)
    return getattr(transformers, data["feature_extractor_type"])(**data)


def test_every_bundled_processor_config_is_a_bundled_model():
    from memfit.models.catalog import bundled_model_ids

    assert set(bundled_processor_ids()) <= set(bundled_model_ids())
    assert {"google/vit-base-patch16-224", "openai/whisper-large-v3"} <= set(bundled_processor_ids())


@pytest.mark.parametrize("size", SIZES)
def test_vit_pixel_values_are_what_the_installed_processor_returns(size):
    width, height = map(int, size.split("x"))
    got = _inputs(model="google/vit-base-patch16-224", image_size=size, max_length=16)
    processor = _installed_processor(load_bundled_processor("google/vit-base-patch16-224"), "image")
    expected = processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")
    assert got.tensors["pixel_values"][0] == tuple(expected["pixel_values"].shape[1:])
    assert got.tensors["pixel_values"][0] == (3, 224, 224)  # the model card: images at 224x224
    assert got.summary["image_size"] == size and got.summary["given"] == size


@pytest.mark.parametrize("size", SIZES)
def test_dinov2_processor_defaults_resize_and_crop_like_the_installed_class(size, tmp_path):
    """A local model directory without a preprocessor config: the class transformers maps the model type to,
    with its defaults (BitImageProcessor: shortest edge 256, centre crop 224), said in the notes."""
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=224,
                                       architectures=["Dinov2ForImageClassification"])
    config.save_pretrained(tmp_path)
    width, height = map(int, size.split("x"))
    got = _inputs(model=str(tmp_path), image_size=size, max_length=16)
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING

    cls = IMAGE_PROCESSOR_MAPPING[transformers.Dinov2Config]["pil"]
    expected = cls()(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")
    assert got.tensors["pixel_values"][0] == tuple(expected["pixel_values"].shape[1:]) == (3, 224, 224)
    assert any("defaults" in n for n in got.notes)


@pytest.mark.parametrize("hub_id, bins", [("openai/whisper-small", 80), ("openai/whisper-large-v3", 128),
                                          ("openai/whisper-large-v3-turbo", 128)])
@pytest.mark.parametrize("seconds", [30.0, 7.5])
def test_whisper_pads_every_clip_to_its_30_s_window(hub_id, bins, seconds):
    got = _inputs(model=hub_id, audio_seconds=seconds)
    extractor = _installed_processor(load_bundled_processor(hub_id), "audio")
    expected = extractor(np.zeros(int(seconds * 16000), dtype=np.float32), sampling_rate=16000, return_tensors="pt")
    assert got.tensors["input_features"][0] == tuple(expected["input_features"].shape[1:]) == (bins, 3000)
    assert got.summary["encoder_positions"] == 1500 == resolve_config(hub_id).config.max_source_positions


def test_whisper_labels_stop_at_the_decoders_positions():
    setup = resolve(TrainSetup(model="openai/whisper-small"))
    assert setup.task == "speech-seq2seq"
    assert setup.target_length == 448 and any("max_target_positions" in n for n in setup.notes)
    assert resolve(TrainSetup(model="openai/whisper-small", target_length=128)).target_length == 128


def _one_line_error(argv, capsys) -> str:
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


def test_audio_longer_than_the_whisper_window_is_one_line(capsys):
    err = _one_line_error(["estimate", "openai/whisper-small", "--audio-seconds", "45", "--batch-size", "1"], capsys)
    assert "45" in err and "30 s window" in err and len(err.splitlines()) == 1


def test_a_sampling_rate_the_extractor_does_not_take_is_one_line(capsys):
    err = _one_line_error(["estimate", "openai/whisper-small", "--sampling-rate", "44100"], capsys)
    assert "44100" in err and "16000" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flag, value", [("--image-size", "1024x1024"), ("--audio-seconds", "10")])
def test_a_text_model_with_an_image_or_audio_flag_is_one_line(flag, value, capsys):
    err = _one_line_error(["estimate", "openai-community/gpt2", flag, value, "--max-length", "32"], capsys)
    assert flag in err and "causal-lm" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("bad", ["1024", "1024x", "0x224", "axb", "12x12x3"])
def test_an_image_size_that_is_not_w_x_h_is_refused(bad):
    with pytest.raises(MemfitError, match="WIDTHxHEIGHT"):
        TrainSetup(model="google/vit-base-patch16-224", image_size=bad)


def test_image_classification_takes_one_image_per_example():
    with pytest.raises(MemfitError, match="one image per example"):
        resolve(TrainSetup(model="google/vit-base-patch16-224", images_per_example=2))


@pytest.mark.slow
def test_estimate_json_says_what_each_image_became(capsys):
    assert main(["estimate", "google/vit-base-patch16-224", "--image-size", "1920x1080", "--batch-size", "2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["task"] == "image-cls"
    assert data["media_inputs"]["image_size"] == "1920x1080"
    assert data["media_inputs"]["inputs"] == {"pixel_values": [3, 224, 224]}
    assert data["setup"]["image_size"] == "1920x1080"


def test_16_bit_weights_without_autocast_is_one_line(capsys):
    """whisper-large-v3 loads in float16 (its config's torch_dtype); without autocast the float32 input_features
    meet float16 conv weights, which F.conv1d refuses on a GPU as on the CPU."""
    err = _one_line_error(["estimate", "openai/whisper-large-v3", "--batch-size", "1"], capsys)
    # no --gpu: compute capability 8.0 is assumed, which has bf16 mixed precision (memfit.sim.media_dtypes)
    assert "float16" in err and "--precision bf16" in err and len(err.splitlines()) == 1
    err = _one_line_error(["estimate", "openai/whisper-large-v3", "--batch-size", "1", "--gpu", "T4"], capsys)
    assert "float16" in err and "--precision fp16" in err and len(err.splitlines()) == 1  # a T4 (7.5): fp16


@pytest.mark.parametrize("hub_id", ["facebook/dinov2-base", "facebook/convnext-base-224",
                                    "microsoft/swin-tiny-patch4-window7-224"])
@pytest.mark.parametrize("size", ["224x224", "1920x1080"])
def test_bundled_image_classifiers_take_what_their_installed_processor_returns(hub_id, size):
    """DINOv2 (BitImageProcessor: shortest edge 256, crop 224), ConvNeXt (resize 224/0.875, crop 224) and Swin
    (ViT's processor: 224x224) each make a 3x224x224 image of any size; their task is image-cls by default."""
    width, height = map(int, size.split("x"))
    got = _inputs(model=hub_id, image_size=size, max_length=16)
    processor = _installed_processor(load_bundled_processor(hub_id), "image")
    expected = processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")
    assert got.tensors["pixel_values"][0] == tuple(expected["pixel_values"].shape[1:]) == (3, 224, 224)
    assert resolve(TrainSetup(model=hub_id)).task == "image-cls"
