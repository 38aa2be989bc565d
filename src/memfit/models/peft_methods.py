"""peft methods beyond plain LoRA: a peft config read from a dict, validated, and built by peft's own
`get_peft_model` on the meta model.

`TrainSetup(peft_config={...})` takes what peft's `get_peft_config` reads (peft 0.21 mapping.py: the
`PEFT_TYPE_TO_CONFIG_MAPPING[config_dict["peft_type"]](**config_dict)`), i.e. the content of an
`adapter_config.json`: `{"peft_type": "IA3", "target_modules": [...], ...}`, or a `PeftConfig` object. LoRA keeps
its own fields (`lora_r`, ...; `use_dora` for DoRA). Every method peft builds runs as peft's real code: its layers
are created on the meta device (`with torch.device("meta")`) and the forward and backward are peft's modules under
fake tensors, like the base model's.

Methods whose forward reads tensor values (a data-dependent shape or a Python branch on a value) cannot run under
fake tensors; `FAKE_UNSUPPORTED` names them with the reason and `apply_peft` refuses them with one line. They were
found by running every peft type on a tiny Llama under fake tensors (tests/models/test_peft_methods.py checks the list).
"""

from __future__ import annotations

import json
from typing import Any

from memfit.errors import MemfitError, first_line
from memfit.train_setup import suggest_name

#: peft types whose training step cannot run under fake tensors, and why (peft 0.21.2 sources, each checked by
#: tests/models/test_peft_methods.py::test_unsupported_methods_fail_under_fake_tensors).
FAKE_UNSUPPORTED: dict[str, str] = {
    "ADAMSS": "its adapters are initialized from an SVD of the base weights, which needs their values "
              "(tuners/adamss/layer.py `update_layer` -> utils.py `clustering_Z`: `VT.detach().cpu().numpy()`)",
    "FROD": "its projections are a decomposition of the base weights, which needs their values "
            "(tuners/frod/model.py `_init_frod_projections`)",
    "SHIRA": "the number of trainable entries is the number of nonzeros of its mask, a data-dependent size "
             "(tuners/shira/layer.py `update_layer`: `torch.where(mask == 1.0)`)",
    "UNILORA": "it counts how often each index is used (`torch.bincount`, a data-dependent size; "
               "tuners/unilora/model.py)",
    "WAVEFT": "its forward selects entries by a boolean mask, a data-dependent size "
              "(tuners/waveft/layer.py `get_delta_weight`: `padded_indices[:, valid_mask]`)",
    "VBLORA": "its forward branches on a tensor value (tuners/vblora/layer.py `_get_lora_matrices`: "
              "`if self.training and vblora_logits_A[0, 0].isinf().any()`)",
}

#: peft types memfit does not build (they need more than a config: several adapters or a second model).
NOT_BUILT: dict[str, str] = {
    "XLORA": "X-LoRA mixes several trained LoRA adapters loaded from checkpoints (`adapters` paths)",
    "POLY": "Poly routes between several adapters per task id (`task_ids` in every batch)",
    "MULTITASK_PROMPT_TUNING": "multitask prompt tuning needs `task_ids` in every batch",
    "CPT": "CPT needs token type masks in every batch (`input_type_mask`)",
    "CARTRIDGE": "Cartridge initializes its KV prefix from the model run on text",
}

#: TrainSetup.task -> peft TaskType (what memfit's LoRA always passed); prompt-learning methods need it, since
#: get_peft_model only builds PeftModelForCausalLM & co. (which insert the prompts) for a task type.
TASK_TYPES = {"seq-cls": "SEQ_CLS", "token-cls": "TOKEN_CLS", "qa": "QUESTION_ANS", "causal-lm": "CAUSAL_LM",
              "seq2seq-lm": "SEQ_2_SEQ_LM", "image-text-to-text": "CAUSAL_LM"}
#: LoRA's modules of a vision-language model when none are named: the language model's query and value projections,
#: as the Hugging Face cookbook's "Fine-Tuning a Vision Language Model (Qwen2-VL-7B) with TRL" sets them
#: (`LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")`); Qwen2.5-VL's vision tower names
#: its attention `qkv` / `proj`, so the adapters sit in the language model only (TRL's and peft's common recipe).
VLM_LORA_TARGETS = ["q_proj", "v_proj"]


def _jsonable(value: Any) -> Any:
    """A config value as JSON holds it (enums by value, sets as sorted lists), so the setup can be cached."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and type(value).__module__.startswith("peft"):  # PeftType, TaskType
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "to_dict"):  # nested configs (LoftQConfig, EvaConfig, ...)
        return _jsonable(value.to_dict())
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return _jsonable(dataclasses.asdict(value))
    raise MemfitError(f"`peft_config` value `{value!r}` cannot be read; use JSON values (strings, numbers, lists)")


def normalize_peft_config(config: Any, *, source: str = "the arguments") -> tuple[dict[str, Any], list[str]]:
    """The peft config as a plain dict, checked by building it with peft (one-line MemfitErrors), and notes.

    A key that this method's config class does not take but another peft config class does (`exclude_modules` or
    `alpha_pattern` in an adapter_config.json written by another peft version) is dropped with a note, as peft's
    own `PeftConfig.from_peft_type` (config.py) drops unexpected keys with a warning when it loads such a file; any
    other unknown key is an error.

    Args:
        config: a dict (an adapter_config.json's content), a JSON string, or a peft `PeftConfig`.
        source: where it came from, for the messages.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as err:
            raise MemfitError(f"`peft_config` in {source} is not a JSON object ({err.msg}); pass a dict") from err
    if hasattr(config, "to_dict") and not isinstance(config, dict):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise MemfitError(f"`peft_config` in {source} must be a dict with `peft_type`; got `{type(config).__name__}`")
    data = _jsonable(config)
    notes = []
    cls = _config_class(data, source)
    if cls is not None:
        own = _field_names(cls)
        dropped = sorted(k for k in data if k not in own and k in _all_peft_field_names())
        if dropped:
            data = {k: v for k, v in data.items() if k not in dropped}
            notes.append(f"`peft_config` keys {', '.join(f'`{k}`' for k in dropped)} are not fields of "
                         f"{cls.__name__} in the installed peft and were ignored, as peft ignores them when it "
                         "loads such an adapter_config.json")
    build_config(data, source=source)
    return data, notes


def _field_names(cls) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def _all_peft_field_names() -> set[str]:
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return set().union(*(_field_names(c) for c in PEFT_TYPE_TO_CONFIG_MAPPING.values()))


def _config_class(data: dict[str, Any], source: str):
    """The config class of `data["peft_type"]` (None when absent or unknown: build_config names the error)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    known = {str(getattr(k, "value", k)): cls for k, cls in PEFT_TYPE_TO_CONFIG_MAPPING.items()}
    return known.get(str(data.get("peft_type", "")).upper())


def read_peft_config_file(path: str) -> dict[str, Any]:
    """The JSON object of an adapter_config.json (`path` or `path/adapter_config.json`); one-line MemfitErrors."""
    import os

    file = os.path.join(path, "adapter_config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError as err:
        raise MemfitError(f"peft config file `{file}` does not exist; pass an adapter_config.json") from err
    except (OSError, UnicodeDecodeError) as err:
        raise MemfitError(f"cannot read peft config file `{file}`: {err}") from err
    except json.JSONDecodeError as err:
        raise MemfitError(f"peft config file `{file}` is not JSON ({err.msg} at line {err.lineno})") from err
    if not isinstance(data, dict):
        raise MemfitError(f"peft config file `{file}` must hold a JSON object with `peft_type`; got a "
                          f"{type(data).__name__}")
    return data


def build_config(data: dict[str, Any], *, source: str = "the arguments", task: str | None = None):
    """peft's config object for `data` (peft's `get_peft_config`), errors converted to one-line MemfitErrors.

    Args:
        data: the config dict (`peft_type` and the config class's fields).
        source: where it came from, for the messages.
        task: TrainSetup.task; sets peft's `task_type` when the dict has none.
    """
    import dataclasses

    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    if not isinstance(data, dict):  # a setup not yet through models.resolve: a JSON string or a PeftConfig
        data = normalize_peft_config(data, source=source)[0]
    data = dict(data)
    known = {str(getattr(k, "value", k)): cls for k, cls in PEFT_TYPE_TO_CONFIG_MAPPING.items()}  # PeftType keys
    peft_type = data.get("peft_type")
    if peft_type is None:
        raise MemfitError(f"`peft_config` in {source} has no `peft_type`; add e.g. `\"peft_type\": \"IA3\"` "
                          f"(one of {', '.join(sorted(known))})")
    key = str(peft_type).upper()
    if key not in known:
        raise MemfitError(f"unknown peft_type `{peft_type}` in {source}{suggest_name(key, set(known))}; peft "
                          f"knows {', '.join(sorted(known))}")
    if key in NOT_BUILT:
        raise MemfitError(f"peft_type `{key}` is not modelled: {NOT_BUILT[key]}")
    cls = known[key]
    names = {f.name for f in dataclasses.fields(cls)}
    for name in data:
        if name not in names:
            raise MemfitError(f"unknown key `{name}` for peft_type `{key}` in {source}{suggest_name(name, names)}; "
                              f"{cls.__name__} takes {', '.join(sorted(n for n in names if not n.startswith('_')))}")
    data["peft_type"] = key
    if task is not None and data.get("task_type") is None and task in TASK_TYPES:
        data["task_type"] = TASK_TYPES[task]
    try:
        return cls(**data)
    except (TypeError, ValueError, KeyError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MemfitError(f"peft rejects `peft_config` ({key}) in {source}: {first[:300]}") from err


#: peft types whose spliced simulation (memfit.sim.splice: 5 blocks simulated, the rest repeated) equals the full one,
#: checked on an 8-layer Llama (tests/models/test_peft_methods.py). Not in it, for a reason: ADALORA (its forward adds
#: an orthogonality loss over the adapters of every block at once), TINYLORA (its weight tying shares one vector across
#: blocks), ADAPTION_PROMPT (its prompts sit in the top blocks, which the cut removes), SHADOW (its carrier modules
#: cannot be deep-copied for the cut). Others are simulated in full.
SPLICE_OK = frozenset({
    "BEFT", "BOFT", "C3A", "DEFT", "DELORA", "FOURIERFT", "GLORA", "GRALORA", "HIRA", "HRA", "IA3", "LILY",
    "LN_TUNING", "LOHA", "LOKR", "LORA", "MISS", "OFT", "OSF", "PEANUT", "PREFIX_TUNING", "PROMPT_TUNING",
    "P_TUNING", "PSOFT", "PVERA", "RANDLORA", "ROAD", "SUPERTUNING", "TRAINABLE_TOKENS", "VERA",
})


def splice_allowed(setup: Any) -> bool:
    """Whether the repeated blocks of a model with this setup's peft method may be simulated once (SPLICE_OK)."""
    kind = peft_type_of(setup)
    return kind is None or kind in SPLICE_OK


def peft_type_of(setup: Any) -> str | None:
    """`LORA` for the LoRA fields, the peft_config's type, or None when the full model trains."""
    if getattr(setup, "peft_config", None):
        return str(setup.peft_config["peft_type"]).upper()
    return "LORA" if setup.lora_r is not None else None


def is_prompt_learning(setup: Any) -> bool:
    """Prompt tuning, p-tuning, prefix tuning: virtual tokens are added to every sequence (peft PromptLearningConfig)."""
    kind = peft_type_of(setup)
    return kind in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "CPT")


def setup_config(setup: Any):
    """peft's config for `setup`: its LoRA fields (with `use_dora`) or its `peft_config`."""
    if getattr(setup, "peft_config", None):
        return build_config(setup.peft_config, task=setup.task)
    from peft import LoraConfig

    return LoraConfig(r=setup.lora_r, lora_alpha=setup.lora_alpha, lora_dropout=setup.lora_dropout,
                      target_modules=lora_targets(setup.lora_target_modules or (
                          VLM_LORA_TARGETS if setup.task == "image-text-to-text" else None)),
                      task_type=TASK_TYPES.get(setup.task),
                      use_dora=bool(getattr(setup, "use_dora", False)))


def lora_targets(targets: Any) -> Any:
    """`lora_target_modules` as peft takes it: peft's shorthand `all-linear` (peft.utils
    INCLUDE_LINEAR_LAYERS_SHORTHAND: every linear layer but the output head, tuners_utils.py
    `_maybe_include_all_linear_layers`) and a regex are strings there, not lists; `--lora-target-modules all-linear`
    gives the one-element list `["all-linear"]`."""
    from peft.utils import INCLUDE_LINEAR_LAYERS_SHORTHAND

    if isinstance(targets, (list, tuple)) and len(targets) == 1 \
            and targets[0].lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND:
        return INCLUDE_LINEAR_LAYERS_SHORTHAND
    return targets


def apply_peft(model, setup: Any):
    """peft's `get_peft_model(model, config)` with the layers created on the meta device.

    Args:
        model: the meta model.
        setup: the TrainSetup (its LoRA fields or `peft_config`).
    """
    import torch
    from peft import get_peft_model
    from torch import nn

    cfg = setup_config(setup)
    kind = str(getattr(cfg.peft_type, "value", cfg.peft_type))
    if getattr(setup, "load_in_4bit", False) or getattr(setup, "load_in_8bit", False):
        _check_quantized_base(cfg, kind)
    if kind in FAKE_UNSUPPORTED:
        raise MemfitError(f"peft method {kind} cannot be simulated under fake tensors: {FAKE_UNSUPPORTED[kind]}; "
                          "estimate a method of the same size instead (LoRA of the same rank and targets)")
    from memfit.models._peft_adapter import build_patches

    try:
        with torch.device("meta"), build_patches():
            return get_peft_model(model, cfg)
    except (ValueError, TypeError, KeyError, NotImplementedError, RuntimeError) as err:
        first = first_line(err)
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        if "target_modules" in str(err) or "Please specify" in str(err):
            # peft has no default targets for many new model types (qwen3_moe, olmoe, gpt_oss, deepseek_v2,
            # olmo2, smollm3: TRANSFORMERS_MODELS_TO_*_TARGET_MODULES_MAPPING); name this model's own
            example = ",".join(n for n in ("q_proj", "v_proj") if n in linear) or ",".join(linear[:2]) or "query,value"
            where = "`--lora-target-modules`" if kind == "LORA" and not getattr(setup, "peft_config", None) \
                else "`target_modules` in the peft config"
            label = "LoRA" if kind == "LORA" else kind
            raise MemfitError(f"{label} cannot wrap this model: {first}. Name the modules with {where} (e.g. "
                              f"`{example}`; its linear layers: {', '.join(linear[:12])})") from err
        raise MemfitError(f"peft cannot build {kind} on this model: {first}") from err


def materialize_plain_tensors(model, *, device: str) -> int:
    """Give the meta tensors peft keeps in plain attributes (not parameters or buffers, so `to_empty` skips them)
    storage on `device`, zero-filled; returns how many.

    peft 0.21 keeps some index tensors so: `PeftModel.prompt_tokens[adapter]` (peft_model.py
    `_setup_prompt_encoder`: `torch.arange(num_virtual_tokens * num_transformer_submodules)`), FourierFT's
    `indices[adapter]` (tuners/fourierft/layer.py `update_layer`). On a GPU they stay on the host and each forward
    copies them to the device (`.to(device)` in `get_prompt` / `get_delta_weight`): B x virtual tokens resp.
    2 x n_frequency int64 temporaries, which memfit, whose device is the CPU, does not see (a few KiB).

    Args:
        model: the peft model after `to_empty`.
        device: where memfit's simulated device tensors live (the CPU; a FakeTensor under FakeTensorMode).
    """
    import torch

    count = 0
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(module, name, torch.zeros(value.shape, dtype=value.dtype, device=device))
                count += 1
            elif isinstance(value, dict):
                for key, item in list(value.items()):
                    if isinstance(item, torch.Tensor) and item.is_meta:
                        value[key] = torch.zeros(item.shape, dtype=item.dtype, device=device)
                        count += 1
    return count


#: peft types that leave the (quantized) Linear layers alone: virtual tokens, norms, embedding rows.
_NO_LINEAR_WRAP = frozenset({"PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "LN_TUNING", "TRAINABLE_TOKENS"})


def quantized_peft_types() -> list[str]:
    """The peft types peft 0.21 has bitsandbytes layers for (a `bnb` module in their tuner package: LoRA,
    AdaLoRA, IA3, HiRA, PVeRA, RandLoRA, RoAd), plus those that wrap no Linear layer."""
    import importlib.util

    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    out = set(_NO_LINEAR_WRAP)
    for key, tuner in PEFT_TYPE_TO_TUNER_MAPPING.items():
        package = tuner.__module__.rsplit(".", 1)[0]
        if importlib.util.find_spec(f"{package}.bnb") is not None:
            out.add(str(getattr(key, "value", key)))
    return sorted(out)


def _check_quantized_base(cfg, kind: str) -> None:
    """A peft method without bitsandbytes layers on 4-/8-bit weights: peft wraps the Linear4bit as a plain Linear
    and computes with its packed storage (its tuner has no `bnb.py` dispatcher); a one-line error instead."""
    allowed = quantized_peft_types()
    if kind not in allowed:
        raise MemfitError(f"peft method {kind} on 4-/8-bit weights is not modelled: peft has no bitsandbytes layer "
                          f"for it (no peft.tuners.*.bnb module); use one of {', '.join(allowed)}, or drop "
                          "`load_in_4bit`/`load_in_8bit`")


def peft_notes(setup: Any) -> list[str]:
    """What the report should say about the setup's peft method: what memfit simulates differently from a GPU run."""
    if not getattr(setup, "peft_config", None):
        return []
    cfg = setup.peft_config
    kind = str(cfg.get("peft_type", "")).upper()
    notes = []
    if is_prompt_learning(setup):
        notes.append(f"{kind}: peft adds virtual tokens to every sequence (num_virtual_tokens "
                     f"`{cfg.get('num_virtual_tokens')}`); the step runs them on top of the padded length")
    if kind == "ADALORA":
        notes.append("AdaLoRA's rank reallocation is not simulated: `update_and_allocate`, which the training loop calls "
                     "after each step, keeps three tensors the size of each adapter parameter on the device (peft "
                     "tuners/adalora/layer.py RankAllocator: ipt, exp_avg_ipt, exp_avg_unc)")
    if kind in ("LOHA", "LOKR") and float(cfg.get("module_dropout") or 0) > 0:
        notes.append(f"{kind} module_dropout `{cfg['module_dropout']}`: simulated as a step that runs the adapter "
                     "(a real step skips it at random, using less memory)")
    if kind == "BOFT":
        notes.append("BOFT: peft's CUDA extension fbd_cuda (used on a GPU when it compiles) is not emulated; its "
                     "torch fallback (torch.block_diag) is simulated")
    return notes
