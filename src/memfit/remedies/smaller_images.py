"""Smaller images (opt-in `smaller_images`, vision-language models): each side of the image halved.

A processor that keeps the image's resolution makes a quarter of the image tokens of a half-size image:
Qwen2.5-VL's `smart_resize` keeps the pixel count within `min_pixels` / `max_pixels`, so a 1024x1024 image is
1,369 tokens and a 512x512 one 324 (memfit.models.image_text runs the processor on both). The vision tower's
activations and the language model's sequence shrink with them. A processor that resizes to one size (LLaVA's
336 px, Gemma 3's 896 px) makes the same tokens of any size: the planner simulates the variant like any other,
so it is only chosen where it saves. It changes what the model sees (less detail), hence opt-in.
"""

from memfit.remedies.base import Applicability, Remedy

_SMALLEST_SIDE_PX = 56  #: not planned smaller: two of Qwen2.5-VL's 28-pixel merged patches


def _size(setup):
    from memfit.models.image_text import DEFAULT_IMAGE_WH

    return setup.image_wh or DEFAULT_IMAGE_WH


def _check(setup, gpu):
    if setup.task != "image-text-to-text":
        return Applicability(False, "vision-language models only (an image classifier's processor resizes to its "
                                    "own size)")
    width, height = _size(setup)
    if min(width, height) // 2 < _SMALLEST_SIDE_PX:
        return Applicability(False, f"the images are already small ({width}x{height})")
    return Applicability(True, "fewer image tokens where the processor keeps the resolution")


def _variants(setup, gpu):
    if not _check(setup, gpu).applies:
        return []
    width, height = _size(setup)
    return [{"image_size": f"{width // 2}x{height // 2}"}]


def _apply(changes, setup, **_):
    width, height = (int(x) for x in changes["image_size"].split("x"))
    return {}, {}, [f"resize each image to {width}x{height} before the processor (e.g. `image.resize(({width}, "
                    f"{height}))` in the collator), or cap the processor's resolution: "
                    f"`processor.image_processor.max_pixels = {width * height}` where it has `max_pixels` (Qwen2.5-VL)"]


REMEDY = Remedy(
    name="smaller_images", title="smaller images", opt_in=True, advice=("smaller_images",),
    saves="image tokens: the vision tower's activations and the language model's sequence",
    costs="less image detail", check=_check, variants=_variants, apply=_apply, fields=("image_size",),
)
