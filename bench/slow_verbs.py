"""Wall time of the commands users wait longest for, as ratios to the seed plan measured in the same run.

    python bench/slow_verbs.py [--runs 1] [--only NAME,NAME] [--json-dir DIR]

Each figure is a fresh process (`python -m memfit.cli ...`, as a user runs it) with its own empty
`MEMFIT_CACHE_DIR` (no cache from an earlier run or figure) and `MEMFIT_NO_SERVER=1` (a `memfit serve` the user
keeps never makes a figure look faster). The baseline is the single-GPU seed plan (`memfit plan` without a model:
xlnet-large-cased, batch 1 x accumulation 16, V100-16GB); every other figure is printed as a ratio to the median of
the baseline runs of the same run, and the baseline is run before and after the others, so that a change of the
machine's load touches both. Machines of the same kind differ by 3x in absolute times, much less in ratios.

`--json-dir DIR` keeps each command's `--json` output (the first run of each), to compare the plans of two
commits (`elapsed_s` aside, they must be equal).

`--against SRC` (the `src` folder of another checkout, e.g. a `git worktree` of an earlier commit) measures every
figure, the baseline included, with that code too, alternating the two in one run (this tree first, then SRC, for
each figure and run), so that both see the same machine; each code's figures are ratios to its own baseline, and
`--json-dir` keeps SRC's outputs as `NAME.against.json`.

The last line is `NAME_x=<ratio> ...` for every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> the `memfit` argv (`--json` is added); the cases of docs/diagnose.md and docs/plan.md, and the two
#: multi-GPU and QLoRA plans users reported as slow
COMMANDS: dict[str, list[str]] = {
    "seed_plan": ["plan"],
    "diagnose_model": ["diagnose", os.path.join(ROOT, "tests", "data", "oom", "trainer_eval.log"),
                       "--model", "xlnet-large-cased", "--batch-size", "1", "--grad-accum", "16",
                       "--max-length", "4096", "--eval-strategy", "epoch", "--eval-batch-size", "1"],
    "plan_4xT4": ["plan", "meta-llama/Llama-3.2-1B", "--task", "causal-lm", "--weights-dtype", "fp32",
                  "--precision", "fp16", "--batch-size", "4", "--grad-accum", "4", "--max-length", "512",
                  "--eval-strategy", "no", "--gpus", "4xT4"],
    "plan_8xH100_qwen7b": ["plan", "Qwen/Qwen2.5-7B", "--task", "causal-lm", "--precision", "bf16",
                           "--batch-size", "4", "--grad-accum", "4", "--max-length", "2048", "--eval-strategy", "no",
                           "--gpus", "8xH100-80GB"],
    "plan_allow_qlora": ["plan", "meta-llama/Llama-3.1-8B", "--task", "causal-lm", "--precision", "fp16",
                         "--batch-size", "4", "--max-length", "1024", "--eval-strategy", "no", "--gpu", "T4",
                         "--allow", "qlora"],
}

CPU_S: dict[str, list[float]] = {}


def _cpu_children_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(name: str, cache_dir: str, json_dir: str | None, src: str | None = None, suffix: str = "") -> float:
    env = dict(os.environ, MEMFIT_CACHE_DIR=cache_dir, MEMFIT_NO_SERVER="1",
               PYTHONPATH=os.pathsep.join([src or os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, "-m", "memfit.cli", *COMMANDS[name], "--json"]
    cpu_before = _cpu_children_s()
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    CPU_S.setdefault(name + suffix, []).append(_cpu_children_s() - cpu_before)
    if done.returncode not in (0, 1):
        raise SystemExit(f"`memfit {' '.join(COMMANDS[name])}` failed ({done.returncode}): "
                         f"{done.stderr.strip()[-600:]}")
    if json_dir is not None:
        path = os.path.join(json_dir, f"{name}{'.against' if suffix else ''}.json")
        if not os.path.exists(path):
            try:
                json.loads(done.stdout)
            except ValueError:
                raise SystemExit(f"`memfit {' '.join(COMMANDS[name])} --json` printed no JSON: {done.stdout[:300]}")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(done.stdout)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of each figure (the baseline: twice as many)")
    parser.add_argument("--only", default="", help="comma-separated figures besides the baseline")
    parser.add_argument("--json-dir", default=None, help="keep each command's --json output here")
    parser.add_argument("--against", default=None, metavar="SRC",
                        help="another checkout's src folder, measured alternately in the same run")
    opts = parser.parse_args()
    codes = [("", None)] + ([(" [against]", os.path.abspath(opts.against))] if opts.against else [])
    names = [n for n in COMMANDS if n != "seed_plan" and (not opts.only or n in opts.only.split(","))]
    if opts.json_dir:
        os.makedirs(opts.json_dir, exist_ok=True)
    times: dict[str, list[float]] = {}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as tmp:
        fresh = iter(os.path.join(tmp, f"cache-{i}") for i in range(10**6))

        def measure(name: str) -> None:
            for suffix, src in codes:
                t = _run(name, next(fresh), opts.json_dir, src, suffix)
                times.setdefault(name + suffix, []).append(t)
                print(f"{name}{suffix}: {t:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)

        for _ in range(opts.runs):
            measure("seed_plan")
        for _ in range(opts.runs):
            for name in names:
                measure(name)
        for _ in range(opts.runs):
            measure("seed_plan")
    ratios = []
    for suffix, _ in codes:
        seed = "seed_plan" + suffix
        base = statistics.median(times[seed])
        print(f"baseline {seed}: {base:.2f} s (median of {', '.join(f'{t:.2f}' for t in times[seed])}); "
              f"CPU {statistics.median(CPU_S[seed]):.2f} s")
        for name in names:
            key = name + suffix
            med = statistics.median(times[key])
            print(f"{key}: {med:.2f} s ({', '.join(f'{t:.2f}' for t in times[key])}) = {med / base:.2f}x the seed "
                  f"plan; CPU {statistics.median(CPU_S[key]):.2f} s; `memfit {' '.join(COMMANDS[name][:1] + ['...'])}`")
            ratios.append(f"{name}{'_against' if suffix else ''}_x={med / base:.2f}")
    print(f"runs={opts.runs} cpus={os.cpu_count()} load_average start {load_start:.1f} end {os.getloadavg()[0]:.1f}")
    print(" ".join(ratios))


if __name__ == "__main__":
    main()
