"""Emulations of CUDA kernels whose allocations differ from their CPU counterparts (SDPA backends)."""

from __future__ import annotations

