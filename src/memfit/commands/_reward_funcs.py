"""`memfit train --trainer grpo|rloo --reward-func SPEC`: the reward functions of GRPOTrainer (RLOOTrainer calls and
loads them the same way), named as TRL users name them.

A SPEC is one of

- `module:function`: a function of an importable module (`trl.rewards:think_format_reward`, TRL 1.16's
  `trl.rewards` exports accuracy_reward, reasoning_accuracy_reward, think_format_reward,
  get_soft_overlong_punishment, get_repetition_penalty_reward, get_cosine_scaled_reward: the `get_` ones build a
  function and are not reward functions themselves);
- `path/to/file.py:function`: a function of the user's own file, loaded with importlib from that file;
- a local directory of a sequence-classification reward model: GRPOTrainer takes a model id string and loads it with
  `AutoModelForSequenceClassification.from_pretrained(id, num_labels=1)` and its tokenizer with
  `AutoTokenizer.from_pretrained(id)` (grpo_trainer.py `__init__`, "Reward functions" / "Reward processing class").

Each is checked before any model is loaded; every bad SPEC is a one-line MemfitError naming it and the fix. A reward
function is called by GRPOTrainer as `f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
log_extra=..., log_metric=..., <every other dataset column>=...)` (grpo_trainer.py `_calculate_rewards`), so it must
take those names (a `**kwargs` does). A reward model scores `prompt + completion` decoded and tokenized again with
its own tokenizer, so a tokenizer of other ids than its embeddings is an error (an id past the embedding stops the
run after the first generation); a tokenizer merely different from the policy's is what TRL expects.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from memfit.errors import MemfitError, first_line

__all__ = ["RewardFunc", "read_reward_funcs", "read_reward_func", "REWARD_CALL_NAMES"]

#: The keyword arguments GRPOTrainer passes to every reward function besides the dataset's columns (TRL 1.16
#: grpo_trainer.py `_calculate_rewards`; `environments` only with an environment_factory, which memfit train has not).
REWARD_CALL_NAMES = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")

_FORMS = "`module:function`, `path/to/file.py:function` or a local reward model directory"


@dataclass(frozen=True)
class RewardFunc:
    """One checked `--reward-func`: a function (`kind` "function", `value` the callable) or a reward model directory
    (`kind` "model", `value` its path, which GRPOTrainer loads itself)."""

    spec: str
    kind: str
    value: Any
    #: what TRL logs it as: the function's __name__, the model directory's name
    name: str


def _load_file(spec: str, path: str) -> Any:
    if not os.path.isfile(path):
        raise MemfitError(f"--reward-func `{spec}`: the file `{path}` does not exist; give an existing .py file "
                          "(`path/to/file.py:function`)")
    module_name = "memfit_reward_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise MemfitError(f"--reward-func `{spec}`: `{path}` cannot be loaded as a Python module; give a .py file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses / pickling in the user's file look their module up here
    try:
        loader_spec.loader.exec_module(module)
    except SyntaxError as err:
        sys.modules.pop(module_name, None)
        raise MemfitError(f"--reward-func `{spec}`: `{path}` has a syntax error at line {err.lineno} ({err.msg}); "
                          "fix the file") from None
    except Exception as err:  # noqa: BLE001 - the user's code: any error while it is loaded, on one line
        sys.modules.pop(module_name, None)
        raise MemfitError(f"--reward-func `{spec}`: loading `{path}` raised {type(err).__name__}: {first_line(err)}; "
                          "fix the file") from None
    return module


def _load_module(spec: str, name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = err.name or name
        itself = name == missing or name.startswith(missing + ".")
        fix = (f"install it, or give a file as `path/to/{name.replace('.', '/')}.py:function`" if itself
               else f"install `{missing}`, which it imports")
        raise MemfitError(f"--reward-func `{spec}`: module `{name}` cannot be imported (No module named "
                          f"`{missing}`); {fix}") from None
    except Exception as err:  # noqa: BLE001 - any error while the module is imported, on one line
        raise MemfitError(f"--reward-func `{spec}`: importing `{name}` raised {type(err).__name__}: "
                          f"{first_line(err)}; fix the module or name another") from None


def _callable_names(module: Any) -> list[str]:
    """The public functions of `module` (through dir/getattr: `trl.rewards` is a lazy module)."""
    out = []
    for n in dir(module):
        if n.startswith("_"):
            continue
        try:
            value = getattr(module, n)
        except Exception:  # noqa: BLE001 - a lazy module's submodule that does not import: not a candidate
            continue
        if inspect.isfunction(value):
            out.append(n)
    return sorted(out)


def _annotation_text(p: inspect.Parameter) -> str:
    a = p.annotation
    return "" if a is p.empty else (a if isinstance(a, str) else repr(a)).replace(" ", "").replace("typing.", "")


def _check_signature(spec: str, func: Callable, columns: tuple[str, ...], conversational: bool | None,
                     trainer: str = "GRPOTrainer") -> None:
    """GRPOTrainer calls `func` with keywords only: REWARD_CALL_NAMES and the dataset's other columns; its
    `completions` are strings for string prompts and lists of one message for chat prompts
    (grpo_trainer.py `_generate` decodes them so), which an annotation of `completions` may say it needs."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature: TRL will call it as it is
        return
    wants = next((_annotation_text(p) for p in params if p.name == "completions"), "")
    if conversational is False and wants.startswith("list[list[dict"):  # trl.rewards' accuracy / format rewards
        raise MemfitError(f"--reward-func `{spec}` takes conversational completions (`completions: {wants}`, "
                          f"lists of messages) but the prompts of --data are strings, so {trainer} passes strings; "
                          "give the prompts as chat messages, or a reward function of strings")
    if conversational is True and wants in ("list[str]", "List[str]"):
        raise MemfitError(f"--reward-func `{spec}` takes completions as strings (`completions: {wants}`) but the "
                          f"prompts of --data are chat messages, so {trainer} passes lists of messages; give string "
                          "prompts, or a reward function of messages")
    passed = (*REWARD_CALL_NAMES, *columns)
    for p in params:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise MemfitError(f"--reward-func `{spec}`: its parameter `{p.name}` is positional-only; {trainer} "
                              "passes every argument by name: make it a normal parameter")
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in passed:
            raise MemfitError(f"--reward-func `{spec}` needs `{p.name}`, which {trainer} passes only from a dataset "
                              f"column of that name; add a `{p.name}` column to every example of --data (or give "
                              "the parameter a default)")
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    taken = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [n for n in passed if n not in taken]
    if missing:
        raise MemfitError(f"--reward-func `{spec}`: it takes no `{missing[0]}`; {trainer} calls a reward function "
                          f"as f({', '.join(f'{n}=...' for n in passed)}): add `**kwargs` to its parameters")


def _function(spec: str, columns: tuple[str, ...], conversational: bool | None,
              trainer: str = "GRPOTrainer") -> RewardFunc:
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise MemfitError(f"--reward-func `{spec}` names no function; give {_FORMS}")
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    module = _load_file(spec, where) if is_file else _load_module(spec, where)
    label = f"`{where}`"
    if not hasattr(module, attr):
        close = difflib.get_close_matches(attr, _callable_names(module), n=1)
        hint = f"did you mean `{where}:{close[0]}`?" if close else (
            "its functions: " + ", ".join(_callable_names(module)[:8]) if _callable_names(module)
            else "it defines no function")
        raise MemfitError(f"--reward-func `{spec}`: {label} has no `{attr}`; {hint}")
    func = getattr(module, attr)
    if not callable(func):
        raise MemfitError(f"--reward-func `{spec}`: `{attr}` in {label} is a {type(func).__name__}, not a function; "
                          "name a function that returns one reward per completion")
    if isinstance(func, type):
        raise MemfitError(f"--reward-func `{spec}`: `{attr}` in {label} is a class; name a function (or an "
                          "instance's module-level name) that returns one reward per completion")
    if attr.startswith("get_") and _takes_no_completions(func):  # trl.rewards' factories
        raise MemfitError(f"--reward-func `{spec}`: `{attr}` builds a reward function, it is not one; call it in "
                          f"a file of your own (`reward = {attr}(...)`) and give `that_file.py:reward`")
    _check_signature(spec, func, columns, conversational, trainer)
    return RewardFunc(spec=spec, kind="function", value=func, name=getattr(func, "__name__", attr))


def _takes_no_completions(func: Callable) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(p.name == "completions" or p.kind is p.VAR_KEYWORD for p in params)


def _reward_model(spec: str, conversational: bool | None, trainer: str = "GRPOTrainer") -> RewardFunc:
    """A local reward model directory, checked as GRPOTrainer will load it."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise MemfitError(f"--reward-func `{spec}` is a directory without config.json; give a reward model "
                          "directory (a sequence-classification model saved with save_pretrained)")
    try:
        config = AutoConfig.from_pretrained(spec)
    except (OSError, ValueError, KeyError) as err:
        raise MemfitError(f"--reward-func `{spec}`: its config.json cannot be read ({first_line(err)}); give a "
                          "reward model directory") from None
    classifiers = set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())
    archs = list(getattr(config, "architectures", None) or [])
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise MemfitError(f"--reward-func `{spec}`: model type `{config.model_type}` has no sequence-classification "
                          f"head in transformers, which {trainer} loads a reward model as; give a reward model")
    if archs and not any(a in classifiers for a in archs):
        raise MemfitError(f"--reward-func `{spec}` is a `{archs[0]}`, not a sequence-classification reward model: "
                          f"{trainer} would score with a new, random head; train a reward model first (TRL's "
                          "RewardTrainer) and give its directory")
    labels = getattr(config, "num_labels", 1)
    if labels != 1:
        raise MemfitError(f"--reward-func `{spec}` has {labels} labels; {trainer} loads a reward model with "
                          "num_labels=1 (one score per completion): give a reward model of one label")
    try:
        tok = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MemfitError(f"--reward-func `{spec}`: its tokenizer cannot be loaded ({first_line(err)}); {trainer} "
                          "loads the reward model's tokenizer from its directory: save the tokenizer it was trained "
                          "with there (tokenizer.save_pretrained)") from None
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if isinstance(rows, int) and len(tok) > rows:
        raise MemfitError(f"--reward-func `{spec}`: its tokenizer has {len(tok)} tokens but the reward model has "
                          f"{rows} token embeddings: another tokenizer than the one it was trained with "
                          "(ids past its embedding stop the run after the first generation); save the reward model's "
                          "own tokenizer in its directory")
    if conversational and not getattr(tok, "chat_template", None):  # grpo_trainer.py `_calculate_rewards`
        raise MemfitError(f"--reward-func `{spec}`: its tokenizer has no chat template, which {trainer} applies to "
                          "the chat prompt + completion before the reward model scores them; add `chat_template` to "
                          "its tokenizer_config.json, or give string prompts")
    if tok.pad_token_id is None and tok.eos_token_id is None:
        raise MemfitError(f"--reward-func `{spec}`: its tokenizer has neither a pad nor an EOS token; {trainer} "
                          "pads the scored texts with one (it sets pad to EOS when pad is missing): set `pad_token` "
                          "in its tokenizer_config.json")
    return RewardFunc(spec=spec, kind="model", value=spec, name=os.path.basename(os.path.normpath(spec)))


def read_reward_func(spec: str, columns: tuple[str, ...] = (), conversational: bool | None = None,
                     trainer: str = "GRPOTrainer") -> RewardFunc:
    """One `--reward-func SPEC`, checked (see the module docstring); a one-line MemfitError otherwise.

    Args:
        spec: `module:function`, `path/to/file.py:function` or a local reward model directory.
        columns: the dataset's columns besides `prompt`, which GRPOTrainer passes to reward functions by name.
        conversational: the prompts are chat messages (True), strings (False), or not known (None).
        trainer: the trainer class the messages name (`RLOOTrainer` calls and loads reward functions as
            GRPOTrainer does: rloo_trainer.py `__init__`, `_calculate_rewards`).
    """
    spec = str(spec).strip()
    if not spec:
        raise MemfitError(f"--reward-func is empty; give {_FORMS}")
    if os.path.isdir(spec):
        return _reward_model(spec, conversational, trainer)
    if ":" in spec and not (len(spec) > 1 and spec[1] == ":" and spec.count(":") == 1):  # `C:\dir` is a path
        return _function(spec, columns, conversational, trainer)
    if spec.endswith(".py"):
        raise MemfitError(f"--reward-func `{spec}` names a file but no function; give `{spec}:function`")
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        raise MemfitError(f"--reward-func `{spec}` is not a local directory; memfit train loads a reward model from "
                          f"a local directory (download it first: `hf download {spec} --local-dir DIR`, then "
                          "--reward-func DIR)")
    raise MemfitError(f"--reward-func `{spec}` is neither a function nor an existing directory; give {_FORMS}")


def read_reward_funcs(specs: list[str], columns: tuple[str, ...] = (), conversational: bool | None = None,
                      trainer: str = "GRPOTrainer") -> list[RewardFunc]:
    """Every `--reward-func`, in order, each checked (read_reward_func)."""
    return [read_reward_func(s, columns, conversational, trainer) for s in specs]
