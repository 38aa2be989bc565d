"""LoRA's targets as peft takes them: its `all-linear` shorthand (a string there, `--lora-target-modules all-linear`
gives a one-element list) wraps what peft's own `LoraConfig(target_modules="all-linear")` wraps."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from helpers import tiny_config
from memfit.models.peft_methods import apply_peft
from memfit.models.build import build_meta_model
from memfit.process import build_parser
from memfit.commands._setup_flags import setup_fields
from memfit.train_setup import TrainSetup


def _wrapped(model):
    return sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A"))


def test_all_linear_is_peft_shorthand():
    cfg = tiny_config("llama")
    torch.manual_seed(0)
    theirs = _wrapped(get_peft_model(AutoModelForCausalLM.from_config(cfg),
                                     LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")))
    fields = setup_fields(build_parser().parse_args(["estimate", "x", "--lora-r", "4",
                                                     "--lora-target-modules", "all-linear"]))
    setup = TrainSetup(model=cfg, task="causal-lm", **{k: v for k, v in fields.items() if k != "model"})
    ours = _wrapped(apply_peft(build_meta_model(setup), setup))
    assert ours == theirs and any(n.endswith("mlp.down_proj") for n in ours)
    assert not any(n.endswith("lm_head") for n in ours)  # peft leaves the output layer out
    assert TrainSetup(model=cfg, lora_r=4, lora_target_modules="all-linear").lora_target_modules == ["all-linear"]
