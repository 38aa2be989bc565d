"""memfit.diagnosis.model_part: an out-of-memory error inside a vision-language model's image path is said to be
there (the vision tower, the projector), from the frames of transformers' own modeling code."""

from __future__ import annotations

import json
from pathlib import Path

from memfit.cli import main
from memfit.diagnosis import diagnose
from memfit.diagnosis.model_part import model_part

DATA = Path(__file__).resolve().parents[1] / "data" / "oom"


def test_an_oom_inside_qwen2_5_vls_vision_blocks_is_the_vision_towers():
    d = diagnose(DATA / "qwen2_5_vl_vision_tower.log")
    assert d.phase == "forward" and d.model_part == "vision_tower"
    assert "get_image_features" in d.model_part_frame and "self.visual(" in d.model_part_frame
    # the image-path remedies come first, then the forward's own
    assert d.advice_ids[:2] == ("smaller_images", "freeze_vision_tower")
    assert d.remedies[:2] == ("smaller_images", "freeze_vision_tower")


def test_a_text_models_oom_names_no_part():
    assert diagnose(DATA / "trainer_eval.log").model_part == ""


def test_the_innermost_part_call_decides():
    tb = '''Traceback (most recent call last):
  File "/x/transformers/models/llava/modeling_llava.py", line 250, in get_image_features
    image_outputs = self.vision_tower(pixel_values, output_hidden_states=True, **kwargs)
  File "/x/transformers/models/llava/modeling_llava.py", line 262, in get_image_features
    image_features = self.multi_modal_projector(selected_image_feature)
  File "/x/torch/nn/modules/linear.py", line 134, in forward
    return F.linear(input, self.weight, self.bias)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.'''
    assert model_part(tb)[0] == "projector"
    # Whisper's encoder call is read in Whisper's file only (every seq2seq model has a `self.encoder(`)
    whisper = '''  File "/x/transformers/models/whisper/modeling_whisper.py", line 1100, in forward
    encoder_outputs = self.encoder(input_features, head_mask=head_mask)'''
    t5 = whisper.replace("whisper/modeling_whisper.py", "t5/modeling_t5.py")
    assert model_part(whisper)[0] == "audio_encoder" and model_part(t5)[0] == ""


def test_json_and_chinese_text(capsys):
    assert main(["diagnose", str(DATA / "qwen2_5_vl_vision_tower.log"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_part"] == "vision_tower" and "self.visual(" in out["model_part_frame"]
    assert main(["diagnose", str(DATA / "qwen2_5_vl_vision_tower.log"), "--lang", "zh"]) == 0
    assert "视觉编码器" in capsys.readouterr().out
