"""`memfit.estimate(setup) -> MemoryReport`: peak GPU memory of a fine-tuning run.

Simulates the run (memfit.sim.engine), reduces the trace to peaks per phase and the
breakdown at the peak (memfit.peaks), replays it through the caching-allocator model
(memfit.allocator.caching) and adds memory held outside PyTorch (memfit.gpus.outside_pytorch) to say what
`nvidia-smi` would show and whether the run fits the GPU.

    from memfit import TrainSetup, estimate
    report = estimate(TrainSetup(model="xlnet-large-cased", per_device_train_batch_size=1), gpu="V100-16GB")
    print(report.peak_reserved_bytes, report.fits)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from memfit.allocator.conf import AllocConf, alloc_conf_from_env, parse_alloc_conf
from memfit.allocator.caching import replay
from memfit.errors import MemfitError
from memfit.gpus.catalog import GpuSpec, as_gpu_spec
from memfit.gpus.outside_pytorch import cublas_workspace_bytes
from memfit.gpus.outside_pytorch import non_pytorch_bytes as _non_pytorch_table
from memfit.peaks import BREAKDOWN_KEYS, peaks
from memfit.sim.engine import simulate
from memfit.trace import TraceEvent
from memfit.train_setup import TrainSetup

__all__ = ["MemoryReport", "OomPrediction", "estimate", "REPORT_PHASES"]

REPORT_PHASES = ("forward", "backward", "optimizer", "eval")


@dataclass(frozen=True)
class OomPrediction:
    """Where the allocator model runs out of memory, and what PyTorch would print."""

    phase: str
    category: str
    tried_to_allocate_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    message: str


@dataclass(frozen=True)
class MemoryReport:
    """Peak memory of one fine-tuning setup. All sizes in bytes."""

    model: str
    model_type: str
    task: str
    params: int
    trainable_params: int
    peak_allocated_bytes: int
    """`torch.cuda.max_memory_allocated()`: live tensor bytes, each rounded up to 512."""
    peak_phase: str
    phases: dict[str, int]
    """Peak allocated bytes within each phase (forward, backward, optimizer, eval)."""
    breakdown: dict[str, int]
    """Bytes by category at the overall allocated peak."""
    phase_breakdowns: dict[str, dict[str, int]]
    peak_reserved_bytes: int
    """`torch.cuda.max_memory_reserved()` by the caching-allocator model."""
    reserved_by_phase: dict[str, int]
    fragmentation_at_peak_bytes: int
    non_pytorch_bytes: int
    """CUDA context, kernels and libraries (estimate; measured by NVML on a GPU)."""
    device_used_bytes: int
    """What `nvidia-smi` would show for this process at the peak: reserved + non-PyTorch."""
    gpu: dict[str, Any] | None
    fits: bool | None
    oom: OomPrediction | None
    checkpointing: str | None
    sdpa_backends: list[str]
    alloc_conf: str
    notes: list[str]
    setup: dict[str, Any]
    elapsed_s: float
    trace: list[TraceEvent] = field(repr=False, compare=False, default_factory=list)

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.gpu is None else self.gpu["total_bytes"] - self.device_used_bytes

    def to_json(self) -> dict[str, Any]:
        """The stable `--json` schema (documented in README.md, "JSON output")."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "trace"}
        out["oom"] = None if self.oom is None else dataclasses.asdict(self.oom)
        out["headroom_bytes"] = self.headroom_bytes
        out["schema"] = "memfit.estimate/1"
        return out


def _setup_json(setup: TrainSetup) -> dict[str, Any]:
    data = {}
    for f in dataclasses.fields(setup):
        value = getattr(setup, f.name)
        if f.name == "model" and not isinstance(value, str):
            value = getattr(value, "_name_or_path", None) or type(value).__name__
        if f.name == "example_lengths" and value is not None:
            value = {"count": len(value), "max": max(value)}
        if isinstance(value, tuple):
            value = list(value)
        data[f.name] = value
    data["sequence_length"] = setup.sequence_length
    data["effective_batch_size"] = setup.effective_batch_size
    return data


def _with_workspaces(trace: list[TraceEvent], workspace_bytes: int) -> list[TraceEvent]:
    """Add the cuBLAS workspaces: allocated through the caching allocator at the first matmul of
    the forward and, on the autograd thread's own handle, of the backward; kept for the process
    lifetime (aten/src/ATen/cuda/CublasHandlePool.cpp `getCurrentCUDABlasHandle`/`getNewWorkspace`)."""
    if workspace_bytes <= 0:
        return trace
    out: list[TraceEvent] = []
    next_id = max((e.id for e in trace), default=0) + 1
    added = set()
    for ev in trace:
        if ev.phase in ("forward", "backward") and ev.phase not in added:
            out.append(TraceEvent("alloc", next_id, workspace_bytes, "workspaces", ev.phase, "cublas workspace"))
            next_id += 1
            added.add(ev.phase)
        out.append(ev)
    return out


def estimate(
    setup: TrainSetup | str | None = None,
    *,
    gpu: str | GpuSpec | None = None,
    alloc_conf: str | AllocConf | None = None,
    non_pytorch_bytes: int | None = None,
    **fields: Any,
) -> MemoryReport:
    """Simulate `setup` (or `TrainSetup(**fields)`, or `TrainSetup(model=setup, **fields)` for a
    model id) and report its peak memory.

    `gpu`: a catalog name (`V100-16GB`), a size (`16GiB`), `auto`, or a GpuSpec; None
    leaves `fits` unknown. `alloc_conf`: PYTORCH_CUDA_ALLOC_CONF text; None reads the
    environment as PyTorch does. `non_pytorch_bytes`: memory outside PyTorch's cache when it
    is known (measured, or read from an OOM message) instead of memfit's table.
    """
    started = time.perf_counter()
    if setup is None:
        setup = TrainSetup(**fields)
    elif isinstance(setup, str):  # a model id: estimate("bert-base-uncased", per_device_train_batch_size=4)
        setup = TrainSetup(model=setup, **fields)
    elif not isinstance(setup, TrainSetup):
        raise MemfitError(f"setup `{type(setup).__name__}` is not a TrainSetup; pass TrainSetup(...), "
                          "TrainSetup.from_kwargs(model, training_args={...}) or a model id")
    elif fields:
        setup = setup.replace(**fields)
    spec = as_gpu_spec(gpu)
    if spec is not None and tuple(setup.compute_capability) != tuple(spec.compute_capability):
        setup = setup.replace(compute_capability=tuple(spec.compute_capability))
    if alloc_conf is None:
        import os

        conf = alloc_conf_from_env(os.environ)
    elif isinstance(alloc_conf, str):
        conf = parse_alloc_conf(alloc_conf)
    else:
        conf = alloc_conf
    sim = simulate(setup)
    notes = list(sim.notes)
    trace = sim.trace
    workspace = cublas_workspace_bytes(spec) if spec is not None else 0
    trace = _with_workspaces(trace, workspace)
    tp = peaks(trace)
    if non_pytorch_bytes is None and isinstance(gpu, str) and gpu.strip().lower() == "auto":
        from memfit.gpus.outside_pytorch import measure_non_pytorch_bytes

        non_pytorch_bytes = measure_non_pytorch_bytes()  # None without a GPU or NVML
        if non_pytorch_bytes is not None:
            notes.append("memory outside PyTorch measured by NVML in this process (context and loaded kernels)")
    np_est = _non_pytorch_table(spec) if spec is not None and non_pytorch_bytes is None else None
    outside = np_est.total_bytes if np_est is not None else (non_pytorch_bytes or 0)
    capacity = spec.total_bytes - outside if spec is not None else None
    alloc = replay(trace, conf=conf, capacity_bytes=capacity)
    oom = None
    if alloc.oom is not None and spec is not None:
        from memfit.oom_text import format_oom_message

        o = alloc.oom
        message = format_oom_message(
            device=0, tried_to_allocate_bytes=o.tried_to_allocate_bytes, total_bytes=spec.total_bytes,
            free_bytes=max(0, spec.total_bytes - outside - o.reserved_bytes),
            process_used_bytes=o.reserved_bytes + outside, allocated_bytes=o.allocated_bytes,
            reserved_unallocated_bytes=o.reserved_bytes - o.allocated_bytes,
        )
        oom = OomPrediction(o.phase, o.category, o.tried_to_allocate_bytes, o.allocated_bytes,
                            o.reserved_bytes, message)
    if alloc.oom is not None:
        # the capped replay stops at the OOM; report what the run would need without a cap
        alloc = dataclasses.replace(replay(trace, conf=conf), oom=alloc.oom)
    peak_reserved = alloc.peak_reserved_bytes
    if spec is None:
        notes.append("no --gpu given: reserved memory is modelled, `fits` is unknown and memory outside "
                     "PyTorch (CUDA context, ~0.3-1.3 GiB) is not included")
    if setup.weights_dtype == "auto" and sim.weights_dtype != "float32":
        notes.append(f"weights are {sim.weights_dtype}, the dtype transformers 5 `from_pretrained` loads this "
                     "checkpoint in by default (dtype='auto'); pass --weights-dtype fp32 if you load in fp32")
    if sim.weights_dtype == "float16" and setup.precision == "fp16":
        notes.append("fp16 weights with fp16 mixed precision: a real run stops at the first optimizer step "
                     "(GradScaler: 'Attempting to unscale FP16 gradients'); load the model in fp32 "
                     "(--weights-dtype fp32) or use bf16")
    phases = {p: tp.by_phase[p].bytes for p in REPORT_PHASES if p in tp.by_phase}
    if not setup.does_eval:
        phases["eval"] = 0
    return MemoryReport(
        model=sim.model_name, model_type=sim.model_type, task=setup.task, params=sim.params,
        trainable_params=sim.trainable_params, peak_allocated_bytes=tp.overall.bytes, peak_phase=tp.phase_of_peak,
        phases=phases, breakdown={k: tp.overall.breakdown.get(k, 0) for k in BREAKDOWN_KEYS + ("workspaces",)},
        phase_breakdowns={p: dict(tp.by_phase[p].breakdown) for p in phases if p in tp.by_phase},
        peak_reserved_bytes=peak_reserved,
        reserved_by_phase={p: alloc.peak_reserved_by_phase.get(p, 0) for p in REPORT_PHASES},
        fragmentation_at_peak_bytes=alloc.fragmentation_at_peak_bytes,
        non_pytorch_bytes=outside,
        device_used_bytes=peak_reserved + outside,
        gpu=None if spec is None else {"name": spec.name, "total_bytes": spec.total_bytes,
                                       "compute_capability": list(spec.compute_capability)},
        fits=None if spec is None else (alloc.oom is None and peak_reserved + outside <= spec.total_bytes),
        oom=oom, checkpointing=sim.checkpointing, sdpa_backends=sim.sdpa_backends,
        alloc_conf=_conf_text(conf), notes=notes, setup=_setup_json(setup),
        elapsed_s=round(time.perf_counter() - started, 3), trace=trace,
    )


def _conf_text(conf: AllocConf) -> str:
    parts = []
    if conf.max_split_size_bytes is not None:
        parts.append(f"max_split_size_mb:{conf.max_split_size_bytes // (1024 * 1024)}")
    if conf.expandable_segments:
        parts.append("expandable_segments:True")
    if conf.garbage_collection_threshold is not None:
        parts.append(f"garbage_collection_threshold:{conf.garbage_collection_threshold}")
    return ",".join(parts)
