"""Vision-language models: the step on FakeTensors, with the processor's real host data (memfit.sim.host_values),
allocates what the same step on real CPU tensors does, event for event.

A tiny Qwen2.5-VL (two language blocks of width 64, two vision blocks of width 32, one of them full attention,
the other windowed) is saved with its image processor settings to a directory, as a user's checkpoint is, and
simulated twice (tests/helpers.real_and_fake): `fake=False` on real zero-filled CPU tensors, `fake=True` on
FakeTensors. Both runs get the same real `input_ids`, `attention_mask`, `mm_token_type_ids`, `pixel_values` and
`image_grid_thw` from Qwen2_5_VLProcessor; the real run reads its attention mask as a GPU run does (all ones: the
causal mask is skipped), which the fake run, holding the real mask, does too.
"""

from __future__ import annotations

import pytest
import transformers
from helpers import real_and_fake, trace_key

from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup


def _qwen2_5_vl(text_layers: int = 2, vision_depth: int = 2, full: tuple[int, ...] = (1,)):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=text_layers, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=200, max_position_embeddings=4096, bos_token_id=0,
                         eos_token_id=0, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=list(full), window_size=112, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153,
        architectures=["Qwen2_5_VLForConditionalGeneration"])
    # max_pixels 200704 (448 x 448): a 100x80 image is 6 x 8 patches of 14 px, two 8 x 8 windows of merged patches
    return config, Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=200704)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    config, processor = _qwen2_5_vl()
    config.save_pretrained(folder)
    processor.save_pretrained(folder)
    simulate(TrainSetup(model=str(folder), image_size="100x80", max_length=8, per_device_train_batch_size=1),
             fake=False, splice=False)  # first-run effects (lazily built tables) out of the compared runs
    return str(folder)


_SLOW = [pytest.mark.slow]
CASES = [
    (dict(), []),
    (dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    (dict(lora_r=4, trainer="sft", precision="bf16"), []),
    (dict(images_per_example=2, precision="bf16", attn_implementation="flash_attention_2",
          compute_capability=(8, 0)), _SLOW),
    (dict(precision="fp16", gradient_accumulation_steps=2, image_size="300x200"), _SLOW),
]


@pytest.mark.parametrize("fields", [pytest.param(f, marks=m, id=str(i)) for i, (f, m) in enumerate(CASES)])
def test_fake_trace_equals_real_cpu_run(qwen_dir, fields):
    setup = TrainSetup(model=qwen_dir, **{"image_size": "100x80", "max_length": 16, "per_device_train_batch_size": 2,
                                          **fields})
    real, fake = real_and_fake(setup, real_masks_like_fake=False)
    assert real.media_inputs == fake.media_inputs
    assert fake.media_inputs["image_tokens_per_image"] > 0
    assert peaks(real.trace) == peaks(fake.trace)


def test_without_host_values_the_fake_run_cannot_read_the_grid(qwen_dir, monkeypatch):
    """The mode is what makes the fake run possible: with it never active, the vision tower's `.tolist()` of a
    FakeTensor grid fails."""
    from memfit.sim import host_values

    monkeypatch.setattr(host_values.HostValues, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    monkeypatch.setattr(host_values, "image_text_batch", _fake_batch)
    with pytest.raises(Exception):
        simulate(TrainSetup(model=qwen_dir, image_size="100x80", max_length=8, per_device_train_batch_size=1),
                 fake=True, splice=False)


def _fake_batch(example, batch):
    import torch

    out = {k: torch.cat([v] * batch) for k, v in example.items()}  # inside the fake mode: FakeTensors
    out["labels"] = out["input_ids"].clone()
    return out


@pytest.mark.slow
def test_splice_keeps_the_windowed_vision_stack_whole(tmp_path):
    """Eight language blocks are cut to five and spliced; the vision stack, whose full-attention blocks (3 and 7)
    run unlike the windowed ones, is simulated whole: the spliced trace equals the full one."""
    config, processor = _qwen2_5_vl(text_layers=8, vision_depth=8, full=(3, 7))
    config.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    setup = TrainSetup(model=str(tmp_path), image_size="300x200", max_length=16, per_device_train_batch_size=2,
                       precision="bf16")
    full = simulate(setup, splice=False)
    spliced = simulate(setup, splice=True)
    assert trace_key(spliced.trace) == trace_key(full.trace)


# -- Gemma 3: a SigLIP tower, a pooling projector, image tokens attending each other both ways -----------------


def _gemma3():
    """A tiny Gemma3ForConditionalGeneration: two language blocks of width 64 (one sliding, one full attention),
    two SigLIP blocks of width 32 on 56 x 56 images (4 x 4 patches of 14 px, pooled 2 x 2 into 4 image tokens),
    and its image processor resizing to 56 x 56."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config = transformers.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=4096,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=32),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=4, boi_token_index=250, eoi_token_index=251, image_token_index=262,
        architectures=["Gemma3ForConditionalGeneration"])
    return config, Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    import json

    folder = tmp_path_factory.mktemp("gemma3")
    config, processor = _gemma3()
    config.save_pretrained(folder)
    processor.save_pretrained(folder)
    # the processor's own settings, as the hub's processor_config.json holds them (256 there: mm_tokens_per_image)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 4,
                                                              "processor_class": "Gemma3Processor"}))
    simulate(TrainSetup(model=str(folder), image_size="100x80", max_length=8, per_device_train_batch_size=1),
             fake=False, splice=False)
    return str(folder)


GEMMA_CASES = [
    (dict(), []),
    (dict(lora_r=4, trainer="sft", precision="bf16"), []),
    (dict(precision="bf16", gradient_checkpointing=True, images_per_example=2), _SLOW),
]


@pytest.mark.parametrize("fields", [pytest.param(f, marks=m, id=str(i)) for i, (f, m) in enumerate(GEMMA_CASES)])
def test_gemma3_fake_trace_equals_real_cpu_run(gemma_dir, fields):
    """Includes the tower's backward through its post_layernorm, whose gradient the projector's transpose leaves
    transposed: the fake input gradient is laid out contiguous as the CUDA and CPU kernels lay it out
    (memfit.sim.layouts), so the fc2 `ViewBackward0` below it copies nothing, as on the real run."""
    setup = TrainSetup(model=gemma_dir, **{"image_size": "100x80", "max_length": 16, "per_device_train_batch_size": 2,
                                           **fields})
    real, fake = real_and_fake(setup, real_masks_like_fake=False)
    assert real.media_inputs == fake.media_inputs
    # the processor's count: image_seq_length <image_soft_token>s per image
    assert fake.media_inputs["image_tokens_per_image"] == 4
    assert peaks(real.trace) == peaks(fake.trace)


def test_gemma3_pan_and_scan_fake_trace_equals_real_cpu_run(gemma_dir):
    """Pan-and-scan: a 1200x400 image is the whole image and 3 crops of 400 x 400 (Gemma3Processor's crop
    settings: ratio 3 >= 1.2, crops of at least 256 px), each resized to 56 x 56 and 4 image tokens: the vision
    tower runs 4 views an image on both runs."""
    setup = TrainSetup(model=gemma_dir, image_size="1200x400", pan_and_scan=True, max_length=16,
                       per_device_train_batch_size=2)
    real, fake = real_and_fake(setup, real_masks_like_fake=False)
    assert real.media_inputs == fake.media_inputs
    assert fake.media_inputs["crops_per_image"] == 3 and fake.media_inputs["image_tokens_per_image"] == 4 * 4
    assert peaks(real.trace) == peaks(fake.trace)


def test_gemma3_pan_and_scan_report_and_json_say_the_crops(gemma_dir, capsys):
    import json

    from memfit.cli import main

    argv = ["estimate", gemma_dir, "--image-size", "1200x400", "--pan-and-scan", "--max-length", "16",
            "--batch-size", "1"]
    assert main([*argv, "--json"]) == 0
    media = json.loads(capsys.readouterr().out)["media_inputs"]
    assert (media["crops_per_image"], media["image_tokens_per_crop"], media["image_tokens_per_image"]) == (3, 4, 16)
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1200x400 image -> 1 + 3 pan-and-scan crops, 16 image tokens each" in out
