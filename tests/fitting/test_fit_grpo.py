"""memfit.fit / MemfitCallback with TRL's real GRPOTrainer on the CPU (memfit.fitting.grpo_recovery): a 2-layer
Llama built from a config, a character tokenizer built in code (no hub), a length reward; an out-of-memory error
(real CUDA text) injected in generation, in scoring and in a training micro-step. Each run is compared with a run
without the error: the optimizer steps, the completions per prompt, TRL's derived sizes, and the weights where the
two runs compute the same thing."""

from __future__ import annotations

import json

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402
from helpers import (CHARS, LengthReward, eos2_char_tokenizer, max_weight_diff, oom_error, rl_sizes,  # noqa: E402
                     weights_of)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import memfit.fitting.run as mf  # noqa: E402
from memfit.fitting import grpo_recovery  # noqa: E402

PROMPTS = ["abcd", "efghij", "klm", "nopqrs", "tuvw", "xyz", "abcdefg", "hi"]
TOK = eos2_char_tokenizer()


def _grpo(tmp_path, **kw):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=3 + len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      max_position_embeddings=64)
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = dict(model_init_kwargs={"dtype": torch.float32}, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                max_completion_length=8, use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no",
                num_train_epochs=1, seed=0, disable_tqdm=True, bf16=False, learning_rate=1e-2)
    args = GRPOConfig(str(tmp_path / "out"), **{**base, **kw})
    reward = LengthReward()
    # from a folder: with beta > 0 GRPOTrainer loads its reference copy from the model's path
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    trainer = GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=TOK)
    return trainer, reward


def _moved(trainer, before):
    return max_weight_diff(before, weights_of(trainer)) > 1e-4


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The run without an error: (trainer, reward, report, weights before, weights after)."""
    t, reward = _grpo(tmp_path_factory.mktemp("plain"))
    before = weights_of(t)
    report = mf.fit(t, plan=False)
    return t, reward, report, before, weights_of(t)


# -- preflight -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_preflight_reads_the_grpo_trainer(tmp_path):
    t, _ = _grpo(tmp_path, beta=0.04)
    pre = mf.preflight(t)
    s = pre.setup
    assert s.trainer == "grpo" and s.num_generations == 4 and s.max_completion_length == 8 and s.beta == 0.04
    assert s.steps_per_generation == 2 and s.precision == "fp32"  # bf16=False given: not GRPOConfig's default
    # the prompts as GRPOTrainer tokenizes them (one token per character here), not a default max_length
    assert s.example_lengths == [len(p) for p in PROMPTS] and s.sequence_length == max(map(len, PROMPTS))
    assert pre.longest_example == 7 and pre.example_count == 8
    assert {"generation", "scoring"} <= set(pre.estimate.phases)


@pytest.mark.slow
def test_steps_expected_is_what_grpo_trainer_runs(plain, tmp_path):
    t, reward, report, before, after = plain
    # 8 prompts x 4 completions, 8 completions per generation batch, 2 micro-steps of 4 per batch, 2 per step
    assert report.steps_completed == report.steps_expected == t.state.global_step == 4
    assert report.rl["generate_calls"] == len(reward.calls) == 4 and reward.groups_whole()
    assert report.status == "completed" and not report.oom_recoveries and _moved(t, before)
    t3, _ = _grpo(tmp_path, num_train_epochs=2, steps_per_generation=4)
    assert mf.steps_expected(t3) == 8


# -- recovery --------------------------------------------------------------------------------------------------

def _generate_in_halves(trainer):
    """The reference for a split generation: the test's own wrapper generating each batch in two calls."""
    original = trainer._generate_single_turn

    def generate(prompt_ids, images, fields, num_generations, *a, **k):
        half = len(prompt_ids) // 2
        ids1, _ = original(prompt_ids[:half], images, fields, num_generations, *a, **k)
        ids2, _ = original(prompt_ids[half:], images, fields, num_generations, *a, **k)
        return ids1 + ids2, None

    trainer._generate_single_turn = generate


@pytest.mark.slow
def test_generation_oom_generates_in_smaller_calls_with_the_same_completions_per_prompt(tmp_path, plain):
    _, plain_reward, plain_report, _, _ = plain
    ref, ref_reward = _grpo(tmp_path / "halves")
    _generate_in_halves(ref)
    ref_report = mf.fit(ref, plan=False)

    t, reward = _grpo(tmp_path / "oom")
    before = weights_of(t)
    original = t._generate_single_turn
    seen = []

    def generate(prompt_ids, *a, **k):  # the OOM comes after the whole batch was sampled (the RNG has moved on)
        out = original(prompt_ids, *a, **k)
        seen.append(len(prompt_ids))
        if len(prompt_ids) > 4:
            raise oom_error()
        return out

    t._generate_single_turn = generate
    report = mf.fit(t, plan=False)
    assert [r["phase"] for r in report.oom_recoveries] == ["generation"]
    assert "in 2 calls of <= 4" in report.oom_recoveries[0]["change"]
    assert seen == [8] + [4] * 8  # one failed call, then 2 calls for each of the 4 generation batches
    assert report.rl["generation_calls_per_batch"] == 2 and report.rl["generate_calls"] == 9
    assert report.steps_completed == report.steps_expected == plain_report.steps_completed == 4
    assert rl_sizes(t) == (4, 2, 2, 8) and report.effective_batch_size == 8
    assert len(reward.calls) == len(plain_reward.calls) == 4 and reward.groups_whole()
    assert [sorted(c) for c in reward.calls] == [sorted(c) for c in plain_reward.calls]  # the same prompts
    # the RNG state of the failed call is restored: the run is the one that generated in two calls from the start
    assert max_weight_diff(weights_of(t), weights_of(ref)) == 0.0 and _moved(t, before)
    assert [c for c in reward.calls] == [c for c in ref_reward.calls] and ref_report.steps_completed == 4


@pytest.mark.slow
def test_scoring_oom_halves_trl_chunks_and_learns_the_same(tmp_path):
    """beta > 0: the reference model scores each generation batch in TRL's chunks of per_device_train_batch_size;
    an OOM halves them. Each completion is scored on its own, so the run learns what the plain run learns."""
    base, _ = _grpo(tmp_path / "base", beta=0.04)
    mf.fit(base, plan=False)
    t, reward = _grpo(tmp_path / "oom", beta=0.04)
    original = t._get_per_token_logps_and_entropies
    chunks = []

    def score(model, input_ids, attention_mask, logits_to_keep, batch_size=None, **k):
        if not torch.is_grad_enabled():
            chunks.append(batch_size)
            if batch_size > 2:
                raise oom_error()
        return original(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **k)

    t._get_per_token_logps_and_entropies = score
    report = mf.fit(t, plan=False)
    assert [r["phase"] for r in report.oom_recoveries] == ["scoring"]
    assert chunks == [4] + [2] * 4 and report.rl["scoring_batch_size"] == 2
    assert report.steps_completed == report.steps_expected == 4 and rl_sizes(t) == (4, 2, 2, 8)
    assert reward.groups_whole()
    assert max_weight_diff(weights_of(t), weights_of(base)) < 1e-6


def _inject_train_oom(trainer, at_call, min_rows):
    """A real-format CUDA OOM in the loss forward of the `at_call`-th micro-step on, while micro-batches hold
    `min_rows` completions."""
    original = trainer.compute_loss
    calls = {"n": 0}

    def compute_loss(model, inputs, *a, **k):
        calls["n"] += 1
        if calls["n"] >= at_call and inputs["completion_ids"].shape[0] >= min_rows:
            raise oom_error()
        return original(model, inputs, *a, **k)

    trainer.compute_loss = compute_loss


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_training_oom_chunks_the_micro_batch_and_learns_the_same(tmp_path, loss_type):
    """The OOM in the 2nd micro-step of the 2nd optimizer step: that window is recomputed in chunks of 2
    completions weighted for the loss type; nothing is generated again and the weights are the plain run's."""
    base, base_reward = _grpo(tmp_path / "base", loss_type=loss_type)
    mf.fit(base, plan=False)
    t, reward = _grpo(tmp_path / "oom", loss_type=loss_type)
    _inject_train_oom(t, at_call=4, min_rows=4)
    report = mf.fit(t, plan=False)
    assert [r["phase"] for r in report.oom_recoveries] == ["train"] and report.oom_recoveries[0]["step"] == 1
    assert report.micro_batch_chunks == 2
    assert report.steps_completed == report.steps_expected == 4 and t._step == 8
    assert rl_sizes(t) == (4, 2, 2, 8) and report.effective_batch_size == 8
    assert report.rl["generate_calls"] == len(reward.calls) == len(base_reward.calls) == 4
    assert reward.calls == base_reward.calls  # the same completions' prompts, in the same order
    assert max_weight_diff(weights_of(t), weights_of(base)) < 1e-5


def test_chunk_weights_sum_the_chunks_to_the_micro_batch_loss():
    """Against GRPOTrainer's own `_compute_loss` formulas: each loss type's reduction of a [4, 5] per-token loss,
    computed whole and as the weighted sum over 2 chunks."""
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    reductions = {
        "grpo": lambda x, m: ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(),
        "bnpo": lambda x, m: (x * m).sum() / m.sum().clamp(min=1.0),
        "dr_grpo": lambda x, m: (x * m).sum() / (x.size(0) * 5),
        "luspo": lambda x, m: (x * m).sum(-1).mean(),
        "dapo": lambda x, m: (x * m).sum() / 11,  # num_items_in_batch: the generation batch's tokens
    }
    for loss_type, reduce in reductions.items():
        parts = [{"completion_ids": loss[a:b], "completion_mask": mask[a:b]} for a, b in ((0, 1), (1, 4))]
        w = grpo_recovery.chunk_weights(parts, loss_type)
        chunked = sum(wi * reduce(p["completion_ids"], p["completion_mask"]) for wi, p in zip(w, parts))
        assert torch.allclose(chunked, reduce(loss, mask)), loss_type


@pytest.mark.slow
@pytest.mark.parametrize("kw, match", [(dict(entropy_coef=0.01), "entropy bonus"),
                                       (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5")])
def test_training_oom_that_cannot_be_chunked_is_one_line(tmp_path, kw, match):
    t, _ = _grpo(tmp_path, **kw)
    _inject_train_oom(t, at_call=1, min_rows=1)
    with pytest.raises(torch.OutOfMemoryError, match=match) as info:
        mf.fit(t, plan=False, report_path=str(tmp_path / "r.json"))
    assert "\n" not in str(info.value) and "lower per_device_train_batch_size" in str(info.value)
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_generation_oom_even_one_at_a_time_is_one_line(tmp_path):
    t, _ = _grpo(tmp_path)

    def generate(*a, **k):
        raise oom_error()

    t._generate_single_turn = generate
    with pytest.raises(torch.OutOfMemoryError, match="out of memory in GRPO generation") as info:
        mf.fit(t, plan=False, max_recoveries=2)
    assert "\n" not in str(info.value) and "in 4 calls" in str(info.value)


@pytest.mark.slow
def test_guards_are_removed_after_the_run(plain):
    t = plain[0]
    assert "_generate_single_turn" not in vars(t) and "_get_per_token_logps_and_entropies" not in vars(t)
    assert "training_step" not in vars(t) or not isinstance(t.training_step, grpo_recovery.GrpoTrainingStep)


# -- MemfitCallback ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_callback_preflights_a_grpo_trainer_and_counts_generation_in_the_micro_steps(tmp_path):
    from memfit import MemfitCallback

    t, _ = _grpo(tmp_path, max_steps=1)
    cb = MemfitCallback(gpu=None, report_path=tmp_path / "cb.json")
    t.add_callback(cb)
    t.train()
    r = json.loads((tmp_path / "cb.json").read_text())
    assert r["finished"] and r["trainer"] == "grpo" and r["optimizer_steps_measured"] == 1
    phases = r["preflight"]["predicted_phases"]
    assert r["predicted_peak_allocated_bytes_by_phase"]["train"] == max(
        phases[p] for p in ("forward", "backward", "generation", "scoring"))
    assert r["preflight"]["longest_example"] == 7


# -- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_reward_model_of_another_tokenizer_is_one_line_before_training(tmp_path):
    """A reward model with 20 token embeddings scored through the policy's 30-token tokenizer: GRPOTrainer would
    index past its embedding after the first generation; preflight (and so memfit.fit) says so first."""
    from datasets import Dataset
    from transformers import LlamaForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer

    from memfit.errors import MemfitError

    small = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, num_labels=1)
    policy, _ = _grpo(tmp_path / "p")
    args = GRPOConfig(str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                      use_cpu=True, report_to="none", bf16=False, max_steps=1)
    t = GRPOTrainer(model=policy.model, reward_funcs=LlamaForSequenceClassification(small), args=args,
                    reward_processing_classes=TOK, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                    processing_class=TOK)
    for call in (mf.preflight, lambda tr: mf.fit(tr, plan=False)):
        with pytest.raises(MemfitError, match=r"has 20 token embeddings but its processing class") as info:
            call(t)
        assert "\n" not in str(info.value) and "reward_processing_classes" in str(info.value)
    assert t.state.global_step == 0
