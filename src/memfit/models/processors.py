"""The inputs of image and speech models, made by the model's own processor from a synthetic image or clip.

How many pixels, frames or samples a model sees is decided by its processor, not by the user's file: ViT's
`ViTImageProcessor` resizes any image to 224x224, DINOv2's `BitImageProcessor` resizes the shortest edge to 256
and crops 224, Whisper's `WhisperFeatureExtractor` pads every clip to its 30 s window (3000 mel frames, 1500
encoder positions). memfit runs that processor
(transformers', with the settings of the model's `preprocessor_config.json`) on a black image of
`TrainSetup.image_size` or a silent clip of `audio_seconds`, and the simulated batch has the shapes and dtypes
it returns. Nothing here is a formula of a processor: a new processor setting changes the batch as it changes
a real one.

Where the processor settings come from, first found: the bundled `preprocessor_config.json`
(`memfit/models/configs/processors/`, cited in configs/SOURCES.md); a local model directory's own; the hub
(when online or cached); else the processor class transformers maps the model type to, with its defaults
(said in the notes).

    memfit estimate openai/whisper-small --audio-seconds 30 --batch-size 8
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Iterator

import torch

from memfit.errors import MemfitError
from memfit.train_setup import AUDIO_TASKS, IMAGE_TASKS, TrainSetup

__all__ = ["MediaInputs", "media_inputs", "bundled_processor_ids", "load_bundled_processor", "bundled_processor_record",
           "load_processor", "quiet_transformers"]

_PACKAGE, _FOLDER = "memfit.models.configs", "processors"
_META_KEY = "_memfit"
#: Seconds of audio when `audio_seconds` is not given: Whisper's window (WhisperFeatureExtractor's default
#: `chunk_length=30`, transformers/models/whisper/feature_extraction_whisper.py), the clip every Whisper batch
#: is padded to.
DEFAULT_AUDIO_SECONDS = 30.0
#: ... and for CTC fine-tuning (wav2vec2, HuBERT): the longest clip transformers' run_speech_recognition_ctc.py
#: keeps (`max_duration_in_seconds`, default 20.0, examples/pytorch/speech-recognition).
DEFAULT_CTC_AUDIO_SECONDS = 20.0


@dataclass(frozen=True)
class MediaInputs:
    """What the processor made of one example: the batch tensors' per-example shapes and dtypes, and a summary."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Input name -> (shape of one example, dtype), as the processor returned them (the batch axis dropped)."""
    summary: dict[str, Any]
    """For the report and its JSON: the input given, the processor class, each tensor's shape, and the encoder
    positions of a clip where the model says how many its convolutions leave."""
    notes: list[str] = field(default_factory=list)
    example: dict[str, torch.Tensor] | None = None
    """The processor's real output for one example, for a model that reads input values on the host (a
    vision-language model: memfit.models.image_text); the batch is `per_device_train_batch_size` copies of it,
    concatenated on the first axis as the processor concatenates examples. None: the batch is made of `tensors`."""


# -- the processor's settings ----------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _bundled_files() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for entry in resources.files(_PACKAGE).joinpath(_FOLDER).iterdir():
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text(encoding="utf-8"))
            hub_id = (data.get(_META_KEY) or {}).get("hub_id") or entry.name[: -len(".json")].replace("--", "/")
            out[hub_id] = data
    return out


def bundled_processor_ids() -> list[str]:
    """Hub ids whose `preprocessor_config.json` memfit bundles."""
    return sorted(_bundled_files())


def bundled_processor_record(hub_id: str) -> dict[str, Any] | None:
    """The `_memfit` record of the bundled preprocessor config of `hub_id` (its source, and a vision-language
    model's `processor_config`: the settings of its `processor_config.json`), or None."""
    data = _bundled_files().get(hub_id)
    return None if data is None else dict(data.get(_META_KEY) or {})


def load_bundled_processor(hub_id: str) -> dict[str, Any] | None:
    """The bundled `preprocessor_config.json` of `hub_id` (without memfit's `_memfit` record), or None."""
    data = _bundled_files().get(hub_id)
    if data is None:
        return None
    return {k: v for k, v in data.items() if k != _META_KEY}


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Keep transformers' backend warnings ("requires torchvision ... falling back to the PIL backend") off the
    terminal: the report names the processor class that ran."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _class_named(name: str, kind: str) -> Any:
    import transformers

    if kind == "image":
        from memfit.models._processor_adapter import image_processor_class

        cls = image_processor_class(name)
    else:
        cls = getattr(transformers, name, None)
    if cls is None:
        raise MemfitError(f"the processor class `{name}` of the model's preprocessor config is not in transformers "
                          f"{transformers.__version__}; upgrade transformers")
    return cls


def load_processor(spec: Any, kind: str) -> tuple[Any, str]:
    """The image processor (`kind` "image") or feature extractor ("audio") of the model `spec`
    (memfit.models.build.ModelSpec), and where its settings came from (a phrase for the notes)."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    key = "image_processor_type" if kind == "image" else "feature_extractor_type"
    auto = AutoImageProcessor if kind == "image" else AutoFeatureExtractor
    with quiet_transformers():
        if spec.source == "bundled":
            from memfit.models.catalog import find_bundled

            hub_id = find_bundled(spec.name) or spec.name
            data = load_bundled_processor(hub_id)
            if data is not None:
                legacy = str(data.get("feature_extractor_type", ""))
                if kind == "image" and key not in data and legacy.endswith("FeatureExtractor"):
                    # a legacy serialisation: AutoImageProcessor.from_pretrained reads `ViTFeatureExtractor` as
                    # `ViTImageProcessor` (transformers/models/auto/image_processing_auto.py)
                    data = {**data, key: legacy.replace("FeatureExtractor", "ImageProcessor")}
                if key not in data:
                    raise MemfitError(f"the bundled preprocessor config of `{hub_id}` has no `{key}`: `{spec.name}` "
                                      f"takes no {'images' if kind == 'image' else 'audio'}")
                return _class_named(data[key], kind).from_dict(data), f"the bundled preprocessor config of `{hub_id}`"
        if spec.source in ("local", "hub"):
            where = spec.name if spec.source == "hub" else os.path.dirname(spec.name) if spec.name.endswith(".json") \
                else spec.name
            offline = spec.source == "local" or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
            try:
                return auto.from_pretrained(where, local_files_only=offline), f"the preprocessor config of `{where}`"
            except (OSError, ValueError, KeyError):  # no preprocessor_config.json there: the class's defaults
                pass
        config = spec.config
        if config is None:
            raise MemfitError(f"`{spec.name}` has no config, so memfit cannot tell which processor makes its inputs; "
                              "pass a model directory with its preprocessor_config.json")
        from transformers.models.auto import feature_extraction_auto, image_processing_auto

        mapping = image_processing_auto.IMAGE_PROCESSOR_MAPPING if kind == "image" \
            else feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING
        try:
            cls = mapping[type(config)]
        except KeyError as err:
            raise MemfitError(f"transformers maps no {'image processor' if kind == 'image' else 'feature extractor'} "
                              f"to model type `{config.model_type}`; pass a model directory with its "
                              "preprocessor_config.json") from err
        if isinstance(cls, dict):  # {"pil": ..., "torchvision": ...}: the backend that runs without torchvision
            cls = cls.get("pil") or next(iter(cls.values()))
        elif isinstance(cls, tuple):
            cls = next(c for c in cls if c is not None)
        kwargs = {}
        size = getattr(config, "image_size", None)
        if kind == "image" and isinstance(size, int):
            # the input size the model's position table was built for (ViT raises on any other without
            # `interpolate_pos_encoding`); the processor class's default is 224
            kwargs["size"] = {"height": size, "width": size}
        return cls(**kwargs), (f"`{cls.__name__}`'s defaults (no preprocessor config found for `{spec.name}`)"
                               + (f", resizing to the config's image_size {size}" if kwargs else ""))


# -- synthetic inputs through the processor --------------------------------------------------------------------


def media_inputs(setup: TrainSetup, spec: Any, model: Any = None) -> MediaInputs | None:
    """The per-example inputs the processor makes for `setup` (None for a text task).

    Args:
        setup: the resolved run (its task, image_size, audio_seconds, sampling_rate).
        spec: the model (memfit.models.build.ModelSpec).
        model: the built (meta) model: its `_get_feat_extract_output_lengths` gives the encoder positions of a
            clip (Whisper's convolutions), reported with the inputs.
    """
    if setup.task == "image-text-to-text":  # images and text: memfit.models.image_text.image_text_inputs
        return None
    if setup.task in IMAGE_TASKS:
        return _image_inputs(setup, spec)
    if setup.task in AUDIO_TASKS:
        return _audio_inputs(setup, spec, model)
    return None


def _image_inputs(setup: TrainSetup, spec: Any) -> MediaInputs:
    import numpy as np

    processor, source = load_processor(spec, "image")
    notes = []
    if setup.image_wh is None:
        width, height = _processor_size(processor)
        given = None
        notes.append(f"no --image-size: a {width}x{height} image, {type(processor).__name__}'s own size")
    else:
        (width, height), given = setup.image_wh, setup.image_size
    image = np.zeros((height, width, 3), dtype=np.uint8)  # HWC, as PIL images become arrays
    try:
        with quiet_transformers():
            out = processor(images=[image], return_tensors="pt", input_data_format="channels_last")
    except (ValueError, RuntimeError, TypeError) as err:
        raise MemfitError(f"{type(processor).__name__} refuses a {width}x{height} image: "
                          f"{str(err).splitlines()[0][:200]}; choose another --image-size") from err
    tensors = {name: (tuple(t.shape[1:]), t.dtype) for name, t in out.items() if isinstance(t, torch.Tensor)}
    shape = tensors["pixel_values"][0]
    summary = {"kind": "image", "image_size": f"{width}x{height}", "given": given,
               "processor": type(processor).__name__, "processor_settings": source,
               "inputs": {name: list(s) for name, (s, _) in tensors.items()}}
    notes.append(f"each {width}x{height} image becomes pixel_values {'x'.join(map(str, shape))} "
                 f"({type(processor).__name__}, settings from {source})")
    return MediaInputs(tensors, summary, notes)


def _processor_size(processor: Any) -> tuple[int, int]:
    """(width, height) of the processor's output: its `crop_size` when it crops, else its `size`."""
    size = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    size = size or getattr(processor, "size", None) or {}
    size = dict(size) if not isinstance(size, int) else {"height": size, "width": size}
    if "height" in size and "width" in size:
        return int(size["width"]), int(size["height"])
    edge = size.get("shortest_edge") or size.get("longest_edge")
    if edge:
        return int(edge), int(edge)
    raise MemfitError(f"{type(processor).__name__} states no output size; pass --image-size WxH")


def _audio_inputs(setup: TrainSetup, spec: Any, model: Any) -> MediaInputs:
    import numpy as np

    extractor, source = load_processor(spec, "audio")
    name = type(extractor).__name__
    rate = int(extractor.sampling_rate)
    notes = []
    if setup.sampling_rate is not None and setup.sampling_rate != rate:
        # what the feature extractor itself raises ("It is strongly recommended to pass the `sampling_rate` ...")
        raise MemfitError(f"{name} of `{spec.name}` takes audio sampled at {rate} Hz, not `{setup.sampling_rate}` Hz; "
                          f"resample the data (datasets' `cast_column(\"audio\", Audio(sampling_rate={rate}))`) and "
                          f"pass --sampling-rate {rate}")
    seconds = setup.audio_seconds
    if seconds is None:
        seconds = DEFAULT_CTC_AUDIO_SECONDS if setup.task == "ctc" else DEFAULT_AUDIO_SECONDS
        notes.append(f"no --audio-seconds: clips of {seconds:g} s assumed"
                     + (" (run_speech_recognition_ctc.py's `max_duration_in_seconds`)" if setup.task == "ctc" else ""))
    window_s = getattr(extractor, "chunk_length", None)  # Whisper: the 30 s the encoder takes (feature extractor)
    if setup.task == "speech-seq2seq" and isinstance(window_s, (int, float)) and seconds > window_s:
        raise MemfitError(f"`audio_seconds` {seconds:g} is longer than {spec.name}'s {window_s:g} s window "
                          f"({name} `chunk_length`): Trainer cuts longer clips; split the audio into clips of at most "
                          f"{window_s:g} s (or use --audio-seconds {window_s:g})")
    samples = int(round(seconds * rate))
    clip = np.zeros(samples, dtype=np.float32)
    kwargs = {}
    if getattr(extractor, "return_attention_mask", False):
        kwargs["return_attention_mask"] = True  # an extractor that makes a mask: the collator passes it on
    try:
        with quiet_transformers():
            out = extractor(clip, sampling_rate=rate, return_tensors="pt", **kwargs)
    except (ValueError, RuntimeError, TypeError) as err:
        raise MemfitError(f"{name} refuses a {seconds:g} s clip: {str(err).splitlines()[0][:200]}") from err
    tensors = {key: (tuple(t.shape[1:]), t.dtype) for key, t in out.items() if isinstance(t, torch.Tensor)}
    first = next(iter(tensors))
    summary = {"kind": "audio", "audio_seconds": seconds, "sampling_rate": rate, "samples": samples,
               "processor": name, "processor_settings": source,
               "inputs": {key: list(s) for key, (s, _) in tensors.items()}}
    positions = _encoder_positions(model, tensors[first][0][-1])
    if positions is not None:
        summary["encoder_positions"] = positions
    if setup.task == "ctc":
        summary["label_length"] = _ctc_label_length(setup, spec, positions, notes)
    what = f"{first} {'x'.join(map(str, tensors[first][0]))}"
    notes.append(f"each {seconds:g} s clip at {rate} Hz becomes {what}"
                 + (f", {positions} encoder positions" if positions is not None else "")
                 + f" ({name}, settings from {source})")
    return MediaInputs(tensors, summary, notes)


def _ctc_label_length(setup: TrainSetup, spec: Any, positions: int | None, notes: list[str]) -> int:
    """Characters of each CTC transcript: `target_length`, else `max_length` capped at the clip's encoder positions
    (CTC aligns one character or more to each position: a longer transcript has no alignment)."""
    if setup.target_length is not None:
        if positions is not None and setup.target_length > positions:
            raise MemfitError(f"`target_length` {setup.target_length} is longer than the {positions} positions "
                              f"{spec.name}'s encoder makes of a {setup.audio_seconds or DEFAULT_CTC_AUDIO_SECONDS:g} s "
                              f"clip: CTC needs a position per character; use --target-length {positions} or less, "
                              "or longer clips")
        return setup.target_length
    if positions is not None and setup.max_length > positions:
        notes.append(f"labels of {positions} characters: the clip's encoder positions (max_length "
                     f"{setup.max_length} is longer, and CTC needs a position per character); --target-length sets "
                     "another")
        return positions
    return setup.max_length


def _encoder_positions(model: Any, frames: int) -> int | None:
    """Positions the model's feature convolutions leave of `frames` input frames (samples for wav2vec2), from the
    model's own `_get_feat_extract_output_lengths` (Whisper's encoder: its stride-2 convolution; wav2vec2: its
    seven-layer convolution stack, 320 samples a position)."""
    for module in (model, getattr(model, "model", None), getattr(getattr(model, "model", None), "encoder", None)):
        fn = getattr(module, "_get_feat_extract_output_lengths", None)
        if fn is not None:
            return int(fn(torch.tensor(frames)))
    return None
