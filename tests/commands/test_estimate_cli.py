"""`memfit estimate`: JSON schema, numbers through the pure function, errors through the command."""

import json

import pytest

from memfit.cli import main
from memfit.estimator import estimate
from memfit.train_setup import TrainSetup

def test_json_schema(tiny_bert_dir, capsys):
    assert main(["estimate", tiny_bert_dir, "--batch-size", "2", "--max-length", "32", "--eval-strategy", "epoch",
                 "--gpu", "T4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("params", "trainable_params", "peak_allocated_bytes", "phases", "breakdown", "peak_reserved_bytes",
                "non_pytorch_bytes", "device_used_bytes", "gpu", "fits"):
        assert key in data, key
    assert set(data["phases"]) == {"forward", "backward", "optimizer", "eval"}
    for key in ("weights", "gradients", "optimizer_state", "activations", "temporaries", "eval_outputs"):
        assert key in data["breakdown"]
    assert data["gpu"]["name"] == "T4"
    assert data["device_used_bytes"] >= data["peak_reserved_bytes"] >= data["peak_allocated_bytes"]
    assert sum(data["breakdown"].values()) == data["peak_allocated_bytes"]
    assert data["fits"] is True


def test_table_output(tiny_bert_dir, capsys):
    assert main(["estimate", tiny_bert_dir, "--batch-size", "2", "--max-length", "16"]) == 0
    out = capsys.readouterr().out
    assert "Peak allocated per phase" in out and "optimizer state" in out


def test_accumulation_does_not_change_the_peak_shape(tiny_bert_dir):
    # the seed's remedy 2: accumulation steps do not set activation memory
    a = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, gradient_accumulation_steps=16,
                            max_length=32))
    b = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, gradient_accumulation_steps=8,
                            max_length=32))
    assert a.peak_allocated_bytes == b.peak_allocated_bytes


def test_amp_keeps_fp32_master_states(tiny_bert_dir):
    # the seed's remedy 4: AMP does not halve memory: fp32 weights, grads and optimizer state stay
    fp32 = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, max_length=32))
    amp = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, max_length=32, precision="fp16"))
    for key in ("weights", "gradients", "optimizer_state"):
        assert amp.breakdown[key] == fp32.breakdown[key]


def test_longer_sequences_grow_activations(tiny_bert_dir):
    short = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, max_length=32))
    long = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, max_length=128))
    assert long.breakdown["activations"] > 3 * short.breakdown["activations"]


def test_small_gpu_does_not_fit_and_prints_pytorch_message(tiny_bert_dir):
    r = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=64, max_length=512), gpu="300MiB")
    assert r.fits is False
    assert r.oom is not None and "CUDA out of memory. Tried to allocate" in r.oom.message
    from memfit.oom_text import parse_oom

    parsed = parse_oom(r.oom.message)
    assert parsed is not None and parsed.tried_to_allocate_bytes is not None


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["estimate", "no-such-org/no-such-model-xyz"], "not bundled"),
        (["estimate", "bert-base-uncased", "--batch-size", "0"], "--batch-size"),
        (["estimate", "bert-base-uncased", "--optim", "adamw_foo"], "adamw_foo"),
        (["estimate", "bert-base-uncased", "--gpu", "Z80-1KB"], "Z80-1KB"),
        (["estimate", "bert-base-uncased", "--precision", "bf16", "--gpu", "V100-16GB"], "bf16"),
        (["estimate", "gpt2", "--task", "mlm"], "mlm"),
        (["estimate", "bert-base-uncased", "--alloc-conf", "max_split_size_mb:abc"], "max_split_size_mb"),
        (["estimate", "bert-base-uncased", "--args", "/nonexistent/args.json"], "does not exist"),
        (["estimate", "bert-base-uncased", "--example-lengths", "1,x"], "example lengths"),
    ],
)
def test_bad_input_is_one_clear_line(argv, fragment, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_fp16_and_bf16_in_args_file(tmp_path, capsys):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"fp16": True, "bf16": True}))
    assert main(["estimate", "bert-base-uncased", "--args", str(path)]) == 2
    assert "choose one" in capsys.readouterr().err


def test_list_models(capsys):
    assert main(["estimate", "--list-models"]) == 0
    out = capsys.readouterr().out.split()
    assert len(out) >= 25 and any("xlnet-large-cased" in m for m in out)


def test_unsupported_architecture(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert main(["estimate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "Traceback" not in err


def test_a_module_is_never_modified():
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=100))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = estimate(TrainSetup(model=model, per_device_train_batch_size=2, max_length=16))
    assert r.params == sum(p.numel() for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_fp16_weights_with_fp16_amp_is_flagged(tiny_bert_dir):
    r = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, max_length=16, precision="fp16",
                            weights_dtype="fp16"))
    assert any("unscale FP16 gradients" in n for n in r.notes)
    ok = estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=2, max_length=16, precision="fp16"))
    assert not any("unscale FP16 gradients" in n for n in ok.notes)


def test_the_phase_that_runs_out_of_memory_says_its_reserved_figure_stops_there(capsys):
    """The replay stops at the OOM: the failing phase's reserved figure (2.45 GiB) is below its allocated peak
    (5.92 GiB) and read as a contradiction without saying so."""
    from memfit.cli import main

    main(["estimate", "sentence-transformers/all-MiniLM-L6-v2", "--gpu", "3GiB", "--batch-size", "64",
          "--max-length", "512"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ forward")]
    assert len(rows) == 1 and "then OOM" in rows[0], rows
