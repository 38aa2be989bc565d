"""The LLM-stack remedies of the planner: FlashAttention-2, Liger kernels, QLoRA.

Each is proposed only where it can run (GPU, packages, model type), is simulated like every other
remedy (the plan's numbers come from the emulated kernels), and says what to install."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from memfit.gpus import as_gpu_spec
from memfit.planner import plan
from memfit.planner.search import _kernel_axis
from memfit.planner.throughput import StepCost, step_time_s
from memfit.remedies import REGISTRY
from memfit.train_setup import TrainSetup


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048).save_pretrained(path)
    return str(path)


def _verdicts(setup, gpu):
    return {name: r.check(setup, gpu) for name, r in REGISTRY.items()}


@pytest.mark.parametrize("gpu,applies", [("V100-16GB", False), ("T4", False), ("A100-80GB", True), ("L4", True)])
def test_flash_attention_only_where_flash_attn_runs(tiny_llama, gpu, applies):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="fp16")
    verdict = REGISTRY["flash_attention"].check(setup, as_gpu_spec(gpu))
    assert verdict.applies is applies, verdict.reason
    if not applies:
        assert "8.0" in verdict.reason


def test_flash_attention_not_proposed_twice(tiny_llama):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", attn_implementation="flash_attention_2")
    assert not REGISTRY["flash_attention"].check(setup, as_gpu_spec("A100-80GB")).applies


def test_liger_by_model_type(tiny_llama, tiny_bert_dir):
    gpu = as_gpu_spec("A100-80GB")
    assert REGISTRY["liger"].check(TrainSetup(model=tiny_llama, task="causal-lm"), gpu).applies
    bert = REGISTRY["liger"].check(TrainSetup(model=tiny_bert_dir, task="seq-cls"), gpu)
    from memfit.sim.kernels.liger import liger_supported_model_types

    assert bert.applies is ("bert" in liger_supported_model_types())
    assert not REGISTRY["liger"].check(TrainSetup(model=tiny_llama, task="causal-lm", use_liger_kernel=True),
                                       gpu).applies


def test_kernel_axis_is_short_and_qlora_needs_consent(tiny_llama):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16")
    gpu = as_gpu_spec("A100-80GB")
    verdicts = _verdicts(setup, gpu)
    axis = _kernel_axis(setup, gpu, verdicts, allow=(), exclude=())
    assert axis == [{}, {"attn_implementation": "flash_attention_2", "use_liger_kernel": True}]
    allowed = _kernel_axis(setup, gpu, verdicts, allow=("qlora",), exclude=())
    assert len(allowed) == 3 and allowed[2]["load_in_4bit"] and "lora_r" not in allowed[2]  # LoRA: its own axis
    assert allowed[2]["bnb_4bit_compute_dtype"] == "bf16" and allowed[2]["attn_implementation"] == "flash_attention_2"
    assert _kernel_axis(setup, gpu, verdicts, allow=(), exclude=("flash_attention", "liger")) == [{}]
    v100 = as_gpu_spec("V100-16GB")
    fp16 = setup.replace(precision="fp16")
    assert _kernel_axis(fp16, v100, _verdicts(fp16, v100), allow=(), exclude=()) == [{}, {"use_liger_kernel": True}]


def test_apply_names_the_packages_and_the_auto_class(tiny_llama):
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16")
    _, _, code = REGISTRY["flash_attention"].apply({"attn_implementation": "flash_attention_2"}, setup)
    assert code[0].startswith("# pip install flash-attn") and "AutoModelForCausalLM" in code[1]
    args, _, code = REGISTRY["liger"].apply({"use_liger_kernel": True}, setup)
    assert args == {"use_liger_kernel": True} and "liger-kernel" in code[0]
    _, _, code = REGISTRY["qlora"].apply({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                          "bnb_4bit_compute_dtype": "bf16", "bnb_4bit_use_double_quant": True}, setup)
    text = "\n".join(code)
    assert "pip install bitsandbytes" in text and "torch.bfloat16" in text and "prepare_model_for_kbit_training" in text


def test_dequantization_makes_steps_slower():
    gpu = as_gpu_spec("A100-80GB")
    base = StepCost(8_000_000_000, 40_000_000, 32, 4096, 2048, 1, 1, "bf16", True, "adamw_torch_fused")
    q = StepCost(8_000_000_000, 40_000_000, 32, 4096, 2048, 1, 1, "bf16", True, "adamw_torch_fused",
                 quantized_params=8_000_000_000 - 40_000_000, quantized_bits=4)
    # 3 passes x 7.96e9 params x 2.5 B / 2.039e12 B/s (A100-80GB bandwidth in the catalog) on top
    extra = step_time_s(q, gpu) - step_time_s(base, gpu)
    assert extra == pytest.approx(3 * (8_000_000_000 - 40_000_000) * 2.5 / (gpu.memory_bandwidth_gbps * 1e9))


def test_plan_uses_flash_and_liger_where_they_fit(tiny_llama):
    """A tiny Llama whose logits (4096 vocab x 1024 tokens x batch 8, float32 in the loss) dominate: the plan
    verifies the lean kernels by simulation and keeps the method; on a V100 flash is never proposed."""
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", per_device_train_batch_size=8,
                       max_length=1024)
    base = plan(setup, gpu="A100-80GB").baseline
    need = base.peak_allocated_bytes
    outside = base.device_used_bytes - base.peak_reserved_bytes
    result = plan(setup, gpu=f"{int((outside + 0.8 * base.peak_reserved_bytes) / 0.95)}B")
    assert not result.fits_as_is
    chosen = result.plans[result.chosen]
    assert chosen.verified and chosen.fits
    assert {"flash_attention", "liger"} & set(chosen.remedies), chosen.remedies
    assert chosen.peak_allocated_bytes < need
    on_v100 = plan(setup.replace(precision="fp16"), gpu="V100-16GB")
    assert all("flash_attention" not in p.remedies for p in on_v100.plans)


def test_qlora_allows_lora_and_a_bare_4bit_base_is_refused(tiny_llama):
    """`--allow qlora` lets a full fine-tune become QLoRA (LoRA comes with it); a 4-bit base without adapters is
    refused by TrainSetup (as Trainer refuses it), so the planner skips such combinations."""
    from memfit.errors import MemfitError
    from memfit.planner.search import _check_options

    assert "lora" in _check_options(margin=0.05, allow=("qlora",), exclude=())
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16")
    with pytest.raises(MemfitError):
        setup.replace(**REGISTRY["qlora"].variants(setup, as_gpu_spec("A100-80GB"))[0])
    assert setup.replace(lora_r=16, **REGISTRY["qlora"].variants(setup, as_gpu_spec("A100-80GB"))[0]).load_in_4bit


# -- kbit prep's checkpointing, paged optimizers, checkpoint offload ------------------

_QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bf16",
          "bnb_4bit_use_double_quant": True, "lora_r": 16}


def _budget(gpu):
    from memfit.planner.memory_model import Budget

    spec = as_gpu_spec(gpu)
    return Budget(spec, 0.05, int(spec.total_bytes * 0.95), 2**30, int(spec.total_bytes * 0.95) - 2**30)


def _candidate(changes):
    from memfit.planner.ranking import Candidate

    return Candidate(True, 2, 1.2, len(changes), 2**30, 2**29, dict(changes))


def test_kbit_prep_checkpointing_is_not_proposed(tiny_llama):
    """With QLoRA, peft's prepare_model_for_kbit_training (kbit_prep, on by default) already turns gradient
    checkpointing on: a plan must not list "enable gradient checkpointing" as a change, and must say why it is on;
    the candidate with it and the one without are one plan."""
    from types import SimpleNamespace

    from memfit.planner.memory_model import Simulations
    from memfit.planner.search import _verify
    from memfit.remedies import implied_changes

    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", max_length=128)
    with_ckpt = {**_QLORA, "gradient_checkpointing": True}
    implied = implied_changes(setup, with_ckpt)
    assert "gradient_checkpointing" not in implied.changes and implied.changes == _QLORA
    assert "prepare_model_for_kbit_training" in implied.implied["gradient_checkpointing"]
    # without kbit prep the user must turn it on: it stays a change
    assert implied_changes(setup, {**with_ckpt, "kbit_prep": False}).changes["gradient_checkpointing"] is True
    base = SimpleNamespace(report=SimpleNamespace(checkpointing="huggingface"), need_ratio=1.0)
    out = _verify(setup, [_candidate(with_ckpt), _candidate(_QLORA)], base, _budget("A100-80GB"), Simulations(),
                  alloc_conf=None, verify_top=0, max_plans=8)
    assert len(out.plans) == 1  # the same run, listed once
    fitted = out.plans[0]
    assert "gradient_checkpointing" not in fitted.remedies and "gradient_checkpointing" not in fitted.changes
    assert "gradient_checkpointing" not in fitted.setup_changes
    assert any("prepare_model_for_kbit_training" in n for n in fitted.notes), fitted.notes
    # verified: the simulated setup has checkpointing on (kbit prep), and its report says so
    sims = Simulations()
    verified = _verify(setup, [_candidate(with_ckpt)], base, _budget("A100-80GB"), sims, alloc_conf=None,
                       verify_top=1, max_plans=1).plans[0]
    assert verified.verified and sims.count == 1 and "gradient_checkpointing" not in verified.remedies
    assert any("prepare_model_for_kbit_training" in n and "gradient checkpointing is on" in n for n in verified.notes)
    # the checkpointing remedy's own verdict on a quantized setup names kbit prep
    q = setup.replace(**_QLORA)
    assert q.gradient_checkpointing and "prepare_model_for_kbit_training" in \
        REGISTRY["gradient_checkpointing"].check(q, as_gpu_spec("A100-80GB")).reason


@pytest.mark.parametrize("optim", ["adamw_8bit", "paged_adamw_8bit", "lion_8bit", "adamw_bnb_8bit"])
def test_optimizer_remedy_does_not_propose_what_is_already_8bit(tiny_llama, optim):
    """transformers' `adamw_8bit` is an alias of `adamw_bnb_8bit` and every "8bit" name is 8-bit already
    (trainer_optimizer.py `_get_bitsandbytes_optimizer`): the remedy must not propose `adamw_bnb_8bit` to them."""
    setup = TrainSetup(model=tiny_llama, task="causal-lm", optim=optim)
    variants = [v["optim"] for v in REGISTRY["optimizer"].variants(setup, as_gpu_spec("A100-80GB"))]
    assert "adamw_bnb_8bit" not in variants and "adafactor" not in variants and "paged_adamw_32bit" not in variants
    assert variants == ([] if optim == "paged_adamw_8bit" else ["paged_adamw_8bit"])
    assert REGISTRY["optimizer"].check(setup, as_gpu_spec("A100-80GB")).applies is bool(variants)


def test_paged_optimizers_are_proposed_and_described(tiny_llama):
    setup = TrainSetup(model=tiny_llama, task="causal-lm")
    a100 = as_gpu_spec("A100-80GB")
    assert [v["optim"] for v in REGISTRY["optimizer"].variants(setup, a100)] == \
        ["adamw_bnb_8bit", "adafactor", "paged_adamw_8bit", "paged_adamw_32bit"]
    # managed memory is CUDA's: not proposed on an AMD GPU; not to SGD (it would add a state)
    assert "paged_adamw_8bit" not in [v["optim"] for v in REGISTRY["optimizer"].variants(setup, as_gpu_spec("MI300X"))]
    assert not REGISTRY["optimizer"].check(setup.replace(optim="sgd"), a100).applies
    for optim in ("paged_adamw_8bit", "paged_adamw_32bit"):
        args, _, code = REGISTRY["optimizer"].apply({"optim": optim}, setup)
        assert args == {"optim": optim} and code[0] == "# pip install bitsandbytes" and "managed memory" in code[1]


def test_paged_optimizer_cost_is_simulated(tiny_llama):
    """Each paged optimizer's step is simulated once: its state leaves the allocator's figures (paged_bytes)."""
    from memfit.estimator import estimate
    from memfit.planner.memory_model import Simulations, _optimizer_costs

    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", max_length=64)
    report = estimate(setup)
    costs = _optimizer_costs(setup, report, [{"optim": "adamw_torch"}, {"optim": "paged_adamw_32bit"},
                                             {"optim": "paged_adamw_8bit"}], Simulations())
    # the tiny Llama's 4096 x 64 embedding and LM head (untied) are its parameters of >= 100k elements
    # (bitsandbytes pages only those): two float32 states of each paged at 32 bits, two uint8 ones at 8 bits
    emb = 2 * 4096 * 64
    assert costs["adamw_torch"].paged_bytes == 0
    assert costs["paged_adamw_32bit"].paged_bytes == 2 * 4 * emb
    assert costs["paged_adamw_8bit"].paged_bytes == 2 * 1 * emb
    # what leaves the allocator is AdamW's state of those matrices: the rest stays (within 1 %)
    paged32, adam = costs["paged_adamw_32bit"], costs["adamw_torch"]
    assert paged32.state_bytes + paged32.paged_bytes == pytest.approx(adam.state_bytes, rel=0.01)
    assert paged32.state_bytes < adam.state_bytes / 4


def test_paged_traffic_only_when_the_gpu_is_short():
    from memfit.planner.throughput import host_link_gbps, paged_traffic_bytes

    assert paged_traffic_bytes(8 * 2**30, 10 * 2**30) == 0  # room for the whole state: no traffic
    assert paged_traffic_bytes(8 * 2**30, 3 * 2**30) == 2 * 5 * 2**30  # 5 GiB evicted, paged in and out
    assert paged_traffic_bytes(8 * 2**30, -2**30) == 2 * 8 * 2**30
    gpu = as_gpu_spec("A100-80GB")
    assert host_link_gbps(gpu) == pytest.approx(31.5 * 0.8)  # PCIe 4.0 x16
    assert host_link_gbps(as_gpu_spec("V100-16GB")) == pytest.approx(15.75 * 0.8)
    assert host_link_gbps(as_gpu_spec("H100-80GB")) == pytest.approx(63.0 * 0.8)
    base = StepCost(8_000_000_000, 8_000_000_000, 32, 4096, 2048, 1, 4, "bf16", True, "paged_adamw_32bit")
    paged = StepCost(8_000_000_000, 8_000_000_000, 32, 4096, 2048, 1, 4, "bf16", True, "paged_adamw_32bit",
                     paged_traffic_bytes=10 * 10**9)
    assert step_time_s(paged, gpu) - step_time_s(base, gpu) == pytest.approx(10e9 / (host_link_gbps(gpu) * 1e9))


def test_checkpoint_offload_variant_and_change(tiny_llama):
    from memfit.remedies import remedy_for_field

    setup = TrainSetup(model=tiny_llama, task="causal-lm", gradient_checkpointing=True,
                       gradient_checkpointing_kwargs={"use_reentrant": False})
    remedy = REGISTRY["checkpoint_offload"]
    gpu = as_gpu_spec("A100-80GB")
    assert remedy.check(setup, gpu).applies
    [variant] = remedy.variants(setup, gpu)
    assert variant == {"gradient_checkpointing_kwargs": {"use_reentrant": False, "offload": True}}
    hash(tuple(sorted(variant.items())))  # the planner keys candidates by their changes
    assert remedy_for_field("gradient_checkpointing_kwargs") is remedy
    args, _, code = remedy.apply(variant, setup)
    assert args == {"gradient_checkpointing_kwargs": {"use_reentrant": False, "offload": True}}
    assert not remedy.check(setup.replace(**variant), gpu).applies
    # proposed to a setup that already checkpoints (the checkpointing remedy is not), on the checkpointing axis
    from memfit.planner.search import _candidate_axes, _describe

    axes = _candidate_axes(setup, gpu, _verdicts(setup, gpu), allow=(), exclude=())
    assert axes.checkpointing == [{"gradient_checkpointing": True}, {"gradient_checkpointing": True, **variant}]
    # without checkpointing the plan turns it on too, each change described by its own remedy
    plain = setup.replace(gradient_checkpointing=False)
    axes = _candidate_axes(plain, gpu, _verdicts(plain, gpu), allow=(), exclude=())
    both = axes.checkpointing[-1]
    names, args, _, _ = _describe(plain, both, "huggingface")
    assert names == ["gradient_checkpointing", "checkpoint_offload"]
    assert args == {"gradient_checkpointing": True,
                    "gradient_checkpointing_kwargs": {"use_reentrant": False, "offload": True}}


def test_checkpoint_offload_is_simulated_and_charged(tiny_llama):
    """The offload variant's estimate keeps fewer activations on the GPU than checkpointing alone, and the speed
    model's offloaded bytes equal the host copies the simulation makes (transformers' save_on_cpu)."""
    import memfit.sim.offload as offload_mod
    from memfit.estimator import estimate
    from memfit.planner.ranking import StepTimer
    from memfit.sim.engine import simulate

    gpu = as_gpu_spec("A100-80GB")
    ckpt = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", weights_dtype="bf16",
                      per_device_train_batch_size=3, max_length=256, gradient_checkpointing=True)
    [variant] = REGISTRY["checkpoint_offload"].variants(ckpt, gpu)
    off = ckpt.replace(**variant)
    assert off.gradient_checkpointing_kwargs == {"offload": True}
    a, b = estimate(ckpt), estimate(off)
    assert b.breakdown["activations"] < a.breakdown["activations"] or \
        b.phase_breakdowns["forward"]["activations"] < a.phase_breakdowns["forward"]["activations"]
    trackers = []
    real = offload_mod.host_offload_patch

    def spy(tracker):
        trackers.append(tracker)
        return real(tracker)

    timer = StepTimer.for_setup(off, gpu)
    for weights in ("bf16", "fp32"):
        trackers.clear()
        s = off.replace(weights_dtype=weights)
        offload_mod.host_offload_patch = spy
        try:
            simulate(s, optimizer_steps=0, splice=False)  # one micro-step (accumulation 1)
        finally:
            offload_mod.host_offload_patch = real
        host = sum(r.size_bytes for t in trackers for r in t.records if r.category == "host")
        assert host > 0 and StepTimer.for_setup(s, gpu).offload_bytes(s) == host
    assert timer.offload_bytes(ckpt) == 0
    slower = timer.seconds(off, 10**6, 10**6) - timer.seconds(ckpt, 10**6, 10**6)
    from memfit.planner.throughput import host_link_gbps

    assert slower == pytest.approx(2 * timer.offload_bytes(off) / (host_link_gbps(gpu) * 1e9))


def test_checkpointing_reaches_a_live_trainer(tmp_path):
    """transformers 5.24 Trainer reads `activation_checkpointing`; `gradient_checkpointing` only mirrors it after
    TrainingArguments.__post_init__, so memfit.fit must set the new name (it set only the old one)."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = SimpleNamespace(args=args, model=SimpleNamespace(supports_gradient_checkpointing=True))
    REGISTRY["gradient_checkpointing"].apply_to_trainer(trainer, {"gradient_checkpointing": True}, [], None)
    assert args.activation_checkpointing is True
    kw = REGISTRY["checkpoint_offload"].variants(TrainSetup(model="bert-base-uncased"), None)[0]
    REGISTRY["checkpoint_offload"].apply_to_trainer(trainer, {"gradient_checkpointing_kwargs":
                                                              kw["gradient_checkpointing_kwargs"]}, [], None)
    assert args.activation_checkpointing_kwargs == {"offload": True}
