"""`memfit plan --trainer grpo|rloo --gpus NxGPU`: where GRPOTrainer (TRL 1.16) generates on N GPUs of one kind,
and how the training ranks spread the step, keeping the completions per optimizer step and the generation batch
exactly. memfit.planner.parallel_plan.plan_parallel hands GRPO and RLOO setups here.

Layouts (each crossed with the training strategies and micro-batches below):

- **colocate on all N**: `vllm_mode="colocate"`, one vLLM engine in each of the N training processes
  (trl/generation/vllm_generation.py `_init_vllm`, `vllm_tensor_parallel_size=1`); each rank generates its
  share of the generation batch and holds `vllm_gpu_memory_utilization x` its card, sized per candidate as the
  single-GPU plan sizes it (memfit.planner.grpo_plan `_Search.options`: the largest share in hundredths that
  leaves the rank's step its reserved peak, or sleep mode where that lets vLLM take more);
- **server on k GPUs + training on N - k**: `trl vllm-serve` on GPUs 0..k-1 (CUDA_VISIBLE_DEVICES) with its
  own budget, `gpu_memory_utilization` 0.9 of each of its GPUs (trl/scripts/vllm_serve.py `ScriptArguments`,
  memfit.gpus.vllm.VLLM_SERVE_DEFAULT_UTILIZATION) for the weights and the KV cache, tensor parallel `t` (the
  smallest power of two dividing k and the attention heads at which the weights and one sequence of
  `max_model_len` tokens fit `t x 0.9 x total`) and data parallel `k / t`; the training processes hold no vLLM
  memory (memfit.gpus.vllm). Every k from the smallest that holds the model up to N - 1 whose N - k training
  ranks split the batches is a layout; the server GPUs' budget is checked in closed form, not simulated.

Batches. The setup describes one rank as `memfit estimate --gpus` reads it: `b` completions per micro-batch, `a`
micro-steps per optimizer step, `b x steps_per_generation` completions generated per rank per generation. On N
ranks that is `E = b x a x N` completions per optimizer step (or `global_batch`) and a global generation batch
`G = E x steps_per_generation / a` (TRL: `generation_batch_size = per_device_train_batch_size x num_processes x
steps_per_generation`, grpo_config.py `__post_init__`). Both stay exactly. With `T` training ranks a candidate's
per-rank settings are `per_device_train_batch_size = b'` (any `b'` dividing `E / T` and `G / T`),
`gradient_accumulation_steps = E / (T b')` and `steps_per_generation = G / (T b')` (a `generation_batch_size` of
the setup is replaced by it: TRL derives the same global `G`); so fewer training ranks (server mode) take more
completions each. `T` must divide `E` and `G`, and memfit's per-rank simulation needs whole prompt groups per rank
(`G / T` a multiple of `num_generations`; TRL itself only needs `G` to be one); a layout without that is skipped
with a note.

Training strategies: memfit.planner.launch.VARIANTS on the GPUs (DDP, ZeRO-1/2, FSDP2 shard_grad_op / full_shard,
ZeRO-3; no CPU offload), each rank simulated as `memfit.estimate(..., parallel=...)` simulates it; one training rank
is a plain single-GPU run. Gradient checkpointing: on and off (GRPOConfig's default is on), as the single-GPU
GRPO plan searches it. A candidate is not simulated when one of its layout and strategy with a micro-batch no
larger, and checkpointing on where it has it off (or as it has it), did not fit.

Speed (modelled seconds per optimizer step; only ratios between candidates are used): a rank's step as
memfit.planner.grpo_time models it (scoring, generation per optimizer step), its training part replaced by
memfit.planner.parallel_plan's per-rank step of the strategy (compute, the optimizer's shard, exposed
collectives of memfit.planner.comm), plus, per generation:

- colocate: the rank's own vLLM decoding `G / N` sequences in waves of what its sized KV pool holds
  (grpo_time), and the weight push into it (`sync_weights`: `load_weights` per parameter, in grpo_time);
- server: each of the `k / t` replicas decoding `G t / k` sequences on `t` GPUs, taken as one GPU with `t` times
  the bandwidth, compute and memory (`server_generation_s`); the main process streams the weights to the server
  over NCCL (`update_named_params`) at memfit.planner.comm's link rate; the training ranks wait (TRL 1.16
  generates synchronously: `gather_object` of the prompts, one `vllm_client.generate` on the main process);
- sharded strategies (FSDP2, ZeRO-3): `_iter_named_params` gathers the full parameters once per generation.

Candidates are simulated best modelled time first (the colocated ones bounded by the largest share their budget
could give); the search stops when no candidate left can beat the best that fits, or after `max_simulations`.

Opt-ins (`allow`, as the single-GPU GRPO plan takes them: memfit.planner.grpo_plan.GRPO_OPT_IN, its variants from
memfit.planner.grpo_plan.opt_in_methods, so one remedy and one variant per change): `fewer_generations`
(`num_generations` halved: `E` and `G` halve, the same prompts, as grpo_plan.grpo_micro_batches scales them),
`shorter_completions`, `no_reference` (`beta=0`), `lora`, `qlora` (with LoRA's adapters), each alone and, where
several are allowed, all together; applied to every training rank of every layout and simulated per rank as the
others. As on one GPU (where an opt-in's tier ranks after every plan that keeps the method), they are searched
only when nothing fits as typed, within the same `max_simulations`; a note names the opt-in chosen. QLoRA is
searched with DDP and one training rank only (not sharded: ZeRO / FSDP2 would store the 4-bit weights otherwise,
memfit.planner.parallel_plan `_sharded_qlora`).

vLLM's `max_num_seqs` caps the sequences decoded at once, not its memory: colocated, TRL sets it to the rank's
generation batch (grpo_trainer.py), which grpo_time's waves never exceed; the server takes `vllm serve`'s default
(memfit.gpus.vllm.vllm_serve_max_num_seqs: 256, or 1024 on a GPU of 70 GiB or more other than an A100), which
caps each replica's concurrency here.

Known limitations: tensor parallelism's all-reduces in the server, vLLM's CUDA graphs and activations (inside its
share), and the server's own memory outside its share are not modelled; the server runs
on the first k GPUs of one node (several nodes: colocate only); the memory is rank 0's, as for the other
multi-GPU plans.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from memfit.errors import MemfitError
from memfit.train_setup import TRL_CONFIG_CLASS_NAMES, TrainSetup

__all__ = ["GrpoParallelParts", "Layout", "plan_grpo_parallel", "server_layouts", "global_sizes",
           "rank_settings"]


class GrpoParallelParts(NamedTuple):
    """What memfit.planner.parallel_plan hands this module (so that it does not import that module): its result
    classes and its per-rank step-time model."""

    candidate_cls: Any  #: ParallelCandidate
    result_cls: Any  #: ParallelPlanResult
    model_facts: Any  #: parallel_plan._model_facts
    step: Any  #: parallel_plan._step
    tie_fraction: float  #: parallel_plan.TIE_FRACTION


@dataclass(frozen=True)
class Layout:
    """Where generation runs: vLLM colocated on every training rank, or a server on `server_gpus` GPUs."""

    mode: str  #: colocate, server, or generate (transformers' generate in every rank: use_vllm off)
    training_ranks: int
    server_gpus: int = 0
    tensor_parallel: int = 1
    data_parallel: int = 1

    @property
    def label(self) -> str:
        if self.mode == "server":
            return (f"vLLM server on {self.server_gpus} GPU(s) (TP {self.tensor_parallel} x DP {self.data_parallel})"
                    f" + training on {self.training_ranks}")
        return ("vLLM colocated" if self.mode == "colocate" else "generate") + f" on all {self.training_ranks}"


def global_sizes(setup: TrainSetup, world_size: int, global_batch: int | None = None) -> tuple[int, int]:
    """(completions per optimizer step E, global generation batch G) of the per-rank `setup` on `world_size` ranks
    (module docstring); a one-line MemfitError when `global_batch` does not give a whole generation batch."""
    steps, g_rank = setup.grpo_sizes
    e_rank = setup.effective_batch_size
    e = e_rank * world_size if global_batch is None else global_batch
    if (e * g_rank) % e_rank:
        raise MemfitError(f"global batch `{e}` gives no whole generation batch (x steps_per_generation {steps} / "
                          f"gradient_accumulation_steps {setup.gradient_accumulation_steps}); give a multiple of "
                          f"{e_rank // math.gcd(e_rank, g_rank)}")
    return e, e * g_rank // e_rank


def rank_settings(setup: TrainSetup, e: int, g: int, ranks: int) -> list[dict[str, Any]]:
    """The per-rank GRPOConfig batch settings of `ranks` training ranks that keep `e` completions per optimizer
    step and the global generation batch `g`, smallest micro-batch first (module docstring); [] when the ranks do
    not split them."""
    if e % ranks or g % ranks:
        return []
    er, gr = e // ranks, g // ranks
    out = []
    for b in range(1, math.gcd(er, gr) + 1):
        if er % b or gr % b:
            continue
        # steps_per_generation left unset where TRL's default (gradient_accumulation_steps) gives it
        steps = None if gr == er and setup.steps_per_generation is None else gr // b
        out.append({"per_device_train_batch_size": b, "gradient_accumulation_steps": er // b,
                    "steps_per_generation": steps, "generation_batch_size": None})
    return out


def server_layouts(setup: TrainSetup, world_size: int, *, weight_bytes: int, kv_per_token: int, max_model_len: int,
                   total_bytes: int, heads: int | None, server_gpus: int | None = None,
                   utilization: float | None = None) -> tuple[list[Layout], list[str]]:
    """The server layouts on `world_size` GPUs (module docstring) and notes on the k left out; `server_gpus`: only
    that k (a MemfitError when the server cannot hold the model on it)."""
    from memfit.gpus.vllm import VLLM_SERVE_DEFAULT_UTILIZATION

    u = VLLM_SERVE_DEFAULT_UTILIZATION if utilization is None else utilization
    need = weight_bytes + kv_per_token * max_model_len  # vLLM starts only with one max_model_len sequence's cache
    ks = [server_gpus] if server_gpus is not None else list(range(1, world_size))
    out, notes = [], []
    for k in ks:
        t = 1
        while t <= k and (k % t or (heads and heads % t) or t * int(u * total_bytes) < need):
            t *= 2
        if t > k:
            why = (f"vLLM server on {k} GPU(s): no tensor parallel size dividing {k} and the attention heads holds "
                   f"the weights ({weight_bytes} B) and one sequence of {max_model_len} tokens "
                   f"({kv_per_token * max_model_len} B) in {u:g} x its GPUs' {total_bytes} B")
            if server_gpus is not None:
                raise MemfitError(why + "; give more --vllm-server-gpus or use colocate")
            notes.append(why)
            continue
        out.append(Layout("server", world_size - k, k, t, k // t))
    return out, notes


def server_generation_s(setup: TrainSetup, spec: Any, *, params: int, weight_bytes: int, kv_per_token: int,
                        layout: Layout, generation_batch: int, utilization: float) -> tuple[float, int, int]:
    """(seconds, sequences decoded at once per replica, waves) of one generation of `generation_batch` completions
    by the server (module docstring); a replica on `t` GPUs is one GPU with t x bandwidth, compute and memory."""
    from memfit.gpus.vllm import vllm_serve_max_num_seqs
    from memfit.planner.grpo_time import _BANDWIDTH_FRACTION, vllm_concurrency
    from memfit.planner.throughput import _rate_flops

    t, d = layout.tensor_parallel, layout.data_parallel
    p, c = setup.sequence_length, setup.max_completion_length
    per_replica = -(-generation_batch // d)
    pool = t * int(utilization * spec.total_bytes) - weight_bytes
    # at most vllm serve's default max_num_seqs (trl vllm-serve passes none): memfit.gpus.vllm
    concurrency = min(vllm_concurrency(pool, kv_per_token, p + c, per_replica),
                      vllm_serve_max_num_seqs(spec.name, spec.total_bytes))
    if concurrency <= 0:
        return math.inf, 0, 0
    bandwidth = t * spec.memory_bandwidth_gbps * 1e9 * _BANDWIDTH_FRACTION
    rate = t * _rate_flops(spec, setup.precision)
    waves = -(-per_replica // concurrency)
    decode_s, left = 0.0, per_replica
    for _ in range(waves):  # as grpo_time.grpo_step_time decodes a wave
        n = min(concurrency, left)
        left -= n
        decode_s += c * max((weight_bytes + n * (p + c / 2) * kv_per_token) / bandwidth, 2 * params * n / rate)
    prefill_s = 2 * params * per_replica * p / rate  # Kaplan et al. 2020 sec. 2.1: 2 N per token forward
    return decode_s + prefill_s, concurrency, waves


@dataclass
class _Cand:
    layout: Layout
    variant: Any  #: memfit.planner.launch.Variant
    changes: dict[str, Any]  #: TrainSetup changes of the rank (batch settings, checkpointing, vLLM mode, opt-in)
    bound_s: float
    lean: int  #: 1 with checkpointing on
    method: tuple = ()  #: the `--allow` opt-in's changes, sorted (memfit.planner.grpo_plan.opt_in_methods)


class _Planner:
    def __init__(self, setup: TrainSetup, req: Any, parts: GrpoParallelParts, alloc_conf: str | None) -> None:
        from memfit.gpus.outside_pytorch import non_pytorch_bytes
        from memfit.planner.grpo_plan import grpo_facts

        self.setup, self.req, self.parts, self.alloc_conf = setup, req, parts, alloc_conf
        self.spec = req.spec
        self.m = parts.model_facts(setup, self.spec)
        self.facts = grpo_facts(setup, self.spec, self.m.params)
        self.outside_table = non_pytorch_bytes(self.spec).total_bytes
        self.sims = 0
        self.simulated: list[Any] = []
        self._facts_of: dict[tuple, Any] = {}

    def m_of(self, s: TrainSetup) -> Any:
        """parallel_plan's model facts of the rank setup `s` (with LoRA: the adapters train, the base is frozen)."""
        key = (s.lora_r, s.lora_target_modules and tuple(s.lora_target_modules), s.load_in_4bit)
        base = (self.setup.lora_r, self.setup.lora_target_modules and tuple(self.setup.lora_target_modules),
                self.setup.load_in_4bit)
        if key == base:
            return self.m
        if key not in self._facts_of:
            self._facts_of[key] = self.parts.model_facts(s, self.spec)
        return self._facts_of[key]

    def sizes_of(self, num_generations: int) -> tuple[int, int]:
        """(E, G) of the rank setup with `num_generations` completions per prompt: the setup's global sizes, scaled
        as the single-GPU plan scales them for fewer generations (the same prompts, fewer completions each:
        memfit.planner.grpo_plan.grpo_micro_batches)."""
        e, g = self.sizes
        n = self.setup.num_generations
        return (e, g) if num_generations == n else (e * num_generations // n, g * num_generations // n)

    # -- per training-rank count ------------------------------------------------------------------------------
    def outside(self, ranks: int) -> int:
        from memfit.parallel.nccl import nccl_buffer_bytes

        return self.outside_table + nccl_buffer_bytes(ranks, self.req.nodes)

    def budget(self, ranks: int):
        from memfit.planner.memory_model import Budget

        out = self.outside(ranks)
        return Budget(self.spec, self.req.margin, self.req.budget_bytes, out, self.req.budget_bytes - out)

    def par(self, v: Any, ranks: int, precision: str):
        from memfit.planner.launch import parallel_setup_for

        if ranks == 1:
            return None
        return parallel_setup_for(v, world_size=ranks, nodes=self.req.nodes, hidden_size=self.m.hidden_size,
                                  precision=precision)

    # -- time -------------------------------------------------------------------------------------------------
    def time_s(self, c: _Cand, s: TrainSetup, share: float | None, trainable: int | None = None) -> float:
        """Modelled seconds of an optimizer step (module docstring)."""
        from memfit.parallel.setup import ParallelSetup
        from memfit.planner.comm import gpu_link_bytes_per_s
        from memfit.planner.grpo_time import grpo_step_time

        lay, f, m = c.layout, self.facts, self.m_of(s)
        trainable = m.trainable_params if trainable is None else trainable
        pool = None
        if lay.mode == "colocate":
            pool = int((share or 0) * self.spec.total_bytes) - f.weight_bytes
        kv = f.kv_per_token if lay.mode != "generate" else f.hf_kv_per_token
        gt = grpo_step_time(s, self.spec, f.timer, m.params, trainable, kv_per_token=kv,
                            weight_bytes=f.weight_bytes, pool_bytes=pool)
        steps, _ = s.grpo_sizes
        per_step = s.gradient_accumulation_steps / (steps * s.num_iterations)
        par = self.par(c.variant, lay.training_ranks, s.precision) or ParallelSetup(world_size=1)
        train = s.replace(max_length=s.sequence_length + s.max_completion_length, example_lengths=None)
        st, _ = self.parts.step(c.variant, par, train, m, self.spec, self.req.interconnect, self.req.nodes)
        link = gpu_link_bytes_per_s(self.req.interconnect, self.req.nodes)
        gather_s = 0.0
        if lay.training_ranks > 1 and (c.variant.strategy == "fsdp" or c.variant.strategy == "zero3"):
            gather_s = f.weight_bytes * (lay.training_ranks - 1) / lay.training_ranks / link
        generation_s = gt.generation_s
        if lay.mode == "server":
            from memfit.gpus.vllm import VLLM_SERVE_DEFAULT_UTILIZATION

            _, g = self.sizes_of(s.num_generations)
            gen_s, _, _ = server_generation_s(s, self.spec, params=m.params, weight_bytes=f.weight_bytes,
                                              kv_per_token=kv, layout=lay, generation_batch=g,
                                              utilization=VLLM_SERVE_DEFAULT_UTILIZATION)
            generation_s = (gen_s + f.weight_bytes / link) * per_step
        return st.total_s + gt.scoring_s + generation_s + gather_s * per_step

    # -- candidates -------------------------------------------------------------------------------------------
    def candidates(self, layouts: list[Layout], variants: list[Any], method: dict[str, Any] | None = None
                   ) -> tuple[list[_Cand], list[str]]:
        """The candidates of the layouts with the setup's method, or with an `--allow` opt-in's `method` changes
        applied to every rank (QLoRA: DDP and one training rank only, module docstring)."""
        method = method or {}
        s = self.setup
        sm = s.replace(**method)
        e, g = self.sizes_of(sm.num_generations)
        ckpts = [{}, {"gradient_checkpointing": not s.gradient_checkpointing}]  # as the single-GPU GRPO plan
        out, notes = [], []
        for lay in layouts:
            mbs = rank_settings(sm, e, g, lay.training_ranks)
            mbs = [mb for mb in mbs if (g // lay.training_ranks) % sm.num_generations == 0]
            if not mbs:
                notes.append(f"{lay.label}: {lay.training_ranks} training ranks do not split {e} completions per step "
                             f"and a generation batch of {g} into whole prompt groups of {sm.num_generations}")
                continue
            mode = {} if lay.mode == "generate" else {"use_vllm": True, "vllm_mode": lay.mode}
            if lay.mode == "server":
                mode["vllm_enable_sleep_mode"] = False
            vs = variants if lay.training_ranks > 1 else variants[:1]  # one rank: a plain run (DDP's step, no peers)
            if method.get("load_in_4bit") and lay.training_ranks > 1:
                vs = [v for v in vs if v.strategy == "ddp"]
            for v in vs:
                for ck in ckpts:
                    for mb in mbs:
                        ch = {**method, **mode, **ck, **mb}
                        try:
                            rs = s.replace(**ch)
                        except MemfitError:
                            continue
                        share = None
                        if lay.mode == "colocate":  # the bound: the largest share the budget could give
                            from memfit.planner.grpo_plan import share_for

                            share = share_for(self.budget(lay.training_ranks).capacity_bytes, self.spec.total_bytes)
                        # a lower bound: with LoRA, as if nothing trained (as the single-GPU GRPO plan bounds it)
                        trainable = 0 if method.get("lora_r") else None
                        out.append(_Cand(lay, v, ch, self.time_s(_Cand(lay, v, ch, 0, 0), rs, share, trainable),
                                         int(rs.gradient_checkpointing), tuple(sorted(method.items()))))
        out.sort(key=lambda c: c.bound_s)
        return out, notes

    # -- memory -----------------------------------------------------------------------------------------------
    def assess(self, c: _Cand) -> list[Any]:
        """The candidate's rank 0 simulated at its capacity: ParallelCandidates (a colocated one with its sized
        share, and with sleep mode where that lets vLLM take more)."""
        from memfit.allocator.bounded import bounded_reserved
        from memfit.allocator.conf import parse_alloc_conf
        from memfit.estimator import estimate
        from memfit.planner.grpo_plan import _Candidate, _Search
        from memfit.planner.memory_model import Simulations

        lay, ranks = c.layout, c.layout.training_ranks
        s = self.setup.replace(**c.changes)
        budget = self.budget(ranks)
        par = self.par(c.variant, ranks, s.precision)
        self.sims += 1
        report = estimate(s, gpu=self.spec, parallel=par, capacity_bytes=budget.capacity_bytes,
                          alloc_conf=self.alloc_conf, non_pytorch_bytes=self.outside_table)
        results = []
        if lay.mode == "colocate":
            search = _Search(s, budget, self.facts, Simulations(), self.alloc_conf)
            options = search.options(_Candidate({}, 0, 0.0), report)
        else:
            options = [None]
        for o in options:
            changes, share, sleep = dict(c.changes), None, False
            if o is not None:
                share = o.changes.get("vllm_gpu_memory_utilization", s.vllm_gpu_memory_utilization)
                sleep = o.changes.get("vllm_enable_sleep_mode", s.vllm_enable_sleep_mode)
                changes.update(vllm_gpu_memory_utilization=share, vllm_enable_sleep_mode=sleep)
                fits, reserved, used = o.fits, o.reserved_bytes, o.used_bytes
                notes = list(o.notes)
            else:
                fits, reserved = report.fits is True, report.peak_reserved_bytes
                used = reserved + budget.outside_bytes
                notes = []
            env = None
            if not fits and report.trace is not None and o is None:  # as parallel_plan: the allocator settings
                for text in ("expandable_segments:True", "max_split_size_mb:128"):
                    conf = f"{self.alloc_conf},{text}" if self.alloc_conf else text
                    alt = bounded_reserved(report.trace, conf=parse_alloc_conf(conf),
                                           capacity_bytes=budget.capacity_bytes, search=False)
                    if alt.oom is None:
                        fits, reserved, env = True, alt.report.peak_reserved_bytes, conf
                        used = reserved + budget.outside_bytes
                        break
            rs = self.setup.replace(**changes)
            t = self.time_s(c, rs, share, report.trainable_params)
            fits = fits and math.isfinite(t)
            generation = self.generation_json(lay, share, sleep, rs)
            ch = {k: v for k, v in changes.items() if getattr(self.setup, k) != v}
            st, colls = self._step_time(c, rs, t)
            cand = self.parts.candidate_cls(
                c.variant.key, f"{_strategy_label(c.variant, ranks)}, {lay.label}", ch,
                rs.per_device_train_batch_size, rs.gradient_accumulation_steps, fits, report.peak_allocated_bytes,
                reserved, used, budget.budget_bytes - used, (report.parallel or {}).get("host_bytes_per_node", 0),
                st, env, colls, report.checkpointing, generation=dict(generation, notes=notes))
            results.append(cand)
        return results

    def _step_time(self, c: _Cand, s: TrainSetup, total_s: float):
        """(StepTime, collectives as JSON) of the candidate: parallel_plan's per-rank step of the strategy, with the
        scoring and generation seconds in total_s."""
        from memfit.parallel.setup import ParallelSetup

        par = self.par(c.variant, c.layout.training_ranks, s.precision) or ParallelSetup(world_size=1)
        train = s.replace(max_length=s.sequence_length + s.max_completion_length, example_lengths=None)
        st, colls = self.parts.step(c.variant, par, train, self.m_of(s), self.spec, self.req.interconnect,
                                    self.req.nodes)
        return replace(st, total_s=total_s), [x.to_json(s.gradient_accumulation_steps) for x in colls]

    def generation_json(self, lay: Layout, share: float | None, sleep: bool, s: TrainSetup) -> dict[str, Any]:
        from memfit.gpus.vllm import VLLM_SERVE_DEFAULT_UTILIZATION

        f, total = self.facts, self.spec.total_bytes
        e, g = self.sizes_of(s.num_generations)
        out: dict[str, Any] = {"mode": lay.mode, "training_ranks": lay.training_ranks, "server_gpus": lay.server_gpus,
                               "completions_per_step": e, "generation_batch_size": g,
                               "completions_per_rank_per_step": e // lay.training_ranks,
                               "generated_per_rank": g // lay.training_ranks, "weights_bytes": f.weight_bytes}
        if lay.mode == "colocate":
            out.update(vllm_gpu_memory_utilization=share, sleep=sleep, share_bytes=int((share or 0) * total))
        elif lay.mode == "server":
            u = VLLM_SERVE_DEFAULT_UTILIZATION
            per_gpu = int(u * total)
            _, conc, waves = server_generation_s(s, self.spec, params=self.m_of(s).params, weight_bytes=f.weight_bytes,
                                                 kv_per_token=f.kv_per_token, layout=lay, generation_batch=g,
                                                 utilization=u)
            out.update(gpu_memory_utilization=u, tensor_parallel=lay.tensor_parallel,
                       data_parallel=lay.data_parallel, server_bytes_per_gpu=per_gpu,
                       server_weights_bytes_per_gpu=f.weight_bytes // lay.tensor_parallel,
                       server_kv_pool_bytes_per_replica=lay.tensor_parallel * per_gpu - f.weight_bytes,
                       sequences_at_once_per_replica=conc, waves=waves)
        return out

    @property
    def sizes(self) -> tuple[int, int]:
        return global_sizes(self.setup, self.req.world_size, self.req.global_batch)


def _could_beat(t: float, variant_order: int, best: Any, order: dict[str, int], tie: float) -> bool:
    """A candidate of modelled time `t` would replace `best` (memfit.planner.parallel_plan.TIE_FRACTION, `tie`:
    times within it are a tie that the simpler strategy, earlier in VARIANTS, wins)."""
    b, mine = best.step.total_s, order[best.variant]
    if variant_order < mine:
        return t < b * (1 + tie)
    return t < b * (1 - tie) if variant_order > mine else t < b


def _better(x: Any, y: Any, order: dict[str, int], tie: float) -> bool:
    return _could_beat(x.step.total_s, order[x.variant], y, order, tie)


def _strategy_label(v: Any, ranks: int) -> str:
    return "1 GPU" if ranks == 1 else f"{v.label} on {ranks}"


def _check_server_gpus(setup: TrainSetup, world_size: int, server_gpus: Any) -> None:
    t = setup.trainer.upper()
    if server_gpus is None:
        if setup.use_vllm and setup.vllm_mode == "server" and world_size < 2:
            raise MemfitError(f"vllm_mode `server` on {world_size} GPU leaves no GPU for `trl vllm-serve`: give 2 or "
                              "more GPUs (`--gpus 2xGPU`) or use `vllm_mode=colocate`")
        return
    if isinstance(server_gpus, bool) or not isinstance(server_gpus, int) or server_gpus < 1:
        raise MemfitError(f"vllm server GPUs `{server_gpus!r}` must be a whole number of at least 1")
    if server_gpus >= world_size:
        raise MemfitError(f"vllm server GPUs `{server_gpus}` leave no training GPU of {world_size}: give fewer than "
                          f"{world_size}")
    if not setup.use_vllm:
        raise MemfitError(f"vllm server GPUs `{server_gpus}` with use_vllm off: {t} generates with transformers' "
                          "generate; pass `use_vllm=true` or drop the server GPUs")


def plan_grpo_parallel(setup: TrainSetup, req: Any, variants: list[Any], *, parts: GrpoParallelParts,
                       alloc_conf: str | None, max_simulations: int, script: str, started: float,
                       server_gpus: int | None = None) -> Any:
    """The ParallelPlanResult of a GRPO / RLOO setup on `req`'s GPUs (module docstring). `req`:
    memfit.planner.parallel_plan's checked request; `variants`: the strategies asked for."""
    from memfit.models.build import resolve_config

    from memfit.planner.grpo_plan import check_grpo_allow

    _check_server_gpus(setup, req.world_size, server_gpus)
    check_grpo_allow(req.allow)
    pl = _Planner(setup, req, parts, alloc_conf)
    e, g = pl.sizes
    if g % setup.num_generations:
        raise MemfitError(f"the global generation batch of {g} completions is not divisible by num_generations "
                          f"`{setup.num_generations}`, as {TRL_CONFIG_CLASS_NAMES[setup.trainer]} requires")
    variants = [v for v in variants if v.tier == 0 and not v.hybrid]
    notes: list[str] = []
    if not setup.use_vllm:
        layouts = [Layout("generate", req.world_size)]
        notes.append("use_vllm is off: every rank generates with transformers' generate; vLLM layouts (colocate, "
                     "server) are not searched: pass `use_vllm=true` for them")
    else:
        layouts = [] if server_gpus is not None else [Layout("colocate", req.world_size)]
        if req.nodes == 1:
            cfg = resolve_config(setup.model).config
            text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            srv, why = server_layouts(setup, req.world_size, weight_bytes=pl.facts.weight_bytes,
                                      kv_per_token=pl.facts.kv_per_token, max_model_len=pl.facts.max_model_len,
                                      total_bytes=req.spec.total_bytes,
                                      heads=getattr(text, "num_attention_heads", None), server_gpus=server_gpus)
            layouts += srv
            notes += [f"not searched: {w}" for w in why]
        else:
            notes.append("vLLM server layouts are planned on one node; several nodes: colocate only")
    cands, why = pl.candidates(layouts, variants)
    notes += [f"not searched: {w}" for w in why]
    order = {v.key: i for i, v in enumerate(variants)}
    best, stopped = _search(pl, cands, order, parts.tie_fraction, max_simulations, notes)
    fitted_as_typed = best is not None
    methods = _opt_ins(setup, req)
    from memfit.remedies import REGISTRY

    for name in req.allow:  # an allowed opt-in that does not apply, and why (as the single-GPU plan's not-applicable)
        verdict = REGISTRY[name].check(setup, req.spec)
        if not verdict.applies:
            notes.append(f"not searched: --allow {name}: {verdict.reason}")
    # as the single-GPU GRPO plan ranks them (memfit.planner.grpo_plan: an opt-in's tier after every plan that
    # keeps the method, every allowed opt-in together after each one alone): the `--allow` opt-ins are searched
    # only when nothing fits as typed, and their combination only when no single one fits
    tiers = [methods[:-1], methods[-1:]] if len(methods) > 1 else [methods]
    for tier_methods in tiers:
        if best is not None or stopped or not tier_methods:
            break
        cands, why = [], []
        for method in tier_methods:
            found, w = pl.candidates(layouts, variants, method)
            cands += found
            why += [x for x in w if x not in why]
        cands.sort(key=lambda c: c.bound_s)
        notes += [f"not searched: {w}" for w in why if f"not searched: {w}" not in notes]
        if (any(m.get("load_in_4bit") for m in tier_methods) and any(v.strategy != "ddp" for v in variants)
                and any(lay.training_ranks > 1 for lay in layouts)
                and "not searched: QLoRA under ZeRO / FSDP2 for GRPO (DDP and one training rank only)" not in notes):
            notes.append("not searched: QLoRA under ZeRO / FSDP2 for GRPO (DDP and one training rank only)")
        best, stopped = _search(pl, cands, order, parts.tie_fraction, max_simulations, notes)
    if methods and not fitted_as_typed:
        if best is not None:
            notes.append("nothing fits as typed; " + _opt_in_note(setup, best.setup_changes))
        elif not stopped:
            notes.append(f"nothing fits with the opt-ins allowed either ({', '.join(req.allow)})")
    if stopped:
        notes.append(f"stopped after {pl.sims} simulations (max_simulations); a faster plan may exist")
    chosen = None if best is None else pl.simulated.index(best)
    launch = None if best is None else _launch(setup, best, variants, pl, script)
    return parts.result_cls(
        gpu={"name": req.spec.name, "total_bytes": req.spec.total_bytes}, world_size=req.world_size, nodes=req.nodes,
        interconnect=req.interconnect.to_json(),
        global_batch=e if best is None else best.generation["completions_per_step"],
        per_rank_batch=(e // req.world_size if best is None else best.generation["completions_per_rank_per_step"]),
        budget_bytes=req.budget_bytes, capacity_bytes=req.capacity_bytes, margin=req.margin,
        candidates=pl.simulated, chosen=chosen, launch=launch, simulations=pl.sims,
        elapsed_s=round(time.perf_counter() - started, 2), notes=notes,
        config_class=TRL_CONFIG_CLASS_NAMES[setup.trainer])


def _opt_ins(setup: TrainSetup, req: Any) -> list[dict[str, Any]]:
    """The `--allow` opt-ins' method changes (memfit.planner.grpo_plan.opt_in_methods: the single-GPU plan's)."""
    from memfit.planner.grpo_plan import GRPO_OPT_IN, opt_in_methods
    from memfit.remedies import REGISTRY

    usable = [n for n in GRPO_OPT_IN if n in req.allow and REGISTRY[n].check(setup, req.spec).applies]
    return opt_in_methods(setup, req.spec, usable)


def _opt_in_note(setup: TrainSetup, changes: dict[str, Any]) -> str:
    """What the chosen candidate's opt-ins change, named as memfit.remedies names and describes them."""
    from memfit.planner.grpo_plan import GRPO_OPT_IN
    from memfit.remedies import REGISTRY

    used = [REGISTRY[n] for n in GRPO_OPT_IN
            if any(k in changes and changes[k] != getattr(setup, k) for k in REGISTRY[n].fields)]
    return "with --allow: " + "; ".join(f"{r.name} ({r.title}: {r.costs})" for r in used)


def _search(pl: _Planner, cands: list[_Cand], order: dict[str, int], tie: float, max_simulations: int,
            notes: list[str]) -> tuple[Any, bool]:
    """Simulate `cands` best bound first (module docstring); (the fastest fitting candidate or None, whether it
    stopped at max_simulations). What it simulated goes to `pl.simulated`, refusals to `notes`."""
    from memfit import progress

    best = None
    failed: list[_Cand] = []
    stopped = False
    best_of: dict[str, Any] = {}  #: the fastest fitting candidate of each generation mode, so both are shown
    for c in cands:
        mine = best_of.get(c.layout.mode)
        if mine is not None and not _could_beat(c.bound_s, order[c.variant.key], mine, order, tie):
            continue  # its mode already has a verified candidate it cannot beat
        if any(f.layout == c.layout and f.variant.key == c.variant.key and f.method == c.method and f.lean >= c.lean
               and f.changes["per_device_train_batch_size"] <= c.changes["per_device_train_batch_size"]
               for f in failed):
            continue  # a leaner one with a smaller micro-batch did not fit
        if pl.sims >= max_simulations:
            stopped = True
            break
        progress.report(f"{c.layout.label}, {c.variant.label}, batch {c.changes['per_device_train_batch_size']}",
                        pl.sims, max_simulations)
        try:
            found = pl.assess(c)
        except MemfitError as err:
            notes.append(f"not simulated: {c.layout.label}, {c.variant.label}: {err}")
            continue
        pl.simulated += found
        if not any(x.fits for x in found):
            failed.append(c)
        for x in found:
            if x.fits and (mine is None or _better(x, mine, order, tie)):
                best_of[c.layout.mode] = mine = x
            if x.fits and (best is None or _better(x, best, order, tie)):
                best = x
    return best, stopped


def _launch(setup: TrainSetup, best: Any, variants: list[Any], pl: _Planner, script: str) -> Any:
    """memfit.planner.launch's files and commands for the training ranks, with the vLLM server's command and the
    GPUs each side sees (CUDA_VISIBLE_DEVICES)."""
    from memfit.planner.launch import Launch, launch_for
    from memfit.planner.search import _describe

    gen = best.generation
    ranks, k = gen["training_ranks"], gen["server_gpus"]
    from memfit.remedies import REGISTRY

    _, args, env, code = _describe(setup, best.setup_changes, best.checkpointing)
    # every other change is a GRPOConfig / RLOOConfig name; LoRA and QLoRA are peft / bitsandbytes code (_describe)
    peft = {*REGISTRY["lora"].fields, *REGISTRY["qlora"].fields}
    args.update({k: v for k, v in best.setup_changes.items() if k not in peft})
    if gen["mode"] == "server":
        args.update(vllm_server_host="0.0.0.0", vllm_server_port=8000)  # GRPOConfig defaults, written out
    if best.alloc_conf:
        env = dict(env, PYTORCH_CUDA_ALLOC_CONF=best.alloc_conf)
    v = next(x for x in variants if x.key == best.variant)
    precision = setup.replace(**best.setup_changes).precision
    if ranks == 1:  # one training process: no engine, no accelerate config
        import json

        from memfit.planner.launch import TRAINING_ARGS_FILE

        base = Launch({TRAINING_ARGS_FILE: json.dumps(args, indent=2, default=str) + "\n"}, args, dict(env),
                      list(code), [f"python {script}"])
    else:
        base = launch_for(v, world_size=ranks, nodes=pl.req.nodes, hidden_size=pl.m.hidden_size, precision=precision,
                          training_args=args, env=env, code=code, script=script,
                          accumulation=best.gradient_accumulation_steps)
    if gen["mode"] != "server":
        return base
    server_devices = ",".join(str(i) for i in range(k))
    train_devices = ",".join(str(i) for i in range(k, k + ranks))
    model = setup.model if isinstance(setup.model, str) else "MODEL"
    serve = (f"CUDA_VISIBLE_DEVICES={server_devices} trl vllm-serve --model {model} --tensor-parallel-size "
             f"{gen['tensor_parallel']} --data-parallel-size {gen['data_parallel']} --gpu-memory-utilization "
             f"{gen['gpu_memory_utilization']} --port 8000 &   # the generation GPUs")
    commands = [serve] + [f"CUDA_VISIBLE_DEVICES={train_devices} {cmd}" for cmd in base.commands]
    return replace(base, commands=commands)
