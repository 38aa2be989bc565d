"""Benchmark: real CUDA allocator traces replayed through memfit's allocator model.

    python bench/snapshot_replay.py [DIR]     # default DIR: ../shared/snapshots (next to the repo)

One row per `*.pickle` in DIR (`torch.cuda.memory._dump_snapshot()` files recorded on real
GPUs, see DIR/README.md): recorded vs modelled peak reserved and cudaMalloc counts, whether
the sequence of segment operations is equal (else the first divergence), and whether the
replay is exact (same segment operations, same reserved memory after every entry, every
block at the recorded address, same final segments). Last line: `snapshots_exact=<k>/<n>`.
Files are read with memfit's no-globals unpickler (memfit.allocator.snapshot.load_snapshot).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from memfit.allocator.snapshot import load_snapshot, replay_snapshot
    from memfit.errors import MemfitError

    folder = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / ".." / "shared" / "snapshots"
    files = sorted(folder.glob("*.pickle"))
    if not files:
        print(f"no *.pickle in {folder}", file=sys.stderr)
        return 2
    exact = 0
    print("| snapshot | entries | peak reserved recorded | peak reserved memfit | cudaMalloc recorded | "
          "cudaMalloc memfit | segment sequence | addresses | final segments | exact | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for f in files:
        t = time.perf_counter()
        try:
            r = replay_snapshot(load_snapshot(f))
        except MemfitError as err:
            print(f"| {f.name} | - | - | - | - | - | error: {err} | - | - | no | - |")
            continue
        elapsed = time.perf_counter() - t
        d = r.first_divergence
        seq = "equal" if r.segment_sequence_equal else (
            f"diverges at entry {d.event_index}: recorded {d.recorded}, memfit {d.modelled}" if d else "differs")
        exact += r.exact
        print(f"| {f.name} | {r.num_entries} | {r.recorded.peak_reserved_bytes:,} | {r.modelled.peak_reserved_bytes:,} "
              f"| {r.recorded.segment_allocs} | {r.modelled.segment_allocs} | {seq} "
              f"| {'all equal' if r.address_mismatches == 0 else f'{r.address_mismatches} differ'} "
              f"| {'equal' if r.final_state_equal else 'differ'} | {'yes' if r.exact else 'no'} | {elapsed:.2f} |")
    print(f"snapshots_exact={exact}/{len(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
