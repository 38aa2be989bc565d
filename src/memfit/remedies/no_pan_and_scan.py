"""No pan-and-scan (opt-in `no_pan_and_scan`, Gemma 3): `do_pan_and_scan=False`, each image one view.

With `do_pan_and_scan` Gemma3ImageProcessor cuts an image whose sides differ enough into crops along its longer
side (transformers models/gemma3/image_processing_gemma3.py `pan_and_scan_batched`: a side ratio of at least
`pan_and_scan_min_ratio_to_activate`, crops of at least `pan_and_scan_min_crop_size` px, at most
`pan_and_scan_max_num_crops`), and Gemma3Processor writes one more block of `image_seq_length` image tokens per
crop (processing_gemma3.py `replace_image_token`): a 1920x1080 image is the whole image and 2 crops, 768 image
tokens instead of 256 (docs/multimodal.md). The vision tower runs every view and the language model's sequence
holds their tokens; without pan-and-scan both shrink to one view. The planner simulates the variant like any
other (memfit.models.image_text runs the processor both ways), so an image too square or too small to be
cropped is never chosen: it saves nothing. It changes the model's inputs (fewer views, less detail of a wide
image), hence opt-in.
"""

from memfit.remedies.base import Applicability, Remedy, model_type

#: The model type whose processor takes `do_pan_and_scan` (memfit.models.image_text FAMILIES `pan_and_scan`).
_MODEL_TYPES = ("gemma3",)


def _check(setup, gpu):
    if setup.task != "image-text-to-text" or model_type(setup) not in _MODEL_TYPES:
        return Applicability(False, "Gemma 3 with --pan-and-scan only (Gemma3Processor's `do_pan_and_scan`)")
    if not setup.pan_and_scan:
        return Applicability(False, "pan-and-scan is off already: each image is one view")
    return Applicability(True, "each image one view: no crops for the vision tower and the sequence")


def _variants(setup, gpu):
    return [{"pan_and_scan": False}] if _check(setup, gpu).applies else []


def _apply(changes, setup, **_):
    return {}, {}, ["call the processor with `do_pan_and_scan=False` (the default; drop `do_pan_and_scan=True` from "
                    "the processor call or its `images_kwargs`, and --pan-and-scan from memfit's command)"]


REMEDY = Remedy(
    name="no_pan_and_scan", title="no pan-and-scan crops", opt_in=True,
    saves="the crops' image tokens: the vision tower's activations and the language model's sequence",
    costs="one view of each image: less detail of wide or tall images",
    check=_check, variants=_variants, apply=_apply, fields=("pan_and_scan",),
)
