"""diagnose -> plan hand-off: the GPU and the memory outside PyTorch come from the message."""

import json

import pytest

from memfit.cli import main
from memfit.diagnosis import diagnose, gpu_from_message
from memfit.errors import MemfitError
from memfit.oom_text import parse_oom
from memfit.train_setup import TrainSetup

SEED = ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 15.78 GiB total capacity; 14.31 GiB "
        "already allocated; 2.75 MiB free; 14.78 GiB reserved in total by PyTorch)")


@pytest.fixture(scope="module")
def bert_dir(tiny_bert_dir):
    return tiny_bert_dir


def test_gpu_from_the_seed_message_is_a_v100():
    assert gpu_from_message(parse_oom(SEED)).name == "V100-16GB"


def test_setup_hands_over_to_the_planner(bert_dir):
    d = diagnose(SEED, setup=TrainSetup(model=bert_dir, per_device_train_batch_size=4, max_length=64))
    assert d.plan is not None
    assert d.plan.gpu["name"] == "V100-16GB"
    # memory outside PyTorch is the message's ~1 GiB, not memfit's table
    assert abs(d.plan.baseline.device_used_bytes - d.plan.baseline.peak_reserved_bytes
               - parse_oom(SEED).non_pytorch_bytes) == 0


def test_setup_must_be_a_trainsetup():
    with pytest.raises(MemfitError, match="TrainSetup"):
        diagnose(SEED, setup={"model": "bert-base-uncased"})


def test_cli_with_saved_plan(tmp_path, bert_dir, capsys):
    plan_file = tmp_path / "plan.json"
    assert main(["plan", bert_dir, "--batch-size", "8", "--max-length", "64", "--gpu", "T4", "--json"]) == 0
    plan_file.write_text(capsys.readouterr().out)
    log = tmp_path / "train.log"
    log.write_text(SEED)
    assert main(["diagnose", str(log), "--plan", str(plan_file), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["saved_plan"]["schema"] == "memfit.plan/1"


def test_cli_bad_plan_file(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    assert main(["diagnose", "--text", SEED, "--plan", str(bad)]) == 2
    assert "not a memfit plan" in capsys.readouterr().err


def test_cli_args_without_model(tmp_path, capsys):
    args = tmp_path / "a.json"
    args.write_text("{}")
    assert main(["diagnose", "--text", SEED, "--args", str(args)]) == 2
    assert "--model" in capsys.readouterr().err
