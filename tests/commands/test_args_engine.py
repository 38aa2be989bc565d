"""The multi-GPU engine from every route means the same run: `--deepspeed` / `--fsdp` / `--fsdp-config` flags,
the same TrainingArguments names in an `--args` file, and a `TrainingArguments` object
(memfit.parallel.setup `parallel_from_training_args`); a flag wins over the file, with a note."""

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import DATA_DIR, tiny_config
from memfit.commands._args import parallel_from_args
from memfit.errors import MemfitError
from memfit.parallel import parallel_from_training_args
from memfit.process import build_parser, main
from memfit.train_setup import TrainSetup

REAL = DATA_DIR / "real_configs"
ENGINES = {
    "zero2": {"deepspeed": str(REAL / "transformers_ds_config_zero2.json")},
    "zero3": {"deepspeed": str(REAL / "transformers_ds_config_zero3.json")},
    "fsdp2": {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}},
    "fsdp2_grad_op": {"fsdp": "shard_grad_op auto_wrap"},
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_config("llama").save_pretrained(path)
    return str(path)


def _flags(engine: dict, tmp_path) -> list[str]:
    out = []
    if "deepspeed" in engine:
        out += ["--deepspeed", engine["deepspeed"]]
    if "fsdp" in engine:
        out += ["--fsdp", engine["fsdp"]]
    if "fsdp_config" in engine:
        path = tmp_path / "fsdp_config.json"
        path.write_text(json.dumps(engine["fsdp_config"]))
        out += ["--fsdp-config", str(path)]
    return out


def _parallel(argv, model):
    args = build_parser().parse_args(["estimate", model, *argv])
    setup = TrainSetup(model=model, task="causal-lm", precision="fp16")
    return parallel_from_args(args, setup)[0]


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(ENGINES)), route=st.sampled_from(["flags", "args", "both"]),
       gpus=st.sampled_from([2, 4, 8]))
def test_flags_args_file_and_both_are_one_run(llama_dir, tmp_path_factory, name, route, gpus):
    tmp_path = tmp_path_factory.mktemp("route")
    engine = ENGINES[name]
    flagged = _parallel([*_flags(engine, tmp_path), "--gpus", f"{gpus}xA100-80GB"], llama_dir)
    argv = ["--gpus", f"{gpus}xA100-80GB"]
    if route in ("args", "both"):
        path = tmp_path / "args.json"
        path.write_text(json.dumps({**engine, "per_device_train_batch_size": 8}))
        argv += ["--args", str(path)]
    if route in ("flags", "both"):
        argv += _flags(engine, tmp_path)
    got = _parallel(argv, llama_dir)
    assert got == flagged and got.world_size == gpus
    assert got.strategy == ("fsdp" if "fsdp" in engine else name)


def test_a_training_arguments_object_is_the_same_run(llama_dir, tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path / "out"), deepspeed=ENGINES["zero3"]["deepspeed"], fp16=True,
                             report_to="none")
    ours, _ = parallel_from_training_args(args, world_size=4, precision="fp16", hidden_size=32)
    flagged = _parallel([*_flags(ENGINES["zero3"], tmp_path), "--gpus", "4xA100-80GB"], llama_dir)
    assert ours == flagged and ours.zero.dtype == "fp16" and ours.zero.offload_param


def test_a_flag_wins_over_the_file_with_a_note(llama_dir, tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps(ENGINES["zero2"]))
    par = _parallel(["--args", str(path), "--deepspeed", ENGINES["zero3"]["deepspeed"], "--gpus", "4xT4"], llama_dir)
    assert par.strategy == "zero3" and any("the flag wins" in n for n in par.notes)
    par = _parallel(["--args", str(path), "--fsdp", "full_shard", "--gpus", "4xT4"], llama_dir)
    assert par.strategy == "fsdp"  # --fsdp replaces the file's DeepSpeed


def test_relative_deepspeed_path_next_to_the_args_file(llama_dir, tmp_path):
    shutil.copy(ENGINES["zero2"]["deepspeed"], tmp_path / "ds.json")
    (tmp_path / "args.json").write_text(json.dumps({"deepspeed": "ds.json"}))
    par = _parallel(["--args", str(tmp_path / "args.json"), "--gpus", "2xA100-80GB"], llama_dir)
    assert par.strategy == "zero2" and any("arguments file's folder" in n for n in par.notes)


def test_both_engines_in_the_file_is_one_line(llama_dir, tmp_path, capsys):
    (tmp_path / "args.json").write_text(json.dumps({**ENGINES["zero2"], "fsdp": "full_shard"}))
    with pytest.raises(MemfitError, match="two engines"):
        _parallel(["--args", str(tmp_path / "args.json"), "--gpus", "2xA100-80GB"], llama_dir)


def test_estimate_from_an_args_file_is_the_engine_not_a_note(llama_dir, tmp_path, capsys):
    (tmp_path / "args.json").write_text(json.dumps({**ENGINES["zero2"], "per_device_train_batch_size": 2,
                                                    "fp16": True}))
    assert main(["estimate", llama_dir, "--max-length", "16", "--args", str(tmp_path / "args.json"),
                 "--gpus", "4xA100-80GB", "--json", "--no-cache"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["parallel"]["strategy"], data["parallel"]["world_size"], data["setup"]["precision"]) == \
        ("zero2", 4, "fp16")
    assert not any("not modelled" in n for n in data["notes"])
    assert not any("Attempting to unscale" in n for n in data["notes"])  # DeepSpeed's own loss scaler, no GradScaler
    assert any("DeepSpeed casts the model to its config's fp16" in n for n in data["notes"])


def test_plan_says_it_does_not_use_the_files_engine(llama_dir, tmp_path):
    from memfit.commands.estimate import build_setup

    (tmp_path / "args.json").write_text(json.dumps(ENGINES["zero2"]))
    args = build_parser().parse_args(["plan", llama_dir, "--args", str(tmp_path / "args.json"), "--gpu", "T4"])
    setup, _, _ = build_setup(args)
    assert any("`deepspeed`" in n and "does not use it" in n for n in setup.notes)
    args = build_parser().parse_args(["estimate", llama_dir, "--args", str(tmp_path / "args.json")])
    assert not any("`deepspeed`" in n for n in build_setup(args)[0].notes)  # estimate reads it as the engine
