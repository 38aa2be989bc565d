"""memfit.parallel.deepspeed_rules against the code it mirrors: transformers 5.24's TrainingArguments and
HfTrainerDeepSpeedConfig, accelerate 1.16's DeepSpeedPlugin, run on the CPU for every combination of a DeepSpeed
config's fp16/bf16 sections, the Trainer's precision, an accelerate config's mixed_precision and the route
(`TrainingArguments(deepspeed=...)` or `accelerate launch`)."""

import itertools
import json
import os
from unittest import mock

import pytest

from memfit.errors import MemfitError
from memfit.parallel.deepspeed_rules import autotp_size, check_batch_keys, deepspeed_precision, unmodelled_key_notes

_SECTIONS = [None, {"enabled": "auto"}, {"enabled": True}, {"enabled": False}]


def _config(fp16, bf16):
    cfg = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
           "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}
    if fp16 is not None:
        cfg["fp16"] = dict(fp16)
    if bf16 is not None:
        cfg["bf16"] = dict(bf16)
    return cfg


def _theirs(cfg, trainer, launcher, via_accelerate, tmp_path):
    """What transformers + accelerate leave in the config DeepSpeed receives: `fp16` / `bf16` / `fp32`, or
    "error" when either library raises (a mismatch is raised by trainer_config_finalize)."""
    import transformers.training_args as ta
    from accelerate.utils import DeepSpeedPlugin
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    env = {"ACCELERATE_MIXED_PRECISION": launcher or "no"}
    kwargs = {"fp16": trainer == "fp16", "bf16": trainer == "bf16"}
    if via_accelerate:
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(path))
    else:
        kwargs["deepspeed"] = str(path)
    with mock.patch.dict(os.environ, env), \
            mock.patch.object(ta, "is_torch_bf16_gpu_available", lambda: True, create=True):
        try:
            args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **kwargs)
            plugin = args.deepspeed_plugin
            if via_accelerate:  # Trainer.__init__ -> propagate_args_to_deepspeed
                plugin.hf_ds_config = HfTrainerDeepSpeedConfig(plugin.hf_ds_config.config)
                plugin.deepspeed_config = plugin.hf_ds_config.config
                plugin.hf_ds_config.trainer_config_process(args)
            else:
                plugin.set_mixed_precision(args.mixed_precision)  # AcceleratorState.__init__
        except ValueError:
            return "error"
    if plugin.hf_ds_config.mismatches:
        return "error"
    c = plugin.deepspeed_config
    if c.get("bf16", {}).get("enabled") is True and c.get("fp16", {}).get("enabled") is True:
        return "error"
    return "bf16" if c.get("bf16", {}).get("enabled") is True else "fp16" if c.get("fp16", {}).get("enabled") else "fp32"


_ALL = [(fp16, bf16, trainer, launcher, via)
        for fp16, bf16 in itertools.product(_SECTIONS, _SECTIONS)
        for trainer in ("fp16", "bf16", None)
        for via, launcher in ((False, None), (True, None), (True, "fp16"), (True, "bf16"))]
#: The files of the corpus (tests/data/real_configs) have these shapes; the other combinations run as slow tests.
_FAST = [(None, None), ({"enabled": "auto"}, None), ({"enabled": True}, None), (None, {"enabled": "auto"})]
_CASES = [pytest.param(*c, marks=() if (c[0], c[1]) in _FAST and c[3] != "fp16" else pytest.mark.slow)
          for c in _ALL]


@pytest.mark.parametrize("fp16,bf16,trainer,launcher,via", _CASES)
def test_precision_as_transformers_and_accelerate_decide_it(fp16, bf16, trainer, launcher, via, tmp_path):
    cfg = _config(fp16, bf16)
    theirs = _theirs(cfg, trainer, launcher, via, tmp_path)
    try:
        ours, notes = deepspeed_precision(cfg, trainer=trainer, launcher=launcher, via_accelerate=via)
    except MemfitError as err:
        assert "\n" not in str(err)
        ours, notes = "error", []
    if trainer is None and notes:
        # memfit's precision fp32 reads as "not set": it takes the config's dtype and says that the Trainer needs it;
        # the run with that flag set is the one transformers accepts
        assert ours != "fp32" and f"`{ours}=True`" in notes[0]
        assert _theirs(cfg, ours, launcher, via, tmp_path) == ours
    else:
        assert ours == theirs


def test_batch_keys_as_trainer_config_process_checks_them():
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    cfg = {"train_batch_size": 128, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
           "zero_optimization": {"stage": 2}}
    for micro, gas, world in [(4, 4, 8), (4, 4, 4), (8, 4, 8), (4, 2, 8)]:
        args = mock.Mock(world_size=world, per_device_train_batch_size=micro, gradient_accumulation_steps=gas,
                         max_grad_norm=1.0, learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                         weight_decay=0.0, save_on_each_node=False, fp16=False, bf16=False, fp16_full_eval=False,
                         bf16_full_eval=False)
        hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(cfg)))
        hf.trainer_config_process(args)
        batch = [m for m in hf.mismatches if "batch" in m or "accumulation" in m]
        try:
            check_batch_keys(cfg, micro_batch=micro, accumulation=gas, world_size=world, source="`ds.json`")
            refused = False
        except MemfitError as err:
            refused = True
            assert "\n" not in str(err) and "`ds.json`" in str(err)
        assert refused == bool(batch), (micro, gas, world, batch)


def test_keys_that_change_memory_are_named():
    cfg = {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 4},
           "sequence_parallel_size": 2, "pipeline": {"stages": 2}, "torch_autocast": {"enabled": False}}
    notes = unmodelled_key_notes(cfg, "`ds.json`")
    assert autotp_size(cfg) == 4
    assert any("autotp_size` 4" in n and "upper bound" in n for n in notes)
    assert any("sequence_parallel_size" in n for n in notes) and any("`pipeline`" in n for n in notes)
    assert not any("torch_autocast" in n for n in notes)  # switched off
    assert unmodelled_key_notes({"zero_optimization": {"stage": 3}}) == []
