"""Every bundled model estimates offline, with the head its family is fine-tuned with."""

import pytest

from memfit import TrainSetup, estimate
from memfit.models.catalog import bundled_model_ids

_LM = ("llama", "mistral", "qwen", "phi", "gpt2")
_S2S = ("t5", "bart")


def _task(model_id: str) -> str:
    low = model_id.lower()
    if any(k in low for k in _LM):
        return "causal-lm"
    if any(k in low for k in _S2S):
        return "seq2seq-lm"
    return "seq-cls"


@pytest.mark.parametrize("model_id", bundled_model_ids())
def test_bundled_model_estimates(model_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = estimate(TrainSetup(model=model_id, task=_task(model_id), per_device_train_batch_size=1, max_length=64,
                            precision="bf16"), gpu="A100-80GB")
    assert r.params > 1_000_000
    assert r.breakdown["weights"] > 0
    assert r.phase_breakdowns["optimizer"]["gradients"] > 0 and r.phase_breakdowns["optimizer"]["optimizer_state"] > 0
    assert r.device_used_bytes >= r.peak_reserved_bytes >= r.peak_allocated_bytes
