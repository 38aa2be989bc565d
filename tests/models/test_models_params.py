"""`params` of every bundled model and task equals the model transformers builds on real CPU tensors.

The full-size models do not fit a fast test on real tensors, so each bundled config is shrunk to
one block per stack and a small vocabulary (tying flags, widths and heads unchanged), built by memfit
on meta and by transformers on the CPU, and compared parameter for parameter (count and ties). The
slow tests build the full-size models the issue names on real tensors (about 2 minutes and 3 GB;
`pytest -m "not slow"` leaves them out).
"""

from __future__ import annotations

import copy
import warnings
from importlib import resources

import pytest
import torch
import transformers
from torch import nn

from memfit.models.catalog import bundled_model_ids, load_bundled_config
from memfit.models.build import build_meta_model, shared_parameter_names
from memfit.models.resolve import resolve
from memfit.train_setup import TASKS, TrainSetup

#: `slow`, and skipped unless asked for: the default run (`pytest -q`) selects no marker.
SLOW = [pytest.mark.slow]

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
#: Widths of 2560 and more: their one-block real builds take seconds each; the default run skips them.
_WIDE = 2560


def _width(config) -> int:
    return max(int(getattr(config, k, 0) or 0) for k in ("hidden_size", "d_model", "n_embd"))


def _shrunk(hub_id: str, layers: int = 1, *, vocab: bool = True):
    config = load_bundled_config(hub_id)
    # a vision-language config (Gemma 3's) keeps its stacks in sub-configs: each is shrunk as the top one
    subs = [getattr(config, k) for k in ("text_config", "vision_config") if hasattr(config, k)]
    for part in [config, *subs]:
        for key in _LAYER_KEYS:
            if isinstance(getattr(part, key, None), int):
                setattr(part, key, layers)
    if vocab:  # token ids only index the vocabulary; they change no parameter
        for part in [config, *subs[:1]]:
            for key, value in part.to_dict().items():
                if key.endswith("_token_id") and value is not None:
                    setattr(part, key, [1] if isinstance(value, list) else 1)
            part.vocab_size = 256
    return config


def _t5_head_as_loaded(config) -> bool:
    """A T5 v1.1 / Flan-T5 config: the checkpoint stores its own `lm_head.weight` (see the roundtrip test)."""
    return getattr(config, "scale_decoder_outputs", True) is False


def _real(auto_name: str, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, auto_name).from_config(config, dtype=torch.bfloat16)


def _unique(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _compare(hub_id: str, task: str) -> None:
    config = _shrunk(hub_id)
    setup = TrainSetup(model=config, task=task, max_length=16)
    if task in ("seq-cls", "token-cls"):
        config.num_labels = setup.num_labels  # what the user's from_pretrained(..., num_labels=2) gives
    try:
        meta = build_meta_model(setup)
    except ValueError:  # MemfitError: no such head; the real build must refuse it too
        with pytest.raises(ValueError):
            _real(TASKS[task], config)
        return
    real = _real(TASKS[task], config)
    expected, ties = _unique(real), shared_parameter_names(real)
    if task == "seq2seq-lm" and _t5_head_as_loaded(config):
        expected += real.lm_head.weight.numel()
        ties = {k: v for k, v in ties.items() if k != "lm_head.weight"}
    assert _unique(meta) == expected, f"{hub_id} {task}"
    assert shared_parameter_names(meta) == ties, f"{hub_id} {task}"


#: Families whose every task runs in the default run (tied LM heads, shared encoder/decoder embeddings,
#: ALBERT's factorised embeddings, XLNet's FloatTensor weights, DeBERTa's relative positions).
_ALL_TASKS_FAST = ("openai-community/gpt2", "google-t5/t5-small", "google/flan-t5-base", "facebook/bart-base",
                   "google-bert/bert-base-uncased", "albert/albert-base-v2", "xlnet/xlnet-base-cased",
                   "microsoft/deberta-v3-base", "FacebookAI/roberta-base", "Qwen/Qwen2.5-0.5B")


_DEFAULT_TASK_ONLY = {line.split("`")[1] for line in resources.files("memfit.models.configs").joinpath("SOURCES.md")
             .read_text(encoding="utf-8").splitlines() if line.startswith("| `")}


def _cases():
    """Every bundled model x every task; the default run keeps each model's default task (and all tasks
    of the families above) for models narrower than `_WIDE`, the rest is marked slow."""
    out = []
    for hub_id in bundled_model_ids():
        config = load_bundled_config(hub_id)
        # one MoE block is E experts on real tensors (Qwen3-30B-A3B: 604M parameters); slow
        moe = any(isinstance(getattr(config, k, None), int) and getattr(config, k) > 1
                  for k in ("num_local_experts", "num_experts", "n_routed_experts"))
        narrow = _width(config) < _WIDE and not moe
        default = resolve(TrainSetup(model=hub_id)).task
        # the configs in SOURCES.md's tables: their default task only; one real block of a 70B or of 32 experts
        # is about a billion parameters, and the other heads are the same code as their families' older models
        for task in [default] if hub_id in _DEFAULT_TASK_ONLY else TASKS:
            fast = narrow and (task == default or hub_id in _ALL_TASKS_FAST)
            out.append(pytest.param(hub_id, task, id=f"{hub_id}-{task}", marks=[] if fast else SLOW))
    return out


@pytest.mark.parametrize(("hub_id", "task"), _cases())
def test_params_equal_a_real_build(hub_id, task, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _compare(hub_id, task)


def test_the_wide_models_are_the_big_ones():
    wide = {h for h in bundled_model_ids() if _width(load_bundled_config(h)) >= _WIDE}
    assert "meta-llama/Llama-3.1-8B" in wide and "openai-community/gpt2" not in wide
    assert len(wide) <= len(bundled_model_ids()) // 2  # the fast run covers most bundled models


def test_flan_t5_as_loaded_has_its_own_head(tmp_path):
    """Why the T5 v1.1 correction: a checkpoint with a distinct lm_head.weight, loaded by from_pretrained,
    keeps it untied although transformers 5 sets `tie_word_embeddings=True` on every T5 config."""
    config = _shrunk("google/flan-t5-base")
    assert config.tie_word_embeddings is True and config.scale_decoder_outputs is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.T5ForConditionalGeneration(copy.deepcopy(config))
        assert model.lm_head.weight is model.shared.weight  # from_config ties it
        model.lm_head.weight = nn.Parameter(torch.randn_like(model.lm_head.weight))  # as the hub file stores it
        model.save_pretrained(tmp_path)
        loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is not loaded.shared.weight
    meta = build_meta_model(TrainSetup(model=config, task="seq2seq-lm", max_length=16))
    assert _unique(meta) == _unique(loaded)
    assert shared_parameter_names(meta) == shared_parameter_names(loaded)
    # and the original T5 (hub config without `tie_word_embeddings: false`) stays tied
    t5 = build_meta_model(TrainSetup(model=_shrunk("t5-small"), task="seq2seq-lm", max_length=16))
    assert t5.lm_head.weight is t5.shared.weight


# -- full size, real tensors -------------------------------------------------------------------------------

#: Counts of real CPU builds (`AutoModelFor*.from_config`, transformers 5.24), measured by the slow
#: tests below; they equal the model cards' figures where those are exact (Qwen2.5-0.5B: 0.49B,
#: Llama-3.2-1B: 1.23B, Llama-3.1-8B: 8.03B).
FULL_SIZE = [
    ("openai-community/gpt2", "causal-lm", 124_439_808),
    ("google-t5/t5-small", "seq2seq-lm", 60_506_624),
    ("facebook/bart-base", "seq2seq-lm", 139_420_416),
    ("Qwen/Qwen2.5-0.5B", "causal-lm", 494_032_768),
    ("meta-llama/Llama-3.2-1B", "causal-lm", 1_235_814_400),
]


@pytest.mark.parametrize(("hub_id", "task", "count"),
                         [pytest.param(*c, id=c[0], marks=SLOW) for c in FULL_SIZE])
def test_full_size_params_equal_a_real_build(hub_id, task, count, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real = _real(TASKS[task], load_bundled_config(hub_id))
    assert _unique(real) == count
    meta = build_meta_model(TrainSetup(model=hub_id, task=task, max_length=16))
    assert _unique(meta) == count
    assert shared_parameter_names(meta) == shared_parameter_names(real)


@SLOW[0]
def test_llama_3_1_8b_params_from_real_builds_of_one_and_two_blocks(monkeypatch):
    """8B on real tensors is 16 GB even in bf16: blocks are identical, so count(N) = c1 + (N - 1) (c2 - c1)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_id = "meta-llama/Llama-3.1-8B"
    c1 = _unique(_real("AutoModelForCausalLM", _shrunk(hub_id, 1, vocab=False)))
    c2 = _unique(_real("AutoModelForCausalLM", _shrunk(hub_id, 2, vocab=False)))
    blocks = load_bundled_config(hub_id).num_hidden_layers
    full = c1 + (blocks - 1) * (c2 - c1)
    assert full == 8_030_261_248
    meta = build_meta_model(TrainSetup(model=hub_id, task="causal-lm", max_length=16))
    assert _unique(meta) == full
