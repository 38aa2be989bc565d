"""The CUDA caching allocator: its model (caching), its settings (conf), and real traces (snapshot)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.allocator.caching import AllocatorReport, OomEvent, replay, round_size, get_allocation_size
    from memfit.allocator.conf import AllocConf, parse_alloc_conf, alloc_conf_from_env
    from memfit.allocator.snapshot import SnapshotReplay, events_from_torch_snapshot, replay_torch_snapshot

__all__ = ["AllocatorReport", "OomEvent", "replay", "round_size", "get_allocation_size", "AllocConf", "parse_alloc_conf", "alloc_conf_from_env", "SnapshotReplay", "events_from_torch_snapshot", "replay_torch_snapshot"]

_LAZY = {"AllocatorReport": "caching", "OomEvent": "caching", "replay": "caching", "round_size": "caching", "get_allocation_size": "caching", "AllocConf": "conf", "parse_alloc_conf": "conf", "alloc_conf_from_env": "conf", "SnapshotReplay": "snapshot", "events_from_torch_snapshot": "snapshot", "replay_torch_snapshot": "snapshot"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.allocator.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
