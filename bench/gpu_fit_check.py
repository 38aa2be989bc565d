"""`memfit.fit` on a real GPU: recovery, plan application and measurement under CUDA.

Run from the repository root (venv active) on a machine with one CUDA GPU:

    python bench/gpu_fit_check.py --out bench/results/      # all checks (about 3 min on one H200)
    python bench/gpu_fit_check.py --dry-run                  # no CUDA: the checks and their predicted limits

Everything `memfit.fit` does was tested on the CPU under `memfit.testing.memory_budget`; what
only a GPU can show is checked here, each check in a fresh child process (clean allocator),
on bert-base-uncased (memfit's bundled config, random weights, synthetic fixed-length data):

* `train_recovery`: fp32, batch 32 x 256 tokens, no plan, the process limited with
  `torch.cuda.set_per_process_memory_fraction` to the resident training state plus half of the
  predicted activations, so the first micro-step runs out of memory. Expected: a recovery by
  chunking, every step done, the same effective batch, weights close to an unlimited run of the
  same seed (max abs difference printed; cuBLAS/atomics make fp32 GPU runs not bitwise equal).
* `plan_mixed_precision`: batch 32 x 512 tokens on a limit where the fp32 setup does not fit;
  `memfit.fit(..., gpu=<the limit>)` applies its plan (mixed precision and/or checkpointing and
  micro-batch) before training. Expected: a plan applied, no OOM, every step done; the
  measured peaks (torch.cuda) are reported next to the predicted ones.
* `optimizer_foreach`: `optim="adamw_torch"` (foreach on CUDA: a temporary the size of the
  parameters in the step), batch 4 x 64 tokens, limit = predicted step peak minus half the
  weights. Expected: an optimizer-step recovery to the per-parameter mode, every step done.

Output: `<out>/gpu_fit_check-<gpu>-<date>.json` and one `check=... ok=...` line per check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "src"))

MODEL = "bert-base-uncased"
CHECKS = {
    "train_recovery": dict(batch=32, length=256, optim="adamw_torch_fused", plan=False, steps=6),
    "plan_mixed_precision": dict(batch=32, length=512, optim="adamw_torch_fused", plan=True, steps=4),
    "optimizer_foreach": dict(batch=4, length=64, optim="adamw_torch", plan=False, steps=4),
}


def _trainer(out: str, check: dict[str, Any], seed: int = 0):
    import torch
    from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

    from memfit.models.build import resolve_config

    config = resolve_config(MODEL).config
    config.num_labels = 2
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    g = torch.Generator().manual_seed(seed)
    n = check["batch"] * check["steps"]
    data = [{"input_ids": torch.randint(1000, 20000, (check["length"],), generator=g),
             "attention_mask": torch.ones(check["length"], dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(n)]
    args = TrainingArguments(out, per_device_train_batch_size=check["batch"], gradient_accumulation_steps=1,
                             max_steps=check["steps"], optim=check["optim"], report_to="none",
                             save_strategy="no", logging_strategy="no", seed=seed, disable_tqdm=True,
                             dataloader_num_workers=0)
    return Trainer(model=model, args=args, train_dataset=data)


def _limit_bytes(name: str, report) -> int:
    """The per-process limit of a check, from memfit's prediction of the unconstrained setup."""
    step_end = report.phase_breakdowns.get("optimizer", {})
    weights = step_end.get("weights", 0)
    resident = weights + step_end.get("gradients", 0) + step_end.get("optimizer_state", 0)
    if name == "train_recovery":
        return int(resident + 0.5 * (report.peak_allocated_bytes - resident))
    if name == "plan_mixed_precision":
        return int(0.6 * report.peak_allocated_bytes)
    return int(report.phases["optimizer"] - 0.5 * weights)


def run_child(name: str, limit: int | None) -> dict[str, Any]:
    """One check in this (fresh) process; `limit=None` runs it unconstrained (the reference weights)."""
    import torch

    import memfit

    check = CHECKS[name]
    out: dict[str, Any] = {"check": name, "limit_bytes": limit}
    with tempfile.TemporaryDirectory() as d:
        trainer = _trainer(d, check)
        total = torch.cuda.get_device_properties(0).total_memory
        if limit is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
        gpu = f"{limit}B" if (limit is not None and check["plan"]) else None
        try:
            report = memfit.fit(trainer, plan=check["plan"], gpu=gpu)
        except Exception as exc:  # recorded: the parent reports it
            out.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:800]}")
            return out
        out.update(
            steps_completed=report.steps_completed, steps_expected=report.steps_expected,
            effective_batch_size=report.effective_batch_size, oom_recoveries=report.oom_recoveries,
            plan_applied=report.plan_applied, micro_batch_chunks=report.micro_batch_chunks,
            phases=report.phases, measured_with=report.measured_with, elapsed_s=report.elapsed_s,
            max_memory_allocated=torch.cuda.max_memory_allocated(), max_memory_reserved=torch.cuda.max_memory_reserved(),
            fp16=bool(trainer.args.fp16), bf16=bool(trainer.args.bf16))
        weights = torch.cat([p.detach().float().reshape(-1).cpu() for p in trainer.model.parameters()])
        path = os.path.join(tempfile.gettempdir(), f"gpu_fit_check-{name}-{'ref' if limit is None else 'run'}.pt")
        torch.save(weights, path)
        out["weights_path"] = path
    return out


def _spawn(name: str, limit: int | None, timeout: float) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--child", name, "--limit", str(limit or 0)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"check": name, "ok": False, "error": f"timeout after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"check": name, "ok": False, "error": f"no result (rc={proc.returncode}): {proc.stderr[-800:]}"}
    return json.loads(lines[-1])


def _verdict(name: str, run: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    import torch

    if "error" in run:
        return {"ok": False, "why": run["error"]}
    done = run["steps_completed"] == run["steps_expected"]
    phases = {r["phase"] for r in run["oom_recoveries"]}
    v: dict[str, Any] = {"steps_done": done}
    if name == "train_recovery":
        v["recovered"] = "train" in phases
        if ref and "weights_path" in ref:
            v["max_abs_weight_diff_vs_unlimited"] = float(
                (torch.load(run["weights_path"]) - torch.load(ref["weights_path"])).abs().max())
    elif name == "plan_mixed_precision":
        v["plan_applied"] = bool(run["plan_applied"])
        v["no_oom"] = not run["oom_recoveries"]
        v["reserved_share_of_limit"] = round(run["max_memory_reserved"] / run["limit_bytes"], 3)
    else:
        v["optimizer_recovered"] = "optimizer" in phases
    v["ok"] = all(x for k, x in v.items() if isinstance(x, bool))
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: the checks and their predicted limits")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per child process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, args.limit or None), default=str))
        return 0

    import memfit
    from memfit.train_setup import TrainSetup

    gpu = "H200" if args.dry_run else "auto"
    limits = {}
    for name, check in CHECKS.items():
        setup = TrainSetup(model=MODEL, per_device_train_batch_size=check["batch"], max_length=check["length"],
                           optim=check["optim"], eval_strategy="no")
        report = memfit.estimate(setup, gpu=gpu)
        limits[name] = _limit_bytes(name, report)
        print(f"check={name} predicted_peak_allocated={report.peak_allocated_bytes} limit_bytes={limits[name]}")
    if args.dry_run:
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    results = {}
    for name in CHECKS:
        ref = _spawn(name, None, args.timeout) if name == "train_recovery" else None
        run = _spawn(name, limits[name], args.timeout)
        results[name] = {"run": run, "reference": ref, "verdict": _verdict(name, run, ref)}
        print(f"check={name} ok={results[name]['verdict']['ok']} {json.dumps(results[name]['verdict'])}")
    os.makedirs(args.out, exist_ok=True)
    tag = torch.cuda.get_device_name(0).replace(" ", "-")
    path = os.path.join(args.out, f"gpu_fit_check-{tag}-{datetime.date.today()}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "memfit_limits": limits, "results": results}, fh, indent=2, default=str)
    print(f"written {path}")
    return 0 if all(r["verdict"]["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
