"""TRL's DistillationTrainer (memfit.sim.distill_steps): DistillationConfig's names against the installed TRL, the
whole step (generation, the student's and the teacher's backbones, the chunked divergence) on real CPU tensors
against FakeTensors, the divergence kernels' CUDA allocations, the evaluation against TRL's real `evaluate()`, and the
closed form: the teacher is exactly one copy of its own weights, with no gradients and no optimizer state."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

trl = pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

import torch  # noqa: E402
from helpers import char_tokenizer, eos_beyond_vocab_llama, live_peaks, real_and_fake  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from memfit import TrainSetup, estimate  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.sim import _trl_adapter as trl_adapter  # noqa: E402
from memfit.sim.tracker import StorageTracker  # noqa: E402
from memfit.train_setup import TRAINING_ARGS_NAMES, TRL_CONFIG_NAMES  # noqa: E402


def _llama(hidden: int, layers: int, vocab: int = 256) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       max_position_embeddings=512)


STUDENT, TEACHER = _llama(64, 2), _llama(96, 3)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    TEACHER.save_pretrained(path)
    return str(path)


def _setup(teacher: str, **kw) -> TrainSetup:
    base = dict(model=STUDENT, task="causal-lm", trainer="distill", teacher_model=teacher,
                per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=16, max_completion_length=24,
                optim="adamw_torch", attn_implementation="sdpa")
    return TrainSetup(**{**base, **kw})


def test_distillation_config_names_match_installed_trl():
    from trl import DistillationConfig

    assert TRL_CONFIG_NAMES["distill"] == {f.name for f in dataclasses.fields(DistillationConfig)} - TRAINING_ARGS_NAMES


def test_distillation_config_object_is_read(tmp_path, teacher_dir):
    from trl import DistillationConfig

    args = DistillationConfig(output_dir=str(tmp_path), use_cpu=True, teacher_model_name_or_path=teacher_dir,
                              max_completion_length=64, beta=0.5)
    s = TrainSetup.from_training_args(args, model=STUDENT)
    assert (s.trainer, s.teacher_model, s.max_completion_length, s.beta) == ("distill", teacher_dir, 64, 0.5)
    assert s.gradient_checkpointing and s.precision == "bf16"  # TRL's base-config defaults
    assert TrainSetup(model=STUDENT, task="causal-lm", trainer="distill", teacher_model=teacher_dir).beta == \
        DistillationConfig(output_dir=str(tmp_path), use_cpu=True).beta == 1.0


@pytest.mark.parametrize("kw, fragment", [
    (dict(teacher_model=None), "needs the teacher"),
    (dict(beta=1.5), "`beta` must be in [0, 1]"),
    (dict(use_vllm=True), "`use_vllm` with trainer `distill` is not modelled"),
    (dict(trainer="sft"), "`teacher_model` is a DistillationTrainer setting"),
])
def test_bad_distillation_input_is_one_line(kw, fragment, teacher_dir):
    with pytest.raises(MemfitError) as err:
        _setup(teacher_dir, **kw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_teacher_of_another_vocabulary_is_refused(tmp_path):
    _llama(64, 2, vocab=512).save_pretrained(tmp_path)
    with pytest.raises(MemfitError, match="shared vocabulary") as err:
        estimate(_setup(str(tmp_path)), gpu="A100-80GB")
    assert "\n" not in str(err.value)


def test_teacher_and_reference_are_built_with_flash_attention_emulated(teacher_dir):
    """transformers refuses to build a flash-attn model where flash-attn is not installed: the teacher and DPO's
    reference are built as the trained model is (with sdpa, then switched to memfit's emulated kernels), so a plan
    that tries flash attention for a distillation or DPO run can simulate it."""
    from memfit.models.build import resolve_config
    from memfit.sim import trl_steps

    setup = _setup(teacher_dir, attn_implementation="flash_attention_2", precision="bf16")
    spec = resolve_config(setup.model)
    teacher = trl_steps.build_reference(setup, spec)
    assert teacher.config.num_hidden_layers == 3 and teacher.config._attn_implementation == "flash_attention_2"
    reference = trl_steps.build_reference(setup.replace(trainer="dpo", teacher_model=None), spec)
    assert reference.config.num_hidden_layers == 2 and reference.config._attn_implementation == "flash_attention_2"


def test_divergence_kernels_allocate_what_cuda_allocates():
    """ChunkedDivergenceFunction forward + backward under divergence_kernels: the buffers the kernels write into
    (two `[N, 32768]` fp32 tiles each way, the `[N]` statistics, the `[N, H]` and `[vocab, H]` fp32 gradients), none
    of the torch fallbacks' tile-sized temporaries."""
    from trl.kernels.chunked_divergence import TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE

    n, h, vocab = 8, 16, 64
    tile = min(n, TOKEN_CHUNK_SIZE) * VOCAB_CHUNK_SIZE * 4

    def sizes(patched: bool) -> list[int]:
        hs = torch.randn(n, h, requires_grad=True)
        ws = torch.randn(vocab, h, requires_grad=True)
        ht, wt = torch.randn(n, h), torch.randn(vocab, h)
        tr = StorageTracker()
        with tr, (trl_adapter.divergence_kernels() if patched else contextlib.nullcontext()):
            div, _ = trl_adapter.chunked_divergence(hs, ws, None, ht, wt, None, 1.0, 1.0, 1.0, None, 1.0, None)
            div.sum().backward()
        return [ev.size_bytes for ev in tr.trace() if ev.action == "alloc"]

    ours = sizes(True)
    assert ours.count(tile) == 4  # s_buf and t_buf in the forward and in the backward, nothing else of that size
    assert n * h * 4 in ours and vocab * h * 4 in ours  # grad_hidden, grad_weight (fp32)
    assert max(ours) == tile
    assert sum(sizes(False)) > sum(ours)  # the CPU fallbacks allocate temporaries the CUDA kernels do not


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(beta=0.5), dict(lora_r=4)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_distillation_step_on_real_tensors_matches_fake(kw, teacher_dir):
    """Generation, the student's and the teacher's backbones, the chunked divergence, backward and optimizer on
    real (zero) CPU tensors and on FakeTensors: the same trace, event for event."""
    real, fake = real_and_fake(_setup(teacher_dir, **kw))
    assert "generation" in {ev.phase for ev in fake.trace}


@pytest.mark.slow
def test_teacher_is_one_copy_of_its_weights(teacher_dir):
    """The teacher adds exactly its own weights (each tensor as the allocator rounds it), no gradients and no optimizer state: against
    the same run with the student as its own teacher."""
    student_dir = teacher_dir + "-student"
    STUDENT.save_pretrained(student_dir)
    a = estimate(_setup(teacher_dir), gpu="A100-80GB")
    b = estimate(_setup(student_dir), gpu="A100-80GB")
    from memfit.peaks import rounded  # the caching allocator's block size of each tensor

    def copy_bytes(config):
        return sum(rounded(p.numel() * 4) for p in LlamaForCausalLM(config).parameters())

    wa, wb = a.phase_breakdowns["optimizer"], b.phase_breakdowns["optimizer"]
    assert wa["weights"] - wb["weights"] == copy_bytes(TEACHER) - copy_bytes(STUDENT)
    assert wa["optimizer_state"] == wb["optimizer_state"] and wa["gradients"] == wb["gradients"]


@pytest.mark.slow
def test_eval_phase_matches_real_distillation_trainer_evaluate(tmp_path):
    """DistillationTrainer.prediction_step (TRL 1.16) generates one completion per eval prompt, then the student's and
    the teacher's backbones and the chunked divergence under no_grad: memfit's `eval` phase (after two simulated
    optimizer steps) against TRL's real `evaluate()` of one eval batch measured by memfit's tracker on the CPU, above
    what is alive when each starts: the peak before the divergence (generation, the padded batch) equal, the whole
    phase's within 0.1% (the entropy metric's gather is not simulated)."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from memfit.sim import engine

    student, teacher = eos_beyond_vocab_llama(), eos_beyond_vocab_llama(hidden=96, layers=3)
    for config in (student, teacher):
        config._attn_implementation = "sdpa"
    LlamaForCausalLM(teacher).save_pretrained(tmp_path / "teacher")
    prompts = ["abcdefghijklmnop", "qrstuvw"] * 4  # 8 prompts, left-padded, the longest 16 tokens
    torch.manual_seed(0)
    args = DistillationConfig(str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                              per_device_eval_batch_size=8, max_completion_length=24, use_cpu=True, report_to="none",
                              logging_strategy="no", save_strategy="no", eval_strategy="steps", bf16=False,
                              gradient_checkpointing=False, disable_tqdm=True,
                              teacher_model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"})
    t = DistillationTrainer(model=LlamaForCausalLM(student), teacher_model=str(tmp_path / "teacher"), args=args,
                            train_dataset=Dataset.from_dict({"prompt": prompts}),
                            eval_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=char_tokenizer())
    tr = StorageTracker()
    with trl_adapter.divergence_kernels(), tr:
        for m in (t.model, t.teacher_model):
            for w in list(m.parameters()) + list(m.buffers()):
                tr.register(w, "weights")
        first = len(tr.events)
        metrics = t.evaluate()
    assert metrics["eval_completions/min_length"] == 24  # no completion stopped early: the worst case memfit predicts
    real_peak, real_pre = live_peaks(tr.trace()[first:])
    setup = TrainSetup(model=student, task="causal-lm", trainer="distill", teacher_model=str(tmp_path / "teacher"),
                       per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=24,
                       example_lengths=[len(p) for p in prompts], optim="adamw_torch", attn_implementation="sdpa",
                       precision="fp32", eval_strategy="steps", per_device_eval_batch_size=8, eval_samples=len(prompts),
                       gradient_checkpointing=False)
    peak, pre = live_peaks(engine.simulate(setup, splice=False).trace, "eval")
    assert pre == real_pre
    assert abs(peak - real_peak) <= 0.001 * real_peak, (peak, real_peak)

