"""The vision tower's windows, counted as transformers' `get_vision_window_index` makes them, and the note memfit
prints when simulating them goes beyond the host memory it has measured (memfit.sim.vision_windows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import memfit
from memfit.sim.vision_windows import MEASURED_WINDOW_BLOCKS, vision_window_cost

_CONFIGS = Path(memfit.__file__).parent / "models" / "configs"


def _config(name: str):
    return transformers.Qwen2_5_VLConfig(**json.loads((_CONFIGS / f"{name}.json").read_text()))


def test_a_16_frame_1024_clip_at_batch_8_on_the_7b_is_noted():
    cost = vision_window_cost(_config("Qwen--Qwen2.5-VL-7B-Instruct"),
                              {"video_grid_thw": torch.tensor([[8, 74, 74]])}, 8, "sdpa")
    # 74 patches a side are 37 merged ones, 10 windows of 4 (the last one padded): 100 a frame, 8 frames, 8 examples
    assert (cost.windows, cost.windowed_blocks, cost.patches) == (6400, 28, 8 * 8 * 74 * 74)
    note = cost.note()
    assert note is not None and "6,400 windows in each of 28 blocks" in note and "GiB of host memory" in note


def test_what_was_measured_is_not_noted():
    """The 7B at one such clip, the largest run measured; the 3B at one 1792x1792 image (16 x 16 windows)."""
    clip = vision_window_cost(_config("Qwen--Qwen2.5-VL-7B-Instruct"),
                              {"video_grid_thw": torch.tensor([[8, 74, 74]])}, 1, "sdpa")
    image = vision_window_cost(_config("Qwen--Qwen2.5-VL-3B-Instruct"),
                               {"image_grid_thw": torch.tensor([[1, 128, 128]])}, 1, "sdpa")
    assert (clip.window_blocks, image.window_blocks) == (MEASURED_WINDOW_BLOCKS, 256 * 28) == (800 * 28, 7168)
    assert clip.note() is None and image.note() is None


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_runs_one_call_per_block(attn):
    assert vision_window_cost(_config("Qwen--Qwen2.5-VL-7B-Instruct"),
                              {"video_grid_thw": torch.tensor([[8, 74, 74]])}, 8, attn) is None


def test_a_tower_without_windows_has_none():
    """Qwen2-VL's vision tower attends over each image whole (its config has no `window_size`)."""
    assert vision_window_cost(transformers.Qwen2VLConfig(), {"image_grid_thw": torch.tensor([[1, 128, 128]])}, 1, "sdpa") is None


def test_the_simulation_says_it_on_stderr_and_in_its_notes(tmp_path, monkeypatch, capsys):
    """A tiny Qwen2.5-VL with the measured bound lowered to nothing: the note is printed before the simulation
    runs, once, and kept with the result."""
    from helpers import tiny_qwen2_5_vl_dir

    from memfit.sim import engine, vision_windows
    from memfit.sim.engine import simulate
    from memfit.train_setup import TrainSetup

    monkeypatch.setattr(vision_windows, "MEASURED_WINDOW_BLOCKS", 0)
    monkeypatch.setattr(engine, "_SAID", set())
    folder = tiny_qwen2_5_vl_dir(tmp_path, vision_depth=2)
    sim = simulate(TrainSetup(model=folder, image_size="100x80", max_length=8, per_device_train_batch_size=2),
                   splice=False)
    said = [line for line in capsys.readouterr().err.splitlines() if "vision tower attends" in line]
    # 100x80: 6 x 8 patches, 3 x 4 merged ones, one window of 4 x 4; two examples, one windowed block of two
    assert said == ["memfit: note: the vision tower attends in 2 windows in each of 1 blocks (96 patches): "
                    f"simulating them takes about {said[0].split('about ')[1]}"]
    assert said[0].removeprefix("memfit: note: ") in sim.notes
