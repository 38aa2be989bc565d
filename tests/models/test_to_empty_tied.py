"""`to_empty_tied` (memfit.models.build): every parameter and buffer as `Module.to_empty` makes them, without
converting the meta tensors one by one."""

from __future__ import annotations

import pytest
import torch

from memfit.train_setup import TrainSetup


def _layout(module):
    out, first = [], {}
    for kind, items in (("p", module.named_parameters(remove_duplicate=False)),
                        ("b", module.named_buffers(remove_duplicate=False))):
        for name, t in items:
            out.append((kind, name, tuple(t.shape), t.stride(), t.dtype, str(t.device), t.requires_grad,
                        isinstance(t, torch.nn.Parameter), t.untyped_storage().nbytes(), t.storage_offset(),
                        first.setdefault(id(t), name)))  # the first name of a tensor: its tying
    return out


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("model", ["gpt2", "t5-small", "xlnet-base-cased"])
def test_to_empty_tied_equals_module_to_empty(model, fake):
    """Every parameter and buffer as `Module.to_empty` made them (shape, strides, dtype, grad flag, storage size,
    tying), with a non-contiguous buffer among them."""
    from memfit.models.build import build_meta_model, shared_parameter_names, to_empty_tied, _retie
    from memfit.sim import _torch_adapter as adapter

    setup = TrainSetup(model=model, task="causal-lm" if model == "gpt2" else "seq-cls")
    models = [build_meta_model(setup) for _ in range(2)]
    for m in models:
        m.register_buffer("memfit_test_transposed", torch.empty(3, 5, device="meta").t())
    with adapter.new_fake_mode() if fake else torch.no_grad():
        to_empty_tied(models[0], device="cpu")
        aliases = shared_parameter_names(models[1])
        models[1].to_empty(device="cpu")  # the old path
        _retie(models[1], aliases)
    assert _layout(models[0]) == _layout(models[1])
    assert any(not t.is_contiguous() for t in models[0].buffers())
