"""memfit.testing.memory_budget: a CPU run that raises PyTorch's CUDA OOM past a byte budget."""

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from memfit.fitting.run import is_oom_error
from memfit.oom_text import parse_oom
from memfit.testing import memory_budget, round_size


def test_counts_module_and_raises_at_the_limit():
    m = torch.nn.Linear(256, 256)
    with memory_budget(2 << 20, count=(m,)) as b:
        start = b.live_bytes
        assert start == round_size(256 * 256 * 4) + round_size(256 * 4)
        x = torch.randn(64, 256)
        m(x).sum().backward()
        assert b.peak_bytes > start
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.randn(1024, 1024)  # 4 MiB > 2 MiB
    msg = parse_oom(str(info.value))
    assert msg.format == "current"
    assert msg.tried_to_allocate_bytes == 4 << 20
    assert msg.total_bytes == 2 << 20
    assert is_oom_error(info.value)


def test_frees_and_reset_peak():
    with memory_budget("1MiB") as b:
        x = torch.ones(100_000)  # 400 KB
        assert b.live_bytes >= 400_000
        del x
        assert b.live_bytes == 0
        assert b.peak_bytes >= 400_000
        b.reset_peak()
        assert b.peak_bytes == 0
        y = torch.ones(1000)
        assert b.peak_bytes == round_size(4000)
        del y


def test_oom_in_backward_keeps_type_and_mode_does_not_leak():
    net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    with pytest.raises(torch.OutOfMemoryError):
        with memory_budget(int(4.5 * 2**20), count=(net,)):
            net(torch.randn(32, 512)).sum().backward()
    assert _get_current_dispatch_mode() is None


def test_nested_budgets():
    with memory_budget("8MiB") as outer:
        torch.ones(100_000)
        with memory_budget("1MiB") as inner:
            a = torch.ones(100_000)
            with pytest.raises(torch.OutOfMemoryError):
                torch.ones(300_000)
        b = torch.ones(300_000)  # fine for the outer budget
        assert inner.peak_bytes < (1 << 20) and outer.peak_bytes > (1 << 20)
        del a, b
    assert _get_current_dispatch_mode() is None


def test_is_oom_error_table():
    assert is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert is_oom_error(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("CUDA out of memory"))  # only RuntimeError/MemoryError by message
