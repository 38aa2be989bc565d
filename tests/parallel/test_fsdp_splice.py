"""FSDP2 with layer splicing (memfit.parallel.fsdp `splice_allowed`, memfit.sim.splice) writes the trace of the full
model: the cut model runs sharded as the model is, and its blocks' tags enclose FSDP2's hooks (all-gather,
reshard, reduce-scatter). The spliced trace must be the full model's, event for event, up to the order of frees
that follow one another (zero_grad drops the gradients of the cut and the full model in another order; an allocator
ends a run of frees in the same state whatever their order)."""

from __future__ import annotations

import pytest

from memfit.parallel import fsdp
from memfit.parallel.setup import ParallelSetup
from memfit.train_setup import TrainSetup
from helpers import canonical_events, tiny_config


@pytest.fixture
def cut_used(monkeypatch):
    """Whether each FSDP runner that ran had a cut model."""
    seen: list[bool] = []
    plain = fsdp._FsdpRunner.run

    def run(self, **kw):
        seen.append(self.cut is not None)
        return plain(self, **kw)

    monkeypatch.setattr(fsdp._FsdpRunner, "run", run)
    return seen



def _compare(cut_used, arch="llama", layers=8, par=None, **kw):
    task = {"llama": "causal-lm", "bert": "seq-cls"}[arch]
    setup = TrainSetup(model=tiny_config(arch, layers), task=task, per_device_train_batch_size=2, max_length=16,
                       **{"eval_strategy": "no", **kw})
    parallel = ParallelSetup(**{"world_size": 4, "strategy": "fsdp", **(par or {})})
    assert fsdp.splice_allowed(setup, parallel)
    spliced = fsdp.simulate_fsdp(setup, parallel, splice=True)
    full = fsdp.simulate_fsdp(setup, parallel, splice=False)
    assert cut_used == [True, False]
    assert canonical_events(spliced.trace) == canonical_events(full.trace)
    assert (spliced.params, spliced.trainable_params) == (full.params, full.trainable_params)


def test_spliced_fsdp2_is_the_full_model(cut_used):
    _compare(cut_used)


def test_spliced_fsdp2_with_half_precision_weights_and_evaluation(cut_used):
    # bf16 blocks: each block's output is freed between the next two blocks (no op saves it), in training too
    _compare(cut_used, weights_dtype="bf16", precision="bf16", eval_strategy="steps",
             par={"param_dtype": "bf16", "reduce_dtype": "bf16"})


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(precision="fp16", par={"param_dtype": "fp16", "reduce_dtype": "fp16"}),
    dict(par={"reshard_after_forward": False}, gradient_accumulation_steps=3, gradient_checkpointing=True),
    dict(par={"world_size": 8, "nodes": 2, "hybrid_shard": True}),
    dict(gradient_checkpointing=True, lora_r=8),
    dict(trainer="grpo", num_generations=2, max_completion_length=8),
    dict(arch="bert", layers=9, precision="fp16", par={"reshard_after_forward": False}),
], ids=["fp16-policy", "shard-grad-op-accumulation", "hybrid", "lora-checkpointing", "grpo", "bert"])
def test_spliced_fsdp2_variants(cut_used, kw):
    kw = dict(kw)
    if kw.get("gradient_accumulation_steps", 1) > 1:
        kw["par"] = {**kw["par"], "sync_each_batch": True}
    _compare(cut_used, **kw)


def test_what_is_not_spliced():
    setup = TrainSetup(model=tiny_config("llama", 8), task="causal-lm", gradient_accumulation_steps=2)
    fsdp2 = ParallelSetup(world_size=4, strategy="fsdp", sync_each_batch=True)
    assert fsdp.splice_allowed(setup, fsdp2)
    # no_sync micro-steps keep each block's unsharded gradients past the micro-step
    assert not fsdp.splice_allowed(setup, fsdp2.replace(sync_each_batch=False))
    assert not fsdp.splice_allowed(setup, fsdp2.replace(cpu_offload=True))
    assert not fsdp.splice_allowed(setup, fsdp2.replace(fsdp_version=1))
    assert not fsdp.splice_allowed(setup.replace(load_in_4bit=True, lora_r=8), fsdp2)
    assert not fsdp.splice_allowed(setup.replace(trainer="dpo"), fsdp2)  # its reference forward is not tagged
