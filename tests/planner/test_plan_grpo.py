"""`memfit plan` for GRPO (memfit.planner.grpo_plan, grpo_time): the generation batch and the completions per
optimizer step kept, vLLM's share sized in closed form and checked by estimating the plan again, GRPOConfig names
in the change, the opt-ins only with --allow, one-line refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from transformers import LlamaConfig  # noqa: E402

from memfit import TrainSetup, estimate  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.gpus.catalog import as_gpu_spec  # noqa: E402
from memfit.planner.grpo_plan import grpo_micro_batches, held_when_vllm_wakes, share_for  # noqa: E402
from memfit.planner.grpo_time import grpo_step_time, vllm_concurrency  # noqa: E402
from memfit.remedies import OPT_IN, REGISTRY  # noqa: E402
from memfit.trace import TraceEvent  # noqa: E402

LLAMA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)


def _setup(**kw) -> TrainSetup:
    base = dict(model=LLAMA, task="causal-lm", trainer="grpo", per_device_train_batch_size=4,
                gradient_accumulation_steps=2, num_generations=4, max_length=16, max_completion_length=24,
                optim="adamw_torch", attn_implementation="sdpa", gradient_checkpointing=True, precision="bf16")
    return TrainSetup(**{**base, **kw})


# -- closed forms and the search space ---------------------------------------------------------------------------

def test_share_is_the_largest_hundredth_that_fits_the_room():
    total = 80 * 2**30
    assert share_for(int(0.42 * total) + 1, total) == 0.42
    assert share_for(int(0.42 * total) - 2**20, total) == 0.41
    assert share_for(0, total) == 0.0 and share_for(-5, total) == 0.0
    assert share_for(2 * total, total) == 1.0


@pytest.mark.parametrize("kw", [dict(), dict(steps_per_generation=4), dict(generation_batch_size=16),
                                dict(per_device_train_batch_size=8, gradient_accumulation_steps=1)])
def test_micro_batches_keep_the_generation_batch_and_the_completions_per_step(kw):
    s = _setup(**kw)
    steps, g = s.grpo_sizes
    splits = grpo_micro_batches(s)
    assert splits and len({m["per_device_train_batch_size"] for m in splits}) == len(splits)
    for mb in splits:
        t = s.replace(**mb)  # GRPOConfig's own derivation (memfit.train_setup.grpo_generation_sizes) accepts it
        assert t.effective_batch_size == s.effective_batch_size
        assert t.grpo_sizes[1] == g
    # fewer generations: the same prompts, half the completions each
    for mb in grpo_micro_batches(s, 2):
        t = s.replace(num_generations=2, **mb)
        assert t.effective_batch_size * 2 == s.effective_batch_size and t.grpo_sizes[1] * 2 == g


def test_held_when_vllm_wakes_is_what_is_alive_at_the_last_scoring():
    ev = [TraceEvent("alloc", 1, 1000, phase="setup"), TraceEvent("alloc", 2, 512, phase="scoring"),
          TraceEvent("free", 2, 512, phase="forward"), TraceEvent("alloc", 3, 4096, phase="optimizer"),
          TraceEvent("alloc", 4, 100, phase="scoring")]
    # blocks of 512 bytes (memfit.peaks.rounded): 1000 -> 1024, 4096 -> 4096; the second scoring starts at event 4
    assert held_when_vllm_wakes(ev) == 1024 + 4096


def test_vllm_concurrency_and_generation_time_grow_with_the_pool():
    s = _setup(use_vllm=True)
    spec = as_gpu_spec("A100-80GB")
    from memfit.planner.ranking import StepTimer

    timer = StepTimer(spec, 2, 64, 2)
    kv = 512
    per_sequence = kv * (16 + 24)
    assert vllm_concurrency(3 * per_sequence + 1, kv, 40, 8) == 3
    assert vllm_concurrency(100 * per_sequence, kv, 40, 8) == 8  # at most the generation batch (max_num_seqs)
    times = [grpo_step_time(s, spec, timer, 10**9, 10**9, kv_per_token=kv, weight_bytes=2 * 10**9,
                            pool_bytes=n * per_sequence) for n in (1, 3, 8, 64)]
    assert [t.waves for t in times] == [8, 3, 1, 1]
    assert times[0].generation_s > times[1].generation_s > times[2].generation_s == times[3].generation_s
    assert math.isinf(grpo_step_time(s, spec, timer, 10**9, 10**9, kv_per_token=kv, weight_bytes=2 * 10**9,
                                     pool_bytes=per_sequence - 1).total_s)  # no sequence fits: vLLM cannot run


def test_grpo_remedies_are_opt_in_and_only_for_grpo():
    assert {"fewer_generations", "shorter_completions", "no_reference"} <= set(OPT_IN)
    sft = TrainSetup(model=LLAMA, task="causal-lm")
    for name in ("vllm_share", "fewer_generations", "shorter_completions", "no_reference"):
        r = REGISTRY[name]
        assert not r.serves("sft") and r.serves("grpo")
        assert r.check(sft, None).applies is False and r.variants(sft, None) == []
    s = _setup(beta=0.04, num_generations=8, max_completion_length=512, per_device_train_batch_size=8,
               gradient_accumulation_steps=1)
    assert REGISTRY["fewer_generations"].variants(s, None) == [{"num_generations": 4}]
    assert REGISTRY["shorter_completions"].variants(s, None) == [{"max_completion_length": 256}]
    assert REGISTRY["no_reference"].variants(s, None) == [{"beta": 0.0}]


def test_refusals_are_one_line():
    from memfit.planner.parallel_plan import plan_parallel
    from memfit.planner.search import plan

    # several GPUs are planned (memfit.planner.grpo_parallel_plan); server mode needs a GPU besides training's
    with pytest.raises(MemfitError, match="leaves no GPU for `trl vllm-serve`") as err:
        plan_parallel(_setup(use_vllm=True, vllm_mode="server"), gpus="1xA100-80GB")
    assert "\n" not in str(err.value)
    with pytest.raises(MemfitError, match="`--allow truncation` is not searched for GRPO") as err:
        plan(_setup(), gpu="A100-80GB", allow=("truncation",))
    assert "\n" not in str(err.value)


# -- whole plans (simulated) -------------------------------------------------------------------------------------

def _grpo_config_names() -> set[str]:
    from trl import GRPOConfig

    return {f.name for f in dataclasses.fields(GRPOConfig)}


@pytest.mark.slow
def test_colocated_share_is_sized_and_leaves_the_step_fitting():
    """A share of 0.45 of a 1 GiB card leaves the training step no room; the plan sizes the largest share that
    does: estimating the plan's setup again at that share fits, and one hundredth more would leave the step less
    than its reserved peak."""
    from memfit.planner.search import plan

    s = _setup(use_vllm=True, vllm_gpu_memory_utilization=0.45)
    r = plan(s, gpu="1GiB")
    assert not r.fits_as_is and r.chosen is not None and r.config_class == "GRPOConfig"
    p = r.plans[r.chosen]
    assert p.fits and p.verified and "vllm_share" in p.remedies
    assert set(p.changes) <= _grpo_config_names()  # the change is GRPOConfig's names
    from memfit.report.plan_view import render_plan_html

    assert "GRPOConfig(..., " in render_plan_html(r)  # the plan page names the config too
    t = s.replace(**p.setup_changes)
    assert t.effective_batch_size == s.effective_batch_size and t.grpo_sizes[1] == s.grpo_sizes[1]
    share = t.vllm_gpu_memory_utilization
    spec = as_gpu_spec("1GiB")
    base = estimate(s, gpu=spec)
    capacity = r.budget_bytes - base.non_pytorch_bytes  # what PyTorch may use within the budget
    again = estimate(t, gpu=spec, non_pytorch_bytes=base.non_pytorch_bytes,
                     capacity_bytes=capacity - int(share * spec.total_bytes))
    assert again.fits is True
    if not t.vllm_enable_sleep_mode:  # held all along: one hundredth more leaves less than the step's peak
        alone = estimate(t, gpu=spec, non_pytorch_bytes=base.non_pytorch_bytes, capacity_bytes=capacity)
        assert capacity - int((share + 0.01) * spec.total_bytes) < alone.peak_reserved_bytes
        assert capacity - int(share * spec.total_bytes) >= alone.peak_reserved_bytes


def test_opt_ins_only_with_allow_and_ranked_last():
    """The search space: without --allow no candidate changes the generations, the completion length, beta or
    the adapters; with them those candidates come after every one that keeps the method (tier 2), and every
    allowed opt-in together after each one alone (tier 3: the last resort, not the fastest combination)."""
    from memfit.planner.grpo_plan import _Search, grpo_facts
    from memfit.planner.memory_model import Simulations
    from memfit.planner.search import _as_setup, _budget_for

    spec = as_gpu_spec("A100-80GB")
    s = _as_setup(_setup(beta=0.04, num_generations=4, max_completion_length=256, per_device_train_batch_size=8,
                         gradient_accumulation_steps=1)).replace(compute_capability=tuple(spec.compute_capability))
    budget = _budget_for(spec, 0.05, 0)
    counts = type("Counts", (), {"params": 10**5, "trainable_params": 10**5})()
    search = _Search(s, budget, grpo_facts(s, spec, counts.params), Simulations(), None)
    verdicts = {name: r.check(s, spec) for name, r in REGISTRY.items()}
    method = {"num_generations", "max_completion_length", "beta", "lora_r", "load_in_4bit"}
    plain = search.candidates(verdicts, allow=(), exclude=(), base_report=counts)
    assert plain and not any(method & set(c.changes) for c in plain)
    assert {c.changes.get("gradient_checkpointing") for c in plain} == {None, False}  # on (as is) and off
    allowed = search.candidates(verdicts, allow=("fewer_generations", "shorter_completions", "no_reference"),
                                exclude=(), base_report=counts)
    opt = [c for c in allowed if method & set(c.changes)]
    together = [c for c in opt if {"num_generations", "max_completion_length", "beta"} <= set(c.changes)]
    alone = [c for c in opt if c not in together]
    assert together and alone and all(c.tier == 3 for c in together) and all(c.tier == 2 for c in alone)
    assert all(c.tier < 2 for c in allowed if c not in opt)
    assert allowed.index(opt[0]) > max(i for i, c in enumerate(allowed) if c not in opt)
    assert allowed.index(together[0]) > max(allowed.index(c) for c in alone)
    for c in opt:
        t = s.replace(**c.changes)
        if "num_generations" in c.changes:  # the same prompts: half the completions, half the generation batch
            assert t.effective_batch_size * 2 == s.effective_batch_size and t.grpo_sizes[1] * 2 == s.grpo_sizes[1]
        else:
            assert t.effective_batch_size == s.effective_batch_size and t.grpo_sizes[1] == s.grpo_sizes[1]


@pytest.mark.slow
def test_plan_without_vllm_keeps_the_batches_and_its_setup_fits_when_estimated_again():
    """transformers' generate: as is the step needs ~170 MiB; with 100 MiB for PyTorch the plan takes a smaller micro-batch
    (more steps per generation), and estimating that setup again fits."""
    from memfit.planner.search import plan

    s = _setup(beta=0.04, num_generations=4, max_completion_length=256, per_device_train_batch_size=8,
               gradient_accumulation_steps=1)
    # the smallest card memfit accepts, with all but 100 MiB of its budget outside PyTorch
    outside = int(256 * 2**20 * 0.95) - 100 * 2**20
    r = plan(s, gpu="256MiB", non_pytorch_bytes=outside)
    assert not r.fits_as_is and r.chosen is not None
    p = r.plans[r.chosen]
    assert set(p.changes) <= _grpo_config_names()
    assert not {"num_generations", "max_completion_length", "beta"} & set(p.setup_changes)
    t = s.replace(**p.setup_changes)
    assert t.per_device_train_batch_size < 8
    assert t.effective_batch_size == s.effective_batch_size and t.grpo_sizes[1] == s.grpo_sizes[1]
    again = estimate(t, gpu="256MiB", non_pytorch_bytes=outside, capacity_bytes=r.budget_bytes - outside)
    assert again.fits is True


@pytest.mark.slow
def test_rloo_is_planned_as_grpo_with_rloo_config_names():
    """RLOOConfig has GRPOConfig's generation names: the same search, the change in RLOOConfig's names."""
    from trl import RLOOConfig

    from memfit.planner.search import plan

    s = _setup(trainer="rloo", use_vllm=True, vllm_gpu_memory_utilization=0.45)
    r = plan(s, gpu="1GiB")
    assert r.config_class == "RLOOConfig" and not r.fits_as_is and r.chosen is not None
    p = r.plans[r.chosen]
    assert set(p.changes) <= {f.name for f in dataclasses.fields(RLOOConfig)}
    t = s.replace(**p.setup_changes)
    assert t.effective_batch_size == s.effective_batch_size and t.grpo_sizes[1] == s.grpo_sizes[1]
    assert t.vllm_gpu_memory_utilization < 0.45
