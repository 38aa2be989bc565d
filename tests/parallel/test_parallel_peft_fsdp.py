"""peft's own FSDP configs (tests/data/peft_fsdp, vendored unchanged) with LoRA and QLoRA: estimated as the Trainer
runs them (FSDP1 with peft's `fsdp_auto_wrap_policy`: memfit.parallel.fsdp `_peft_fsdp1_policies`) or refused in
one line. The per-rank figures of these runs against real 2-process runs: tests/parallel/test_parallel_qlora.py."""

import json

import pytest

from helpers import DATA_DIR
from memfit.cli import main

CONFIGS = DATA_DIR / "peft_fsdp"


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_peft_fsdp_config_with_lora(tiny_bert_dir, tmp_path, strategy, capsys):
    """FSDP1 with `use_orig_params: false` cannot wrap a block holding trainable adapters and frozen base weights
    in one FlatParameter; the Trainer gives a peft model peft's policy, which makes each adapter a unit of its own."""
    cfg = tmp_path / "fsdp_config.yaml"
    cfg.write_text((CONFIGS / "fsdp_config.yaml").read_text().replace("FULL_SHARD", strategy))
    assert main(["estimate", tiny_bert_dir, "--lora-r", "8", "--max-length", "16", "--batch-size", "2",
                 "--eval-strategy", "no", "--accelerate-config", str(cfg), "--json", "--no-cache"]) == 0
    par = json.loads(capsys.readouterr().out)["parallel"]
    assert (par["fsdp_version"], par["use_orig_params"], par["world_size"]) == (1, False, 8)
    assert par["reshard_after_forward"] is (strategy == "FULL_SHARD")


def test_peft_fsdp_peft_policy_wraps_adapters(tiny_bert_dir):
    """The units FSDP1 builds under peft's policy: every LoRA A / B Linear is one, with only trainable parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from memfit.parallel import ParallelSetup
    from memfit.parallel import fsdp as memfit_fsdp
    from memfit.train_setup import TrainSetup

    seen = {}
    original = memfit_fsdp._FsdpRunner._wrap_fsdp1

    def wrap(self):
        original(self)
        units = [m for m in self.model.modules() if isinstance(m, FSDP) and m._handle is not None]
        seen["fqns"] = [tuple(u._handle.flat_param._fqns) for u in units]
        seen["trainable"] = [u._handle.flat_param.requires_grad for u in units]

    memfit_fsdp._FsdpRunner._wrap_fsdp1 = wrap
    try:
        setup = TrainSetup.from_kwargs(tiny_bert_dir, lora_r=8, per_device_train_batch_size=2, max_length=16,
                                       eval_strategy="no", weights_dtype="fp32")
        memfit_fsdp.simulate_fsdp(setup, ParallelSetup(world_size=2, strategy="fsdp", fsdp_version=1,
                                                       use_orig_params=False))
    finally:
        memfit_fsdp._FsdpRunner._wrap_fsdp1 = original
    trainable = [fqns for fqns, t in zip(seen["fqns"], seen["trainable"]) if t]
    # BERT's query and value in its 2 layers, LoRA A and B each (no bias): 8 units of one weight; and the seq-cls
    # head peft trains (`modules_to_save`), weight and bias. Every other unit is frozen (FSDP1 would refuse a mix).
    assert sorted(trainable) == [("weight",)] * 8 + [("weight", "bias")], trainable


def test_peft_fsdp_qlora_config_is_refused_in_one_line(tiny_bert_dir, capsys):
    """peft's FSDP-QLoRA config offloads parameters with FSDP1, which memfit does not emulate: one line."""
    assert main(["estimate", tiny_bert_dir, "--lora-r", "8", "--max-length", "16", "--eval-strategy", "no",
                 "--accelerate-config", str(CONFIGS / "fsdp_config_qlora.yaml"), "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert "FSDP1 with CPU offload" in err and len(err.splitlines()) == 1
