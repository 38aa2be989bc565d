"""Bundled Hugging Face ``config.json`` files for commonly fine-tuned models.

memfit simulates memory without downloading weights, but it still needs each
model's architecture.  The package ships the real hub ``config.json`` of the
models people fine-tune most (``memfit/models/configs/<org>--<name>.json``), so the
common cases work fully offline (``HF_HUB_OFFLINE=1``).

Each bundled file is the hub ``config.json`` (irrelevant bookkeeping fields such
as ``transformers_version`` dropped) plus one extra top-level key,
``"_memfit"``, holding provenance::

    {"hub_id": "meta-llama/Llama-3.2-1B",
     "source": "<where the values came from>",
     "params": 1240000000,            # published total parameter count
     "params_source": "<where that count was published>",
     "params_class": "AutoModelForCausalLM",  # the model class it counts
     "params_rel_tol": 0.03,          # optional: coarser published figure
     "note": "..."}                   # optional

Names are matched case-insensitively and may be given as the canonical hub id
(``google-bert/bert-base-uncased``), the legacy un-namespaced id
(``bert-base-uncased``), or just the bare model name (``llama-3.2-1b``).
"""

from __future__ import annotations

import difflib
import json
import re
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig

__all__ = [
    "bundled_model_ids",
    "bundled_aliases",
    "similar_bundled",
    "find_bundled",
    "load_bundled_config",
    "bundled_info",
    "hidden_size",
    "ALIASES",
]

_PACKAGE = "memfit.models.configs"
_META_KEY = "_memfit"

#: Hub ids whose config.json has the same architecture as a bundled one (same modules and shapes): they
#: resolve to it instead of a copied file. Only fields that change no tensor differ (token ids,
#: chat-template bookkeeping). The `-Instruct` / `-it` variants people fine-tune.
ALIASES: dict[str, str] = {
    # Llama 3.x Instruct: the base config with eos_token_id [128001, 128008, 128009]
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.2-1B-Instruct": "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B-Instruct": "meta-llama/Llama-3.2-3B",
    # Llama 3.3 70B Instruct: the Llama 3.1 70B architecture (LlamaForCausalLM, 80 x 8192, GQA 64/8, llama3 RoPE)
    "meta-llama/Llama-3.3-70B-Instruct": "meta-llama/Llama-3.1-70B",
    # DeepSeek-R1-Distill-Llama-8B: fine-tuned from Llama-3.1-8B (model card), the same architecture
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": "meta-llama/Llama-3.1-8B",
    # Gemma instruction-tuned checkpoints: the pretrained architecture
    "google/gemma-2-2b-it": "google/gemma-2-2b",
    "google/gemma-2-9b-it": "google/gemma-2-9b",
    "google/gemma-2-27b-it": "google/gemma-2-27b",
    "google/gemma-3-1b-it": "google/gemma-3-1b-pt",
    "google/gemma-3-27b-it": "google/gemma-3-27b-pt",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M",
    # base / instruct twins of the same architecture (the model cards; only
    # token ids and chat bookkeeping differ). SmolLM2-1.7B is bundled by its Instruct config, the one quoted in public code
    "HuggingFaceTB/SmolLM2-360M-Instruct": "HuggingFaceTB/SmolLM2-360M",
    "HuggingFaceTB/SmolLM2-1.7B": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "Qwen/Qwen2.5-Coder-7B": "Qwen/Qwen2.5-Coder-7B-Instruct",
    # Mixtral 8x7B base: the Instruct config's fields (MixtralForCausalLM, 32 x 4096, 8 experts top-2, vocab 32000,
    # max_position_embeddings 32768, rope_theta 1e6), as public code quotes the base hub config.json
    "mistralai/Mixtral-8x7B-v0.1": "mistralai/Mixtral-8x7B-Instruct-v0.1",
}
# Not aliases: Qwen2.5-7B-Instruct (max_position_embeddings 32768, the base 131072) and Mistral-Nemo-Instruct-2407
# (1024000, the base 128000) differ from their base in a field memfit reads (the max-length check): both are files.


@lru_cache(maxsize=None)
def _read_all() -> dict[str, dict[str, Any]]:
    """Read every bundled config, keyed by its canonical hub id."""
    out: dict[str, dict[str, Any]] = {}
    for entry in resources.files(_PACKAGE).iterdir():
        if not entry.name.endswith(".json"):
            continue
        data = json.loads(entry.read_text(encoding="utf-8"))
        meta = data.get(_META_KEY) or {}
        hub_id = meta.get("hub_id") or entry.name[: -len(".json")].replace("--", "/")
        out[hub_id] = data
    return out


@lru_cache(maxsize=None)
def _alias_index() -> dict[str, str]:
    """Map lower-cased aliases (full id, bare name) to canonical hub ids.

    Full ids win over bare names; a bare name shared by two bundled models
    (none today) would resolve to neither.
    """
    full: dict[str, str] = {}
    bare: dict[str, list[str]] = {}
    for hub_id in _read_all():
        key = hub_id.lower()
        full[key] = hub_id
        full[key.replace("/", "--")] = hub_id
        bare.setdefault(key.rsplit("/", 1)[-1], []).append(hub_id)
    for alias, target in ALIASES.items():
        if target in _read_all():
            full[alias.lower()] = target
            full[alias.lower().replace("/", "--")] = target
            bare.setdefault(alias.lower().rsplit("/", 1)[-1], []).append(target)
    index = {name: ids[0] for name, ids in bare.items() if len(ids) == 1}
    index.update(full)
    return index


def bundled_model_ids() -> list[str]:
    """Return the canonical hub ids of all bundled configs, sorted."""
    return sorted(_read_all(), key=str.lower)


def bundled_aliases() -> dict[str, str]:
    """The :data:`ALIASES` that resolve (alias -> the bundled hub id it loads), sorted by alias."""
    ids = _read_all()
    return {a: t for a, t in sorted(ALIASES.items(), key=lambda kv: kv[0].lower()) if t in ids}


_VARIANT_WORDS = re.compile(r"-(instruct|it|chat|base|pt|hf|v\d+(\.\d+)*|\d{4})(?=-|$)")


def _family(hub_id: str) -> str:
    """`mistralai/Mistral-Nemo-Instruct-2407` -> `mistral-nemo`: the bare name without variant words."""
    bare = hub_id.strip().strip("/").lower().rsplit("/", 1)[-1]
    previous = None
    while previous != bare:
        previous, bare = bare, _VARIANT_WORDS.sub("", bare)
    return bare


def similar_bundled(name: str, n: int = 4) -> list[str]:
    """Bundled ids (and aliases) most likely to share `name`'s architecture, for an id that is not bundled.

    First the ids of the same family and size (the name without `-Instruct`, `-it`, `-Base`, `-v0.1`,
    a 4-digit date: the twins of one architecture); else the closest names (difflib). Offline this is a
    guess from the name, not a check of the architecture.
    """
    names = bundled_model_ids() + list(bundled_aliases())
    family = _family(name)
    same = [i for i in names if _family(i) == family]
    if same:
        return same[:n]
    by_bare = {i.lower().rsplit("/", 1)[-1]: i for i in names}
    close = difflib.get_close_matches(name.strip().lower().rsplit("/", 1)[-1], list(by_bare), n=n, cutoff=0.6)
    return [by_bare[c] for c in close]


def find_bundled(name: str) -> str | None:
    """Resolve ``name`` to the canonical hub id of a bundled config, or ``None``.

    Matching is case-insensitive and accepts the canonical id
    (``openai-community/gpt2``), the legacy id without organisation (``gpt2``,
    ``t5-base``, ``xlnet-large-cased``), the bare model name of a namespaced id
    (``llama-3.2-1b``, ``deberta-v3-base``) and the file-name form
    (``meta-llama--Llama-3.2-1B``), and the ids of :data:`ALIASES` (an ``-Instruct`` variant
    resolves to its base config).  A differing organisation is not accepted
    (``someone/gpt2`` is a different model).
    """
    key = name.strip().strip("/").lower()
    if key.endswith(".json"):
        key = key[: -len(".json")]
    index = _alias_index()
    # An "org/name" whose org differs from the bundled one is a different model.
    return index.get(key)


def _require(hub_id: str) -> dict[str, Any]:
    resolved = find_bundled(hub_id)
    if resolved is None:
        raise KeyError(f"no bundled config for {hub_id!r}")
    return _read_all()[resolved]


def bundled_info(hub_id: str) -> dict[str, Any]:
    """Return the ``_memfit`` provenance record of a bundled config (a copy).

    Raises ``KeyError`` if ``hub_id`` does not resolve via :func:`find_bundled`.
    """
    return json.loads(json.dumps(_require(hub_id).get(_META_KEY, {})))


def load_bundled_config(hub_id: str) -> PretrainedConfig:
    """Build a ``transformers.PretrainedConfig`` from a bundled ``config.json``.

    Uses ``AutoConfig.for_model(model_type, **fields)``, so it never touches
    the network and works with ``HF_HUB_OFFLINE=1``.  Raises ``KeyError`` if
    ``hub_id`` does not resolve via :func:`find_bundled`.
    """
    from transformers import AutoConfig

    data = {k: v for k, v in _require(hub_id).items() if k != _META_KEY}
    data = json.loads(json.dumps(data))  # deep copy: configs may mutate dicts
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    resolved = find_bundled(hub_id)
    config._name_or_path = resolved
    return config


def hidden_size(config: Any) -> int | None:
    """The model's width, as transformers fills DeepSpeed's `"auto"` buckets from it (integrations/deepspeed.py
    `trainer_config_finalize`): `hidden_size`, else the largest of `hidden_sizes` (ConvNeXt, ResNet, Swin's
    per-stage widths); None when the config has neither."""
    width = getattr(config, "hidden_size", None)
    if width:
        return int(width)
    sizes = getattr(config, "hidden_sizes", None)
    return (int(max(sizes)) or None) if sizes else None
