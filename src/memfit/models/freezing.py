"""Freezing the parts of an image or speech model people freeze, with the model's own methods where it has them.

* `freeze_feature_encoder`: a wav2vec2-style model's convolutional feature encoder, by the model's
  `freeze_feature_encoder()` (`Wav2Vec2FeatureEncoder._freeze_parameters`: its parameters' requires_grad off and its
  `_requires_grad` flag, which stops its forward from making the waveform require a gradient). transformers'
  run_speech_recognition_ctc.py calls it by default (`--freeze_feature_encoder`, true), as the CTC fine-tuning guide
  does: the convolutions over raw audio then save nothing for a backward.
* `freeze_encoder`: Whisper's whole audio encoder, by its `freeze_encoder()` (run_speech_recognition_seq2seq.py's
  `--freeze_encoder`).
* `freeze_vision_tower`: a vision-language model's image encoder, the module transformers' own
  `get_encoder(modality="image")` finds (`vision_tower`, `visual`, `vision_model`, ...); an image classifier's
  backbone (its `base_model`: all but the classification head, a linear probe).
* `freeze_projector`: a vision-language model's projector between the tower and the language model, by the names
  transformers' models give it (`PROJECTOR_NAMES`).

A frozen parameter gets no gradient and no optimizer state (Trainer's optimizer takes the parameters that require a
gradient, `Trainer.get_decay_parameter_names` / `create_optimizer`), which tests/models/test_freezing.py checks in
bytes.
"""

from __future__ import annotations

from torch import nn

from memfit.errors import MemfitError

__all__ = ["freeze_parts", "PROJECTOR_NAMES", "wants_frozen_feature_encoder", "vision_tower", "projector"]

#: Attribute names of the projector in transformers' vision-language models: `multi_modal_projector` (LLaVA, Gemma 3,
#: PaliGemma, Llama 3.2 Vision), `connector` (Idefics3, SmolVLM), `merger` inside Qwen2.5-VL's `visual`.
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "merger", "mm_projector")


def wants_frozen_feature_encoder(setup) -> bool:  # noqa: ANN001 (TrainSetup)
    """`freeze_feature_encoder`, None resolved: frozen for ctc, as transformers' CTC fine-tuning script does."""
    if setup.freeze_feature_encoder is None:
        return setup.task == "ctc"
    return bool(setup.freeze_feature_encoder)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def freeze_parts(model: nn.Module, setup) -> list[str]:  # noqa: ANN001 (TrainSetup)
    """Freeze what `setup` asks on `model` (in place); the notes that say what was frozen."""
    inner = _unwrap(model)
    name = type(inner).__name__
    notes: list[str] = []
    if wants_frozen_feature_encoder(setup):
        if not hasattr(inner, "freeze_feature_encoder"):
            if setup.freeze_feature_encoder:
                raise MemfitError(f"`freeze_feature_encoder` is set but {name} has no convolutional feature encoder "
                                  "(no `freeze_feature_encoder()`); drop --freeze-feature-encoder")
        else:
            inner.freeze_feature_encoder()
            if setup.freeze_feature_encoder is None:
                notes.append(f"the convolutional feature encoder is frozen ({name}.freeze_feature_encoder()), as "
                             "run_speech_recognition_ctc.py does by default; --no-freeze-feature-encoder trains it")
    if setup.freeze_encoder:
        if not hasattr(inner, "freeze_encoder"):
            raise MemfitError(f"`freeze_encoder` is set but {name} has no `freeze_encoder()` (Whisper has); "
                              "drop --freeze-encoder")
        inner.freeze_encoder()
    if setup.freeze_vision_tower:
        tower = vision_tower(inner)
        if tower is None:
            raise MemfitError(f"`freeze_vision_tower` is set but {name} has no vision tower; drop --freeze-vision-tower")
        tower.requires_grad_(False)
    if setup.freeze_projector:
        part = projector(inner)
        if part is None:
            raise MemfitError(f"`freeze_projector` is set but {name} has no projector (none of "
                              f"{', '.join(PROJECTOR_NAMES)}); drop --freeze-projector")
        part.requires_grad_(False)
    return notes


def vision_tower(model: nn.Module) -> nn.Module | None:
    """A vision-language model's image encoder, or an image classifier's backbone; None when it has neither."""
    if hasattr(model, "get_encoder"):
        try:
            tower = model.get_encoder(modality="image")
        except (TypeError, ValueError):  # a get_encoder without modalities
            tower = None
        if tower is not None and tower is not model and tower is not getattr(model, "base_model", None):
            return tower
    if _is_image_classifier(model):
        return model.base_model
    return None


def _is_image_classifier(model: nn.Module) -> bool:
    """An `*ForImageClassification` head over a backbone (`base_model` is not the model itself)."""
    return type(model).__name__.endswith("ForImageClassification") and getattr(model, "base_model", model) is not model


def projector(model: nn.Module) -> nn.Module | None:
    """A vision-language model's projector (the first module named as in `PROJECTOR_NAMES`), or None."""
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in PROJECTOR_NAMES:
            return module
    return None
