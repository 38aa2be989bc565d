"""LLaVA 1.5, LLaVA-NeXT, SmolVLM2, Llama 3.2 Vision (mllama), Qwen3-VL and PaliGemma 2: the step on FakeTensors, with the processor's real
host data (memfit.sim.host_values), allocates what the same step on real CPU tensors does, event for event.

Each tiny model (two language blocks of width 64, two vision blocks of width 32) is saved with its image processor
settings and its processor_config.json to a directory, as a user's checkpoint is, and simulated twice
(tests/helpers.real_and_fake): `fake=False` on real zero-filled CPU tensors, `fake=True` on FakeTensors. Both runs
get the same real `input_ids`, `attention_mask` and `pixel_values` (SmolVLM2: also `pixel_attention_mask`) from the
model's own processor class. LLaVA's CLIP tower sees every image at its one input size; SmolVLM2 reads its inputs
on the host (the padding tiles it drops, the patch mask and the per-tile position ids it builds from
`pixel_attention_mask`), and its tiles follow the image's shape. mllama's language model cross-attends to the
tiles through `cross_attention_mask`, which it reads with the `aspect_ratio_ids` / `aspect_ratio_mask` of each
image. Qwen3-VL adds its vision tower's deepstack features to the image positions of its first language blocks'
outputs, indexing them with the boolean mask of those positions (`hidden_states[visual_pos_masks, :]`).
LLaVA-NeXT's tiles follow the image's size (its anyres pinpoints), and the model reads `image_sizes` on the host
to unpad each image's features. PaliGemma's processor takes the answer as a suffix: its `token_type_ids` mark it, and the language model's mask
lets the image and the prefix attend both ways (`block_sequence_ids`, read from those ids).
"""

from __future__ import annotations

import json
import os

import pytest
import transformers
from helpers import real_and_fake, tiny_qwen3_vl_dir

from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup

_TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=200, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
             pad_token_id=2)


def _llava(folder):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    # a 28-px CLIP tower of 14-px patches: 2 x 2 patches and a CLS position; "default" drops the CLS: 4 tokens
    transformers.LlavaConfig(
        text_config=_TEXT,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        image_token_index=150, pad_token_id=151, vision_feature_layer=-2, vision_feature_select_strategy="default",
        architectures=["LlavaForConditionalGeneration"]).save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)
    return {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
            "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}


def _smolvlm(folder):
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    # 32-px tiles of 8-px patches, pixel-shuffled 2 x 2: 4 tokens a tile; an image is resized to a longest edge of
    # 64 and split into tiles of 32 (a 100x80 image: 2 x 2 tiles and the whole image)
    transformers.SmolVLMConfig(
        text_config=_TEXT,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        scale_factor=2, image_token_id=150, architectures=["SmolVLMForConditionalGeneration"]).save_pretrained(folder)
    SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(folder)
    return {"image_seq_len": 4, "processor_class": "SmolVLMProcessor"}


def _mllama(folder):
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    # 28-px tiles of 14-px patches (4 patches and a CLS position), up to 4 tiles an image; a self-attention block,
    # a cross-attention block, two more self-attention blocks
    transformers.MllamaConfig(
        text_config={**_TEXT, "model_type": "mllama_text_model", "num_hidden_layers": 4, "cross_attention_layers": [1]},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=2, image_size=28, patch_size=14, intermediate_layers_indices=[0],
                           vision_output_dim=64, max_num_tiles=4,
                           supported_aspect_ratios=[[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]),
        image_token_index=150, architectures=["MllamaForConditionalGeneration"]).save_pretrained(folder)
    MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=4).save_pretrained(folder)
    return {"processor_class": "MllamaProcessor"}


def _qwen3_vl(folder, *, text_layers: int = 2, vision_depth: int = 2, deepstack=(0,)):
    tiny_qwen3_vl_dir(folder, text_layers=text_layers, vision_depth=vision_depth, deepstack=deepstack)
    return {"processor_class": "Qwen3VLProcessor"}


def _paligemma(folder):
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    # PaliGemma 2: a Gemma 2 language model (soft-capped attention, sliding window) reading 28-px images of 14-px
    # patches, 4 image tokens (image_seq_length) an image; the prefix attends bidirectionally (token_type_ids 0)
    transformers.PaliGemmaConfig(
        text_config=dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                         vocab_size=200, max_position_embeddings=1024, sliding_window=16, bos_token_id=2,
                         eos_token_id=1, pad_token_id=0),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, vision_use_head=False),
        projection_dim=64, image_token_index=150, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        architectures=["PaliGemmaForConditionalGeneration"]).save_pretrained(folder)
    SiglipImageProcessorPil(size={"height": 28, "width": 28}, image_seq_length=4).save_pretrained(folder)
    return {"processor_class": "PaliGemmaProcessor"}


def _llava_next(folder):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    # LLaVA-NeXT anyres: a 28-px base view of 14-px patches and the tiles of the pinpoint resolution that fits the
    # image best (a 100x80 image: 56x56, 2 x 2 tiles), unpadded and with a newline feature per row (image_newline)
    pinpoints = [[28, 56], [56, 28], [56, 56]]
    transformers.LlavaNextConfig(
        text_config={**_TEXT, "model_type": "mistral"},
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        image_grid_pinpoints=pinpoints, image_token_index=150, pad_token_id=151, vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        architectures=["LlavaNextForConditionalGeneration"]).save_pretrained(folder)
    LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                               image_grid_pinpoints=pinpoints).save_pretrained(folder)
    return {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
            "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"}


MODELS = {"llava": _llava, "smolvlm": _smolvlm, "mllama": _mllama, "qwen3_vl": _qwen3_vl, "paligemma": _paligemma,
          "llava_next": _llava_next}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = {}
    for name, make in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        with open(os.path.join(folder, "processor_config.json"), "w", encoding="utf-8") as f:
            json.dump(make(folder), f)
        simulate(TrainSetup(model=str(folder), image_size="100x80", max_length=8, per_device_train_batch_size=1),
                 fake=False, splice=False)  # first-run effects (lazily built tables) out of the compared runs
        out[name] = str(folder)
    return out


_SLOW = [pytest.mark.slow]
CASES = [
    ("llava", dict(), []),
    ("llava", dict(lora_r=4, trainer="sft", precision="bf16"), []),
    ("llava", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("llava", dict(images_per_example=2, precision="bf16", attn_implementation="flash_attention_2",
                   compute_capability=(8, 0)), _SLOW),
    ("smolvlm", dict(), []),
    ("smolvlm", dict(lora_r=4, trainer="sft", precision="bf16"), []),
    ("smolvlm", dict(precision="fp16", gradient_accumulation_steps=2, image_size="300x60"), _SLOW),
    ("smolvlm", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("smolvlm", dict(images_per_example=2, precision="bf16", attn_implementation="flash_attention_2",
                     compute_capability=(8, 0)), _SLOW),
    ("mllama", dict(), []),
    ("mllama", dict(lora_r=4, trainer="sft", precision="bf16"), []),
    ("mllama", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("mllama", dict(images_per_example=2, precision="fp16", gradient_accumulation_steps=2, image_size="300x60"),
     _SLOW),
    ("qwen3_vl", dict(), []),
    ("qwen3_vl", dict(lora_r=4, trainer="sft", precision="bf16"), []),
    ("qwen3_vl", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("qwen3_vl", dict(images_per_example=2, precision="fp16", gradient_accumulation_steps=2, image_size="300x60"),
     _SLOW),
    ("llava_next", dict(), []),
    ("llava_next", dict(lora_r=4, trainer="sft", precision="bf16"), []),
    ("llava_next", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("llava_next", dict(images_per_example=2, precision="fp16", gradient_accumulation_steps=2, image_size="300x60"),
     _SLOW),
    ("paligemma", dict(target_length=6), []),
    ("paligemma", dict(lora_r=4, trainer="sft", precision="bf16", target_length=4), []),
    ("paligemma", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("paligemma", dict(precision="fp16", gradient_accumulation_steps=2, image_size="300x60", target_length=12),
     _SLOW),
]


@pytest.mark.parametrize(("name", "fields"), [pytest.param(n, f, marks=m, id=f"{n}-{i}")
                                              for i, (n, f, m) in enumerate(CASES)])
def test_fake_trace_equals_real_cpu_run(model_dirs, name, fields):
    setup = TrainSetup(model=model_dirs[name], **{"image_size": "100x80", "max_length": 16,
                                                  "per_device_train_batch_size": 2, **fields})
    real, fake = real_and_fake(setup, real_masks_like_fake=False)
    assert real.media_inputs == fake.media_inputs
    assert fake.media_inputs["image_tokens_per_image"] > 0
    assert peaks(real.trace) == peaks(fake.trace)


def test_smolvlm_tiles_follow_the_image_shape(model_dirs):
    """A 300x60 strip is resized to 64x13 and split into 2 x 1 tiles and the whole image: 3 tiles, not 5."""
    from memfit.sim.engine import simulate as run

    wide = run(TrainSetup(model=model_dirs["smolvlm"], image_size="300x60", max_length=8,
                          per_device_train_batch_size=1), fake=True, splice=False)
    square = run(TrainSetup(model=model_dirs["smolvlm"], image_size="100x80", max_length=8,
                            per_device_train_batch_size=1), fake=True, splice=False)
    assert wide.media_inputs["inputs"]["pixel_values"][1] < square.media_inputs["inputs"]["pixel_values"][1]
    assert wide.media_inputs["image_tokens_per_image"] < square.media_inputs["image_tokens_per_image"]


def _assert_spliced_is_full(folder, settings):
    """The model saved in `folder` with its processor settings: the spliced trace equals the full one."""
    from helpers import trace_key

    with open(os.path.join(folder, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump(settings, f)
    setup = TrainSetup(model=str(folder), image_size="100x80", max_length=16, per_device_train_batch_size=2,
                       precision="bf16")
    assert trace_key(simulate(setup, splice=True).trace) == trace_key(simulate(setup, splice=False).trace)


@pytest.mark.slow
def test_splice_keeps_the_llava_vision_tower_whole(tmp_path):
    """Eight language blocks are cut to five and spliced; LLaVA's CLIP tower, whose second-to-last hidden state
    (vision_feature_layer -2, an index against the full depth) feeds the projector, is simulated whole: the
    spliced trace equals the full one."""
    config = transformers.AutoConfig.for_model("llava", text_config={**_TEXT, "num_hidden_layers": 8},
                                               vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                                                                  intermediate_size=64, num_hidden_layers=8,
                                                                  num_attention_heads=2, image_size=28, patch_size=14,
                                                                  projection_dim=32),
                                               image_token_index=150, pad_token_id=151, vision_feature_layer=-2,
                                               vision_feature_select_strategy="default",
                                               architectures=["LlavaForConditionalGeneration"])
    settings = _llava(tmp_path)  # the processor settings; the config is replaced by the 8-block one
    config.save_pretrained(tmp_path)
    _assert_spliced_is_full(tmp_path, settings)


@pytest.mark.slow
def test_splice_keeps_the_mllama_vision_encoder_whole(tmp_path):
    """An 8-block mllama vision encoder whose hidden states 3 and 7 (intermediate_layers_indices) feed the
    projector is simulated whole: the spliced trace equals the full one."""
    settings = _mllama(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.vision_config.num_hidden_layers = 8
    config.vision_config.intermediate_layers_indices = [3, 7]
    config.vision_config.vision_output_dim = 32 * 3  # the last hidden state and the two selected
    config.save_pretrained(tmp_path)
    _assert_spliced_is_full(tmp_path, settings)


@pytest.mark.slow
def test_splice_keeps_the_qwen3_vl_stacks_whole(tmp_path):
    """Qwen3-VL with 8 vision blocks whose blocks 3 and 7 (deepstack_visual_indexes) are added to the image positions
    after the first two of 8 language blocks: both stacks are simulated whole, and the spliced trace equals the
    full one."""
    settings = _qwen3_vl(tmp_path, text_layers=8, vision_depth=8, deepstack=(3, 7))
    _assert_spliced_is_full(tmp_path, settings)


@pytest.mark.slow
def test_splice_keeps_the_llava_next_vision_tower_whole(tmp_path):
    """LLaVA-NeXT selects the CLIP tower's second-to-last hidden state too (vision_feature_layer -2), of the base
    view and of every anyres tile: with eight blocks in each stack, the spliced trace has the full one's events and
    its peaks. Their order differs at the end of the forward, where a few frees of the last language block come in
    another order: the same holds for a text-only Mistral of the same size (its language model), so the order is
    compared for LLaVA (a Llama language model) above, not here."""
    import collections

    from helpers import trace_key

    settings = _llava_next(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.text_config.num_hidden_layers = 8
    config.vision_config.num_hidden_layers = 8
    config.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump(settings, f)
    setup = TrainSetup(model=str(tmp_path), image_size="100x80", max_length=16, per_device_train_batch_size=2,
                       precision="bf16")
    spliced, full = simulate(setup, splice=True).trace, simulate(setup, splice=False).trace
    assert collections.Counter(trace_key(spliced)) == collections.Counter(trace_key(full))
    assert peaks(spliced) == peaks(full)
