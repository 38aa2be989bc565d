"""memfit.fit with TRL's real DistillationTrainer on the CPU (memfit.fitting.distill_recovery): a 2-layer Llama student
and a 3-layer teacher built from helpers.trl_llama_config (in code: no directory), helpers.char_tokenizer (its EOS is
never sampled: every completion is max_completion_length long); an out-of-memory error (real CUDA text) injected in
generation and in the teacher's forward. The run is compared with a run that generates each window in two calls
from the start."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402
from helpers import CHARS, char_tokenizer, oom_error, trl_llama_config  # noqa: E402

import memfit.fitting.run as mf  # noqa: E402
from memfit.fitting import distill_recovery  # noqa: E402

PROMPTS = ["abcd", "efghij", "klm", "nopqrs", "tuvw", "xyz", "abcdefg", "hi"]
VOCAB = 2 + len(CHARS)
TOK = char_tokenizer()


def _config(layers: int):
    cfg = trl_llama_config(VOCAB)
    cfg.num_hidden_layers = layers
    cfg.eos_token_id = VOCAB  # char_tokenizer's EOS, one past the vocabulary: never sampled
    return cfg


def _distill(tmp_path, **kw):
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    torch.manual_seed(0)
    student, teacher = LlamaForCausalLM(_config(2)), LlamaForCausalLM(_config(3))
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=8, use_cpu=True,
                report_to="none", logging_strategy="no", save_strategy="no", max_steps=2, seed=0, disable_tqdm=True,
                bf16=False, learning_rate=1e-3)
    args = DistillationConfig(str(tmp_path / "out"), **{**base, **kw})
    evaluates = args.eval_strategy != "no"
    return DistillationTrainer(model=student, teacher_model=teacher, args=args, processing_class=TOK,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}) if evaluates else None)


def _weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _generate_in_halves(trainer, seen):
    """The reference for a split generation: each window generated in two calls of half its prompts."""
    original = trainer._generate_single_turn

    def generate(prompt_ids, *a, **k):
        half = len(prompt_ids) // 2
        seen.append(len(prompt_ids))
        return original(prompt_ids[:half], *a, **k) + original(prompt_ids[half:], *a, **k)

    trainer._generate_single_turn = generate


@pytest.mark.slow
def test_oom_in_generation_and_in_the_teachers_forward_are_recovered(tmp_path):
    """A window's 8 prompts run out of memory in one generate call (after sampling it: the RNG has moved on) and the
    teacher's forward of a 4-completion micro-batch runs out in the 2nd micro-step: memfit generates in 2 calls of 4
    (the failed call's RNG state restored: the draws of a run generating in 2 calls from the start) and runs the
    micro-batches as 2 chunks (student and teacher on each); the micro-step counter and the buffer stay TRL's."""
    ref = _distill(tmp_path / "ref")
    ref_calls: list[int] = []
    _generate_in_halves(ref, ref_calls)
    before = _weights(ref)
    ref_report = mf.fit(ref, plan=False)
    moved = _max_diff(before, _weights(ref))

    t = _distill(tmp_path / "oom")
    pre = mf.preflight(t)  # the teacher built in code: its config written to a folder for the simulation
    assert pre.setup.trainer == "distill" and pre.setup.teacher_model and pre.setup.max_completion_length == 8
    assert {"generation"} <= set(pre.estimate.phases)
    # the prediction holds the teacher's weights beside the student's, each storage as the allocator rounds it
    from memfit.testing import counted_bytes

    assert pre.estimate.breakdown["weights"] == counted_bytes(t.model, t.teacher_model) > counted_bytes(t.model)
    original = t._generate_single_turn
    calls: list[int] = []

    def generate(prompt_ids, *a, **k):
        out = original(prompt_ids, *a, **k)
        calls.append(len(prompt_ids))
        if len(prompt_ids) > 4:
            raise oom_error()
        return out

    t._generate_single_turn = generate
    hidden = t._get_last_hidden_state
    teacher_calls = {"n": 0}

    def last_hidden_state(model, input_ids, *a, **k):
        if not torch.is_grad_enabled():  # the teacher's forward (the student's runs with grad)
            teacher_calls["n"] += 1
            if teacher_calls["n"] == 2 and input_ids.size(0) == 4:
                raise oom_error()
        return hidden(model, input_ids, *a, **k)

    t._get_last_hidden_state = last_hidden_state
    report = mf.fit(t, plan=False)
    assert [r["phase"] for r in report.oom_recoveries] == ["generation", "train"]
    assert "in 2 calls of <= 4" in report.oom_recoveries[0]["change"] and report.micro_batch_chunks == 2
    assert "same prompts, one completion each" in report.oom_recoveries[0]["change"]
    assert calls == [8, 4, 4, 4, 4] and ref_calls == [8, 8]  # one failed call, then 2 per window
    assert report.rl["generation_calls_per_batch"] == 2 and report.rl["generate_calls"] == 5
    assert report.steps_completed == report.steps_expected == ref_report.steps_completed == 2 and t._step == 4
    assert report.effective_batch_size == 8
    diff = _max_diff(_weights(t), _weights(ref))
    assert moved > 1e-4 and diff < moved * 1e-2, (diff, moved)  # Adam amplifies float rounding where grads are ~0
    # the guards are removed after the run
    assert "_generate_single_turn" in vars(t) and vars(t)["_generate_single_turn"] is generate
    assert not isinstance(vars(t).get("training_step"), distill_recovery.DistillTrainingStep)


def test_a_micro_batch_with_images_is_not_split():
    """TRL splits a micro-batch's pixel_values per image (split_pixel_values_by_grid), not per completion."""
    ids = torch.zeros(4, 3, dtype=torch.long)
    assert distill_recovery.chunk_refusal({"prompt_ids": ids, "completion_ids": ids}) is None
    why = distill_recovery.chunk_refusal({"prompt_ids": ids, "pixel_values": torch.zeros(8, 3)})
    assert "`pixel_values`" in why and "per image" in why



def test_callback_without_the_teachers_path_is_one_line_before_the_first_step(tmp_path):
    """MemfitCallback is given no trainer, only the arguments: without DistillationConfig.teacher_model_name_or_path
    it cannot see the teacher, and says so in one line before the first step."""
    from memfit import MemfitCallback
    from memfit.errors import MemfitError

    t = _distill(tmp_path, max_steps=1)
    t.add_callback(MemfitCallback(gpu=None, report_path=tmp_path / "cb.json"))
    with pytest.raises(MemfitError, match="set DistillationConfig.teacher_model_name_or_path") as info:
        t.train()
    assert "\n" not in str(info.value) and t.state.global_step == 0


def test_preflight_does_not_flag_eval_logits(tmp_path):
    """DistillationTrainer's `prediction_step` returns the loss alone (`loss, None, None`): no logits are kept."""
    t = _distill(tmp_path, eval_strategy="steps", eval_steps=1)
    pre = mf.preflight(t)
    assert pre.setup.does_eval and "eval_logits_on_gpu" not in {f.kind for f in pre.flags}
