import pathlib
import re

import torch

from memfit.sim import autocast as ac


def _header_lists():
    path = pathlib.Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not path.exists():
        return None
    text = path.read_text()
    out = {}
    for macro in ("AT_FORALL_LOWER_PRECISION_FP", "AT_FORALL_FP32", "AT_FORALL_FP32_SET_OPT_DTYPE", "AT_FORALL_PROMOTE"):
        m = re.search(r"#define " + macro + r"\(_\)(.*?)(?:\n\n|\n#)", text, re.S)
        if m is None:
            return None
        names = []
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", m.group(1)):
            names.append(name + (("." + overload) if overload else ""))
        out[macro] = names
    return out


def test_policy_lists_match_the_installed_torch_header():
    lists = _header_lists()
    if lists is None:
        import pytest

        pytest.skip("torch headers not installed")
    assert set(lists["AT_FORALL_LOWER_PRECISION_FP"]) == set(ac.LOWER_PRECISION_OPS)
    assert set(lists["AT_FORALL_FP32"]) == set(ac.FP32_OPS)
    assert set(lists["AT_FORALL_FP32_SET_OPT_DTYPE"]) == set(ac.FP32_SET_OPT_DTYPE_OPS)
    assert set(lists["AT_FORALL_PROMOTE"]) == set(ac.PROMOTE_OPS)


def test_cuda_policy_on_cpu_tensors():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with ac.cuda_autocast(torch.float16) as policy:
        y = lin(x)
        assert y.dtype == torch.float16  # linear: lower precision
        assert torch.softmax(y, -1).dtype == torch.float32  # softmax: fp32 via set_opt_dtype
        assert torch.nn.functional.layer_norm(y, (8,)).dtype == torch.float32  # fp32 list
        assert torch.einsum("ij,kj->ik", x, lin.weight).dtype == torch.float16  # einsum is on CUDA's list
        assert (y + x).dtype == torch.float32  # plain type promotion, not an autocast op
        # the weight cast is cached (fp32 leaf requiring grad), the activation cast is not
        assert id(lin.weight) in policy.cache and id(x) not in policy.cache
    assert lin(x).dtype == torch.float32  # restored on exit


def test_cpu_autocast_is_restored_after_emulation():
    lin = torch.nn.Linear(4, 4)
    with ac.cuda_autocast(torch.bfloat16):
        pass
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
