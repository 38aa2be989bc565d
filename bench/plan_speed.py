"""Benchmark: the whole `memfit plan` search for a 24-layer model (the seed case), on this machine.

    python bench/plan_speed.py            # 3 repeats, prints medians; last line plan_seconds_median=<s>

Target: under 20 s on 2 cores. The first run of a process also pays for importing
the model code (reported separately as `first_run_s`).
"""

from __future__ import annotations

import statistics
import sys
import time


def main(repeats: int = 3) -> int:
    from memfit.commands.estimate import SEED_CASE
    from memfit.planner.search import plan
    from memfit.train_setup import TrainSetup

    results = []
    for max_length in (512, 4096):
        setup = TrainSetup.from_kwargs("xlnet-large-cased", training_args=SEED_CASE["training_args"],
                                       max_length=max_length)
        times = []
        for i in range(repeats):
            t = time.perf_counter()
            r = plan(setup, gpu="V100-16GB")
            times.append(time.perf_counter() - t)
            if i == 0:
                chosen = r.plans[r.chosen] if r.chosen is not None else None
                print(f"max_length={max_length} fits_as_is={r.fits_as_is} simulations={r.simulations} "
                      f"chosen={chosen.setup_changes if chosen else None} "
                      f"relative_step_time={chosen.relative_step_time if chosen else None}")
        print(f"max_length={max_length} first_run_s={times[0]:.2f} runs_s={[round(x, 2) for x in times]}")
        results += times[1:] if repeats > 1 else times
    print(f"plan_seconds_median={statistics.median(results):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
