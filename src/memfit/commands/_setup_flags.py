"""The setup flags of `memfit estimate`, `plan`, `train` and `diagnose --model`, made from the dataclass fields of
`memfit.TrainSetup` (and `memfit.parallel.ParallelSetup`'s world size, nodes and strategy), as transformers'
`HfArgumentParser` makes TrainingArguments' options:

* one option per field, spelled `--per-device-train-batch-size` and `--per_device_train_batch_size` (the
  underscore form parses but is left out of `--help`); today's short names (`--batch-size`, `--attn`, ...) are
  the aliases of ALIASES;
* the help is the field's attribute docstring (read from the source with `ast`, only when help is shown), with
  the default the verb applies;
* the type gives the value: int, float, text; `choices` come from the field's `metadata["choices"]` (PRECISIONS,
  OPTIMIZERS, ...); a bool field is a flag, with a `--no-` form when its default is not False
  (`--no-truncation`); a list is comma-separated (`list[int]` also `@FILE`); a dict is a JSON object;
* every default is None, "not given", so that an `--args` file and the flags merge as memfit.commands._args says
  (a flag that sets what the file sets wins, with a note).

Flags that are not fields of a setup record (`--gpu`, `--json`, `--args`, `--data`, ...) are declared by their verb.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from memfit.errors import MemfitError

__all__ = ["ALIASES", "NOT_FLAGS", "SETUP_FIELDS", "PARALLEL_FIELDS", "add_setup_flags", "add_parallel_flags",
           "setup_fields", "flag_name", "field_help", "split_list", "read_lengths", "setup_flag_fields"]

#: The short names memfit's flags had before they were made from the fields; each also parses as its field's
#: own `--field-name`. (`--no-truncation` and `--no-kbit-prep` are the `--no-` forms of their bool fields.)
ALIASES: dict[str, tuple[str, ...]] = {
    "per_device_train_batch_size": ("--batch-size",),
    "per_device_eval_batch_size": ("--eval-batch-size",),
    "gradient_accumulation_steps": ("--grad-accum",),
    "attn_implementation": ("--attn",),
    "use_liger_kernel": ("--liger",),
    "float8_recipe": ("--float8",),
    "bnb_4bit_use_double_quant": ("--double-quant",),
    "teacher_model": ("--teacher",),  # DistillationTrainer's teacher (`memfit train --trainer distill --teacher DIR`)
}

#: A bool flag that also takes an optional value for another field: `--packing [STRATEGY]` (SFT packing, with
#: SFTConfig.packing_strategy; `--packing` alone keeps the strategy `--packing-strategy` or the file gives).
_OPTIONAL_VALUE = {"packing": "packing_strategy"}

#: Flags whose value is a file that memfit reads: field -> (metavar, "module:reader").
_FILE_VALUE = {"peft_config": ("FILE", "memfit.models.peft_methods:read_peft_config_file")}

#: TrainSetup fields without a flag of their own, and why.
NOT_FLAGS = {
    "model": "the verb's MODEL argument (`diagnose --model`), declared by the verb",
    "compute_capability": "the target GPU's, set from --gpu by memfit.estimate",
    "notes": "memfit's own output (what it changed or assumed)",
}

#: ParallelSetup fields with a flag (the other multi-GPU settings come from --deepspeed / --fsdp-config files).
PARALLEL_FIELDS = ("world_size", "nodes", "strategy")

#: Where the flags' option spellings are recorded on the namespace (field -> the option string typed).
_TYPED = "_setup_flags_typed"


def _train_setup() -> type:
    from memfit.train_setup import TrainSetup

    return TrainSetup


def _setup_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(_train_setup()) if f.name not in NOT_FLAGS)


#: TrainSetup fields `memfit estimate`, `plan` and `diagnose --model` read from flags: all but NOT_FLAGS.
SETUP_FIELDS = _setup_field_names()


def _record(name: str) -> type:
    if name in PARALLEL_FIELDS:
        from memfit.parallel.setup import ParallelSetup

        return ParallelSetup
    return _train_setup()


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(_record(name)) if f.name == name)


def _kind(f: dataclasses.Field) -> str:
    """`int`, `float`, `str`, `bool`, `list[int]`, `list[str]` or `dict`, from the field's annotation (a string:
    the setup modules use postponed annotations)."""
    text = str(f.type).replace(" ", "")
    parts = [p for p in text.split("|") if p != "None"]
    if len(parts) != 1 or parts[0] not in ("int", "float", "str", "bool", "list[int]", "list[str]", "dict"):
        raise TypeError(f"setup field `{f.name}` has annotation `{f.type}`, which no flag parses; list it in NOT_FLAGS")
    return parts[0]


@lru_cache(maxsize=None)
def _docstrings(cls: type) -> dict[str, str]:
    """field -> its attribute docstring (the string literal after the field), one line."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


#: Choices listed in the metavar (`{fp32,fp16,bf16}`) up to this many; more are named in the help.
_SHOWN_CHOICES = 6


def field_help(name: str, default: str | None = None) -> str:
    """The help of `name`'s flag: its docstring, the choices a metavar hides, and the default (`default`, the
    verb's, else the field's own when it is a value)."""
    f = _field(name)
    text = _docstrings(_record(name)).get(name, "")
    choices = f.metadata.get("choices")
    if choices and len(choices) > _SHOWN_CHOICES:
        text += f" One of: {', '.join(choices)}."
    if name in _OPTIONAL_VALUE:  # `--packing [STRATEGY]`
        other = _OPTIONAL_VALUE[name]
        text += f" With a value, also {other}: {', '.join(_field(other).metadata['choices'])}."
    if default is None and f.default is not dataclasses.MISSING and f.default is not None \
            and not isinstance(f.default, bool) and _kind(f) in ("int", "float", "str"):
        default = str(f.default)
    if default is not None and f"default {default}" not in text and f"default is {default}" not in text:
        text += f" (default: {default})"
    return text.replace("%", "%%")  # argparse formats help with %


class _SetupFlag(argparse.Action):
    """Stores the field's value (a flag: True, its `--no-` form False) and records the option string typed, so
    that a message names the flag the user wrote (`--batch-size`, not `--per-device-train-batch-size`). The help
    is read from the docstrings when shown."""

    def __init__(self, option_strings, dest, *, negatives=(), verb_default=None, lazy_help=True, **kwargs):
        self.negatives = frozenset(negatives)
        self._verb_default = verb_default
        self._lazy_help = lazy_help
        super().__init__(option_strings, dest, **kwargs)

    @property  # type: ignore[override]
    def help(self):  # noqa: D401 - argparse reads `action.help`
        if self._lazy_help and self._help is None:
            return field_help(self.dest, self._verb_default)
        return self._help

    @help.setter
    def help(self, value):
        self._help = value

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.negatives:
            value = False
        elif self.nargs == 0:
            value = True
        else:
            value = values
        setattr(namespace, self.dest, value)
        typed = dict(getattr(namespace, _TYPED, None) or {})
        typed[self.dest] = option_string
        setattr(namespace, _TYPED, typed)


def _metavar(name: str, kind: str, choices: tuple | None) -> str | None:
    if name in _FILE_VALUE:
        return _FILE_VALUE[name][0]
    if choices:
        return None if len(choices) <= _SHOWN_CHOICES else name.rsplit("_", 1)[-1].upper()
    return {"int": "N", "float": "NUM", "list[int]": "N,N,...|@FILE", "list[str]": "NAME,NAME,...",
            "dict": "JSON"}.get(kind, name.rsplit("_", 1)[-1].upper())


def _add(parser: Any, name: str, verb_default: str | None) -> None:
    f = _field(name)
    kind = _kind(f)
    choices = f.metadata.get("choices")
    dash, under = "--" + name.replace("_", "-"), "--" + name
    shown = [dash, *ALIASES.get(name, ())]
    hidden = [under] if under != dash else []
    kwargs: dict[str, Any] = {"dest": name, "default": None, "verb_default": verb_default}
    if kind == "bool":
        if f.default is not False:  # `--no-truncation`, `--no-kbit-prep`, `--no-completion-only-loss`
            shown.append("--no-" + name.replace("_", "-"))
            hidden.append("--no_" + name)  # HfArgumentParser's spelling
        negatives = [o for o in shown + hidden if o.startswith(("--no-", "--no_"))]
        kwargs["negatives"] = negatives
        if name in _OPTIONAL_VALUE:  # `--packing [STRATEGY]`
            other = _field(_OPTIONAL_VALUE[name])
            kwargs.update(nargs="?", const=True, choices=other.metadata.get("choices"),
                          metavar=_OPTIONAL_VALUE[name].rsplit("_", 1)[-1].upper())
        else:
            kwargs["nargs"] = 0
    else:
        # `checked_by_setup`: TrainSetup refuses a value with a message of its own (`--trainer orpo` names the TRL
        # trainer memfit does not simulate), not argparse's "invalid choice"
        kwargs.update(type={"int": int, "float": float}.get(kind, str),
                      choices=None if f.metadata.get("checked_by_setup") else choices,
                      metavar=_metavar(name, kind, choices))
    parser.add_argument(*shown, action=_SetupFlag, **kwargs)
    if hidden:
        parser.add_argument(*hidden, action=_SetupFlag, help=argparse.SUPPRESS, lazy_help=False,
                            **{**kwargs, "negatives": [o for o in hidden if o.startswith("--no_")]})


def add_setup_flags(parser: Any, fields: Iterable[str] = SETUP_FIELDS, *,
                    defaults: Mapping[str, str] | None = None) -> None:
    """Add the flags of `fields` (TrainSetup field names) to `parser` (or an argument group).

    Args:
        parser: an ArgumentParser or an argument group.
        fields: which fields the verb reads (SETUP_FIELDS: estimate, plan, diagnose; memfit.commands.train
            names its own).
        defaults: field -> the default the verb applies when the flag is not given, for the help, where it is
            not the field's own (`memfit train --max-length`: 128).
    """
    defaults = dict(defaults or {})
    for name in fields:
        if name in NOT_FLAGS:
            raise ValueError(f"`{name}` has no setup flag: {NOT_FLAGS[name]}")
        _add(parser, name, defaults.get(name))


def add_parallel_flags(parser: Any) -> None:
    """`--world-size`, `--nodes`, `--strategy`: ParallelSetup's fields (memfit.commands._args adds the others)."""
    for name in PARALLEL_FIELDS:
        _add(parser, name, None)


def setup_flag_fields(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """field -> the visible option strings of its flag in `parser` (for tests and docs)."""
    out: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, _SetupFlag) and action.help is not argparse.SUPPRESS:
            out.setdefault(action.dest, []).extend(action.option_strings)
    return out


def flag_name(args: argparse.Namespace, name: str) -> str:
    """The option the user typed for field `name` (`--batch-size`), else its own `--field-name`."""
    return (getattr(args, _TYPED, None) or {}).get(name) or "--" + name.replace("_", "-")


def split_list(text: str) -> list[str]:
    """`a, b,c` -> ["a", "b", "c"] (a list field's flag value)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def read_lengths(text: str) -> list[int]:
    """`--example-lengths`: comma- or space-separated token counts, or `@FILE` (one per line)."""
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as fh:
                items = fh.read().split()
        except OSError as err:
            raise MemfitError(f"cannot read example lengths file `{text[1:]}`: {err.strerror}") from err
    else:
        items = [x for x in text.replace(",", " ").split() if x]
    try:
        return [int(x) for x in items]
    except ValueError as err:
        raise MemfitError(f"example lengths must be whole token counts; got `{text[:60]}`") from err


def _read_file_value(name: str, path: str) -> Any:
    import importlib

    module, reader = _FILE_VALUE[name][1].split(":")
    return getattr(importlib.import_module(module), reader)(path)


def setup_fields(args: argparse.Namespace, fields: Iterable[str] = SETUP_FIELDS) -> dict[str, Any]:
    """The TrainSetup fields the flags of `fields` gave (those not given are left out), as TrainSetup takes them:
    lists split, `--example-lengths @FILE` and `--peft-config FILE` read, `--packing STRATEGY` as packing and
    packing_strategy."""
    out: dict[str, Any] = {}
    for name in fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        kind = _kind(_field(name))
        if name in _FILE_VALUE:
            value = _read_file_value(name, value)
        elif kind in ("list[int]", "list[str]"):
            value = read_lengths(value) if kind == "list[int]" else split_list(value)
            if not value:  # `--lora-target-modules ""`: not given
                continue
        elif name in _OPTIONAL_VALUE and isinstance(value, str):
            other = _OPTIONAL_VALUE[name]
            given = getattr(args, other, None)
            if given is not None and given != value:
                raise MemfitError(f"`{flag_name(args, name)} {value}` and `{flag_name(args, other)} {given}` differ; "
                                  "give one of them")
            out[other] = value
            value = True
        out[name] = value
    return out
