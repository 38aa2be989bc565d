"""memfit.models.image_text: a vision-language model's example, made by its own processor.

The image-token counts are compared with what the installed transformers' image processor returns for the same
synthetic image, computed here at test time from its own output (`image_grid_thw`, divided by the merge of
`merge_size` x `merge_size` patches into one token as Qwen2_5_VLProcessor does), never a table; and with the
count the issue quotes from the shipped processor settings (a 1024x1024 image is about 1,370 tokens for
Qwen2.5-VL, 256 for Gemma 3). Gemma 3's count is the installed Gemma3ImageProcessor's crops of the image
(`pixel_values` rows: one with pan-and-scan off) times the `<image_soft_token>`s the installed Gemma3Processor
writes for one `<start_of_image>` (its `full_image_sequence`, from processor_config.json's image_seq_length).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models.build import default_task, resolve_config
from memfit.models.image_text import image_text_example
from memfit.models.processors import load_bundled_processor
from memfit.models.resolve import resolve
from memfit.train_setup import TrainSetup

#: The sizes the image tests run: square images and a 1920x1080 video frame.
SIZES = ["224x224", "448x448", "672x672", "1024x1024", "1344x1344", "1920x1080"]
QWEN = ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct")
GEMMA = ("google/gemma-3-4b-it", "google/gemma-3-12b-it")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _example(**fields):
    setup = resolve(TrainSetup(**fields))
    return image_text_example(setup, resolve_config(setup.model))


def _installed_qwen_grid(hub_id: str, width: int, height: int):
    """image_grid_thw of one black image from the installed transformers' Qwen2-VL image processor."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    data = load_bundled_processor(hub_id)
    processor = get_image_processor_class_from_name(data["image_processor_type"])(**data)
    out = processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")
    return out["image_grid_thw"], processor.merge_size


@pytest.mark.parametrize("hub_id", QWEN + GEMMA)
def test_default_task_is_image_text_to_text(hub_id):
    task, why = default_task(hub_id)
    assert task == "image-text-to-text" and "ForConditionalGeneration" in why


@pytest.mark.parametrize("size", SIZES)
def test_qwen_image_tokens_are_what_the_installed_processor_returns(size):
    width, height = map(int, size.split("x"))
    grid, merge = _installed_qwen_grid(QWEN[0], width, height)
    expected = int(grid.prod()) // merge**2
    example, summary, notes = _example(model=QWEN[0], image_size=size, max_length=32)
    assert summary["image_tokens_per_image"] == expected
    assert summary["image_grid_thw"] == grid.tolist()
    assert int((example["input_ids"] == 151655).sum()) == expected  # <|image_pad|>, the config's image_token_id
    assert example["pixel_values"].shape[0] == int(grid.prod())  # one row per patch
    # the sequence: the image tokens, the 32 text words, <|vision_start|> and <|vision_end|>
    assert summary["sequence_length"] == example["input_ids"].shape[1] == expected + 32 + 2
    assert f"becomes {expected} image tokens" in notes[-1]


def test_qwen_1024_image_is_the_count_the_issue_quotes():
    # smart_resize: 1024 rounds to 1036 = 37 x 28 pixels, 74 x 74 patches of 14, merged 2 x 2
    _, summary, _ = _example(model=QWEN[0], image_size="1024x1024", max_length=8)
    assert summary["image_tokens_per_image"] == 1369


def test_images_per_example_repeat_the_placeholder():
    one, s1, _ = _example(model=QWEN[1], image_size="448x448", max_length=8)
    two, s2, _ = _example(model=QWEN[1], image_size="448x448", max_length=8, images_per_example=2)
    assert s2["image_tokens"] == 2 * s1["image_tokens"] and s2["images_per_example"] == 2
    assert two["image_grid_thw"].shape[0] == 2 and two["pixel_values"].shape[0] == 2 * one["pixel_values"].shape[0]


def test_batch_is_what_the_processor_makes_of_that_many_examples():
    """The simulated batch (host_values.image_text_batch: B copies concatenated on the first axis) has the shapes
    the processor itself returns for B examples."""
    import transformers

    from memfit.models._processor_adapter import TEXT_WORD, processor_class, stub_tokenizer
    from memfit.models.image_text import FAMILIES
    from memfit.models.processors import load_processor
    from memfit.sim.host_values import image_text_batch

    setup = resolve(TrainSetup(model=QWEN[0], image_size="300x200", max_length=8))
    spec = resolve_config(setup.model)
    example, _, _ = image_text_example(setup, spec)
    family = FAMILIES["qwen2_5_vl"]
    image_processor, _ = load_processor(spec, "image")
    tokens = {t: getattr(spec.config, a) for t, a in family.tokens.items()}
    processor = processor_class(transformers.Qwen2_5_VLProcessor)(image_processor=image_processor,
                                                                  tokenizer=stub_tokenizer(tokens))
    text = family.placeholder + " " + " ".join([TEXT_WORD] * 8)
    image = np.zeros((200, 300, 3), dtype=np.uint8)
    three = processor(images=[[image]] * 3, text=[text] * 3, return_tensors="pt")
    batch = image_text_batch(example, 3)
    assert {k: tuple(v.shape) for k, v in three.items()} == {k: tuple(v.shape) for k, v in batch.items()
                                                              if k != "labels"}
    assert batch["labels"].shape == batch["input_ids"].shape


def test_an_image_the_processor_refuses_is_one_line(capsys):
    # smart_resize: "absolute aspect ratio must be smaller than 200"
    with pytest.raises(MemfitError, match=r"refuses a 5000x20 image: .*aspect ratio.*--image-size"):
        _example(model=QWEN[0], image_size="5000x20")
    assert main(["estimate", QWEN[0], "--image-size", "5000x20"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "5000x20" in err and "Traceback" not in err


def test_a_text_model_with_an_image_size_is_one_line(capsys):
    assert main(["estimate", "openai-community/gpt2", "--image-size", "1024x1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--image-size" in err and "takes no images" in err


def test_lora_defaults_to_the_language_model():
    _, _, notes = _example(model=QWEN[0], image_size="224x224", max_length=8, lora_r=16)
    assert any("q_proj, v_proj" in n for n in notes)


@pytest.mark.slow
def test_estimate_json_has_the_image_tokens(capsys):
    code = main(["estimate", QWEN[1], "--image-size", "448x448", "--max-length", "64", "--batch-size", "1",
                 "--precision", "bf16", "--lora-r", "8", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    media = report["media_inputs"]
    grid, merge = _installed_qwen_grid(QWEN[1], 448, 448)
    assert media["image_tokens_per_image"] == int(grid.prod()) // merge**2
    assert report["task"] == "image-text-to-text"


def _installed_gemma(hub_id: str, width: int, height: int):
    """(pixel_values, the `<image_soft_token>`s per `<start_of_image>`) of one black image from the installed
    transformers' Gemma 3 image processor and processor (the processor built on a tokenizer naming the tokens)."""
    import transformers
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    from memfit.models._processor_adapter import processor_class, stub_tokenizer
    from memfit.models.processors import bundled_processor_record

    data = load_bundled_processor(hub_id)
    image_processor = get_image_processor_class_from_name(data["image_processor_type"])(**data)
    pixels = image_processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")
    tokenizer = stub_tokenizer({"<start_of_image>": 255999, "<end_of_image>": 256000, "<image_soft_token>": 262144},
                               {"boi_token": "<start_of_image>", "boi_token_id": 255999, "eoi_token": "<end_of_image>",
                                "image_token": "<image_soft_token>", "image_token_id": 262144})
    processor = processor_class(transformers.Gemma3Processor)(image_processor=image_processor, tokenizer=tokenizer,
                                                              **bundled_processor_record(hub_id)["processor_config"])
    return pixels["pixel_values"], processor.full_image_sequence.count("<image_soft_token>")


@pytest.mark.parametrize("hub_id", GEMMA)
@pytest.mark.parametrize("size", SIZES)
def test_gemma_image_tokens_are_what_the_installed_processor_returns(hub_id, size):
    width, height = map(int, size.split("x"))
    pixels, per_crop = _installed_gemma(hub_id, width, height)
    expected = pixels.shape[0] * per_crop
    example, summary, notes = _example(model=hub_id, image_size=size, max_length=32)
    assert summary["image_tokens_per_image"] == expected == 256  # the count the issue quotes
    assert int((example["input_ids"] == 262144).sum()) == expected  # <image_soft_token>, image_token_index
    assert tuple(example["pixel_values"].shape) == tuple(pixels.shape) == (1, 3, 896, 896)
    assert int(example["token_type_ids"].sum()) == expected  # the image positions the mask attends both ways
    # the sequence: the image tokens, the 32 text words, and `\n\n<start_of_image>` ... `<end_of_image>\n\n`
    assert summary["sequence_length"] == example["input_ids"].shape[1] == expected + 32 + 4
    assert f"becomes {expected} image tokens" in notes[-1]


def test_gemma_images_per_example_repeat_the_image_sequence():
    _, s1, _ = _example(model=GEMMA[0], image_size="448x448", max_length=8)
    two, s2, _ = _example(model=GEMMA[0], image_size="448x448", max_length=8, images_per_example=2)
    assert s2["image_tokens"] == 2 * s1["image_tokens"] and two["pixel_values"].shape[0] == 2


# -- Gemma 3 pan-and-scan: the image and its crops, each one image sequence ------------------------------------

#: Square images (never cropped: under pan_and_scan_min_ratio_to_activate) and landscape / portrait ones.
PAN_AND_SCAN_SIZES = ["224x224", "896x896", "1920x1080", "1080x1920", "3000x1000"]


def _installed_gemma_pan_and_scan(hub_id: str, width: int, height: int):
    """(crops, image tokens, input_ids) of one black image with pan-and-scan, from the installed transformers: its
    Gemma3ImageProcessor's `num_crops` with Gemma3Processor's own crop settings (its `images_kwargs`), times the
    `<image_soft_token>`s of one image sequence; and the installed Gemma3Processor's input_ids for the image and 32
    text words."""
    import transformers
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    from memfit.models._processor_adapter import processor_class, stub_tokenizer
    from memfit.models.processors import bundled_processor_record

    data = load_bundled_processor(hub_id)
    image_processor = get_image_processor_class_from_name(data["image_processor_type"])(**data)
    settings = {k: v for k, v in transformers.Gemma3Processor.images_kwargs.items() if k.startswith("pan_and_scan")}
    image = np.zeros((height, width, 3), dtype=np.uint8)
    crops = int(image_processor(images=[image], do_pan_and_scan=True, return_tensors="pt", **settings)["num_crops"][0])
    tokenizer = stub_tokenizer({"<start_of_image>": 255999, "<end_of_image>": 256000, "<image_soft_token>": 262144},
                               {"boi_token": "<start_of_image>", "boi_token_id": 255999, "eoi_token": "<end_of_image>",
                                "image_token": "<image_soft_token>", "image_token_id": 262144}, literals=("\n\n",))
    processor = processor_class(transformers.Gemma3Processor)(image_processor=image_processor, tokenizer=tokenizer,
                                                              **bundled_processor_record(hub_id)["processor_config"])
    per_crop = processor.full_image_sequence.count("<image_soft_token>")
    out = processor(images=[[image]], text=["<start_of_image> " + " ".join(["a"] * 32)], do_pan_and_scan=True,
                    return_tensors="pt")
    return crops, (1 + crops) * per_crop, out["input_ids"]


@pytest.mark.parametrize("size", PAN_AND_SCAN_SIZES)
def test_gemma_pan_and_scan_crops_are_what_the_installed_processor_returns(size):
    width, height = map(int, size.split("x"))
    crops, expected, input_ids = _installed_gemma_pan_and_scan(GEMMA[0], width, height)
    example, summary, notes = _example(model=GEMMA[0], image_size=size, max_length=32, pan_and_scan=True)
    assert (crops > 0) == (width != height)  # the non-square sizes are cropped, so the crops are exercised
    assert summary["crops_per_image"] == crops and summary["pan_and_scan"] is True
    assert summary["image_tokens_per_image"] == expected == int((example["input_ids"] == 262144).sum())
    assert summary["image_tokens_per_crop"] * (1 + crops) == expected
    assert example["pixel_values"].shape[0] == 1 + crops  # the whole image and each crop, 896 x 896
    assert example["input_ids"].tolist() == input_ids.tolist()  # the crops' image sequences and the processor's words
    assert summary["sequence_length"] == example["input_ids"].shape[1]
    assert any(f"the whole image and {crops} crop" in n for n in notes)


def test_gemma_without_pan_and_scan_keeps_one_view_of_a_wide_image():
    _, summary, _ = _example(model=GEMMA[0], image_size="3000x1000", max_length=8)
    assert summary["image_tokens_per_image"] == 256 and "crops_per_image" not in summary


def test_pan_and_scan_on_another_model_is_one_line(capsys):
    with pytest.raises(MemfitError, match=r"--pan-and-scan.*Qwen2_5_VLProcessor.*drop --pan-and-scan"):
        _example(model=QWEN[1], image_size="448x448", pan_and_scan=True)
    for argv in (["estimate", "openai-community/gpt2", "--pan-and-scan"],
                 ["estimate", "google/paligemma2-3b-pt-224", "--pan-and-scan"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--pan-and-scan" in err and "Traceback" not in err


def test_do_pan_and_scan_in_an_args_file_is_the_field(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"do_pan_and_scan": True, "per_device_train_batch_size": 1}))
    assert TrainSetup.from_json(path, model=GEMMA[0]).pan_and_scan is True
    path.write_text(json.dumps({"do_pan_and_scan": True, "pan_and_scan": False}))
    with pytest.raises(MemfitError, match="both `do_pan_and_scan` and `pan_and_scan`"):
        TrainSetup.from_json(path, model=GEMMA[0])


def test_gemma_pan_and_scan_crops_each_image_of_an_example():
    one, s1, _ = _example(model=GEMMA[0], image_size="3000x1000", max_length=8, pan_and_scan=True)
    two, s2, _ = _example(model=GEMMA[0], image_size="3000x1000", max_length=8, pan_and_scan=True,
                          images_per_example=2)
    assert s2["crops_per_image"] == s1["crops_per_image"] > 0
    assert s2["image_tokens"] == 2 * s1["image_tokens"] and two["pixel_values"].shape[0] == 2 * one["pixel_values"].shape[0]
