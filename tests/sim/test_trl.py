"""TRL's SFTTrainer and DPOTrainer: the settings read from SFTConfig / DPOConfig, the simulated
steps (memfit.sim.trl_steps) checked on real CPU tensors, real TRL trainers under memfit.testing.memory_budget
with preflight and MemfitCallback."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest

trl = pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from helpers import bundled_tokenizer, like_fake, real_and_fake, tiny_config, trace_key  # noqa: E402

from memfit import MemfitCallback, TrainSetup, estimate, preflight  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.peaks import peaks  # noqa: E402
from memfit.sim.engine import simulate  # noqa: E402
from memfit.sim.trl_steps import sft_batch  # noqa: E402
from memfit.testing import memory_budget  # noqa: E402
from memfit.train_setup import TRAINING_ARGS_NAMES, TRL_CONFIG_NAMES  # noqa: E402

LLAMA = tiny_config("llama")


def _setup(**kw):
    base = dict(model=LLAMA, per_device_train_batch_size=2, max_length=16, attn_implementation="sdpa")
    return TrainSetup(**{**base, **kw})


# -- settings ----------------------------------------------------------------------------------------

def test_trl_config_names_match_installed_trl():
    from trl import DPOConfig, SFTConfig

    for key, cls in (("sft", SFTConfig), ("dpo", DPOConfig)):
        assert TRL_CONFIG_NAMES[key] == {f.name for f in dataclasses.fields(cls)} - TRAINING_ARGS_NAMES, key


def test_sft_config_object_is_read(tmp_path):
    from trl import SFTConfig

    args = SFTConfig(output_dir=str(tmp_path), packing=True, packing_strategy="wrapped", max_length=48,
                     per_device_train_batch_size=3, use_cpu=True, completion_only_loss=True)
    s = TrainSetup.from_training_args(args, model=LLAMA)
    assert (s.trainer, s.packing, s.packing_strategy, s.max_length, s.per_device_train_batch_size) == \
        ("sft", True, "wrapped", 48, 3)
    assert s.completion_only_loss is True and not s.is_padding_free
    # SFTConfig's own defaults (TRL 1.16): bf16 and gradient checkpointing on
    assert s.precision == "bf16" and s.gradient_checkpointing
    bfd = TrainSetup.from_training_args(SFTConfig(output_dir=str(tmp_path), packing=True, use_cpu=True), model=LLAMA)
    assert bfd.is_padding_free  # bfd packing implies padding-free (SFTTrainer.__init__)


def test_sft_names_need_the_sft_trainer(tmp_path):
    s = TrainSetup.from_kwargs(LLAMA, training_args={"trainer": "sft", "dataset_text_field": "text", "packing": True,
                                                     "max_seq_length": 40})
    assert s.trainer == "sft" and s.max_length == 40 and any("max_seq_length" in n for n in s.notes)
    with pytest.raises(MemfitError, match=r"SFTConfig setting.*trainer='sft'"):
        TrainSetup.from_kwargs(LLAMA, training_args={"dataset_text_field": "text"})
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"trainer": "dpo", "beta": 0.2, "max_prompt_length": 64, "max_length": 32}))
    d = TrainSetup.from_json(path, model=LLAMA)
    assert d.trainer == "dpo" and d.max_length == 32 and any("max_prompt_length" in n for n in d.notes)
    k = TrainSetup.from_kwargs(LLAMA, trainer="sft", dataset_text_field="text", packing=True)
    assert k.packing


@pytest.mark.parametrize("kw, match", [
    (dict(trainer="ppo"), "trainer `ppo`"),
    (dict(trainer="sft", packing_strategy="zigzag"), "packing_strategy `zigzag`"),
    (dict(packing=True), "SFTTrainer setting"),
    (dict(precompute_ref_log_probs=True, trainer="sft"), "DPOTrainer setting"),
    (dict(trainer="sft", task="seq-cls"), "causal language model"),
    (dict(trainer="sft", padding_free="yes"), "true or false"),
])
def test_bad_trl_settings_are_one_line_errors(kw, match):
    with pytest.raises(MemfitError, match=match):
        _setup(**kw)


# -- the simulated steps -----------------------------------------------------------------------------

_key = trace_key  # tests/helpers.py


CASES = [
    dict(trainer="sft", example_lengths=[16, 9, 5]),
    dict(trainer="sft", packing=True, packing_strategy="wrapped"),
    dict(trainer="sft", packing=True),  # bfd: padding-free
    dict(trainer="sft", precision="bf16", lora_r=4, gradient_checkpointing=True, padding_free=True,
         example_lengths=[12, 7, 3]),
    dict(trainer="dpo"),
    dict(trainer="dpo", lora_r=4, precision="bf16"),
    dict(trainer="dpo", precompute_ref_log_probs=True, gradient_accumulation_steps=2),
]


@pytest.fixture(scope="module")
def _warm():
    # first-run effects (lazily created module constants), as in tests/sim/test_exactness.py
    with like_fake():
        for kw in (CASES[0], CASES[4]):
            simulate(_setup(**kw), fake=False, splice=False)


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_trl_step_on_real_tensors_matches_fake(kw, _warm):
    """The TRL step on real (zero) CPU tensors and on FakeTensors: the same trace, event for event."""
    real, fake = real_and_fake(_setup(**kw))
    assert peaks(real.trace, round_to=1).overall.bytes == peaks(fake.trace, round_to=1).overall.bytes


def test_sft_logits_are_never_materialized():
    """TRL's fused LM head: no [B, L, vocab] fp32 logits tensor, which the plain Trainer's causal-LM step has."""
    logits = 3 * 16 * LLAMA.vocab_size * 4  # B=3: no weight of the tiny model has this size
    sft = simulate(_setup(trainer="sft", per_device_train_batch_size=3, example_lengths=[16, 16]))
    plain = simulate(_setup(task="causal-lm", per_device_train_batch_size=3, example_lengths=[16, 16]))
    assert any(ev.size_bytes == logits for ev in plain.trace)
    assert not any(ev.size_bytes == logits for ev in sft.trace)


def test_packed_run_is_one_full_sequence_per_pack():
    """Wrapped packing: B packs of max_length tokens, an all-ones mask; the same estimate as a batch of B
    unpadded sequences of max_length (what the kernel sees)."""
    packed = estimate(_setup(trainer="sft", packing=True, packing_strategy="wrapped", max_length=32))
    full = estimate(_setup(trainer="sft", max_length=32, example_lengths=[32] * 6))
    assert packed.peak_allocated_bytes == full.peak_allocated_bytes
    assert packed.peak_reserved_bytes == full.peak_reserved_bytes
    padded = estimate(_setup(trainer="sft", max_length=32, example_lengths=[32, 20, 12]))
    assert padded.peak_allocated_bytes >= full.peak_allocated_bytes  # a padded batch also builds its mask


def test_padding_free_is_lower_than_padded():
    lengths = [64] + [8] * 31
    padded = estimate(_setup(trainer="sft", per_device_train_batch_size=8, max_length=64, example_lengths=lengths))
    free_setup = _setup(trainer="sft", per_device_train_batch_size=8, max_length=64, example_lengths=lengths,
                        padding_free=True)
    assert free_setup.padding_free_tokens == 64 + 7 * 8  # the 8 longest examples in one row
    free = estimate(free_setup)
    assert free.peak_allocated_bytes < padded.peak_allocated_bytes
    assert any("block-diagonal" in n for n in free.notes)  # sdpa: no varlen kernel


def test_dpo_reference_model():
    """A second frozen copy of the weights; none with peft (adapter disabled) or precomputed log-probs."""
    one = simulate(_setup(trainer="sft"))
    copy_ = simulate(_setup(trainer="dpo"))
    pre = simulate(_setup(trainer="dpo", precompute_ref_log_probs=True))

    def weights(sim):
        return sum(ev.size_bytes for ev in sim.trace if ev.action == "alloc" and ev.category == "weights")

    assert weights(copy_) == 2 * weights(one)
    assert weights(pre) == weights(one)
    lora = simulate(_setup(trainer="dpo", lora_r=4))
    lora_sft = simulate(_setup(trainer="sft", lora_r=4))
    assert weights(lora) == weights(lora_sft)
    ia3 = {"peft_type": "IA3", "task_type": "CAUSAL_LM"}  # any peft method: the adapter-disabled model, no copy
    assert weights(simulate(_setup(trainer="dpo", peft_config=ia3))) == weights(simulate(_setup(trainer="sft",
                                                                                              peft_config=ia3)))
    # chosen and rejected in one forward: the batch is 2B sequences
    inputs = [ev.size_bytes for ev in copy_.trace if ev.action == "alloc" and ev.category == "inputs"]
    assert 2 * 2 * 16 * 8 in inputs  # int64 input_ids [2B, L]


def test_sft_batch_shapes():
    tensors, kwargs = sft_batch(_setup(trainer="sft", packing=True, per_device_train_batch_size=3, max_length=16))
    assert tuple(kwargs["input_ids"].shape) == (1, 48) and "attention_mask" not in kwargs
    assert {"position_ids", "cu_seq_lens_q", "seq_idx"} <= set(kwargs)


# -- real TRL trainers on the CPU --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


def _llama(tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _quiet():
    warnings.simplefilter("ignore")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_real_sft_trainer_preflight_and_callback(tok, tmp_path, strategy):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    _quiet()
    texts = [{"text": "hello world " * (i % 7 + 1)} for i in range(16)]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, max_length=32, packing=True,
                     packing_strategy=strategy, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                     gradient_checkpointing=False, logging_steps=1)
    cb = MemfitCallback(report_path=tmp_path / "report.json")
    trainer = SFTTrainer(model=_llama(tok), args=args, train_dataset=Dataset.from_list(texts), processing_class=tok,
                         callbacks=[cb])
    real = next(iter(trainer.get_train_dataloader()))
    pre = preflight(trainer)
    s = pre.setup
    assert (s.trainer, s.packing, s.packing_strategy, s.is_padding_free) == ("sft", True, strategy, strategy == "bfd")
    # the simulated batch has the real collator's keys, and at least its tokens (the worst micro-batch)
    tensors, kwargs = sft_batch(s)
    assert set(real) - {"max_length_q", "max_length_k", "cu_seq_lens_k"} <= set(tensors) | set(kwargs)
    assert kwargs["input_ids"].numel() >= real["input_ids"].numel()
    if strategy == "wrapped":
        assert tuple(real["input_ids"].shape) == tuple(kwargs["input_ids"].shape) == (4, 32)
        assert bool(real["attention_mask"].all())  # all ones: transformers builds no mask, nor does memfit
    # preflight's prediction is the simulation of the same batch
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    hand = TrainSetup(model=trainer.model.config, trainer="sft", packing=True, packing_strategy=strategy,
                      per_device_train_batch_size=4, max_length=32, example_lengths=lengths, optim=s.optim,
                      completion_only_loss=False)
    with memory_budget("1GiB", count=(trainer.model,)) as budget:
        cb.measure = budget
        trainer.train()
    # after train(): a bare estimate resets accelerate's state, which preflight keeps (preserve_accelerator_state)
    assert estimate(hand).peak_allocated_bytes == pre.estimate.peak_allocated_bytes
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["finished"] and report["trainer"] == "sft" and report["optimizer_steps_measured"] == 2
    # At the optimizer step the weights, their gradients and AdamW's two float32 moments are all alive, measured (CPU)
    # as predicted (CUDA); the CPU's forward and backward kernels differ from CUDA's, so the train phase is not compared
    weights_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert report["measured_peak_allocated_bytes_by_phase"]["optimizer"] >= 4 * weights_bytes
    assert report["predicted_peak_allocated_bytes_by_phase"]["optimizer"] >= 4 * weights_bytes
    assert report["measured_peak_allocated_bytes_by_phase"]["train"] > weights_bytes
    assert report["predicted_peak_allocated_bytes_by_phase"]["train"] > weights_bytes


@pytest.mark.slow
def test_real_dpo_trainer_preflight(tok, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    _quiet()
    pref = [{"prompt": "q " * (i % 3 + 1), "chosen": "good " * (i % 4 + 1), "rejected": "bad " * (i % 5 + 1)}
            for i in range(8)]
    model = _llama(tok)
    args = DPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, max_length=8, report_to=[],
                     use_cpu=True, save_strategy="no", bf16=False, gradient_checkpointing=False)
    cb = MemfitCallback(report_path=tmp_path / "report.json")
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=Dataset.from_list(pref),
                         processing_class=tok, callbacks=[cb])
    real = next(iter(trainer.get_train_dataloader()))
    pre = preflight(trainer)
    s = pre.setup
    assert s.trainer == "dpo" and not s.precompute_ref_log_probs and s.sequence_length == 8  # truncated to max_length
    assert real["input_ids"].shape[0] == 2 * 2  # chosen and rejected of 2 pairs in one forward
    hand = TrainSetup(model=model.config, trainer="dpo", per_device_train_batch_size=2, max_length=8,
                      example_lengths=s.example_lengths, optim=s.optim)
    with memory_budget("1GiB", count=(trainer.model, trainer.ref_model)) as budget:
        cb.measure = budget
        trainer.train()
    assert estimate(hand).peak_allocated_bytes == pre.estimate.peak_allocated_bytes
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["finished"] and report["trainer"] == "dpo"
    print("PEEK", json.dumps({k: report[k] for k in report if "by_phase" in k}))
    assert report["measured_peak_allocated_bytes_by_phase"]["train"] > 0


@pytest.mark.slow
def test_callback_stops_or_warns_before_a_run_that_cannot_fit(tok, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    _quiet()
    texts = [{"text": "hello world " * (i % 7 + 1)} for i in range(8)]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, max_length=32, report_to=[],
                     use_cpu=True, save_strategy="no", bf16=False, gradient_checkpointing=False)
    stop = MemfitCallback(budget_bytes="20MiB", on_oom="stop", report_path=tmp_path / "r.json")
    trainer = SFTTrainer(model=_llama(tok), args=args, train_dataset=Dataset.from_list(texts), processing_class=tok,
                         callbacks=[stop])
    with pytest.raises(MemfitError, match="stopped before the first step"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert json.loads((tmp_path / "r.json").read_text())["preflight"]["fits"] is False
    warn = MemfitCallback(budget_bytes="20MiB", report_path=tmp_path / "w.json")
    trainer = SFTTrainer(model=_llama(tok), args=args, train_dataset=Dataset.from_list(texts), processing_class=tok,
                         callbacks=[warn])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert any("memfit:" in str(w.message) for w in seen) and trainer.state.global_step == 1


def test_callback_rejects_bad_arguments():
    with pytest.raises(MemfitError, match="on_oom `halt`"):
        MemfitCallback(on_oom="halt")
    with pytest.raises(MemfitError, match="memory_budget"):
        MemfitCallback(measure=object())


def test_estimate_cli_takes_trl_flags(tmp_path, capsys):
    from memfit.cli import main

    LLAMA.save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--trainer", "sft", "--packing", "--batch-size", "2", "--max-length", "16",
                 "--json", "--no-cache"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert any("padding-free SFT batch (32 tokens" in n for n in report["notes"])
    assert main(["estimate", str(tmp_path), "--packing", "wrapped"]) == 2  # packing without --trainer sft
    assert "SFTTrainer setting" in capsys.readouterr().err


@pytest.mark.slow
def test_dataset_lengths_are_what_the_trl_trainers_tokenize(tok, tmp_path):
    """memfit's token lengths of a JSONL file equal those of the dataset SFTTrainer / DPOTrainer prepare."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from memfit.fitting.trl_data import dataset_lengths
    from memfit.sim._trl_adapter import dpo_example_lengths

    _quiet()
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}assistant: {% endif %}")
    words = ["alpha", "beta gamma", "delta epsilon zeta", "eta"]
    sets = {
        "text": [{"text": " ".join(words[: i % 4 + 1]) * (i % 3 + 1)} for i in range(6)],
        "prompt-completion": [{"prompt": words[i % 4], "completion": " ".join(words[: i % 3 + 1])} for i in range(6)],
        "messages": [{"messages": [{"role": "user", "content": words[i % 4]},
                                   {"role": "assistant", "content": " ".join(words[: i % 3 + 1])}]} for i in range(6)],
    }
    model = _llama(tok)
    for fmt, rows in sets.items():
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
        t = chat_tok if fmt == "messages" else tok
        args = SFTConfig(output_dir=str(tmp_path), max_length=1024, report_to=[], use_cpu=True, bf16=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=t)
        got = dataset_lengths(path, t, trainer="sft")
        assert got.format == fmt
        assert got.lengths == [len(x) for x in trainer.train_dataset["input_ids"]], fmt
    pref = [{"prompt": words[i % 4], "chosen": words[(i + 1) % 4], "rejected": " ".join(words[: i % 4 + 1])}
            for i in range(6)]
    dargs = DPOConfig(output_dir=str(tmp_path), max_length=None, report_to=[], use_cpu=True, bf16=False)
    dpo = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=dargs, train_dataset=Dataset.from_list(pref),
                     processing_class=tok)
    got = dataset_lengths(pref, tok, trainer="dpo")
    assert got.format == "preference" and got.lengths == dpo_example_lengths(dpo.train_dataset, None)
    # the worst micro-batch these lengths give: the longest example, truncated to max_length
    setup = TrainSetup(model=model.config, trainer="dpo", example_lengths=got.lengths, max_length=4)
    assert setup.sequence_length == min(4, got.longest)


def test_dataset_lengths_bad_input(tmp_path):
    from memfit.fitting.trl_data import dataset_lengths

    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "x"}\n')
    with pytest.raises(MemfitError, match="columns `question`"):
        dataset_lengths(path, None, trainer="sft")
    path.write_text('{"text": "x"}\nnot json\n')
    with pytest.raises(MemfitError, match="line 2"):
        dataset_lengths(path, None)
    with pytest.raises(MemfitError, match="does not exist"):
        dataset_lengths(tmp_path / "nope.jsonl", None)


# -- recovery: memfit.fit(sft_trainer) / fit(dpo_trainer) ----------------------------------------------

def _inject_oom_above(trainer, numel):
    """A real-format CUDA OOM in every training forward whose input_ids hold more than `numel` tokens."""
    from helpers import oom_error

    original = trainer.compute_loss

    def compute_loss(model, inputs, *a, **k):
        if model.training and inputs["input_ids"].numel() > numel:
            raise oom_error()
        return original(model, inputs, *a, **k)

    trainer.compute_loss = compute_loss


def _sft_trainer(tok, out, **kw):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    texts = [{"text": "hello world " * (i % 7 + 1)} for i in range(16)]
    args = SFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, max_length=32, report_to=[],
                     use_cpu=True, save_strategy="no", bf16=False, gradient_checkpointing=False, seed=3,
                     gradient_accumulation_steps=2, **kw)
    return SFTTrainer(model=_llama(tok), args=args, train_dataset=Dataset.from_list(texts), processing_class=tok)


def _close(a, b, tol=1e-5):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters())) < tol


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(packing=True)], ids=["bfd-padding-free"])  # padded/wrapped: row splits (test_fit)
def test_fit_recovers_sft_oom_with_the_same_weights(tok, tmp_path, kw):
    import memfit.fitting.run as mf

    _quiet()
    base = _sft_trainer(tok, tmp_path / "a", **kw)
    base_report = mf.fit(base, plan=False)
    t = _sft_trainer(tok, tmp_path / "b", **kw)
    first = next(iter(t.get_train_dataloader()))
    _inject_oom_above(t, first["input_ids"].numel() // 2 + 1)  # the full micro-batch fails, half of it runs
    report = mf.fit(t, plan=False)
    assert report.oom_recoveries and report.steps_completed == base_report.steps_completed == 2
    assert report.micro_batch_chunks >= 2
    assert _close(base.model, t.model)


@pytest.mark.slow
def test_fit_recovers_dpo_oom_keeping_pairs_together(tok, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    import memfit.fitting.run as mf

    _quiet()
    pref = [{"prompt": "q " * (i % 3 + 1), "chosen": "good " * (i % 4 + 1), "rejected": "bad " * (i % 5 + 1)}
            for i in range(8)]

    def make(out):
        model = _llama(tok)
        args = DPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, max_length=16, report_to=[],
                         use_cpu=True, save_strategy="no", bf16=False, gradient_checkpointing=False, seed=3)
        return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                          train_dataset=Dataset.from_list(pref), processing_class=tok)

    base = make(tmp_path / "a")
    mf.fit(base, plan=False)
    t = make(tmp_path / "b")
    original = t.compute_loss
    seen = []

    def compute_loss(model, inputs, *a, **k):
        if model.training:
            if inputs["input_ids"].shape[0] > 4:
                from helpers import oom_error

                raise oom_error()
            seen.append(inputs["completion_mask"].shape[0])
        return original(model, inputs, *a, **k)

    t.compute_loss = compute_loss
    report = mf.fit(t, plan=False)
    assert report.oom_recoveries and report.steps_completed == 2
    assert seen and all(n == 4 for n in seen)  # 2 pairs per chunk: chosen and rejected of each together
    assert _close(base.model, t.model)
