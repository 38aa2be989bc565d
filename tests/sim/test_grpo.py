"""TRL's GRPOTrainer (memfit.sim.grpo_steps): GRPOConfig's names and derived sizes against the installed TRL, the
generation phase against transformers' real `generate` measured by memfit's tracker on real CPU tensors, the whole
step on real tensors against FakeTensors, and the closed forms (KV cache, reference copy, vLLM's share)."""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest

trl = pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

import torch  # noqa: E402
from helpers import char_tokenizer, eos_beyond_vocab_llama, live_peaks, real_and_fake, trace_key  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from memfit import TrainSetup, estimate  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.gpus.catalog import as_gpu_spec  # noqa: E402
from memfit.peaks import peaks  # noqa: E402
from memfit.sim import grpo_steps  # noqa: E402
from memfit.sim.tracker import StorageTracker  # noqa: E402
from memfit.train_setup import TRAINING_ARGS_NAMES, TRL_CONFIG_NAMES, grpo_generation_sizes  # noqa: E402


def _llama(kv_heads: int = 2, layers: int = 2) -> LlamaConfig:
    """A tiny Llama; no tokenizer: the token ids are made up (pad 0, bos 1, eos 2)."""
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=kv_heads, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, max_position_embeddings=512)


LLAMA = _llama()


def _setup(**kw) -> TrainSetup:
    base = dict(model=LLAMA, task="causal-lm", trainer="grpo", per_device_train_batch_size=4,
                gradient_accumulation_steps=2, num_generations=4, max_length=16, max_completion_length=24,
                optim="adamw_torch", attn_implementation="sdpa")
    return TrainSetup(**{**base, **kw})


# -- settings ----------------------------------------------------------------------------------------

def test_grpo_config_names_match_installed_trl():
    from trl import GRPOConfig

    assert TRL_CONFIG_NAMES["grpo"] == {f.name for f in dataclasses.fields(GRPOConfig)} - TRAINING_ARGS_NAMES


@pytest.mark.parametrize("kw", [dict(per_device_train_batch_size=8, gradient_accumulation_steps=1),
                                dict(per_device_train_batch_size=4, gradient_accumulation_steps=4),
                                dict(per_device_train_batch_size=4, steps_per_generation=3),
                                dict(per_device_train_batch_size=2, generation_batch_size=16),
                                dict(per_device_train_batch_size=4, generation_batch_size=6),
                                dict(per_device_train_batch_size=4, generation_batch_size=8, steps_per_generation=2)])
def test_generation_sizes_as_grpo_config_derives_them(kw, tmp_path):
    """steps_per_generation / generation_batch_size as GRPOConfig.__post_init__ (TRL 1.16) derives them; where
    it raises ValueError, memfit raises its one-line error."""
    from trl import GRPOConfig

    args = {"gradient_accumulation_steps": 1, "num_generations": 2, **kw}
    try:
        cfg = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **args)
    except ValueError:
        with pytest.raises(MemfitError) as err:
            grpo_generation_sizes(args["per_device_train_batch_size"], args["gradient_accumulation_steps"],
                                  args.get("steps_per_generation"), args.get("generation_batch_size"))
        assert "\n" not in str(err.value)
        return
    assert grpo_generation_sizes(args["per_device_train_batch_size"], args["gradient_accumulation_steps"],
                                 args.get("steps_per_generation"), args.get("generation_batch_size")) == \
        (cfg.steps_per_generation, cfg.generation_batch_size)


def test_grpo_config_object_is_read(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      steps_per_generation=2, max_completion_length=64, beta=0.04, use_vllm=True,
                      vllm_gpu_memory_utilization=0.5)
    s = TrainSetup.from_training_args(args, model=LLAMA)
    assert (s.trainer, s.num_generations, s.max_completion_length, s.beta, s.grpo_sizes) == ("grpo", 4, 64, 0.04, (2, 8))
    assert s.use_vllm and s.vllm_gpu_memory_utilization == 0.5
    # GRPOConfig's own defaults (TRL 1.16): bf16 and gradient checkpointing on
    assert s.precision == "bf16" and s.gradient_checkpointing


def test_grpo_args_file_names_and_trl_defaults():
    s = TrainSetup.from_kwargs(LLAMA, training_args={"trainer": "grpo", "temperature": 0.7, "loss_type": "dapo",
                                                     "max_prompt_length": 128, "use_liger_loss": True})
    assert s.gradient_checkpointing and s.precision == "bf16"  # GRPOConfig's defaults, with notes
    assert any("max_prompt_length" in n and "ignored" in n for n in s.notes)
    assert any("use_liger_loss" in n and "fused LM head" in n for n in s.notes)
    with pytest.raises(MemfitError, match="did you mean `num_generations`"):
        TrainSetup.from_kwargs(LLAMA, training_args={"trainer": "grpo", "num_generation": 4})
    with pytest.raises(MemfitError, match="GRPOConfig setting; say which trainer"):
        TrainSetup.from_kwargs(LLAMA, training_args={"vllm_server_port": 8000})


@pytest.mark.parametrize("kw, fragment", [
    (dict(num_generations=3), "not divisible by num_generations `3`"),
    (dict(num_generations=1), "num_generations `1` is below 2"),
    (dict(generation_batch_size=6), "generation_batch_size `6` must be divisible"),
    (dict(generation_batch_size=8, steps_per_generation=2), "both set"),
    (dict(vllm_gpu_memory_utilization=1.2), "vllm_gpu_memory_utilization `1.2`"),
    (dict(vllm_mode="remote"), "vllm_mode `remote`"),
    (dict(beta=-0.1), "`beta` must be"),
    (dict(trainer="sft", use_vllm=True), "`use_vllm` is a GRPOTrainer setting"),
])
def test_bad_grpo_input_is_one_line(kw, fragment):
    with pytest.raises(MemfitError) as err:
        _setup(**kw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("trainer, name", [("gkd", "GKDTrainer"), ("orpo", "ORPOTrainer"), ("cpo", "CPOTrainer"),
                                           ("online_dpo", "OnlineDPOTrainer")])
def test_other_rl_trainers_are_named_not_supported(trainer, name):
    with pytest.raises(MemfitError) as err:
        TrainSetup(model=LLAMA, trainer=trainer)
    assert name in str(err.value) and "not supported" in str(err.value) and "\n" not in str(err.value)


# -- generation: memfit against transformers' generate on real tensors ------------------------------------

def _measured(fn, model) -> tuple[int, list]:
    """Peak bytes `fn` adds above the model's weights, on real CPU tensors under memfit's tracker; its trace."""
    tr = StorageTracker()
    with tr:
        for t in list(model.parameters()) + list(model.buffers()):
            tr.register(t, "weights")
        first = len(tr.events)
        fn(tr)
    trace = tr.trace()[first:]
    return peaks(trace, round_to=1).overall.bytes, trace


@pytest.mark.parametrize("kv_heads, g, p, c", [(2, 8, 16, 40), (4, 8, 16, 40), (1, 4, 8, 96)])
def test_generation_matches_transformers_generate(kv_heads, g, p, c):
    """GRPO's generation phase: memfit's prefill + last decode step on a grown cache against transformers'
    `generate` run for all `c` tokens as GRPOTrainer calls it (do_sample, TRL's defaults, EOS ids), measured by
    memfit's tracker on real CPU tensors: the peak above the weights within 0.5%."""
    config = _llama(kv_heads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # GRPOTrainer.__init__'s generation config (grpo_trainer.py), with the tiny model's special ids
    gen = GenerationConfig(max_new_tokens=c, do_sample=True, pad_token_id=0, bos_token_id=1, eos_token_id=[2],
                           temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                           cache_implementation=None, disable_compile=True)
    shape = {}

    def real(tr):
        ids = torch.randint(3, 256, (g, p))
        mask = torch.ones(g, p, dtype=torch.long)
        mask[-1, :1] = 0  # left-padded prompts of different lengths
        tr.register(ids, "inputs")
        tr.register(mask, "inputs")
        with torch.no_grad():
            shape["out"] = tuple(model.generate(input_ids=ids, attention_mask=mask, generation_config=gen).shape)

    def predicted(tr):
        runner = types.SimpleNamespace(model=model, fwd_model=model, cut=None, low=None, tracker=tr, checkpointing=None,
                                       setup=None)
        grpo_steps.generation(runner, g, p, c)

    measured, _ = _measured(real, model)
    assert shape["out"] == (g, p + c)  # no sequence stopped early (the worst case memfit predicts)
    ours, trace = _measured(predicted, model)
    assert abs(ours - measured) <= 0.005 * measured, (ours, measured)
    # the closed form: 2 x layers x kv_heads x head_dim x tokens x batch x bytes, tokens = P + C - 1 at the end
    layer = g * kv_heads * (64 // 4) * (p + c - 1) * 4
    final = [ev for ev in trace if ev.action == "alloc" and ev.size_bytes == layer]
    assert len(final) == 2 * config.num_hidden_layers
    assert sum(ev.size_bytes for ev in final) == grpo_steps.kv_cache_bytes(config, sequences=g, tokens=p + c - 1,
                                                                           dtype_bytes=4)


# -- the whole step: real tensors against FakeTensors ------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(beta=0.04), dict(beta=0.04, lora_r=4), dict(use_vllm=True),
                                dict(gradient_accumulation_steps=1, steps_per_generation=2)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_grpo_step_on_real_tensors_matches_fake(kw):
    """Generation, scoring, forward, backward and optimizer of GRPO on real (zero) CPU tensors and on FakeTensors:
    the same trace, event for event (as tests/sim/test_trl.py checks SFT and DPO)."""
    real, fake = real_and_fake(_setup(**kw))
    phases = {ev.phase for ev in fake.trace}
    assert ("generation" in phases) != bool(kw.get("use_vllm")) and "scoring" in phases


SPLICE_CASES = [pytest.param(dict(), id="default"),
                pytest.param(dict(beta=0.04), id="beta-reference-copy", marks=pytest.mark.slow),
                pytest.param(dict(beta=0.04, lora_r=4), id="beta-lora", marks=pytest.mark.slow),
                pytest.param(dict(use_vllm=True), id="vllm", marks=pytest.mark.slow),
                pytest.param(dict(gradient_accumulation_steps=1, steps_per_generation=2), id="steps_per_generation",
                             marks=pytest.mark.slow),
                pytest.param(dict(precision="bf16", gradient_checkpointing=True, beta=0.04), id="bf16-checkpointing",
                             marks=pytest.mark.slow),
                pytest.param(dict(num_iterations=2, max_completion_length=1), id="one-token", marks=pytest.mark.slow),
                pytest.param(dict(eval_strategy="steps", per_device_eval_batch_size=8, beta=0.04), id="eval",
                             marks=pytest.mark.slow)]


@pytest.mark.parametrize("kw", SPLICE_CASES)
def test_spliced_grpo_trace_equals_full_model_trace(kw, monkeypatch):
    """Layer splicing of every GRPO phase (memfit.sim.splice; the generation's prefill, grown cache and decode step,
    the scoring chunks of the policy and of the reference's cut model, the training step): on an 8-layer Llama the
    spliced trace is the full model's, event for event, as tests/sim/test_splice.py checks SFT's figures."""
    from memfit.sim import engine

    runners = []
    plain = engine._Runner.run
    monkeypatch.setattr(engine._Runner, "run", lambda self, **k: runners.append(self) or plain(self, **k))
    spliced = engine.simulate(_setup(model=_llama(layers=8), **kw), splice=True)
    assert runners[-1].cut is not None, "splicing did not happen"
    assert (runners[-1].ref_cut is not None) == (kw.get("beta", 0) > 0 and "lora_r" not in kw)
    full = engine.simulate(_setup(model=_llama(layers=8), **kw), splice=False)
    assert runners[-1].cut is None
    a, b = trace_key(spliced.trace), trace_key(full.trace)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert a == b, f"first difference at event {first}: spliced {a[first:first + 3]} full {b[first:first + 3]}"
    assert peaks(spliced.trace).by_phase.keys() >= {"scoring", "forward", "backward"} | (
        {"eval"} if "eval_strategy" in kw else set())


@pytest.mark.slow
def test_spliced_trace_with_a_reward_model_equals_full_model_trace(tmp_path, monkeypatch):
    """The reward model's forward runs whole between the policy's spliced passes (memfit.sim.grpo_steps
    `reward_scores`): the spliced trace is still the full model's."""
    config = _llama()
    config.architectures = ["LlamaForSequenceClassification"]
    config.save_pretrained(tmp_path / "reward")
    test_spliced_grpo_trace_equals_full_model_trace(dict(reward_model=str(tmp_path / "reward")), monkeypatch)


def test_qlora_adapters_are_bf16_as_the_installed_trl_casts_them():
    """Every TRL trainer memfit simulates casts a quantized model's trainable parameters to bf16 in `__init__` (the
    installed TRL's code says so); transformers' Trainer does not: the estimate's adapter gradients are 2 bytes per
    parameter for GRPO and SFT, peft's 4 for the plain Trainer."""
    import inspect

    from trl.trainer.distillation_trainer import DistillationTrainer

    from memfit.sim.trl_steps import QLORA_BF16_ADAPTER_TRAINERS
    from memfit.train_setup import TRL_CONFIG_CLASS_NAMES

    classes = {"grpo": trl.GRPOTrainer, "rloo": trl.RLOOTrainer, "kto": trl.KTOTrainer, "sft": trl.SFTTrainer,
               "dpo": trl.DPOTrainer, "reward": trl.RewardTrainer, "distill": DistillationTrainer}
    assert set(classes) == set(TRL_CONFIG_CLASS_NAMES) == set(QLORA_BF16_ADAPTER_TRAINERS)
    for name, cls in classes.items():
        assert "param.data = param.data.to(torch.bfloat16)" in inspect.getsource(cls.__init__), name
    lora = dict(load_in_4bit=True, lora_r=8, precision="bf16", optim="adamw_torch")
    grpo = estimate(_setup(**lora), gpu="A100-80GB")
    plain = dict(model=LLAMA, task="causal-lm", per_device_train_batch_size=4, max_length=32, **lora)
    sft = estimate(TrainSetup(trainer="sft", **plain), gpu="A100-80GB")
    hf = estimate(TrainSetup(**plain), gpu="A100-80GB")
    # LoRA on q_proj / v_proj of 2 layers: A [8, 64] and B [64, 8] / [32, 8] (2 KV heads of 16)
    adapters = 2 * (8 * 64 + 64 * 8) + 2 * (8 * 64 + 32 * 8)
    assert hf.phase_breakdowns["optimizer"]["gradients"] >= 4 * adapters
    for report in (grpo, sft):
        assert 2 * adapters <= report.phase_breakdowns["optimizer"]["gradients"] < 4 * adapters
        assert any("casts the trainable parameters of a quantized model to bf16" in n for n in report.notes)


def test_old_log_probs_only_when_trl_computes_them():
    """GRPOTrainer computes old log-probs when gradient_accumulation_steps % (steps_per_generation x
    num_iterations) != 0, or with vLLM (its importance sampling correction)."""
    assert not grpo_steps.needs_old_log_probs(_setup())
    assert grpo_steps.needs_old_log_probs(_setup(num_iterations=2))
    assert grpo_steps.needs_old_log_probs(_setup(gradient_accumulation_steps=1, steps_per_generation=2))
    assert grpo_steps.needs_old_log_probs(_setup(use_vllm=True))


# -- closed forms in the estimate ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reports():
    out = {}
    for name, kw in (("beta0", dict(beta=0.0)), ("beta", dict(beta=0.04)), ("beta_lora", dict(beta=0.04, lora_r=4)),
                     ("lora", dict(beta=0.0, lora_r=4)), ("vllm", dict(use_vllm=True)),
                     ("sleep", dict(use_vllm=True, vllm_enable_sleep_mode=True))):
        out[name] = estimate(_setup(**kw), gpu="A100-80GB")
    return out


def test_beta_zero_drops_exactly_one_copy_of_the_weights(reports):
    weights_bytes = sum(p.numel() * p.element_size() for p in LlamaForCausalLM(LLAMA).parameters())
    ref = reports["beta"].phase_breakdowns["forward"]["weights"] - reports["beta0"].phase_breakdowns["forward"]["weights"]
    assert abs(ref - weights_bytes) <= 512 * 32  # each tensor rounded up to 512 bytes
    assert reports["beta"].rl["reference_copy"] and not reports["beta0"].rl["reference_copy"]
    # peft: the adapter disabled is the reference, no copy
    assert reports["beta_lora"].phase_breakdowns["forward"]["weights"] == \
        reports["lora"].phase_breakdowns["forward"]["weights"]
    assert not reports["beta_lora"].rl["reference_copy"]


def test_vllm_share_is_utilization_times_total(reports):
    total = as_gpu_spec("A100-80GB").total_bytes
    v = reports["vllm"].rl["vllm"]
    assert v["generation_bytes"] == v["training_bytes"] == int(0.3 * total)
    # the training step has what remains of the card; nvidia-smi shows the share too
    assert reports["vllm"].capacity_bytes == total - reports["vllm"].non_pytorch_bytes - int(0.3 * total)
    assert reports["vllm"].device_used_bytes == (reports["vllm"].peak_reserved_bytes + reports["vllm"].non_pytorch_bytes
                                                 + int(0.3 * total))
    assert "generation" not in reports["vllm"].phases  # vLLM generates, not the training model
    # sleep mode (level 2): nothing held while training, the share back while generating
    s = reports["sleep"].rl["vllm"]
    assert s["training_bytes"] == 0 and s["sleep_level"] == 2
    assert reports["sleep"].capacity_bytes == total - reports["sleep"].non_pytorch_bytes
    assert s["device_used_at_generation_bytes"] == (s["training_held_at_generation_bytes"]
                                                   + reports["sleep"].non_pytorch_bytes + int(0.3 * total))
    # the most over the generations: the second wakes vLLM beside the weights and Adam's state of the first step
    bd = reports["sleep"].phase_breakdowns
    assert s["training_held_at_generation_bytes"] >= bd["forward"]["weights"] + bd["optimizer"]["optimizer_state"]


def test_generation_rows_in_the_report(reports):
    r = reports["beta0"]
    assert r.phases["generation"] > 0 and r.phases["scoring"] > 0
    assert r.rl["generation_batch_size"] == 8 and r.rl["steps_per_generation"] == 2
    assert r.rl["kv_cache_bytes"] == grpo_steps.kv_cache_bytes(LLAMA, sequences=8, tokens=16 + 24 - 1, dtype_bytes=4)


def test_vllm_share_too_small_for_the_weights_does_not_fit():
    r = estimate(_setup(use_vllm=True, vllm_gpu_memory_utilization=1e-6), gpu="A100-80GB")
    assert r.fits is False and any("vLLM fails at start-up" in n for n in r.notes)




# -- evaluation: memfit's eval phase against TRL's real GRPOTrainer.evaluate on the CPU ---------------------------

#: The eval prompts (one token per character), of different lengths: left-padded, the longest P = 16 tokens.
EVAL_PROMPTS = ["abcdefghijklmnop", "qrstuvw"]
EVAL_LLAMA = eos_beyond_vocab_llama()
EVAL_BATCH, EVAL_COMPLETION = 8, 24


def _real_evaluate(tmp_path, trainer: str, reward_model=None, **kw):
    """TRL's GRPOTrainer / RLOOTrainer `evaluate()` on the CPU (one eval step of EVAL_BATCH completions), under
    memfit's tracker with TRL's log-prob kernels allocating as on CUDA (as memfit simulates them); the weights
    registered first. `reward_model`: a sequence-classification model as the one reward function (with
    `char_tokenizer` as its processing class). Returns (the trace, the completions' lengths)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from memfit.sim import _trl_adapter as trl_adapter

    config_cls, trainer_cls = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[trainer]
    torch.manual_seed(0)
    config = copy.deepcopy(EVAL_LLAMA)  # a model writes into its config (the attention implementation)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    if kw.get("beta", {"grpo": 0.0, "rloo": 0.05}[trainer]) > 0:  # the reference copy is loaded from the model's path
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    args = config_cls(str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      num_generations=4, per_device_eval_batch_size=EVAL_BATCH, max_completion_length=EVAL_COMPLETION,
                      use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="steps",
                      bf16=False, gradient_checkpointing=False, disable_tqdm=True,
                      model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **kw)
    tokenizer = char_tokenizer()
    rewards = {"reward_funcs": lambda completions, **k: [float(len(c)) for c in completions]}
    if reward_model is not None:
        from tokenizers import decoders

        # completions decoded without a space between characters: tokenized again, as many tokens as generated
        tokenizer.backend_tokenizer.decoder = decoders.Fuse()
        rewards = {"reward_funcs": reward_model, "reward_processing_classes": tokenizer}
    t = trainer_cls(model=model, args=args, train_dataset=Dataset.from_dict({"prompt": EVAL_PROMPTS * 4}),
                    eval_dataset=Dataset.from_dict({"prompt": EVAL_PROMPTS}), processing_class=tokenizer,
                    **rewards)
    lengths = []
    generate = t._generate_single_turn

    def counted(*a, **k):
        out = generate(*a, **k)
        lengths.extend(len(ids) for ids in (out[0] if isinstance(out, tuple) else out))  # GRPO's: a tuple
        return out

    t._generate_single_turn = counted
    tr, windows = StorageTracker(), []
    with trl_adapter.cuda_kernels(), tr:
        weights = [t.model.parameters(), t.model.buffers()]
        if getattr(t, "ref_model", None) is not None:
            weights += [t.ref_model.parameters(), t.ref_model.buffers()]
        if reward_model is not None:
            weights += [t.reward_funcs[0].parameters(), t.reward_funcs[0].buffers()]
        for group in weights:
            for w in group:
                tr.register(w, "weights")
        first = len(tr.events)
        if reward_model is not None:  # the event window of each reward forward, in the returned trace
            t.reward_funcs[0].register_forward_pre_hook(lambda *a: windows.append([len(tr.events) - first]))
            t.reward_funcs[0].register_forward_hook(lambda *a: windows[-1].append(len(tr.events) - first))
        t.evaluate()
    if reward_model is not None:
        return tr.trace()[first:], lengths, windows
    return tr.trace()[first:], lengths


EVAL_CASES = [pytest.param("grpo", dict(), id="grpo"),
              pytest.param("grpo", dict(beta=0.04), id="grpo-beta-reference-copy", marks=pytest.mark.slow),
              pytest.param("rloo", dict(), id="rloo-reference-copy", marks=pytest.mark.slow)]


@pytest.mark.parametrize("trainer, kw", EVAL_CASES)
def test_eval_phase_matches_real_trainer_evaluate(trainer, kw, tmp_path):
    """GRPOTrainer / RLOOTrainer.prediction_step (TRL 1.16) generates the eval batch's completions, scores them and
    computes the loss under no_grad: memfit's `eval` phase (after two simulated optimizer steps) against TRL's real
    `evaluate()` measured by memfit's tracker on the CPU, above what is alive when each starts: the whole phase's
    peak and the peak before the loss (generation and scoring) within 0.1%. (What differs: TRL's logging metrics,
    a few scalars; the host copies a GPU run makes and a CPU run does not.)"""
    real, lengths = _real_evaluate(tmp_path, trainer, **kw)
    assert lengths == [EVAL_COMPLETION] * EVAL_BATCH  # no completion stopped early: the worst case memfit predicts
    setup = TrainSetup(model=EVAL_LLAMA, task="causal-lm", trainer=trainer, per_device_train_batch_size=4,
                       gradient_accumulation_steps=2, num_generations=4, max_completion_length=EVAL_COMPLETION,
                       example_lengths=[len(p) for p in EVAL_PROMPTS], optim="adamw_torch", attn_implementation="sdpa",
                       precision="fp32", eval_strategy="steps", per_device_eval_batch_size=EVAL_BATCH,
                       eval_samples=len(EVAL_PROMPTS), gradient_checkpointing=False, **kw)
    from memfit.sim import engine

    sim = engine.simulate(setup, splice=False)
    (peak, pre), (real_peak, real_pre) = live_peaks(sim.trace, "eval"), live_peaks(real)
    assert abs(peak - real_peak) <= 0.001 * real_peak, (peak, real_peak)
    assert abs(pre - real_pre) <= 0.001 * real_pre, (pre, real_pre)
    # the eval batch's KV cache: per_device_eval_batch_size sequences of P + C - 1 tokens at the end
    layer = EVAL_BATCH * 2 * (64 // 4) * (16 + EVAL_COMPLETION - 1) * 4
    cache = [ev for ev in sim.trace if ev.phase == "eval" and ev.action == "alloc" and ev.size_bytes == layer]
    assert sum(ev.size_bytes for ev in cache) == grpo_steps.kv_cache_bytes(
        EVAL_LLAMA, sequences=EVAL_BATCH, tokens=16 + EVAL_COMPLETION - 1, dtype_bytes=4)


def _reward_config():
    """A sequence-classification Llama over `char_tokenizer`'s ids, wider than the policy: its forward over the eval
    batch is the largest thing scoring allocates (each tensor under the 1 MiB of `live_peaks`' loss tiles)."""
    config = eos_beyond_vocab_llama(hidden=128)
    config.intermediate_size = 512
    config.architectures = ["LlamaForSequenceClassification"]
    return config


def _window_peak(events) -> int:
    """The peak of (action, bytes) events above what was alive before the first."""
    cur = peak = 0
    for action, size in events:
        cur += size if action == "alloc" else -size
        peak = max(peak, cur)
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_reward_model_matches_real_trainer_evaluate(trainer, tmp_path, monkeypatch):
    """A reward model among `reward_funcs` (`reward_model`): its weights on the device from the start (the closed
    form), and its forward over the whole eval batch in scoring (`_calculate_rewards`, under inference_mode)
    against TRL's real `evaluate()` on the CPU: the peak of the reward forward above what was alive when it
    started, the same bytes; it sets GRPO's scoring peak here."""
    from transformers import LlamaForSequenceClassification

    from memfit.sim import engine

    config = _reward_config()
    config.save_pretrained(tmp_path / "reward")
    torch.manual_seed(1)
    reward = LlamaForSequenceClassification(copy.deepcopy(config))
    real, _, windows = _real_evaluate(tmp_path, trainer, reward_model=reward)
    assert len(windows) == 1  # one eval batch, scored in one reward call
    real_forward = [(ev.action, ev.size_bytes) for ev in real[windows[0][0]:windows[0][1]]]

    simulated, plain = [], grpo_steps.reward_scores

    def measured(runner, g, tokens):  # the events of the simulated reward model's forward
        at = []
        hooks = [runner.reward_model.register_forward_pre_hook(lambda *a: at.append(len(runner.tracker.events))),
                 runner.reward_model.register_forward_hook(lambda *a: at.append(len(runner.tracker.events)))]
        out = plain(runner, g, tokens)
        for h in hooks:
            h.remove()
        simulated.append([(a, r.size_bytes) for a, r, _, _ in runner.tracker.events[at[0]:at[1]]])
        return out

    monkeypatch.setattr(grpo_steps, "reward_scores", measured)
    base = dict(model=EVAL_LLAMA, task="causal-lm", trainer=trainer, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, num_generations=4, max_completion_length=EVAL_COMPLETION,
                example_lengths=[len(p) for p in EVAL_PROMPTS], optim="adamw_torch", attn_implementation="sdpa",
                precision="fp32", eval_strategy="steps", per_device_eval_batch_size=EVAL_BATCH,
                eval_samples=len(EVAL_PROMPTS), gradient_checkpointing=False)
    with_reward = engine.simulate(TrainSetup(**base, reward_model=str(tmp_path / "reward")), splice=False)
    assert _window_peak(simulated[-1]) == _window_peak(real_forward), "the eval batch's reward forward"
    assert len(simulated) == 2  # the training step's generation batch before it
    monkeypatch.setattr(grpo_steps, "reward_scores", plain)
    without = engine.simulate(TrainSetup(**base), splice=False)
    if trainer == "grpo":  # RLOO always scores old log-probs: the 32768-wide tiles of TRL's kernels set its peak
        assert live_peaks(with_reward.trace, "scoring")[0] > 2 * live_peaks(without.trace, "scoring")[0]
    reward_bytes = sum(p.numel() * p.element_size() for p in reward.parameters())
    added = (peaks(with_reward.trace).by_phase["setup"].breakdown["weights"]
             - peaks(without.trace).by_phase["setup"].breakdown["weights"])
    assert abs(added - reward_bytes) <= 512 * 32  # each tensor rounded up to 512 bytes


def test_reward_model_is_a_grpo_and_rloo_setting(tmp_path):
    with pytest.raises(MemfitError, match="reward_model.*trainer is `dpo`"):
        TrainSetup(model=LLAMA, task="causal-lm", trainer="dpo", reward_model="x")
    with pytest.raises(MemfitError, match="^reward model `.*missing` is not bundled"):
        estimate(_setup(reward_model=str(tmp_path / "missing")))


def test_eval_with_vllm_holds_no_generation_tensors_and_wakes_vllm():
    """With vLLM, prediction_step generates with vLLM too: the eval phase holds no KV cache of the training model
    (the closed form's cache appears only without vLLM); in sleep mode vLLM wakes for the eval batch beside what
    training holds then (the buffered generation batch, the weights, Adam's state), counted in what nvidia-smi shows."""
    from memfit.sim import engine

    layer = 8 * 2 * (64 // 4) * (16 + 24 - 1) * 4  # one cache layer's keys of 8 eval sequences, P + C - 1 tokens

    def cache_allocs(sim):
        return [ev for ev in sim.trace if ev.phase == "eval" and ev.action == "alloc" and ev.size_bytes == layer]

    plain = engine.simulate(_setup(eval_strategy="steps", per_device_eval_batch_size=8), splice=False)
    vllm = engine.simulate(_setup(eval_strategy="steps", per_device_eval_batch_size=8, use_vllm=True), splice=False)
    assert len(cache_allocs(plain)) == 2 * LLAMA.num_hidden_layers and not cache_allocs(vllm)
    phases = {ev.phase for ev in vllm.trace}
    assert phases >= {"eval", "scoring"} and "generation" not in phases
    r = estimate(_setup(eval_strategy="steps", per_device_eval_batch_size=8, use_vllm=True,
                        vllm_enable_sleep_mode=True), gpu="A100-80GB")
    assert r.phases["eval"] > 0
    from memfit.peaks import rounded

    live, phase, held = {}, None, {}
    for ev in r.trace:  # what is alive (as the allocator rounds it) when each generation's vLLM wakes up
        if ev.phase in ("scoring", "eval") and phase != ev.phase:
            held.setdefault(ev.phase, []).append(sum(live.values()))
        phase = ev.phase
        if ev.action == "alloc":
            live[ev.id] = rounded(ev.size_bytes)
        elif ev.action == "free":
            live.pop(ev.id, None)
    v = r.rl["vllm"]
    # the eval batch's generation comes after the optimizer steps, beside the buffered batch: it holds the most
    assert held["eval"][0] > max(held["scoring"])
    assert v["training_held_at_generation_bytes"] == held["eval"][0]
    assert r.device_used_bytes >= v["device_used_at_generation_bytes"]


def test_eval_batch_must_hold_whole_groups_of_num_generations_eval():
    """GRPOConfig.__post_init__: with evaluation, per_device_eval_batch_size must be divisible by
    `num_generations_eval or num_generations`."""
    _setup(eval_strategy="steps", per_device_eval_batch_size=6, num_generations_eval=3)
    with pytest.raises(MemfitError) as err:
        _setup(eval_strategy="steps", per_device_eval_batch_size=6)
    assert "num_generations `4`" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(MemfitError, match="num_generations_eval `4`"):
        _setup(eval_strategy="steps", per_device_eval_batch_size=6, num_generations_eval=4)
