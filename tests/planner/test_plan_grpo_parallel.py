"""`memfit plan --trainer grpo --gpus NxGPU` (memfit.planner.grpo_parallel_plan): vLLM colocated on every rank
against `trl vllm-serve` on k GPUs and training on the others, the completions per optimizer step and the
generation batch kept, the server's own budget, one-line refusals, and the chosen rank's figures equal to
`memfit.estimate` of the same per-rank setup."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from transformers import LlamaConfig  # noqa: E402

from memfit import TrainSetup, estimate  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.gpus.catalog import as_gpu_spec  # noqa: E402
from memfit.gpus.vllm import VLLM_SERVE_DEFAULT_UTILIZATION  # noqa: E402
from memfit.planner.grpo_parallel_plan import global_sizes, rank_settings, server_layouts  # noqa: E402
from memfit.train_setup import grpo_generation_sizes  # noqa: E402

LLAMA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)


def _setup(**kw) -> TrainSetup:
    base = dict(model=LLAMA, task="causal-lm", trainer="grpo", per_device_train_batch_size=4,
                gradient_accumulation_steps=2, num_generations=4, max_length=16, max_completion_length=24,
                optim="adamw_torch", attn_implementation="sdpa", gradient_checkpointing=True, precision="bf16",
                use_vllm=True)
    return TrainSetup(**{**base, **kw})


# -- closed forms ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(steps_per_generation=4), dict(generation_batch_size=16)])
def test_rank_settings_keep_the_completions_per_step_and_the_generation_batch(kw):
    """On 4 GPUs the setup's rank gives E = b x a x 4 completions per step and G = E x steps / a; every split over
    T training ranks keeps both, as TRL derives the global generation batch from the per-rank settings."""
    s = _setup(**kw)
    steps, g_rank = s.grpo_sizes
    e, g = global_sizes(s, 4)
    assert e == s.effective_batch_size * 4 and g == g_rank * 4
    seen = 0
    for ranks in (1, 2, 3, 4):
        for mb in rank_settings(s, e, g, ranks):
            t = s.replace(**mb)
            b, a = t.per_device_train_batch_size, t.gradient_accumulation_steps
            assert b * a * ranks == e
            # GRPOConfig.__post_init__: generation_batch_size = per_device_train_batch_size x processes x steps
            steps = t.grpo_sizes[0]
            assert grpo_generation_sizes(b, a, t.steps_per_generation, None, num_processes=ranks) == (steps, g)
            seen += 1
        if e % ranks or g % ranks:
            assert rank_settings(s, e, g, ranks) == []  # 3 ranks do not split 32 completions
    assert seen > 4


def test_server_layouts_hold_the_weights_in_their_own_budget():
    """The server's budget is trl vllm-serve's gpu_memory_utilization (0.9) of each of its GPUs; a model whose
    weights and one max_model_len sequence do not fit 0.9 x one GPU gets tensor parallel 2, and k GPUs run k / t
    replicas."""
    total = 80 * 2**30
    kv, max_len = 100_000, 32_768
    assert VLLM_SERVE_DEFAULT_UTILIZATION == 0.9
    small, notes = server_layouts(_setup(), 4, weight_bytes=10 * 2**30, kv_per_token=kv, max_model_len=max_len,
                                  total_bytes=total, heads=32)
    assert [(x.server_gpus, x.tensor_parallel, x.data_parallel, x.training_ranks) for x in small] == \
        [(1, 1, 1, 3), (2, 1, 2, 2), (3, 1, 3, 1)] and notes == []
    per_gpu = int(0.9 * total)
    weights = per_gpu - kv * max_len + 1  # one byte too many for one GPU's 0.9
    big, notes = server_layouts(_setup(), 4, weight_bytes=weights, kv_per_token=kv, max_model_len=max_len,
                                total_bytes=total, heads=32)
    assert [(x.server_gpus, x.tensor_parallel, x.data_parallel) for x in big] == [(2, 2, 1)]
    assert len(notes) == 2 and all("holds the weights" in n for n in notes)  # k = 1 and k = 3 (odd)
    ok, _ = server_layouts(_setup(), 4, weight_bytes=weights - 1, kv_per_token=kv, max_model_len=max_len,
                           total_bytes=total, heads=32)
    assert ok[0].tensor_parallel == 1  # exactly 0.9 x the GPU holds them


def test_bad_input_is_one_line():
    from memfit.planner.parallel_plan import plan_parallel

    cases = [
        (dict(setup=_setup(vllm_mode="server"), gpus="1xA100-80GB"), "leaves no GPU for `trl vllm-serve`"),
        (dict(setup=_setup(), gpus="4xA100-80GB", vllm_server_gpus=4), "leave no training GPU of 4"),
        (dict(setup=_setup(), gpus="4xA100-80GB", vllm_server_gpus=0), "must be a whole number of at least 1"),
        (dict(setup=_setup(use_vllm=False), gpus="4xA100-80GB", vllm_server_gpus=1), "use_vllm off"),
        (dict(setup=TrainSetup(model=LLAMA, task="causal-lm"), gpus="4xA100-80GB", vllm_server_gpus=1),
         "are for GRPO / RLOO"),
        (dict(setup=_setup(), gpus="4xA100-80GB", allow=("truncation",)), "is not searched for GRPO; its opt-ins"),
        # the GRPO plan across GPUs tries no CPU offload: the opt-ins it searches, not the engines' offload
        (dict(setup=_setup(), gpus="4xA100-80GB", allow=("offload",)), "`--allow offload` is not searched for GRPO"),
    ]
    for kw, text in cases:
        setup = kw.pop("setup")
        with pytest.raises(MemfitError, match=text) as err:
            plan_parallel(setup, **kw)
        assert "\n" not in str(err.value)


# -- whole plans (simulated) -------------------------------------------------------------------------------------

def _rank_estimate(setup: TrainSetup, r, cand, gpu: str = "A100-80GB", config=LLAMA):
    """`memfit.estimate` of the candidate's per-rank setup, as its launch files configure it, at the capacity the
    plan replayed it with (a colocated share held all along is outside that capacity)."""
    from memfit.gpus.outside_pytorch import non_pytorch_bytes
    from memfit.parallel.nccl import nccl_buffer_bytes
    from memfit.planner.launch import VARIANTS, parallel_setup_for

    spec = as_gpu_spec(gpu)
    assert spec.total_bytes == r.gpu["total_bytes"]
    t = setup.replace(**cand.setup_changes)
    ranks = cand.generation["training_ranks"]
    v = next(x for x in VARIANTS if x.key == cand.variant)
    par = None if ranks == 1 else parallel_setup_for(v, world_size=ranks, nodes=1, hidden_size=config.hidden_size,
                                                     precision=t.precision)
    outside = non_pytorch_bytes(spec).total_bytes
    capacity = r.budget_bytes - outside - nccl_buffer_bytes(ranks, 1)
    held = int(t.vllm_gpu_memory_utilization * spec.total_bytes) \
        if t.vllm_mode == "colocate" and not t.vllm_enable_sleep_mode else 0
    return t, estimate(t, gpu=spec, parallel=par, non_pytorch_bytes=outside, capacity_bytes=capacity - held)


@pytest.mark.slow
def test_plan_on_four_gpus_weighs_colocate_against_a_server_and_keeps_the_batches():
    from memfit.planner.parallel_plan import plan_parallel

    s = _setup()
    r = plan_parallel(s, gpus="4xA100-80GB", max_simulations=8)
    modes = {c.generation["mode"] for c in r.candidates}
    assert modes == {"colocate", "server"}
    assert r.chosen is not None and r.to_json()["schema"] == "memfit.plan.parallel/1"
    e, g = global_sizes(s, 4)
    spec = as_gpu_spec("A100-80GB")
    for c in r.candidates:
        gen, t = c.generation, s.replace(**c.setup_changes)
        ranks = gen["training_ranks"]
        assert ranks + gen["server_gpus"] == 4
        assert t.effective_batch_size * ranks == e == gen["completions_per_step"]
        assert t.per_device_train_batch_size * t.grpo_sizes[0] * ranks == g == gen["generation_batch_size"]
        if gen["mode"] == "server":
            assert t.vllm_mode == "server" and gen["server_gpus"] >= 1
            # the server's own budget: 0.9 x each GPU, for the weights and the KV cache
            assert gen["server_bytes_per_gpu"] == int(0.9 * spec.total_bytes)
            assert gen["server_kv_pool_bytes_per_replica"] + gen["weights_bytes"] == \
                gen["tensor_parallel"] * gen["server_bytes_per_gpu"]
        else:
            assert ranks == 4 and t.vllm_mode == "colocate" and 0 < t.vllm_gpu_memory_utilization <= 1
    # the fastest fitting candidate of each mode: its per-rank figures are memfit.estimate's of the same setup
    for mode in ("colocate", "server"):
        fitting = [c for c in r.candidates if c.generation["mode"] == mode and c.fits]
        best = min(fitting, key=lambda c: c.step.total_s)
        t, report = _rank_estimate(s, r, best)
        assert report.fits is True
        assert report.peak_reserved_bytes == best.peak_reserved_bytes
        assert report.peak_allocated_bytes == best.peak_allocated_bytes
        assert report.device_used_bytes == best.device_used_bytes  # reserved + outside PyTorch + NCCL (+ vLLM share)
    best = r.chosen_candidate
    cmds = r.launch.commands
    if best.generation["mode"] == "server":
        k = best.generation["server_gpus"]
        assert cmds[0].startswith(f"CUDA_VISIBLE_DEVICES={','.join(map(str, range(k)))} trl vllm-serve ")
        assert "--gpu-memory-utilization 0.9" in cmds[0]
        assert all(c.startswith(f"CUDA_VISIBLE_DEVICES={','.join(map(str, range(k, 4)))} ") for c in cmds[1:])
        assert r.launch.training_args["vllm_mode"] == "server" and "vllm_server_host" in r.launch.training_args
    else:
        assert any(f"--num_processes 4" in c for c in cmds)


@pytest.mark.slow
def test_server_gpus_asked_for_and_the_launch_files():
    """`vllm_server_gpus=2` on 4 GPUs: only server layouts on 2 GPUs, training on the other 2 with the strategy's
    accelerate config for 2 processes; the files are written by memfit.planner.launch."""
    import yaml

    from memfit.planner.parallel_plan import plan_parallel

    s = _setup(trainer="rloo")
    r = plan_parallel(s, gpus="4xA100-80GB", vllm_server_gpus=2, max_simulations=4)
    assert r.candidates and all(c.generation["server_gpus"] == 2 and c.generation["training_ranks"] == 2
                                for c in r.candidates)
    best = r.chosen_candidate
    assert best is not None and r.per_rank_batch == best.generation["completions_per_rank_per_step"]
    acc = yaml.safe_load(r.launch.files["accelerate_config.yaml"])
    assert acc["num_processes"] == 2
    assert r.launch.commands[0].startswith("CUDA_VISIBLE_DEVICES=0,1 trl vllm-serve ")
    assert "--data-parallel-size 2" in r.launch.commands[0]
    assert all(c.startswith("CUDA_VISIBLE_DEVICES=2,3 ") for c in r.launch.commands[1:])
    t, report = _rank_estimate(s, r, best)
    assert report.device_used_bytes == best.device_used_bytes and report.fits is True


@pytest.mark.slow
def test_a_server_is_chosen_where_a_colocated_vllm_cannot_start_beside_the_step():
    """A 1.5M-token max_position_embeddings makes vLLM's smallest share (the weights and one max_model_len
    sequence, memfit.planner.grpo_plan) most of a 1 GiB card: no colocated share leaves the step room, while the
    server's 0.9 of its own GPU holds it; the plan chooses the server and trains on the other GPUs."""
    from memfit.planner.grpo_time import kv_bytes_per_token
    from memfit.planner.parallel_plan import plan_parallel

    long = LlamaConfig(**{**LLAMA.to_dict(), "max_position_embeddings": 1_500_000})
    s = _setup(model=long)
    spec = as_gpu_spec("1GiB")
    minimum = kv_bytes_per_token(long, 4) * 1_500_000  # the tiny config's weights are fp32
    assert 0.7 * spec.total_bytes < minimum < 0.9 * spec.total_bytes
    r = plan_parallel(s, gpus="2x1GiB", max_simulations=6)
    colocated = [c for c in r.candidates if c.generation["mode"] == "colocate"]
    assert colocated and not any(c.fits for c in colocated)
    best = r.chosen_candidate
    assert best is not None and best.generation["mode"] == "server"
    assert best.generation["server_gpus"] == 1 and best.generation["training_ranks"] == 1
    assert best.generation["server_kv_pool_bytes_per_replica"] >= minimum - best.generation["weights_bytes"]
    t = s.replace(**best.setup_changes)
    assert t.effective_batch_size == 2 * s.effective_batch_size  # one training rank takes both ranks' completions
    assert r.launch.commands == [r.launch.commands[0], "CUDA_VISIBLE_DEVICES=1 python train.py"]
    _, report = _rank_estimate(s, r, best, "1GiB")
    assert report.fits is True and report.device_used_bytes == best.device_used_bytes


# -- `--allow` across GPUs ---------------------------------------------------------------------------------------

def test_fewer_generations_halve_the_completions_and_the_generation_batch_on_every_layout():
    """`--allow fewer_generations` across GPUs: the single-GPU remedy's variant (num_generations halved, the same
    prompts), so every layout's ranks split E / 2 completions per step and a generation batch of G / 2, as
    memfit.planner.grpo_plan.grpo_micro_batches scales them on one GPU (no simulation: the candidates only)."""
    from memfit.planner.grpo_parallel_plan import GrpoParallelParts, Layout, _opt_ins, _Planner
    from memfit.planner.grpo_plan import opt_in_methods
    from memfit.planner.launch import VARIANTS
    from memfit.planner.parallel_plan import (TIE_FRACTION, ParallelCandidate, ParallelPlanResult, _model_facts,
                                              _request, _step)
    from memfit.remedies import REGISTRY

    s = _setup(num_generations=4)
    kw = dict(gpus="4xA100-80GB", world_size=None, nodes=1, global_batch=None, margin=None, strategies=("ddp",),
              interconnect=None, network_gbps=None, max_simulations=4)
    req = _request(s, gpu=None, allow=("fewer_generations",), **kw)
    spec = req.spec
    assert _opt_ins(s, req) == opt_in_methods(s, spec, ["fewer_generations"]) == \
        REGISTRY["fewer_generations"].variants(s, spec) == [{"num_generations": 2}]
    assert _opt_ins(s, _request(s, gpu=None, allow=(), **kw)) == []
    pl = _Planner(s, req, GrpoParallelParts(ParallelCandidate, ParallelPlanResult, _model_facts, _step, TIE_FRACTION),
                  None)
    e, g = global_sizes(s, 4)
    layouts = [Layout("colocate", 4), Layout("server", 2, 2, 1, 2)]
    cands, _ = pl.candidates(layouts, [v for v in VARIANTS if v.key == "ddp"], {"num_generations": 2})
    assert {c.layout for c in cands} == set(layouts)
    for c in cands:
        t = s.replace(**c.changes)
        ranks = c.layout.training_ranks
        assert t.num_generations == 2 and c.method == (("num_generations", 2),)
        assert t.effective_batch_size * ranks == e // 2
        assert t.per_device_train_batch_size * t.grpo_sizes[0] * ranks == g // 2
        assert (g // 2 // ranks) % t.num_generations == 0  # whole prompt groups per rank


@pytest.mark.slow
def test_lora_allowed_fits_two_gpus_where_nothing_fits_as_typed():
    """On 2 cards of 1 GiB a 37M-parameter Llama (fp32 weights, AdamW, beta 0.04) fits no layout as typed: neither
    vLLM colocated on both nor a server on one and training on the other; the plan says nothing fits. With
    `--allow lora` the same as-typed candidates are simulated first, none fits, and then the layouts are weighed
    with LoRA on every rank: the chosen one fits, its per-rank figures are memfit.estimate's of its per-rank setup,
    its change is said as the single-GPU plan says it (`LoRA r16` in the changes, peft's code in the launch, no
    `lora_r` among the GRPOConfig names) and a note names the opt-in."""
    from memfit.commands.plan import short
    from memfit.parallel.rank import shared_simulations
    from memfit.planner.parallel_plan import plan_parallel

    big = LlamaConfig(**{**LLAMA.to_dict(), "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024,
                         "max_position_embeddings": 64})
    # E = 2 completions per step, G = 4: colocated on 2 (b 1) and a server on 1 + training on 1 (b 1 or 2)
    s = _setup(model=big, per_device_train_batch_size=1, gradient_accumulation_steps=1, steps_per_generation=2,
               num_generations=2, max_completion_length=16, beta=0.04)
    with shared_simulations():
        typed = plan_parallel(s, gpus="2x1GiB", strategies=("ddp",))
        r = plan_parallel(s, gpus="2x1GiB", strategies=("ddp",), allow=("lora",))
    assert typed.chosen is None and typed.candidates and not any(c.fits for c in typed.candidates)
    assert {c.generation["mode"] for c in typed.candidates} == {"colocate", "server"}
    n = len(typed.candidates)
    assert [c.to_json() for c in r.candidates[:n]] == [c.to_json() for c in typed.candidates]  # the as-typed search
    assert all(c.setup_changes.get("lora_r") == 16 for c in r.candidates[n:]) and len(r.candidates) > n
    best = r.chosen_candidate
    assert best is not None and best.fits and r.chosen >= n
    assert "LoRA r16" in short(best.setup_changes)
    assert any("with --allow: lora (LoRA" in x for x in r.notes)
    assert "lora_r" not in r.launch.training_args and any("LoraConfig(r=16" in x for x in r.launch.code)
    t, report = _rank_estimate(s, r, best, "1GiB", big)
    assert t.lora_r == 16 and report.fits is True
    assert report.peak_reserved_bytes == best.peak_reserved_bytes
    assert report.peak_allocated_bytes == best.peak_allocated_bytes


def test_the_server_decodes_at_most_vllm_serve_max_num_seqs_at_once():
    """trl vllm-serve passes no --max-num-seqs, so a replica schedules at most vllm serve's default (vllm
    arg_utils.py `get_batch_defaults`: 256, or 1024 on a GPU of 70 GiB or more that is not an A100): 600
    completions of the tiny model, whose KV cache pool holds them all, take 3 waves on an A100-80GB and one on an
    H100-80GB; the cap changes the waves, not the server's memory (its pool is the same 0.9 of the GPU)."""
    from memfit.gpus.vllm import vllm_serve_max_num_seqs
    from memfit.planner.grpo_parallel_plan import Layout, server_generation_s

    s = _setup()
    lay = Layout("server", 2, 1, 1, 1)
    out = {}
    for gpu in ("A100-80GB", "H100-80GB"):
        spec = as_gpu_spec(gpu)
        out[gpu] = server_generation_s(s, spec, params=10**6, weight_bytes=4 * 10**6, kv_per_token=1024, layout=lay,
                                       generation_batch=600, utilization=0.9)
    assert vllm_serve_max_num_seqs("A100-80GB", as_gpu_spec("A100-80GB").total_bytes) == 256
    assert vllm_serve_max_num_seqs("H100-80GB", as_gpu_spec("H100-80GB").total_bytes) == 1024
    assert vllm_serve_max_num_seqs("L40S", as_gpu_spec("L40S").total_bytes) == 256  # under 70 GiB
    assert out["A100-80GB"][1:] == (256, 3) and out["H100-80GB"][1:] == (600, 1)
