"""Benchmark: real CUDA allocator traces replayed through memfit's allocator model.

    python bench/snapshot_replay.py [DIR ...]

DIR defaults to tests/data/snapshots, bench/data/snapshots and, when it exists,
../shared/snapshots (next to the repository). Every `*.pickle` (a
`torch.cuda.memory._dump_snapshot()` file, read with memfit's no-globals unpickler) and
`*.json.gz` (the same dict reduced, see the folders' SOURCE.md) is read; a file whose
original (its SHA-256, recorded in `source`) was already read is skipped. One row per
device with trace entries: recorded vs modelled peak reserved and cudaMalloc counts,
whether the sequence of segment operations is equal (else the first divergence), how
the start state was found (the blocks whose size the final segments leave open, and how
many the trace fixed), and whether the replay is exact (same segment operations, same
reserved memory after every entry, every block at the recorded address, same final
segments, and one start state the data allow that holds every entry). An error is a
row too. Last line: `snapshots_exact=<k>/<n>` over the rows.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIRS = [REPO / "tests" / "data" / "snapshots", REPO / "bench" / "data" / "snapshots",
                REPO / ".." / "shared" / "snapshots"]


def _read(path: Path) -> tuple[dict[str, Any], str]:
    """The snapshot and the SHA-256 of its original file."""
    from memfit.allocator.snapshot import check_snapshot, load_snapshot

    if path.name.endswith(".json.gz"):
        snap = json.loads(gzip.decompress(path.read_bytes()))
        check_snapshot(snap, name=str(path))
        return snap, str(snap.get("source", {}).get("sha256") or hashlib.sha256(path.read_bytes()).hexdigest())
    return load_snapshot(path), hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str]) -> int:
    from memfit.allocator.snapshot import replay_snapshot
    from memfit.errors import MemfitError

    dirs = [Path(a) for a in argv] if argv else [d for d in DEFAULT_DIRS if d.is_dir()]
    files = [f for d in dirs for f in sorted(list(d.glob("*.pickle")) + list(d.glob("*.json.gz")))]
    if not files:
        print(f"no *.pickle or *.json.gz in {', '.join(map(str, dirs))}", file=sys.stderr)
        return 2
    seen: set[str] = set()
    exact = rows = 0
    print("| snapshot | device | entries | peak reserved recorded | peak reserved memfit | cudaMalloc recorded | "
          "cudaMalloc memfit | segment sequence | addresses | final segments | start (open / fixed / forced) "
          "| exact | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for f in files:
        try:
            snap, digest = _read(f)
        except MemfitError as err:
            rows += 1
            print(f"| {f.name} | - | - | - | - | - | - | error: {err} | - | - | - | no | - |")
            continue
        if digest in seen:
            continue
        seen.add(digest)
        devices = [d for d, t in enumerate(snap["device_traces"]) if t] or [0]
        for device in devices:
            rows += 1
            t = time.perf_counter()
            try:
                r = replay_snapshot(snap, device=device)
            except MemfitError as err:
                print(f"| {f.name} | {device} | - | - | - | - | - | error: {err} | - | - | - | no | - |")
                continue
            elapsed = time.perf_counter() - t
            d = r.first_divergence
            seq = "equal" if r.segment_sequence_equal else (
                f"diverges at entry {d.event_index}: recorded {d.recorded}, memfit {d.modelled}" if d else "differs")
            s = r.search
            start = f"{s.open_blocks} / {len(s.pinned)} / {len(s.forced)}" if s is not None else "-"
            exact += r.exact
            print(f"| {f.name} | {device} | {r.num_entries} | {r.recorded.peak_reserved_bytes:,} "
                  f"| {r.modelled.peak_reserved_bytes:,} | {r.recorded.segment_allocs} | {r.modelled.segment_allocs} "
                  f"| {seq} | {'all equal' if r.address_mismatches == 0 else f'{r.address_mismatches} differ'} "
                  f"| {'equal' if r.final_state_equal else 'differ'} | {start} | {'yes' if r.exact else 'no'} "
                  f"| {elapsed:.2f} |")
    print(f"snapshots_exact={exact}/{rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
