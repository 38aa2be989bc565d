"""On a real CUDA GPU: the caching allocator's rounding and segment sizes are what memfit models.

Skipped without CUDA (the `gpu` marker, tests/conftest.py). bench/gpu_truth.py compares whole
training runs; these check the two rules every figure rests on, in a fresh process.
"""

import os
import subprocess
import sys

import pytest

CODE = r"""
import json, torch
from memfit.allocator.caching import get_allocation_size, round_size
out = []
for n in (1, 511, 513, 1 << 20, (1 << 20) + 1, 10 << 20, (10 << 20) + 1, 123_456_789):
    torch.cuda.empty_cache()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    out.append([n, torch.cuda.memory_allocated() - a0, round_size(n),
                torch.cuda.memory_reserved() - r0, get_allocation_size(round_size(n))])
    del t
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_rounding_and_segment_sizes_match_cuda():
    import json

    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ""})
    assert r.returncode == 0, r.stderr
    for n, allocated, modelled, reserved, segment in json.loads(r.stdout.strip().splitlines()[-1]):
        assert allocated == modelled, n
        assert reserved == segment, n  # a fresh cache: each request opens its own segment
