"""Replay a real CUDA allocator trace (`torch.cuda.memory._snapshot()`) exactly.

With `torch.cuda.memory._record_memory_history()` on, PyTorch records every call into the
caching allocator; `torch.cuda.memory._dump_snapshot()` writes those calls (`device_traces`)
and the final `segments` as a pickle. Three steps, one module each:

* `read`: the pickle read without running code in it (no globals), its settings
  (`allocator_settings`) and its trace entries;
* `start`: the allocator's state when the first recorded entry happened (the trace is a
  ring buffer: recording often starts after memory was allocated), rebuilt by undoing the
  trace from the final segments;
* `recorded`: the recording replayed at its own addresses, which also chooses, among the
  start states the final segments allow, the one the trace holds (`search_start`);
* `replay`: the model seeded with that state replays the trace and is compared with the
  recording entry by entry (`replay_snapshot`); `what_if` replays it under other settings.
"""

from __future__ import annotations

from memfit.allocator.snapshot.read import (
    DeviceSummary, check_snapshot, conf_from_snapshot, default_device, device_summaries, load_snapshot, loads_snapshot,
)
from memfit.allocator.snapshot.replay import (
    Divergence, ReplaySide, SnapshotReplay, WhatIf, replay_snapshot, what_if,
)
from memfit.allocator.snapshot.recorded import StartSearch
from memfit.allocator.snapshot.start import StartState, start_state

__all__ = [
    "SnapshotReplay", "ReplaySide", "Divergence", "WhatIf", "StartState",
    "load_snapshot", "loads_snapshot", "check_snapshot", "conf_from_snapshot", "start_state", "replay_snapshot",
    "what_if", "DeviceSummary", "device_summaries", "default_device", "StartSearch",
]
