"""The inputs of a vision-language model for one video clip, made by the model's own video processor.

How many tokens a clip becomes is decided by the model's video processor and processor, not by memfit:
Qwen2.5-VL's `Qwen2VLVideoProcessor` resizes each frame as its image processor resizes an image (`smart_resize`
within `min_pixels` / `max_pixels`), groups `temporal_patch_size` frames into one temporal patch (repeating the
last frame when the count is not a multiple of it, `patchify`), and `Qwen2_5_VLProcessor` repeats
`<|video_pad|>` `video_grid_thw.prod() // merge_size**2` times (processing_qwen2_5_vl.py `replace_video_token`).
memfit builds that video processor (the class transformers' AutoVideoProcessor maps the model type to, with the
settings of the model's preprocessor config, which AutoVideoProcessor reads when a model ships no
`video_preprocessor_config.json`) and runs the processor on one example: `video_frames` decoded black frames of
`image_size` (a clip the data pipeline has already decoded and sampled: the processor samples no frames of it,
`do_sample_frames` off) and a prompt of `max_length` one-token words after the clip's placeholder, as the chat
template writes it. The example's tensors come back real, as an image example's do (memfit.models.image_text):
the model reads `video_grid_thw` and `second_per_grid_ts` on the host (its vision windows, its 3D positions).
Qwen3-VL's `Qwen3VLVideoProcessor` reads the model's own video preprocessor settings (bundled in the processor
config's `_memfit` record), and `Qwen3VLProcessor` writes a `<t seconds>` timestamp before each temporal patch from
the clip's metadata, which memfit gives as frames sampled at the video processor's `fps` (VIDEO_FAMILIES).
SmolVLM2's `SmolVLMVideoProcessor` squares each frame to one `max_image_size` tile, and `SmolVLMProcessor`
writes `image_seq_len` `<image>` tokens per frame between per-frame text (VIDEO_FAMILIES).

transformers' video processors are torchvision code (`BaseVideoProcessor` resizes with
torchvision.transforms.v2): without an importable torchvision a clip is refused in one line.

    memfit estimate Qwen/Qwen2.5-VL-7B-Instruct --video-frames 16 --image-size 640x360 --lora-r 16 --trainer sft
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import MemfitError

__all__ = ["VIDEO_FAMILIES", "VideoFamily", "video_text_example", "video_text_inputs", "video_model_ids",
           "load_video_processor"]


@dataclass(frozen=True)
class VideoFamily:
    """How memfit writes one clip for a model type (beside memfit.models.image_text.FAMILIES' image recipe)."""

    placeholder: str
    """What the model's chat template writes for one video in a user turn (the processor expands it)."""
    video_token_attr: str
    """The config attribute of the id of the tokens the video features replace (counted in `input_ids`)."""
    frame_text: str | None = None
    """Text the processor writes around each frame, which the stub tokenizer makes one token a word of (said in the
    notes: the model's own tokenizer may make more tokens of it); None: only special tokens."""
    metadata: bool = False
    """The processor writes the frames' timestamps from the clip's `video_metadata`: memfit passes the metadata of
    frames sampled at the video processor's own `fps` (frame i at i / fps seconds)."""


VIDEO_FAMILIES: dict[str, VideoFamily] = {
    # Qwen2.5-VL's chat template writes each video of a user turn as `<|vision_start|><|video_pad|><|vision_end|>`;
    # Qwen2_5_VLProcessor repeats `<|video_pad|>` video_grid_thw.prod() // merge_size**2 times
    # (processing_qwen2_5_vl.py `replace_video_token`) and adds `second_per_grid_ts` (temporal_patch_size / fps)
    "qwen2_5_vl": VideoFamily(placeholder="<|vision_start|><|video_pad|><|vision_end|>",
                              video_token_attr="video_token_id"),
    # SmolVLM2's chat template writes `<video>` for a video of a user turn; SmolVLMProcessor replaces it with
    # `You are provided the following series of {frame_count} frames from a {duration} [H:MM:SS] video.\n`, then
    # per frame `\nFrame from MM:SS:` + `<fake_token_around_image><global-img>` + `<image>` x image_seq_len +
    # `<fake_token_around_image>`, then `\n\n` (processing_smolvlm.py `replace_video_token`, DEFAULT_VIDEO_INTRO,
    # FRAME_TIMESTAMP_MESSAGE, DEFAULT_MEDIA_OUTTRO); each frame is one image of SmolVLMVideoProcessor's size
    "smolvlm": VideoFamily(placeholder="<video>", video_token_attr="image_token_id",
                           frame_text="an introduction and a `Frame from MM:SS:` line before each frame"),
    # Qwen3-VL's chat template writes a video as Qwen2.5-VL's; Qwen3VLProcessor writes, per temporal patch,
    # `<{t:.1f} seconds>` + `<|vision_start|>` + `<|video_pad|>` x (grid h x w // merge_size**2) + `<|vision_end|>`,
    # t the mean of the patch's frames' `frames_indices / fps` from the clip's metadata (processing_qwen3_vl.py
    # `replace_video_token`, `_calculate_timestamps`)
    "qwen3_vl": VideoFamily(placeholder="<|vision_start|><|video_pad|><|vision_end|>",
                            video_token_attr="video_token_id",
                            frame_text="a `<t seconds>` timestamp before each temporal patch", metadata=True),
}

#: Model types memfit makes no clip for yet, and why.
_NO_CLIP_YET: dict[str, str] = {}


def video_model_ids() -> list[str]:
    """The bundled models memfit runs a clip through: those whose bundled preprocessor config names the processor
    class of a model type in VIDEO_FAMILIES (its `processor_class`)."""
    from memfit.models.image_text import FAMILIES
    from memfit.models.processors import bundled_processor_ids, load_bundled_processor

    classes = {FAMILIES[model_type].processor for model_type in VIDEO_FAMILIES}
    return [hub_id for hub_id in bundled_processor_ids()
            if (load_bundled_processor(hub_id) or {}).get("processor_class") in classes]


def _refuse(spec: Any, why: str) -> MemfitError:
    return MemfitError(f"`{spec.name}` takes no --video-frames in memfit: {why}; the bundled models that do are "
                       f"{', '.join(video_model_ids())}")


def load_video_processor(spec: Any) -> tuple[Any, str]:
    """The video processor of the model `spec` (memfit.models.build.ModelSpec), and where its settings came
    from (a phrase for the notes). Raises MemfitError (one line) where transformers has none for the model type
    or torchvision, which every video processor runs on, cannot be imported."""
    import os

    import transformers
    from transformers.models.auto import video_processing_auto

    model_type = spec.config.model_type
    names = video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES.get(model_type)
    if names is None:
        raise _refuse(spec, f"transformers {transformers.__version__} has no video processor for model type "
                            f"`{model_type}`")
    try:
        import torchvision  # noqa: F401  (transformers' BaseVideoProcessor: torchvision.transforms.v2)
    except (ImportError, RuntimeError, OSError) as err:
        raise MemfitError(f"--video-frames runs the model's video processor, which transformers builds on torchvision "
                          f"(BaseVideoProcessor), and torchvision cannot be imported here ({str(err).splitlines()[0]}); "
                          "install the torchvision release built for your torch") from err
    name = names.get("torchvision") if isinstance(names, dict) else names
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        raise _refuse(spec, f"transformers {transformers.__version__} has no video processor class for model type "
                            f"`{model_type}`")
    from memfit.models.processors import load_bundled_processor, quiet_transformers

    with quiet_transformers():
        if spec.source == "bundled":
            from memfit.models.catalog import find_bundled

            hub_id = find_bundled(spec.name) or spec.name
            from memfit.models.processors import bundled_processor_record

            video = (bundled_processor_record(hub_id) or {}).get("video_preprocessor_config")
            if video is not None:  # the model's own video_preprocessor_config.json, which AutoVideoProcessor reads first
                settings = {k: v for k, v in video.items() if not k.endswith("_type") and k != "processor_class"}
                return cls(**settings), f"the bundled video preprocessor config of `{hub_id}`"
            data = load_bundled_processor(hub_id)
            if data is not None:
                # AutoVideoProcessor reads preprocessor_config.json where a model has no video_preprocessor_config
                # (video_processing_auto.py `get_video_processor_config`): the image processor's settings
                settings = {k: v for k, v in data.items() if not k.endswith("_type") and k != "processor_class"}
                return cls(**settings), f"the bundled preprocessor config of `{hub_id}`"
        if spec.source in ("local", "hub"):
            where = spec.name if spec.source == "hub" else os.path.dirname(spec.name) if spec.name.endswith(".json") \
                else spec.name
            offline = spec.source == "local" or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
            try:
                return (transformers.AutoVideoProcessor.from_pretrained(where, local_files_only=offline),
                        f"the (video) preprocessor config of `{where}`")
            except (OSError, ValueError, KeyError):  # none there: the class's defaults
                pass
        return cls(), f"`{name}`'s defaults (no preprocessor config found for `{spec.name}`)"


def video_text_example(setup: Any, spec: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """The processor's output for one example of one clip of `setup.video_frames` frames (real tensors), a
    summary for the report and its JSON, and notes (memfit.models.image_text.image_text_example's contract).

    Args:
        setup: the resolved run (video_frames, image_size: each frame's, max_length: the text's words).
        spec: the model (memfit.models.build.ModelSpec).
    """
    import numpy as np
    import transformers

    from memfit.models._processor_adapter import TEXT_WORD, processor_class, stub_tokenizer
    from memfit.models.image_text import DEFAULT_IMAGE_WH, FAMILIES, _config_id, _processor_settings
    from memfit.models.processors import load_processor, quiet_transformers

    model_type = getattr(spec.config, "model_type", "")
    video, family = VIDEO_FAMILIES.get(model_type), FAMILIES.get(model_type)
    if video is None or family is None:
        why = _NO_CLIP_YET.get(model_type, f"memfit has no video recipe for model type `{model_type}`")
        raise _refuse(spec, why)
    if setup.images_per_example != 1:
        raise MemfitError(f"an example of --video-frames holds one clip and no image; drop --images-per-example "
                          f"{setup.images_per_example} (or estimate the images without --video-frames)")
    video_processor, source = load_video_processor(spec)
    vp = type(video_processor).__name__
    # the most frames the processor's own sampling keeps of a clip: SmolVLMVideoProcessor's `num_frames`
    # (video_sampling's max_frames), Qwen2VLVideoProcessor's `max_frames` (its `sample_frames`)
    limit = getattr(video_processor, "num_frames", None) or getattr(video_processor, "max_frames", None)
    if isinstance(limit, int) and setup.video_frames > limit:
        raise MemfitError(f"{vp} of `{spec.name}` keeps at most {limit} frames of a clip when it samples one; "
                          f"`video_frames` {setup.video_frames} is more: use --video-frames {limit} or fewer")
    image_processor, _ = load_processor(spec, "image")
    notes = []
    if setup.image_wh is None:
        width, height = DEFAULT_IMAGE_WH
        notes.append(f"no --image-size: frames of {width}x{height} assumed")
    else:
        width, height = setup.image_wh
    frames = setup.video_frames
    tokens = {token: _config_id(spec.config, attr) for token, attr in family.tokens.items()}
    tokenizer = stub_tokenizer(tokens, literals=family.literals)
    with quiet_transformers():
        processor = processor_class(getattr(transformers, family.processor))(
            image_processor=image_processor, video_processor=video_processor, tokenizer=tokenizer,
            **_processor_settings(spec))
        text = video.placeholder + " " + " ".join([TEXT_WORD] * setup.max_length)
        clip = np.zeros((frames, height, width, 3), dtype=np.uint8)  # decoded frames, THWC
        try:
            extra = {}
            if video.metadata:  # frames sampled at the video processor's own rate
                from transformers.video_utils import VideoMetadata

                fps = float(getattr(video_processor, "fps", None) or 2)
                extra["video_metadata"] = [VideoMetadata(total_num_frames=frames, fps=fps,
                                                         frames_indices=list(range(frames)))]
            out = processor(videos=[clip], text=[text], return_tensors="pt", do_sample_frames=False, **extra)
        except (ValueError, RuntimeError, TypeError) as err:
            raise MemfitError(f"{family.processor} refuses a clip of {frames} frames of {width}x{height}: "
                              f"{str(err).splitlines()[0][:200]}; choose another --video-frames or --image-size") \
                from err
    example = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    video_tokens = int((example["input_ids"] == _config_id(spec.config, video.video_token_attr)).sum())
    length = int(example["input_ids"].shape[-1])
    summary = {"kind": "video-text", "image_size": f"{width}x{height}", "given": setup.image_size,
               "video_frames": frames, "video_tokens_per_clip": video_tokens, "text_tokens": setup.max_length,
               "sequence_length": length, "processor": f"{family.processor} ({vp})", "processor_settings": source,
               "inputs": {k: list(v.shape) for k, v in example.items()}}
    grid = example.get("video_grid_thw")
    if grid is not None:
        summary["video_grid_thw"] = grid.tolist()
        step = int(getattr(video_processor, "temporal_patch_size", 1) or 1)
        seen = int(grid[0, 0]) * step  # frames the vision tower reads: the processor's temporal patches
        summary["frames_processed"] = seen
        if seen != frames:
            patches = int(grid[0, 0])
            notes.append(f"{frames} frame{'s become' if frames > 1 else ' becomes'} {seen} ({patches} temporal "
                         f"patch{'es' if patches > 1 else ''} of {step} frames, {vp}'s temporal_patch_size: it "
                         "repeats the last frame to fill the last patch)")
    notes.append(f"each clip of {frames} frames of {width}x{height} becomes {video_tokens} video tokens "
                 f"({family.processor} with {vp}, settings from {source}); the sequence is {length} tokens: "
                 f"{video_tokens} video, {setup.max_length} text (--max-length), "
                 f"{length - video_tokens - setup.max_length} the template's video markers"
                 + (f" and {video.frame_text}, one token a word here (the model's own tokenizer may make more of it)"
                    if video.frame_text else ""))
    return example, summary, notes


def video_text_inputs(setup: Any, spec: Any) -> Any:
    """`video_text_example` as the simulator takes it: a memfit.models.processors.MediaInputs holding the real
    example (its `tensors` the example's shapes and dtypes)."""
    from memfit.models.processors import MediaInputs

    example, summary, notes = video_text_example(setup, spec)
    tensors = {name: (tuple(t.shape), t.dtype) for name, t in example.items()}
    return MediaInputs(tensors, summary, notes, example=example)
