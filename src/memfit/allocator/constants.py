"""The CUDA caching allocator's constants, each once, with its source.

c10/cuda/CUDACachingAllocator.cpp (pytorch main, 2026), namespace `c10::CachingAllocator` /
`c10::cuda::CUDACachingAllocator` (also in c10/core/AllocatorConfig.h):
"""

from __future__ import annotations

__all__ = ["K_MIN_BLOCK_SIZE", "K_SMALL_SIZE", "K_SMALL_BUFFER", "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC",
           "K_ROUND_LARGE", "ROUNDUP_INTERVALS"]

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 B
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: small allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20971520  # kLargeBuffer: 1..10 MiB allocations are packed in 20 MiB segments
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: from 10 MiB a segment is sized to the request
K_ROUND_LARGE = 2097152  # kRoundLarge: large segments are rounded up to 2 MiB
#: kRoundUpPowerOfTwoIntervals (c10/core/AllocatorConfig.h): 16 intervals, 1 MiB .. 64 GiB
ROUNDUP_INTERVALS = 16
