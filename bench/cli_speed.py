"""Wall time of `memfit estimate` and `memfit plan` as a user runs them: fresh processes, end to end.

    python bench/cli_speed.py [--runs 3]

Each figure is the median of `--runs` subprocess runs of `python -m memfit.cli ...`:

* estimate cold: a fresh, empty `MEMFIT_CACHE_DIR` for each run (Python start, imports, simulation);
* estimate warm: the same command again with the cache one cold run filled (memfit.cache);
* plan: `memfit plan --max-length 4096` of the seed case (no cache: every run simulates).

* served: the same cold estimates (an empty cache each) and plans while a `memfit serve` runs (memfit.server,
  started once for the bench in a temporary socket folder; `--no-serve` skips it). The other figures run with
  `MEMFIT_NO_SERVER=1`, so a server the user keeps never makes them look faster.

* floor: what any tool that reads the real model pays, whatever it does next: a fresh Python that imports
  torch and transformers, reads the model's config.json (memfit's bundled copy, read as a plain JSON file)
  and builds the model on the meta device under accelerate's `init_empty_weights`. Every time is also printed
  as a ratio to the floor of its case, measured in the same run: machines of the same kind differ by 3x in
  absolute times, much less in ratios. Targets: the cold estimate at most 1.5x the floor, the warm one under
  0.1x, the seed plan at 4096 tokens under 4x.

Cases: the seed case (`memfit estimate` without a model: xlnet-large-cased on a V100-16GB) and
`meta-llama/Llama-3.1-8B --task causal-lm`. The last two lines are
`estimate_cold_s=<x> estimate_warm_s=<y> plan_s=<z>` (medians of the seed case) and
`estimate_cold_x=<x> estimate_warm_x=<y> plan_x=<z>` (the same as ratios to the seed case's floor).
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
#: the floor of each case: (bundled config file, the transformers auto class of its task)
FLOOR_MODELS = {"seed": ("xlnet--xlnet-large-cased.json", "AutoModelForSequenceClassification"),
                "llama-3.1-8b": ("meta-llama--Llama-3.1-8B.json", "AutoModelForCausalLM")}
FLOOR_SCRIPT = """
import json, sys
import torch, transformers
from accelerate import init_empty_weights
config_dict = json.load(open(sys.argv[1], encoding="utf-8"))
config = transformers.AutoConfig.for_model(**config_dict)
with init_empty_weights():
    model = getattr(transformers, sys.argv[2]).from_config(config)
assert next(model.parameters()).device.type == "meta"
"""
PLAN = ["plan", "--max-length", "4096"]


CPU_S: dict[str, list[float]] = {}  #: figure -> CPU seconds of each run


def _cpu_children_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env(cache_dir: str, serve_dir: str | None) -> dict[str, str]:
    env = dict(os.environ, MEMFIT_CACHE_DIR=cache_dir,
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("MEMFIT_NO_SERVER", None)
    if serve_dir is None:
        env["MEMFIT_NO_SERVER"] = "1"
    else:
        env["MEMFIT_SERVE_DIR"] = serve_dir
    return env


def _run(argv: list[str], cache_dir: str, figure: str, serve_dir: str | None = None) -> float:
    env = _env(cache_dir, serve_dir)
    cpu_before = _cpu_children_s()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memfit.cli", *argv], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    CPU_S.setdefault(figure, []).append(_cpu_children_s() - cpu_before)
    if done.returncode not in (0, 1):
        raise SystemExit(f"`memfit {' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return elapsed


def _floor(name: str) -> float:
    """One fresh Python that imports torch and transformers and builds the case's model on the meta device."""
    config_file, auto_class = FLOOR_MODELS[name]
    path = os.path.join(ROOT, "src", "memfit", "models", "configs", config_file)
    cpu_before = _cpu_children_s()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", FLOOR_SCRIPT, path, auto_class], capture_output=True, text=True,
                          env=dict(os.environ, TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1"))
    elapsed = time.perf_counter() - started
    CPU_S.setdefault(f"{name}_floor", []).append(_cpu_children_s() - cpu_before)
    if done.returncode:
        raise SystemExit(f"the floor of {name} failed: {done.stderr.strip()[-400:]}")
    return elapsed


def _served(tmp: str, runs: int) -> dict[str, float]:
    """The cold estimates and the plan again, each a fresh client process, while one `memfit serve` runs."""
    serve_dir = os.path.join(tmp, "serve")
    env = _env(os.path.join(tmp, "serve-cache"), serve_dir)
    server = subprocess.Popen([sys.executable, "-m", "memfit.cli", "serve", "--idle-minutes", "10"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict[str, float] = {}
    try:
        started = time.perf_counter()
        ready = server.stdout.readline()
        if "ready at" not in ready:
            raise SystemExit(f"`memfit serve` did not start: {ready}{server.stderr.read()[-400:]}")
        print(f"memfit serve ready in {time.perf_counter() - started:.2f} s", flush=True)
        for name, argv in CASES.items():
            cold = [_run(["estimate", *argv], os.path.join(tmp, f"served-{name}-{i}"), f"served_{name}_cold",
                         serve_dir) for i in range(runs)]
            out[f"served_{name}_cold"] = statistics.median(cold)
            print(f"served estimate {name}, cold cache: {out[f'served_{name}_cold']:.2f} s "
                  f"({', '.join(f'{t:.2f}' for t in cold)})", flush=True)
        plan = [_run(PLAN, os.path.join(tmp, f"served-plan-{i}"), "served_plan", serve_dir) for i in range(runs)]
        out["served_plan"] = statistics.median(plan)
        print(f"served plan seed --max-length 4096: {out['served_plan']:.2f} s ({', '.join(f'{t:.2f}' for t in plan)})")
        subprocess.run([sys.executable, "-m", "memfit.cli", "serve", "--stop"], env=env, capture_output=True)
        tail = server.communicate(timeout=60)[0].strip().splitlines()
        served = tail[-1] if tail else ""
        expected = f"ended after {runs * (len(CASES) + 1)} requests"
        if expected not in served:  # a figure a client ran on its own is not a served figure
            raise SystemExit(f"the server did not run every served figure: `{served}`, expected `{expected}`")
    finally:
        if server.poll() is None:
            server.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-serve", action="store_true", help="skip the figures with a `memfit serve` running")
    opts = parser.parse_args()
    runs = opts.runs
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as tmp:
        for name, argv in CASES.items():
            # floor and cold estimate alternate, so a change in the machine's load touches both alike
            floor, cold = [], []
            for i in range(runs):
                floor.append(_floor(name))
                cold.append(_run(["estimate", *argv], os.path.join(tmp, f"{name}-cold-{i}"), f"{name}_cold"))
            warm_dir = os.path.join(tmp, f"{name}-cold-0")  # filled by the first cold run
            warm = [_run(["estimate", *argv], warm_dir, f"{name}_warm") for _ in range(runs)]
            medians[f"{name}_floor"] = f = statistics.median(floor)
            medians[f"{name}_cold"] = statistics.median(cold)
            medians[f"{name}_warm"] = statistics.median(warm)
            print(f"estimate {name}: floor {f:.2f} s ({', '.join(f'{t:.2f}' for t in floor)}), "
                  f"cold {medians[f'{name}_cold']:.2f} s ({', '.join(f'{t:.2f}' for t in cold)}) = "
                  f"{medians[f'{name}_cold'] / f:.2f}x floor, "
                  f"warm {medians[f'{name}_warm']:.2f} s ({', '.join(f'{t:.2f}' for t in warm)}) = "
                  f"{medians[f'{name}_warm'] / f:.3f}x floor", flush=True)
        plan = [_run(PLAN, os.path.join(tmp, f"plan-{i}"), "plan") for i in range(runs)]
        medians["plan"] = statistics.median(plan)
        print(f"plan seed --max-length 4096: {medians['plan']:.2f} s ({', '.join(f'{t:.2f}' for t in plan)}) = "
              f"{medians['plan'] / medians['seed_floor']:.2f}x the seed floor")
        if not opts.no_serve:
            medians.update(_served(tmp, runs))
    print("CPU seconds (median; runs; served_*: the client process only, the server's child is not counted): " + ", ".join(
        f"{k} {statistics.median(v):.2f} ({', '.join(f'{t:.2f}' for t in v)})" for k, v in CPU_S.items()))
    print(f"runs={runs} cpus={os.cpu_count()} python={sys.version.split()[0]} load_average={os.getloadavg()[0]:.1f}")
    if not opts.no_serve:
        print(f"served_estimate_cold_s={medians['served_seed_cold']:.2f} served_plan_s={medians['served_plan']:.2f} "
              "(with `memfit serve` running)")
    print(f"estimate_cold_s={medians['seed_cold']:.2f} estimate_warm_s={medians['seed_warm']:.2f} "
          f"plan_s={medians['plan']:.2f}")
    floor = medians["seed_floor"]
    print(f"estimate_cold_x={medians['seed_cold'] / floor:.2f} estimate_warm_x={medians['seed_warm'] / floor:.3f} "
          f"plan_x={medians['plan'] / floor:.2f} (ratios to the seed floor, {floor:.2f} s; targets <= 1.5, < 0.1, < 4)")


if __name__ == "__main__":
    main()
