"""Diagnosis (phase, causes, advice) and the `memfit diagnose` CLI."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import DATA_DIR
from memfit.cli import main
from memfit.diagnosis import detect_phase, diagnose
from memfit.errors import MemfitError
from memfit.diagnosis.strings import LANGS, MESSAGES
from memfit.units import GiB, MiB

DATA = DATA_DIR / "oom"
CORPUS = {c["id"]: c["text"] for c in json.loads((DATA / "corpus.json").read_text(encoding="utf-8"))}
SEED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 15.78 GiB total capacity; "
        "14.31 GiB already allocated; 2.75 MiB free; 14.78 GiB reserved in total by PyTorch) If reserved memory is "
        ">> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory "
        "Management and PYTORCH_CUDA_ALLOC_CONF")
TF = "/opt/venv/lib/python3.11/site-packages/transformers/trainer.py"


def tb(*frames: tuple[str, str, str], error: str = SEED) -> str:
    lines = ["Traceback (most recent call last):"]
    for file, func, code in frames:
        lines += [f'  File "{file}", line 1, in {func}', f"    {code}"]
    return "\n".join(lines + [error, ""])


TRAIN = [("train.py", "<module>", "trainer.train()"), (TF, "_run_epoch", "tr_loss_step = self.training_step(model, inputs)")]


def kinds(d):
    return [c.kind for c in d.causes]


# ------------------------------------------------------------------ the seed message


def test_seed_message_is_a_true_shortfall_not_fragmentation():
    d = diagnose(SEED)
    assert d.is_oom and d.oom_count == 1 and d.phase == "unknown"
    assert d.causes[0].kind == "shortfall" and d.causes[0].primary
    frag = next(c for c in d.causes if c.kind == "fragmentation")
    assert not frag.primary
    assert "0.47 GiB" in frag.text and "max_split_size_mb" in frag.text and "not" in frag.text
    assert abs(frag.bytes / GiB - 0.47) < 0.005
    outside = next(c for c in d.causes if c.kind == "non_pytorch")
    assert abs(outside.bytes / GiB - 0.997) < 0.005  # 15.78 - 2.75 MiB - 14.78
    assert "outside PyTorch's cache" in outside.text and "15.78 GiB" in outside.text
    assert "allocator" not in d.advice_ids


# ------------------------------------------------------------------ phases


@pytest.mark.parametrize("frames, phase", [
    (TRAIN + [(TF, "training_step", "self.accelerator.backward(loss, **kwargs)"),
              ("/x/accelerate/accelerator.py", "backward", "loss.backward(**kwargs)"),
              ("/x/torch/_tensor.py", "backward", "torch.autograd.backward("),
              ("/x/torch/autograd/graph.py", "_engine_run_backward", "return Variable._execution_engine.run_backward(")],
     "backward"),
    (TRAIN + [(TF, "training_step", "loss = self.compute_loss(model, inputs)"), (TF, "compute_loss", "outputs = model(**inputs)"),
              ("/x/torch/nn/modules/module.py", "_call_impl", "return forward_call(*args, **kwargs)"),
              ("/x/transformers/models/llama/modeling_llama.py", "forward", "attn = self.self_attn(hidden_states)")],
     "forward"),
    (TRAIN + [(TF, "_run_epoch", "self.optimizer.step()"), ("/x/accelerate/optimizer.py", "step", "self.optimizer.step(closure)"),
              ("/x/torch/optim/adamw.py", "_multi_tensor_adamw", "exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)")],
     "optimizer"),
    (TRAIN + [(TF, "_maybe_log_save_evaluate", "self._save_checkpoint(model, trial)"),
              (TF, "_save_checkpoint", "self.save_model(output_dir, _internal_call=True)"),
              ("/x/safetensors/torch.py", "save_file", "serialize_file(_flatten(tensors), filename)")],
     "save"),
    (TRAIN + [(TF, "_finalize_training", "self._load_best_model()"), (TF, "_load_best_model", "model.load_state_dict(state_dict)")],
     "load_best"),
    # train(resume_from_checkpoint=...): the checkpoint's weights into the model, its optimizer state (both
    # through load_state_dict, which alone reads as model loading / the optimizer) are the resume
    ([("train.py", "<module>", "trainer.train(resume_from_checkpoint=True)"),
      (TF, "train", "self._load_from_checkpoint(resume_from_checkpoint)"),
      (TF, "_load_from_checkpoint", "load_result = model.load_state_dict(state_dict, False)"),
      ("/x/torch/nn/modules/module.py", "load_state_dict", "load(self, state_dict)")],
     "resume"),
    (TRAIN + [(TF, "_prepare_for_training", "self._load_optimizer_and_scheduler(resume_from_checkpoint)"),
              (TF, "_load_optimizer_and_scheduler", "self.optimizer.load_state_dict("),
              ("/x/torch/optim/optimizer.py", "load_state_dict", "state[param] = _cast(param, v)")],
     "resume"),
    (TRAIN + [(TF, "get_batch_samples", "batch_samples.append(next(epoch_iterator))"),
              ("/x/torch/utils/data/_utils/fetch.py", "fetch", "return self.collate_fn(data)"),
              ("/x/transformers/data/data_collator.py", "__call__", "batch = pad_without_fast_tokenizer_warning(")],
     "data_collation"),
    ([("train.py", "<module>", "model = AutoModelForCausalLM.from_pretrained(name).to('cuda')"),
      ("/x/torch/nn/modules/module.py", "to", "return self._apply(convert)"),
      ("/x/torch/nn/modules/module.py", "_apply", "param_applied = fn(param)")],
     "model_loading"),
    ([("C:\\work\\loop.py", "<module>", "loss.backward()")], "backward"),
    ([], "unknown"),
])
def test_phase_from_traceback(frames, phase):
    assert detect_phase(tb(*frames))[0] == phase
    assert diagnose(tb(*frames)).phase == phase


def test_every_diagnosed_phase_has_a_label_and_advice():
    from memfit.diagnosis.advice import PHASE_ADVICE
    from memfit.trace import DIAGNOSED_PHASES

    assert set(PHASE_ADVICE) == set(DIAGNOSED_PHASES)
    for phase in DIAGNOSED_PHASES:
        assert f"phase.{phase}" in MESSAGES and all(f"advice.{a}" in MESSAGES for a in PHASE_ADVICE[phase])


def test_fit_reads_a_live_exception_with_the_same_frame_table():
    from memfit.diagnosis.phase import phase_of_exception
    from memfit.fitting.run import failure_record
    from memfit.trace import FINAL_EVAL, RESUME, SAVE, TRAINING, UNKNOWN

    def load_state_dict(state):
        raise RuntimeError("size mismatch")

    def _load_from_checkpoint(path):  # the name of transformers' Trainer method that loads a checkpoint at resume
        load_state_dict({})

    def _save_checkpoint():
        raise OSError("disk full")

    def raised(f, *args):
        try:
            f(*args)
        except Exception as exc:  # noqa: BLE001
            return exc

    resume = raised(_load_from_checkpoint, "checkpoint-3")
    assert phase_of_exception(resume) == RESUME == detect_phase(tb(*TRAIN, ("x.py", "_load_from_checkpoint", "")))[0]
    assert failure_record(resume, phase=TRAINING, step=3, checkpoints=[])["phase"] == RESUME
    assert failure_record(raised(_save_checkpoint), phase=TRAINING, step=1, checkpoints=[])["phase"] == SAVE
    assert failure_record(raised(_save_checkpoint), phase=FINAL_EVAL, step=1, checkpoints=[])["phase"] == FINAL_EVAL
    plain = raised(lambda: 1 / 0)
    assert phase_of_exception(plain) == UNKNOWN
    assert failure_record(plain, phase=TRAINING, step=0, checkpoints=["c"])["phase"] == TRAINING


def test_the_phase_module_imports_nothing_from_fitting():
    import subprocess
    import sys

    code = ("import sys, memfit.diagnosis.phase; "
            "bad = [m for m in sys.modules if m.startswith('memfit.fitting') or m == 'torch']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_evaluation_log_file_phase_and_advice():
    d = diagnose((DATA / "trainer_eval.log").read_text(encoding="utf-8"))
    assert d.phase == "eval" and "prediction_step" in d.phase_frame
    assert d.advice_ids[:3] == ("eval_settings.batch_size", "eval_settings.accumulation_steps",
                             "eval_settings.preprocess_logits")
    assert "allocator" in d.advice_ids  # 2.30 of 21.2 GiB unallocated (11%): contributes


def test_long_log_several_errors_crlf_ansi_uses_last_and_its_traceback():
    first = tb(*TRAIN, (TF, "_run_epoch", "self.optimizer.step()"), error=SEED)
    noise = "\n".join(f"\x1b[34mstep {i}\x1b[0m loss 1.{i % 9}" for i in range(2000))
    last = tb(*TRAIN, (TF, "training_step", "self.accelerator.backward(loss)"), error=CORPUS["cads4"])
    d = diagnose((first + noise + "\n" + last).replace("\n", "\r\n"))
    assert d.oom_count == 2 and d.phase == "backward"
    assert d.message.tried_to_allocate_bytes == int(round(22.78 * GiB))


def test_exception_objects_are_accepted():
    def step():
        raise RuntimeError(CORPUS["rlinf255"])

    try:
        step()
    except RuntimeError as err:
        d = diagnose(err)
    assert d.is_oom and d.message.format == "current"
    assert d.causes[0].kind == "other_processes" and "2797307" in d.causes[0].text
    assert d.advice_ids[0] == "stop_other_processes"


# ------------------------------------------------------------------ causes


def test_fragmentation_primary_and_self_pid_in_container():
    d = diagnose(CORPUS["mask2dit4"])  # 40.69 GiB unallocated, request 35.60 GiB
    assert d.causes[0].kind == "fragmentation" and d.causes[0].primary
    assert d.advice_ids[0] == "allocator"
    assert "self_pid" in kinds(d) and "other_processes" not in kinds(d)


def test_fragmentation_contributing_to_shortfall():
    d = diagnose(CORPUS["cads4"])  # 9.35 GiB unallocated + 12.73 free < 22.78 requested
    assert d.causes[0].kind == "shortfall" and d.causes[0].bytes == pytest.approx((22.78 - 12.73) * GiB, rel=1e-3)
    frag = next(c for c in d.causes if c.kind == "fragmentation")
    assert not frag.primary and "Fragmentation" in frag.text
    assert d.advice_ids[-1] == "allocator"


def test_memory_cap():
    d = diagnose(CORPUS["allowed_current"])  # 17.50 GiB reserved + 996 MiB > 17.69 GiB allowed
    assert d.causes[0].kind == "memory_cap" and d.advice_ids[0] == "raise_cap"


def test_windows_shared_memory_and_zero_process_usage():
    d = diagnose(CORPUS["meshgen7"])  # 13.98 GiB allocated on an 8 GiB card
    assert "shared system memory" in " ".join(c.text for c in d.causes)
    assert diagnose(CORPUS["mistral69"]).is_oom


@pytest.mark.parametrize("cid, kind", [("qwen873", "cublas_alloc_failed"), ("iim28", "cuda_error"),
                                       ("deblurgan128", "cudnn_alloc_failed"), ("cudnn_ns", "cudnn_not_supported"),
                                       ("mxfold20", "cpu_ram"), ("nul_device", "truncated")])
def test_messages_without_figures(cid, kind):
    d = diagnose(CORPUS[cid])
    assert d.causes[0].kind == kind and d.advice


def test_no_oom_and_setup_hook():
    d = diagnose("all fine\n")
    assert not d.is_oom and d.oom_count == 0 and d.causes == () and d.advice == ()
    with pytest.raises(MemfitError, match="setup"):
        diagnose(SEED, setup={"model": "gpt2"})
    with pytest.raises(MemfitError, match="`fr`"):
        diagnose(SEED, lang="fr")


def test_every_string_has_every_language():
    for key, row in MESSAGES.items():
        assert set(row) == set(LANGS), key


@pytest.mark.parametrize("cid", sorted(CORPUS))
def test_every_corpus_message_diagnoses_in_both_languages(cid):
    en, zh = diagnose(CORPUS[cid]), diagnose(CORPUS[cid], lang="zh")
    assert en.is_oom and zh.is_oom and en.advice_ids == zh.advice_ids and len(en.causes) == len(zh.causes)


@settings(max_examples=200, deadline=None)
@given(st.text() | st.builds(lambda a, b: a + SEED[: len(b)] + b, st.text(max_size=50), st.text(max_size=400)))
def test_arbitrary_text_never_crashes(text):
    d = diagnose(text)
    assert d.is_oom == (d.oom_count > 0)


# ------------------------------------------------------------------ CLI

JSON_KEYS = {"is_oom", "tried_to_allocate_bytes", "total_bytes", "free_bytes", "allocated_bytes", "reserved_bytes",
             "reserved_unallocated_bytes", "non_pytorch_bytes", "other_processes", "phase", "causes", "advice"}


def test_cli_json(capsys):
    assert main(["diagnose", "--json", "--text", CORPUS["rlinf255"]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(out)
    assert out["is_oom"] and out["tried_to_allocate_bytes"] == 86 * MiB and out["phase"] == "unknown"
    assert out["other_processes"][1] == {"pid": 2797307, "bytes": int(round(14.85 * GiB))}
    assert {"kind", "bytes", "text"} <= set(out["causes"][0])
    assert out["non_pytorch_bytes"] == out["total_bytes"] - out["free_bytes"] - out["reserved_bytes"]


def test_cli_readable_english_and_chinese(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(tb(*TRAIN, (TF, "training_step", "self.accelerator.backward(loss)")), encoding="utf-8")
    assert main(["diagnose", str(log)]) == 0
    out = capsys.readouterr().out
    assert "backward pass" in out and "0.47 GiB" in out and "gradient checkpointing" in out
    assert main(["diagnose", str(log), "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert "反向传播" in out and "梯度检查点" in out


def test_cli_stdin_and_count(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(SEED + "\n" + CORPUS["iim28"] + "\n"))
    assert main(["diagnose", "-"]) == 0
    out = capsys.readouterr().out
    assert "2 out-of-memory errors" in out and "CUDA error: out of memory" in out


def test_cli_no_oom_exits_1(tmp_path, capsys):
    log = tmp_path / "ok.log"
    log.write_text("epoch 1 loss 0.1\n", encoding="utf-8")
    assert main(["diagnose", str(log)]) == 1
    assert "No out-of-memory error found" in capsys.readouterr().out
    assert main(["diagnose", "--json", "--text", "fine"]) == 1
    assert json.loads(capsys.readouterr().out)["is_oom"] is False


@pytest.mark.parametrize("argv, needle", [
    (["diagnose", "/no/such/file.log"], "does not exist"),
    (["diagnose"], "pass a log file"),
    (["diagnose", ".", "--text", "x"], "give one of them"),
])
def test_cli_user_errors_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "`" in err and err.count("\n") == 1


def test_cli_directory_is_an_error(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
