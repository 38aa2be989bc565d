"""Wall time of `memfit estimate` and `memfit plan` as a user runs them: fresh processes, end to end.

    python bench/cli_speed.py [--runs 3]

Each figure is the median of `--runs` subprocess runs of `python -m memfit.cli ...`:

* estimate cold: a fresh, empty `MEMFIT_CACHE_DIR` for each run (Python start, imports, simulation);
* estimate warm: the same command again with the cache one cold run filled (memfit.cache);
* plan: `memfit plan --max-length 4096` of the seed case (no cache: every run simulates).

Cases: the seed case (`memfit estimate` without a model: xlnet-large-cased on a V100-16GB) and
`meta-llama/Llama-3.1-8B --task causal-lm`. The last line is
`estimate_cold_s=<x> estimate_warm_s=<y> plan_s=<z>` (medians of the seed case).
The caches live in a temporary folder that is removed at the end; the user's cache is never touched.
Each run's CPU seconds (user + system of the child, `resource.getrusage(RUSAGE_CHILDREN)`) are printed too:
on a machine others load they move much less than wall time, so compare commits by them there.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"seed": [], "llama-3.1-8b": ["meta-llama/Llama-3.1-8B", "--task", "causal-lm"]}
PLAN = ["plan", "--max-length", "4096"]


CPU_S: dict[str, list[float]] = {}  #: figure -> CPU seconds of each run


def _cpu_children_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str], cache_dir: str, figure: str) -> float:
    env = dict(os.environ, MEMFIT_CACHE_DIR=cache_dir,
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    cpu_before = _cpu_children_s()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memfit.cli", *argv], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    CPU_S.setdefault(figure, []).append(_cpu_children_s() - cpu_before)
    if done.returncode not in (0, 1):
        raise SystemExit(f"`memfit {' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as tmp:
        for name, argv in CASES.items():
            cold = [_run(["estimate", *argv], os.path.join(tmp, f"{name}-cold-{i}"), f"{name}_cold")
                    for i in range(runs)]
            warm_dir = os.path.join(tmp, f"{name}-cold-0")  # filled by the first cold run
            warm = [_run(["estimate", *argv], warm_dir, f"{name}_warm") for _ in range(runs)]
            medians[f"{name}_cold"] = statistics.median(cold)
            medians[f"{name}_warm"] = statistics.median(warm)
            print(f"estimate {name}: cold {medians[f'{name}_cold']:.2f} s ({', '.join(f'{t:.2f}' for t in cold)}), "
                  f"warm {medians[f'{name}_warm']:.2f} s ({', '.join(f'{t:.2f}' for t in warm)})", flush=True)
        plan = [_run(PLAN, os.path.join(tmp, f"plan-{i}"), "plan") for i in range(runs)]
        medians["plan"] = statistics.median(plan)
        print(f"plan seed --max-length 4096: {medians['plan']:.2f} s ({', '.join(f'{t:.2f}' for t in plan)})")
    print("CPU seconds (median; runs): " + ", ".join(
        f"{k} {statistics.median(v):.2f} ({', '.join(f'{t:.2f}' for t in v)})" for k, v in CPU_S.items()))
    print(f"runs={runs} cpus={os.cpu_count()} python={sys.version.split()[0]} load_average={os.getloadavg()[0]:.1f}")
    print(f"estimate_cold_s={medians['seed_cold']:.2f} estimate_warm_s={medians['seed_warm']:.2f} "
          f"plan_s={medians['plan']:.2f}")


if __name__ == "__main__":
    main()
