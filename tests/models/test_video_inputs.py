"""memfit.models.video_inputs: one clip of `--video-frames` decoded frames, made into a vision-language model's
example by its own video processor.

The video-token counts are compared with what the installed transformers' video processor returns for the same
synthetic clip, computed here at test time from its own output (`video_grid_thw`, divided by the merge of
`merge_size` x `merge_size` patches into one token as Qwen2_5_VLProcessor does), never a table. A tiny
Qwen2.5-VL's step with a clip is simulated on FakeTensors and on real CPU tensors, event for event, as the image
steps are (tests/sim/test_vlm_exactness.py). transformers' video processors need torchvision: those tests skip
where it cannot be imported (PyPI's torchvision beside the CPU build of torch fails to load its operators), and
the refusal there is tested instead.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models.build import resolve_config
from memfit.models.processors import load_bundled_processor
from memfit.models.resolve import resolve
from memfit.models.video_inputs import video_text_example
from memfit.train_setup import TrainSetup

QWEN = ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct")
QWEN3 = "Qwen/Qwen3-VL-4B-Instruct"
SMOLVLM = ("HuggingFaceTB/SmolVLM2-2.2B-Instruct", "HuggingFaceTB/SmolVLM2-500M-Video-Instruct")


def _torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


TORCHVISION = _torchvision_imports()
needs_torchvision = pytest.mark.skipif(not TORCHVISION, reason="transformers' video processors need torchvision, "
                                                               "which cannot be imported here")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _example(**fields):
    setup = resolve(TrainSetup(**fields))
    return video_text_example(setup, resolve_config(setup.model))


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_a_model_without_video_is_one_line_naming_those_with(capsys):
    err = _one_line_error(capsys, ["estimate", "llava-hf/llava-1.5-7b-hf", "--video-frames", "8"])
    assert "takes no --video-frames" in err and all(hub_id in err for hub_id in QWEN)


def test_video_frames_in_an_args_file_is_the_same_setting(capsys, tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"video_frames": 8, "per_device_train_batch_size": 1}))
    err = _one_line_error(capsys, ["estimate", "llava-hf/llava-1.5-7b-hf", "--args", str(path)])
    assert "takes no --video-frames" in err and QWEN[0] in err


def test_a_text_model_with_video_frames_is_one_line(capsys):
    err = _one_line_error(capsys, ["estimate", "openai-community/gpt2", "--video-frames", "8"])
    assert "--video-frames" in err and "takes no video" in err


@pytest.mark.parametrize("value", [0, -3])
def test_video_frames_must_be_positive(value):
    with pytest.raises(MemfitError, match=rf"`video_frames` must be a positive integer; got `{value}`"):
        TrainSetup(model=QWEN[0], video_frames=value)


@pytest.mark.skipif(TORCHVISION, reason="torchvision imports here")
def test_without_torchvision_a_clip_is_one_line(capsys):
    err = _one_line_error(capsys, ["estimate", QWEN[0], "--video-frames", "8"])
    assert "torchvision" in err and "video processor" in err


def _installed_qwen_video(hub_id: str, frames: int, width: int, height: int):
    """video_grid_thw of one black clip from the installed transformers' Qwen2-VL video processor, built from the
    bundled preprocessor config, and the processor (its merge_size, temporal_patch_size)."""
    import transformers

    data = {k: v for k, v in load_bundled_processor(hub_id).items()
            if not k.endswith("_type") and k != "processor_class"}
    processor = transformers.Qwen2VLVideoProcessor(**data)
    out = processor(videos=[np.zeros((frames, height, width, 3), dtype=np.uint8)], return_tensors="pt",
                    do_sample_frames=False)
    return out["video_grid_thw"], processor


@needs_torchvision
@pytest.mark.parametrize(("frames", "size"), [(2, "448x448"), (8, "640x360"), (16, "480x270"), (5, "320x240")])
def test_qwen_video_tokens_are_what_the_installed_processor_returns(frames, size):
    width, height = map(int, size.split("x"))
    grid, processor = _installed_qwen_video(QWEN[0], frames, width, height)
    expected = int(grid.prod()) // processor.merge_size**2
    example, summary, notes = _example(model=QWEN[0], image_size=size, max_length=16, video_frames=frames)
    assert summary["video_tokens_per_clip"] == expected > 0
    assert summary["video_grid_thw"] == grid.tolist()
    assert int((example["input_ids"] == 151656).sum()) == expected  # <|video_pad|>, the config's video_token_id
    assert example["pixel_values_videos"].shape[0] == int(grid.prod())  # one row per patch
    # the sequence: the video tokens, the 16 text words, <|vision_start|> and <|vision_end|>
    assert summary["sequence_length"] == example["input_ids"].shape[1] == expected + 16 + 2
    assert summary["frames_processed"] == int(grid[0, 0]) * processor.temporal_patch_size
    assert f"becomes {expected} video tokens" in notes[-1]


@needs_torchvision
def test_an_odd_frame_count_says_what_it_becomes():
    """5 frames are 3 temporal patches of 2: the processor repeats the last frame; the note says so."""
    _, summary, notes = _example(model=QWEN[1], image_size="448x448", max_length=8, video_frames=5)
    grid, processor = _installed_qwen_video(QWEN[1], 5, 448, 448)
    made = int(grid[0, 0]) * processor.temporal_patch_size
    assert made != 5 and summary["frames_processed"] == made
    assert any(n.startswith(f"5 frames become {made}") for n in notes)
    _, even, even_notes = _example(model=QWEN[1], image_size="448x448", max_length=8, video_frames=made)
    assert even["video_tokens_per_clip"] == summary["video_tokens_per_clip"]
    assert not any("frames become" in n for n in even_notes)


def _installed_smolvlm_frames(hub_id: str, frames: int, width: int, height: int) -> int:
    """Frames (images) the installed transformers' SmolVLM video processor, built from the bundled preprocessor
    config, makes of one black clip."""
    import transformers

    data = {k: v for k, v in load_bundled_processor(hub_id).items()
            if not k.endswith("_type") and k != "processor_class"}
    out = transformers.SmolVLMVideoProcessor(**data)(videos=[np.zeros((frames, height, width, 3), dtype=np.uint8)],
                                                     return_tensors="pt", do_sample_frames=False)
    return int(out["pixel_values"].shape[1])


@needs_torchvision
@pytest.mark.parametrize(("hub_id", "frames", "size"), [(SMOLVLM[0], 16, "640x360"), (SMOLVLM[1], 8, "1280x720"),
                                                        (SMOLVLM[0], 3, "300x300")])
def test_smolvlm_video_tokens_are_what_the_installed_processor_returns(hub_id, frames, size):
    """Each frame the installed video processor makes is one image of image_seq_len `<image>` tokens (the bundled
    processor_config.json); the per-frame text is said in the note to be counted one token a word."""
    from memfit.models.processors import bundled_processor_record

    width, height = map(int, size.split("x"))
    made = _installed_smolvlm_frames(hub_id, frames, width, height)
    expected = made * bundled_processor_record(hub_id)["processor_config"]["image_seq_len"]
    example, summary, notes = _example(model=hub_id, image_size=size, max_length=16, video_frames=frames)
    assert summary["video_tokens_per_clip"] == expected > 0
    assert example["pixel_values"].shape[1] == made
    assert "one token a word here" in notes[-1]


@needs_torchvision
def test_smolvlm_more_frames_than_it_samples_is_one_line(capsys):
    err = _one_line_error(capsys, ["estimate", SMOLVLM[0], "--video-frames", "65", "--image-size", "320x240"])
    assert "at most 64 frames" in err and "--video-frames 64" in err


@needs_torchvision
def test_images_per_example_with_a_clip_is_one_line():
    with pytest.raises(MemfitError, match="one clip and no image"):
        _example(model=QWEN[0], image_size="448x448", video_frames=4, images_per_example=2)


@pytest.mark.slow
@needs_torchvision
def test_fake_trace_with_a_clip_equals_real_cpu_run(tmp_path):
    """A tiny Qwen2.5-VL (helpers.tiny_qwen2_5_vl_dir) saved with its video processor settings: the step on a clip
    of 4 frames, on FakeTensors, allocates what the same step on real CPU tensors does, event for event."""
    import transformers
    from helpers import real_and_fake, tiny_qwen2_5_vl_dir

    from memfit.peaks import peaks

    folder = tiny_qwen2_5_vl_dir(tmp_path, text_layers=2, vision_depth=2)
    transformers.Qwen2VLVideoProcessor(min_pixels=3136, max_pixels=200704).save_pretrained(folder)
    setup = TrainSetup(model=folder, image_size="100x80", video_frames=4, max_length=16,
                       per_device_train_batch_size=2)
    real, fake = real_and_fake(setup, real_masks_like_fake=False)
    assert real.media_inputs == fake.media_inputs
    assert fake.media_inputs["video_tokens_per_clip"] > 0 and "video_grid_thw" in fake.media_inputs
    assert peaks(real.trace) == peaks(fake.trace)


@needs_torchvision
def test_estimate_json_has_the_video_tokens(tmp_path, capsys):
    from helpers import tiny_qwen2_5_vl_dir

    folder = tiny_qwen2_5_vl_dir(tmp_path)
    assert main(["estimate", folder, "--video-frames", "6", "--image-size", "224x224", "--max-length", "32",
                 "--json"]) == 0
    media = json.loads(capsys.readouterr().out)["media_inputs"]
    assert media["kind"] == "video-text" and media["video_frames"] == 6
    assert media["video_tokens_per_clip"] > 0 and media["sequence_length"] == media["video_tokens_per_clip"] + 32 + 2


def _tiny_smolvlm_dir(folder) -> str:
    """A tiny SmolVLM2 (two language blocks of width 64, two vision blocks of width 32: 32-px frames of 8-px
    patches, pixel-shuffled 2 x 2, 4 tokens a frame) saved with its image and video processor settings."""
    import transformers
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    text = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=200, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
                pad_token_id=2)
    transformers.SmolVLMConfig(
        text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=32, patch_size=8),
        scale_factor=2, image_token_id=150, architectures=["SmolVLMForConditionalGeneration"]).save_pretrained(folder)
    SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(folder)
    transformers.SmolVLMVideoProcessor(max_image_size={"longest_edge": 32},  # each frame squared to one 32-px tile
                                       video_sampling={"fps": 1, "max_frames": 8, "video_size": {"longest_edge": 32}}
                                       ).save_pretrained(folder)
    with open(f"{folder}/processor_config.json", "w", encoding="utf-8") as f:
        json.dump({"image_seq_len": 4, "processor_class": "SmolVLMProcessor"}, f)
    return str(folder)


@pytest.mark.slow
@needs_torchvision
def test_smolvlm_fake_trace_with_a_clip_equals_real_cpu_run(tmp_path):
    """A tiny SmolVLM2's step on a clip of 3 frames: FakeTensors allocate what real CPU tensors do, event for
    event (SmolVLM2 reads `pixel_attention_mask` on the host, as for its image tiles)."""
    from helpers import real_and_fake

    from memfit.peaks import peaks

    setup = TrainSetup(model=_tiny_smolvlm_dir(tmp_path), image_size="100x80", video_frames=3, max_length=16,
                       per_device_train_batch_size=2)
    real, fake = real_and_fake(setup, real_masks_like_fake=False)
    assert real.media_inputs == fake.media_inputs
    assert fake.media_inputs["video_tokens_per_clip"] == 3 * 4
    assert peaks(real.trace) == peaks(fake.trace)


# -- Qwen3-VL: a `<t seconds>` timestamp before each temporal patch, from the clip's metadata -----------------------

@needs_torchvision
@pytest.mark.parametrize(("frames", "size"), [(2, "448x448"), (8, "640x360"), (5, "320x240")])
def test_qwen3_vl_video_tokens_are_what_the_installed_processor_returns(frames, size):
    """The installed Qwen3VLVideoProcessor, built from the bundled video preprocessor settings, on the same clip:
    its grid gives the video tokens; the processor writes one `<t seconds>` timestamp (two stub words) and
    `<|vision_start|>` / `<|vision_end|>` per temporal patch inside the template's own pair."""
    import transformers

    from memfit.models.processors import bundled_processor_record

    width, height = map(int, size.split("x"))
    video = bundled_processor_record(QWEN3)["video_preprocessor_config"]
    processor = transformers.Qwen3VLVideoProcessor(**{k: v for k, v in video.items() if not k.endswith("_type")})
    grid = processor(videos=[np.zeros((frames, height, width, 3), dtype=np.uint8)], return_tensors="pt",
                     do_sample_frames=False)["video_grid_thw"]
    expected = int(grid.prod()) // processor.merge_size**2
    example, summary, notes = _example(model=QWEN3, image_size=size, max_length=16, video_frames=frames)
    assert summary["video_tokens_per_clip"] == expected > 0 and summary["video_grid_thw"] == grid.tolist()
    patches = int(grid[0, 0])
    assert summary["sequence_length"] == expected + 16 + 2 + 4 * patches
    assert "bundled video preprocessor config" in notes[-1] and "<t seconds>" in notes[-1]


@pytest.mark.slow
@needs_torchvision
def test_qwen3_vl_fake_trace_with_a_clip_equals_real_cpu_run(tmp_path):
    """A tiny Qwen3-VL (helpers.tiny_qwen3_vl_dir, tests/sim/test_vlm_exactness.py's) saved with a video processor: the step on a clip of 4
    frames, on FakeTensors, allocates what the same step on real CPU tensors does, event for event."""
    import transformers
    from helpers import real_and_fake, tiny_qwen3_vl_dir

    from memfit.peaks import peaks

    tiny_qwen3_vl_dir(tmp_path)
    with open(tmp_path / "processor_config.json", "w", encoding="utf-8") as f:
        json.dump({"processor_class": "Qwen3VLProcessor"}, f)
    transformers.Qwen3VLVideoProcessor(size={"shortest_edge": 1024, "longest_edge": 200704}, patch_size=16,
                                       merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(tmp_path)
    setup = TrainSetup(model=str(tmp_path), image_size="100x80", video_frames=4, max_length=16,
                       per_device_train_batch_size=2)
    real, fake = real_and_fake(setup, real_masks_like_fake=False)
    assert real.media_inputs == fake.media_inputs and fake.media_inputs["video_tokens_per_clip"] > 0
    assert peaks(real.trace) == peaks(fake.trace)
