"""Ground truth on a real GPU: memfit's predictions next to what CUDA measures.

Run from the repository root (venv active) on a machine with one CUDA GPU:

    python bench/gpu_truth.py --out bench/results/          # the whole matrix (< 8 min on one H200)
    python bench/gpu_truth.py --list                         # the matrix, one line per configuration
    python bench/gpu_truth.py --dry-run                      # no CUDA: the matrix and memfit's predictions
    python bench/gpu_truth.py --configs bert-base-fp32-L128,t5-base-bf16-L128 --timeout 120
    python bench/gpu_truth.py --replay-snapshot bench/results/snapshot-....pickle   # no CUDA needed

What one configuration runs (in a fresh child process, `sys.executable`, so the peaks and the
caching allocator start clean): the model built from memfit's bundled config with
`AutoModelFor<task>.from_config` (random init on the CPU, no download; LoRA via peft as memfit
wraps it), a synthetic dataset of fixed-length int64 examples (input_ids, attention_mask with
the last token padded, token_type_ids where memfit feeds them, labels), and `transformers.Trainer`
itself with

    TrainingArguments(per_device_train_batch_size, gradient_accumulation_steps, max_steps=2,
                      eval_strategy="steps", eval_steps=2, per_device_eval_batch_size,
                      fp16/bf16, optim, gradient_checkpointing, report_to="none",
                      save_strategy="no", logging_strategy="no", dataloader_num_workers=0)

on `2 * batch * accumulation` training and `eval_samples` evaluation examples: exactly the sequence
memfit simulates (memfit.sim.engine: weights to the device, 2 optimizer steps of
`gradient_accumulation_steps` micro-steps, then one evaluation pass). The child records
`torch.cuda.max_memory_allocated()` / `max_memory_reserved()` overall and per phase (peaks reset
with `torch.cuda.reset_peak_memory_stats()` at the phase boundaries: forward = `training_step`
up to the return of `compute_loss`, backward = the rest of `training_step`, optimizer = clipping,
`optimizer.step()` and `zero_grad()` up to `on_step_end`, eval = `Trainer.evaluate`), and the
memory the process holds outside PyTorch (NVML for this pid via nvidia-ml-py when it is installed
and sees the pid, else `torch.cuda.mem_get_info()` used minus reserved).

memfit's prediction of the same setup is computed in the parent, which never touches CUDA, with
the GpuSpec that `memfit.gpus.catalog.resolve_gpu("auto")` returns in a probe child. Compared quantities
(relative error = predicted / measured - 1):

* peak_allocated: `max_memory_allocated()` vs `MemoryReport.peak_allocated_bytes`
* peak_reserved: `max_memory_reserved()` vs `MemoryReport.peak_reserved_bytes`
* device_used: what nvidia-smi shows at the peak, measured as peak reserved + the measured
  non-PyTorch memory, vs `MemoryReport.device_used_bytes`
* per phase (CSV only): peak allocated in forward/backward/optimizer/eval vs `MemoryReport.phases`

One configuration (`--snapshot-config`, default the first of the run) also records the
allocator trace (`torch.cuda.memory._record_memory_history`), saves `torch.cuda.memory._snapshot()`
as a pickle and replays it through `memfit.allocator.snapshot.replay_snapshot`: the model's peak
reserved against the observed one (exact match is the target).

Output: `<out>/gpu_truth-<gpu>-<date>.csv` (one row per configuration, with GPU, driver, CUDA,
torch and transformers versions), `<out>/gpu_truth-<gpu>-<date>.json` (summary) and the last
lines `median_rel_err_peak_allocated=...`, `max_rel_err_...`, `snapshot_replay_reserved_match=...`.
A configuration that fails on the GPU (OOM, a missing bitsandbytes, a timeout) is recorded with
its error and the run goes on. Exit status: 0 when at least one configuration was measured.

Known limitations:

* fp16 runs use GradScaler(init_scale=2**16) as accelerate builds it; on random weights a step can
  overflow and be skipped, so the optimizer state may be created one step later (the
  `optimizer_steps_skipped` column says so; the peak usually still comes from the step that runs).
* Trainer prefetches all micro-batches of an optimizer step to the device (`get_batch_samples`);
  memfit holds one micro-batch at a time. A few KiB for these batch sizes.
* `device_used` relies on the non-PyTorch measurement; `mem_get_info` counts every process on
  the GPU, so run nothing else on it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("forward", "backward", "optimizer", "eval")
QUANTITIES = ("peak_allocated", "peak_reserved", "device_used")
SNAPSHOT_MAX_ENTRIES = 2_000_000


# -- the matrix ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    name: str
    model: str
    task: str
    batch: int
    max_length: int
    precision: str = "fp32"
    optim: str = "adamw_torch_fused"
    gradient_checkpointing: bool = False
    lora_r: int | None = None
    gradient_accumulation_steps: int = 1
    eval_batch: int | None = None  # None: same as batch
    eval_samples: int | None = None  # None: 2 eval batches
    weights_dtype: str = "auto"
    needs: tuple[str, ...] = ()  # importable modules the run needs (bitsandbytes)

    @property
    def per_device_eval_batch_size(self) -> int:
        return self.eval_batch or self.batch

    @property
    def n_eval(self) -> int:
        return self.eval_samples or 2 * self.per_device_eval_batch_size

    @property
    def n_train(self) -> int:
        return 2 * self.batch * self.gradient_accumulation_steps

    def setup_fields(self) -> dict[str, Any]:
        """The memfit TrainSetup of this configuration, field for field."""
        return dict(
            model=self.model, task=self.task, num_labels=2, per_device_train_batch_size=self.batch,
            per_device_eval_batch_size=self.per_device_eval_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps, max_length=self.max_length,
            precision=self.precision, weights_dtype=self.weights_dtype, optim=self.optim,
            gradient_checkpointing=self.gradient_checkpointing, lora_r=self.lora_r,
            eval_strategy="epoch", eval_samples=self.n_eval,
        )

    def describe(self) -> str:
        parts = [f"{self.model} {self.task}", f"bs={self.batch}", f"L={self.max_length}", self.precision,
                 self.optim]
        if self.gradient_accumulation_steps > 1:
            parts.append(f"ga={self.gradient_accumulation_steps}")
        if self.gradient_checkpointing:
            parts.append("grad-ckpt")
        if self.lora_r:
            parts.append(f"lora r={self.lora_r}")
        if self.weights_dtype != "auto":
            parts.append(f"weights={self.weights_dtype}")
        parts.append(f"eval bs={self.per_device_eval_batch_size} n={self.n_eval}")
        return ", ".join(parts)


MATRIX: tuple[Config, ...] = (
    Config("bert-base-fp32-L128", "bert-base-uncased", "seq-cls", 16, 128),
    Config("bert-base-fp16-L512", "bert-base-uncased", "seq-cls", 8, 512, "fp16"),
    Config("bert-base-bf16-gc-L512", "bert-base-uncased", "seq-cls", 8, 512, "bf16", gradient_checkpointing=True),
    Config("roberta-large-fp16-adafactor-L128", "roberta-large", "seq-cls", 8, 128, "fp16", "adafactor"),
    Config("roberta-large-tokcls-bf16-ga2-L512", "roberta-large", "token-cls", 4, 512, "bf16",
           gradient_accumulation_steps=2),
    Config("xlnet-large-fp32-L128", "xlnet-large-cased", "seq-cls", 4, 128),
    Config("xlnet-large-bf16-L512", "xlnet-large-cased", "seq-cls", 2, 512, "bf16"),
    Config("gpt2-medium-clm-fp16-L512", "gpt2-medium", "causal-lm", 4, 512, "fp16", eval_batch=2, eval_samples=4),
    Config("gpt2-medium-clm-bf16-gc-adafactor-L512", "gpt2-medium", "causal-lm", 4, 512, "bf16", "adafactor",
           gradient_checkpointing=True, eval_batch=2, eval_samples=4),
    Config("gpt2-medium-clm-lora-fp32-L128", "gpt2-medium", "causal-lm", 8, 128, lora_r=8, eval_batch=4,
           eval_samples=8),
    Config("t5-base-s2s-bf16-L128", "t5-base", "seq2seq-lm", 8, 128, "bf16", eval_batch=4, eval_samples=8),
    Config("t5-base-s2s-fp32-gc-adafactor-L512", "t5-base", "seq2seq-lm", 4, 512, "fp32", "adafactor",
           gradient_checkpointing=True, eval_batch=2, eval_samples=4),
    Config("llama-3.2-1b-clm-bf16-L512", "meta-llama/Llama-3.2-1B", "causal-lm", 2, 512, "bf16",
           eval_batch=1, eval_samples=2),
    Config("llama-3.2-1b-clm-lora-gc-bf16-L512", "meta-llama/Llama-3.2-1B", "causal-lm", 4, 512, "bf16",
           gradient_checkpointing=True, lora_r=16, eval_batch=1, eval_samples=2),
    Config("tinyllama-clm-fp32w-bf16-L128", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "causal-lm", 2, 128, "bf16",
           weights_dtype="fp32", eval_batch=1, eval_samples=2),
    Config("llama-3.2-1b-clm-bnb8bit-bf16-L128", "meta-llama/Llama-3.2-1B", "causal-lm", 2, 128, "bf16",
           "adamw_bnb_8bit", eval_batch=1, eval_samples=2, needs=("bitsandbytes",)),
)
BY_NAME = {c.name: c for c in MATRIX}


def _missing(config: Config) -> list[str]:
    import importlib.util

    return [m for m in config.needs if importlib.util.find_spec(m) is None]


# -- child: one configuration on CUDA ------------------------------------------------------------
class _PhaseMeter:
    """Peak allocated / reserved per phase: `reset_peak_memory_stats` at each boundary."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.current = "setup"
        self.allocated: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        torch.cuda.reset_peak_memory_stats()

    def switch(self, phase: str) -> None:
        cuda = self.torch.cuda
        cuda.synchronize()
        a, r = int(cuda.max_memory_allocated()), int(cuda.max_memory_reserved())
        self.allocated[self.current] = max(self.allocated.get(self.current, 0), a)
        self.reserved[self.current] = max(self.reserved.get(self.current, 0), r)
        cuda.reset_peak_memory_stats()
        self.current = phase


def _build_model(cfg: Config):
    """The task model as memfit builds it (memfit.models.build.build_meta_model), but real, on the CPU."""
    import torch
    import transformers

    from memfit.models.build import resolve_config
    from memfit.train_setup import TASKS

    config = resolve_config(cfg.model).config
    if cfg.task in ("seq-cls", "token-cls"):
        config.num_labels = 2
    if getattr(config, "pad_token_id", None) is None and cfg.task == "seq-cls":
        config.pad_token_id = 0
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    dtype = dtypes.get(cfg.weights_dtype)
    if cfg.weights_dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float32)
    auto = getattr(transformers, TASKS[cfg.task])
    model = auto.from_config(config, dtype=dtype)
    if cfg.lora_r is not None:
        from peft import LoraConfig, get_peft_model

        task_type = {"seq-cls": "SEQ_CLS", "token-cls": "TOKEN_CLS", "qa": "QUESTION_ANS",
                     "causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}.get(cfg.task)
        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=16, lora_dropout=0.0,
                                                 task_type=task_type))
    return model, config


class _Synthetic:
    """Fixed-length examples; the last token of each is padding (memfit pads its batch the same way)."""

    def __init__(self, n: int, cfg: Config, config) -> None:
        import torch

        self.n = n
        seq = cfg.max_length
        mask = torch.ones(seq, dtype=torch.long)
        mask[-1] = 0
        ex = {"input_ids": torch.zeros(seq, dtype=torch.long), "attention_mask": mask}
        model_type = getattr(config, "model_type", "")
        if getattr(config, "type_vocab_size", 0) > 1 or model_type == "xlnet":
            ex["token_type_ids"] = torch.zeros(seq, dtype=torch.long)
        if cfg.task == "seq-cls":
            ex["labels"] = torch.tensor(0, dtype=torch.long)
        else:  # token-cls, causal-lm, seq2seq-lm (target_length = max_length)
            ex["labels"] = torch.zeros(seq, dtype=torch.long)
        self.example = ex

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {k: v.clone() for k, v in self.example.items()}


def run_child(cfg: Config, snapshot_path: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "error", "error": None}
    try:
        import torch
    except Exception as err:  # pragma: no cover
        return {**out, "error": f"import torch: {err}"}
    if not torch.cuda.is_available():
        return {**out, "error": "no CUDA GPU in the child"}
    missing = _missing(cfg)
    if missing:
        return {**out, "status": "skipped", "error": f"{', '.join(missing)} not installed"}
    meter = None
    try:
        from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

        torch.cuda.init()
        torch.cuda.set_device(0)
        recording = False
        if snapshot_path:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=SNAPSHOT_MAX_ENTRIES)
            recording = True
        started = time.perf_counter()
        model, config = _build_model(cfg)
        out["build_s"] = round(time.perf_counter() - started, 2)
        tmp = tempfile.mkdtemp(prefix="gpu_truth-")
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=cfg.batch,
            per_device_eval_batch_size=cfg.per_device_eval_batch_size,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps, max_steps=2,
            eval_strategy="steps", eval_steps=2, fp16=cfg.precision == "fp16", bf16=cfg.precision == "bf16",
            optim=cfg.optim, gradient_checkpointing=cfg.gradient_checkpointing, report_to="none",
            save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
        )
        meter = _PhaseMeter(torch)
        skipped = {"n": 0}

        class Meter(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                opt = kw.get("optimizer")
                if getattr(opt, "step_was_skipped", False):
                    skipped["n"] += 1
                meter.switch("between")

        class MeteredTrainer(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                meter.switch("forward")
                try:
                    return super().training_step(model, inputs, num_items_in_batch)
                finally:
                    meter.switch("optimizer")  # clip, step, zero_grad (a gap before the next micro-step)

            def compute_loss(self, model, inputs, *a, **kw):
                result = super().compute_loss(model, inputs, *a, **kw)
                if model.training and torch.is_grad_enabled():
                    meter.switch("backward")
                return result

            def evaluate(self, *a, **kw):
                meter.switch("eval")
                try:
                    return super().evaluate(*a, **kw)
                finally:
                    meter.switch("after")

        trainer = MeteredTrainer(
            model=model, args=args, train_dataset=_Synthetic(cfg.n_train, cfg, config),
            eval_dataset=_Synthetic(cfg.n_eval, cfg, config), data_collator=default_data_collator,
            callbacks=[Meter()],
        )
        t0 = time.perf_counter()
        trainer.train()
        torch.cuda.synchronize()
        out["train_s"] = round(time.perf_counter() - t0, 2)
        meter.switch("end")
        out["optimizer_steps_skipped"] = skipped["n"]
        out["optimizer_state_tensors"] = sum(
            1 for s in trainer.optimizer.state.values() for v in (s.values() if isinstance(s, dict) else [])
            if torch.is_tensor(v))
        if recording:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            entries = len(snap.get("device_traces", [[]])[0])
            out["snapshot_entries"] = entries
            out["snapshot_truncated"] = entries >= SNAPSHOT_MAX_ENTRIES
            with open(snapshot_path, "wb") as fh:
                pickle.dump(snap, fh)
            out["snapshot_path"] = snapshot_path
        out["status"] = "ok"
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
        out["traceback"] = traceback.format_exc()[-2000:]
        if meter is not None:
            try:
                meter.switch("error")
            except Exception:
                pass
    if meter is not None:
        phases_a = {p: meter.allocated.get(p) for p in PHASES}
        phases_r = {p: meter.reserved.get(p) for p in PHASES}
        out["phases_allocated"] = phases_a
        out["phases_reserved"] = phases_r
        out["setup_allocated"] = meter.allocated.get("setup")
        out["peak_allocated"] = max(meter.allocated.values(), default=0)
        out["peak_reserved"] = max(meter.reserved.values(), default=0)
    try:
        out.update(_device_memory(torch))
        if out.get("peak_reserved") is not None and out.get("non_pytorch") is not None:
            out["device_used"] = out["peak_reserved"] + out["non_pytorch"]
    except Exception as err:
        out["device_memory_error"] = repr(err)
    return out


def _device_memory(torch) -> dict[str, Any]:
    """This process's GPU memory at the end: NVML for this pid, else mem_get_info (device-wide)."""
    reserved = int(torch.cuda.memory_reserved())
    res: dict[str, Any] = {"reserved_end": reserved}
    try:
        from memfit.gpus.outside_pytorch import measure_non_pytorch_bytes

        non_pt = measure_non_pytorch_bytes(0)
    except Exception:
        non_pt = None
    if non_pt is not None:
        res.update(non_pytorch=int(non_pt), used_end=int(non_pt) + reserved, used_method="nvml-pid")
        return res
    free, total = torch.cuda.mem_get_info()
    used = int(total - free)
    res.update(non_pytorch=used - reserved, used_end=used, used_method="mem_get_info")
    return res


# -- probe child: what GPU, which versions -------------------------------------------------------
def run_probe() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "cuda": torch.version.cuda, "python": platform.python_version(),
                            "cuda_available": torch.cuda.is_available()}
    for mod in ("peft", "accelerate", "bitsandbytes"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    if not info["cuda_available"]:
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(gpu_name=props.name, total_memory=int(props.total_memory),
                compute_capability=[props.major, props.minor], device_count=torch.cuda.device_count())
    info["driver"] = _driver_version()
    from memfit.gpus.catalog import resolve_gpu

    info["gpu_spec"] = dataclasses.asdict(resolve_gpu("auto"))
    return info


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except Exception:
        return None


def _spec_from(d: dict[str, Any]):
    from memfit.gpus.catalog import GpuSpec

    d = dict(d)
    d["compute_capability"] = tuple(d["compute_capability"])
    d["notes"] = tuple(d.get("notes") or ())
    return GpuSpec(**d)


def _spawn(argv: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run this script as a child; return its JSON result (None if it wrote none) and its output tail."""
    fd, result = tempfile.mkstemp(prefix="gpu_truth-", suffix=".json")
    os.close(fd)
    os.unlink(result)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--result", result]
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        tail = (proc.stdout + proc.stderr)[-3000:]
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        tail = f"timeout after {timeout:.0f} s (--timeout)"
        rc = None
    data = None
    if os.path.exists(result):
        try:
            with open(result) as fh:
                data = json.load(fh)
        finally:
            os.unlink(result)
    if data is None:
        data = {"status": "error", "error": tail.strip().splitlines()[-1] if rc is not None and tail.strip()
                else tail}
        if rc is not None:
            data["error"] = f"child exited {rc}: {data['error']}"
    return data, tail


# -- predictions ---------------------------------------------------------------------------------
def predict(cfg: Config, gpu) -> dict[str, Any]:
    from memfit import TrainSetup, estimate

    t0 = time.perf_counter()
    try:
        r = estimate(TrainSetup(**cfg.setup_fields()), gpu=gpu)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
    return {
        "peak_allocated": r.peak_allocated_bytes, "peak_reserved": r.peak_reserved_bytes,
        "device_used": r.device_used_bytes, "non_pytorch": r.non_pytorch_bytes,
        "phases_allocated": {p: r.phases.get(p) for p in PHASES},
        "phases_reserved": {p: r.reserved_by_phase.get(p) for p in PHASES},
        "peak_phase": r.peak_phase, "fits": r.fits, "params": r.params, "trainable_params": r.trainable_params,
        "checkpointing": r.checkpointing, "elapsed_s": round(time.perf_counter() - t0, 2),
    }


def _rel(pred: Any, meas: Any) -> float | None:
    if not isinstance(pred, (int, float)) or not isinstance(meas, (int, float)) or meas <= 0:
        return None
    return pred / meas - 1.0


def _gib(n: Any) -> str:
    return "-" if not isinstance(n, (int, float)) else f"{n / 2**30:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


# -- snapshot replay -----------------------------------------------------------------------------
def replay_snapshot(path: str, measured_peak_reserved: int | None = None) -> dict[str, Any]:
    from memfit.allocator import snapshot

    snap = snapshot.load_snapshot(path)  # refuses every global: a pickle can run code
    rep = snapshot.replay_snapshot(snap)
    model = rep.report.peak_reserved_bytes
    observed = rep.observed_peak_reserved_bytes
    res = {
        "snapshot": path, "model_peak_reserved": model, "observed_peak_reserved": observed,
        "measured_max_memory_reserved": measured_peak_reserved,
        "model_peak_allocated": rep.report.peak_allocated_bytes,
        "model_num_cudamalloc": rep.report.num_cudamalloc, "observed_num_cudamalloc": rep.observed_num_cudamalloc,
        "match": model == observed, "rel_err": _rel(model, observed),
    }
    print(f"snapshot replay ({os.path.basename(path)}): model peak reserved {model} B, observed {observed} B"
          + (f", max_memory_reserved {measured_peak_reserved} B" if measured_peak_reserved is not None else "")
          + f"; cudaMalloc model {rep.report.num_cudamalloc} / observed {rep.observed_num_cudamalloc}"
          + f"; match={res['match']}")
    return res


# -- main ----------------------------------------------------------------------------------------
def _select(text: str | None) -> list[Config]:
    if not text:
        return list(MATRIX)
    chosen = []
    for name in [n.strip() for n in text.split(",") if n.strip()]:
        if name in BY_NAME:
            chosen.append(BY_NAME[name])
            continue
        hits = [c for c in MATRIX if name in c.name]
        if not hits:
            sys.exit(f"gpu_truth: no configuration matches `{name}`; `--list` shows the names")
        chosen += [c for c in hits if c not in chosen]
    return chosen


def _print_list(configs: list[Config]) -> None:
    width = max(len(c.name) for c in configs)
    for c in configs:
        note = ""
        missing = _missing(c)
        if missing:
            note = f"  [{', '.join(missing)} not installed: skipped on the GPU]"
        print(f"{c.name:<{width}}  {c.describe()}{note}")


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for q in QUANTITIES:
        errs = [abs(r[f"rel_err_{q}"]) for r in rows if r.get(f"rel_err_{q}") is not None]
        out[f"median_rel_err_{q}"] = statistics.median(errs) if errs else None
        out[f"max_rel_err_{q}"] = max(errs) if errs else None
        out[f"n_{q}"] = len(errs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"), help="folder for the CSV/JSON/snapshot")
    ap.add_argument("--configs", help="comma-separated names (or substrings) of configurations; default all")
    ap.add_argument("--list", action="store_true", help="print the matrix and exit")
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: print the matrix and memfit's predictions")
    ap.add_argument("--gpu", default=None, help="GPU for the predictions (default: auto on a GPU, H200 for --dry-run)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per child process (default 240)")
    ap.add_argument("--snapshot-config", default=None,
                    help="configuration whose allocator trace is recorded and replayed (default: the first "
                         "selected); `none` to skip")
    ap.add_argument("--replay-snapshot", metavar="PICKLE", help="replay a saved snapshot through memfit and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--snapshot-path", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.child or a.probe:
        data = run_probe() if a.probe else run_child(BY_NAME[a.child], a.snapshot_path)
        with open(a.result, "w") as fh:
            json.dump(data, fh)
        return 0

    configs = _select(a.configs)
    if a.list:
        _print_list(configs)
        return 0
    if a.replay_snapshot:
        res = replay_snapshot(a.replay_snapshot)
        print(f"snapshot_replay_reserved_match={res['match']}")
        return 0

    # the parent never touches CUDA: the probe child says what GPU this is
    env: dict[str, Any] = {}
    if not a.dry_run:
        probe, tail = _spawn(["--probe"], timeout=max(a.timeout, 120))
        if not probe.get("cuda_available"):
            reason = probe.get("error") or "torch.cuda.is_available() is False"
            print(f"gpu_truth: a CUDA GPU is needed to measure ground truth ({reason}); "
                  "use --dry-run to see the matrix and memfit's predictions without one", file=sys.stderr)
            return 2
        env = probe
        gpu = _spec_from(probe["gpu_spec"]) if a.gpu is None else a.gpu
    else:
        import torch
        import transformers

        env = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
               "gpu_name": None, "driver": None}
        gpu = a.gpu or "H200"
    from memfit.gpus.catalog import resolve_gpu

    spec = resolve_gpu(gpu) if isinstance(gpu, str) else gpu
    mode = "dry run (no CUDA)" if a.dry_run else f"GPU {env.get('gpu_name')}"
    print(f"gpu_truth: {len(configs)} configurations, {mode}; predictions for {spec.name} "
          f"({spec.total_bytes / 2**30:.2f} GiB, cc {spec.compute_capability[0]}.{spec.compute_capability[1]}); "
          f"torch {env.get('torch')}, transformers {env.get('transformers')}, CUDA {env.get('cuda')}, "
          f"driver {env.get('driver')}")

    snap_name = None
    if not a.dry_run and (a.snapshot_config or "").lower() != "none":
        snap_name = a.snapshot_config or next((c.name for c in configs if not _missing(c)), None)
        if snap_name not in BY_NAME:
            sys.exit(f"gpu_truth: --snapshot-config `{snap_name}` is not a configuration name")
    os.makedirs(a.out, exist_ok=True)
    date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    gpu_tag = (env.get("gpu_name") or spec.name).replace(" ", "-").replace("/", "-")

    rows: list[dict[str, Any]] = []
    header = (f"{'config':<40} {'status':<7} {'alloc GiB meas/pred':>20} {'err':>7} {'resv GiB meas/pred':>20} "
              f"{'err':>7} {'used GiB meas/pred':>20} {'err':>7} {'s':>5}")
    if not a.dry_run:
        print(header)
    started_all = time.perf_counter()
    snapshot_result: dict[str, Any] | None = None
    for cfg in configs:
        pred = predict(cfg, spec)
        row: dict[str, Any] = {
            "gpu_name": env.get("gpu_name"), "gpu_total_bytes": env.get("total_memory"), "driver": env.get("driver"),
            "cuda": env.get("cuda"), "torch": env.get("torch"), "transformers": env.get("transformers"),
            "peft": env.get("peft"), "accelerate": env.get("accelerate"), "bitsandbytes": env.get("bitsandbytes"),
            "memfit_gpu": spec.name, "config": cfg.name,
            **{k: v for k, v in cfg.setup_fields().items()}, "predict_s": pred.get("elapsed_s"),
            "predict_error": pred.get("error"),
        }
        for q in QUANTITIES + ("non_pytorch",):
            row[f"pred_{q}"] = pred.get(q)
        for p in PHASES:
            row[f"pred_{p}_allocated"] = (pred.get("phases_allocated") or {}).get(p)
            row[f"pred_{p}_reserved"] = (pred.get("phases_reserved") or {}).get(p)
        meas: dict[str, Any] = {}
        t0 = time.perf_counter()
        if a.dry_run:
            missing = _missing(cfg)
            row["status"] = "dry-run"
            row["error"] = f"{', '.join(missing)} not installed here: would be skipped on the GPU" if missing else None
        else:
            missing = _missing(cfg)
            if missing:
                meas = {"status": "skipped", "error": f"{', '.join(missing)} not installed"}
            else:
                argv_child = ["--child", cfg.name]
                snap_path = None
                if cfg.name == snap_name:
                    snap_path = os.path.abspath(os.path.join(a.out, f"snapshot-{gpu_tag}-{date}-{cfg.name}.pickle"))
                    argv_child += ["--snapshot-path", snap_path]
                meas, tail = _spawn(argv_child, timeout=a.timeout)
                if meas.get("status") != "ok" and meas.get("traceback"):
                    print(meas["traceback"].rstrip()[-1200:], file=sys.stderr)
            row["status"] = meas.get("status", "error")
            row["error"] = meas.get("error")
            for q in QUANTITIES + ("non_pytorch",):
                row[f"meas_{q}"] = meas.get(q)
            row["meas_used_end"] = meas.get("used_end")
            row["meas_used_method"] = meas.get("used_method")
            row["meas_setup_allocated"] = meas.get("setup_allocated")
            for p in PHASES:
                row[f"meas_{p}_allocated"] = (meas.get("phases_allocated") or {}).get(p)
                row[f"meas_{p}_reserved"] = (meas.get("phases_reserved") or {}).get(p)
            row["optimizer_steps_skipped"] = meas.get("optimizer_steps_skipped")
            row["optimizer_state_tensors"] = meas.get("optimizer_state_tensors")
            row["build_s"] = meas.get("build_s")
            row["train_s"] = meas.get("train_s")
            ok = row["status"] == "ok"
            for q in QUANTITIES + ("non_pytorch",):
                row[f"rel_err_{q}"] = _rel(row[f"pred_{q}"], row[f"meas_{q}"]) if ok else None
            for p in PHASES:
                row[f"rel_err_{p}_allocated"] = (_rel(row[f"pred_{p}_allocated"], row[f"meas_{p}_allocated"])
                                                 if ok else None)
            if ok and meas.get("snapshot_path"):
                try:
                    snapshot_result = replay_snapshot(meas["snapshot_path"], meas.get("peak_reserved"))
                    snapshot_result["config"] = cfg.name
                    snapshot_result["truncated"] = meas.get("snapshot_truncated")
                except Exception as err:
                    snapshot_result = {"config": cfg.name, "error": f"{type(err).__name__}: {err}", "match": None}
                    print(f"snapshot replay failed: {snapshot_result['error']}", file=sys.stderr)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        if a.dry_run:
            ph = " ".join(f"{p[:3]}={_gib(row[f'pred_{p}_allocated'])}" for p in PHASES)
            err = f"  ERROR {row['predict_error']}" if row["predict_error"] else ""
            note = f"  ({row['error']})" if row.get("error") else ""
            print(f"{cfg.name:<40} pred alloc {_gib(row['pred_peak_allocated'])} GiB, reserved "
                  f"{_gib(row['pred_peak_reserved'])} GiB, device used {_gib(row['pred_device_used'])} GiB "
                  f"[{ph}] {row['predict_s']} s{err}{note}", flush=True)
        else:
            cells = []
            for q in QUANTITIES:
                cells.append(f"{_gib(row.get(f'meas_{q}')) + '/' + _gib(row.get(f'pred_{q}')):>20} "
                             f"{_pct(row.get(f'rel_err_{q}')):>7}")
            print(f"{cfg.name:<40} {row['status']:<7} {' '.join(cells)} {row['wall_s']:>5}"
                  + (f"  {row['error']}" if row.get("error") else ""), flush=True)

    summary = _summary(rows) if not a.dry_run else {}
    summary.update(
        date=date, dry_run=a.dry_run, gpu_name=env.get("gpu_name"), driver=env.get("driver"), cuda=env.get("cuda"),
        torch=env.get("torch"), transformers=env.get("transformers"), memfit_gpu=spec.name,
        n_configs=len(rows), n_ok=sum(r["status"] == "ok" for r in rows),
        n_failed=sum(r["status"] == "error" for r in rows), n_skipped=sum(r["status"] == "skipped" for r in rows),
        failed={r["config"]: r["error"] for r in rows if r["status"] in ("error", "skipped")},
        snapshot_replay=snapshot_result, total_s=round(time.perf_counter() - started_all, 1),
    )
    suffix = "-dry-run" if a.dry_run else ""
    base = os.path.join(a.out, f"gpu_truth-{gpu_tag}-{date}{suffix}")
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(base + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()})
    with open(base + ".json", "w") as fh:
        json.dump(summary, fh, indent=2, default=str)
    print(f"wrote {base}.csv and {base}.json ({summary['total_s']} s)")
    if a.dry_run:
        failed = [r["config"] for r in rows if r["predict_error"]]
        print(f"dry_run_configs={len(rows)} prediction_errors={len(failed)}" + (f" ({', '.join(failed)})" if failed else ""))
        return 1 if failed else 0
    for q in QUANTITIES:
        m, x = summary[f"median_rel_err_{q}"], summary[f"max_rel_err_{q}"]
        print(f"median_rel_err_{q}={'nan' if m is None else f'{m:.4f}'}")
        print(f"max_rel_err_{q}={'nan' if x is None else f'{x:.4f}'}")
    match = None if snapshot_result is None else snapshot_result.get("match")
    print(f"snapshot_replay_reserved_match={'n/a' if match is None else match}")
    print(f"configs_ok={summary['n_ok']} failed={summary['n_failed']} skipped={summary['n_skipped']}")
    return 0 if summary["n_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
