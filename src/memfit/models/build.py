"""Turn what the user names as a model into a module built on the meta device.

A model is a hub id (bundled configs work offline; others are fetched with `AutoConfig`
when online), a local directory holding `config.json`, a `PretrainedConfig`, or an
`nn.Module`. Weights are never loaded: `from_config` runs under `torch.device("meta")`, and
parameters the model ties (embeddings shared with the LM head) stay one parameter, as in the
model `from_pretrained` loads. `default_task` picks the head from the config's architectures.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.train_setup import TASKS, TrainSetup

__all__ = ["ModelSpec", "resolve_config", "build_meta_model", "to_empty_tied", "shared_parameter_names",
           "default_task"]

_WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: Any  # transformers.PretrainedConfig or None for a plain nn.Module
    source: str  # "bundled", "local", "hub", "config", "module"


def _bundled(name: str):
    try:
        from memfit.models import catalog as model_catalog
    except ImportError:  # pragma: no cover - catalog not built yet
        return None, []
    hub_id = model_catalog.find_bundled(name)
    if hub_id is None:
        return None, model_catalog.bundled_model_ids()
    return model_catalog.load_bundled_config(hub_id), []


def resolve_config(model: Any) -> ModelSpec:
    """Find the config for `model` without downloading weights."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, nn.Module):
        return ModelSpec(type(model).__name__, getattr(model, "config", None), "module")
    if isinstance(model, PretrainedConfig):
        return ModelSpec(getattr(model, "_name_or_path", "") or model.model_type, model, "config")
    if not isinstance(model, (str, os.PathLike)):
        raise MemfitError(f"model `{model!r}` is not a hub id, directory, config or nn.Module")
    name = os.fspath(model)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise MemfitError(f"directory `{name}` has no config.json; point at a saved model directory")
        try:
            return ModelSpec(name, AutoConfig.from_pretrained(name), "local")
        except (ValueError, KeyError, OSError) as err:
            raise MemfitError(f"cannot read `{name}/config.json`: {err}") from err
    if os.path.isfile(name) and name.endswith(".json"):
        try:
            return ModelSpec(name, AutoConfig.from_pretrained(name), "local")
        except (ValueError, KeyError, OSError) as err:
            raise MemfitError(f"cannot read config file `{name}`: {err}") from err
    config, known = _bundled(name)
    if config is not None:
        return ModelSpec(name, config, "bundled")
    offline = not _hub_reachable()
    try:
        with _quiet_hub():
            # without a connection, only the local hub cache: huggingface_hub would otherwise retry
            # for ~20 s before giving up (HF_HUB_ETAG_TIMEOUT, its backoff)
            return ModelSpec(name, AutoConfig.from_pretrained(name, local_files_only=offline), "hub")
    except Exception as err:  # offline, unknown id, gated repo, unknown model_type ...
        from memfit.models.catalog import similar_bundled

        similar = similar_bundled(name) if known else []
        shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
        if similar:  # a name of the same family (an -Instruct twin) or close to it: the likely same architecture
            shown = f"closest to `{name}`: {', '.join(similar)}; all: " + shown
        why = "no connection to the Hugging Face hub and not in its local cache" if offline else type(err).__name__
        raise MemfitError(
            f"model `{name}` is not bundled and its config could not be fetched ({why}). "
            f"Bundled ids work offline: {shown} (`memfit estimate --list-models` shows all). "
            "Otherwise pass a directory or a config.json file of the model"
        ) from err


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the hub endpoint answers a TCP connect within `timeout_s` (False under HF_HUB_OFFLINE)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_hub():
    """Keep huggingface_hub's own retry warnings off the terminal: the MemfitError says what failed."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR + 1)
    try:
        yield
    finally:
        hub_logger.setLevel(level)


# -- building on the meta device with shared parameters kept shared ----------------------------


@contextlib.contextmanager
def without_hf_deepspeed_config():
    """Hide a live DeepSpeed ZeRO-3 Trainer's config from transformers while memfit builds its meta models.

    With ZeRO-3 transformers' `is_deepspeed_zero3_enabled()` reads the config a DeepSpeed `TrainingArguments`
    registered (`set_hf_deepspeed_config`, a weak reference), and `PreTrainedModel._from_config` then builds
    every model under `deepspeed.zero.Init`, which partitions parameters as they are made and fails on
    memfit's meta tensors ("Cannot copy out of meta tensor"). The reference is unset inside and set back after.
    """
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover - transformers without its DeepSpeed integration
        yield
        return
    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    live = ref() if ref is not None else None
    if live is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(live)


@contextlib.contextmanager
def _meta_init() -> Iterator[None]:
    """Build modules on the meta device; a parameter registered twice stays one parameter (and never under a
    live ZeRO-3 config's `deepspeed.zero.Init`: `without_hf_deepspeed_config`).

    `torch.device("meta")` puts every tensor a constructor creates on meta. A few models create
    weights with the legacy `torch.FloatTensor(...)` constructor, which ignores the default device
    (XLNet's q/k/v/o/r, `XLNetRelativeAttention.__init__`); those are moved to meta as they are
    registered, as `accelerate.init_empty_weights` does.

    Why not `accelerate.init_empty_weights`: its `register_empty_parameter`
    (accelerate/big_modeling.py, `init_on_device`) wraps *every* registered parameter in a new
    `Parameter`, also when `PreTrainedModel.tie_weights` (transformers/modeling_utils.py) ties the
    output embedding by `setattr(parent, name, source_param)` at the end of `post_init`. The
    tie is lost: GPT-2, Llama 3.2, Qwen2.5, T5 and BART were counted with an extra copy of their
    embedding matrix. Here a parameter already on meta is registered as it is, and a CPU one is
    replaced by the same meta twin every time it is registered.
    """
    import weakref

    original = nn.Module.register_parameter
    # id(cpu param) -> (meta twin, weak reference to that cpu param): the cpu memory is freed as soon as
    # the model drops it, and a later tensor that reuses the id is not mistaken for it
    twins: dict[int, tuple[nn.Parameter, weakref.ref]] = {}

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            entry = twins.get(id(param))
            if entry is None or entry[1]() is not param:
                twin = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
                twin.__dict__.update(param.__dict__)  # e.g. transformers' `_is_hf_initialized`
                entry = twins[id(param)] = (twin, weakref.ref(param))
            param = entry[0]
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    try:
        with torch.device("meta"), without_hf_deepspeed_config():
            yield
    finally:
        nn.Module.register_parameter = original


def shared_parameter_names(module: nn.Module) -> dict[str, str]:
    """`{alias: first name}` for every parameter reachable under more than one name (tied weights).

    The first name is the one `named_parameters()` (which removes duplicates) reports.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    parent._parameters[attr] = param  # not via register_parameter: no patch may rewrap it


def _retie(module: nn.Module, aliases: dict[str, str]) -> None:
    for alias, source in aliases.items():
        _set_parameter(module, alias, module.get_parameter(source))


def to_empty_tied(module: nn.Module, *, device: str | torch.device) -> nn.Module:
    """`module.to_empty(device=...)` that keeps tied parameters tied.

    `nn.Module._apply` gives each module's own `_parameters` entry a new `Parameter` when the
    device changes (meta -> cpu, or a FakeTensor: `compute_should_use_set_data` is False), so a
    parameter shared by two modules becomes two. The aliases are put back afterwards.
    """
    aliases = shared_parameter_names(module)
    fn = _empty_like_on(device)
    unique = list(module.modules())
    if len(unique) == sum(1 for _ in module.named_modules(remove_duplicate=False)):
        module._apply(fn)  # what `Module.to_empty(device=device)` runs (torch/nn/modules/module.py)
    else:
        # a module reachable twice (peft: prompt learning's `word_embeddings`, VB-LoRA's shared vector
        # bank): `_apply` would convert it twice, and the second conversion of a FakeTensor parameter is a
        # `swap_tensors` that fails ("Couldn't swap Embedding.weight"); convert each module once
        for sub in unique:
            sub._apply(fn, recurse=False)
    _retie(module, aliases)
    return module


def _empty_like_on(device: str | torch.device):
    """`lambda t: torch.empty_like(t, device=device)`, `Module.to_empty`'s function, built with `torch.empty` where
    that is the same tensor: for a contiguous `t`, `empty_like`'s default `memory_format=torch.preserve_format`
    gives the contiguous strides `torch.empty` gives (aten/src/ATen/native/TensorFactories.cpp `empty_like`), with
    the same shape, dtype and layout, and neither copies `requires_grad`. Under FakeTensorMode `empty` skips
    converting each meta-built input into a FakeTensor first (measured 0.14 -> 0.05 CPU s for
    xlnet-large-cased's 414 tensors)."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        # plain tensors only: a tensor subclass (FSDP2's DTensor parameters) keeps its type through empty_like
        if type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.is_contiguous():
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return torch.empty_like(t, device=device)

    return empty


def _to_meta_tied(module: nn.Module) -> nn.Module:
    aliases = shared_parameter_names(module)
    module.to("meta")
    _retie(module, aliases)
    return module


def _same_layout(a: nn.Module, b: nn.Module) -> bool:
    shapes_a = [(n, tuple(p.shape), p.dtype) for n, p in a.named_parameters(remove_duplicate=False)]
    shapes_b = [(n, tuple(p.shape), p.dtype) for n, p in b.named_parameters(remove_duplicate=False)]
    return sorted(shapes_a, key=lambda t: t[0]) == sorted(shapes_b, key=lambda t: t[0])


def _match_parameters(user: nn.Module, twin: nn.Module) -> None:
    """Give `twin` the user's sharing and `requires_grad`, name by name.

    Both are walked with `named_parameters(remove_duplicate=False)`, so a tied parameter
    (one object under two names) cannot shift the pairing, and a head the user untied (or tied)
    is untied (or tied) in the twin too.
    """
    chosen: dict[int, nn.Parameter] = {}  # id(user param) -> twin param
    used: set[int] = set()
    for name, p in user.named_parameters(remove_duplicate=False):
        twin_p = chosen.get(id(p))
        if twin_p is None:
            twin_p = twin.get_parameter(name)
            if id(twin_p) in used:  # tied in the twin, separate in the user's module
                twin_p = nn.Parameter(torch.empty_like(twin_p), requires_grad=p.requires_grad)
            twin_p.requires_grad_(p.requires_grad)
            chosen[id(p)] = twin_p
            used.add(id(twin_p))
        _set_parameter(twin, name, twin_p)


def _meta_deepcopy(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are fresh meta tensors; no weight is copied.

    `copy.deepcopy` takes each parameter and buffer from the memo, so a tensor shared by two
    modules is one meta tensor in the copy, as in the original.
    """
    import copy

    memo: dict[int, Any] = {}
    keep_alive = []
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        keep_alive.append(p)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
        keep_alive.append(b)
    return copy.deepcopy(module, memo)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A meta-device twin of the user's module; the user's weights are never touched or copied.

    A Hugging Face model is rebuilt from its config (same class, no weights) and given the
    user's tying and `requires_grad` name by name; when its parameters differ from the user's
    (a resized or added layer) or for any other module, the module is deep-copied with every
    parameter and buffer replaced by a meta tensor.
    """
    import copy

    config = getattr(module, "config", None)
    from_config = getattr(type(module), "_from_config", None)
    if config is not None and from_config is not None:
        dtype = next((p.dtype for p in module.parameters()), None)
        with _meta_init():
            twin = from_config(copy.deepcopy(config), **({"dtype": dtype} if dtype is not None else {}))
        if _same_layout(module, twin):
            _match_parameters(module, twin)
            return twin
    return _meta_deepcopy(module)


def _untie_as_loaded(model: nn.Module, config: Any) -> None:
    """Untie the LM head of a T5 v1.1 / Flan-T5 model, as `from_pretrained` leaves it.

    transformers 5 forces `tie_word_embeddings=True` on T5 configs and keeps the hub's `False`
    only as `scale_decoder_outputs` (`T5Config.__post_init__`, also UMT5/LongT5), so
    `from_config` ties `lm_head.weight` to `shared.weight`. These checkpoints store a distinct
    `lm_head.weight`; `PreTrainedModel.tie_weights(missing_keys=...)` finds both present with
    different values and does not tie them ("we will NOT tie them"). The loaded model has its own
    head (Flan-T5-base: 247,577,856 parameters, not 222,903,552).
    """
    if getattr(config, "scale_decoder_outputs", True) is not False:
        return
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is None or inp is None or out.weight is not inp.weight:
        return
    out.weight = nn.Parameter(torch.empty_like(out.weight, device="meta"), requires_grad=out.weight.requires_grad)


def build_meta_model(setup: TrainSetup, spec: ModelSpec | None = None) -> nn.Module:
    """Build the task model of `setup` on the meta device (no weights, no memory).

    Tied parameters are one parameter, as in the model `from_pretrained` loads.
    """
    import transformers

    spec = spec or resolve_config(setup.model)
    if isinstance(setup.model, nn.Module):
        return _meta_copy(setup.model)
    import copy

    config = copy.deepcopy(spec.config)  # the head settings below must not reach a caller's (or a live model's) config
    task = setup.task or _task_of_config(spec.config)[0]  # a setup memfit.models.resolve has not seen: the default
    if task in ("seq-cls", "token-cls", "image-cls"):
        config.num_labels = setup.num_labels  # image-cls: a new head of num_labels classes, as fine-tuning sets
        if task == "seq-cls" and setup.num_labels > 1 and getattr(config, "problem_type", None) is None:
            # what most heads set on their first forward with integer labels; DeBERTa-v2 otherwise
            # takes a `labels.nonzero()` path whose output size depends on the data
            config.problem_type = "single_label_classification"
    if task == "ctc" and getattr(config, "layerdrop", 0.0):
        # LayerDrop skips encoder layers at random (a host draw per layer); run_speech_recognition_ctc.py sets
        # `layerdrop` 0.0 unless asked, and a step that skips none is the one that needs the most memory
        config.layerdrop = 0.0
    if setup.attn_implementation is not None:
        config._attn_implementation = setup.attn_implementation
    if getattr(config, "pad_token_id", None) is None and task == "seq-cls":
        # Trainer users must set it for batch > 1 (GPT-2/Llama seq-cls); it does not change memory.
        config.pad_token_id = 0
    auto = getattr(transformers, TASKS[task])
    dtype = _WEIGHT_DTYPES.get(setup.weights_dtype)
    if setup.weights_dtype == "auto":
        # from_pretrained's dtype "auto" (transformers 5's default): the config's dtype, else the checkpoint's
        # weights' dtype (modeling_utils.py `_get_dtype`), which a vision-language config without a top-level
        # dtype records in its text_config (Qwen3-VL: "dtype": "bfloat16" there, BF16 safetensors)
        text = getattr(config, "text_config", None)
        dtype = getattr(config, "dtype", None) or getattr(text, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float32)
    try:
        with _meta_init():
            model = auto.from_config(config, dtype=dtype)
    except ValueError as err:
        from memfit.errors import first_line

        media = [k for k in ("vision_config", "audio_config", "speech_config") if getattr(config, k, None) is not None]
        if media:  # an image-text / audio-text model: no text task fits, and memfit models none of its own yet
            raise MemfitError(
                f"`{spec.name}` ({config.model_type}) is a multimodal model (its config has `{media[0]}`): transformers "
                f"{transformers.__version__} has no `{task}` head for it ({first_line(err)}), and memfit does not "
                "model its image / audio + text inputs yet; estimate its language model alone (its `text_config`)"
            ) from err
        raise MemfitError(
            f"`{spec.name}` ({config.model_type}) has no `{task}` head in transformers "
            f"{transformers.__version__}: {first_line(err)}. Choose another --task"
        ) from err
    if any(not p.is_meta for p in model.parameters()):
        _to_meta_tied(model)  # a parameter made outside both the device context and register_parameter
    _untie_as_loaded(model, config)
    return model


# -- the task a model is fine-tuned for when none is given --------------------------------------

#: Class-name endings of a head -> the task of that head (a module, or a checkpoint already
#: fine-tuned with it). Order matters: `ForConditionalGeneration` before `LMHeadModel`.
_HEAD_SUFFIXES = (
    ("ForSequenceClassification", "seq-cls"), ("ForTokenClassification", "token-cls"),
    ("ForQuestionAnswering", "qa"), ("ForMaskedLM", "mlm"), ("ForCausalLM", "causal-lm"),
    ("ForImageClassification", "image-cls"),
    ("ForConditionalGeneration", "seq2seq-lm"), ("ForSeq2SeqLM", "seq2seq-lm"), ("LMHeadModel", "causal-lm"),
)
#: Fine-tuned checkpoints keep their head: a config whose architecture is one of these keeps its task.
_FINE_TUNED_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
#: Pretrained with bidirectional context (permutation LM, XLNet paper sec. 2.2) though its head class
#: is `XLNetLMHeadModel`: fine-tuned like BERT, for classification (the paper's GLUE/RACE results).
_BIDIRECTIONAL_LM_TYPES = frozenset({"xlnet"})


def default_task(model: Any) -> tuple[str, str]:
    """The task memfit simulates when none is given, and why (a sentence for the report's notes).

    An `nn.Module` has its head: its class decides (`GPT2LMHeadModel` -> causal-lm). For a config
    (hub id, directory, `PretrainedConfig`), the fine-tuning people do with that model:
    an encoder-decoder (`is_encoder_decoder`: T5, BART) -> seq2seq-lm; a decoder-only language
    model (architecture `*ForCausalLM`, or the causal-LM class of a model type that has no
    masked-LM head: GPT-2's `GPT2LMHeadModel`) -> causal-lm; a checkpoint already fine-tuned for
    classification, tokens or QA keeps that head; encoders (`*ForMaskedLM`, `*ForPreTraining`,
    XLNet, a bare `*Model`) -> seq-cls, the usual fine-tuning of an encoder.
    """
    if isinstance(model, nn.Module):
        name = type(getattr(model, "module", model)).__name__
        from transformers.models.auto import modeling_auto

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if name.endswith("ForConditionalGeneration") and model_type in modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
            return "speech-seq2seq", f"task `speech-seq2seq` is the head of the model class `{name}`"
        if name.endswith("ForCTC"):
            return "ctc", f"task `ctc` is the head of the model class `{name}`"
        for suffix, task in _HEAD_SUFFIXES:
            if suffix in name:
                return task, f"task `{task}` is the head of the model class `{name}`"
        return "seq-cls", f"task `seq-cls` assumed: the head of model class `{name}` is not one memfit knows"
    config = resolve_config(model).config
    return _task_of_config(config)


def _task_of_config(config: Any) -> tuple[str, str]:
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", "")
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else None
    said = f"the config's architectures (`{arch}`)" if arch else f"its model type (`{model_type}`, no architectures)"
    why = "; pass --task to choose another"
    if arch and arch.endswith(_FINE_TUNED_SUFFIXES):
        task = next(t for s, t in _HEAD_SUFFIXES if arch.endswith(s))
        return task, f"task `{task}` chosen from {said}{why}"
    # image and speech models, by the Auto classes transformers maps their model type to
    if getattr(config, "vision_config", None) is not None \
            and model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return ("image-text-to-text", f"task `image-text-to-text` chosen from {said}: a vision-language model{why}")
    if model_type in modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return "speech-seq2seq", f"task `speech-seq2seq` chosen from {said}: a speech encoder-decoder{why}"
    if model_type in modeling_auto.MODEL_FOR_CTC_MAPPING_NAMES and not (arch or "").endswith(
            ("ForSequenceClassification", "ForAudioFrameClassification", "ForXVector")):
        # wav2vec2 / HuBERT checkpoints, pretrained (`*ForPreTraining`, `*Model`) or CTC-fine-tuned: speech
        # recognition with a CTC head, as transformers' run_speech_recognition_ctc.py fine-tunes them
        return "ctc", f"task `ctc` chosen from {said}: a speech encoder, fine-tuned with a CTC head{why}"
    if (model_type in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
            and model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        return "image-cls", f"task `image-cls` chosen from {said}: an image encoder{why}"
    if getattr(config, "is_encoder_decoder", False) and model_type in modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq-lm", f"task `seq2seq-lm` chosen from {said}: an encoder-decoder{why}"
    causal_class = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    encoder = model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in _BIDIRECTIONAL_LM_TYPES
    if (arch or "").endswith("ForCausalLM") or (causal_class is not None and not encoder and arch in (None, causal_class)):
        return "causal-lm", f"task `causal-lm` chosen from {said}: a decoder-only language model{why}"
    return "seq-cls", f"task `seq-cls` chosen from {said}: an encoder, fine-tuned with a classification head{why}"
