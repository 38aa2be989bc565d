"""`memfit.estimate(setup) -> MemoryReport`: peak GPU memory of a fine-tuning run.

Simulates the run (memfit.sim.engine), reduces the trace to peaks per phase and the
breakdown at the peak (memfit.peaks), replays it through the caching-allocator model
(memfit.allocator) with the memory the GPU leaves to PyTorch, so that free-and-retry and
out-of-memory are modelled (memfit.allocator.bounded), and adds memory held outside PyTorch
(memfit.gpus.outside_pytorch) to say what `nvidia-smi` would show and whether the run fits the GPU.

Reserved memory is always a figure some GPU's allocator reaches: on the given GPU, or,
without one, on a GPU that leaves exactly `required_bytes` to PyTorch, the smallest memory
at which the run completes. The replay without any limit (`uncapped_peak_reserved_bytes`)
can grow without bound (the evaluation's growing prediction buffers) and is kept only to
explain that growth.

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
from memfit.errors import MemfitError
from memfit.gpus.catalog import GpuSpec, as_gpu_spec
from memfit.gpus.outside_pytorch import cublas_workspace_bytes
from memfit.gpus.outside_pytorch import non_pytorch_bytes as _non_pytorch_table
from memfit.models.resolve import resolve
from memfit.peaks import BREAKDOWN_KEYS, peaks
from memfit.allocator.bounded import RESOLUTION_BYTES, SteadyState, bounded_reserved
from memfit.trace import REPORT_PHASES, RL_PHASES, TraceEvent
from memfit.train_setup import (GENERATING_TRAINERS, TRAINING_ARGS_NAMES, TrainSetup, grpo_generation_sizes,
                                 suggest_name)

# memfit.sim.engine (torch, transformers: seconds to import) is imported in `estimate` after the cache lookup.

__all__ = ["MemoryReport", "OomPrediction", "estimate", "REPORT_PHASES", "CUDA_MALLOC_ASYNC_NOTE"]

#: `backend:cudaMallocAsync` (CUDAMallocAsyncAllocator.cpp: a pool the CUDA driver manages, cudaMallocAsync /
#: cudaFreeAsync) has no model in memfit.allocator; the figures are the native allocator's, and the report says so.
CUDA_MALLOC_ASYNC_NOTE = ("backend:cudaMallocAsync is NOT modelled: the reserved figures, the fit and the OOM message "
                          "are those of PyTorch's native caching allocator, not of cudaMallocAsync (whose pool the "
                          "CUDA driver manages); only the allocated figures hold for it")



@dataclass(frozen=True)
class OomPrediction:
    """Where the allocator model runs out of memory, and what PyTorch would print."""

    phase: str
    category: str
    tried_to_allocate_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    message: str
    step: int | None = None
    """Optimizer step that runs out of memory: 1 or 2 (simulated), or a later one (the steady
    state, memfit.allocator.bounded); None in the setup or the evaluation."""


#: MemoryReport fields kept out of `to_json` (and the cache): the trace and what replays it.
_NOT_IN_JSON = frozenset({"trace", "replay_conf", "rank_traces"})


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
    """`torch.cuda.max_memory_reserved()` by the caching-allocator model, replayed with the memory
    the GPU leaves to PyTorch (`capacity_bytes`): never above it; when the run runs out of memory,
    the figure when it does. Without a GPU: on a GPU that leaves exactly `required_bytes`."""
    reserved_by_phase: dict[str, int | None]
    """Peak reserved within each phase, from the same replay; None for a phase the run never
    reaches because it runs out of memory before."""
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
    capacity_bytes: int | None = None
    """Memory available to PyTorch's allocator in the replay: the GPU's total minus memory
    outside PyTorch; None without a GPU."""
    required_bytes: int | None = None
    """Smallest memory available to PyTorch at which the replay of the run (the simulated
    steps, the evaluation and `MAX_STEADY_STEPS` training steps) completes, to 2 MiB or 1/256 of
    it, whichever is larger (memfit.allocator.bounded.smallest_capacity). Searched without a GPU or when
    the run runs out of memory on it; None when the run fits the GPU (then `headroom_bytes` says
    how much is spare)."""
    shortfall_bytes: int | None = None
    """`required_bytes - capacity_bytes` when the run runs out of memory on the GPU, else None
    (on a GPU smaller than the memory outside PyTorch, that memory counts too)."""
    uncapped_peak_reserved_bytes: int = 0
    """Peak reserved by a replay without any memory limit: cached blocks are never released,
    so this grows without bound when requests keep growing (evaluation buffers). Not what any
    GPU reaches when above its memory; kept to show that growth."""
    steady_state: SteadyState | None = None
    """Reserved memory over many optimizer steps (memfit.allocator.bounded.steady_state), replayed with
    `capacity_bytes` (without a GPU: `required_bytes`); None without two optimizer steps."""
    # -- attention and Liger kernels --
    attn_implementation: str | None = None
    """The attention implementation the simulated model ran (config._attn_implementation)."""
    emulated_kernels: list[str] = field(default_factory=list)
    """CUDA/Triton kernels that ran as emulations (flash_attention_2[:varlen], liger:fused_linear_cross_entropy, ...)."""
    reserved_at_peak_allocated_bytes: int = 0
    """Reserved memory at the moment of the allocated peak (the moment `breakdown` describes), from the
    same replay; minus `peak_allocated_bytes` it is what the cache held free for reuse at that moment."""
    # -- quantization --
    quantization: dict[str, Any] | None = None
    """Quantized base weights (bitsandbytes): method, bits, quantized params and bytes, what stays in higher
    precision, the dequantization temporaries live at the peak; None when the weights are not quantized."""
    paged_bytes: int = 0
    """Optimizer state of a paged bitsandbytes optimizer in CUDA managed memory (cudaMallocManaged): outside
    PyTorch's allocator, so in no allocated/reserved figure; on the GPU while there is room, paged out to host
    memory by the driver when there is not."""
    # -- images and audio --
    media_inputs: dict[str, Any] | None = None
    """What the model's own processor made of each image or clip (memfit.models.processors): the size or length
    given, the processor class, each input tensor's per-example shape, a clip's encoder positions; None for text."""
    # -- multi-GPU: rank 0 of a ParallelSetup; None on one GPU --
    parallel: dict[str, Any] | None = None
    """Strategy, world size, nodes, the rank's buffers, host memory for offload (per rank and per node),
    NCCL bytes outside PyTorch and what nvidia-smi shows per GPU (memfit.parallel)."""
    # -- RL trainers (GRPO) --
    rl: dict[str, Any] | None = None
    """GRPO: the generation batch (`steps_per_generation`, `generation_batch_size`, prompt and completion tokens),
    the KV cache of transformers' generate in closed form, whether a reference copy is held, and vLLM's share of
    the GPU (memfit.gpus.vllm; `vllm.training_bytes` is outside `capacity_bytes` and inside `device_used_bytes`);
    None for other trainers."""
    trace: list[TraceEvent] = field(repr=False, compare=False, default_factory=list)
    replay_conf: AllocConf | None = field(default=None, repr=False, compare=False)
    """The allocator settings of the replay the reserved figures come from (the views in memfit.report replay
    `trace` with them); None, as `trace` is empty, in a report read from the cache. Not in the JSON."""
    rank_traces: dict[int, list[TraceEvent]] = field(repr=False, compare=False, default_factory=dict)
    """Multi-GPU runs whose ranks differ (`parallel['ranks']`, ZeRO-2): the trace of each group of ranks other
    than rank 0's, by the group's first rank (`trace` is rank 0's), for the views' per-rank timelines. Not in the
    JSON."""

    def __repr__(self) -> str:
        from memfit.units import format_bytes

        gpu = self.gpu["name"] if self.gpu else None
        return (f"MemoryReport(model={self.model!r}, task={self.task!r}, fits={self.fits}, "
                f"peak_allocated={format_bytes(self.peak_allocated_bytes)}, "
                f"peak_reserved={format_bytes(self.peak_reserved_bytes)}, gpu={gpu!r})")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MemoryReport":
        """The report `to_json` wrote (the cache's entries), without the trace. `steady_state.oom` (the
        OOM event, not in the JSON) is None; `steady_state.oom_step` says which step runs out."""
        names = {f.name for f in dataclasses.fields(cls)} - _NOT_IN_JSON
        kwargs = {k: v for k, v in data.items() if k in names}
        if kwargs.get("oom") is not None:
            kwargs["oom"] = OomPrediction(**kwargs["oom"])
        if kwargs.get("steady_state") is not None:
            st = dict(kwargs["steady_state"])
            st["step_reserved_bytes"] = tuple(st.get("step_reserved_bytes") or ())
            kwargs["steady_state"] = SteadyState(**st)
        return cls(**kwargs)

    @property
    def headroom_bytes(self) -> int | None:
        """GPU memory left at the peak; negative: how much more the run needs (`-shortfall_bytes`)."""
        if self.gpu is None:
            return None
        if self.shortfall_bytes is not None:
            return -self.shortfall_bytes
        return self.gpu["total_bytes"] - self.device_used_bytes

    def to_json(self) -> dict[str, Any]:
        """The stable `--json` schema (documented in README.md, "JSON output")."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_IN_JSON}
        out["oom"] = None if self.oom is None else dataclasses.asdict(self.oom)
        out["steady_state"] = None if self.steady_state is None else self.steady_state.to_json()
        out["headroom_bytes"] = self.headroom_bytes
        out["schema"] = "memfit.estimate/1"
        return out

    # -- views (memfit.report; matplotlib for `plot`, pandas for `timeline(as_frame=True)`) --
    def timeline(self, *, as_frame: bool = False, max_samples: int | None = None) -> Any:
        """The memory timeline of the simulated run: a list of memfit.report.timeline.Sample (allocated by
        category, reserved, the largest live storages), or a pandas DataFrame with `as_frame=True`."""
        from memfit.report import report_timeline, timeline_frame

        tl = report_timeline(self, max_samples=max_samples)
        return timeline_frame(tl) if as_frame else tl.samples

    def to_html(self, path: Any) -> str:
        """Write the interactive report (one self-contained HTML file, no network access); returns the path."""
        from memfit.report import write_views

        return write_views(self, html_path=path)[0]

    def plot(self, path: Any) -> str:
        """Write the timeline as a stacked area chart, PNG or SVG by the extension (needs matplotlib)."""
        from memfit.report import write_views

        return write_views(self, plot_path=path)[0]

    def _repr_html_(self) -> str:
        """The interactive report inline in a notebook (a summary when the report has no trace)."""
        from memfit.report.html import notebook_html

        return notebook_html(self)


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
        # GRPO's generation and scoring run on the main thread's handle, as the forward does
        handle = "forward" if ev.phase in RL_PHASES else ev.phase
        if handle in ("forward", "backward") and handle not in added:
            out.append(TraceEvent("alloc", next_id, workspace_bytes, "workspaces", ev.phase, "cublas workspace"))
            next_id += 1
            added.add(handle)
        out.append(ev)
    return out


def _is_model(value: Any) -> bool:
    """What TrainSetup's `model` takes besides a hub id: an nn.Module, a PretrainedConfig, a model directory
    (os.PathLike); by duck type, so that this module does not import torch or transformers."""
    import os

    return (isinstance(value, os.PathLike) or callable(getattr(value, "named_parameters", None))
            or (hasattr(value, "model_type") and callable(getattr(value, "to_dict", None))))


def estimate(
    setup: TrainSetup | str | None = None,
    *,
    gpu: str | GpuSpec | None = None,
    alloc_conf: str | AllocConf | None = None,
    non_pytorch_bytes: int | None = None,
    capacity_bytes: int | None = None,
    cache: bool = False,
    parallel: Any = None,
    **fields: Any,
) -> MemoryReport:
    """Simulate `setup` (or `TrainSetup(**fields)`, or `TrainSetup(model=setup, **fields)` for a
    model id) and report its peak memory.

    Args:
        setup: a TrainSetup; a model (hub id, directory, PretrainedConfig or nn.Module: then `fields` are its
            TrainSetup fields, as `TrainSetup.from_kwargs(model, **fields)`); or None (`fields` make the TrainSetup).
        gpu: a catalog name (`V100-16GB`), a size (`16GiB`), `auto`, or a GpuSpec; None leaves
            `fits` unknown and reports `required_bytes`.
        alloc_conf: PYTORCH_CUDA_ALLOC_CONF text; None reads the environment as PyTorch does.
        non_pytorch_bytes: memory outside PyTorch's cache when it is known (measured, or read
            from an OOM message) instead of memfit's table.
        capacity_bytes: memory PyTorch's allocator may use, instead of the GPU's total minus
            memory outside PyTorch (the planner passes its budget, which keeps a margin free);
            needs `gpu`.
        cache: read and write memfit's cache of results (memfit.cache; the CLI's default). A result
            read from it has no `trace`.
        parallel: a memfit.parallel.ParallelSetup (DDP, FSDP2, ZeRO-1/2/3 over several GPUs): the report is
            rank 0's, with `parallel` saying what differs per rank and the host memory offload needs.
        **fields: TrainSetup fields (or TrainingArguments names such as `fp16=True`).
    """
    started = time.perf_counter()
    setup_names = {f.name for f in dataclasses.fields(TrainSetup)}
    for key in fields:
        if key not in setup_names and key not in TRAINING_ARGS_NAMES:
            raise MemfitError(f"estimate() got an unknown setting `{key}`{suggest_name(key, setup_names | TRAINING_ARGS_NAMES)}; "
                              "its keywords are TrainSetup fields (they mirror TrainingArguments names)")
    if setup is None:
        if "model" not in fields:
            raise MemfitError("estimate() needs a model: pass a model id (`estimate(\"bert-base-uncased\")`), "
                              "a TrainSetup, or model=...")
        setup = TrainSetup.from_kwargs(**fields)
    elif isinstance(setup, str) or _is_model(setup):  # estimate("bert-base-uncased" or nn.Module, batch_size=4)
        setup = TrainSetup.from_kwargs(setup, **fields)
    elif not isinstance(setup, TrainSetup):
        raise MemfitError(f"setup `{type(setup).__name__}` is not a TrainSetup; pass TrainSetup(...), "
                          "TrainSetup.from_kwargs(model, training_args={...}) or a model id")
    elif fields:
        if any(k not in setup_names for k in fields):  # TrainingArguments names (fp16=True): through from_kwargs
            base = {f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)}
            setup = TrainSetup.from_kwargs(base.pop("model"), training_args=fields, **base)
        else:
            setup = setup.replace(**fields)
    setup = resolve(setup)  # the task from the model, the peft_config read by peft
    spec = as_gpu_spec(gpu)
    if capacity_bytes is not None:
        if spec is None:
            raise MemfitError(f"capacity_bytes `{capacity_bytes}` needs a GPU: pass gpu=... as well")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise MemfitError(f"capacity_bytes `{capacity_bytes!r}` must be a positive number of bytes")
    if spec is not None and tuple(setup.compute_capability) != tuple(spec.compute_capability):
        # the setup's own checks (bf16, a bf16 4-bit compute dtype) are the GPU's; the simulation gets the GpuSpec
        setup = setup.replace(compute_capability=tuple(spec.compute_capability))
    if alloc_conf is None:
        import os

        conf = alloc_conf_from_env(os.environ)
    elif isinstance(alloc_conf, str):
        conf = parse_alloc_conf(alloc_conf)
    else:
        conf = alloc_conf
    key = None
    if parallel is not None:  # multi-GPU: not in the cache's key, so not cached
        cache = False
    if parallel is not None:
        setup = _per_rank_generation(setup, parallel.world_size)
    zero = getattr(parallel, "zero", None) if getattr(parallel, "strategy", "").startswith("zero") else None
    if zero is not None and zero.dtype != "fp32" and setup.precision != zero.dtype:
        # DeepSpeed trains in its config's dtype (memfit.parallel.deepspeed_rules decides it from every source)
        setup = setup.replace(precision=zero.dtype)
    if cache and not (isinstance(gpu, str) and gpu.strip().lower() == "auto"):
        from memfit import cache as _cache

        key = _cache.estimate_key(setup, gpu=spec, conf=conf, non_pytorch_bytes=non_pytorch_bytes,
                                  capacity_bytes=capacity_bytes)
        stored = _cache.load_entry(key) if key is not None else None
        if stored is not None:
            try:
                hit = MemoryReport.from_json(stored)
            except (TypeError, ValueError, KeyError):  # an entry of another shape: ignored, recomputed
                hit = None
            if hit is not None:
                return dataclasses.replace(
                    hit, elapsed_s=round(time.perf_counter() - started, 3),
                    notes=[*hit.notes, f"read from memfit's cache (simulated in {hit.elapsed_s:.1f} s before; "
                                       "--no-cache simulates again)"])
    from memfit.sim.engine import simulate

    rank = None
    if parallel is not None:  # multi-GPU: rank 0's trace from memfit.parallel
        from memfit.parallel.rank import simulate_rank

        rank = simulate_rank(setup, parallel, gpu=spec)
        sim = rank.sim
        sim.notes = list(sim.notes) + rank.notes
    else:
        sim = simulate(setup, gpu=spec)
    notes = list(sim.notes) + [n for n in conf.notes if "cudaMallocAsync" not in n]
    if conf.backend == "cudaMallocAsync":
        notes.insert(0, CUDA_MALLOC_ASYNC_NOTE)
    trace = sim.trace
    workspace = cublas_workspace_bytes(spec) if spec is not None else 0
    trace = _with_workspaces(trace, workspace)
    rank_traces = {} if rank is None else {r: _with_workspaces(t, workspace) for r, t in rank.rank_traces.items()}
    tp = peaks(trace)
    for group in rank.ranks if rank is not None else ():  # each group's peak as `peak_allocated_bytes` counts it
        group["peak_allocated_bytes"] = (tp.overall.bytes if 0 in group["ranks"]
                                         else peaks(rank_traces[group["ranks"][0]]).overall.bytes)
    if non_pytorch_bytes is None and isinstance(gpu, str) and gpu.strip().lower() == "auto":
        from memfit.gpus.outside_pytorch import measure_non_pytorch_bytes

        non_pytorch_bytes = measure_non_pytorch_bytes()  # None without a GPU or NVML
        if non_pytorch_bytes is not None:
            notes.append("memory outside PyTorch measured by NVML in this process (context and loaded kernels)")
    np_est = _non_pytorch_table(spec) if spec is not None and non_pytorch_bytes is None else None
    outside = np_est.total_bytes if np_est is not None else (non_pytorch_bytes or 0)
    if rank is not None:
        outside += rank.nccl_bytes  # NCCL's buffers: outside PyTorch's allocator (memfit.parallel.nccl)
    capacity = spec.total_bytes - outside if spec is not None else None
    rl = _rl_part(setup, sim, spec)  # GRPO: a colocated vLLM takes its share of the card before training does
    vllm_training = rl["vllm"]["training_bytes"] if rl is not None and rl["vllm"] is not None else 0
    if capacity is not None:
        capacity -= vllm_training
    if capacity_bytes is not None:
        capacity = capacity_bytes
    short_of = capacity  # a GPU smaller than the memory outside PyTorch leaves nothing (and is short of that too)
    if capacity is not None:
        capacity = max(0, capacity)
    bounded = bounded_reserved(trace, conf=conf, capacity_bytes=capacity, lower_bytes=tp.overall.bytes)
    alloc = bounded.report
    oom = None
    if bounded.oom is not None and spec is not None:
        from memfit.oom_text import format_oom_message

        o = bounded.oom
        message = format_oom_message(
            device=0, tried_to_allocate_bytes=o.tried_to_allocate_bytes, total_bytes=spec.total_bytes,
            free_bytes=max(0, spec.total_bytes - outside - o.reserved_bytes),
            process_used_bytes=o.reserved_bytes + outside, allocated_bytes=o.allocated_bytes,
            reserved_unallocated_bytes=o.reserved_bytes - o.allocated_bytes,
        )
        oom = OomPrediction(o.phase, o.category, o.tried_to_allocate_bytes, o.allocated_bytes,
                            o.reserved_bytes, message, bounded.oom_step)
    peak_reserved = alloc.peak_reserved_bytes
    required = bounded.required_bytes
    shortfall = required - short_of if (short_of is not None and required is not None) else None
    if spec is None:
        notes.append("no --gpu given: reserved memory is replayed on a GPU that leaves exactly the required "
                     "memory to PyTorch; `fits` is unknown and memory outside PyTorch (CUDA context, "
                     "~0.3-1.3 GiB) is not included")
    growth = _uncapped_growth_note(bounded.uncapped, required if required is not None else capacity)
    if growth:
        notes.append(growth)
    if required is not None and not bounded.required_exact:
        notes.append(f"the smallest capacity was not narrowed to {RESOLUTION_BYTES // 2**20} MiB (or 1/256) within the "
                     "bound on allocator replays; `required_bytes` is one at which the run completes")
    if zero is not None and zero.dtype != "fp32":
        notes.append(f"weights are {sim.weights_dtype}: DeepSpeed casts the model to its config's {zero.dtype} "
                     "(engine `_configure_distributed_model`) and scales fp16 losses with its own loss scaler, "
                     "not torch's GradScaler")
    elif setup.weights_dtype == "auto" and sim.weights_dtype != "float32":
        notes.append(f"weights are {sim.weights_dtype}, the dtype transformers 5 `from_pretrained` loads this "
                     "checkpoint in by default (dtype='auto'); pass --weights-dtype fp32 if you load in fp32")
    if sim.weights_dtype == "float16" and setup.precision == "fp16" and zero is None:
        notes.append("fp16 weights with fp16 mixed precision: a real run stops at the first optimizer step "
                     "(GradScaler: 'Attempting to unscale FP16 gradients'); load the model in fp32 "
                     "(--weights-dtype fp32) or use bf16")
    quantization = _quantization_report(sim.quantization, trace, tp.overall.event_index)
    if sim.paged_bytes:
        from memfit.units import format_bytes

        notes.append(f"paged optimizer: {format_bytes(sim.paged_bytes)} of optimizer state is in CUDA managed memory "
                     "(bitsandbytes F.get_paged -> cudaMallocManaged), outside PyTorch's allocator and outside every "
                     "figure here: it occupies that much more GPU memory while the GPU has room and is paged to host "
                     "memory when it has not (slower steps, no OOM)")
    phases = {p: tp.by_phase[p].bytes for p in REPORT_PHASES + RL_PHASES if p in tp.by_phase}
    if not setup.does_eval:
        phases["eval"] = 0
    report = MemoryReport(
        model=sim.model_name, model_type=sim.model_type, task=setup.task, params=sim.params,
        trainable_params=sim.trainable_params, peak_allocated_bytes=tp.overall.bytes, peak_phase=tp.phase_of_peak,
        phases=phases, breakdown={k: tp.overall.breakdown.get(k, 0) for k in BREAKDOWN_KEYS + ("workspaces",)},
        phase_breakdowns={p: dict(tp.by_phase[p].breakdown) for p in phases if p in tp.by_phase},
        peak_reserved_bytes=peak_reserved,
        reserved_by_phase=_reserved_by_phase(alloc, setup.does_eval, capacity is not None and alloc.oom is not None),
        fragmentation_at_peak_bytes=alloc.fragmentation_at_peak_bytes,
        non_pytorch_bytes=outside,
        device_used_bytes=peak_reserved + outside + vllm_training,
        gpu=None if spec is None else {"name": spec.name, "total_bytes": spec.total_bytes,
                                       "compute_capability": list(spec.compute_capability)},
        fits=None if spec is None else bounded.oom is None,
        oom=oom, checkpointing=sim.checkpointing, sdpa_backends=sim.sdpa_backends,
        alloc_conf=_conf_text(conf), notes=notes, setup=_setup_json(setup),
        elapsed_s=round(time.perf_counter() - started, 3), capacity_bytes=capacity, required_bytes=required,
        shortfall_bytes=shortfall, uncapped_peak_reserved_bytes=bounded.uncapped.peak_reserved_bytes,
        steady_state=bounded.steady, trace=trace, replay_conf=conf, rank_traces=rank_traces,
        reserved_at_peak_allocated_bytes=alloc.reserved_at_peak_allocated_bytes,
        quantization=quantization, paged_bytes=sim.paged_bytes, media_inputs=sim.media_inputs,
        attn_implementation=sim.attn_implementation, emulated_kernels=list(sim.attn_kernels),
        parallel=None if rank is None else _parallel_json(parallel, rank, peak_reserved + outside),
        rl=rl,
    )
    if rl is not None and rl["vllm"] is not None and spec is not None and rl["vllm"]["sleep"]:
        report = _with_vllm_wakeup(report, trace, spec)
    if rl is not None and rl["vllm"] is not None and spec is not None and not rl["vllm"]["weights_fit"]:
        report = dataclasses.replace(report, fits=False, notes=[*report.notes, (
            f"vLLM's share ({rl['vllm']['generation_bytes']} B) does not hold the model's weights "
            f"({rl['vllm']['weights_bytes']} B): vLLM fails at start-up (no memory for its KV cache); raise "
            "`vllm_gpu_memory_utilization`")])
    if rl is not None and rl["vllm"] is not None and spec is not None:
        report = _with_vllm_startup(report, rl["vllm"], spec, outside)
    if key is not None:
        from memfit import cache as _cache

        _cache.store_entry(key, report.to_json())
    return report


def _rl_part(setup: TrainSetup, sim: Any, spec: GpuSpec | None) -> dict[str, Any] | None:
    """The GRPO / RLOO part of the report (MemoryReport.rl); None for other trainers."""
    if setup.trainer not in ("grpo", "rloo"):  # the trainers that generate (RLOO: GRPO's generation batch)
        return None
    from memfit.gpus.vllm import vllm_share
    from memfit.sim.grpo_steps import kv_cache_bytes, needs_old_log_probs

    steps, gen = setup.grpo_sizes
    p, c = setup.sequence_length, setup.max_completion_length
    weight_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(sim.weights_dtype, 4)
    # the cache holds what k_proj / v_proj return: the autocast dtype under mixed precision, else the weights'
    cache_dtype_bytes = 2 if setup.precision in ("fp16", "bf16") else weight_bytes
    from memfit.models.build import resolve_config

    config = resolve_config(setup.model).config
    kv = None if config is None else kv_cache_bytes(config, sequences=gen, tokens=p + c - 1,
                                                    dtype_bytes=cache_dtype_bytes)
    vllm = None
    if setup.use_vllm:
        total = spec.total_bytes if spec is not None else 0
        vllm = vllm_share(mode=setup.vllm_mode, utilization=setup.vllm_gpu_memory_utilization, total_bytes=total,
                          sleep=setup.vllm_enable_sleep_mode, weights_bytes=sim.params * weight_bytes).to_json()
    return {"trainer": setup.trainer, "steps_per_generation": steps, "generation_batch_size": gen,
            "num_generations": setup.num_generations, "prompt_tokens": p, "completion_tokens": c,
            "kv_cache_bytes": None if setup.use_vllm else kv, "reference_copy": setup.beta != 0.0 and
            setup.lora_r is None and not setup.peft_config, "old_log_probs": setup.trainer == "rloo" or needs_old_log_probs(setup),  # RLOO: always
            "reward_model": setup.reward_model, "vllm": vllm}


def _with_vllm_startup(report: MemoryReport, vllm: dict[str, Any], spec: GpuSpec, outside_bytes: int) -> MemoryReport:
    """vLLM colocated: TRL builds the engine in GRPOTrainer.__init__ after Trainer.__init__ has put the policy on
    the GPU (grpo_trainer.py: `super().__init__` before `VLLMGeneration(...)`), and vLLM refuses to start when the
    free memory then is below `gpu_memory_utilization x total` ("Free memory on device ... on startup is less than
    desired GPU memory utilization", vllm/v1/worker/gpu_worker.py `init_device`). A share above what the card has
    left is a run that never starts: `fits` is False and a note gives the largest share that starts."""
    if vllm["mode"] != "colocate":
        return report
    free_at_start = spec.total_bytes - vllm["weights_bytes"] - outside_bytes
    if vllm["generation_bytes"] <= free_at_start:
        return report
    largest = max(0.0, int(free_at_start / spec.total_bytes * 100) / 100)
    from memfit.units import format_bytes

    return dataclasses.replace(report, fits=False, notes=[*report.notes, (
        f"vllm_gpu_memory_utilization `{vllm['utilization']}` asks vLLM for {format_bytes(vllm['generation_bytes'])} "
        f"of the {spec.name}'s {format_bytes(spec.total_bytes)}, but when TRL starts vLLM the training process already "
        f"holds the weights ({format_bytes(vllm['weights_bytes'])}) and memory outside PyTorch "
        f"({format_bytes(outside_bytes)}): vLLM stops at start-up (free memory below its share); use at most "
        f"{largest:g}")])


def _with_vllm_wakeup(report: MemoryReport, trace: list[TraceEvent], spec: GpuSpec) -> MemoryReport:
    """vLLM colocated in sleep mode: what nvidia-smi shows while vLLM is awake and generates (its share, next to what
    the training process holds then: the tensors alive when a generation's scoring starts, PyTorch's cache emptied
    first, vllm_generation.py `sync_weights`), and whether that fits the card too. The most over the trace's
    generations counts: the first holds the weights only, a later one also the optimizer state of the steps
    before it; an evaluation's (GRPOTrainer.prediction_step generates with vLLM too) holds the training step's
    buffered generation batch besides. Without sleep mode the share is held all along and `device_used_bytes` counts
    it already."""
    vllm = report.rl["vllm"]
    if vllm["mode"] != "colocate":
        return report
    from memfit.peaks import rounded

    live: dict[int, int] = {}
    held, phase = 0, None
    for ev in trace:
        if ev.phase in ("scoring", "eval") and phase != ev.phase:  # a generation: vLLM wakes up beside what is alive
            held = max(held, sum(live.values()))
        phase = ev.phase
        if ev.action == "alloc":
            live[ev.id] = rounded(ev.size_bytes)
        elif ev.action == "free":
            live.pop(ev.id, None)
    at_generation = held + report.non_pytorch_bytes + vllm["generation_bytes"]
    rl = {**report.rl, "vllm": {**vllm, "training_held_at_generation_bytes": held,
                                "device_used_at_generation_bytes": at_generation}}
    fits = report.fits
    notes = list(report.notes)
    if at_generation > spec.total_bytes:
        fits = False
        notes.append(f"vLLM's share ({vllm['generation_bytes']} B) does not fit beside what training holds while it "
                     f"generates ({held} B): {at_generation} B of {spec.total_bytes} B")
    return dataclasses.replace(report, rl=rl, fits=fits, notes=notes,
                               device_used_bytes=max(report.device_used_bytes, at_generation))


def _quantization_report(summary: dict[str, Any] | None, trace: list[TraceEvent], peak_index: int
                         ) -> dict[str, Any] | None:
    """The simulation's quantization summary plus the bytes allocated inside bitsandbytes ops (dequantized
    weights, float32 absmax, int8 casts: memfit.sim.kernels.bnb) live at the allocated peak and at most."""
    if summary is None:
        return None
    from memfit.sim.kernels.bnb import DEQUANT_LABEL

    live: dict[int, int] = {}
    total = most = at_peak = 0
    for i, ev in enumerate(trace):
        if ev.action == "alloc" and ev.module.startswith(DEQUANT_LABEL):
            live[ev.id] = ev.size_bytes
            total += ev.size_bytes
            most = max(most, total)
        elif ev.action == "free" and ev.id in live:
            total -= live.pop(ev.id)
        if i == peak_index:
            at_peak = total
    return {**summary, "dequant_temporaries_at_peak_bytes": at_peak, "dequant_temporaries_max_bytes": most}


def _per_rank_generation(setup: TrainSetup, world_size: int) -> TrainSetup:
    """GRPO / RLOO over `world_size` processes: GRPOConfig's `generation_batch_size` counts the completions of all
    processes (TRL 1.16 grpo_config.py `__post_init__`: `steps_per_generation = generation_batch_size //
    (per_device_train_batch_size * num_processes)`), and each rank generates its own share: the rank's setup
    names the steps per generation instead."""
    if setup.trainer not in GENERATING_TRAINERS or setup.generation_batch_size is None or world_size <= 1:
        return setup
    steps, total = grpo_generation_sizes(setup.per_device_train_batch_size, setup.gradient_accumulation_steps,
                                         None, setup.generation_batch_size, num_processes=world_size)
    note = (f"generation_batch_size {total} counts the completions of all {world_size} processes: each rank "
            f"generates {total // world_size} (steps_per_generation {steps})")
    return setup.replace(generation_batch_size=None, steps_per_generation=steps, notes=[*setup.notes, note])


def _parallel_json(parallel, rank, device_used_bytes: int) -> dict[str, Any]:
    """The multi-GPU part of the report."""
    fsdp1_views = parallel.strategy == "fsdp" and parallel.fsdp_version == 1 and parallel.use_orig_params
    if rank.ranks:  # ZeRO-2: the ranks' gradient partitions differ (memfit.parallel.rank._per_rank_zero2)
        worst = max(rank.ranks, key=lambda d: d["peak_allocated_bytes"])
        differ = (f"yes: ZeRO-2's gradient partition buffer holds the whole parameters each rank's partition cuts; "
                  f"rank 0 peaks at {rank.ranks[0]['peak_allocated_bytes']} B allocated, rank {worst['ranks'][0]} "
                  f"(the worst) at {worst['peak_allocated_bytes']} B (see `ranks`)")
    elif fsdp1_views:
        differ = ("slightly: FSDP1 with use_orig_params keeps optimizer state per original-parameter view, and each "
                  "rank's shard cuts the parameters differently (measured: 0.5% between 2 ranks)")
    elif parallel.strategy == "ddp":
        differ = ("no: DDP keeps a whole replica on every rank (weights, gradients, buckets, optimizer state) and "
                  "every rank runs the same shapes")
    else:
        differ = "no: every rank holds the same shard sizes (the last rank's padding aside)"
    alike = not rank.ranks and not fsdp1_views  # every rank holds what rank 0's trace holds
    out = {
        **parallel.to_json(), "rank": 0, "host_bytes_per_rank": rank.host_bytes,
        "host_bytes_per_node": rank.host_bytes * parallel.gpus_per_node, "nccl_bytes": rank.nccl_bytes,
        "nvidia_smi_per_gpu_bytes": device_used_bytes, "buffers": rank.buffers,
        "deepspeed_model_states": rank.deepspeed_model_states, "ranks_differ": differ, "ranks": rank.ranks,
        "ranks_alike": alike,
    }
    if parallel.strategy == "fsdp":  # per node vs per rank under hybrid sharding
        out["shard_group_size"] = parallel.shard_size
        out["replicas"] = parallel.world_size // parallel.shard_size
    return out


def _reserved_by_phase(alloc, does_eval: bool, stopped: bool) -> dict[str, int | None]:
    """Peak reserved per phase; None for a phase an OOM in the trace keeps the run from reaching."""
    out: dict[str, int | None] = {}
    for p in REPORT_PHASES + tuple(p for p in RL_PHASES if p in alloc.peak_reserved_by_phase):
        if p in alloc.peak_reserved_by_phase:
            out[p] = alloc.peak_reserved_by_phase[p]
        elif p == "eval" and not does_eval:
            out[p] = 0
        else:
            out[p] = None if stopped else 0
    return out


#: The note on uncapped growth is shown when the uncapped replay reserves this much more than the
#: bounded figure (a display threshold: below it the two differ by ordinary fragmentation).
_GROWTH_NOTE_RATIO = 1.25


def _uncapped_growth_note(uncapped, bound: int | None) -> str | None:
    """A note when the replay without a memory limit grows far past what a GPU reaches."""
    if bound is None or uncapped.peak_reserved_bytes <= bound * _GROWTH_NOTE_RATIO:
        return None
    by_phase = uncapped.peak_reserved_by_phase
    phase = next((p for p in by_phase if by_phase[p] == uncapped.peak_reserved_bytes), "the run")
    from memfit.units import format_bytes

    return (f"without a memory limit the cache would grow to {format_bytes(uncapped.peak_reserved_bytes)} by the "
            f"{phase} phase (blocks freed there stay cached and are too small for the larger requests that follow); "
            "a GPU's allocator frees them and retries when cudaMalloc fails, so every reserved figure here is "
            "replayed with the GPU's memory")


def _conf_text(conf: AllocConf) -> str:
    parts = []
    if conf.max_split_size_bytes is not None:
        parts.append(f"max_split_size_mb:{conf.max_split_size_bytes // (1024 * 1024)}")
    if conf.expandable_segments:
        parts.append("expandable_segments:True")
    if conf.garbage_collection_threshold is not None:
        parts.append(f"garbage_collection_threshold:{conf.garbage_collection_threshold}")
    if conf.backend != "native":
        parts.append(f"backend:{conf.backend}")
    return ",".join(parts)
