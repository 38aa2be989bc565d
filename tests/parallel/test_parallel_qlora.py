"""QLoRA (bitsandbytes 4-bit base weights + LoRA) and LoRA under FSDP2, FSDP1 and DeepSpeed ZeRO-3, per rank.

The sharded 4-bit storage is checked in closed form (fast), and rank 0's simulated trace against REAL 2-process
CPU runs (slow): the tiny Llama checkpoint loaded by transformers with a real `BitsAndBytesConfig` (bitsandbytes'
CPU backend quantizes it), peft's `get_peft_model`, then the engine as the Trainer prepares it: FSDP2
`fully_shard` per decoder block and the root; FSDP1 with peft's `fsdp_auto_wrap_policy`, `use_orig_params=False`
and the quant-storage mixed precision (transformers `update_fsdp_plugin_peft`); DeepSpeed ZeRO-3 on its CPU
accelerator. Each rank's live tensor bytes are counted as memory_budget counts them (DTensors as their local
shards, FSDP's resize-based frees seen through memfit's own hooks), the layers' quantization states included
(attributes, not parameters: counted from bitsandbytes' QuantState)."""

import json
import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from memfit.testing import round_size

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

HIDDEN, INTER, LAYERS, VOCAB = 128, 256, 2, 256
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}  # peft's default targets for Llama: q_proj, v_proj
ZERO = {"reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686, "stage3_param_persistence_threshold": 640}


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0)


def _setup(**changes):
    from memfit.train_setup import TrainSetup

    kw = dict(task="causal-lm", per_device_train_batch_size=2, max_length=16, optim="adamw_torch",
              eval_strategy="no", weights_dtype="bf16", precision="fp32", load_in_4bit=True,
              bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bf16", bnb_4bit_quant_storage="bfloat16",
              kbit_prep=False, lora_r=LORA["r"], lora_alpha=LORA["lora_alpha"], lora_dropout=LORA["lora_dropout"])
    kw.update(changes)
    if not kw["load_in_4bit"]:
        for key in ("bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "kbit_prep"):
            kw.pop(key)
    return TrainSetup.from_kwargs(_config(), **kw)


def _quantized_linears():
    """(out_features, in_features) of every Linear transformers quantizes in the tiny Llama (all but lm_head)."""
    per_layer = [(HIDDEN, HIDDEN)] * 4 + [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    return per_layer * LAYERS


# -- the sharded 4-bit storage in closed form ---------------------------------------------------------------------
@pytest.mark.parametrize("storage,itemsize", [("bfloat16", 2), pytest.param("float32", 4, marks=pytest.mark.slow)])
def test_sharded_4bit_storage_in_closed_form(storage, itemsize):
    """FSDP2 rank 0 of 2 holds half of each packed 4-bit weight and every layer's whole quantization state.

    bitsandbytes packs two 4-bit values per byte, `n/2` bytes per weight of n elements, as `(n/2)/itemsize`
    elements of the storage dtype (functional.py `quantize_4bit`: `((n + 1) // (2 * itemsize), 1)`); FSDP2
    shards dim 0 into `ceil(rows / 2)` rows per rank. The quantization state (a float32 absmax per block of 64
    elements, the 16-entry float32 nf4 code) is no parameter: whole on every rank. ZeRO-3 partitions the same
    bytes, counted in its dtype's elements (bf16: 2 bytes each)."""
    from memfit.parallel import ParallelSetup
    from memfit.parallel.rank import simulate_rank

    rows = [(o * i // 2) // itemsize for o, i in _quantized_linears()]
    packed_shard_bytes = sum(-(-r // 2) * itemsize for r in rows)
    assert packed_shard_bytes == sum(o * i for o, i in _quantized_linears()) // 2 // 2  # n/2 bytes, halved
    quant_state_bytes = sum(4 * (o * i // 64) + 4 * 16 for o, i in _quantized_linears())

    setup = _setup(bnb_4bit_quant_storage=storage)
    r = simulate_rank(setup, ParallelSetup(world_size=2, strategy="fsdp"))
    setup_weights = sorted(e.size_bytes for e in r.sim.trace
                           if e.action == "alloc" and e.phase == "setup" and e.category == "weights")
    # the rank's parameter shards: each packed weight's, exactly its bytes
    shard_sizes = sorted(-(-row // 2) * itemsize for row in rows)
    remaining = list(setup_weights)
    for size in shard_sizes:
        assert size in remaining, (size, storage)
        remaining.remove(size)
    absmax = [4 * (o * i // 64) for o, i in _quantized_linears()]
    for size in absmax:  # whole, not halved
        assert size in remaining, (size, storage)
        remaining.remove(size)
    assert remaining.count(4 * 16) >= len(rows)  # the nf4 code table of every layer
    report = r.sim.quantization
    assert report["quant_storage"] == storage and report["quantized_params"] == sum(o * i for o, i in
                                                                                    _quantized_linears())
    assert quant_state_bytes == sum(absmax) + 64 * len(rows)

    from memfit.parallel import zero_settings_from_deepspeed

    z, _ = zero_settings_from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **ZERO}},
                                        hidden_size=HIDDEN)
    z3 = simulate_rank(setup.replace(precision="bf16"), ParallelSetup(world_size=2, strategy="zero3", zero=z))
    bufs = {b["name"]: b["bytes"] for b in z3.buffers}
    assert bufs["bitsandbytes quantization states (whole on every rank)"] == quant_state_bytes
    # DeepSpeed casts the floating parameters to bf16 (`module.bfloat16()`: the packed storage too, its elements
    # kept: bf16 as it is, float32 halved in bytes, its values then garbage, hence the guides' storage = compute
    # dtype) and partitions all but the persistent ones (<= 640 elements: the 2 * LAYERS + 1 norms) into ceil(P/2)
    packed = sum(rows)
    lora = LAYERS * 2 * 2 * LORA["r"] * HIDDEN  # q_proj and v_proj, A and B
    partitioned = packed + 2 * VOCAB * HIDDEN + lora
    assert bufs["persistent parameters (whole)"] == 2 * HIDDEN * (2 * LAYERS + 1)
    assert bufs["bit16 parameter partitions"] == 2 * -(-partitioned // 2)


@pytest.mark.slow
def test_uint8_storage_stays_whole_under_fsdp2_and_is_refused_by_fsdp1():
    """The default `bnb_4bit_quant_storage` uint8: accelerate leaves those weights out of FSDP2's sharding (every
    rank holds them whole, and says so); FSDP1 cannot flatten integer tensors (its own ValueError, one line)."""
    from memfit.errors import MemfitError
    from memfit.parallel import ParallelSetup
    from memfit.parallel.rank import simulate_rank

    setup = _setup(bnb_4bit_quant_storage="uint8")
    r = simulate_rank(setup, ParallelSetup(world_size=2, strategy="fsdp"))
    whole = sum(o * i // 2 for o, i in _quantized_linears())
    weights = sum(e.size_bytes for e in r.sim.trace if e.action == "alloc" and e.phase == "setup"
                  and e.category == "weights" and e.size_bytes in {o * i // 2 for o, i in _quantized_linears()})
    assert weights == whole
    assert any("out of its sharding" in n for n in r.sim.notes)
    with pytest.raises(MemfitError, match="integer tensors.*bnb_4bit_quant_storage") as err:
        simulate_rank(setup, ParallelSetup(world_size=2, strategy="fsdp", fsdp_version=1, use_orig_params=False))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_parameter_offload_moves_the_packed_shards_to_the_host():
    """FSDP2's CPUOffloadPolicy: each rank's host holds its shard of every parameter (the packed 4-bit storage in
    its bf16 elements, embeddings and norms in bf16) and, for the trainable LoRA weights, fp32 weights, gradients
    and Adam's two states (16 B per element); the GPU then holds less. ZeRO-3's offload_param / offload_optimizer
    likewise."""
    from memfit.parallel import ParallelSetup, zero_settings_from_deepspeed
    from memfit.parallel.rank import simulate_rank
    from memfit.peaks import peaks

    setup = _setup()
    packed = sum(o * i // 2 for o, i in _quantized_linears()) // 2  # bf16 elements
    frozen = packed + 2 * VOCAB * HIDDEN + HIDDEN * (2 * LAYERS + 1)
    lora = LAYERS * 2 * 2 * LORA["r"] * HIDDEN
    on, off = (simulate_rank(setup, ParallelSetup(world_size=2, strategy="fsdp", cpu_offload=c)) for c in (True, False))
    assert on.host_bytes == 2 * (frozen // 2) + 16 * (lora // 2)
    assert peaks(on.sim.trace).overall.bytes < peaks(off.sim.trace).overall.bytes
    offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    z, _ = zero_settings_from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **ZERO,
                                                                                        **offload}},
                                        hidden_size=HIDDEN)
    z3 = simulate_rank(setup.replace(precision="bf16"), ParallelSetup(world_size=2, strategy="zero3", zero=z))
    host = {b["name"]: b["bytes"] for b in z3.buffers if b["device"] == "host"}
    assert host["bit16 parameter partitions"] == 2 * -(-(frozen - HIDDEN * (2 * LAYERS + 1) + lora) // 2)


@pytest.mark.slow
def test_quant_storage_from_the_flag_and_from_args(tmp_path, capsys):
    """`bnb_4bit_quant_storage` is a setting: `--bnb-4bit-quant-storage` and `quantization_config` in `--args` give
    the same sharded estimate."""
    from transformers import LlamaForCausalLM

    from memfit.cli import main

    ckpt = tmp_path / "tiny"
    LlamaForCausalLM(_config()).save_pretrained(ckpt)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                                        "bnb_4bit_compute_dtype": "bfloat16",
                                                        "bnb_4bit_quant_storage": "bfloat16"}}))
    common = ["estimate", str(ckpt), "--task", "causal-lm", "--lora-r", "8", "--max-length", "16", "--eval-strategy",
              "no", "--gpus", "2xA100-80GB", "--strategy", "fsdp", "--json", "--no-cache"]
    reports = []
    for extra in (["--args", str(args)], ["--load-in-4bit", "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-compute-dtype",
                                          "bf16", "--bnb-4bit-quant-storage", "bfloat16"]):
        assert main(common + extra) == 0
        out = capsys.readouterr().out
        # a library's import-time log line may precede the report on a captured stdout (DeepSpeed's "Setting
        # accelerator to CPU" under pytest's capture): the report is the JSON object from its first line on
        reports.append(json.loads(out[out.index("{\n"):]))
    assert [r["quantization"]["quant_storage"] for r in reports] == ["bfloat16", "bfloat16"]
    assert reports[0]["peak_allocated_bytes"] == reports[1]["peak_allocated_bytes"]


# -- against real 2-process CPU runs ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(checkpoint, quantized, storage):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from peft import LoraConfig, get_peft_model

    q = None
    if quantized:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_quant_storage=getattr(torch, storage))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=q, dtype=torch.bfloat16,
                                                 device_map="cpu")
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


def _quant_states(model):
    from bitsandbytes.nn import Linear4bit

    out = []
    for m in model.modules():
        if isinstance(m, Linear4bit):
            qs = m.weight.quant_state
            out += [qs.absmax, qs.code]
            if qs.nested:
                out += [qs.offset, qs.state2.absmax, qs.state2.code]
    return out


def _worker(rank, world, port, out, checkpoint, engine, quantized, storage):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch.distributed as dist

    from helpers import shard_budget
    from memfit.models.quantization import quiet_bnb_logs
    from memfit.parallel import _dist_adapter as da

    if engine == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)

    torch.manual_seed(0)
    with quiet_bnb_logs():
        model = _load(checkpoint, quantized, storage)
    ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[-1, -1] = 0  # memfit's simulated batch: one pad token
    res = {}
    budget = shard_budget(1 << 40, count=[model, *_quant_states(model)])
    from torch.distributed.fsdp import _runtime_utils

    catch_all = _runtime_utils._catch_all_reshard  # FSDP1's own, with real data pointers (not memfit's stand-in)
    with budget, da.fsdp_storage_hooks(budget.on_alloc, budget.on_free), \
            da.fsdp1_storage_hooks(budget.on_alloc, budget.on_free), quiet_bnb_logs():
        _runtime_utils._catch_all_reshard = catch_all
        if engine == "fsdp2":
            for block in model.base_model.model.model.layers:
                da.fully_shard(block)
            da.fully_shard(model)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)
        elif engine == "fsdp1":
            from peft.utils.other import fsdp_auto_wrap_policy

            # transformers update_fsdp_plugin_peft: peft's policy; the quant storage dtype as mixed precision
            dtype = getattr(torch, storage) if quantized else None
            model = da.fsdp1_wrap(model, block_classes=None, sharding_strategy="FULL_SHARD", mesh=None,
                                  use_orig_params=False, cpu_offload=False, param_dtype=dtype, reduce_dtype=dtype,
                                  auto_wrap_policy=fsdp_auto_wrap_policy(model))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)
        else:
            import deepspeed

            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                   "zero_optimization": {"stage": 3, **ZERO}}
            engine_, _, _, _ = deepspeed.initialize(
                model=model, config=cfg, model_parameters=[p for p in model.parameters() if p.requires_grad])
        res["init"] = budget.live_bytes
        for step in range(2):
            if step == 1:  # the second step's own peak: after the first step's transients (test docstring)
                res["peak1"] = budget.peak_bytes
                budget.reset_peak()
            if engine == "zero3":
                loss = engine_(input_ids=ids, attention_mask=mask, labels=ids).loss
                engine_.backward(loss)
                engine_.step()
                del loss
            else:
                # FSDP1 QLoRA computes under the Trainer's bf16 autocast: peft casts an adapter's input to its fp32
                # sharded weight's dtype, which FSDP1's bf16 mixed precision then all-gathers in bf16
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=engine == "fsdp1" and quantized):
                    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
                loss.backward()
                del loss
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0,
                                               foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        res["final"] = budget.live_bytes
        res["peak2"] = budget.peak_bytes
        res["peak"] = max(res["peak1"], res["peak2"])
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as tests/parallel/test_parallel_deepspeed.py: no interpreter teardown racing the peer


def _real(engine, quantized=True, storage="bfloat16"):
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        LlamaForCausalLM(_config()).to(torch.bfloat16).save_pretrained(os.path.join(d, "ckpt"))
        mp.spawn(_worker, args=(2, _free_port(), d, os.path.join(d, "ckpt"), engine, quantized, storage), nprocs=2,
                 join=True)
        return [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(2)]


def _predicted(engine, quantized=True, storage="bfloat16"):
    from memfit.parallel import ParallelSetup, zero_settings_from_deepspeed
    from memfit.parallel.rank import simulate_rank

    changes = {"bnb_4bit_quant_storage": storage} if quantized else {"load_in_4bit": False}
    if engine == "zero3":
        setup = _setup(precision="bf16", **changes)
        z, _ = zero_settings_from_deepspeed({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {
            "torch_adam": True}}, "zero_optimization": {"stage": 3, **ZERO}}, hidden_size=HIDDEN)
        par = ParallelSetup(world_size=2, strategy="zero3", zero=z)
    else:
        setup = _setup(precision="bf16" if engine == "fsdp1" and quantized else "fp32", **changes)
        par = ParallelSetup(world_size=2, strategy="fsdp", fsdp_version=1 if engine == "fsdp1" else 2,
                            use_orig_params=engine != "fsdp1")
    r = simulate_rank(setup, par)
    live = peak = peak1 = peak2 = 0
    init = None
    steps = 0
    prev = "setup"
    for e in r.sim.trace:
        if init is None and e.phase != "setup":
            init = live
        if prev == "optimizer" and e.phase != "optimizer":
            steps += 1
            peak1 = peak1 if steps > 1 else peak
            peak2 = live
        prev = e.phase
        live += round_size(e.size_bytes) if e.action == "alloc" else -round_size(e.size_bytes)
        peak = max(peak, live)
        if steps:
            peak2 = max(peak2, live)
    # the Trainer's running loss (`tr_loss`, one 512-byte block from the setup on), which these loops do not have
    return {"init": init - 512, "final": live - 512, "peak": peak - 512, "peak1": peak1 - 512, "peak2": peak2 - 512}


CASES = {"fsdp2-qlora": ("fsdp2", True), "fsdp1-qlora": ("fsdp1", True), "zero3-qlora": ("zero3", True),
         "fsdp1-lora": ("fsdp1", False)}

#: (figure, relative bound) checked per case; figures: `init` (after wrapping), `final`, `peak`, `peak1` / `peak2`
#: (the peaks of the first and of the second optimizer step). See the test's docstring for the measurements.
CHECKS = {
    "fsdp2-qlora": [("init", 0.03), ("final", 0.04), ("peak", 0.05)],
    "fsdp1-qlora": [("final", 0.03), ("peak2", 0.05)],
    "fsdp1-lora": [("final", 0.03), ("peak2", 0.03)],
    "zero3-qlora": [("init", 0.12), ("final", 0.12), ("peak1", 0.06)],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_per_rank_against_a_real_two_process_run(case):
    """Measured (bytes, both real ranks identical, against memfit's rank 0):

    * FSDP2 QLoRA (bf16 storage): init 198144 / final 233472 / peak 943616 against 195072 / 227840 / 975872
      (-1.6%, -2.4%, +3.4%).
    * FSDP1 QLoRA (peft's policy, bf16 mixed precision, under bf16 autocast): final 229376, second-step peak
      797696 against 227840 / 821248 (-0.7%, +3.0%).
    * FSDP1 LoRA (peft's policy, `use_orig_params=False`, the fix of `_catch_all_reshard` under fake tensors:
      without it memfit kept every frozen unit unsharded, final 1364480, +204%): final 449024, second-step peak
      1489920 against 444928 / 1485824 (-0.9%, -0.3%).
      FSDP1 runs here hold the loaded (unwrapped) model's storages from wrapping until the first forward (real
      init 523264 / 1232896 B, the first step's peak above the second's), which this CPU set-up loads in place;
      memfit's init is the shards alone, so for FSDP1 only `init <= real` is checked.
    * ZeRO-3 QLoRA (bf16): init 235008 / final 267776 / first-step peak 736768 against 211456 / 243712 / 702976
      (-10.0%, -9.0%, -4.6%): DeepSpeed keeps one partition tensor per parameter and memfit one buffer (57 tensors
      of this tiny model rounded to 512 B each, up to 29 KB; not attributed one by one). The second step peaks at
      842240 against 973312 (+15.6%): once its trace is complete memfit keeps every gathered parameter into the
      backward (memfit.parallel.zero: measured on a model whose every module runs a backward), while DeepSpeed
      also releases frozen modules no backward reuses; memfit's figure is an upper bound there, checked as one."""
    engine, quantized = CASES[case]
    real = _real(engine, quantized)
    pred = _predicted(engine, quantized)
    for r in real:
        for key, bound in CHECKS[case]:
            assert abs(r[key] - pred[key]) <= bound * r[key], (case, key, r[key], pred[key])
        if engine == "fsdp1":
            assert pred["init"] <= r["init"], (case, r, pred)
        if engine == "zero3":
            assert 0 <= pred["peak2"] - r["peak2"] <= 0.20 * r["peak2"], (case, r, pred)
