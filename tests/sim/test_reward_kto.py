"""TRL's RewardTrainer (memfit.sim.reward_steps) and KTOTrainer (memfit.sim.kto_steps): their config names against
the installed TRL, each step on real CPU tensors against FakeTensors, and the closed forms (a reward model scores
two sequences per pair; KTO holds one reference copy of the weights and a KL batch as large as the batch, none with
`loss_type="apo_zero_unpaired"`), and KTO's step against TRL's real `compute_loss` on the CPU."""

from __future__ import annotations

import dataclasses

import pytest

trl = pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

import torch  # noqa: E402
from helpers import char_tokenizer, eos_beyond_vocab_llama, live_peaks, real_and_fake  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from memfit import TrainSetup, estimate  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.train_setup import TRAINING_ARGS_NAMES, TRL_CONFIG_NAMES  # noqa: E402

LLAMA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
B, S = 4, 16


def _setup(trainer: str, **kw) -> TrainSetup:
    base = dict(model=LLAMA, trainer=trainer, per_device_train_batch_size=B, gradient_accumulation_steps=2,
                max_length=S, optim="adamw_torch", attn_implementation="sdpa")
    if trainer != "reward":
        base["task"] = "causal-lm"
    return TrainSetup(**{**base, **kw})


@pytest.mark.parametrize("trainer, config", [("reward", "RewardConfig"), ("kto", "KTOConfig")])
def test_config_names_match_installed_trl(trainer, config):
    cls = getattr(trl, config)
    assert TRL_CONFIG_NAMES[trainer] == {f.name for f in dataclasses.fields(cls)} - TRAINING_ARGS_NAMES


def test_config_objects_are_read(tmp_path):
    from trl import KTOConfig, RewardConfig

    s = TrainSetup.from_training_args(RewardConfig(output_dir=str(tmp_path), use_cpu=True, max_length=256), model=LLAMA)
    assert (s.trainer, s.task, s.num_labels, s.max_length) == ("reward", "seq-cls", 1, 256)
    assert s.gradient_checkpointing and s.precision == "bf16"  # TRL's base-config defaults
    s = TrainSetup.from_training_args(KTOConfig(output_dir=str(tmp_path), use_cpu=True, precompute_ref_log_probs=True,
                                                per_device_train_batch_size=4), model=LLAMA)
    assert (s.trainer, s.beta, s.precompute_ref_log_probs) == ("kto", 0.1, True)


@pytest.mark.parametrize("kw, fragment", [
    (dict(trainer="reward", task="causal-lm"), "trains a sequence-classification head"),
    (dict(trainer="kto", per_device_train_batch_size=1), "too small for KTO"),
    (dict(trainer="kto", beta=float("nan")), "`beta` must be a finite number"),
    (dict(trainer="kto", loss_type="apo_zero"), "did you mean `apo_zero_unpaired`"),
    (dict(trainer="reward", loss_type="kto"), "`loss_type` is a setting of TRL's"),
    (dict(trainer="sft", precompute_ref_log_probs=True), "DPOTrainer setting (KTOTrainer's too)"),
])
def test_bad_input_is_one_line(kw, fragment):
    with pytest.raises(MemfitError) as err:
        _setup(**kw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_args_reader_names_the_closest():
    with pytest.raises(MemfitError, match="did you mean `desirable_weight`"):
        TrainSetup.from_kwargs(LLAMA, training_args={"trainer": "kto", "desirable_weights": 1.0})
    with pytest.raises(MemfitError, match="RewardConfig setting; say which trainer"):
        TrainSetup.from_kwargs(LLAMA, training_args={"center_rewards_coefficient": 0.01})


@pytest.mark.slow
@pytest.mark.parametrize("trainer, kw", [("reward", {}), ("reward", dict(lora_r=4)), ("kto", {}),
                                         ("kto", dict(lora_r=4)), ("kto", dict(precompute_ref_log_probs=True)),
                                         ("kto", dict(loss_type="apo_zero_unpaired", precompute_ref_log_probs=True))],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_step_on_real_tensors_matches_fake(trainer, kw):
    """Forward, backward and optimizer of RewardTrainer / KTOTrainer on real (zero) CPU tensors and on FakeTensors:
    the same trace, event for event."""
    real_and_fake(_setup(trainer, **kw))


def _inputs(report) -> list[int]:
    """The sizes of the batch tensors the first micro-step puts on the device."""
    first = next(i for i, ev in enumerate(report.trace) if ev.category == "inputs")
    out = []
    for ev in report.trace[first:]:
        if ev.category != "inputs" or ev.action != "alloc":
            break
        out.append(ev.size_bytes)
    return out


@pytest.fixture(scope="module")
def reports():
    return {name: estimate(_setup(trainer, **kw), gpu="A100-80GB")
            for name, (trainer, kw) in {"reward": ("reward", {}), "kto": ("kto", {}),
                                        "kto_pre": ("kto", dict(precompute_ref_log_probs=True)),
                                        "kto_lora": ("kto", dict(lora_r=4)),
                                        "kto_lora_pre": ("kto", dict(lora_r=4, precompute_ref_log_probs=True)),
                                        "dpo": ("dpo", {}), "dpo_pre": ("dpo", dict(precompute_ref_log_probs=True))
                                        }.items()}


@pytest.mark.slow
def test_reward_model_scores_two_sequences_per_pair(reports):
    """RewardTrainer's batch: chosen and rejected in one `[2B, S]` int64 input_ids and attention_mask; the model is
    a one-label classifier (its score head `[1, hidden]`, no LM head)."""
    assert _inputs(reports["reward"]) == [2 * B * S * 8] * 2
    r = reports["reward"]
    assert r.task == "seq-cls"
    head = LLAMA.hidden_size * 4  # the `score` Linear of one label, fp32, no bias
    lm = LlamaForCausalLM(LLAMA)
    causal = sum(p.numel() * 4 for p in lm.parameters())
    # the classifier's weights: the causal LM's without its (untied) LM head, plus the score head
    expected = causal - LLAMA.vocab_size * LLAMA.hidden_size * 4 + head
    assert 0 <= r.phase_breakdowns["optimizer"]["weights"] - expected <= 512 * 32


@pytest.mark.slow
def test_kto_reference_and_kl_batch(reports):
    """KTO holds exactly one reference copy of the weights (none with precomputed log-probs, none with peft), and
    its collator puts the KL batch on the device next to the batch: six `[B, S]` int64 tensors and the labels."""
    weights_bytes = sum(p.numel() * p.element_size() for p in LlamaForCausalLM(LLAMA).parameters())
    w = {k: r.phase_breakdowns["forward"]["weights"] for k, r in reports.items()}
    assert 0 <= w["kto"] - w["kto_pre"] - weights_bytes <= 512 * 32
    assert w["kto_lora"] == w["kto_lora_pre"]
    assert w["kto"] == w["dpo"] and w["kto_pre"] == w["dpo_pre"]  # the same rule as DPO's
    assert _inputs(reports["kto"]) == [B * S * 8] * 6 + [B]  # input_ids, attention_mask, completion_mask x 2; label
    assert _inputs(reports["kto_pre"]) == [B * S * 8] * 6 + [B * 4] * 2 + [B]  # and the precomputed ref_logps


def _real_kto_step(tmp_path, loss_type: str):
    """TRL's KTOTrainer (1.16) on the CPU: one micro-batch of B examples collated by its own collator and its
    `compute_loss`, under memfit's tracker (TRL's log-prob kernels allocating as on CUDA, as memfit simulates them),
    the policy's and the reference's weights registered first. Prompt + completion + EOS is 16 tokens for the longest
    example, and for the longest of the KL batch (the completions are all 7 characters)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from memfit.sim import _trl_adapter as trl_adapter
    from memfit.sim.tracker import StorageTracker

    config = eos_beyond_vocab_llama()
    config.vocab_size += 1  # KTOTrainer appends EOS to every completion: it is an id of the model here
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")  # the reference copy is loaded from the path
    args = KTOConfig(str(tmp_path / "out"), per_device_train_batch_size=B, max_length=None, loss_type=loss_type,
                     use_cpu=True, report_to="none", bf16=False, gradient_checkpointing=False, disable_tqdm=True,
                     logging_strategy="no", model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    data = {"prompt": ["abcdefgh", "ijkl", "mnopqr", "stu"], "completion": ["ijklmno", "mnopqrs", "stuvwxy", "vwxyzab"],
            "label": [True, True, False, False]}
    t = KTOTrainer(model=str(tmp_path / "model"), args=args, train_dataset=Dataset.from_dict(data),
                   processing_class=char_tokenizer())
    examples = [t.train_dataset[i] for i in range(B)]
    tr = StorageTracker()
    with trl_adapter.cuda_kernels(), tr:
        for model in (t.model, t.ref_model):
            for w in list(model.parameters()) + list(model.buffers()):
                tr.register(w, "weights")
        first = len(tr.events)
        batch = t.data_collator(examples)
        t.model.train()
        t.compute_loss(t.model, batch)
    assert batch["input_ids"].shape == (B, S)
    return tr.trace()[first:], set(batch)


@pytest.mark.slow
def test_kto_loss_types_against_trl_compute_loss(tmp_path):
    """`loss_type="apo_zero_unpaired"` estimates no KL term (KTOTrainer `calculate_KL`): no KL batch from the collator,
    no KL forward of the policy or of the reference. memfit's forward phase (batch, KL and policy forwards, the
    reference, the loss) of each loss type against TRL's real collator and `compute_loss` measured by memfit's tracker
    on the CPU: the peak above what is alive before within 0.1% (TRL's entropy metric, a few `[B, S]` temporaries, is
    not simulated), and what apo_zero_unpaired saves the same as in the real run to the byte."""
    from memfit.sim import engine

    measured, predicted = {}, {}
    for loss_type in ("kto", "apo_zero_unpaired"):
        trace, keys = _real_kto_step(tmp_path / loss_type, loss_type)
        assert any(k.startswith("KL_") for k in keys) == (loss_type == "kto")
        config = eos_beyond_vocab_llama()
        config.vocab_size += 1
        setup = TrainSetup(model=config, task="causal-lm", trainer="kto", per_device_train_batch_size=B,
                           gradient_accumulation_steps=1, max_length=S, optim="adamw_torch", attn_implementation="sdpa",
                           precision="fp32", gradient_checkpointing=False, loss_type=loss_type)
        measured[loss_type] = live_peaks(trace)[0]
        predicted[loss_type] = live_peaks(engine.simulate(setup, splice=False).trace, "forward")[0]
        assert abs(predicted[loss_type] - measured[loss_type]) <= 0.001 * measured[loss_type], (predicted, measured)
    saved = measured["kto"] - measured["apo_zero_unpaired"]
    assert saved >= 3 * B * S * 8  # at least the KL batch's input_ids, attention_mask and completion_mask
    assert predicted["kto"] - predicted["apo_zero_unpaired"] == saved


def test_apo_zero_unpaired_allows_one_example_and_drops_the_kl_batch():
    """KTOTrainer.__init__ refuses one example per micro-batch only when it estimates the KL term; apo_zero_unpaired's
    batch is input_ids, attention_mask, completion_mask and the labels (with precomputed log-probs, `ref_logps` only)."""
    from memfit.sim import kto_steps

    kto_steps.kto_batch(_setup("kto", per_device_train_batch_size=1, loss_type="apo_zero_unpaired"))
    batch = kto_steps.kto_batch(_setup("kto", loss_type="apo_zero_unpaired", precompute_ref_log_probs=True))
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask", "ref_logps", "label"}
    assert set(kto_steps.kto_batch(_setup("kto"))) == {"input_ids", "attention_mask", "completion_mask", "KL_input_ids",
                                                       "KL_attention_mask", "KL_completion_mask", "label"}

