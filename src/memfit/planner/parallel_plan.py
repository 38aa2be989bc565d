"""`memfit.planner.parallel_plan.plan_parallel`: the fastest way to spread a run over the GPUs a user has.

Search space: a strategy (memfit.planner.launch.VARIANTS: DDP, ZeRO-1/2, FSDP2 shard_grad_op and
full_shard, ZeRO-3; CPU offload of the optimizer / parameters as a last resort, tried only when nothing on
the GPUs fits), gradient checkpointing (the setup's and, where it applies, on), the kernels
(memfit.planner.search's kernel axis: FlashAttention-2 / Liger where GPU, model and packages allow), and
the micro-batch. The global batch stays the user's: `per_device_train_batch_size x
gradient_accumulation_steps x world size` (or `global_batch` when given, for a budget of GPU kinds), so
each rank keeps `global / world` samples per optimizer step split into micro-batch x accumulation, as the
single-GPU planner keeps the effective batch exactly.

Memory: every candidate that is counted as fitting was simulated as rank 0 sees it
(memfit.estimator.estimate with the candidate's `ParallelSetup`, memfit.parallel.rank) and replayed through
the allocator with the budget as its capacity: the GPU's total less the margin, less memfit's table of
memory outside PyTorch and NCCL's buffers (memfit.parallel.nccl); when it does not fit, replayed again with
`expandable_segments:True`, then `max_split_size_mb:128`, as the single-GPU planner does
(memfit.planner.search `_verified_plan`).

Speed: per rank, the compute of memfit.planner.throughput (micro-step forward + backward; the optimizer's
pass over the rank's shard of the parameters, or on the CPU with offload) plus the communication of
memfit.planner.comm (volumes per strategy, link bandwidths of memfit.gpus.interconnect, what compute
hides), in modelled seconds per optimizer step. The modelled step time falls as the micro-batch grows
(the small-batch inefficiency and the per-micro-step collectives both shrink), and memory rises with it;
so per strategy / checkpointing / kernels group the fastest fitting candidate is the largest micro-batch
that fits, found by bisection over the micro-batches, and a group whose largest micro-batch cannot beat
the best found is not simulated (branch and bound). Modelled times within `TIE_FRACTION` of each other are
a tie that the simpler strategy wins. A strategy whose leanest candidate (checkpointing on,
leaner kernels, micro-batch 1) does not fit is dropped after that one simulation, and a candidate is not
simulated when a leaner one of its strategy (checkpointing on where it is off, leaner kernels) already failed
at its micro-batch or a smaller one (memory grows with the micro-batch and shrinks with either remedy).

Precision and optimizer (`_families`): each strategy is also tried in mixed precision where
memfit.remedies.mixed_precision applies (bf16 on compute capability 8.0+, else fp16; for ZeRO the DeepSpeed
dtype, for FSDP2 the MixedPrecisionPolicy accelerate sets from it) and, only when nothing with the setup's
optimizer fits, with memfit.remedies.optimizer's 8-bit AdamW / Adafactor (not the paged ones: their state is
outside PyTorch's allocator), where the strategy's per-rank simulation models them (`_optimizer_refusal`).
Leanness and the dropping of a strategy are judged within one precision / optimizer family.

Opt-ins (`allow`): the single-GPU remedies' truncation, LoRA, freezing and QLoRA variants, each alone, tried
only when nothing without them fits, verified per rank as the others; QLoRA under FSDP / ZeRO with its 4-bit
storage in the compute dtype (`_sharded_qlora`).

GRPO and RLOO (the trainers that generate) are planned by memfit.planner.grpo_parallel_plan: vLLM colocated on
every rank against a `trl vllm-serve` server on k of the GPUs, with these strategies on the training ranks.

Known limitations: the memory of a candidate is rank 0's (memfit.parallel); opt-ins are not combined with each
other or with another optimizer; the step time is a model (its assumptions are in
memfit.planner.throughput and memfit.planner.comm), meant to rank candidates, not to predict seconds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from memfit import progress
from memfit.errors import MemfitError
from memfit.gpus.catalog import GpuSpec, as_gpu_spec
from memfit.gpus.interconnect import Interconnect, interconnect_for
from memfit.planner.comm import Collective, StepTime, collectives, comm_step_time
from memfit.planner.launch import HYBRID_VARIANTS, VARIANTS, Launch, Variant, launch_for, parallel_setup_for
from memfit.planner.throughput import StepCost, step_time_s
from memfit.train_setup import TrainSetup

__all__ = ["ParallelCandidate", "ParallelPlanResult", "plan_parallel", "plan_gpu_budget", "parse_gpu_budget",
           "DEFAULT_MAX_SIMULATIONS"]

#: modelled step times closer than this fraction are a tie, which the simpler strategy (earlier in
#: memfit.planner.launch.VARIANTS: DDP, ZeRO-1, ZeRO-2, FSDP2, ZeRO-3) wins: the step-time model rests on
#: assumed efficiencies (memfit.planner.throughput, memfit.planner.comm) and does not resolve smaller differences,
#: and it leaves out the sharded engines' own overheads (per-group hooks, copy-in / copy-out, CPU launch cost)
TIE_FRACTION = 0.05

#: simulations one plan may run before it stops with the best found so far (each is a full per-rank estimate)
DEFAULT_MAX_SIMULATIONS = 24


@dataclass(frozen=True)
class ParallelCandidate:
    """One simulated candidate: strategy, the TrainSetup changes, rank 0's memory and the modelled step."""

    variant: str
    strategy: str  #: label, e.g. "ZeRO-3" or "FSDP2 full_shard"
    setup_changes: dict[str, Any]
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    fits: bool
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int  #: reserved + memory outside PyTorch (NCCL's buffers included): nvidia-smi per GPU
    headroom_bytes: int  #: budget minus what rank 0 needs; negative: how much it is short
    host_bytes_per_node: int  #: host memory offload needs on each node
    step: StepTime
    alloc_conf: str | None = None  #: PYTORCH_CUDA_ALLOC_CONF that makes it fit, when one is needed
    collectives: list[dict[str, Any]] = field(default_factory=list)
    checkpointing: str | None = None  #: whose gradient checkpointing the simulation used (the report's)
    #: GRPO / RLOO (memfit.planner.grpo_parallel_plan): where generation runs (vLLM colocated or a server on k GPUs),
    #: the training ranks, the completions per rank and the vLLM budgets; None for the other trainers
    generation: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["step"] = self.step.to_json()
        return out


@dataclass(frozen=True)
class ParallelPlanResult:
    gpu: dict[str, Any]
    world_size: int
    nodes: int
    interconnect: dict[str, Any]
    global_batch: int
    per_rank_batch: int
    budget_bytes: int  #: the GPU's total less the margin
    capacity_bytes: int  #: what PyTorch's allocator may use on each GPU (budget less memory outside PyTorch)
    margin: float
    candidates: list[ParallelCandidate]  #: every simulated candidate, in the order simulated
    chosen: int | None  #: index into `candidates`
    launch: Launch | None
    simulations: int
    elapsed_s: float
    notes: list[str]
    config_class: str = "TrainingArguments"  #: the class the change is named in (GRPOConfig / RLOOConfig for those)

    @property
    def chosen_candidate(self) -> ParallelCandidate | None:
        return None if self.chosen is None else self.candidates[self.chosen]

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("gpu", "world_size", "nodes", "interconnect", "global_batch",
                                              "per_rank_batch", "budget_bytes", "capacity_bytes", "margin",
                                              "chosen", "simulations", "elapsed_s", "notes", "config_class")}
        out["candidates"] = [c.to_json() for c in self.candidates]
        out["launch"] = None if self.launch is None else self.launch.to_json()
        out["schema"] = "memfit.plan.parallel/1"
        return out


@dataclass(frozen=True)
class _Group:
    variant: Variant
    order: int
    changes: dict[str, Any]  #: precision, optimizer, checkpointing and kernel changes
    lean: tuple[int, int]  #: (checkpointing, kernels) index on each axis: higher is leaner
    family: tuple = ()  #: the precision / optimizer changes, sorted: leanness compares within one family only
    method: int = 0  #: 0: the setup's method; 1: another optimizer; 2: an `--allow` opt-in (as memfit.planner.search)

    @property
    def lean_rank(self) -> int:
        return sum(self.lean)

    @property
    def dead_key(self) -> tuple:
        return (self.variant.key, self.family)

    @property
    def rank_tier(self) -> tuple[int, int]:
        """What is preferred before speed: the setup's optimizer, then another one, then the opt-ins; within each,
        the GPUs alone before CPU offload."""
        return (self.method, self.variant.tier)

    def leaner_or_equal(self, other: "_Group") -> bool:
        return (self.variant.key == other.variant.key and self.family == other.family
                and all(a >= b for a, b in zip(self.lean, other.lean)))


@dataclass
class _Model:
    """What the step-time model needs of the model."""

    params: int
    trainable_params: int
    weight_bytes_per_param: int
    hidden_size: int | None
    n_layer: int
    d_model: int


def _model_facts(setup: TrainSetup, spec: GpuSpec) -> _Model:
    from memfit.models.build import resolve_config
    from memfit.models.catalog import hidden_size
    from memfit.parallel.rank import _meta_model, param_inventory
    from memfit.planner.ranking import StepTimer

    model = _meta_model(setup)
    inv = param_inventory(model)
    elem = next(iter(model.parameters())).element_size()
    cfg = resolve_config(setup.model).config
    hidden = hidden_size(cfg)
    timer = StepTimer.for_setup(setup, spec)  # the model's depth and width
    return _Model(inv.total_params, inv.trainable_params, elem, hidden, timer.n_layer, timer.d_model)


_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _step(v: Variant, par, s: TrainSetup, m: _Model, spec: GpuSpec, ic: Interconnect, nodes: int
          ) -> tuple[StepTime, list[Collective]]:
    """The modelled step of rank 0 of a candidate (module docstring)."""
    n = par.world_size
    precision = s.precision
    if v.strategy.startswith("zero"):
        precision = par.zero.dtype  # DeepSpeed casts the model; the Trainer's autocast is not used
        gather = grad = _DTYPE_BYTES[par.zero.dtype]
    elif v.strategy == "fsdp":
        gather = _DTYPE_BYTES[par.param_dtype] if par.param_dtype else m.weight_bytes_per_param
        grad = _DTYPE_BYTES[par.reduce_dtype] if par.reduce_dtype else gather
    else:
        gather = grad = m.weight_bytes_per_param
    b, a = s.per_device_train_batch_size, s.gradient_accumulation_steps
    cost = StepCost(m.params, m.trainable_params, m.n_layer, m.d_model, s.sequence_length, b, 1, precision,
                    s.gradient_checkpointing, s.optim)
    opt_gpu = step_time_s(dataclasses.replace(cost, accumulation=0), spec)
    micro = step_time_s(cost, spec) - opt_gpu
    if v.strategy == "ddp":
        opt = opt_gpu
    elif v.cpu_offload or v.offload_optimizer:
        from memfit.planner.comm import HOST_OPTIMIZER_GBPS

        opt = opt_gpu * spec.memory_bandwidth_gbps / HOST_OPTIMIZER_GBPS / n  # the rank's shard, on the CPU
    else:
        opt = opt_gpu / n  # the rank's shard
    z = par.zero
    colls = collectives(strategy=v.strategy, world_size=n, param_bytes=m.params * gather,
                        grad_bytes=m.trainable_params * grad, reshard_after_forward=par.reshard_after_forward,
                        cpu_offload=par.cpu_offload, offload_optimizer=bool(z and z.offload_optimizer),
                        offload_param=bool(z and z.offload_param), overlap_comm=bool(z.overlap_comm) if z else True,
                        groups=m.n_layer + 1, ddp_bucket_bytes=int((par.bucket_cap_mb or 25.0) * 2**20),
                        reduce_bucket_bytes=z.reduce_bucket_size * grad if z else None,
                        allgather_bucket_bytes=z.allgather_bucket_size * gather if z else None,
                        hybrid=v.hybrid, gpus_per_node=par.gpus_per_node)
    return comm_step_time(colls, micro_compute_s=micro, accumulation=a, optimizer_s=opt, ic=ic, nodes=nodes), colls


#: what the `--allow` opt-ins bring across GPUs: the single-GPU remedies' own variants (memfit.remedies), each alone
_OPT_INS = ("truncation", "lora", "freeze", "qlora")


def _refusal(strategy: str, family: dict[str, Any]) -> str | None:
    """Why a strategy's per-rank simulation does not model a precision / optimizer / opt-in family (None: it does).
    QLoRA is searched under every strategy, sharded as `_sharded_qlora` sets it up."""
    return _optimizer_refusal(strategy, family["optim"]) if "optim" in family else None


#: `bnb_4bit_quant_storage` of sharded QLoRA per compute dtype (peft docs/source/accelerate/fsdp.md, "Use PEFT QLoRA
#: and FSDP": bfloat16 storage for bf16 training, float32 for fp16 mixed precision; the same for DeepSpeed ZeRO-3,
#: docs/source/accelerate/deepspeed.md)
_SHARDED_QUANT_STORAGE = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float32", "float16": "float32",
                          "fp32": "float32", "float32": "float32"}


def _sharded_qlora(strategy: str, family: dict[str, Any]) -> dict[str, Any]:
    """The QLoRA family as a sharded run sets it up: under FSDP or ZeRO the 4-bit weights are stored in the compute
    dtype so the engine shards them as ordinary storage (memfit.parallel.fsdp: FSDP2 leaves uint8 ones whole, FSDP1
    refuses them), and peft's `prepare_model_for_kbit_training` is not run (TRL's SFTTrainer skips it for sharded
    QLoRA, `_prepare_peft_model`: `is_sharded_qlora`; its fp32 casts cannot share an FSDP1 unit with the bf16
    storage). DDP keeps the family as it is."""
    if not family.get("load_in_4bit") or strategy == "ddp":
        return family
    storage = _SHARDED_QUANT_STORAGE.get(str(family.get("bnb_4bit_compute_dtype")), "bfloat16")
    return {**family, "bnb_4bit_quant_storage": storage, "kbit_prep": False}


def _optimizer_refusal(strategy: str, optim: str) -> str | None:
    """Why a strategy's per-rank simulation does not model `optim` (None: it does).

    * ZeRO: memfit.parallel.zero `zero_buffers` lays out AdamW's fp32 master, exp_avg and exp_avg_sq partitions
      (DeepSpeed's FusedAdam / DeepSpeedCPUAdam); a client optimizer's state is not modelled.
    * FSDP2 + Adafactor: transformers' Adafactor (optimization.py `Adafactor.step`) mixes plain tensors into the
      DTensor shards' update; memfit's run of FSDP2's real code stops there with "aten.add_.Tensor got mixed
      torch.Tensor and DTensor".
    """
    if strategy.startswith("zero"):
        return (f"DeepSpeed ZeRO with `{optim}`: memfit.parallel.zero models AdamW's partitioned state, not a client "
                "optimizer's")
    if strategy == "fsdp" and optim == "adafactor":
        return ("FSDP2 with `adafactor`: transformers' Adafactor mixes plain tensors with FSDP2's DTensor shards "
                "(aten.add_ got mixed torch.Tensor and DTensor)")
    return None


def _network_bound(ic: Interconnect, nodes: int) -> bool:
    """The network is the bottleneck: a flat collective over the nodes runs slower than one within a node
    (memfit.planner.comm `gpu_link_bytes_per_s`), so hybrid sharding is worth a candidate."""
    from memfit.planner.comm import gpu_link_bytes_per_s

    return gpu_link_bytes_per_s(ic, nodes) < gpu_link_bytes_per_s(ic, 1)


def _families(setup: TrainSetup, spec: GpuSpec, allow: tuple[str, ...] = ()) -> list[tuple[dict[str, Any], int]]:
    """(precision / optimizer / opt-in changes, method) the search crosses with each strategy.

    Precision: the setup's and, when memfit.remedies.mixed_precision applies (an fp32 setup), its variant (bf16 on
    compute capability 8.0+, else fp16). Optimizer: the setup's, then (method 1, tried only when nothing with the
    setup's optimizer fits) memfit.remedies.optimizer's 8-bit AdamW / Adafactor. Opt-ins (method 2, only when
    nothing else fits, and only those in `allow`): each variant of the single-GPU remedies of `_OPT_INS` that
    apply, alone, with the setup's optimizer, in each precision; QLoRA with memfit.remedies.lora's adapters (a
    4-bit base trains only through them).
    """
    from memfit.remedies import REGISTRY

    from memfit.remedies.optimizer import smaller_optimizers

    mp = REGISTRY["mixed_precision"]
    precisions: list[dict[str, Any]] = [{}]
    if mp.check(setup, spec).applies:
        precisions += mp.variants(setup, spec)
    # the optimizer remedy's smaller optimizers, less the paged ones: their state lives in CUDA managed memory outside
    # PyTorch's allocator, which the per-rank budget does not model
    optims: list[dict[str, Any]] = [{}] + [{"optim": o} for o in smaller_optimizers(setup.optim, paged=False)]
    out = [({**p, **o}, 1 if o else 0) for o in optims for p in precisions]
    for name in _OPT_INS:
        r = REGISTRY[name]
        if name not in allow or not r.check(setup, spec).applies:
            continue
        for var in r.variants(setup, spec):
            if name == "qlora":
                var = {**var, **REGISTRY["lora"].variants(setup, spec)[0]}
            out += [({**p, **var}, 2) for p in precisions]
    return out


def _axes(setup: TrainSetup, spec: GpuSpec) -> list[tuple[dict[str, Any], tuple[int, int]]]:
    """(checkpointing + kernel changes, leanness) of the single-GPU remedies that still apply under sharding."""
    from memfit.planner.search import _kernel_axis
    from memfit.remedies import REGISTRY

    verdicts = {name: r.check(setup, spec) for name, r in REGISTRY.items()}
    ckpts = [{}]
    if verdicts["gradient_checkpointing"].applies:
        ckpts.append(REGISTRY["gradient_checkpointing"].variants(setup, spec)[0])
    kernels = [k for k in _kernel_axis(setup, spec, verdicts, allow=(), exclude=()) if "load_in_4bit" not in k]
    if setup.precision == "fp32":  # FlashAttention-2 runs in fp16/bf16 only
        kernels = [k for k in kernels if "attn_implementation" not in k] or [{}]
        kernels = [k for i, k in enumerate(kernels) if k not in kernels[:i]]
    out = []
    for i, c in enumerate(ckpts):
        for j, k in enumerate(kernels):
            out.append(({**c, **k}, (i, j)))
    return out


@dataclass(frozen=True)
class _Request:
    """What `plan_parallel` was asked, checked: the GPUs, the batch per rank, the memory each rank may use."""

    spec: GpuSpec
    world_size: int
    nodes: int
    interconnect: Interconnect
    global_batch: int
    per_rank: int
    micro_batches: tuple[int, ...]  #: the divisors of `per_rank`, ascending
    margin: float
    budget_bytes: int
    capacity_bytes: int  #: the budget less memory outside PyTorch and NCCL's buffers
    allow: tuple[str, ...]
    strategies: tuple[str, ...]


def _no_split(global_batch: int, world_size: int) -> MemfitError:
    return MemfitError(f"global batch `{global_batch}` does not split over `{world_size}` GPUs; give a multiple "
                       f"of {world_size}")


def _request(setup: TrainSetup, *, gpus, gpu, world_size, nodes, global_batch, margin, strategies, interconnect,
             network_gbps, max_simulations, allow) -> _Request:
    """The checks of `plan_parallel`'s arguments, each a one-line MemfitError, and what follows from them."""
    from memfit.gpus.outside_pytorch import non_pytorch_bytes
    from memfit.parallel.nccl import nccl_buffer_bytes
    from memfit.parallel.setup import STRATEGIES, ParallelSetup, parse_gpus
    from memfit.planner.search import DEFAULT_MARGIN, _check_options

    margin = DEFAULT_MARGIN if margin is None else margin
    if not 0 <= margin < 0.5:
        raise MemfitError(f"margin `{margin}` must be between 0 and 0.5 (a fraction of each GPU kept free)")
    allow = _check_options(margin=margin, allow=tuple(allow), exclude=())
    if "offload" in allow and setup.trainer not in ("grpo", "rloo"):  # GRPO / RLOO: grpo_plan.check_grpo_allow
        raise MemfitError("`--allow offload` with --gpus: the plan already tries the engines' own CPU offload (ZeRO "
                          "offload_optimizer / offload_param, FSDP2 CPUOffloadPolicy) when nothing fits; drop it")
    if gpus is not None:
        count, name = parse_gpus(gpus)
        if world_size is not None and world_size != count:
            raise MemfitError(f"--gpus `{gpus}` and --world-size `{world_size}` differ; give one of them")
        if gpu is not None and str(gpu) != name:
            raise MemfitError(f"--gpu `{gpu}` and --gpus `{gpus}` name different GPUs; give one")
        world_size, gpu = count, name
    if gpu is None or world_size is None:
        raise MemfitError("a multi-GPU plan needs the GPUs: pass `--gpus 4xA100-40GB` (or `--world-size 4 --gpu "
                          "A100-40GB`)")
    ParallelSetup(world_size=world_size, nodes=nodes)  # the world size / nodes checks, one-line errors
    if isinstance(max_simulations, bool) or not isinstance(max_simulations, int) or max_simulations < 1:
        raise MemfitError(f"max_simulations `{max_simulations!r}` must be a whole number of at least 1")
    allowed = tuple(strategies) if strategies else STRATEGIES
    bad = [s for s in allowed if s not in STRATEGIES]
    if bad:
        raise MemfitError(f"strategy `{bad[0]}` is not one of {', '.join(STRATEGIES)}")
    spec = as_gpu_spec(gpu, required=True)
    ic = interconnect_for(spec.name, kind=interconnect, network_gbps=network_gbps)
    global_batch = setup.effective_batch_size * world_size if global_batch is None else global_batch
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise MemfitError(f"global batch `{global_batch!r}` must be a whole number of samples")
    if global_batch % world_size:
        raise _no_split(global_batch, world_size)
    per_rank = global_batch // world_size
    budget = int(spec.total_bytes * (1 - margin))
    capacity = budget - non_pytorch_bytes(spec).total_bytes - nccl_buffer_bytes(world_size, nodes)
    if capacity <= 0:
        raise MemfitError(f"gpu `{spec.name}` leaves no memory to PyTorch with margin {margin}; use a larger GPU")
    return _Request(spec, world_size, nodes, ic, global_batch, per_rank,
                    tuple(b for b in range(1, per_rank + 1) if per_rank % b == 0), margin, budget, capacity,
                    allow, allowed)


class _Search:
    """The branch-and-bound search of the module docstring over `groups`, simulating rank 0 of each candidate."""

    def __init__(self, setup: TrainSetup, req: _Request, variants: list[Variant], families, m: _Model,
                 alloc_conf: str | None, max_simulations: int):
        self.setup, self.req, self.m = setup, req, m
        self.alloc_conf, self.max_simulations = alloc_conf, max_simulations
        self.pars = {(v.key, setup.replace(**fam).precision): parallel_setup_for(
            v, world_size=req.world_size, nodes=req.nodes, hidden_size=m.hidden_size,
            precision=setup.replace(**fam).precision) for v in variants for fam, _ in families}
        self.candidates: list[ParallelCandidate] = []
        self.tried: dict[tuple, ParallelCandidate] = {}
        self.refused: list[str] = []
        self.refused_keys: set[tuple] = set()
        self.failed: list[tuple[_Group, int, ParallelCandidate]] = []
        self.sims = 0
        self.best: ParallelCandidate | None = None
        self.best_rank: tuple = ((0, 0), 0)  # (rank_tier, order) of the best's group

    def changed(self, group: _Group, b: int) -> TrainSetup:
        return self.setup.replace(**group.changes, per_device_train_batch_size=b,
                                  gradient_accumulation_steps=self.req.per_rank // b)

    def par_of(self, group: _Group):
        return self.pars[(group.variant.key, group.changes.get("precision", self.setup.precision))]

    def modelled(self, group: _Group, b: int) -> tuple[StepTime, list[Collective]]:
        r = self.req
        return _step(group.variant, self.par_of(group), self.changed(group, b), self.m, r.spec, r.interconnect,
                     r.nodes)

    def could_beat(self, g: _Group, t: float) -> bool:
        """A candidate of `g` taking `t` would replace the best (module docstring: TIE_FRACTION)."""
        best = self.best
        if best is None:
            return True
        if g.rank_tier != self.best_rank[0]:
            return g.rank_tier < self.best_rank[0]
        limit = best.step.total_s * ((1 + TIE_FRACTION) if g.order < self.best_rank[1] else (1 - TIE_FRACTION))
        return t < limit or (g.order == self.best_rank[1] and t < best.step.total_s)

    @staticmethod
    def _key(group: _Group, b: int) -> tuple:
        return group.variant.key, tuple(sorted(group.changes.items())), b

    def _answered(self, group: _Group, b: int) -> tuple[bool, ParallelCandidate | None]:
        """(True, what `simulate` returns) when it needs no simulation: tried, refused, or a leaner group of the
        strategy failed at this micro-batch or a smaller one."""
        key = self._key(group, b)
        if key in self.tried:
            return True, self.tried[key]
        if key in self.refused_keys:
            return True, None
        for other, ob, oc in self.failed:
            if other.leaner_or_equal(group) and ob <= b:
                return True, oc
        return False, None

    def simulate(self, group: _Group, b: int) -> ParallelCandidate | None:
        """Rank 0 of `group` at micro-batch `b`, replayed within the capacity; None: the simulation refuses it."""
        from memfit.allocator.bounded import bounded_reserved
        from memfit.allocator.conf import parse_alloc_conf
        from memfit.estimator import estimate

        key = self._key(group, b)
        answered, known = self._answered(group, b)
        if answered:
            return known
        s, per_rank, capacity, alloc_conf = self.changed(group, b), self.req.per_rank, self.req.capacity_bytes, \
            self.alloc_conf
        progress.report(f"{group.variant.label}, batch {b}" + "".join(f", {k}={v}" for k, v in group.changes.items()),
                        self.sims, self.max_simulations)
        self.sims += 1
        try:
            report = estimate(s, gpu=self.req.spec, parallel=self.par_of(group), capacity_bytes=capacity,
                              alloc_conf=alloc_conf)
        except MemfitError as err:  # a combination the simulation refuses (e.g. a kernel the engine's dtype lacks)
            self.refused.append(f"{group.variant.label} with {group.changes or 'the setup as is'}: {err}")
            self.refused_keys.add(key)
            return None
        fits, reserved, env = report.fits is True, report.peak_reserved_bytes, None
        if not fits and report.trace is not None:
            for text in ("expandable_segments:True", "max_split_size_mb:128"):  # as search._verified_plan
                base_conf = f"{alloc_conf},{text}" if alloc_conf else text
                alt = bounded_reserved(report.trace, conf=parse_alloc_conf(base_conf), capacity_bytes=capacity,
                                       search=False)
                if alt.oom is None:
                    fits, reserved, env = True, alt.report.peak_reserved_bytes, base_conf
                    break
        if fits:
            headroom = capacity - reserved
        elif report.shortfall_bytes is not None:
            headroom = -report.shortfall_bytes  # what it needs beyond the capacity
        else:
            headroom = capacity - reserved
        st, colls = self.modelled(group, b)
        ch = {k: v for k, v in dict(group.changes, per_device_train_batch_size=b,
                                     gradient_accumulation_steps=per_rank // b).items() if getattr(self.setup, k) != v}
        c = ParallelCandidate(group.variant.key, group.variant.label, ch, b, per_rank // b, fits,
                              report.peak_allocated_bytes, reserved, reserved + report.non_pytorch_bytes, headroom,
                              (report.parallel or {}).get("host_bytes_per_node", 0), st, env,
                              [x.to_json(per_rank // b) for x in colls], report.checkpointing)
        self.tried[key] = c
        self.candidates.append(c)
        if not fits:
            self.failed.append((group, b, c))
        return c

    def run(self, groups: list[_Group]) -> bool:
        """Search `groups` in order; True when it stopped at `max_simulations`."""
        micro_batches, dead = self.req.micro_batches, set()
        for g in groups:
            if g.dead_key in dead:
                continue
            if not self.could_beat(g, self.modelled(g, micro_batches[-1])[0].total_s):
                continue
            if self.sims >= self.max_simulations:
                return True
            worth = [b for b in micro_batches if self.could_beat(g, self.modelled(g, b)[0].total_s)]
            if not worth:
                continue
            found = None
            first = self.simulate(g, worth[-1])
            if first is None:
                continue  # refused: the group does not apply
            if first.fits:  # the largest first: often enough
                found = worth[-1]
            else:
                kin = [x for x in groups if x.dead_key == g.dead_key]
                lean_group = max(kin, key=lambda x: x.lean_rank)
                lean = self.simulate(lean_group, micro_batches[0]) if self.sims < self.max_simulations else None
                if lean is not None and not lean.fits:
                    dead.add(g.dead_key)  # its leanest candidate does not fit: nothing of this strategy / family does
                    continue
                lo, hi = 0, len(worth) - 2
                while lo <= hi and self.sims < self.max_simulations:
                    mid = (lo + hi + 1) // 2
                    c = self.simulate(g, worth[mid])
                    if c is not None and c.fits:
                        found, lo = worth[mid], mid + 1
                    else:
                        hi = mid - 1
            if found is not None:
                c = self.tried[(g.variant.key, tuple(sorted(g.changes.items())), found)]
                if self.could_beat(g, c.step.total_s):
                    self.best, self.best_rank = c, (g.rank_tier, g.order)
        return False


def plan_parallel(setup: TrainSetup | str, *, gpus: str | None = None, gpu: str | GpuSpec | None = None,
                  world_size: int | None = None, nodes: int = 1, global_batch: int | None = None,
                  margin: float | None = None, strategies: tuple[str, ...] | list[str] | None = None,
                  interconnect: str | None = None, network_gbps: float | None = None,
                  alloc_conf: str | None = None, max_simulations: int = DEFAULT_MAX_SIMULATIONS,
                  script: str = "train.py", allow: tuple[str, ...] | list[str] = (),
                  vllm_server_gpus: int | None = None) -> ParallelPlanResult:
    """The fastest strategy, micro-batch and single-GPU remedies that fit each of `world_size` GPUs.

    Args:
        setup: a TrainSetup or a model id; its batch x accumulation is per GPU.
        gpus: `COUNTxGPU`, e.g. `4xA100-40GB` (or give `gpu` and `world_size`).
        gpu: catalog name, size or GpuSpec of each GPU.
        world_size: GPUs in all.
        nodes: nodes the GPUs are spread over (the same number on each).
        global_batch: samples per optimizer step over all GPUs; None: the setup's batch x accumulation x world size.
        margin: fraction of each GPU kept free (default memfit.planner.search.DEFAULT_MARGIN).
        strategies: restrict the search to these (ddp, fsdp, zero1, zero2, zero3); None: all.
        interconnect: "nvlink" or "pcie" within a node; None: the GPU's default (memfit.gpus.interconnect).
        network_gbps: Gb/s per node between nodes; None: memfit.gpus.interconnect.DEFAULT_NETWORK_GBPS.
        alloc_conf: the run's PYTORCH_CUDA_ALLOC_CONF, for every allocator replay.
        max_simulations: stop after this many per-rank simulations with the best found.
        script: the training script named in the commands.
        allow: opt-in remedies (`truncation`, `lora`, `qlora`, `freeze`; `qlora` allows `lora` too) the search may
            use when nothing else fits; `offload` is an error (the engines' own CPU offload is searched). GRPO /
            RLOO: the single-GPU GRPO plan's opt-ins (memfit.planner.grpo_plan.GRPO_OPT_IN), on every layout.
        vllm_server_gpus: GRPO / RLOO only: plan `trl vllm-serve` on exactly this many of the GPUs (None: colocate
            on all and every server size are weighed, memfit.planner.grpo_parallel_plan).
    """
    from memfit.planner.search import _as_setup, _describe

    started = time.perf_counter()
    setup = _as_setup(setup)
    if vllm_server_gpus is not None and setup.trainer not in ("grpo", "rloo"):
        raise MemfitError(f"vllm server GPUs `{vllm_server_gpus}` are for GRPO / RLOO (the trainers that generate); "
                          f"trainer is `{setup.trainer}`: drop them")
    req = _request(setup, gpus=gpus, gpu=gpu, world_size=world_size, nodes=nodes, global_batch=global_batch,
                   margin=margin, strategies=strategies, interconnect=interconnect, network_gbps=network_gbps,
                   max_simulations=max_simulations, allow=allow)
    spec, ic, world_size = req.spec, req.interconnect, req.world_size
    setup = setup.replace(compute_capability=tuple(spec.compute_capability))
    notes = [n for n in [ic.note] if n]
    m = _model_facts(setup, spec)
    variants = [v for v in VARIANTS if v.strategy in req.strategies]
    if nodes > 1 and world_size > nodes and _network_bound(ic, nodes):
        # hybrid sharding keeps the parameter all-gathers in the node (memfit.planner.comm): after the flat ones
        at = max(i for i, v in enumerate(variants) if v.tier == 0) + 1 if variants else 0
        variants[at:at] = [v for v in HYBRID_VARIANTS if v.strategy in req.strategies]
    if setup.trainer in ("grpo", "rloo"):  # where generation runs: vLLM colocated on all vs a server on k GPUs
        from memfit.planner.grpo_parallel_plan import GrpoParallelParts, plan_grpo_parallel

        return plan_grpo_parallel(setup, req, variants, parts=GrpoParallelParts(ParallelCandidate, ParallelPlanResult,
                                                                               _model_facts, _step, TIE_FRACTION),
                                  alloc_conf=alloc_conf, max_simulations=max_simulations, script=script,
                                  started=started, server_gpus=vllm_server_gpus)
    families = _families(setup, spec, req.allow)
    search = _Search(setup, req, variants, families, m, alloc_conf, max_simulations)
    groups: list[_Group] = []
    not_modelled: dict[str, None] = {}
    for fam, method in families:
        axes = _axes(setup.replace(**fam), spec)
        for i, v in enumerate(variants):
            why = _refusal(v.strategy, fam)
            if why:
                not_modelled[why] = None
                continue
            fam_v = _sharded_qlora(v.strategy, fam)
            groups += [_Group(v, i, {**fam_v, **ch}, lean, tuple(sorted(fam_v.items())), method) for ch, lean in axes]
    groups.sort(key=lambda g: (g.rank_tier, search.modelled(g, req.micro_batches[-1])[0].total_s, g.order,
                               -g.lean_rank))
    from memfit.parallel.rank import shared_simulations

    with shared_simulations():  # ZeRO-1/2/3 of one setup simulate the same program (memfit.parallel.rank)
        stopped = search.run(groups)
    notes += [f"not simulated: {r}" for r in search.refused[:3]]
    notes += [f"not searched: {why}" for why in not_modelled]
    if stopped:
        notes.append(f"stopped after {search.sims} simulations (max_simulations); a faster plan may exist")
    best, candidates = search.best, search.candidates
    chosen = None if best is None else candidates.index(best)
    launch = None
    if best is not None:
        v = next(x for x in variants if x.key == best.variant)
        _, args, env, code = _describe(setup, best.setup_changes, best.checkpointing)
        if best.alloc_conf:
            env = dict(env, PYTORCH_CUDA_ALLOC_CONF=best.alloc_conf)
        launch = launch_for(v, world_size=world_size, nodes=nodes, hidden_size=m.hidden_size,
                            precision=setup.replace(**best.setup_changes).precision, training_args=args, env=env,
                            code=code, script=script,
                            accumulation=best.gradient_accumulation_steps)
    return ParallelPlanResult(
        gpu={"name": spec.name, "total_bytes": spec.total_bytes}, world_size=world_size, nodes=nodes,
        interconnect=ic.to_json(), global_batch=req.global_batch, per_rank_batch=req.per_rank,
        budget_bytes=req.budget_bytes, capacity_bytes=req.capacity_bytes, margin=req.margin, candidates=candidates,
        chosen=chosen, launch=launch, simulations=search.sims, elapsed_s=round(time.perf_counter() - started, 2),
        notes=notes)


def parse_gpu_budget(text: str) -> list[tuple[int, str]]:
    """`8xA100-40GB,4xH100-80GB` -> [(8, "A100-40GB"), (4, "H100-80GB")]."""
    from memfit.parallel.setup import parse_gpus

    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise MemfitError(f"--gpus `{text}` names no GPUs; write e.g. `4xA100-40GB` or `8xA100-40GB,4xH100-80GB`")
    return [parse_gpus(p) for p in parts]


def plan_gpu_budget(setup: TrainSetup | str, kinds: list[tuple[int, str]], **kw: Any
                    ) -> tuple[list[ParallelPlanResult | MemfitError], int | None]:
    """A plan for each GPU kind the user could use, and which is fastest that fits.

    The global batch is the setup's batch x accumulation x the first kind's count (or `global_batch`), the
    same for every kind; a kind it does not split over is reported as its error. Returns (one result or
    error per kind, the index of the fastest that fits or None). `kw` go to `plan_parallel`.
    """
    from memfit.planner.search import _as_setup

    setup = _as_setup(setup)
    kw = dict(kw)
    kw.setdefault("global_batch", setup.effective_batch_size * kinds[0][0])
    out: list[ParallelPlanResult | MemfitError] = []
    for count, name in kinds:
        batch = kw["global_batch"]
        if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1 and batch % count:
            out.append(_no_split(batch, count))  # another kind may still take the batch
            continue
        out.append(plan_parallel(setup, gpu=name, world_size=count, **kw))
    fitting = [(r.chosen_candidate.step.total_s, i) for i, r in enumerate(out)
               if isinstance(r, ParallelPlanResult) and r.chosen is not None]
    return out, (min(fitting)[1] if fitting else None)
