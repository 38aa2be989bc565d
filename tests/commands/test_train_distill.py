"""`memfit train --trainer distill`: TRL's real DistillationTrainer on the CPU under memfit.fit, a tiny Llama student
and a 3-layer teacher of the same vocabulary (helpers.trl_llama_config) over a character tokenizer whose EOS the
models never sample (helpers.char_tokenizer: every completion is max_completion_length long), prompt-only data. The
teacher's bad inputs are one-line errors before any model loads; an emulated GPU too small for a micro-step's
divergence tiles is recovered by chunking, and the run learns what the unbudgeted run learns."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from helpers import CHARS, char_tokenizer, record_budget_models, trl_llama_config  # noqa: E402
from memfit.cli import main  # noqa: E402

PROMPTS = ["abcd", "efghij", "klm", "nopqrs", "tuvw", "xyz", "abcdefg", "hi"]
#: the models' vocabulary: char_tokenizer's pad, bos and characters; its EOS is the id just past it
VOCAB = 2 + len(CHARS)
#: the run of both slow tests (the unbudgeted one and the recovered one): 2 optimizer steps of 2 micro-batches of 4
RUN = ["--trainer", "distill", "--max-completion-length", "8", "--batch-size", "4", "--grad-accum", "2",
       "--max-steps", "2", "--learning-rate", "1e-3", "--seed", "0"]


def _config(vocab: int = VOCAB, layers: int = 2):
    cfg = trl_llama_config(vocab)
    cfg.num_hidden_layers = layers
    cfg.eos_token_id = VOCAB  # char_tokenizer's EOS: never sampled, so every completion is 8 tokens
    return cfg


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    root = tmp_path_factory.mktemp("distill")
    tok = char_tokenizer()
    torch.manual_seed(0)
    out = {}
    for name, model in [("student", LlamaForCausalLM(_config())),
                        ("teacher", LlamaForCausalLM(_config(layers=3))),
                        ("teacher_vocab", LlamaForCausalLM(_config(vocab=VOCAB + 4))),
                        ("teacher_cls", LlamaForSequenceClassification(_config()))]:
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    out["prompts"], out["chat"] = root / "prompts.jsonl", root / "chat.jsonl"
    return out


def _run(argv, capsys):
    code = main(["train"] + [str(a) for a in argv])
    return code, capsys.readouterr()


def test_bad_teacher_inputs_are_one_line_errors(dirs, tmp_path, capsys, monkeypatch):
    """Each is one line on stderr, exit 2, no traceback, before any model is loaded."""
    import memfit.commands.train_trl as tt

    def no_build(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(tt, "build_trl_trainer", no_build)
    d = dirs
    base = [d["student"], "--trainer", "distill", "--data", d["prompts"]]
    cases = [
        (base, "`--trainer distill` needs the teacher DistillationTrainer distils from: give `--teacher DIR`"),
        (base + ["--teacher", "Qwen/Qwen2.5-0.5B"],
         "`--teacher Qwen/Qwen2.5-0.5B` is not a local directory; memfit train loads the teacher from a local "
         "directory (download it first: `hf download Qwen/Qwen2.5-0.5B --local-dir DIR`"),
        (base + ["--teacher", tmp_path / "nope"], "nope`: the directory does not exist"),
        (base + ["--teacher", d["prompts"]], "prompts.jsonl` is a file, not a model directory"),
        (base + ["--teacher", d["teacher_vocab"]],
         f"has vocab_size {VOCAB + 4} but the student `{d['student']}` has {VOCAB}; DistillationTrainer compares"),
        (base + ["--teacher", d["teacher_cls"]], "is a `LlamaForSequenceClassification`, not a causal language model"),
        (base + ["--teacher", d["teacher"], "--max-length", "32"],
         "does not go with `--trainer distill`: DistillationConfig has no max_length"),
        ([d["student"], "--trainer", "sft", "--data", d["prompts"], "--teacher", d["teacher"]],
         "is for `--trainer distill`, not `--trainer sft`: it is DistillationConfig's"),
        ([d["student"], "--trainer", "distill", "--data", d["chat"], "--teacher", d["teacher"]],
         "DistillationTrainer's dataset needs a `prompt` column"),
        # 8 prompts, one held out for evaluation: 7 < the generation batch of 4 x 2
        (base + ["--teacher", d["teacher"], "--batch-size", "4", "--grad-accum", "2", "--eval-strategy", "epoch"],
         "= 8 prompts at once, and DistillationTrainer's sampler drops a generation batch that is not full: "),
    ]
    for argv, match in cases:
        code, res = _run(argv + ["--output-dir", tmp_path / "out"], capsys)
        assert code == 2, (argv, res.err[-800:])
        assert match in res.err and res.err.count("\n") == 1 and "Traceback" not in res.err, (argv, res.err[-800:])
    assert not (tmp_path / "out").exists()


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def plain(dirs, tmp_path_factory):
    """The unbudgeted-sized run (400 MiB: nothing runs out), the models the emulated GPU counted, its output."""
    out = tmp_path_factory.mktemp("plain") / "out"
    with pytest.MonkeyPatch.context() as mp:
        counted = record_budget_models(mp)
        code = main(["train", str(dirs["student"]), "--teacher", str(dirs["teacher"]), "--data", str(dirs["prompts"]),
                     *RUN, "--budget", "400MiB", "--output-dir", str(out)])
    assert code == 0
    return out, counted


@pytest.mark.slow
def test_distill_run_counts_the_teacher(dirs, plain):
    """2 optimizer steps of real DistillationTrainer: one generation batch of 8 prompts per step, the teacher on the
    emulated GPU beside the student, checkpoint, report, model saved."""
    from transformers import AutoModelForCausalLM

    out, counted = plain
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == r["steps_expected"] == 2 and not r["oom_recoveries"]
    assert r["rl"]["generation_batch_size"] == 8 and r["rl"]["generate_calls"] == 2
    assert r["preflight"]["fits"] is True and r["phases"]["generation"]["measured_bytes"] > 0
    student, teacher = counted[-1]  # the student and the teacher loaded from --teacher (3 layers)
    # no gradients: DistillationTrainer runs it under no_grad (it leaves requires_grad as loaded)
    assert teacher.config.num_hidden_layers == 3 and all(p.grad is None for p in teacher.parameters())
    assert student.config.num_hidden_layers == 2
    assert (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    moved = _max_diff(_weights(out), AutoModelForCausalLM.from_pretrained(dirs["student"]).state_dict())
    assert moved > 1e-4


@pytest.mark.slow
def test_distill_recovers_from_oom_and_learns_what_the_plain_run_learns(dirs, plain, tmp_path, capsys):
    """Under 6 MiB a micro-batch's divergence needs two [32, 32768] fp32 tiles (TRL's chunked divergence, 4 MiB
    each): the micro-step runs out, memfit splits it into 2 chunks of 2 completions (the teacher runs on each), the
    window is recomputed, and the weights after 2 steps are the plain run's up to float rounding."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    code, res = _run([dirs["student"], "--teacher", dirs["teacher"], "--data", dirs["prompts"], *RUN,
                      "--budget", "6MiB", "--no-plan", "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == r["steps_expected"] == 2
    assert [x["phase"] for x in r["oom_recoveries"]] == ["train"] and r["micro_batch_chunks"] == 2
    assert (r["rl"]["generation_batch_size"], r["rl"]["generate_calls"], r["effective_batch_size"]) == (8, 2, 8)
    start = AutoModelForCausalLM.from_pretrained(dirs["student"]).state_dict()
    moved = _max_diff(_weights(plain[0]), start)
    diff = _max_diff(_weights(out), _weights(plain[0]))
    assert moved > 1e-4 and diff < moved * 1e-2, (diff, moved)  # Adam amplifies float rounding where grads are ~0
    assert "OOM recoveries: 1 (train)" in res.out and "steps 2/2" in res.out
