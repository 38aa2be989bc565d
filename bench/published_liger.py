"""memfit against Liger-Kernel's end-to-end Trainer examples (linkedin/Liger-Kernel `examples/huggingface`).

Run from the repository root (16 simulations of a 7B-8B model on 4 FSDP ranks, about a minute each):

    python bench/published_liger.py                 # every record
    python bench/published_liger.py --only qwen     # the records of one run (llama, qwen, gemma)
    python bench/published.py --liger-e2e           # the same section after published.py's tables

The records (`tests/data/published/liger_examples_e2e.json`, each with its source) are the three "Peak Allocated
Memory (MB)" charts of the examples' README: Meta-Llama-3-8B, Qwen2-7B and Gemma-7B full fine-tuning with TRL's
SFTTrainer under FSDP1 (`full_shard auto_wrap`, activation checkpointing, backward_prefetch BACKWARD_PRE) on 4
A100 80GB, bf16 mixed precision, AdamW, per-device batch 32 / 48 / 64, at most 512 tokens, with and without Liger.
The figure is `max_memory_allocated()` per GPU within a training step (callback.py `EfficiencyCallback`), in MiB.

What memfit runs for each record: the same model shapes (a bundled twin, or transformers' GemmaConfig defaults,
which are gemma-7b's), `precision=bf16` with the weights loaded in bf16, gradient checkpointing, `adamw_torch`,
FSDP1 full shard over the decoder blocks on 4 ranks (the examples' fsdp_config), an A100-80GB; Liger as the run
patched it (`liger_kernel_config`): the Llama and Qwen runs called `apply_liger_kernel_to_<model>()` after the
model was built, when its class swaps (RMSNorm, MLP) no longer reach the built modules, so only RoPE and the fused
linear cross-entropy took effect; the Gemma run patched before building (all four). Compared: memfit's peak
allocated per GPU (rank 0) with the measured figure; for a bar the chart marks OOM, whether memfit says the step
does not fit in 80 GB.

What is not the same: memfit pads every batch to 512 tokens, the examples each batch to its longest Alpaca example
(truncated at 512; the chart is the maximum over the logged steps, so the worst batch: 512 once a batch holds one
long example, which an epoch of the Llama and Qwen runs makes likely and the Gemma run's 20 steps do not); the
examples ran transformers 4.43.3, whose forward upcasts the whole logits to fp32 and shifts them with a copy where
5.24 (memfit) shifts the labels inside the loss (not simulated: 4.43 is not installed); Liger's kernels of August
2024 (0.1-0.2) against 0.8.5 here. A row whose figure lies below the fp32 model states memfit holds says so: that
run cannot have kept accelerate's fp32 master weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

RECORDS = REPO / "tests" / "data" / "published" / "liger_examples_e2e.json"
MIB = 1024**2
GPU = "A100-80GB"
WORLD_SIZE = 4
#: examples/huggingface/config/fsdp_config.json at the records' commits; FSDP1 (transformers 4.43 had no FSDP2)
FSDP_CONFIG = {"backward_prefetch": "backward_pre", "forward_prefetch": "true", "activation_checkpointing": True,
               "version": 1}
#: Liger's kernels by name -> `_apply_liger_kernel_to_instance` keywords turning the others off
_LIGER_SWITCHES = ("rope", "fused_linear_cross_entropy", "rms_norm", "swiglu", "geglu")


@dataclass(frozen=True)
class Row:
    record_id: str
    measured_mib: float | None  #: None: the chart marks the bar OOM
    predicted_mib: float
    predicted_fits: bool | None
    peak_phase: str
    notes: str

    @property
    def error(self) -> float | None:
        return None if self.measured_mib is None else self.predicted_mib / self.measured_mib - 1.0


def load_records(path: Path = RECORDS) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: cannot read the Liger end-to-end records `{path}`: {err}")
    return data


def _gemma_7b_dir() -> str:
    """A folder with transformers' `GemmaConfig()` (its defaults are gemma-7b's: configuration_gemma.py docstring
    "a configuration similar to that of the Gemma-7B"), since no Gemma 1 config is bundled."""
    from transformers import GemmaConfig

    folder = tempfile.mkdtemp(prefix="memfit-gemma-7b-")
    GemmaConfig().save_pretrained(folder)
    return folder


def setup_of(record: dict[str, Any], model_dir: dict[str, str]) -> tuple[Any, Any]:
    """(TrainSetup, ParallelSetup) memfit runs for `record` (module docstring)."""
    from memfit import TrainSetup
    from memfit.parallel.setup import parallel_from_training_args

    model = record["memfit_model"]
    if model.startswith("transformers GemmaConfig"):
        model = model_dir.setdefault("gemma", _gemma_7b_dir())
    liger = bool(record["use_liger"])
    fields = dict(model=model, task="causal-lm", precision="bf16", weights_dtype="bf16",
                  per_device_train_batch_size=int(record["per_device_train_batch_size"]),
                  max_length=int(record["max_seq_length"]), gradient_checkpointing=True, optim="adamw_torch",
                  weight_decay=0.05, eval_strategy="no", use_liger_kernel=liger)
    if liger:
        patched = set(record["liger_patched"])
        fields["liger_kernel_config"] = {k: False for k in _LIGER_SWITCHES if k not in patched
                                         and not (k == "geglu" and "swiglu" in patched)
                                         and not (k == "swiglu" and "geglu" in patched)}
        if record["run"] != "gemma":
            fields["liger_kernel_config"].pop("geglu", None)  # not a keyword of the Llama / Qwen2 patch
        else:
            fields["liger_kernel_config"].pop("swiglu", None)
    parallel, _ = parallel_from_training_args({"fsdp": "full_shard auto_wrap", "fsdp_config": FSDP_CONFIG},
                                              world_size=WORLD_SIZE, precision="bf16")
    return TrainSetup(**fields), parallel


def predict(record: dict[str, Any], model_dir: dict[str, str]) -> Row:
    from memfit import estimate

    setup, parallel = setup_of(record, model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = estimate(setup, gpu=GPU, parallel=parallel)
    notes = ["padded to 512 tokens (the run: each batch to its longest Alpaca example, <= 512, over "
             + ("20 steps" if "max_steps 20" in record.get("steps", "") else "an epoch") + ")"]
    step = report.phase_breakdowns.get("optimizer", {})
    states = sum(step.get(k, 0) for k in ("weights", "gradients", "optimizer_state"))
    measured = record.get("value_mib")
    if measured is not None and measured * MIB < states:
        notes.append(f"measured is below the rank's fp32 weights, gradients and AdamW states alone ({states / MIB:,.0f} "
                     "MiB, accelerate's FSDP upcast): this run kept them in bf16 (an accelerate before 0.30?)")
    return Row(record["id"], record.get("value_mib"), report.peak_allocated_bytes / MIB, report.fits,
               report.peak_phase, "; ".join(notes))


def run(records: list[dict[str, Any]]) -> list[Row]:
    model_dir: dict[str, str] = {}
    return [predict(r, model_dir) for r in records]


def format_rows(rows: list[Row], records: list[dict[str, Any]]) -> str:
    by_id = {r["id"]: r for r in records}
    out = ["| record | model | batch | Liger | measured MiB | memfit MiB | error | memfit peak | notes |",
           "|---|---|---:|---|---:|---:|---:|---|---|"]
    for row in rows:
        rec = by_id[row.record_id]
        if row.measured_mib is None:
            measured = "OOM"
            verdict = ("agrees: does not fit" if row.predicted_fits is False else
                       "DISAGREES: memfit says it fits" if row.predicted_fits else "fit unknown")
            err = verdict
        else:
            tol = rec.get("read_tolerance_mib")
            measured = f"{row.measured_mib:,.0f}" + (f" +-{tol}" if tol else "")
            err = f"{100 * row.error:+.1f} %"
        out.append(f"| {row.record_id} | {rec['model']} | {rec['per_device_train_batch_size']} | "
                   f"{'+'.join(rec['liger_patched']) if rec['use_liger'] else 'no'} | {measured} | "
                   f"{row.predicted_mib:,.0f} | {err} | {row.peak_phase} | {row.notes} |")
    return "\n".join(out)


def reductions(rows: list[Row], records: list[dict[str, Any]]) -> list[str]:
    """Liger's saving (1 - with / without) at each batch where both bars are figures, measured and memfit's."""
    by_id = {r.record_id: r for r in rows}
    lines = []
    for rec in records:
        if rec["use_liger"]:
            continue
        plain = by_id.get(rec["id"])
        liger = by_id.get(rec["id"].replace("-plain", "-liger"))
        if plain is None or liger is None or plain.measured_mib is None or liger.measured_mib is None:
            continue
        lines.append(f"{rec['run']} batch {rec['per_device_train_batch_size']}: Liger saves "
                     f"{100 * (1 - liger.measured_mib / plain.measured_mib):.1f} % measured, "
                     f"{100 * (1 - liger.predicted_mib / plain.predicted_mib):.1f} % memfit")
    return lines


def summary(rows: list[Row]) -> list[str]:
    errs = [abs(r.error) for r in rows if r.error is not None]
    ooms = [r for r in rows if r.measured_mib is None]
    agree = sum(1 for r in ooms if r.predicted_fits is False)
    median = statistics.median(errs) if errs else float("nan")
    return [f"liger_e2e_oom_agree={agree}/{len(ooms)}",
            f"liger_e2e_median_abs_error={median:.4f} over {len(errs)} records"]


def report(records: list[dict[str, Any]]) -> str:
    started = time.perf_counter()
    rows = run(records)
    lines = [format_rows(rows, records), "", *reductions(rows, records),
             "", "Not compared: Gemma-7B without Liger at batch 48 and 64 (the chart has no bar and no OOM mark).",
             f"{len(rows)} records, {time.perf_counter() - started:.0f} s", *summary(rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("llama", "qwen", "gemma"), help="the records of one run")
    parser.add_argument("--data", type=Path, default=RECORDS, help="the records (default: %(default)s)")
    args = parser.parse_args(argv)
    records = [r for r in load_records(args.data) if args.only in (None, r["run"])]
    print(report(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
