"""Benchmark: what the views cost, on this machine.

    python bench/report_speed.py          # prints figures; last lines html_over_estimate=<ratio>, ui_first_page_s=<s>
    python bench/report_speed.py --against REV [--rounds N]   # the HTML ratio of this tree and of git revision REV

1. The HTML report of the seed estimate (xlnet-large-cased on a V100-16GB, `memfit estimate` with no
   arguments): the estimate itself (simulation and allocator replay, no cache) and then the page (the
   timeline replayed from the trace, the page rendered and written), in one run, so that the ratio of the two
   is measured under the same load. Target: the page adds under 10 % to the estimate. The page right after
   the estimate (`html_over_estimate`) also pays the garbage collector's first full pass over what the
   estimate left (its objects and the torch / transformers modules: the page's allocations trigger it; a
   process that writes no page pays it later, at the next full collection or at exit); the page's own work
   is timed again after an untimed `gc.collect()` (`html_own_over_estimate`). On a loaded machine the wall
   times swing with the other work; the CPU time of this process (`html_cpu_over_estimate`) swings less.
2. `memfit ui`: the server started as a user starts it (`python -m memfit ui`), and the seconds until its first
   page answers, from the process's start (Gradio's import included) and from the moment it says it listens.
   Target: under 2 s once it listens. Skipped without gradio.

`--against REV` compares the page's cost with another revision's under the same load: N rounds, each
measuring the HTML ratio in a fresh process with memfit's package from REV (`git archive`) and then with
this tree's, alternately; it prints each round's ratios, their medians and whether the two revisions wrote
the same page, byte for byte.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def html_ratio(page_path: str | None = None) -> tuple[float, float]:
    """(the page's time over the estimate's, the same for the page's own work: module docstring)."""
    import gc

    from memfit.commands.estimate import SEED_CASE
    from memfit.estimator import estimate
    from memfit.report import write_views
    from memfit.train_setup import TrainSetup

    seed = {k: v for k, v in SEED_CASE.items() if k not in ("model", "gpu", "training_args")}
    setup = TrainSetup.from_kwargs(SEED_CASE["model"], training_args=SEED_CASE["training_args"], **seed)
    estimate(setup, gpu=SEED_CASE["gpu"], cache=False)  # the first run of a process pays the imports
    t, c = time.perf_counter(), time.process_time()
    report = estimate(setup, gpu=SEED_CASE["gpu"], cache=False)
    estimate_s, estimate_cpu_s = time.perf_counter() - t, time.process_time() - c
    with tempfile.TemporaryDirectory() as d:
        page = Path(page_path or Path(d) / "seed.html")
        t, c = time.perf_counter(), time.process_time()
        (path,) = write_views(report, html_path=page)
        html_s, html_cpu_s = time.perf_counter() - t, time.process_time() - c
        size = os.path.getsize(path)
        gc.collect()  # what the estimate left for the collector, collected untimed
        t = time.perf_counter()
        write_views(report, html_path=page)
        own_s = time.perf_counter() - t
    ratio, own = html_s / estimate_s, own_s / estimate_s
    print(f"seed estimate: {estimate_s:.2f} s; its HTML page: {html_s:.3f} s ({size / 2**20:.2f} MiB, "
          f"{len(report.trace)} trace events); again after a full collection: {own_s:.3f} s")
    print(f"CPU time of this process: the estimate {estimate_cpu_s:.2f} s, the page {html_cpu_s:.3f} s")
    print(f"html_cpu_over_estimate={html_cpu_s / estimate_cpu_s:.3f}")
    print(f"html_own_over_estimate={own:.3f}")
    print(f"html_over_estimate={ratio:.3f}")
    return ratio, own


def ui_first_page() -> tuple[float, float] | None:
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("ui: gradio is not installed (pip install 'memfit[ui]'): skipped")
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "memfit", "ui", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"})
    try:
        line = proc.stdout.readline()  # "memfit ui: http://...": printed just before the server starts
        said_s = time.monotonic() - started
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    r.read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() - started > 300:
                    raise SystemExit(f"memfit ui did not answer: {line}{proc.stdout.read()}")
                time.sleep(0.05)
        total_s = time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"memfit ui: first page {total_s:.2f} s after the process started, {total_s - said_s:.2f} s after it said "
          "it starts the server")
    print(f"ui_first_page_s={total_s - said_s:.2f}")
    return total_s, total_s - said_s


def against(rev: str, rounds: int) -> float:
    """The HTML ratio of this tree and of revision `rev`, alternately in fresh processes (module docstring)."""
    import statistics

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as d:
        old_tree = Path(d) / "old"
        old_tree.mkdir()
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "src/memfit"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive.stdout, check=True)
        ratios: dict[str, list[float]] = {rev: [], "this tree": []}
        owns: dict[str, list[float]] = {rev: [], "this tree": []}
        cpus: dict[str, list[float]] = {rev: [], "this tree": []}
        pages: dict[str, bytes] = {}
        for k in range(rounds):
            for name, src in ((rev, old_tree / "src"), ("this tree", root / "src")):
                page = Path(d) / f"{k}-{len(pages)}.html"
                env = {**os.environ, "PYTHONPATH": str(src)}
                proc = subprocess.run([sys.executable, __file__, "--html-only", "--page", str(page)], env=env,
                                      capture_output=True, text=True)
                out = proc.stdout
                found = re.search(r"html_over_estimate=([0-9.]+)", out)
                if found is None:
                    raise SystemExit(f"the measurement with memfit from {name} failed:\n{out}{proc.stderr[-3000:]}")
                ratios[name].append(float(found[1]))
                owns[name].append(float(re.search(r"html_own_over_estimate=([0-9.]+)", out)[1]))
                cpus[name].append(float(re.search(r"html_cpu_over_estimate=([0-9.]+)", out)[1]))
                print(f"round {k + 1}, {name}: {out.strip().splitlines()[-5]}; html_over_estimate={ratios[name][-1]:.3f}"
                      f", html_own_over_estimate={owns[name][-1]:.3f}, html_cpu_over_estimate={cpus[name][-1]:.3f}")
                pages.setdefault(name, page.read_bytes())
    same = pages[rev] == pages["this tree"]
    old, new = statistics.median(ratios[rev]), statistics.median(ratios["this tree"])
    print(f"the two pages are {'identical' if same else 'DIFFERENT'} ({len(pages[rev])} and {len(pages['this tree'])} B)")
    print(f"html_cpu_over_estimate {rev}={statistics.median(cpus[rev]):.3f} "
          f"this_tree={statistics.median(cpus['this tree']):.3f} (medians of {rounds} rounds)")
    print(f"html_own_over_estimate {rev}={statistics.median(owns[rev]):.3f} "
          f"this_tree={statistics.median(owns['this tree']):.3f} (medians of {rounds} rounds)")
    print(f"html_over_estimate {rev}={old:.3f} this_tree={new:.3f} (medians of {rounds} rounds)")
    return new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", metavar="REV", help="compare the HTML ratio with git revision REV")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of --against (default 2)")
    ap.add_argument("--html-only", action="store_true", help="measure the HTML ratio only")
    ap.add_argument("--page", help="where --html-only writes the page (default: a temporary file)")
    args = ap.parse_args()
    if args.against:
        return 0 if against(args.against, args.rounds) < 0.10 else 1
    ratio, _ = html_ratio(args.page)
    if args.html_only:
        return 0 if ratio < 0.10 else 1
    ui = ui_first_page()
    ok = ratio < 0.10 and (ui is None or ui[1] < 2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
