"""memfit.fit with TRL's real RLOOTrainer on the CPU (memfit.fitting.rloo_recovery): the tiny Llama of
helpers.trl_llama_config, a character tokenizer built in code (no hub), a length reward; a 4 MiB emulated GPU
(memfit.testing.memory_budget) that the scoring pass and the training micro-batches do not fit, and an
out-of-memory error (real CUDA text) injected in generation. Each run is compared with a run without the error: the
optimizer steps, TRL's derived sizes, the completions per prompt, and the weights, against how far the optimizer
steps move them."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402
from helpers import (LengthReward, eos2_char_tokenizer, max_weight_diff, oom_error, rl_sizes,  # noqa: E402
                     trl_llama_config, weights_of)
from transformers import LlamaForCausalLM  # noqa: E402

import memfit.fitting.run as mf  # noqa: E402
from memfit.fitting import recovery, rloo_recovery  # noqa: E402

PROMPTS = ["abcd", "efghij", "klm", "nopqrs", "tuvw", "xyz", "abcdefg", "hi"]
TOK = eos2_char_tokenizer()


def _rloo(tmp_path, **kw):
    """RLOOTrainer for 2 optimizer steps: 8 completions per generation batch (2 prompts x 4), 2
    micro-steps of 4 per step; beta 0 (no reference copy), so that the runs stay small."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(trl_llama_config(len(TOK)))
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                max_completion_length=8, use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no",
                max_steps=2, seed=0, disable_tqdm=True, bf16=False, learning_rate=1e-2, beta=0.0)
    args = RLOOConfig(str(tmp_path / "out"), **{**base, **kw})
    reward = LengthReward()
    trainer = RLOOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=TOK)
    return trainer, reward


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The run without an error: (trainer, reward, report, how far its 2 steps moved the weights)."""
    t, reward = _rloo(tmp_path_factory.mktemp("plain"))
    before = weights_of(t)
    report = mf.fit(t, plan=False)
    return t, reward, report, max_weight_diff(before, weights_of(t))


def test_chunk_weights_sum_the_chunks_to_rloos_own_loss(tmp_path):
    """RLOOTrainer's `_compute_loss` on a real prepared micro-batch (generated, scored, its leave-one-out advantages
    taken over the whole generation batch), whole and as 3 uneven chunks of completions weighted 1/4, 2/4, 1/4."""
    t, _ = _rloo(tmp_path, max_steps=-1, num_train_epochs=1)
    # an epoch: 8 prompts x 4 completions, 8 per optimizer step (RLOOTrainer's RepeatSampler, as GRPOTrainer's)
    assert mf.steps_expected(t) == len(PROMPTS) * 4 // 8
    t.model.train()
    prepared = t._prepare_inputs(next(iter(t.get_train_dataloader())))
    assert prepared["completion_ids"].shape[0] == 4 and prepared["advantages"].abs().sum() > 0
    parts = recovery._split(prepared, 3, "rloo")
    weights = rloo_recovery.RlooTrainingStep._weights(None, parts, None, t.model)
    assert [p["completion_ids"].shape[0] for p in parts] == [1, 2, 1] and weights == [0.25, 0.5, 0.25]
    with torch.no_grad():
        whole = t._compute_loss(t.model, prepared)
        chunked = sum(w * t._compute_loss(t.model, p) for w, p in zip(weights, parts))
        unweighted = sum(t._compute_loss(t.model, p) for p in parts)
    assert torch.allclose(chunked, whole, atol=1e-6) and not torch.allclose(unweighted, whole, atol=1e-3)


@pytest.mark.slow
def test_small_gpu_scores_and_trains_in_chunks_and_learns_the_same(tmp_path, plain):
    """Under 4 MiB the old log-probs' pass and the micro-batches of 4 completions run out of memory: memfit halves
    TRL's scoring chunks and splits the micro-batches into chunks of completions weighted by their share, the
    windows recomputed; nothing is generated again, and the weights are the plain run's to float rounding."""
    base, base_reward, base_report, moved = plain
    t, reward = _rloo(tmp_path)
    report = mf.fit(t, plan=False, budget_bytes="4MiB")
    assert report.status == "completed" and {r["phase"] for r in report.oom_recoveries} == {"scoring", "train"}
    assert report.micro_batch_chunks >= 2 and report.rl["scoring_batch_size"] < 4
    assert report.steps_completed == report.steps_expected == base_report.steps_completed == 2 and t._step == 4
    assert rl_sizes(t) == rl_sizes(base) == (4, 2, 2, 8) and report.effective_batch_size == 8
    assert report.rl["generate_calls"] == len(reward.calls) == len(base_reward.calls) == 2
    assert reward.calls == base_reward.calls and reward.groups_whole()
    # two optimizer steps at lr 1e-2 move a weight by ~1.5e-2; the recovered run differs by ~3e-6 (float rounding
    # of smaller matmuls)
    assert moved > 1e-3 and max_weight_diff(weights_of(t), weights_of(base)) < 1e-4


def _generate_in_halves(trainer):
    """The reference for a split generation: the test's own wrapper generating each batch in two calls."""
    original = trainer._generate_single_turn

    def generate(prompt_ids, images, fields):
        half = len(prompt_ids) // 2
        return original(prompt_ids[:half], images, fields) + original(prompt_ids[half:], images, fields)

    trainer._generate_single_turn = generate


@pytest.mark.slow
def test_generation_oom_generates_in_smaller_calls_with_whole_groups_scored(tmp_path, plain):
    """One optimizer step; an OOM after the first generate call of 8 sampled: the batch is generated in 2 calls of
    4, the rewards and leave-one-out baselines still see each prompt's 4 completions, and with the failed call's
    RNG state restored the run is the one that generated in two calls from the start (another sampling than the
    plain run's one call, so that run is the reference)."""
    plain_reward = plain[1]
    ref, ref_reward = _rloo(tmp_path / "halves", max_steps=1)
    _generate_in_halves(ref)
    before = weights_of(ref)
    mf.fit(ref, plan=False)
    moved = max_weight_diff(before, weights_of(ref))

    t, reward = _rloo(tmp_path / "oom", max_steps=1)
    original = t._generate_single_turn
    seen = []

    def generate(prompt_ids, *a, **k):
        out = original(prompt_ids, *a, **k)
        seen.append(len(prompt_ids))
        if len(prompt_ids) > 4:
            raise oom_error()
        return out

    t._generate_single_turn = generate
    report = mf.fit(t, plan=False)
    assert [r["phase"] for r in report.oom_recoveries] == ["generation"]
    assert "in 2 calls of <= 4" in report.oom_recoveries[0]["change"]
    assert seen == [8, 4, 4]  # the failed call, then 2 calls for the generation batch
    assert report.rl["generation_calls_per_batch"] == 2 and report.rl["generate_calls"] == 3
    assert report.steps_completed == report.steps_expected == 1
    assert rl_sizes(t) == (4, 2, 2, 8) and report.effective_batch_size == 8
    assert reward.groups_whole() and sorted(reward.calls[0]) == sorted(plain_reward.calls[0])  # the same prompts
    assert reward.calls == ref_reward.calls and moved > 1e-3
    assert max_weight_diff(weights_of(t), weights_of(ref)) == 0.0
    assert "_generate_single_turn" in vars(t) and t._generate_single_turn is generate  # memfit's guard removed


def test_moe_aux_loss_is_not_split():
    assert "auxiliary loss" in rloo_recovery.rloo_chunk_refusal({"aux_loss": True})
    assert rloo_recovery.rloo_chunk_refusal({"aux_loss": False}) is None
