"""The CUDA caching allocator: its model (caching), its settings (conf), real traces read and replayed
(snapshot), simulated runs written as traces PyTorch's viewer reads (export), and reserved memory bounded
by a GPU's capacity: the smallest capacity a run needs and the steady state of a long run (bounded)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.allocator.caching import AllocatorReport, OomEvent, replay, round_size, get_allocation_size, AllocatorModel, Driver, Block
    from memfit.allocator.conf import AllocConf, parse_alloc_conf, alloc_conf_from_env
    from memfit.allocator.snapshot import SnapshotReplay, load_snapshot, replay_snapshot, what_if, start_state, conf_from_snapshot
    from memfit.allocator.export import export_snapshot, write_snapshot
    from memfit.allocator.bounded import BoundedReserved, SteadyState, bounded_reserved, smallest_capacity, steady_state

__all__ = ["AllocatorReport", "OomEvent", "replay", "round_size", "get_allocation_size", "AllocatorModel", "Driver", "Block", "AllocConf", "parse_alloc_conf", "alloc_conf_from_env", "SnapshotReplay", "load_snapshot", "replay_snapshot", "what_if", "start_state", "conf_from_snapshot", "export_snapshot", "write_snapshot", "BoundedReserved", "SteadyState", "bounded_reserved", "smallest_capacity", "steady_state"]

_LAZY = {"AllocatorReport": "caching", "OomEvent": "caching", "replay": "caching", "round_size": "caching", "get_allocation_size": "caching", "AllocatorModel": "caching", "Driver": "caching", "Block": "caching", "AllocConf": "conf", "parse_alloc_conf": "conf", "alloc_conf_from_env": "conf", "SnapshotReplay": "snapshot", "load_snapshot": "snapshot", "replay_snapshot": "snapshot", "what_if": "snapshot", "start_state": "snapshot", "conf_from_snapshot": "snapshot", "export_snapshot": "export", "write_snapshot": "export", "BoundedReserved": "bounded", "SteadyState": "bounded", "bounded_reserved": "bounded", "smallest_capacity": "bounded", "steady_state": "bounded"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.allocator.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
