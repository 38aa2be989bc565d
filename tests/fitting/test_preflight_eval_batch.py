"""preflight flags a large eval batch only where the run evaluates (it has an eval set)."""

import pytest

import memfit.fitting.run as mf
from helpers import tiny_trainer


@pytest.mark.slow  # two preflights of a real Trainer (about 8 s)
def test_eval_batch_flag_needs_an_eval_set(tmp_path):
    t = tiny_trainer(tmp_path, per_device_eval_batch_size=32)
    assert "eval_batch_larger" in {f.kind for f in mf.preflight(t).flags}
    t.eval_dataset = None
    assert "eval_batch_larger" not in {f.kind for f in mf.preflight(t).flags}
