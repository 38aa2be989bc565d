"""memfit.ui.form (the form as a command line the CLI validates) and memfit.ui.jobs (the verb in a child
process that cancel kills), without a browser or gradio."""

import json
import time

import pytest

from memfit.errors import MemfitError
from memfit.ui.form import Form, diagnose_argv, estimate_argv, model_argument, plan_argv
from memfit.ui.jobs import Job


def test_the_form_is_the_clis_flags(tmp_path):
    form = Form(model="gpt2", gpu="T4", batch_size=4.0, grad_accum="8", max_length=512.0, precision="bf16",
                adapter="QLoRA", lora_r=8, trainer="sft")
    assert estimate_argv(form, str(tmp_path)) == [
        "estimate", "gpt2", "--batch-size", "4", "--grad-accum", "8", "--max-length", "512", "--precision", "bf16",
        "--lora-r", "8", "--load-in-4bit", "--trainer", "sft", "--gpu", "T4", "--no-cache"]
    multi = Form(model="gpt2", gpu="A100-80GB", strategy="fsdp", gpu_count=4.0)
    assert plan_argv(multi, str(tmp_path)) == ["plan", "gpt2", "--gpus", "4xA100-80GB", "--strategy", "fsdp"]
    assert estimate_argv(Form(), str(tmp_path)) == ["estimate", "--no-cache"]  # the built-in example
    assert diagnose_argv("CUDA out of memory.") == ["diagnose", "--text", "CUDA out of memory."]


@pytest.mark.parametrize("form, fragment", [
    (Form(model="/etc"), "not a hub id"),
    (Form(model="../secrets/config.json"), "not a hub id"),
    (Form(gpu="T4", gpu_count="4"), "need a strategy"),
    (Form(strategy="zero3", gpu_count="2"), "needs the GPU"),
    (Form(adapter="IA3"), "is not one of"),
])
def test_what_the_form_refuses(form, fragment, tmp_path):
    with pytest.raises(MemfitError, match=fragment):
        estimate_argv(form, str(tmp_path))


def test_a_model_that_names_a_server_path_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel").mkdir()
    with pytest.raises(MemfitError, match="upload its config.json"):
        model_argument(Form(model="mymodel"), str(tmp_path))
    assert model_argument(Form(model="xlnet-large-cased"), str(tmp_path)) == "xlnet-large-cased"  # bundled


def test_an_uploaded_config_is_checked_and_copied_alone(tiny_bert_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    folder = model_argument(Form(config_path=f"{tiny_bert_dir}/config.json"), str(work))
    assert json.loads((work / "uploaded-model" / "config.json").read_text()) == json.loads(
        open(f"{tiny_bert_dir}/config.json").read())
    assert folder == str(work / "uploaded-model")
    custom = tmp_path / "custom.json"
    custom.write_text(json.dumps({"model_type": "x", "auto_map": {"AutoModel": "modeling_x.X"}}))
    with pytest.raises(MemfitError, match="custom model code"):
        model_argument(Form(config_path=str(custom)), str(tmp_path / "w2"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(MemfitError, match="not JSON"):
        model_argument(Form(config_path=str(bad)), str(tmp_path / "w3"))


def _wait(job, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = job.poll(0.2)
        if out is not None:
            return out
    raise AssertionError("the job did not finish")


def test_a_bad_value_comes_back_as_the_clis_line(tiny_bert_dir):
    out = _wait(Job(["estimate", tiny_bert_dir, "--batch-size", "four"]))
    assert out.code == 2 and out.html is None
    assert "--batch-size" in out.error and "four" in out.error and "Traceback" not in out.error


def test_a_diagnosis_comes_back_as_its_page():
    out = _wait(Job(["diagnose", "--text", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                     "GPU 0 has a total capacity of 15.77 GiB of which 1.00 GiB is free. Of the allocated memory "
                     "13.50 GiB is allocated by PyTorch, and 0.50 GiB is reserved by PyTorch but unallocated."]))
    assert out.code == 0 and out.error is None
    assert 'data-view="diagnose"' in out.html and 'data-segment="request"' in out.html


def test_cancel_kills_the_run(tiny_bert_dir):
    job = Job(["plan", tiny_bert_dir, "--gpu", "T4", "--batch-size", "64", "--max-length", "512", "--no-cache"])
    time.sleep(0.5)
    job.cancel()
    assert job.poll() is not None and job.outcome.code == 130
    assert not job._proc.is_alive()
