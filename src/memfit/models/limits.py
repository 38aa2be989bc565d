"""How many tokens a model can take: a learned position table is a hard limit, RoPE is not.

A model with a table of absolute positions (BERT's `position_embeddings`, GPT-2's `wpe`, BART's
`embed_positions`) indexes that table with each token's position: a longer sequence is an
index out of range on the GPU (a device-side assert), so memfit refuses it with the limit.
Relative positions (T5's buckets, XLNet, DeBERTa-v3 with `position_biased_input=False`) have no
limit. Rotary embeddings (Llama, Qwen2, Mistral, Phi) are computed for any position: transformers
runs past `max_position_embeddings` without an error, so memfit estimates it and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from memfit.errors import MemfitError
from memfit.train_setup import AUDIO_TASKS, IMAGE_TASKS

MEDIA_TASKS = IMAGE_TASKS + AUDIO_TASKS

__all__ = ["PositionLimit", "position_limits", "check_sequence_lengths"]

#: Attribute names of learned (or fixed sinusoidal) absolute position tables in transformers:
#: `position_embeddings` (BERT, RoBERTa, ALBERT, DistilBERT, ELECTRA, DeBERTa with
#: `position_biased_input`), `wpe` (GPT-2, GPT-Neo), `embed_positions` (BART, OPT, mBART, Marian),
#: `pos_emb`.
_POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions", "pos_emb")


@dataclass(frozen=True)
class PositionLimit:
    """The longest sequence one position table of a model takes."""

    module: str
    """Qualified name of the table (e.g. `transformer.wpe`)."""
    max_tokens: int
    decoder: bool
    """The table of a seq2seq decoder: it limits the target (labels) length."""
    offset: int
    """Rows of the table no token position uses (BART's 2, RoBERTa's padding_idx + 1)."""


def position_limits(model: nn.Module) -> list[PositionLimit]:
    """Every absolute position table of `model` and the longest sequence it takes.

    The offset is read from the module as transformers uses it: `BartLearnedPositionalEmbedding`
    looks up `position + self.offset` (offset 2); RoBERTa's `create_position_ids_from_input_ids`
    numbers tokens from `padding_idx + 1` (so 514 rows take 512 tokens).
    """
    limits = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in _POSITION_TABLES or not isinstance(module, nn.Embedding):
            continue
        offset = getattr(module, "offset", None)
        if not isinstance(offset, int):
            offset = module.padding_idx + 1 if module.padding_idx is not None else 0
        limits.append(PositionLimit(name, module.num_embeddings - offset, ".decoder." in f".{name}.", offset))
    return limits


def _config_key(config: Any) -> str:
    """The config's own name for `max_position_embeddings` (GPT-2: `n_positions`)."""
    return getattr(config, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")


def _where(config: Any, limit: PositionLimit) -> str:
    """Where the limit comes from, in the words of the model's config."""
    max_pos = getattr(config, "max_position_embeddings", None) if config is not None else None
    if not isinstance(max_pos, int):
        return f"the {limit.max_tokens + limit.offset} rows of `{limit.module}`"
    if max_pos == limit.max_tokens:
        return f"`{_config_key(config)}` in its config"
    return f"`{_config_key(config)}` = {max_pos} in its config, less the {limit.offset} rows before the first position"


def _is_rope(config: Any) -> bool:
    # transformers 5 keeps the rotary settings in `rope_parameters`; 4.x configs had `rope_theta`
    return getattr(config, "rope_parameters", None) is not None or getattr(config, "rope_theta", None) is not None


def check_sequence_lengths(model: nn.Module, setup: Any, name: str, config: Any) -> list[str]:
    """Raise a MemfitError when `setup`'s sequences do not fit `model`'s positions; return notes.

    Args:
        model: the built (meta) model.
        setup: the TrainSetup (its `sequence_length`, `task`, `target_length`).
        name: the model as the user named it (for the message).
        config: the model's config, or None for a plain module.
    """
    seq = setup.sequence_length
    target = (setup.target_length or seq) if setup.task in ("seq2seq-lm", "speech-seq2seq") else None
    for limit in position_limits(model):
        on_target = limit.decoder and target is not None  # OPT's `model.decoder` is a decoder-only model's
        if setup.task in MEDIA_TASKS and not on_target:
            continue  # an image or audio encoder's positions: the processor's output decides them, not max_length
        n = target if on_target else seq
        if n <= limit.max_tokens:
            continue
        if on_target:
            what, flag = f"`target_length` {n}", "--target-length"
        elif setup.example_lengths is not None and n != setup.max_length:
            what, flag = f"the longest example ({n} tokens, not truncated)", "truncation and --max-length"
        else:
            what, flag = f"`max_length` {n}", "--max-length"
        table = "decoder position limit" if on_target else "position limit"
        raise MemfitError(f"{what} exceeds {name}'s {table} of {limit.max_tokens} ({_where(config, limit)}); "
                          f"use {flag} <= {limit.max_tokens}")
    _check_any_gpu_holds(setup, name, config)
    notes = []
    max_pos = getattr(config, "max_position_embeddings", None) if config is not None else None
    if isinstance(max_pos, int) and max_pos > 0 and _is_rope(config) and seq > max_pos:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        scaling = " and its config has no rope scaling" if kind in (None, "default") else f" (rope scaling `{kind}`)"
        notes.append(f"{seq} tokens exceed {name}'s `{_config_key(config)}` of {max_pos}{scaling}: rotary positions "
                     "run past the length it was trained for (transformers does not stop it; the memory is "
                     "estimated, the quality of such a run is not known)")
    return notes


def _check_any_gpu_holds(setup: Any, name: str, config: Any) -> None:
    """A one-line MemfitError when one layer's hidden states alone (micro-batch x tokens x hidden size, in a 16-bit
    dtype, the smallest a run keeps them in) exceed the largest GPU in memfit's catalog: no GPU runs the step, and
    simulating it would only overflow tensor sizes (torch's numel check)."""
    from memfit.gpus.catalog import CATALOG
    from memfit.models.catalog import hidden_size

    text = getattr(config, "text_config", None) if config is not None else None
    width = (hidden_size(config) if config is not None else None) or (hidden_size(text) if text is not None else None)
    if not width or setup.task in MEDIA_TASKS:
        return
    tokens = setup.padding_free_tokens if setup.is_padding_free else setup.per_device_train_batch_size * \
        setup.sequence_length
    need = tokens * width * 2
    largest = max(CATALOG.values(), key=lambda g: g.total_bytes)
    if need > largest.total_bytes:
        from memfit.units import format_bytes

        raise MemfitError(f"{tokens:,} tokens per micro-batch (`max_length` {setup.sequence_length:,}): one layer's "
                          f"hidden states of {name} alone ({tokens:,} x {width} x 2 B = {format_bytes(need)}) exceed the "
                          f"largest GPU memfit knows ({largest.name}, {format_bytes(largest.total_bytes)}); use a "
                          "smaller --max-length or --batch-size")
