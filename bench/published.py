"""memfit against GPU memory that others measured on real GPUs and published.

Run from the repository root:

    python bench/published.py                        # reads ../shared/published/measurements.json
    python bench/published.py --data FILE.json       # another copy of the records
    python bench/published.py --no-implied-length    # skip the length search behind the padding reason
    python bench/published.py --liger-e2e            # also Liger's end-to-end FSDP examples (published_liger.py)
    python bench/published.py --multimodal           # also the vision-language, speech and GRPO records

The records (`measurements.json`, see its README) are figures from peft's MetaMathQA method
comparison, Liger-Kernel's benchmark data, torchtune's README and peft's README, each with its
source, configuration and what it measures. For every record whose configuration memfit can
express, this script runs memfit and prints one table row: record id (its index in the file),
what it measures, measured MiB, predicted MiB, error (predicted / measured - 1), and for a gap
above 5 % the reason found. Then the records memfit cannot express, each with what is missing,
and as the last line `published_median_abs_error=<fraction> over <n> records`.

Which memfit figure is compared with which measured one:

* peft MetaMathQA comparison (`method_comparison/MetaMathQA/run.py`): a plain PyTorch loop,
  `torch.optim.AdamW(model.parameters())` (foreach on CUDA), bf16 weights without autocast
  (`use_amp: false`; AdamW states in bf16), batch 4, at most 768 tokens, clipping at 1.0, on an
  L40S. Measured: `extra.reserved_99th_pct_mib`, the 99th percentile of
  `torch.cuda.memory_reserved()` read after each training step (`run.py` `train`), which is the
  step's peak reserved (nothing releases cached blocks inside a step; `empty_cache()` runs every
  10 steps). The record's `value_mib` (max reserved over the whole run) also covers generation at
  batch 50 and a loss pass on other data, which memfit does not simulate, so it is not compared.
  Predicted: `MemoryReport.peak_reserved_bytes` of the training step (no evaluation), at the
  configured 768 tokens. The peft method of each experiment is its adapter_config.json from peft's
  repository at the record's commit (`bench/data/metamathqa_experiments.json`), given to memfit as `peft_config`
  (DoRA as `use_dora`); a record whose trainable count memfit does not reproduce says so in its reason.
* Liger-Kernel op benchmarks, provider "huggingface" (`benchmark/scripts/benchmark_*.py` and
  `utils.py` `_test_memory`): `reset_peak_memory_stats(); fwd + bwd; max_memory_allocated()`,
  median of 10 iterations in one process. The op itself runs on fake tensors under memfit's
  tracker (`memfit.sim.tracker.StorageTracker`) with memfit's CUDA patches, the tensors the
  script keeps alive created first, two iterations (the first creates the leaves' `.grad`, which
  later iterations accumulate into), and the trace is replayed through memfit's caching-allocator
  model; predicted = peak allocated within the last iteration (what a peak reset before it
  reports). Where the op runs matmuls, the two cuBLAS workspaces memfit adds to every estimate
  (`memfit.gpus.outside_pytorch.cublas_workspace_bytes`, forward and autograd thread) are alive
  from the start: the script's speed benchmark ran first in the same process.

* Vision-language, speech and GRPO records (`bench/data/published_multimodal.json`, `--multimodal`): figures from
  example scripts, READMEs and notebook outputs that do not state the data's lengths (most do not state what they
  measured either; TRL's notebooks print `torch.cuda.max_memory_reserved()`, the GRPO VRAM probe of
  jsboige/CoursIA writes `max_memory_allocated()` and `max_memory_reserved()`, a record each). Each record carries
  the TrainSetup fields memfit runs for it (`memfit.setup`), what was assumed for what its source leaves out
  (`memfit.assumed`) and what the run did that those fields do not express (`memfit.differs`, the reason printed
  for a gap). Predicted: `peak_reserved_bytes` of the training step (`peak_allocated_bytes` for a record of
  `max_memory_allocated()`). They count as records whose data lengths are assumed.

The script only reads the records; it writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

DEFAULT_DATA = REPO.parent / "shared" / "published" / "measurements.json"
MIB = 1024**2
GAP = 0.05  #: gaps above this get a reason
#: Lengths tried when looking for the padded length at which memfit meets a padded-run record.
IMPLIED_LENGTHS = (320, 384, 448, 512, 576, 640, 704, 768)

# peft MetaMathQA comparison, default_training_params.json: max_seq_length 768, batch_size 4,
# grad_norm_clip 1.0, use_amp false, dtype bfloat16; run.py / utils.py `get_optimizer_and_scheduler`.
PEFT_MAX_LENGTH = 768
PEFT_BATCH = 4
#: LoRA experiments of the comparison whose adapter is plain LoRA (adapter_config.json of each:
#: lora_dropout 0.0, bias none, no DoRA; `rslora` only changes the scaling factor, not memory).
_PLAIN_LORA = re.compile(r"^lora/llama-3\.2-3B-rank(\d+)(-target-mlp|-rslora)?$")
#: adapter_config.json / training_params.json of each experiment (peft's repository at the records' commits).
EXPERIMENTS = REPO / "bench" / "data" / "metamathqa_experiments.json"
#: Vision-language, speech and GRPO records, each with the memfit inputs it is run with (`--multimodal`).
MULTIMODAL = REPO / "bench" / "data" / "published_multimodal.json"
#: Source kinds whose records give memfit's inputs themselves (`memfit.setup`).
_GIVEN_KINDS = ("ms_swift_example_comment", "whisper_peft_readme_table", "trl_notebook_output",
                "axolotl_example_readme", "grpo_probe_jsonl")
#: What the other LoRA experiments add that TrainSetup cannot say.
_LORA_VARIANTS = {
    "lorafa": "LoRA-FA (frozen A, peft.optimizers.create_lorafa_optimizer: training_params.json "
              "`optimizer_type: lora-fa`) not modelled",
}


# -- records ------------------------------------------------------------------------------------
def load_records(path: Path) -> list[dict[str, Any]]:
    """The list of records in `path`; exits with a one-line message when it cannot be read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"error: records file `{path}` does not exist; pass --data FILE (measurements.json)")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: cannot read records file `{path}`: {err}")
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise SystemExit(f"error: `{path}` is not a JSON list of records; pass measurements.json")
    return data


@dataclass(frozen=True)
class TrainCase:
    """A training run memfit estimates with a TrainSetup."""

    label: str
    setup_fields: tuple[tuple[str, Any], ...]  #: TrainSetup keyword arguments (hashable)
    measured_mib: float
    metric: str  #: the measured figure, in words


@dataclass(frozen=True)
class OpCase:
    """One op benchmark replayed on fake tensors."""

    label: str
    op: str  #: cross_entropy, lm_head_ce, rms_norm, geglu_mlp
    dims: tuple[tuple[str, Any], ...]
    measured_mib: float
    metric: str


@dataclass(frozen=True)
class Missing:
    label: str
    missing: str


@dataclass(frozen=True)
class Row:
    record_id: int
    source: str
    label: str
    metric: str
    measured_mib: float
    predicted_mib: float
    reason: str = ""

    @property
    def error(self) -> float:
        return self.predicted_mib / self.measured_mib - 1.0


def _era_stack(record: dict[str, Any]) -> str:
    """`torch 2.13.0, transformers 5.13.1` from a record's era text ('' when absent)."""
    era = str(record.get("era", ""))
    torch_v = re.search(r"torch ([0-9.]+)", era)
    tf_v = re.search(r"transformers ([0-9.]+)", era)
    parts = [f"torch {torch_v.group(1)}" if torch_v else "", f"transformers {tf_v.group(1)}" if tf_v else ""]
    return ", ".join(p for p in parts if p)


def _experiment(record: dict[str, Any]) -> str:
    """`lora/llama-3.2-3B-rank32` from `PEFT LORA (lora/llama-3.2-3B-rank32)`."""
    m = re.search(r"\(([^()]+)\)\s*$", str(record.get("method", "")))
    return m.group(1) if m else str(record.get("method", ""))


def express(record: dict[str, Any]) -> TrainCase | OpCase | Missing:
    """What memfit runs for `record`, or what memfit lacks to express it."""
    kind = record.get("source_kind", "")
    if kind == "peft_method_comparison_json":
        return _express_peft(record)
    if kind == "kernel_microbenchmark":
        return _express_kernel(record)
    if kind == "torchtune_readme_table":
        return Missing(f"{record.get('model')}: {record.get('method')}", _torchtune_missing(record))
    if kind in ("peft_readme_table", "peft_readme_log"):
        return Missing(f"{record.get('model')}: {record.get('method')}", _peft_readme_missing(record))
    if kind in _GIVEN_KINDS:
        return _express_given(record)
    return Missing(str(record.get("model")), f"source kind `{kind}` unknown to this script")


def _express_peft(record: dict[str, Any]) -> TrainCase | Missing:
    extra = record.get("extra") or {}
    stack = _era_stack(record)
    method = str(record.get("method", ""))
    base = dict(
        model="meta-llama/Llama-3.2-3B", task="causal-lm", precision="fp32", weights_dtype="bf16",
        per_device_train_batch_size=PEFT_BATCH, max_length=PEFT_MAX_LENGTH, optim="adamw_torch",
        weight_decay=float((extra.get("optimizer_kwargs") or {}).get("weight_decay", 0.01)),
        max_grad_norm=1.0, compute_capability=(8, 9), eval_strategy="no",
    )
    metric = "reserved (99th pct after each train step)"
    if "reserved_99th_pct_mib" not in extra:
        return Missing(method, "no train-only reserved figure (`extra.reserved_99th_pct_mib`) in the record")
    measured = float(extra["reserved_99th_pct_mib"])
    if method == "full fine-tuning":
        return TrainCase(f"full fine-tuning ({stack})", tuple(sorted(base.items())), measured, metric)
    name = _experiment(record)
    m = _PLAIN_LORA.match(name)
    if m and method.startswith("PEFT LORA"):
        targets = extra.get("target_modules")
        if not isinstance(targets, list) or not targets:
            return Missing(method, "LoRA target modules not in the record")
        fields = dict(base, lora_r=int(m.group(1)), lora_dropout=0.0,  # alpha: no memory
                      lora_target_modules=tuple(sorted(targets)))
        suffix = {"-target-mlp": " mlp", "-rslora": " rsLoRA"}.get(m.group(2) or "", "")
        label = f"LoRA r{m.group(1)}{suffix} {'+'.join(sorted(targets))} ({stack})"
        return TrainCase(label, tuple(sorted(fields.items())), measured, metric)
    for key, missing in _LORA_VARIANTS.items():
        if method.startswith("PEFT LORA") and key in name:
            return Missing(method, missing)
    return _express_peft_method(record, base, name, measured, metric, stack)


def load_multimodal(path: Path = MULTIMODAL) -> list[dict[str, Any]]:
    """The records of `published_multimodal.json`; exits with a one-line message when it cannot be read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: cannot read records file `{path}`: {err}")
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise SystemExit(f"error: `{path}` has no `records` list; pass bench/data/published_multimodal.json")
    return data["records"]


def _hashable(value: Any) -> Any:
    """A setup value as a cache key part: lists as tuples, a peft config as its JSON text."""
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, list):
        return tuple(value)
    return value


def _express_given(record: dict[str, Any]) -> TrainCase | Missing:
    """A record that states the TrainSetup fields memfit runs for it (`memfit.setup`)."""
    setup = (record.get("memfit") or {}).get("setup")
    if not isinstance(setup, dict) or "model" not in setup:
        return Missing(str(record.get("model")), "no memfit inputs (`memfit.setup` with a model) in the record")
    fields = {k: _hashable(v) for k, v in setup.items()}
    label = f"{record.get('model')}: {record['memfit'].get('label') or record.get('method', '').split(' (')[0]}"
    metric = {"allocated": "allocated", "reserved": "reserved", "nvidia_smi": "nvidia-smi"}.get(
        str(record.get("metric")), "not stated (see the record's notes)")
    return TrainCase(label, tuple(sorted(fields.items())), float(record["value_mib"]), metric)


def _experiments() -> dict[str, Any]:
    return json.loads(EXPERIMENTS.read_text(encoding="utf-8"))["experiments"]


def _express_peft_method(record: dict[str, Any], base: dict[str, Any], name: str, measured: float, metric: str,
                         stack: str) -> TrainCase | Missing:
    """A peft method other than plain LoRA: its experiment's adapter_config.json as `peft_config`."""
    from memfit.models.peft_methods import FAKE_UNSUPPORTED

    method = str(record.get("method", ""))
    exp = _experiments().get(name)
    if exp is None or "adapter_config.json" not in exp:
        return Missing(method, f"the adapter_config.json of `{name}` is not in {EXPERIMENTS.name}")
    cfg = exp["adapter_config.json"]
    params = exp.get("training_params.json") or {}
    kind = str(cfg.get("peft_type", "")).upper()
    if kind in FAKE_UNSUPPORTED:
        return Missing(method, f"{kind} cannot be simulated under fake tensors: {FAKE_UNSUPPORTED[kind]}")
    if params.get("optimizer_type", "AdamW") != "AdamW":
        return Missing(method, f"optimizer `{params['optimizer_type']}` (training_params.json) not modelled")
    if params.get("autocast_adapter_dtype", True) is not True:
        return Missing(method, "autocast_adapter_dtype=False (training_params.json: adapters kept in bf16, "
                               "get_peft_model's autocast_adapter_dtype) not modelled; memfit builds peft's default "
                               "(float32 adapters)")
    fields = dict(base)
    if kind == "LORA" and cfg.get("use_dora") and not cfg.get("use_bdlora") and cfg.get("init_lora_weights") is True:
        targets = cfg.get("target_modules") or record["extra"].get("target_modules")
        fields.update(lora_r=int(cfg["r"]), lora_dropout=float(cfg.get("lora_dropout", 0.0)), use_dora=True,
                      lora_target_modules=tuple(sorted(targets)))
        label = f"DoRA r{cfg['r']} {'+'.join(sorted(targets))} ({stack})"
    else:
        fields["peft_config"] = json.dumps(cfg, sort_keys=True)
        label = f"{kind} {name.split('/', 1)[1].removeprefix('llama-3.2-3B-')} ({stack})"
    return TrainCase(label, tuple(sorted(fields.items())), measured, metric)


_KERNEL_PATTERNS = (
    ("cross_entropy", re.compile(r"CrossEntropyLoss on (\w+) logits \[B\*T=(\d+), V=(\d+)\]")),
    ("lm_head_ce", re.compile(r"lm_head Linear\((\d+)->(\d+), bias=False, (\w+)\)")),
    ("rms_norm", re.compile(r"RMSNorm, x \[M=(\d+), H=(\d+)\] (\w+)")),
    ("geglu_mlp", re.compile(r"GEGLU MLP \(hidden (\d+), intermediate (\d+), (\w+)\) (\w+), bsz (\d+)")),
)


def _express_kernel(record: dict[str, Any]) -> OpCase | Missing:
    model = str(record.get("model", ""))
    measured = float(record["value_mib"])
    metric = "allocated (max_memory_allocated, fwd+bwd)"
    for op, pattern in _KERNEL_PATTERNS:
        m = pattern.search(model)
        if not m:
            continue
        if op == "cross_entropy":
            dims = dict(dtype=m.group(1), rows=int(m.group(2)), vocab=int(m.group(3)))
            label = f"CrossEntropyLoss {dims['dtype']} [{dims['rows']}, {dims['vocab']}]"
        elif op == "lm_head_ce":
            bt = re.search(r"BT=(\d+)", str(record.get("seq_len", "")))
            if not bt:
                return Missing(model, "token count (BT) not in the record")
            dims = dict(hidden=int(m.group(1)), vocab=int(m.group(2)), dtype=m.group(3), tokens=int(bt.group(1)))
            label = f"lm_head {dims['hidden']}->{dims['vocab']} + CE, {dims['tokens']} tokens"
        elif op == "rms_norm":
            dims = dict(rows=int(m.group(1)), hidden=int(m.group(2)), dtype=m.group(3))
            label = f"LlamaRMSNorm {dims['dtype']} [{dims['rows']}, {dims['hidden']}]"
        else:
            dims = dict(hidden=int(m.group(1)), intermediate=int(m.group(2)), act=m.group(3), dtype=m.group(4),
                        batch=int(m.group(5)), seq=int(record["seq_len"]))
            label = f"LlamaMLP {dims['act']} [{dims['batch']}x{dims['seq']}, {dims['hidden']}]"
        return OpCase(label, op, tuple(sorted(dims.items())), measured, metric)
    return Missing(model, "op not replicated by this script")


def _torchtune_missing(record: dict[str, Any]) -> str:
    method = str(record.get("method", "")).lower()
    parts = ["torchtune's own model code and recipe loop (not Hugging Face modules or the Trainer)"]
    for key, what in (("pack", "sample packing"), ("compile", "torch.compile"), ("chunked", "chunked cross-entropy"),
                      ("optimizer_in_bwd", "optimizer in backward"), ("offload", "activation/CPU offloading"),
                      ("8-bit", "8-bit AdamW under optimizer_in_bwd"), ("paged", "paged AdamW"),
                      ("qlora", "NF4 base weights (QLoRA)")):
        if key in method or key in str(record.get("optim", "")).lower():
            parts.append(what)
    gpus = re.match(r"\s*(\d+)\s*x", str(record.get("gpu", "")))
    if gpus and int(gpus.group(1)) > 1:
        parts.append(f"multi-GPU sharding ({record.get('gpu')})")
    parts.append("metric: peak active memory / column not specified")
    return "; ".join(dict.fromkeys(parts))


def _peft_readme_missing(record: dict[str, Any]) -> str:
    model = str(record.get("model", ""))
    method = str(record.get("method", "")).lower()
    task = str(record.get("task", "")).lower()
    if "stable-diffusion" in model:
        return "a diffusers model (UNet, VAE, text encoder), not a transformers model"
    if record.get("metric") == "oom_lower_bound":
        return "an OOM: the record is a lower bound, not a figure"
    if "generat" in task:
        return "generation (model.generate) is not simulated"
    parts = [f"model config `{model.split(' ')[0]}` not bundled (no hub access here)",
             "tweet lengths unknown (each shuffled batch padded to its longest)"]
    if "deepspeed" in method or "ds " in method:
        parts.append("DeepSpeed ZeRO-3 with parameter offload not modelled")
    if record.get("metric") == "other":
        parts.append("the table's unit and measurement are not stated")
    return "; ".join(parts)


# -- memfit on training cases --------------------------------------------------------------------
def l40s_spec():
    """The L40S (sm_89) as memfit's GpuSpec; it is not in memfit's catalog.

    total_bytes: "GPU has a total capacity of 44.42 GiB" (OOM message on an L40S,
    stepfun-ai/Step-Video-T2V#8). Rates: "NVIDIA L40S" datasheet (91.6 FP32, 183 TF32 and 362
    FP16/BF16 dense TFLOPS, 864 GB/s); only the memory and compute capability matter here.
    """
    from memfit.gpus.catalog import GpuSpec
    from memfit.units import GiB

    return GpuSpec("L40S", round(44.42 * GiB / MIB) * MIB, (8, 9), 91.6, 183.0, 362.0, 362.0, 864.0,
                   "44.42 GiB total capacity: stepfun-ai/Step-Video-T2V#8")


@dataclass
class Estimator:
    """memfit estimates, cached per identical setup (the peft records share one base model)."""

    cache: dict[tuple, Any] = field(default_factory=dict)
    runs: int = 0
    seconds: float = 0.0

    def report(self, fields: tuple[tuple[str, Any], ...], *, gpu: str | None = None, **changes: Any):
        """memfit's report for the setup `fields` (with `changes`) on `gpu` (a catalog name; None: the L40S)."""
        from memfit import TrainSetup, estimate

        key = (*sorted({**dict(fields), **changes}.items()), ("gpu", gpu))
        if key not in self.cache:
            kwargs = dict(key[:-1])
            if isinstance(kwargs.get("lora_target_modules"), tuple):
                kwargs["lora_target_modules"] = list(kwargs["lora_target_modules"])
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.cache[key] = estimate(TrainSetup(**kwargs), gpu=gpu or l40s_spec())
            self.seconds += time.perf_counter() - started
            self.runs += 1
        return self.cache[key]


def untied_bytes(report, real_params: int | None, element_bytes: int = 2) -> int:
    """Bytes at memfit's allocated peak that belong to parameters memfit has and the real model
    does not (a tied lm_head built untied), from the breakdown at that peak.

    The extra parameters are `report.params - real_params` (0 when memfit has no more). Their
    weights are always counted; when the model is fully trained, also their gradient (if gradients
    are alive at the peak), two AdamW states (if optimizer state is) and, at an optimizer-step peak,
    the foreach `exp_avg_sq` square root (`_multi_tensor_adamw` in torch/optim/adamw.py).

    Args:
        report: memfit's MemoryReport.
        real_params: the real model's parameter count (None: unknown, 0 returned).
        element_bytes: bytes per parameter element (2 for bf16 weights, gradients and AdamW states).
    """
    if not isinstance(real_params, int) or report.params <= real_params:
        return 0
    delta = report.params - real_params
    count = 1
    if report.trainable_params == report.params:
        b = report.breakdown
        count += (1 if b.get("gradients", 0) >= delta * element_bytes else 0)
        count += (2 if b.get("optimizer_state", 0) >= 2 * delta * element_bytes else 0)
        if report.peak_phase == "optimizer" and b.get("temporaries", 0) >= delta * element_bytes:
            count += 1
    return count * delta * element_bytes


def _implied_length(est: Estimator, case: TrainCase, real_params: int | None) -> str:
    """The padded length at which memfit's peak reserved, less `untied_bytes`, first reaches the
    measured figure (linear between the lengths of IMPLIED_LENGTHS), as text: `~597`, `<= 320`
    (already above at the shortest length tried) or `> 768` (below at all of them)."""
    target = case.measured_mib * MIB
    prev = None
    for length in IMPLIED_LENGTHS:
        report = est.report(case.setup_fields, max_length=length)
        value = report.peak_reserved_bytes - untied_bytes(report, real_params)
        if value >= target:
            if prev is None:
                return f"<= {length}"
            l0, v0 = prev
            return f"~{l0 + (length - l0) * (target - v0) / (value - v0):.0f}"
        prev = (length, value)
    return f"> {IMPLIED_LENGTHS[-1]}"


def predict_train(est: Estimator, case: TrainCase, record: dict[str, Any], records: list[dict[str, Any]],
                  implied: bool) -> tuple[float, str]:
    """memfit's figure for `case` (MiB) and, for a gap above GAP, the mechanisms found.

    Args:
        est: the cached estimator.
        case: what memfit runs for `record`.
        record: the published record.
        records: all records (to find the same experiment measured on another stack).
        implied: also search the padded length at which memfit meets the measurement.
    """
    import torch
    import transformers

    report = est.report(case.setup_fields, gpu=(record.get("memfit") or {}).get("gpu"))
    given_allocated = record.get("source_kind") in _GIVEN_KINDS and record.get("metric") == "allocated"
    predicted = (report.peak_allocated_bytes if given_allocated else report.peak_reserved_bytes) / MIB
    error = predicted / case.measured_mib - 1.0
    if record.get("source_kind") in _GIVEN_KINDS:  # the record says how its run differs from memfit's inputs
        given = record.get("memfit") or {}
        trained = (record.get("extra") or {}).get("num_trainable_params")
        differ = (f"trainable parameters differ: memfit {report.trainable_params:,}, the run {trained:,}; "
                  if isinstance(trained, int) and report.trainable_params != trained else "")
        smi = f"memfit's nvidia-smi figure (device_used_bytes) {report.device_used_bytes / MIB:,.0f} MiB"
        if abs(error) <= GAP:
            return predicted, f"{differ}{smi}"
        return predicted, (f"{differ}{smi}; {given.get('differs', 'not investigated')}; "
                           f"assumed: {given.get('assumed', 'nothing')}")
    fields = dict(case.setup_fields)
    reasons = []
    trained = (record.get("extra") or {}).get("num_trainable_params")
    if isinstance(trained, int) and report.trainable_params != trained:  # peft methods: said at any gap
        reasons.append(f"trainable parameters differ: memfit {report.trainable_params:,}, the run {trained:,}")
    if abs(error) <= GAP:
        return predicted, "; ".join(reasons)
    real_params = (record.get("extra") or {}).get("num_total_params")
    peft_method = "peft_config" in fields or fields.get("use_dora")
    if peft_method:
        reasons += _peft_method_reasons(fields, report)
    over = untied_bytes(report, real_params)
    if over:
        delta = report.params - real_params
        reasons.append(
            f"untied lm_head: memfit has {delta:,} parameters more than the run ({report.params:,} vs "
            f"{real_params:,}; Llama-3.2 ties lm_head to embed_tokens, memfit unties it: "
            f"accelerate.init_empty_weights in models/build.py and Module.to_empty in sim/engine.py): "
            f"{over / MIB:,.0f} MiB at memfit's allocated peak ({over // (2 * delta)} x {2 * delta / MIB:.0f} MiB)")
    if error > 0:
        text = ("dynamic padding: memfit pads every batch to 768 tokens; the run pads length-bucketed batches "
                "to their longest (query+response <= 1300 characters, data.py CHAR_LIMIT)")
        if peft_method:  # the length search (8 estimates of a 3B model each) is run for the LoRA records only
            text += "; the plain LoRA records meet memfit at ~600 padded tokens (rows 41, 46-48)"
        elif implied:
            less = " less the untied bytes" if over else ""
            text += f"; memfit{less} meets the measured figure at {_implied_length(est, case, real_params)} tokens"
        reasons.append(text)
    stack = _era_stack(record)
    installed = torch.__version__.split("+")[0]
    if stack and not stack.startswith(f"torch {installed.rsplit('.', 1)[0]}"):
        newest = [r for r in records if r is not record and r.get("method") == record.get("method")
                  and "reserved_99th_pct_mib" in (r.get("extra") or {})
                  and _era_stack(r).startswith(f"torch {installed.rsplit('.', 1)[0]}")]
        same = (f"; the same experiment measured {newest[0]['extra']['reserved_99th_pct_mib']:,.0f} MiB on "
                f"{_era_stack(newest[0])}" if newest else "")
        reasons.append(f"measured on {stack}; memfit runs the code of torch {installed}, "
                       f"transformers {transformers.__version__}{same}")
    if error < 0:
        reasons.append("memfit replays 2 steps of one length; the run's 99th percentile comes from 5000 steps of "
                       "mixed lengths between empty_cache() calls (fragmentation across lengths not modelled)")
    return predicted, "; ".join(reasons)


def _peft_method_reasons(fields: dict[str, Any], report) -> list[str]:
    """Mechanisms of a peft method's row that memfit knows it models differently from the real run."""
    out = []
    cfg = json.loads(fields["peft_config"]) if "peft_config" in fields else {"peft_type": "LORA", "use_dora": True}
    kind = str(cfg.get("peft_type", "")).upper()
    if kind in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"):
        out.append(f"{cfg.get('num_virtual_tokens')} virtual tokens per sequence: memfit runs 768 + "
                   f"{cfg.get('num_virtual_tokens')} positions, the run its bucket's longest + them")
    if kind == "BOFT":
        out.append("BOFT: on the GPU peft uses its CUDA extension fbd_cuda when it compiles (tuners/boft/layer.py "
                   "`get_fbd_cuda`), memfit the torch.block_diag fallback; the 6 points above the other methods' gap "
                   "are not explained further without a GPU")
    return out


# -- op benchmarks on fake tensors ---------------------------------------------------------------
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype(name: str):
    import torch

    return getattr(torch, _DTYPES.get(name, name))


@contextlib.contextmanager
def _default_dtype(dtype):
    """Modules built in `dtype` directly: the script builds them in fp32 and calls `.to(dtype)`,
    which frees the fp32 copies before anything is measured (and `.to` cannot swap FakeTensor
    parameters the tracker holds weak references to)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def simulate_op(build: Callable[[], dict[str, Any]], step: Callable[[dict[str, Any]], None], *,
                iterations: int = 2, workspace_bytes: int = 0, compute_capability: tuple[int, int] = (8, 0)) -> int:
    """Peak allocated bytes of the last of `iterations` calls of `step`, on fake tensors.

    Args:
        build: creates what the benchmark keeps alive (inputs, modules) inside the tracker; returns it.
        step: one measured iteration (forward and backward).
        iterations: iterations run; the peak of the last one is returned (a peak reset before it).
        workspace_bytes: device memory alive from the start outside the op (cuBLAS workspaces).
        compute_capability: of the emulated GPU (SDPA backend choice; no other op here depends on it).
    """
    from memfit.allocator.caching import replay
    from memfit.sim import _torch_adapter as adapter
    from memfit.sim.autocast import cuda_autocast_policy
    from memfit.sim.cuda_patches import cuda_patches
    from memfit.sim.tracker import StorageTracker

    tracker = StorageTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with adapter.new_fake_mode(), tracker, cuda_patches(compute_capability=compute_capability, sdpa_log=[]), \
                cuda_autocast_policy(None):
            tracker.phase = "setup"
            if workspace_bytes:
                tracker.synthetic_alloc(workspace_bytes, "workspaces")
            state = build()
            for i in range(iterations):
                tracker.phase = f"iteration{i}"
                step(state)
            trace = tracker.trace()
            del state
    report = replay(trace)
    return report.peak_allocated_by_phase[f"iteration{iterations - 1}"]


def _op_cross_entropy(dims: dict[str, Any]):
    """benchmark_cross_entropy.py `bench_memory_cross_entropy`: logits [B*T, V] with requires_grad,
    int64 targets, `CrossEntropyLoss()(logits, target).backward()`."""
    import torch

    def build():
        logits = torch.randn(dims["rows"], dims["vocab"], dtype=_dtype(dims["dtype"]), requires_grad=True)
        target = torch.randint(dims["vocab"], (dims["rows"], 1)).squeeze(1)
        return {"logits": logits, "target": target, "loss": torch.nn.CrossEntropyLoss()}

    def step(s):
        s["loss"](s["logits"], s["target"]).backward()

    return build, step, False


def _op_lm_head_ce(dims: dict[str, Any]):
    """benchmark_fused_linear_cross_entropy.py `bench_memory_fused_linear_cross_entropy`: both the
    torch and the Liger lm-head modules are on the device (a bias-free Linear(H, V) each); the torch
    one runs `CrossEntropyLoss()(lin(x), y).backward()` on x [BT, H] with requires_grad."""
    import torch

    dtype = _dtype(dims["dtype"])
    h, v, bt = dims["hidden"], dims["vocab"], dims["tokens"]

    def build():
        lin = torch.nn.Linear(h, v, bias=False, dtype=dtype)
        other = torch.nn.Linear(h, v, bias=False, dtype=dtype)  # the Liger module's weight, never used here
        x = torch.randn(bt, h, dtype=dtype, requires_grad=True)
        target = torch.randint(v, (bt, 1)).squeeze(1)
        return {"lin": lin, "other": other, "x": x, "target": target, "loss": torch.nn.CrossEntropyLoss()}

    def step(s):
        s["loss"](s["lin"](s["x"]), s["target"]).backward()

    return build, step, True


def _op_rms_norm(dims: dict[str, Any]):
    """benchmark_rms_norm.py `bench_memory_rms_norm`: transformers' LlamaRMSNorm (fp32 weight) and
    LigerRMSNorm (fp32 weight of H) on the device, x [M, H] and dy; `y.backward(dy, retain_graph=True)`."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dtype = _dtype(dims["dtype"])

    def build():
        norm = LlamaRMSNorm(dims["hidden"], eps=1e-6)
        other = torch.nn.Parameter(torch.ones(dims["hidden"]))  # LigerRMSNorm's weight
        x = torch.randn(dims["rows"], dims["hidden"], dtype=dtype)
        dy = torch.randn_like(x)
        x.requires_grad_(True)
        return {"norm": norm, "other": other, "x": x, "dy": dy}

    def step(s):
        s["norm"](s["x"]).backward(s["dy"], retain_graph=True)

    return build, step, False


def _op_geglu_mlp(dims: dict[str, Any]):
    """benchmark_geglu.py `bench_memory_geglu` (mode full): transformers' LlamaMLP with
    hidden_act gelu_pytorch_tanh in bf16, x [bsz, T, H] with requires_grad,
    `y.backward(torch.randn_like(y), retain_graph=True)`."""
    import torch
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    dtype = _dtype(dims["dtype"])
    config = LlamaConfig(hidden_size=dims["hidden"], intermediate_size=dims["intermediate"], hidden_act=dims["act"])

    def build():
        x = torch.randn(dims["batch"], dims["seq"], dims["hidden"], dtype=dtype, requires_grad=True)
        with _default_dtype(dtype):
            layer = LlamaMLP(config)
        return {"layer": layer, "x": x}

    def step(s):
        y = s["layer"](s["x"])
        y.backward(torch.randn_like(y), retain_graph=True)

    return build, step, True


OPS = {"cross_entropy": _op_cross_entropy, "lm_head_ce": _op_lm_head_ce, "rms_norm": _op_rms_norm,
       "geglu_mlp": _op_geglu_mlp}


def predict_op(case: OpCase) -> tuple[float, str]:
    """memfit's peak allocated for the op (MiB) and, for a gap above GAP, what differs."""
    from memfit.gpus.catalog import CATALOG
    from memfit.gpus.outside_pytorch import cublas_workspace_bytes

    build, step, matmul = OPS[case.op](dict(case.dims))
    workspace = 2 * cublas_workspace_bytes(CATALOG["a100-80gb"]) if matmul else 0
    predicted = simulate_op(build, step, workspace_bytes=workspace) / MIB
    error = predicted / case.measured_mib - 1.0
    reason = "" if abs(error) <= GAP else "not investigated"
    return predicted, reason


# -- the run -------------------------------------------------------------------------------------
def run(records: list[dict[str, Any]], *, implied: bool = True) -> tuple[list[Row], list[tuple[int, Missing]], Estimator]:
    from memfit import progress
    from memfit.errors import MemfitError

    est = Estimator()
    rows: list[Row] = []
    missing: list[tuple[int, Missing]] = []
    for index, record in enumerate(records):
        case = express(record)
        progress.report(getattr(case, "label", "not expressible"), index, len(records))
        if isinstance(case, Missing):
            missing.append((index, case))
            continue
        if isinstance(case, TrainCase):
            try:
                predicted, reason = predict_train(est, case, record, records, implied)
            except MemfitError as err:  # a peft method memfit refuses for this model
                missing.append((index, Missing(case.label, f"memfit: {err}")))
                continue
        else:
            predicted, reason = predict_op(case)
        rows.append(Row(index, record.get("source_kind", ""), case.label, case.metric, case.measured_mib,
                        predicted, reason))
    return rows, missing, est


_SOURCE_SHORT = {"peft_method_comparison_json": "peft MetaMathQA", "kernel_microbenchmark": "Liger op bench",
                 "torchtune_readme_table": "torchtune README", "peft_readme_table": "peft README",
                 "peft_readme_log": "peft README log", "ms_swift_example_comment": "ms-swift example",
                 "whisper_peft_readme_table": "Whisper PEFT README", "trl_notebook_output": "TRL notebook",
                 "axolotl_example_readme": "axolotl example", "grpo_probe_jsonl": "GRPO VRAM probe"}


def format_tables(rows: list[Row], missing: list[tuple[int, Missing]], records: list[dict[str, Any]]) -> str:
    out = ["| id | source | measures | metric | measured MiB | predicted MiB | error | reason for a gap > 5 % |",
           "|---:|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r.record_id} | {_SOURCE_SHORT.get(r.source, r.source)} | {r.label} | {r.metric} | "
                   f"{r.measured_mib:,.1f} | {r.predicted_mib:,.1f} | {100 * r.error:+.2f} % | {r.reason or '-'} |")
    out += ["", f"Not expressible yet ({len(missing)} records):", "",
            "| id | source | record | what is missing |", "|---:|---|---|---|"]
    for index, m in missing:
        src = _SOURCE_SHORT.get(records[index].get("source_kind", ""), "")
        out.append(f"| {index} | {src} | {m.label} | {m.missing} |")
    return "\n".join(out)


#: Sources whose every input memfit is given as the run had it: the op benchmarks' tensors have fixed shapes. The
#: training runs' records give the truncation length but not the length of each example, so memfit pads every
#: batch to that maximum (the run padded each batch to its longest example): their error includes that assumption.
_INPUTS_KNOWN = {"kernel_microbenchmark"}


def summary(rows: list[Row]) -> list[str]:
    lines = []
    for known, what in ((True, "inputs fully known (fixed op shapes)"),
                        (False, "data lengths assumed (each batch padded to the configured maximum)")):
        errs = [abs(r.error) for r in rows if (r.source in _INPUTS_KNOWN) == known]
        if errs:
            lines.append(f"{what}: median |error| {statistics.median(errs):.6f}, max {max(errs):.6f} "
                         f"over {len(errs)}")
    by_source: dict[str, list[float]] = {}
    for r in rows:
        by_source.setdefault(_SOURCE_SHORT.get(r.source, r.source), []).append(abs(r.error))
    for source, errs in by_source.items():
        lines.append(f"{source}: median |error| {statistics.median(errs):.6f}, max {max(errs):.6f} over {len(errs)}")
    errs = [abs(r.error) for r in rows]
    median = statistics.median(errs) if errs else float("nan")
    lines.append(f"published_median_abs_error={median:.6f} over {len(rows)} records")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="measurements.json (default: %(default)s)")
    parser.add_argument("--no-implied-length", action="store_true",
                        help="skip the length search behind the dynamic-padding reason (faster)")
    parser.add_argument("--liger-e2e", action="store_true",
                        help="also Liger-Kernel's end-to-end FSDP examples (bench/published_liger.py: 16 simulations "
                             "of 7B-8B models on 4 ranks, about a minute each)")
    parser.add_argument("--multimodal", action="store_true",
                        help="also the vision-language, speech and GRPO records (bench/data/published_multimodal.json)")
    args = parser.parse_args(argv)
    records = load_records(args.data)
    started = time.perf_counter()
    from memfit.commands._progress import progress as terminal_progress

    with terminal_progress("bench/published.py", unit="record"):  # on a terminal: which record, of how many
        rows, missing, est = run(records, implied=not args.no_implied_length)
    print(format_tables(rows, missing, records))
    print()
    print(f"{len(records)} records: {len(rows)} compared, {len(missing)} not expressible; "
          f"{est.runs} memfit estimates ({est.seconds:.0f} s), {time.perf_counter() - started:.0f} s in all")
    for line in summary(rows):
        print(line)
    if args.multimodal:
        media = load_multimodal()
        media_rows, media_missing, media_est = run(media, implied=False)
        print()
        print(f"Vision-language, speech and GRPO records ({MULTIMODAL.name}; id: index in its `records`):")
        print()
        print(format_tables(media_rows, media_missing, media))
        print()
        print(f"{len(media)} records: {len(media_rows)} compared, {len(media_missing)} not expressible; "
              f"{media_est.runs} memfit estimates ({media_est.seconds:.0f} s)")
        for line in summary(media_rows):
            print(line)
    if args.liger_e2e:
        sys.path.insert(0, str(REPO / "bench"))
        import published_liger  # bench/published_liger.py, next to this script

        print()
        print("Liger-Kernel end-to-end examples (examples/huggingface: FSDP1 on 4 A100 80GB, peak allocated per GPU):")
        print()
        print(published_liger.report(published_liger.load_records()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
