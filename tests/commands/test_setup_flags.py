"""The setup flags of every verb (memfit.commands._setup_flags) are TrainSetup's (and ParallelSetup's) fields: each
flag names a field or an alias of ALIASES, each field a user sets has a flag, every spelling parses to the same
TrainSetup, every flag has help, and choices are the constant tuples."""

import argparse
import dataclasses

import pytest

from memfit.commands import _setup_flags as sf
from memfit.commands.estimate import build_setup
from memfit.errors import MemfitError
from memfit.parallel.setup import STRATEGIES, ParallelSetup
from memfit.train_setup import (ATTN_IMPLEMENTATIONS, BNB_4BIT_QUANT_TYPES, EVAL_STRATEGIES, HUB_FLASH_KERNELS,
                                OPTIMIZERS, PACKING_STRATEGIES, PRECISIONS, QUANT_STORAGE_DTYPES, TRAINERS,
                                TRL_TRAINERS, VLLM_MODES, TrainSetup)

#: TrainSetup fields with no flag, and why (a new field either gets a flag or is added here with its reason).
INTERNAL = {
    "model": "the verb's MODEL argument (diagnose: --model), not a generated flag",
    "compute_capability": "of the target GPU: memfit.estimate sets it from --gpu",
    "notes": "memfit's output: what it changed or assumed",
}

#: The setup flags memfit had before they were generated, per verb (each must still parse, to the same field).
BEFORE = {
    "estimate": ["--task", "--num-labels", "--batch-size", "--eval-batch-size", "--grad-accum", "--max-length",
                 "--example-lengths", "--no-truncation", "--target-length", "--precision", "--weights-dtype",
                 "--optim", "--weight-decay", "--max-grad-norm", "--gradient-checkpointing", "--eval-strategy",
                 "--eval-accumulation-steps", "--eval-samples", "--lora-r", "--lora-target-modules", "--use-dora",
                 "--peft-config", "--attn", "--liger", "--float8", "--freeze-embeddings", "--freeze-layers",
                 "--load-in-4bit", "--load-in-8bit", "--bnb-4bit-quant-type", "--bnb-4bit-compute-dtype",
                 "--double-quant", "--no-kbit-prep", "--trainer", "--packing", "--padding-free",
                 "--completion-only-loss", "--assistant-only-loss", "--precompute-ref-log-probs", "--world-size",
                 "--nodes", "--strategy"],
    "train": ["--task", "--num-labels", "--max-length", "--per-device-train-batch-size", "--batch-size",
              "--per-device-eval-batch-size", "--eval-batch-size", "--gradient-accumulation-steps", "--grad-accum",
              "--eval-strategy", "--trainer", "--packing", "--padding-free", "--completion-only-loss",
              "--assistant-only-loss", "--precompute-ref-log-probs", "--lora-r", "--lora-target-modules"],
}
BEFORE["plan"] = BEFORE["estimate"]
BEFORE["diagnose"] = [f for f in BEFORE["estimate"] if f not in ("--world-size", "--nodes", "--strategy")]

CHOICES = {"precision": PRECISIONS, "weights_dtype": ("auto", *PRECISIONS), "optim": OPTIMIZERS,
           "eval_strategy": EVAL_STRATEGIES, "attn_implementation": (*ATTN_IMPLEMENTATIONS, *HUB_FLASH_KERNELS),
           "bnb_4bit_quant_type": BNB_4BIT_QUANT_TYPES, "bnb_4bit_compute_dtype": PRECISIONS,
           "bnb_4bit_quant_storage": QUANT_STORAGE_DTYPES, "packing_strategy": PACKING_STRATEGIES,
           "packing": PACKING_STRATEGIES, "strategy": STRATEGIES, "vllm_mode": VLLM_MODES}


def _verb_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each verb's parser, as memfit's CLI builds it (`<verb>_command_parser(subparsers)`)."""
    import importlib

    sub = argparse.ArgumentParser(prog="memfit").add_subparsers()
    return {verb: getattr(importlib.import_module(f"memfit.commands.{verb}"), f"{verb}_command_parser")(sub)
            for verb in ("estimate", "plan", "diagnose", "train")}


PARSERS = _verb_parsers()
FIELDS = {f.name for f in dataclasses.fields(TrainSetup)}
PARALLEL = {f.name for f in dataclasses.fields(ParallelSetup)}


def _setup_actions(parser):
    return [a for a in parser._actions if isinstance(a, sf._SetupFlag)]


@pytest.mark.parametrize("verb", PARSERS)
def test_every_setup_flag_is_a_field_or_an_alias(verb):
    aliases = {o for names in sf.ALIASES.values() for o in names}
    for action in _setup_actions(PARSERS[verb]):
        assert action.dest in FIELDS or action.dest in sf.PARALLEL_FIELDS, action.option_strings
        own = {"--" + action.dest.replace("_", "-"), "--" + action.dest, "--no-" + action.dest.replace("_", "-"),
               "--no_" + action.dest}
        for option in action.option_strings:
            assert option in own or option in sf.ALIASES.get(action.dest, ()), (verb, option)
    assert aliases <= {o for a in _setup_actions(PARSERS["estimate"]) for o in a.option_strings}


@pytest.mark.parametrize("verb", PARSERS)
def test_the_flags_of_before_parse_to_the_same_field(verb):
    by_option = {o: a for a in PARSERS[verb]._actions for o in a.option_strings}
    for option in BEFORE[verb]:
        assert option in by_option, (verb, option)
    # the verbs' own non-setup flags stay theirs: none of them shadows a field
    for action in PARSERS[verb]._actions:
        if not isinstance(action, sf._SetupFlag) and action.dest in FIELDS - {"model"}:
            pytest.fail(f"{verb}: `{action.option_strings}` sets field `{action.dest}` but is not a setup flag")


def test_each_field_a_user_sets_has_a_flag():
    shown = sf.setup_flag_fields(PARSERS["estimate"])
    assert set(shown) == (FIELDS - set(INTERNAL)) | set(sf.PARALLEL_FIELDS)
    assert set(sf.NOT_FLAGS) == set(INTERNAL)
    assert set(sf.setup_flag_fields(PARSERS["diagnose"])) == FIELDS - set(INTERNAL)
    train = set(sf.setup_flag_fields(PARSERS["train"]))
    assert train < FIELDS and {"per_device_train_batch_size", "max_length", "trainer", "packing"} <= train


@pytest.mark.parametrize("verb", PARSERS)
def test_every_generated_flag_has_help(verb):
    for action in _setup_actions(PARSERS[verb]):
        if action.help is argparse.SUPPRESS:  # the underscore spelling of a shown flag
            assert all("_" in o for o in action.option_strings), action.option_strings
            continue
        assert action.help and action.help.strip(), action.option_strings
    PARSERS[verb].format_help()  # every help string formats (no stray %)


def test_choices_are_the_constant_tuples():
    for verb, parser in PARSERS.items():
        for action in _setup_actions(parser):
            if action.dest in CHOICES:
                assert tuple(action.choices) == CHOICES[action.dest], (verb, action.dest)
            elif action.dest == "trainer":  # TrainSetup refuses a trainer with its own line; the help lists them
                assert action.choices is None and f"One of: {', '.join(TRAINERS)}." in action.help, verb
            else:
                assert action.choices is None, (verb, action.dest)
    assert TRL_TRAINERS == tuple(t for t in TRAINERS if t != "trainer")


def _estimate_setup(argv):
    args = PARSERS["estimate"].parse_args(argv)
    args.func = None
    return build_setup(args)[0]


@pytest.mark.parametrize("spellings", [
    (["--batch-size", "4"], ["--per-device-train-batch-size", "4"], ["--per_device_train_batch_size", "4"]),
    (["--grad-accum", "3"], ["--gradient-accumulation-steps", "3"], ["--gradient_accumulation_steps", "3"]),
    (["--eval-batch-size", "2"], ["--per-device-eval-batch-size", "2"], ["--per_device_eval_batch_size", "2"]),
    (["--attn", "eager"], ["--attn-implementation", "eager"], ["--attn_implementation", "eager"]),
    (["--liger"], ["--use-liger-kernel"], ["--use_liger_kernel"]),
    (["--max-length", "64"], ["--max_length", "64"]),
    (["--no-truncation", "--example-lengths", "9,70"], ["--no_truncation", "--example_lengths", "9,70"]),
    (["--lora-r", "4", "--lora-target-modules", "query,value"], ["--lora_r", "4", "--lora_target_modules", "query, value"]),
    (["--gradient-checkpointing"], ["--gradient_checkpointing"]),
])
def test_every_spelling_parses_to_the_same_setup(spellings, tiny_bert_dir):
    setups = [_estimate_setup([tiny_bert_dir, "--task", "seq-cls", *argv]) for argv in spellings]
    assert all(s == setups[0] for s in setups[1:]), spellings
    assert setups[0] != _estimate_setup([tiny_bert_dir, "--task", "seq-cls"])


def test_quantization_and_trl_spellings(tiny_bert_dir):
    from helpers import tiny_config

    a = _estimate_setup(["gpt2", "--task", "causal-lm", "--lora-r", "4", "--load-in-4bit", "--double-quant",
                         "--no-kbit-prep", "--bnb-4bit-quant-type", "nf4"])
    b = _estimate_setup(["gpt2", "--task", "causal-lm", "--lora_r", "4", "--load_in_4bit",
                         "--bnb-4bit-use-double-quant", "--no_kbit_prep", "--bnb_4bit_quant_type", "nf4"])
    assert a == b and a.bnb_4bit_use_double_quant and not a.kbit_prep
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tiny_config("llama").save_pretrained(d)
        p1 = _estimate_setup([d, "--trainer", "sft", "--packing", "wrapped"])
        p2 = _estimate_setup([d, "--trainer", "sft", "--packing", "--packing-strategy", "wrapped"])
        p3 = _estimate_setup([d, "--trainer", "sft", "--packing"])
        assert p1 == p2 and (p1.packing, p1.packing_strategy) == (True, "wrapped")
        assert (p3.packing, p3.packing_strategy) == (True, "bfd")
        with pytest.raises(MemfitError, match="differ"):
            _estimate_setup([d, "--trainer", "sft", "--packing", "bfd", "--packing-strategy", "wrapped"])


def test_train_parses_the_same_fields_as_estimate():
    for argv in (["--batch-size", "4"], ["--per_device_train_batch_size", "4"], ["--grad-accum", "2"],
                 ["--max_length", "32"], ["--trainer", "sft", "--packing", "bfd_split"]):
        est, train = PARSERS["estimate"].parse_args(argv), PARSERS["train"].parse_args(argv)
        fields = [n for n in sf.setup_flag_fields(PARSERS["train"]) if getattr(train, n) is not None]
        assert fields and all(getattr(est, n) == getattr(train, n) for n in fields), argv


def test_a_message_names_the_flag_as_typed():
    args = PARSERS["estimate"].parse_args(["--grad-accum", "0"])
    assert sf.flag_name(args, "gradient_accumulation_steps") == "--grad-accum"
    assert sf.flag_name(args, "per_device_train_batch_size") == "--per-device-train-batch-size"
    args = PARSERS["estimate"].parse_args(["--per_device_train_batch_size", "0"])
    assert sf.flag_name(args, "per_device_train_batch_size") == "--per_device_train_batch_size"


def test_not_given_is_none_so_that_the_args_file_merges(tmp_path, tiny_bert_dir):
    args = PARSERS["estimate"].parse_args([tiny_bert_dir])
    for action in _setup_actions(PARSERS["estimate"]):
        assert getattr(args, action.dest) is None, action.dest
    path = tmp_path / "a.json"
    path.write_text('{"per_device_train_batch_size": 8, "max_length": 32, "gradient_checkpointing": true}')
    args = PARSERS["estimate"].parse_args([tiny_bert_dir, "--task", "seq-cls", "--args", str(path), "--batch-size", "2"])
    args.func = None
    setup = build_setup(args)[0]
    assert (setup.per_device_train_batch_size, setup.max_length, setup.gradient_checkpointing) == (2, 32, True)
    assert any("per_device_train_batch_size" in n and "overrides" in n for n in setup.notes)


def test_help_shows_the_verbs_default():
    train = " ".join(PARSERS["train"].format_help().split())
    estimate = " ".join(PARSERS["estimate"].format_help().split())
    assert "(default: 128;" in train and "(default: 512)" in estimate
    assert "--per_device_train_batch_size" not in estimate  # the underscore form parses, unlisted
