"""A sequence no GPU could hold is a one-line error before the simulation (torch would overflow a tensor's size);
a RoPE model past its `max_position_embeddings` is estimated with a note that says whether the config scales."""

import pytest

from helpers import tiny_config
from memfit import estimate
from memfit.errors import MemfitError
from memfit.process import main


def test_a_length_beyond_any_gpu_is_one_line(tmp_path, capsys):
    tiny_config("llama").save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--max-length", "1000000000000", "--batch-size", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "exceed the largest GPU memfit knows" in err and "--max-length" in err


def test_rope_past_its_positions_is_a_note_naming_the_missing_scaling():
    cfg = tiny_config("llama")  # max_position_embeddings 64, no rope scaling
    report = estimate(cfg, task="causal-lm", max_length=96, per_device_train_batch_size=1)
    assert any("exceed" in n and "has no rope scaling" in n for n in report.notes)
    with pytest.raises(MemfitError, match="largest GPU"):
        estimate(cfg, task="causal-lm", max_length=10**12, per_device_train_batch_size=1)
