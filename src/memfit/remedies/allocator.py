"""Caching-allocator settings, decided by replaying the trace, not by folklore.

`expandable_segments:True` lets segments grow instead of leaving holes; the seed's
`max_split_size_mb:128` stops large cached blocks from being split. Either can lower
reserved memory when reserved >> allocated; neither helps a true shortfall.
"""

from memfit.remedies.base import Applicability, Remedy

CANDIDATES = ("expandable_segments:True", "max_split_size_mb:128")


def _check(setup, gpu):
    return Applicability(True, "reserved minus allocated (fragmentation) is decided by replay")


def _apply(changes, setup, **_):
    return {}, {"PYTORCH_CUDA_ALLOC_CONF": changes["alloc_conf"]}, []


REMEDY = Remedy(
    name="allocator", title="allocator settings",
    saves="reserved-but-unallocated memory (fragmentation)", costs="none measurable",
    check=_check, variants=lambda setup, gpu: [{"alloc_conf": c} for c in CANDIDATES], apply=_apply,
    fields=("alloc_conf",), advice=("allocator",),
)
