import pytest
import torch
from transformers import XLNetConfig, XLNetForSequenceClassification

from memfit.models.blocks import enable_checkpointing, repeated_layer_lists
from memfit.estimator import estimate
from memfit.train_setup import TrainSetup

TINY_XLNET = dict(d_model=32, n_layer=3, n_head=2, d_inner=64, vocab_size=50)


def _model(seed=0):
    torch.manual_seed(seed)
    return XLNetForSequenceClassification(XLNetConfig(**TINY_XLNET, num_labels=2, dropout=0.0))


def test_huggingface_refuses_xlnet_checkpointing():
    # the seed-summary fact: transformers 5 has no gradient checkpointing for XLNet
    with pytest.raises(ValueError):
        _model().gradient_checkpointing_enable()


def test_memfit_checkpointing_gives_the_same_gradients():
    plain, wrapped = _model(), _model()
    assert enable_checkpointing(wrapped) == "memfit"
    ids = torch.randint(0, 50, (2, 12))
    labels = torch.tensor([0, 1])
    for m in (plain, wrapped):
        m.train()
        torch.manual_seed(1)  # same dropout masks in both runs (checkpointing replays the RNG state)
        m(input_ids=ids, labels=labels).loss.backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_repeated_layer_lists_finds_the_blocks():
    lists = repeated_layer_lists(_model())
    assert [name for name, _ in lists] == ["transformer.layer"]


def test_memfit_checkpointing_lowers_simulated_activations():
    cfg = XLNetConfig(**{**TINY_XLNET, "n_layer": 4})
    base = dict(model=cfg, per_device_train_batch_size=2, max_length=64)
    off = estimate(TrainSetup(**base))
    on = estimate(TrainSetup(**base, gradient_checkpointing=True))
    assert on.checkpointing == "memfit" and off.checkpointing is None
    assert on.breakdown["activations"] < 0.6 * off.breakdown["activations"]
    assert any("memfit's per-block checkpointing" in n for n in on.notes)
