"""Benchmark: what the views cost, on this machine.

    python bench/report_speed.py          # prints figures; last lines html_over_estimate=<ratio>, ui_first_page_s=<s>

1. The HTML report of the seed estimate (xlnet-large-cased on a V100-16GB, `memfit estimate` with no
   arguments): the estimate itself (simulation and allocator replay, no cache) and then the page (the
   timeline replayed from the trace, the page rendered and written), in one run, so that the ratio of the two
   is measured under the same load. Target: the page adds under 10 % to the estimate.
2. `memfit ui`: the server started as a user starts it (`python -m memfit ui`), and the seconds until its first
   page answers, from the process's start (Gradio's import included) and from the moment it says it listens.
   Target: under 2 s once it listens. Skipped without gradio.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def html_ratio() -> float:
    from memfit.commands.estimate import SEED_CASE
    from memfit.estimator import estimate
    from memfit.report import write_views
    from memfit.train_setup import TrainSetup

    seed = {k: v for k, v in SEED_CASE.items() if k not in ("model", "gpu", "training_args")}
    setup = TrainSetup.from_kwargs(SEED_CASE["model"], training_args=SEED_CASE["training_args"], **seed)
    estimate(setup, gpu=SEED_CASE["gpu"], cache=False)  # the first run of a process pays the imports
    t = time.perf_counter()
    report = estimate(setup, gpu=SEED_CASE["gpu"], cache=False)
    estimate_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        (path,) = write_views(report, html_path=Path(d) / "seed.html")
        html_s = time.perf_counter() - t
        size = os.path.getsize(path)
    ratio = html_s / estimate_s
    print(f"seed estimate: {estimate_s:.2f} s; its HTML page: {html_s:.3f} s ({size / 2**20:.2f} MiB, "
          f"{len(report.trace)} trace events)")
    print(f"html_over_estimate={ratio:.3f}")
    return ratio


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


def main() -> int:
    ratio = html_ratio()
    ui = ui_first_page()
    ok = ratio < 0.10 and (ui is None or ui[1] < 2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
