"""The one module that bends transformers' multimodal processors to run without a hub tokenizer or torchvision.

A vision-language processor (`Qwen2_5_VLProcessor`, `Gemma3Processor`, ...) expands each image placeholder of
the prompt into the image tokens the model reads, from what its image processor made of the image; memfit
runs that code to learn the sequence. It needs:

- a tokenizer: memfit has no hub access, so `stub_tokenizer` builds one (the `tokenizers` library's WordLevel
  model) that knows the model's special tokens with their ids from the model's config, and one word `a` for
  the text. The image tokens are what the processor inserts; the text is `max_length` words of one token each.
- a processor whose `ProcessorMixin.__init__` accepts no video processor: transformers 5 checks every
  attribute's class (`check_argument_for_proper_class`), and without torchvision the video processor's base
  class is not importable, so the check of `video_processor=None` raises. `processor_class` returns a subclass
  that skips the check for an absent attribute only (images never reach the video processor).
- the image processor class a preprocessor config names, resolved as `AutoImageProcessor.from_pretrained`
  resolves it: a legacy `...Fast` name (Qwen3-VL's `Qwen2VLImageProcessorFast`) is the base class with a backend,
  torchvision's where it is installed, else the PIL one (`image_processor_class`, on transformers' private
  `_resolve_backend` / `_load_backend_class` of models/auto/image_processing_auto.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["stub_tokenizer", "processor_class", "image_processor_class"]

#: The one word of the synthetic text; a whitespace-separated run of it is that many tokens.
TEXT_WORD = "a"


def stub_tokenizer(special_tokens: dict[str, int], attributes: dict[str, Any] | None = None,
                   literals: tuple[str, ...] = ()) -> Any:
    """A fast tokenizer whose vocabulary is `special_tokens` (token -> id, matched whole, never split), the word
    `TEXT_WORD`, an unknown token and `literals` (strings the real tokenizer makes one token of, such as Gemma's
    `\n\n`; each matched whole with a free id, never split away as whitespace); `attributes` are set on it
    (Gemma 3's processor reads `tokenizer.boi_token`, `tokenizer.image_token`, ...)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    used = set(special_tokens.values())
    free = iter(i for i in range(10**9) if i not in used)
    unk, word = next(free), next(free)
    vocab = {"[UNK]": unk, TEXT_WORD: word, **special_tokens, **{text: next(free) for text in literals}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False, lstrip=False, rstrip=False)
                    for t in literals])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    for name, value in (attributes or {}).items():
        setattr(out, name, value)
    return out


def processor_class(base: type) -> type:
    """`base` (a ProcessorMixin subclass) whose constructor takes an absent (None) sub-processor without looking
    up its class, and takes None for a sub-processor its signature requires but memfit does not pass
    (SmolVLMProcessor's positional `video_processor`)."""
    import functools
    import inspect

    required = [name for name, p in inspect.signature(base.__init__).parameters.items()
                if name.endswith("_processor") and p.default is inspect.Parameter.empty]

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None:
            return None
        return base.check_argument_for_proper_class(self, argument_name, argument)

    @functools.wraps(base.__init__)  # ProcessorMixin.get_attributes reads the sub-processors off this signature
    def __init__(self, *args, **kwargs):
        for name in required[len(args):]:
            kwargs.setdefault(name, None)
        base.__init__(self, *args, **kwargs)

    return type(base.__name__, (base,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                         "__init__": __init__})


def image_processor_class(name: str) -> Any:
    """The image processor class `AutoImageProcessor.from_pretrained` loads for a preprocessor config whose
    `image_processor_type` is `name`, or None: transformers 5 strips a legacy `Fast` suffix, picks the torchvision
    backend where it is installed and the PIL one otherwise (or where the processor defaults to PIL), and falls
    back to the other backend when one is missing (image_processing_auto.py `from_pretrained`)."""
    from transformers.models.auto import image_processing_auto as auto

    legacy_fast = name.endswith("Fast")
    base = name[:-4] if legacy_fast else name
    backend = auto._resolve_backend(None, None, base)
    return auto._load_backend_class(base, backend, legacy_fast)
