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
"""

from __future__ import annotations

from typing import Any

__all__ = ["stub_tokenizer", "processor_class"]

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
