"""The inputs of a vision-language model, made by the model's own processor from synthetic images and text.

How many tokens an image becomes is decided by the processor, not by memfit: Qwen2.5-VL's
`Qwen2VLImageProcessor` resizes to a multiple of 28 pixels within `min_pixels` / `max_pixels` (`smart_resize`)
and its processor inserts one `<|image_pad|>` per 2x2 patches of `image_grid_thw`. memfit builds the model's
processor class (transformers' `Qwen2_5_VLProcessor`, ...) from the bundled `preprocessor_config.json` and a
stub tokenizer that knows the model's special tokens (memfit.models._processor_adapter), and runs it on one
example: `images_per_example` black images of `image_size` and a prompt of `max_length` one-token words with
one image placeholder per image, written as the model's chat template writes it. The example's tensors come
back real: the model reads some of them on the host (Qwen2.5-VL's `image_grid_thw` sizes its vision tower's
windows and its 3D positions, the placeholder tokens in `input_ids` say where the image features go), so
the simulator keeps them real and runs what depends on them on real data (memfit.sim.host_values).

    memfit estimate Qwen/Qwen2.5-VL-7B-Instruct --image-size 1024x1024 --lora-r 16 --trainer sft
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import MemfitError

__all__ = ["FAMILIES", "ImageTextFamily", "image_text_example", "image_text_inputs", "DEFAULT_IMAGE_WH"]

#: The image size assumed without --image-size for a processor that resizes to no fixed size (Qwen2.5-VL keeps
#: the aspect and the pixel count within its bounds): the size the issue's examples quote.
DEFAULT_IMAGE_WH = (1024, 1024)


@dataclass(frozen=True)
class ImageTextFamily:
    """How memfit runs one model type's processor."""

    processor: str
    """transformers' processor class."""
    placeholder: str
    """What the model's chat template writes for one image in a user turn (the processor expands it)."""
    tokens: dict[str, str]
    """Special token -> the config attribute holding its id (the tokens the processor reads or writes)."""
    image_token_attr: str
    """The config attribute of the id of the tokens the image features replace (counted in `input_ids`)."""
    attributes: dict[str, str] | None = None
    """Tokenizer attributes the processor reads (Gemma 3's `tokenizer.boi_token`): name -> one of `tokens`; each
    also gets `<name>_id`."""
    literals: tuple[str, ...] = ()
    """Text the processor writes around the image tokens that the model's tokenizer makes one token of (Gemma 3's
    `\n\n`: one token, 108, of its 262,144-token vocabulary, whose ids 107 onwards are runs of newlines); the stub
    tokenizer gives each an id of its own, so the sequence has the length the real tokenizer gives it."""
    pan_and_scan: bool = False
    """Whether the processor takes `do_pan_and_scan` (Gemma3Processor: each image and its crops, TrainSetup.pan_and_scan)."""
    suffix: bool = False
    """Whether the processor takes the answer as a `suffix` beside the prompt (PaliGemma's prefix-LM: the suffix's
    positions are `token_type_ids` 1 and the only labels; the prefix attends bidirectionally)."""


#: What Qwen2.5-VL's and Qwen3-VL's chat templates and processors share: the placeholder of one image and the
#: special tokens
_QWEN_VL = dict(placeholder="<|vision_start|><|image_pad|><|vision_end|>",
                tokens={"<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id",
                        "<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id"},
                image_token_attr="image_token_id")

FAMILIES: dict[str, ImageTextFamily] = {
    # Qwen2.5-VL's chat template (tokenizer_config.json / chat_template.json): each image of a user turn is
    # `<|vision_start|><|image_pad|><|vision_end|>`; Qwen2_5_VLProcessor repeats `<|image_pad|>`
    # image_grid_thw.prod() // merge_size**2 times (processing_qwen2_5_vl.py `replace_image_token`).
    "qwen2_5_vl": ImageTextFamily(processor="Qwen2_5_VLProcessor", **_QWEN_VL),
    # Qwen3-VL's chat template writes each image of a user turn as Qwen2.5-VL's does,
    # `<|vision_start|><|image_pad|><|vision_end|>`; Qwen3VLProcessor repeats `<|image_pad|>`
    # image_grid_thw.prod() // merge_size**2 times (processing_qwen3_vl.py `replace_image_token`), the grid of
    # Qwen2VLImageProcessor's smart_resize to a multiple of patch_size x merge_size = 32 pixels within size's
    # shortest_edge / longest_edge pixel counts
    "qwen3_vl": ImageTextFamily(processor="Qwen3VLProcessor", **_QWEN_VL),
    # LLaVA 1.5's chat template (llava-hf chat_template.json): `USER: <image>\n... ASSISTANT:`; LlavaProcessor
    # repeats `<image>` (patch rows x patch columns of the cropped pixel_values) + num_additional_image_tokens
    # times, one fewer for vision_feature_select_strategy "default" (processing_llava.py `replace_image_token`)
    "llava": ImageTextFamily(
        processor="LlavaProcessor",
        placeholder="<image>",
        tokens={"<image>": "image_token_id"},
        image_token_attr="image_token_id",
    ),
    # LLaVA-NeXT (1.6)'s chat template (llava-hf chat_template.json): `[INST] <image>\n... [/INST]`; LlavaNextProcessor
    # repeats `<image>` as many times as the model's anyres features of the image: the base 336-px view's 24 x 24
    # patches, the tiles of the image_grid_pinpoints resolution select_best_resolution picks for the image's size with
    # the padding cut off, and one newline feature per row of them (processing_llava_next.py `_get_number_of_features`,
    # one fewer for vision_feature_select_strategy "default"); pixel_values are the base view and the tiles
    "llava_next": ImageTextFamily(
        processor="LlavaNextProcessor",
        placeholder="<image>",
        tokens={"<image>": "image_token_index"},
        image_token_attr="image_token_index",
    ),
    # SmolVLM2's chat template writes `<image>` for each image of a user turn; SmolVLMProcessor replaces it with
    # one `<fake_token_around_image><row_r_col_c>` + `<image>` x image_seq_len (processor_config.json) per tile of
    # SmolVLMImageProcessor's split (rows x cols of max_image_size, a "\n" after each row), then
    # `\n<fake_token_around_image><global-img>` + `<image>` x image_seq_len + `<fake_token_around_image>` for the
    # whole image (processing_smolvlm.py `_prompt_split_image`); the markers are the tokenizer's added tokens
    # (added_tokens.json), one token each, and so is each "\n" here (the stub does not merge newlines)
    "smolvlm": ImageTextFamily(
        processor="SmolVLMProcessor",
        placeholder="<image>",
        tokens={"<image>": "image_token_id"},
        image_token_attr="image_token_id",
        literals=("<fake_token_around_image>", "<global-img>", "\n",
                  *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))),
    ),
    # Llama 3.2 Vision's chat template writes `<|image|>` for each image of a user turn, one token the language
    # model cross-attends from (MllamaProcessor adds the tokenizer's bos_token, `build_string_from_input`, and
    # makes cross_attention_mask from the `<|image|>` positions); the image is MllamaImageProcessor's tiles
    "mllama": ImageTextFamily(
        processor="MllamaProcessor",
        placeholder="<|image|>",
        tokens={"<|image|>": "image_token_index", "<|begin_of_text|>": "bos_token_id"},
        image_token_attr="image_token_index",
        attributes={"bos_token": "<|begin_of_text|>"},
    ),
    # Gemma 3's chat template writes `<start_of_image>` for each image of a user turn; Gemma3Processor replaces it
    # with `\n\n<start_of_image>` + `<image_soft_token>` x image_seq_length (processor_config.json: 256) +
    # `<end_of_image>\n\n` (processing_gemma3.py `full_image_sequence`), reading the tokens from the tokenizer's
    # boi_token / image_token / eoi_token; each image is resized to 896x896 (Gemma3ImageProcessor). With
    # `do_pan_and_scan` (a call kwarg: the processor's own `images_kwargs` default, False, outranks the image
    # processor's setting, processing_utils.py `_merge_kwargs`) the image processor also cuts the image into crops
    # along its longer side (its `pan_and_scan`, with the processor's crop settings), each resized alike, and the
    # processor writes `Here is the original image <seq> and here are some crops to help you see better <seq> ...`
    # (`replace_image_token`), one image sequence per crop; the stub tokenizer makes each of those words one token.
    "gemma3": ImageTextFamily(
        processor="Gemma3Processor",
        placeholder="<start_of_image>",
        tokens={"<start_of_image>": "boi_token_index", "<end_of_image>": "eoi_token_index",
                "<image_soft_token>": "image_token_index"},
        image_token_attr="image_token_index",
        attributes={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        literals=("\n\n",),
        pan_and_scan=True,
    ),
    # PaliGemma (2) has no chat template: the prompt is `<image>` per image then the prefix; PaliGemmaProcessor
    # repeats `<image>` image_seq_length times (preprocessor_config.json: (image_size / 14)^2, 256 at 224 px),
    # writes the tokenizer's bos_token after the last one and "\n" after the prefix, and appends `suffix` +
    # eos_token as the pair sequence, whose positions are token_type_ids 1 and the labels; the prefix's are -100
    # (processing_paligemma.py `prepare_inputs_layout` / `__call__`); "\n" is one token of Gemma's vocabulary
    "paligemma": ImageTextFamily(
        processor="PaliGemmaProcessor",
        placeholder="<image>",
        tokens={"<image>": "image_token_index", "<bos>": "bos_token_id", "<eos>": "eos_token_id"},
        image_token_attr="image_token_index",
        attributes={"image_token": "<image>", "bos_token": "<bos>", "eos_token": "<eos>"},
        literals=("\n",),
        suffix=True,
    ),
}


def _config_id(config: Any, attr: str) -> int:
    for c in (config, getattr(config, "text_config", None)):
        value = getattr(c, attr, None) if c is not None else None
        if isinstance(value, int):
            return value
    raise MemfitError(f"the config of model type `{config.model_type}` has no `{attr}`; memfit cannot place its "
                      "image tokens")


def _processor_settings(spec: Any) -> dict[str, Any]:
    """The processor's own settings (`processor_config.json`: Gemma 3's `image_seq_length`, LLaVA's `patch_size`):
    bundled in the `_memfit` record of the model's preprocessor config as `processor_config`, or a local model
    directory's own file; {} (the processor class's defaults) when there is none."""
    import json
    import os

    from memfit.models.catalog import find_bundled
    from memfit.models.processors import bundled_processor_record

    if spec.source == "bundled":
        record = bundled_processor_record(find_bundled(spec.name) or spec.name) or {}
        return dict(record.get("processor_config") or {})
    if spec.source == "local":
        folder = os.path.dirname(spec.name) if spec.name.endswith(".json") else spec.name
        path = os.path.join(folder, "processor_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return {k: v for k, v in data.items() if k not in ("processor_class", "auto_map")}
    return {}


def image_text_example(setup: Any, spec: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """The processor's output for one example of `setup` (real tensors), a summary for the report, and notes.

    Raises MemfitError (one line) for a model type memfit has no processor recipe for, and for an image size the
    processor refuses.
    """
    import numpy as np
    import transformers

    from memfit.models._processor_adapter import TEXT_WORD, processor_class, stub_tokenizer
    from memfit.models.processors import load_processor, quiet_transformers

    config = spec.config
    family = FAMILIES.get(getattr(config, "model_type", ""))
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        raise MemfitError(f"memfit does not run the processor of model type `{config.model_type}` yet (it does for "
                          f"{known}); estimate its language model alone (its `text_config`)")
    if getattr(setup, "pan_and_scan", False) and not family.pan_and_scan:
        raise MemfitError(f"`--pan-and-scan` crops the images of Gemma 3 (Gemma3Processor's `do_pan_and_scan`); "
                          f"{family.processor} of `{spec.name}` has no such setting: drop --pan-and-scan")
    image_processor, source = load_processor(spec, "image")
    notes = []
    if setup.image_wh is None:
        width, height = DEFAULT_IMAGE_WH
        notes.append(f"no --image-size: a {width}x{height} image assumed")
    else:
        width, height = setup.image_wh
    n = setup.images_per_example
    tokens = {token: _config_id(config, attr) for token, attr in family.tokens.items()}
    attributes = {}
    for name, token in (family.attributes or {}).items():
        attributes[name], attributes[f"{name}_id"] = token, tokens[token]
    tokenizer = stub_tokenizer(tokens, attributes, literals=family.literals)
    with quiet_transformers():
        try:
            processor = processor_class(getattr(transformers, family.processor))(
                image_processor=image_processor, tokenizer=tokenizer, **_processor_settings(spec))
        except ImportError as err:  # SmolVLMProcessor without num2words
            raise MemfitError(f"{family.processor} cannot be built: {str(err).splitlines()[0][:200]} (or "
                              "`pip install 'memfit[vision]'`)") from err
        text = family.placeholder * n + " " + " ".join([TEXT_WORD] * setup.max_length)
        suffix_tokens = _suffix_tokens(setup, family)
        kwargs = {"suffix": [" ".join([TEXT_WORD] * suffix_tokens)]} if family.suffix else {}
        if getattr(setup, "pan_and_scan", False):
            kwargs["do_pan_and_scan"] = True
        image = np.zeros((height, width, 3), dtype=np.uint8)  # HWC, as a decoded PIL image becomes an array
        try:
            out = processor(images=[[image] * n], text=[text], return_tensors="pt", **kwargs)
        except (ValueError, RuntimeError, TypeError) as err:
            raise MemfitError(f"{family.processor} refuses a {width}x{height} image: "
                              f"{str(err).splitlines()[0][:200]}; choose another --image-size") from err
    example = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    image_id = _config_id(config, family.image_token_attr)
    image_tokens = int((example["input_ids"] == image_id).sum())
    per_image = image_tokens // n
    length = int(example["input_ids"].shape[-1])
    text_tokens = setup.max_length + (suffix_tokens if family.suffix else 0)
    summary = {"kind": "image-text", "image_size": f"{width}x{height}", "given": setup.image_size,
               "images_per_example": n, "image_tokens_per_image": per_image, "image_tokens": image_tokens,
               "text_tokens": text_tokens, "sequence_length": length,
               "processor": f"{family.processor} ({type(image_processor).__name__})", "processor_settings": source,
               "inputs": {k: list(v.shape) for k, v in example.items()}}
    if family.suffix:
        summary["suffix_tokens"] = suffix_tokens
        if setup.target_length is None:
            notes.append(f"no --target-length: a suffix (the answer, the labels) of {suffix_tokens} tokens, as many as "
                         "the prefix (--max-length)")
    if getattr(setup, "pan_and_scan", False):
        _pan_and_scan_summary(example, summary, notes, n, width, height)
    if "image_grid_thw" in example:
        summary["image_grid_thw"] = example["image_grid_thw"].tolist()
    pixels = example.get("pixel_values")
    shape = "x".join(map(str, pixels.shape)) if pixels is not None else "?"
    notes.append(f"each {width}x{height} image becomes {per_image} image tokens (pixel_values {shape} for "
                 f"{n} image{'s' if n > 1 else ''}; {family.processor} with {type(image_processor).__name__}, settings "
                 f"from {source}); the sequence is {length} tokens: {image_tokens} image, {setup.max_length} text "
                 f"(--max-length)" + (f", {suffix_tokens} suffix (--target-length: the labels)" if family.suffix
                                      else "")
                 + f", {length - image_tokens - text_tokens} the template's image markers"
                 + (" and pan-and-scan's words" if getattr(setup, "pan_and_scan", False) else ""))
    if "aspect_ratio_mask" in example:
        # mllama: an image is tiles the language model cross-attends to (cross_attention_mask), not tokens in the
        # sequence; MllamaImageProcessor pads every image to max_image_tiles, and the vision tower runs them all
        used = example["aspect_ratio_mask"].sum(-1).flatten().tolist()
        summary["image_tiles"] = used
        notes.append(f"each {width}x{height} image is {used[0]} tile{'s' if used[0] > 1 else ''} of "
                     f"{pixels.shape[-1]} px (aspect_ratio_mask), padded to {pixels.shape[2]}: the vision tower runs "
                     f"{pixels.shape[2]} tiles an image and the language model cross-attends to them")
    if getattr(setup, "lora_r", None) is not None and not setup.lora_target_modules and not setup.peft_config:
        from memfit.models.peft_methods import VLM_LORA_TARGETS

        names = ", ".join(VLM_LORA_TARGETS)
        tower = _vision_modules_named(config, VLM_LORA_TARGETS)
        where = (f"the modules named {names}" if tower is None else
                 f"the language model's and the vision tower's {names} (peft matches the names in both)" if tower
                 else f"the language model's {names}")
        notes.append(f"LoRA on {where} (the Hugging Face VLM fine-tuning recipe's modules); --lora-target-modules "
                     "names others")
    return example, summary, notes


def _pan_and_scan_summary(example: dict[str, torch.Tensor], summary: dict[str, Any], notes: list[str], n: int,
                          width: int, height: int) -> None:
    """Gemma 3's pan-and-scan: the crops each image became, read off the processor's `pixel_values` (one row for
    the whole image and one per crop: Gemma3ImageProcessor's `_preprocess`)."""
    rows = int(example["pixel_values"].shape[0])
    crops = rows // n - 1
    per_view = summary["image_tokens_per_image"] // (crops + 1)
    summary.update(pan_and_scan=True, crops_per_image=crops, image_tokens_per_crop=per_view)
    side = "x".join(map(str, example["pixel_values"].shape[-1:-3:-1]))
    notes.append(f"pan-and-scan: each {width}x{height} image is the whole image and {crops} crop"
                 f"{'s' if crops != 1 else ''} (Gemma3ImageProcessor `pan_and_scan`), each resized to {side} and "
                 f"{per_view} image tokens" + ("" if crops else "; the image is too square or too small to be "
                                                "cropped (pan_and_scan_min_ratio_to_activate / _min_crop_size)"))


def _suffix_tokens(setup: Any, family: ImageTextFamily) -> int:
    """Words of the suffix (the answer, the labels) for a processor that takes one: `target_length`, else
    `max_length` (as the labels of seq2seq-lm); a `target_length` for a processor that takes none is refused."""
    if not family.suffix:
        if setup.target_length is not None:
            raise MemfitError(f"`target_length` {setup.target_length} sets the suffix of a prefix-LM processor "
                              f"(PaliGemma's); {family.processor} takes the prompt and answer as one text: drop "
                              "--target-length and give their length as --max-length")
        return 0
    return setup.max_length if setup.target_length is None else setup.target_length


def _vision_modules_named(config: Any, names: list[str]) -> bool | None:
    """Whether the model's vision tower has modules named like `names` (LLaVA's CLIP, SmolVLM's SigLIP and mllama's
    encoder name their attention projections q_proj / v_proj; Qwen2.5-VL's tower names them qkv / proj), read off
    the tower built from `vision_config` on the meta device (AutoModel, else the config class's `...Model`, as
    MllamaVisionConfig's MllamaVisionModel); None when transformers builds no model of it."""
    import transformers

    vision = getattr(config, "vision_config", None)
    if vision is None:
        return False
    own = getattr(transformers, type(vision).__name__.replace("Config", "Model"), None)
    for build in (transformers.AutoModel.from_config, getattr(own, "_from_config", None)):
        if build is None:
            continue
        try:
            with torch.device("meta"):
                tower = build(vision)
        except (ValueError, KeyError, TypeError):
            continue
        return any(name.rsplit(".", 1)[-1] in names for name, _ in tower.named_modules())
    return None


def image_text_inputs(setup: Any, spec: Any) -> Any:
    """`image_text_example` as the simulator takes it: a memfit.models.processors.MediaInputs holding the real
    example (its `tensors` the example's shapes and dtypes)."""
    from memfit.models.processors import MediaInputs

    example, summary, notes = image_text_example(setup, spec)
    tensors = {name: (tuple(t.shape), t.dtype) for name, t in example.items()}
    return MediaInputs(tensors, summary, notes, example=example)
