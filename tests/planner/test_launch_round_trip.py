"""The launch files `memfit plan --gpus ... --write-launch DIR` writes, estimated back through the CLI's readers
(`--accelerate-config`, `--deepspeed`, `--fsdp --fsdp-config`, `--args training_args.json`), give rank 0's figures
the plan verified, exactly, for every strategy."""

import json
from pathlib import Path

import pytest

from conftest import save_bert_config
from memfit.cli import main
from memfit.estimator import estimate
from memfit.planner.launch import (ACCELERATE_FILE, DS_FILE, ENGINE_KEYS, FSDP_FILE, TRAINING_ARGS_FILE, VARIANTS,
                                   launch_for, parallel_setup_for, write_launch)
from memfit.train_setup import TrainSetup

#: the figures of rank 0 that must agree (bytes)
FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return save_bert_config(tmp_path_factory, "bert4rt", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=512, vocab_size=4000)


def _json(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _engine_flags(folder: Path, training_args: dict) -> list[str]:
    """The torchrun route: the engine as TrainingArguments names it, through the matching flags."""
    if "deepspeed" in training_args:
        return ["--deepspeed", str(folder / training_args["deepspeed"])]
    if "fsdp" in training_args:
        return ["--fsdp", training_args["fsdp"], "--fsdp-config", str(folder / training_args["fsdp_config"])]
    return []


def _both_routes(capsys, base: list[str], folder: Path, training_args: dict, gpus: str) -> list[dict]:
    """Rank 0's estimate through the accelerate config and through the torchrun flags, both with the written
    training_args.json (`base` holds no flag the file sets: a flag wins over `--args`)."""
    args = ["--args", str(folder / TRAINING_ARGS_FILE)] if (folder / TRAINING_ARGS_FILE).exists() else []
    acc = _json(capsys, ["estimate", *base, "--gpus", gpus, "--accelerate-config", str(folder / ACCELERATE_FILE),
                         *args, "--json", "--no-cache"])
    run = _json(capsys, ["estimate", *base, "--gpus", gpus, *_engine_flags(folder, training_args), *args, "--json",
                         "--no-cache"])
    return [acc, run]


@pytest.mark.slow
def test_fsdp_accumulation_reads_back_with_sync_each_batch(bert, tmp_path, capsys):
    """FSDP2 with accumulation: the plan simulates `sync_each_batch` (reduce-scatter every micro-step), which no
    accelerate config key carries; training_args.json does, so the files give the simulated figures, and without
    it the estimate is of the Trainer's default `no_sync` (more: unsharded gradients held between micro-steps)."""
    v = next(x for x in VARIANTS if x.key == "fsdp_full_shard")
    setup = TrainSetup(model=bert, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=64,
                       eval_strategy="no", precision="bf16")
    par = parallel_setup_for(v, world_size=2, nodes=1, hidden_size=128, precision="bf16")
    want = estimate(setup, gpu="A100-40GB", parallel=par)  # as memfit.planner.parallel_plan simulates a candidate
    args = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True}
    launch = launch_for(v, world_size=2, nodes=1, hidden_size=128, precision="bf16", training_args=args,
                        accumulation=2)
    write_launch(tmp_path, launch)
    written = json.loads((tmp_path / TRAINING_ARGS_FILE).read_text())
    assert written["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    assert not set(written) & set(ENGINE_KEYS)
    base = [bert, "--max-length", "64", "--eval-strategy", "no"]
    for got in _both_routes(capsys, base, tmp_path, launch.training_args, "2xA100-40GB"):
        assert got["parallel"]["sync_each_batch"] is True
        assert {k: got[k] for k in FIGURES} == {k: getattr(want, k) for k in FIGURES}
    # the accelerate config alone: the Trainer's default no_sync, which holds more
    alone = _json(capsys, ["estimate", *base, "--batch-size", "4", "--grad-accum", "2", "--precision", "bf16",
                           "--gpus", "2xA100-40GB", "--accelerate-config", str(tmp_path / ACCELERATE_FILE), "--json",
                           "--no-cache"])
    assert alone["parallel"]["sync_each_batch"] is False
    assert alone["peak_allocated_bytes"] > want.peak_allocated_bytes


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3"])
def test_the_written_launch_files_give_the_plans_figures(bert, tmp_path, capsys, strategy):
    """`memfit plan --strategy S --write-launch DIR`, then `memfit estimate` of the files: rank 0's peak allocated,
    peak reserved and device figure of the chosen candidate, byte for byte, by both launch routes."""
    base = [bert, "--max-length", "128", "--eval-strategy", "no", "--precision", "bf16"]
    out = _json(capsys, ["plan", *base, "--batch-size", "8", "--grad-accum", "2", "--gpus", "2xA100-40GB",
                         "--strategy", strategy, "--write-launch", str(tmp_path), "--json", "--no-cache"])
    chosen = out["candidates"][out["chosen"]]
    names = {Path(p).name for p in out["written"]}
    assert {ACCELERATE_FILE, TRAINING_ARGS_FILE} <= names
    assert {DS_FILE: strategy.startswith("zero"), FSDP_FILE: strategy == "fsdp"} == {
        DS_FILE: DS_FILE in names, FSDP_FILE: FSDP_FILE in names}
    changes = dict(chosen["setup_changes"])
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "use_liger_kernel",
                 "gradient_checkpointing"):
        changes.pop(name, None)  # in training_args.json
    attn = changes.pop("attn_implementation", None)  # a from_pretrained argument: the launch's code line says it
    if attn is not None:
        assert any(f'attn_implementation="{attn}"' in line for line in out["launch"]["code"])
        base = [*base, "--attn", attn]
    assert changes == {}, changes  # nothing the files and the code lines do not carry
    for got in _both_routes(capsys, base, tmp_path, out["launch"]["training_args"], "2xA100-40GB"):
        assert got["parallel"]["strategy"] == strategy
        assert {k: got[k] for k in FIGURES} == {k: chosen[k] for k in FIGURES}
