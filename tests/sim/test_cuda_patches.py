"""memfit.sim.cuda_patches: every global patch is in place inside, and gone after, even on error."""

import torch
import torch.nn.functional as F
import pytest

from memfit.sim.cuda_patches import cuda_patches, cuda_one_hot
from memfit.sim.patching import patched


def test_patches_are_undone_on_error():
    sdpa, one_hot = F.scaled_dot_product_attention, F.one_hot
    with pytest.raises(RuntimeError, match="boom"):
        with cuda_patches(compute_capability=(8, 0), sdpa_log=[]):
            assert F.scaled_dot_product_attention is not sdpa and F.one_hot is not one_hot
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is sdpa and F.one_hot is one_hot


def test_cuda_one_hot_matches_plain_values():
    x = torch.tensor([[0, 2], [1, 1]])
    with cuda_one_hot():
        got = F.one_hot(x, 3)
    assert torch.equal(got, F.one_hot(x, 3))


def test_sdpa_patch_logs_the_backend():
    log: list[str] = []
    q = torch.randn(1, 2, 8, 16)
    with cuda_patches(compute_capability=(8, 0), sdpa_log=log):
        F.scaled_dot_product_attention(q, q, q)
    assert log and log[0] in ("flash", "efficient", "math", "cudnn")


def test_patched_restores_the_original():
    class Box:
        f = staticmethod(lambda: 1)

    with patched(Box, "f", lambda: 2) as original:
        assert Box.f() == 2 and original() == 1
    assert Box.f() == 1
