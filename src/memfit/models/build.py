"""Turn what the user names as a model into a module built on the meta device.

A model is a hub id (bundled configs work offline; others are fetched with `AutoConfig`
when online), a local directory holding `config.json`, a `PretrainedConfig`, or an
`nn.Module`. Weights are never loaded: `from_config` runs under `torch.device("meta")`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.train_setup import TASKS, TrainSetup

__all__ = ["ModelSpec", "resolve_config", "build_meta_model"]

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
    try:
        with _quiet_hub():
            return ModelSpec(name, AutoConfig.from_pretrained(name), "hub")
    except Exception as err:  # offline, unknown id, gated repo, unknown model_type ...
        shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
        raise MemfitError(
            f"model `{name}` is not bundled and its config could not be fetched ({type(err).__name__}). "
            f"Bundled ids work offline: {shown} (`memfit estimate --list-models` shows all). "
            "Otherwise pass a directory or a config.json file of the model"
        ) from err


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


def _meta_copy(module: nn.Module) -> nn.Module:
    """A meta-device twin of the user's module; the user's weights are never touched.

    A Hugging Face model is rebuilt from its config (same class, no weights); any other module
    is deep-copied and moved to meta (its memory is briefly duplicated on the host).
    """
    import copy

    from accelerate import init_empty_weights

    config = getattr(module, "config", None)
    from_config = getattr(type(module), "_from_config", None)
    if config is not None and from_config is not None:
        dtype = next((p.dtype for p in module.parameters()), None)
        with init_empty_weights(), torch.device("meta"):
            twin = from_config(copy.deepcopy(config), **({"dtype": dtype} if dtype is not None else {}))
        for p_user, p_twin in zip(module.parameters(), twin.parameters()):
            p_twin.requires_grad_(p_user.requires_grad)
        return twin
    return copy.deepcopy(module).to("meta")


def build_meta_model(setup: TrainSetup, spec: ModelSpec | None = None) -> nn.Module:
    """Build the task model of `setup` on the meta device (no weights, no memory)."""
    import transformers

    spec = spec or resolve_config(setup.model)
    if isinstance(setup.model, nn.Module):
        return _meta_copy(setup.model)
    config = spec.config
    if setup.task in ("seq-cls", "token-cls"):
        config.num_labels = setup.num_labels
        if setup.task == "seq-cls" and setup.num_labels > 1 and getattr(config, "problem_type", None) is None:
            # what most heads set on their first forward with integer labels; DeBERTa-v2 otherwise
            # takes a `labels.nonzero()` path whose output size depends on the data
            config.problem_type = "single_label_classification"
    if setup.attn_implementation is not None:
        config._attn_implementation = setup.attn_implementation
    if getattr(config, "pad_token_id", None) is None and setup.task == "seq-cls":
        # Trainer users must set it for batch > 1 (GPT-2/Llama seq-cls); it does not change memory.
        config.pad_token_id = 0
    from accelerate import init_empty_weights

    auto = getattr(transformers, TASKS[setup.task])
    dtype = _WEIGHT_DTYPES.get(setup.weights_dtype)
    if setup.weights_dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float32)
    try:
        # accelerate's init_empty_weights puts parameters on the meta device as they are
        # registered, even those a model creates with torch.FloatTensor(...) (XLNet)
        with init_empty_weights(), torch.device("meta"):
            model = auto.from_config(config, dtype=dtype)
        if any(not p.is_meta for p in model.parameters()):
            model = model.to("meta")  # e.g. XLNet creates some weights with torch.FloatTensor(...) on the CPU
    except ValueError as err:
        raise MemfitError(
            f"`{spec.name}` ({config.model_type}) has no `{setup.task}` head in transformers "
            f"{transformers.__version__}: {str(err).splitlines()[0][:160]}. Choose another --task"
        ) from err
    return model
