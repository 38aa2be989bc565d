"""memfit.models.image_text for LLaVA 1.5, SmolVLM2, Llama 3.2 Vision and Qwen3-VL: each image's token count is
what the installed transformers' processor makes of it.

The expected counts are computed here at test time from the installed image processor's own output for the same
synthetic image, never a table: LLaVA 1.5's CLIPImageProcessor resizes and crops every image to 336x336, one
token per 14-pixel patch (the CLS position the vision tower adds is dropped by vision_feature_select_strategy
"default"); SmolVLM2's SmolVLMImageProcessor splits the image into `rows` x `cols` tiles of 512 px plus the whole
image, each tile `image_seq_len` tokens, so the count depends on the image's size and shape.
"""

from __future__ import annotations

import numpy as np
import pytest

from memfit.models.build import default_task, resolve_config
from memfit.models.catalog import load_bundled_config
from memfit.models.image_text import image_text_example
from memfit.models.processors import bundled_processor_record, load_bundled_processor
from memfit.models.resolve import resolve
from memfit.train_setup import TrainSetup

#: The sizes the image tests run: square images and a 1920x1080 video frame.
SIZES = ["224x224", "448x448", "672x672", "1024x1024", "1344x1344", "1920x1080"]
LLAVA = "llava-hf/llava-1.5-7b-hf"
SMOLVLM = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
SMOLVLM_22B = "HuggingFaceTB/SmolVLM2-2.2B-Instruct"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _example(**fields):
    setup = resolve(TrainSetup(**fields))
    return image_text_example(setup, resolve_config(setup.model))


def _installed(hub_id: str, width: int, height: int, **kwargs):
    """The installed transformers' image processor (the bundled settings) run on one black image."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    data = load_bundled_processor(hub_id)
    processor = get_image_processor_class_from_name(data["image_processor_type"])(**data)
    return processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt", **kwargs)


@pytest.mark.parametrize(("hub_id", "cls"), [(LLAVA, "LlavaForConditionalGeneration"),
                                             (SMOLVLM, "SmolVLMForConditionalGeneration"),
                                             (SMOLVLM_22B, "SmolVLMForConditionalGeneration")])
def test_default_task_is_image_text_to_text(hub_id, cls):
    task, why = default_task(hub_id)
    assert task == "image-text-to-text" and cls in why


@pytest.mark.parametrize("size", SIZES)
def test_llava_image_tokens_are_what_the_installed_processor_returns(size):
    width, height = map(int, size.split("x"))
    pixels = _installed(LLAVA, width, height)["pixel_values"]
    patch = bundled_processor_record(LLAVA)["processor_config"]["patch_size"]
    expected = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    example, summary, notes = _example(model=LLAVA, image_size=size, max_length=32)
    assert summary["image_tokens_per_image"] == expected
    assert int((example["input_ids"] == 32000).sum()) == expected  # <image>, the config's image_token_index
    assert tuple(example["pixel_values"].shape) == tuple(pixels.shape)
    assert summary["sequence_length"] == expected + 32  # the image tokens and the 32 text words
    assert f"becomes {expected} image tokens" in notes[-1]


def test_llava_tokens_are_the_features_its_vision_tower_makes():
    """576 at any size: CLIP ViT-L/14 at 336 px has 24 x 24 patches (config.vision_config), the features the model
    puts in place of the image tokens (it raises when the counts differ)."""
    vision = load_bundled_config(LLAVA).vision_config
    for size in ("224x224", "1920x1080"):
        _, summary, _ = _example(model=LLAVA, image_size=size, max_length=8)
        assert summary["image_tokens_per_image"] == (vision.image_size // vision.patch_size) ** 2 == 576


@pytest.mark.parametrize("hub_id", [SMOLVLM, SMOLVLM_22B])
@pytest.mark.parametrize("size", SIZES)
def test_smolvlm_image_tokens_are_what_the_installed_processor_returns(size, hub_id):
    width, height = map(int, size.split("x"))
    out = _installed(hub_id, width, height, return_row_col_info=True)
    rows, cols = out["rows"][0][0], out["cols"][0][0]
    tiles = rows * cols + 1 if rows else 1  # the split tiles and the whole image
    assert out["pixel_values"].shape[1] == tiles
    per_tile = bundled_processor_record(hub_id)["processor_config"]["image_seq_len"]
    example, summary, notes = _example(model=hub_id, image_size=size, max_length=32)
    assert summary["image_tokens_per_image"] == tiles * per_tile
    assert int((example["input_ids"] == 49190).sum()) == tiles * per_tile  # <image>, the config's image_token_id
    assert tuple(example["pixel_values"].shape) == tuple(out["pixel_values"].shape)
    assert f"becomes {tiles * per_tile} image tokens" in notes[-1]


@pytest.mark.parametrize("hub_id", [SMOLVLM, SMOLVLM_22B])
def test_smolvlm_tokens_are_the_features_of_a_tile(hub_id):
    """image_seq_len is what the model's connector makes of one tile: 500M: (512 / 16)^2 patches, pixel-shuffled by
    scale_factor 4 in each direction; 2.2B: (384 // 14)^2 = 729 patches shuffled by 3 (SmolVLMConnector); the
    processor's tile is the tower's input size."""
    config = load_bundled_config(hub_id)
    vision = config.vision_config
    per_tile = bundled_processor_record(hub_id)["processor_config"]["image_seq_len"]
    assert per_tile == (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    assert load_bundled_processor(hub_id)["max_image_size"]["longest_edge"] == vision.image_size


def test_smolvlm_22b_tiles_are_smaller_than_the_500m_ones():
    """The 2.2B model cuts a 1920x1080 frame into more, smaller (384-px) tiles of 81 tokens each."""
    _, small, _ = _example(model=SMOLVLM, image_size="1920x1080", max_length=8)
    big, large, _ = _example(model=SMOLVLM_22B, image_size="1920x1080", max_length=8)
    assert big["pixel_values"].shape[-1] == 384
    assert large["image_tokens_per_image"] % 81 == 0 and small["image_tokens_per_image"] % 64 == 0


def test_smolvlm_counts_depend_on_the_image_shape():
    _, square, _ = _example(model=SMOLVLM, image_size="1024x1024", max_length=8)
    _, frame, _ = _example(model=SMOLVLM, image_size="1920x1080", max_length=8)
    _, strip, _ = _example(model=SMOLVLM, image_size="2048x256", max_length=8)
    assert square["image_tokens_per_image"] > frame["image_tokens_per_image"] > strip["image_tokens_per_image"]


def test_smolvlm_images_per_example_repeat_the_tiles():
    one, s1, _ = _example(model=SMOLVLM, image_size="1920x1080", max_length=8)
    two, s2, _ = _example(model=SMOLVLM, image_size="1920x1080", max_length=8, images_per_example=2)
    assert s2["image_tokens"] == 2 * s1["image_tokens"]
    assert two["pixel_values"].shape[1] == 2 * one["pixel_values"].shape[1]


def test_smolvlm_without_num2words_is_one_line(monkeypatch):
    """SmolVLMProcessor refuses to be built without num2words; the error names the package and memfit's extra."""
    from transformers.models.smolvlm import processing_smolvlm

    from memfit.errors import MemfitError

    monkeypatch.setattr(processing_smolvlm, "num2words", None)
    with pytest.raises(MemfitError, match=r"SmolVLMProcessor cannot be built: .*num2words.*memfit\[vision\]") as err:
        _example(model=SMOLVLM, image_size="448x448", max_length=8)
    assert "\n" not in str(err.value)


MLLAMA = "meta-llama/Llama-3.2-11B-Vision-Instruct"


@pytest.mark.parametrize("size", SIZES)
def test_mllama_tiles_are_what_the_installed_processor_returns(size):
    """Llama 3.2 Vision: one `<|image|>` token an image, cross-attended to the tiles MllamaImageProcessor cuts it
    into (at most max_image_tiles of 560 px, as its aspect ratio fits), every image padded to max_image_tiles."""
    width, height = map(int, size.split("x"))
    out = _installed(MLLAMA, width, height)
    tiles = out["num_tiles"][0][0] if "num_tiles" in out else int(out["aspect_ratio_mask"].sum())
    example, summary, notes = _example(model=MLLAMA, image_size=size, max_length=32)
    assert summary["image_tiles"] == [tiles]
    assert int((example["input_ids"] == 128256).sum()) == summary["image_tokens_per_image"] == 1  # <|image|>
    assert tuple(example["pixel_values"].shape) == tuple(out["pixel_values"].shape)
    assert example["aspect_ratio_ids"].tolist() == out["aspect_ratio_ids"].tolist()
    assert tuple(example["cross_attention_mask"].shape) == (1, summary["sequence_length"], 1,
                                                            out["pixel_values"].shape[2])
    assert f"is {tiles} tile" in notes[-1] or f"is {tiles} tile" in notes[-2]


def test_mllama_tiles_follow_the_aspect_ratio():
    _, small, _ = _example(model=MLLAMA, image_size="224x224", max_length=8)
    _, square, _ = _example(model=MLLAMA, image_size="1024x1024", max_length=8)
    assert small["image_tiles"] == [1] and square["image_tiles"] == [4]


@pytest.mark.parametrize(("hub_id", "tower"), [(LLAVA, True), (SMOLVLM, True), (MLLAMA, True),
                                               ("Qwen/Qwen2.5-VL-3B-Instruct", False),
                                               ("llava-hf/llava-v1.6-mistral-7b-hf", True),
                                               ("google/paligemma2-3b-pt-224", True)])
def test_lora_note_says_where_peft_puts_the_adapters(hub_id, tower):
    """peft matches target_modules by name: q_proj / v_proj are in LLaVA's CLIP, SmolVLM's SigLIP and mllama's
    vision encoder too, not in Qwen2.5-VL's tower (qkv / proj). The note says which, and peft agrees on a small
    build of the same config."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from memfit.models.peft_methods import VLM_LORA_TARGETS

    _, _, notes = _example(model=hub_id, image_size="224x224", max_length=8, lora_r=16)
    assert ("vision tower's q_proj, v_proj" in notes[-1]) is tower
    config = load_bundled_config(hub_id)
    for sub in (config.get_text_config(), config.vision_config):  # two blocks each: the names, not the sizes
        for key in ("num_hidden_layers", "depth"):
            if isinstance(getattr(sub, key, None), int):
                setattr(sub, key, 2)
    if hasattr(config.vision_config, "num_global_layers"):
        config.vision_config.num_global_layers = 1
        config.vision_config.intermediate_layers_indices = [0]
        config.vision_config.vision_output_dim = 2 * config.vision_config.hidden_size
        config.get_text_config().cross_attention_layers = [1]
    if hasattr(config.vision_config, "fullatt_block_indexes"):
        config.vision_config.fullatt_block_indexes = [1]
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=VLM_LORA_TARGETS))
    in_tower = any("lora_A" in name and ("vision" in name or "visual" in name)
                   for name, _ in peft_model.named_parameters())
    assert in_tower is tower


QWEN3_VL = "Qwen/Qwen3-VL-4B-Instruct"


def _installed_auto(hub_id: str, tmp_path, width: int, height: int):
    """What the installed transformers' AutoImageProcessor, loading the bundled preprocessor_config.json as it
    loads a hub snapshot, makes of one black image (Qwen3-VL names the legacy `Qwen2VLImageProcessorFast`)."""
    import json

    import transformers

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(load_bundled_processor(hub_id)))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    return processor, processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")


def test_qwen3_vl_default_task_is_image_text_to_text():
    task, why = default_task(QWEN3_VL)
    assert task == "image-text-to-text" and "Qwen3VLForConditionalGeneration" in why


@pytest.mark.parametrize("size", SIZES)
def test_qwen3_vl_image_tokens_are_what_the_installed_processor_returns(size, tmp_path):
    """Qwen3-VL: smart_resize to multiples of 32 pixels (patch 16, merge 2), one `<|image_pad|>` per 2x2 patches
    of image_grid_thw (Qwen3VLProcessor `replace_image_token`)."""
    width, height = map(int, size.split("x"))
    processor, out = _installed_auto(QWEN3_VL, tmp_path, width, height)
    grid = out["image_grid_thw"]
    expected = int(grid.prod()) // processor.merge_size**2
    example, summary, notes = _example(model=QWEN3_VL, image_size=size, max_length=32)
    assert summary["image_tokens_per_image"] == expected
    assert summary["image_grid_thw"] == grid.tolist()
    assert int((example["input_ids"] == 151655).sum()) == expected  # <|image_pad|>, the config's image_token_id
    assert tuple(example["pixel_values"].shape) == tuple(out["pixel_values"].shape)  # one row per patch
    # the image tokens, the 32 text words, <|vision_start|> and <|vision_end|>
    assert summary["sequence_length"] == example["input_ids"].shape[1] == expected + 32 + 2
    assert f"becomes {expected} image tokens" in notes[-1]


def test_qwen3_vl_patches_are_what_its_vision_tower_embeds():
    """A pixel_values row is one patch of the tower's Conv3d: in_channels x temporal_patch_size x patch_size^2."""
    vision = load_bundled_config(QWEN3_VL).vision_config
    example, _, _ = _example(model=QWEN3_VL, image_size="448x448", max_length=8)
    assert example["pixel_values"].shape[-1] == vision.in_channels * vision.temporal_patch_size * vision.patch_size**2


def test_qwen3_vl_weights_load_in_the_checkpoints_dtype():
    """Its config names no top-level dtype, its text_config bfloat16 (the BF16 checkpoint's): from_pretrained's
    dtype "auto" reads the weights' dtype, so the meta model is bfloat16, not fp32."""
    import torch

    from memfit.models.build import build_meta_model

    config = load_bundled_config(QWEN3_VL)
    assert config.dtype is None and config.text_config.dtype == torch.bfloat16
    model = build_meta_model(TrainSetup(model=QWEN3_VL, max_length=16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


PALIGEMMA = "google/paligemma2-3b-pt-224"
PALIGEMMA_448 = "google/paligemma2-3b-pt-448"
PALIGEMMA_896 = "google/paligemma2-3b-pt-896"
PALIGEMMA_10B = "google/paligemma2-10b-pt-224"


@pytest.mark.parametrize("hub_id", [PALIGEMMA, PALIGEMMA_448, PALIGEMMA_896, PALIGEMMA_10B])
def test_paligemma_default_task_is_image_text_to_text(hub_id):
    task, why = default_task(hub_id)
    assert task == "image-text-to-text" and "PaliGemmaForConditionalGeneration" in why


@pytest.mark.parametrize(("hub_id", "tokens"), [(PALIGEMMA, 256), (PALIGEMMA_448, 1024), (PALIGEMMA_896, 4096)])
@pytest.mark.parametrize("size", SIZES)
def test_paligemma_image_tokens_are_what_the_installed_processor_returns(size, hub_id, tokens):
    """PaliGemma 2: SiglipImageProcessor resizes every image to the checkpoint's 224x224, 448x448 or 896x896 (no
    crop, no tiles) and PaliGemmaProcessor writes image_seq_length `<image>` tokens, one per 14-px patch the SigLIP
    tower embeds: 256 at 224, 1024 at 448, 4096 at 896, at any image size."""
    width, height = map(int, size.split("x"))
    pixels = _installed(hub_id, width, height)["pixel_values"]
    patch = load_bundled_config(hub_id).vision_config.patch_size
    expected = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    assert expected == load_bundled_processor(hub_id)["image_seq_length"] == tokens
    example, summary, notes = _example(model=hub_id, image_size=size, max_length=32, target_length=8)
    assert summary["image_tokens_per_image"] == expected
    assert int((example["input_ids"] == 257152).sum()) == expected  # <image>, the config's image_token_index
    assert tuple(example["pixel_values"].shape) == tuple(pixels.shape)
    # the image tokens, <bos>, the 32 prefix words, "\n", the 8 suffix words and <eos>
    assert summary["sequence_length"] == example["input_ids"].shape[1] == expected + 1 + 32 + 1 + 8 + 1
    assert f"becomes {expected} image tokens" in notes[-1]


def test_paligemma_suffix_is_the_labels_and_token_type_ids():
    """The processor marks the suffix and its <eos> with token_type_ids 1 and keeps them as the labels; the image,
    <bos>, the prefix and its "\\n" are token_type_ids 0 and labels -100 (processing_paligemma.py)."""
    example, summary, _ = _example(model=PALIGEMMA, image_size="448x448", max_length=20, target_length=5)
    types, labels, ids = example["token_type_ids"][0], example["labels"][0], example["input_ids"][0]
    assert int(types.sum()) == 5 + 1 and summary["suffix_tokens"] == 5
    assert types[-6:].tolist() == [1] * 6 and int(ids[-1]) == 1  # the suffix, then <eos> (the config's eos 1)
    assert labels[types == 1].tolist() == ids[types == 1].tolist()
    assert set(labels[types == 0].tolist()) == {-100}
    assert summary["text_tokens"] == 25


def test_paligemma_suffix_defaults_to_max_length():
    _, summary, notes = _example(model=PALIGEMMA, image_size="224x224", max_length=12)
    assert summary["suffix_tokens"] == 12 and summary["text_tokens"] == 24
    assert any("no --target-length: a suffix" in n and " 12 tokens" in n for n in notes)


def test_target_length_for_a_processor_without_a_suffix_is_one_line():
    from memfit.errors import MemfitError

    with pytest.raises(MemfitError, match=r"`target_length` 8 .*LlavaProcessor .*--max-length") as err:
        _example(model=LLAVA, image_size="224x224", max_length=8, target_length=8)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("hub_id", [PALIGEMMA, PALIGEMMA_448, PALIGEMMA_896, PALIGEMMA_10B])
def test_paligemma_tokens_are_the_features_its_vision_tower_makes(hub_id):
    """image_seq_length is what the SigLIP tower makes of one image at its input size: (size / 14)^2 patches, no
    CLS; the processor resizes to that size."""
    vision = load_bundled_config(hub_id).vision_config
    data = load_bundled_processor(hub_id)
    assert data["image_seq_length"] == (vision.image_size // vision.patch_size) ** 2
    assert data["size"] == {"height": vision.image_size, "width": vision.image_size}


def test_paligemma_448_and_896_differ_from_224_by_their_position_tables():
    """The three checkpoints share every weight but SigLIP's position embedding: (1024 - 256) x 1152 more at 448,
    (4096 - 1024) x 1152 more again at 896."""
    import torch
    import transformers

    counts = []
    for hub_id in (PALIGEMMA, PALIGEMMA_448, PALIGEMMA_896):
        with torch.device("meta"):
            model = transformers.PaliGemmaForConditionalGeneration(load_bundled_config(hub_id))
        counts.append(sum(p.numel() for p in model.parameters()))
    assert counts[1] - counts[0] == (1024 - 256) * 1152 and counts[2] - counts[1] == (4096 - 1024) * 1152


LLAVA_NEXT = "llava-hf/llava-v1.6-mistral-7b-hf"


def test_llava_next_default_task_is_image_text_to_text():
    task, why = default_task(LLAVA_NEXT)
    assert task == "image-text-to-text" and "LlavaNextForConditionalGeneration" in why


def _installed_llava_next_processor():
    """The installed transformers' LlavaNextProcessor with the bundled settings (its tokenizer is not needed for
    `_get_num_multimodal_tokens`, the count vLLM and transformers' own tests read)."""
    import transformers
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    data = load_bundled_processor(LLAVA_NEXT)
    image_processor = get_image_processor_class_from_name(data["image_processor_type"])(**data)
    processor = transformers.LlavaNextProcessor.__new__(transformers.LlavaNextProcessor)
    processor.image_processor = image_processor
    for key, value in bundled_processor_record(LLAVA_NEXT)["processor_config"].items():
        setattr(processor, key, value)
    return processor


@pytest.mark.parametrize("size", [*SIZES, "336x1008", "1100x808"])
def test_llava_next_image_tokens_are_what_the_installed_processor_returns(size):
    """LLaVA-NeXT anyres: the installed LlavaNextImageProcessor's base view and tiles (pixel_values), and the
    installed LlavaNextProcessor's own count for an image of that (height, width) (`_get_num_multimodal_tokens`)."""
    width, height = map(int, size.split("x"))
    pixels = _installed(LLAVA_NEXT, width, height)["pixel_values"]
    expected = _installed_llava_next_processor()._get_num_multimodal_tokens(
        image_sizes=[[height, width]])["num_image_tokens"][0]
    example, summary, notes = _example(model=LLAVA_NEXT, image_size=size, max_length=32)
    assert summary["image_tokens_per_image"] == expected
    assert int((example["input_ids"] == 32000).sum()) == expected  # <image>, the config's image_token_index
    assert tuple(example["pixel_values"].shape) == tuple(pixels.shape)
    assert example["image_sizes"].tolist() == [[height, width]]
    assert summary["sequence_length"] == expected + 32
    assert f"becomes {expected} image tokens" in notes[-1]


def test_llava_next_tiles_follow_the_image_size():
    """A 1100x808 photo is cut into the 672x672 pinpoint's 2 x 2 tiles and the base view (pixel_values 5 x 3 x 336 x
    336, as a public walk-through prints it for such an image); a tall 336x1008 strip into 1 x 3 tiles and the base
    view; the token counts differ with the shape."""
    wide, w, _ = _example(model=LLAVA_NEXT, image_size="1100x808", max_length=8)
    tall, t, _ = _example(model=LLAVA_NEXT, image_size="336x1008", max_length=8)
    assert tuple(wide["pixel_values"].shape) == (1, 5, 3, 336, 336)
    assert tuple(tall["pixel_values"].shape) == (1, 4, 3, 336, 336)
    assert w["image_tokens_per_image"] != t["image_tokens_per_image"]


def test_llava_next_images_per_example_repeat_the_views():
    one, s1, _ = _example(model=LLAVA_NEXT, image_size="1920x1080", max_length=8)
    two, s2, _ = _example(model=LLAVA_NEXT, image_size="1920x1080", max_length=8, images_per_example=2)
    assert s2["image_tokens"] == 2 * s1["image_tokens"]
    assert two["pixel_values"].shape[0] == 2 * one["pixel_values"].shape[0]


def test_paligemma_10b_is_the_3b_tower_with_gemma_2_9b():
    """The 10B checkpoint: the 3B's SigLIP tower (the same vision_config but its projection to the wider language
    model) in front of the language model of the bundled google/gemma-2-9b (its hidden, intermediate, layer and head
    sizes); its 256-token example is the 3B's at 224 px."""
    big, small, lm = (load_bundled_config(h) for h in (PALIGEMMA_10B, PALIGEMMA, "google/gemma-2-9b"))
    skip = {"projection_dim", "num_positions", "transformers_version", "_name_or_path", "dtype", "torch_dtype"}
    assert ({k: v for k, v in big.vision_config.to_dict().items() if k not in skip}
            == {k: v for k, v in small.vision_config.to_dict().items() if k not in skip})
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        assert getattr(big.text_config, key) == getattr(lm, key), key
    assert big.projection_dim == big.vision_config.projection_dim == lm.hidden_size
    _, s_big, _ = _example(model=PALIGEMMA_10B, image_size="640x480", max_length=16, target_length=4)
    _, s_small, _ = _example(model=PALIGEMMA, image_size="640x480", max_length=16, target_length=4)
    assert s_big["sequence_length"] == s_small["sequence_length"] and s_big["image_tokens_per_image"] == 256
