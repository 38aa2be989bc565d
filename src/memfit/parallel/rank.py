"""The trace one rank sees, per strategy, and what it holds in host memory and outside PyTorch.

* `fsdp`: FSDP2's or FSDP1's real code (memfit.parallel.fsdp), hybrid sharding on a 2-D mesh.
* `ddp`: the single-GPU simulation plus DDP's gradient buckets (torch/nn/parallel/distributed.py
  `_ddp_init_helper`; torch/csrc/distributed/c10d/reducer.cpp): one flat tensor per bucket, the
  buckets assigned by DDP's own `_compute_bucket_assignment_by_size` over the trainable parameters
  with limits `[first_bucket, bucket_cap]` (1 MiB first bucket only with the default cap), made when
  DDP wraps the model and kept; rebuilt once in the execution order at the second forward
  (`Reducer::rebuild_buckets`: the new ones are made before the old ones go). Without
  `gradient_as_bucket_view` autograd's gradients stay as they are and the buckets are a second
  copy; with it the reducer copies each new gradient into its bucket view and makes `param.grad`
  that view (`Reducer::mark_variable_ready_dense`), so the gradient tensor autograd made is freed at
  once and `zero_grad(set_to_none=True)` frees nothing.
* `zero1`/`zero2`/`zero3`: the simulation of the model in DeepSpeed's dtype without autocast (the engine
  casts the module: `_configure_distributed_model`), keeping its activations, inputs, temporaries and
  evaluation outputs; weights, gradients, optimizer state and the optimizer phase are replaced by
  memfit.parallel.zero's per-rank buffers.

Within `shared_simulations()` (the multi-GPU planner's search) the single-GPU simulation a DDP or ZeRO rank starts
from is run once per program (memfit.sim.program) and GPU: ZeRO-1, ZeRO-2, ZeRO-3 and their offload variants at the same
micro-batch, checkpointing and kernels simulate the very same program (the model in DeepSpeed's dtype) and differ
only in the buffers added to its trace and in what the allocator replay sees.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from memfit.models.resolve import resolve
from memfit.parallel.nccl import hybrid_group_nccl_bytes, nccl_buffer_bytes
from memfit.parallel.setup import ParallelSetup
from memfit.parallel.zero import ParamInventory, ZeroBuffer, deepspeed_model_states_bytes, zero_buffers
from memfit.sim.program import same_program
from memfit.trace import TraceEvent
from memfit.train_setup import TrainSetup

if TYPE_CHECKING:
    from memfit.gpus.catalog import GpuSpec

__all__ = ["RankResult", "simulate_rank", "param_inventory", "quant_state_bytes", "ddp_bucket_bytes",
           "shared_simulations"]

#: the open `shared_simulations` scope's simulations: (setup, GPU, Simulation), compared by equality
_SHARED: list[tuple[TrainSetup, Any, Any]] | None = None


@contextlib.contextmanager
def shared_simulations() -> Iterator[None]:
    """Within this scope a DDP or ZeRO rank's single-GPU simulation of an equal setup on an equal GPU is reused
    (module docstring); the results do not change (a `Simulation` is handed out as a copy, its trace a new list of
    the same frozen events). Leaving the outermost scope drops the simulations."""
    global _SHARED
    outer = _SHARED is None
    if outer:
        _SHARED = []
    try:
        yield
    finally:
        if outer:
            _SHARED = None


def _simulated(setup: TrainSetup, gpu: Any):
    """memfit.sim.engine.simulate(setup, gpu=gpu), once per program (memfit.sim.program.same_program) and GPU
    within `shared_simulations`."""
    from memfit.sim.engine import simulate

    if _SHARED is None:
        return simulate(setup, gpu=gpu)
    sim = next((x for s, g, x in _SHARED if g == gpu and same_program(s, setup)), None)
    if sim is None:
        sim = simulate(setup, gpu=gpu)
        _SHARED.append((setup, gpu, sim))
    return dataclasses.replace(sim, trace=list(sim.trace), notes=list(sim.notes), sdpa_backends=list(sim.sdpa_backends),
                               attn_kernels=list(sim.attn_kernels), quantization=copy.deepcopy(sim.quantization),
                               media_inputs=copy.deepcopy(sim.media_inputs))


@dataclass
class RankResult:
    """Rank 0's simulation and what it needs beyond its trace."""

    sim: Any  # memfit.sim.engine.Simulation
    host_bytes: int = 0
    nccl_bytes: int = 0
    buffers: list[dict[str, Any]] = field(default_factory=list)
    deepspeed_model_states: dict[str, int] | None = None
    notes: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Ranks whose memory differs (ZeRO-2): each distinct layout with its ranks and its trace's peak allocated bytes
    (before the allocator); rank 0's first. Empty when every rank holds the same."""
    rank_traces: dict[int, list[TraceEvent]] = field(default_factory=dict)
    """The trace of each group of `ranks` other than rank 0's (rank 0's is `sim.trace`), by the group's first
    rank."""


def _meta_model(setup: TrainSetup):
    from memfit.sim.engine import _Runner

    return _Runner(setup, fake=True, splice=False).model


def param_inventory(model, persistence_threshold: int = 0, zero_dtype: str | None = None) -> ParamInventory:
    """Parameter counts of a (meta) model, shared parameters once (as DeepSpeed's `model_to_params`).

    With `zero_dtype` (DeepSpeed's dtype) the counts are in elements of that dtype, as ZeRO's rules take them: the
    engine casts every floating parameter to fp16 / bf16 when enabled (`module.half()` / `.bfloat16()` in
    `_configure_distributed_model`: floating tensors only), so a parameter it does not cast (an integer one, such
    as the packed uint8 storage of 4-bit weights, or any parameter of a run in fp32) counts its own bytes:
    `numel * element_size / b` elements. The persistence test reads the parameter's own numel (`ds_numel`)."""
    seen: dict[int, Any] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    params = list(seen.values())
    b = {"fp16": 2, "bf16": 2, "fp32": 4}.get(zero_dtype or "")

    def elements(p) -> int:
        if b is None or (p.is_floating_point() and zero_dtype != "fp32"):
            return p.numel()
        return -(-p.numel() * p.element_size() // b)

    largest_layer = max((sum(elements(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ParamInventory(
        total_params=sum(elements(p) for p in params),
        trainable_params=sum(elements(p) for p in params if p.requires_grad),
        largest_layer_params=largest_layer,
        largest_param_numel=max((elements(p) for p in params), default=0),
        persistent_params=sum(elements(p) for p in params if p.numel() <= persistence_threshold),
    )


def _offloaded_shard_bytes(model, shard_size: int) -> int:
    """Host bytes per rank under FSDP2's CPUOffloadPolicy: each parameter's shard (1/shard_size, hybrid sharding's
    shard group being one node); a trainable one as fp32 with its fp32 gradient and Adam's two fp32 states (16 B
    per element: accelerate upcasts trainable parameters to fp32 under mixed precision, `fsdp2_prepare_model`), a
    frozen one in its own dtype only (a 4-bit weight: its packed storage; memfit.models.quantization)."""
    seen = {id(p): p for p in model.parameters()}.values()
    return sum(-(-p.numel() // shard_size) * (16 if p.requires_grad else p.element_size()) for p in seen)


def quant_state_bytes(model) -> int:
    """Bytes of the bitsandbytes quantization states of a (meta) model (absmax, code tables, nested states, SCB):
    attributes of the layers, no parameters or buffers, so no engine shards or casts them and every rank holds
    them whole (bitsandbytes nn/modules.py: `Linear4bit.quant_state`, kept on the module for FSDP)."""
    from memfit.models.quantization import quant_state_tensors

    return sum(t.numel() * t.element_size() for t in quant_state_tensors(model))


def ddp_bucket_bytes(model, bucket_cap_mb: float | None) -> list[int]:
    """DDP's bucket sizes in bytes over the model's trainable parameters (module docstring)."""
    from memfit.parallel import _dist_adapter as dadapter

    params, seen = [], set()
    for m in model.modules():  # DDP `_build_params_for_reducer`: module order, requires_grad, shared once
        for p in m.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    cap = int((25.0 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first = dadapter.DDP_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    buckets = dadapter.ddp_bucket_assignment(params, [first, cap])
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]


def _next_id(trace: list[TraceEvent]) -> int:
    return max((e.id for e in trace), default=0) + 1


def _ddp_trace(trace: list[TraceEvent], buckets: list[int], as_view: bool) -> list[TraceEvent]:
    nid = _next_id(trace)
    out: list[TraceEvent] = []
    old = []
    for size in buckets:
        old.append(TraceEvent("alloc", nid, size, "gradients", "setup", "DDP bucket"))
        nid += 1
    grad_ids = set()
    seen_optimizer = False
    rebuilt = False
    inserted = False
    for ev in trace:
        if not inserted and ev.phase != "setup":
            out.extend(old)
            inserted = True
        if ev.phase == "optimizer":
            seen_optimizer = True
        if seen_optimizer and not rebuilt and ev.phase == "forward":
            new = []
            for size in buckets:  # Reducer::rebuild_buckets: new buckets, then the old ones freed
                new.append(TraceEvent("alloc", nid, size, "gradients", "forward", "DDP bucket (rebuilt)"))
                nid += 1
            out.extend(new)
            out.extend(TraceEvent("free", e.id, e.size_bytes, e.category, "forward", e.module) for e in old)
            rebuilt = True
        if as_view and ev.category == "gradients":
            if ev.action == "alloc":
                grad_ids.add(ev.id)
                out.append(TraceEvent("alloc", ev.id, ev.size_bytes, "temporaries", ev.phase, ev.module))
                out.append(TraceEvent("free", ev.id, ev.size_bytes, "temporaries", ev.phase, ev.module))
            continue  # its free at zero_grad: the view goes, the bucket stays
        out.append(ev)
    if not inserted:
        out.extend(old)
    return out


_DROPPED = ("weights", "gradients", "optimizer_state")


def _zero_trace(trace: list[TraceEvent], buffers: list[ZeroBuffer]) -> list[TraceEvent]:
    """The simulated trace with ZeRO's GPU buffers in place of weights, gradients and optimizer state."""
    nid = _next_id(trace)
    gpu = [b for b in buffers if b.device == "gpu" and b.size_bytes > 0]

    def make(lifetime: str, phase: str) -> list[TraceEvent]:
        nonlocal nid
        out_ = []
        for b in gpu:
            if b.lifetime == lifetime:
                out_.append(TraceEvent("alloc", nid, b.size_bytes, b.category, phase, f"DeepSpeed {b.name}"))
                nid += 1
        return out_

    def free(evs: list[TraceEvent], phase: str) -> list[TraceEvent]:
        return [TraceEvent("free", e.id, e.size_bytes, e.category, phase, e.module) for e in evs]

    out: list[TraceEvent] = make("setup", "setup")
    hpz = make("forward_to_step_end", "setup")  # ZeRO++ hpZ secondary partitions
    out.extend(hpz)
    step_made = False
    working: list[TraceEvent] = []    # fwd_bwd: the stage-3 all-gathered working set
    in_bwd: list[TraceEvent] = []     # backward: ipg buffers
    to_step: list[TraceEvent] = []    # backward_to_step: the rank's gradient partition
    prev = "setup"
    for ev in trace:
        phase = ev.phase
        if phase != prev:
            if prev == "backward":
                out.extend(free(in_bwd, prev))
                in_bwd = []
                out.extend(free(working, prev))
                working = []
            if prev == "eval":
                out.extend(free(working, prev))
                working = []
            if phase == "forward" and not hpz:
                hpz = make("forward_to_step_end", phase)
                out.extend(hpz)
            if phase in ("forward", "eval") and not working:
                # stage 3: the module trace is complete after the first optimizer step (not for eval's new order)
                working = make("fwd_bwd" if step_made and phase == "forward" else "fwd_bwd_first", phase)
                out.extend(working)
            if phase == "backward":
                if not to_step:
                    to_step = make("backward_to_step", phase)
                    out.extend(to_step)
                in_bwd = make("backward", phase)
                out.extend(in_bwd)
            if phase == "optimizer":
                if not step_made:
                    out.extend(make("step", phase))
                    step_made = True
                temps = make("step_temp", phase)
                out.extend(temps)
                out.extend(free(temps, phase))
                out.extend(free(to_step, phase))
                to_step = []
                out.extend(free(hpz, phase))  # stage3.py _post_step: invalidate_secondary_tensor
                hpz = []
            prev = phase
        if ev.category in _DROPPED or phase == "optimizer":
            continue
        out.append(ev)
    out.extend(free(in_bwd + working + to_step + hpz, prev))
    return out


def _zero2_layouts(model, world_size: int):
    """ZeRO-2's per-rank gradient partitions for this model (memfit.parallel.zero.zero2_rank_layouts), over the
    Trainer's param groups (decay, then no decay: memfit.sim.optimizers.build_optimizer)."""
    from memfit.parallel.zero import zero2_rank_layouts
    from memfit.sim.optimizers import decay_parameter_names

    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [[p.numel() for n, p in named if n in decay], [p.numel() for n, p in named if n not in decay]]
    return zero2_rank_layouts([g for g in groups if g], world_size)


def _per_rank_zero2(sim_trace, buffers, layouts, b: int):
    """(rank 0's trace and buffers, the distinct layouts with their ranks and trace peaks, the other layouts'
    traces by their first rank)."""
    from dataclasses import replace as _replace

    from memfit.peaks import peaks

    distinct: dict[int, list[int]] = {}
    for lay in layouts:
        distinct.setdefault(lay.grads_in_partition_numel, []).append(lay.rank)
    out, rank0, others = [], None, {}
    for numel, ranks in distinct.items():
        bufs = [_replace(x, size_bytes=b * numel) if x.name == "grads_in_partition" else x for x in buffers]
        trace = _zero_trace(sim_trace, bufs)
        out.append({"ranks": ranks, "peak_allocated_bytes": peaks(trace).overall.bytes,
                    "grads_in_partition_bytes": b * numel})
        if 0 in ranks:
            rank0 = (trace, bufs)
        else:
            others[ranks[0]] = trace
    out.sort(key=lambda d: d["ranks"][0])
    return rank0[0], rank0[1], out, others


def simulate_rank(setup: TrainSetup, parallel: ParallelSetup, *, gpu: GpuSpec | None = None) -> RankResult:
    """Rank 0's trace under `parallel` and what it holds beyond it (module docstring); `gpu`: the target
    GPU's GpuSpec, as memfit.sim.engine.simulate takes it."""
    setup = resolve(setup)
    nccl = nccl_buffer_bytes(parallel.world_size, parallel.nodes)
    hybrid = parallel.strategy == "fsdp" and parallel.hybrid_shard
    if hybrid:  # the shard and replicate groups' communicators
        nccl += hybrid_group_nccl_bytes(parallel.gpus_per_node, parallel.nodes)
    notes = list(parallel.notes)
    if nccl:
        notes.append(f"NCCL buffers ({nccl // 2**20} MiB per rank, an estimate: memfit.parallel.nccl) are counted "
                     "outside PyTorch")
    if parallel.strategy == "fsdp":
        from memfit.parallel.fsdp import simulate_fsdp

        sim = simulate_fsdp(setup, parallel, gpu=gpu)
        host = 0
        if parallel.cpu_offload:
            host = _offloaded_shard_bytes(_meta_model(setup), parallel.shard_size)
        return RankResult(sim, host_bytes=host, nccl_bytes=nccl, notes=notes)
    if parallel.strategy == "ddp":
        model = _meta_model(setup)
        buckets = ddp_bucket_bytes(model, parallel.bucket_cap_mb)
        sim = _simulated(setup, gpu)
        sim.trace = _ddp_trace(sim.trace, buckets, parallel.gradient_as_bucket_view)
        notes.append(f"DDP: {len(buckets)} gradient buckets of {sum(buckets) / 2**20:.1f} MiB in all"
                     + (" (gradient_as_bucket_view: the gradients are views of them)"
                        if parallel.gradient_as_bucket_view else " (a second copy of the gradients)"))
        return RankResult(sim, nccl_bytes=nccl, buffers=[{"name": "DDP buckets", "sizes_bytes": buckets}], notes=notes)
    z = parallel.zero
    dtype = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}[z.dtype]
    base = setup.replace(precision="fp32", weights_dtype=dtype)
    model = _meta_model(base)
    inv = param_inventory(model, z.param_persistence_threshold if z.stage == 3 else 0, zero_dtype=dtype)
    buffers = zero_buffers(z, inv, parallel.world_size, gpus_per_node=parallel.gpus_per_node)
    if setup.load_in_4bit or setup.load_in_8bit:  # the simulated trace's quant states go with its weights
        buffers.append(ZeroBuffer("bitsandbytes quantization states (whole on every rank)", quant_state_bytes(model),
                                  "gpu", "setup", "weights", "bitsandbytes Linear4bit.quant_state / Int8Params.SCB: "
                                  "layer attributes, neither partitioned nor cast by DeepSpeed"))
    sim = _simulated(base, gpu)
    ranks: list[dict[str, Any]] = []
    rank_traces: dict[int, list[TraceEvent]] = {}
    if z.stage == 2 and z.contiguous_gradients and not z.offload_optimizer and parallel.world_size > 1:
        # each rank's grads_in_partition has its own size and creation point
        layouts = _zero2_layouts(model, parallel.world_size)
        b = {"fp16": 2, "bf16": 2, "fp32": 4}[z.dtype]
        sim.trace, buffers, ranks, rank_traces = _per_rank_zero2(sim.trace, buffers, layouts, b)
        if len(ranks) > 1:
            worst = max(ranks, key=lambda d: d["peak_allocated_bytes"])
            notes.append(f"ZeRO-2 ranks differ (each rank's gradient partition buffer holds the whole parameters its "
                         f"partition cuts: stage_1_and_2.py copy_grads_in_partition): rank 0 peaks at "
                         f"{ranks[0]['peak_allocated_bytes'] / 2**20:.1f} MiB allocated, rank {worst['ranks'][0]} "
                         f"(the worst) at {worst['peak_allocated_bytes'] / 2**20:.1f} MiB (their traces' peaks before "
                         "the cuBLAS workspaces an estimate adds)")
        else:
            ranks, rank_traces = [], {}
    else:
        sim.trace = _zero_trace(sim.trace, buffers)
    cpu, gpu = deepspeed_model_states_bytes(z.stage, inv, gpus_per_node=parallel.gpus_per_node, nodes=parallel.nodes,
                                            offload_optimizer=z.offload_optimizer, offload_param=z.offload_param)
    host = sum(b.size_bytes for b in buffers if b.device == "host")
    if setup.precision != "fp32" and z.dtype == "fp32":
        notes.append(f"the DeepSpeed config enables neither fp16 nor bf16: DeepSpeed trains in fp32, and the "
                     f"Trainer's `{setup.precision}` is not applied to the model")
    frozen = (f"; here {100 * inv.trainable_params / inv.total_params:.1f} % of the parameters train, so it "
              "overstates their states" if inv.total_params and inv.trainable_params < inv.total_params else "")
    notes.append(f"DeepSpeed ZeRO-{z.stage} emulated from its source (memfit.parallel.zero). DeepSpeed's own "
                 f"model-state estimator (estimate_zero{3 if z.stage == 3 else 2}_model_states_mem_needs) says "
                 f"{gpu / 2**30:.2f} GiB per GPU, {cpu / 2**30:.2f} GiB host: another quantity, the model states "
                 "alone (no activations, temporaries or buffers) with every parameter counted as trained (18 B each: "
                 f"16-bit weight, gradient, fp32 master and Adam states){frozen}")
    return RankResult(sim, host_bytes=host, nccl_bytes=nccl,
                      buffers=[{"name": b.name, "bytes": b.size_bytes, "device": b.device, "lifetime": b.lifetime,
                                "rule": b.rule} for b in buffers],
                      deepspeed_model_states={"cpu_bytes": cpu, "gpu_bytes": gpu}, notes=notes, ranks=ranks,
                      rank_traces=rank_traces)
