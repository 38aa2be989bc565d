"""memfit.fitting.checkpoint_files: damaged weights, optimizer and state files are found from their headers, unpickled never."""

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from memfit.fitting.checkpoint_files import (checkpoint_problems, safetensors_problem, torch_file_problem,
                                             weights_problem)


def _truncate(path, keep=0.5):
    os.truncate(path, int(os.path.getsize(path) * keep))


@pytest.fixture
def good(tmp_path):
    """A checkpoint folder with the files Trainer writes (real safetensors and torch.save archives)."""
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    save_file({"w": torch.randn(64, 64), "b": torch.zeros(64)}, folder / "model.safetensors")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))])
    opt.param_groups[0]["params"][0].grad = torch.ones(8)
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save({"last_epoch": 4}, folder / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    return folder


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any unpickling (pickle.load, torch.load) during a check fails the test."""

    def refuse(*a, **k):
        raise AssertionError("a check unpickled a file")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_an_intact_checkpoint_has_no_problem(good, no_unpickling):
    assert checkpoint_problems(str(good)) == ([], [])


@pytest.mark.parametrize("damage, expected", [
    (lambda f: _truncate(f / "model.safetensors"), "model.safetensors is damaged"),
    (lambda f: _truncate(f / "model.safetensors", 0.0), "model.safetensors is empty"),
    (lambda f: os.remove(f / "model.safetensors"), "no model weights"),
    (lambda f: os.remove(f / "trainer_state.json"), "no trainer_state.json"),
    (lambda f: (f / "trainer_state.json").write_text("{\"global_st"), "trainer_state.json cannot be read"),
    (lambda f: os.remove(f / "optimizer.pt"), "no optimizer.pt (Trainer would resume with a fresh optimizer state)"),
    (lambda f: os.remove(f / "scheduler.pt"), "no scheduler.pt"),
    (lambda f: _truncate(f / "optimizer.pt"), "optimizer.pt is damaged or truncated"),
    (lambda f: _truncate(f / "rng_state.pth", 0.9), "rng_state.pth is damaged or truncated"),
    (lambda f: (f / "optimizer.pt").write_bytes(pickle.dumps({"state": {}})), "optimizer.pt is damaged"),
])
def test_each_damage_is_named(good, no_unpickling, damage, expected):
    damage(good)
    problems, _ = checkpoint_problems(str(good))
    assert any(expected in p for p in problems), problems


def test_an_empty_folder_and_a_missing_rng_file(good, tmp_path):
    empty = tmp_path / "checkpoint-3"
    empty.mkdir()
    assert checkpoint_problems(str(empty)) == (["empty folder"], [])
    os.remove(good / "rng_state.pth")  # Trainer only logs this: a note, not a reason to skip the checkpoint
    problems, notes = checkpoint_problems(str(good))
    assert problems == [] and "no rng_state.pth" in notes[0]


def test_sharded_weights_need_every_shard(tmp_path, no_unpickling):
    save_file({"a": torch.ones(4)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(4)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert weights_problem(str(tmp_path)) is None
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    assert "no model-00002-of-00002.safetensors" in weights_problem(str(tmp_path))


def test_single_file_checks(tmp_path):
    assert safetensors_problem(str(tmp_path / "x.safetensors")) == "no x.safetensors"
    (tmp_path / "o.pt").write_bytes(b"PK\x03\x04 not really")
    assert "damaged or truncated" in torch_file_problem(str(tmp_path / "o.pt"))
