"""memfit.fit under DeepSpeed ZeRO-2/3 (a real Trainer on DeepSpeed's CPU accelerator, 2 processes, gloo) and the
chunk agreement under FSDP2 (`fully_shard` in a plain loop, 2 processes, gloo: accelerate does not enable FSDP
on the CPU, accelerate/state.py AcceleratorState.__init__)."""

import json
import multiprocessing
import os
import socket
import sys
import time
import types

import pytest
import torch

from memfit.errors import MemfitError
from memfit.fitting import engines

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where helpers is


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, args, timeout=150):
    """Run `target(rank, *args)` on 2 spawned processes; fail (not hang) when a rank is still waiting."""
    sys.path.insert(0, TESTS)  # the ranks import helpers
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not any(hung), f"a rank was still waiting after {timeout} s: {hung}"


def _leave_together():
    # as tests/parallel/test_parallel_deepspeed.py: leave together and skip the interpreter's teardown (a rank that exits
    # while its peer still talks to it, or C++ threads destroyed at exit, abort the process with SIGABRT)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


# -- DeepSpeed: a real Trainer, memfit.fit, an OOM on rank 1 ---------------------------------------------------

def _ds_config(stage):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def _full_weights(trainer, stage):
    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    params = list(model.parameters())
    if stage == 3:  # the parameters are partitioned: gather them (a collective: every rank calls it)
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def _inject_oom_after_forward(trainer, at_call, min_batch):
    """A real-format CUDA OOM after the model's forward (where a language model's loss upcasts its logits), from the
    `at_call`-th training forward on, while micro-batches hold `min_batch` examples or more."""
    import helpers

    original = trainer.compute_loss
    calls = {"n": 0}

    def compute_loss(model, inputs, *a, **k):
        out = original(model, inputs, *a, **k)
        calls["n"] += model.training
        if model.training and calls["n"] >= at_call and inputs["input_ids"].shape[0] >= min_batch:
            del out
            raise helpers.oom_error()
        return out

    trainer.compute_loss = compute_loss


def _ds_worker(rank, port, out, stage):
    os.environ.update(DS_ACCELERATOR="cpu", WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import helpers

    import memfit.fitting.run as mf

    res = {}
    try:
        plain = helpers.tiny_trainer(os.path.join(out, "plain"), bs=4, ga=2, deepspeed=_ds_config(stage))
        plain.train()
        w_plain = _full_weights(plain, stage)
        run = os.path.join(out, "run")
        if rank == 0:  # a checkpoint memfit did not write: kept
            os.makedirs(os.path.join(run, "checkpoint-2"))
            open(os.path.join(run, "checkpoint-2", "mine.txt"), "w").close()
        torch.distributed.barrier()
        t = helpers.tiny_trainer(run, bs=4, ga=2, deepspeed=_ds_config(stage), save_strategy="steps", save_steps=2)
        if rank == 1 and stage == 2:  # from the 2nd micro-step on (the boundary one of window 1), in the forward
            helpers.inject_train_oom(t, at_call=2, min_batch=4)
        if rank == 1 and stage == 3:  # the same, in the loss: after the forward's last parameter all-gather
            _inject_oom_after_forward(t, at_call=2, min_batch=4)
        # a GPU too small for it: memfit's one-GPU plan (micro-batch, ...) must not be applied to a DeepSpeed run
        import dataclasses

        from memfit.gpus.catalog import resolve_gpu

        tiny_gpu = dataclasses.replace(resolve_gpu("T4"), name="tiny", total_bytes=1 << 20)
        report = mf.fit(t, gpu=tiny_gpu, plan=True, max_recoveries=2)
        w_fit = _full_weights(t, stage)
        res.update(fits=report.preflight["fits"], plan_applied=report.plan_applied,
                   no_plan_note=any("does not apply a plan to a DeepSpeed" in n for n in report.notes),
                   micro_batch=t.args.per_device_train_batch_size, ga=t.args.gradient_accumulation_steps)
        res.update(steps=report.steps_completed, expected=report.steps_expected, chunks=report.micro_batch_chunks,
                   recoveries=len(report.oom_recoveries), parallel=report.preflight["parallel"],
                   predicted=report.preflight["predicted_peak_allocated_bytes"], checkpoints=report.checkpoints,
                   engine_steps=int(t.model_wrapped.global_steps),
                   diff_plain=max((a - b).abs().max().item() for a, b in zip(w_plain, w_fit)))
        if rank == 0:
            # the same setup, estimated by memfit.estimate with the parallel settings read here from the JSON
            from memfit import estimate
            from memfit.parallel import ParallelSetup, zero_settings_from_deepspeed

            zero, _ = zero_settings_from_deepspeed(_ds_config(stage), hidden_size=32, precision="fp32")
            from memfit.fitting._trainer import without_hf_deepspeed_config

            pre = mf.preflight(t)
            with without_hf_deepspeed_config():  # ZeRO-3's live config would build memfit's meta model under zero.Init
                res["estimate"] = estimate(pre.setup, gpu=tiny_gpu, parallel=ParallelSetup(world_size=2, strategy=f"zero{stage}",
                                                                             zero=zero)).peak_allocated_bytes
            res["files"] = {c: sorted(os.listdir(os.path.join(run, c))) for c in sorted(os.listdir(run))}
            res["shards"] = sorted(os.listdir(os.path.join(run, "checkpoint-4", "global_step4")))
        torch.save(w_fit, os.path.join(out, f"w{rank}.pt"))
        # resume from DeepSpeed's checkpoint-2 (its memfit-state.json: 2 chunks): the same steps 3 and 4.
        # ZeRO-2: the folder named; ZeRO-3: `True` in an output_dir holding a copy of it (a run stopped after step 2)
        from transformers import TrainerCallback

        resumed_dir = os.path.join(out, "resumed")
        if stage == 3 and rank == 0:
            import shutil

            shutil.copytree(os.path.join(run, "checkpoint-2"), os.path.join(resumed_dir, "checkpoint-2"))
        torch.distributed.barrier()
        again = helpers.tiny_trainer(resumed_dir, bs=4, ga=2, deepspeed=_ds_config(stage))
        if rank == 1:  # memfit.fit's evaluation at the end: rank 1's eval batch of 8 (its 8 examples) does not fit
            helpers.inject_eval_oom(again, at_call=1, min_batch=8)
        taken = []

        class _Count(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                taken.append(state.global_step)

        again.add_callback(_Count())
        resumed = mf.fit(again, plan=False, resume_from_checkpoint=(
            os.path.join(run, "checkpoint-2") if stage == 2 else True))
        res["resumed"] = [resumed.steps_completed, resumed.micro_batch_chunks, taken]
        res["eval"] = [[r["phase"] for r in resumed.oom_recoveries], again.args.per_device_eval_batch_size,
                       resumed.final_metrics["eval_loss"]]
        res["diff_resumed"] = max((a - b).abs().max().item() for a, b in zip(w_fit, _full_weights(again, stage)))
        if stage == 2:  # a rank that cannot split further stops, and makes the other stop instead of waiting
            fatal = helpers.tiny_trainer(os.path.join(out, "fatal"), bs=4, ga=2, deepspeed=_ds_config(stage))
            if rank == 1:
                helpers.inject_train_oom(fatal, at_call=1, min_batch=1)
            try:
                mf.fit(fatal, plan=False, max_recoveries=2)
                res["fatal"] = "ok"
            except Exception as exc:  # noqa: BLE001
                res["fatal"] = f"{type(exc).__name__} {fatal.state.global_step} {'in a chunk of' in str(exc)}"
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank ended with
        import traceback

        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(res, fh)
    _leave_together()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_oom_on_one_rank_recovers_with_the_update_of_a_run_without_it(stage, tmp_path):
    pytest.importorskip("deepspeed")
    d = str(tmp_path)
    _spawn(_ds_worker, (_free_port(), d, stage))
    res = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(2)]
    for r in res:
        assert "error" not in r, r.get("error")
    # no lost step: 64 examples / (4 x 2 ranks) / 2 micro-steps = 4 optimizer steps, DeepSpeed took 4 too
    assert [(r["steps"], r["expected"], r["engine_steps"]) for r in res] == [(4, 4, 4)] * 2
    # the OOM was rank 1's; both ranks split into 2 chunks from then on
    assert [(r["recoveries"], r["chunks"]) for r in res] == [(0, 2), (1, 2)]
    w0, w1 = (torch.load(os.path.join(d, f"w{r}.pt")) for r in range(2))
    assert max((a - b).abs().max().item() for a, b in zip(w0, w1)) == 0.0  # the ranks agree
    assert res[0]["diff_plain"] < 1e-5  # the same update as DeepSpeed's own run without the OOM
    # preflight per rank: the strategy it assumed, and memfit.estimate's prediction for it
    assert res[0]["parallel"]["strategy"] == f"zero{stage}" and res[0]["parallel"]["world_size"] == 2
    assert res[0]["predicted"] == res[0]["estimate"]
    # checkpoints: DeepSpeed's own layout (engine.save_checkpoint's global_step folder), published by renaming
    run = os.path.join(d, "run")
    files = res[0]["files"]
    assert res[0]["checkpoints"] == [os.path.join(run, "checkpoint-2"), os.path.join(run, "checkpoint-4")]
    assert "earlier-checkpoint-2" in files and files["earlier-checkpoint-2"] == ["mine.txt"]  # not deleted
    for c in ("checkpoint-2", "checkpoint-4"):
        assert {f"global_step{c[-1]}", "latest", "trainer_state.json", "memfit-state.json"} <= set(files[c]), files[c]
    assert ".memfit-staging" not in files
    # each rank's optimizer partition (engine.save_checkpoint -> `_save_zero_checkpoint`), staged by both, published once
    assert {r for r in (0, 1) if any(f"zero_pp_rank_{r}_" in f for f in res[0]["shards"])} == {0, 1}, res[0]["shards"]
    assert [r["resumed"] for r in res] == [[4, 2, [3, 4]]] * 2  # steps 3 and 4 only, split as saved
    # the OOM in rank 1's evaluation: both ranks reran it with the same halved eval batch, one gathered loss
    assert [r["eval"][:2] for r in res] == [[["eval"], 4]] * 2 and res[0]["eval"][2] == res[1]["eval"][2]
    assert res[0]["diff_resumed"] < 1e-5, res[0]["diff_resumed"]
    # predicted not to fit the tiny GPU, but no one-GPU plan on a DeepSpeed run, and the report says so
    assert [(r["fits"], r["plan_applied"], r["no_plan_note"], r["micro_batch"], r["ga"]) for r in res] == [
        (False, None, True, 4, 2)] * 2
    if stage == 2:  # rank 1 split 1 -> 2 -> 4 (max_recoveries=2) and still failed: both stop, at the same step
        assert [r["fatal"] for r in res] == ["PeerFailed 0 False", "OutOfMemoryError 0 True"]  # in the forward


# -- FSDP2: fully_shard in a plain loop (accelerate enables FSDP only on GPUs) -------------------------------

def _fsdp_worker(rank, port, out):
    """Both runs (without, then with the OOM on rank 1) in the same 2 processes."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    dist.init_process_group("gloo", rank=rank, world_size=2)
    reduce_scatters = {"n": 0}
    original = pg.foreach_reduce  # FSDP2's reduce-scatter of a group's gradients (FSDPParamGroup.post_backward)

    def counting(*a, **k):
        reduce_scatters["n"] += 1
        return original(*a, **k)

    pg.foreach_reduce = counting
    for mode in ("plain", "oom"):
        reduce_scatters["n"] = 0
        res = {}
        try:
            res, weights = _fsdp_train(rank, mode == "oom")
            res["reduce_scatters"] = reduce_scatters["n"]
            torch.save(weights, os.path.join(out, f"{mode}-w{rank}.pt"))
        except Exception as exc:  # noqa: BLE001
            import traceback

            res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as fh:
            json.dump(res, fh)
    _leave_together()


def _fsdp_train(rank, oom):
    """4 optimizer steps of a 2-block BERT under fully_shard, batch 4 x 2 micro-steps, memfit's agreed chunks."""
    from torch.distributed.fsdp import fully_shard
    from transformers import BertConfig, BertForSequenceClassification

    import helpers
    from memfit.fitting.recovery import _split, is_oom_error, oom_cause

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**helpers.CFG))
    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = helpers.TinyDataset()
    ga, bs = 2, 4
    state = engines.AgreedChunks(max_recoveries=2)
    recoveries = []
    state.recoveries_used = lambda: len(recoveries)
    state.on_recover = lambda cause, tried, old, new, here: recoveries.append((old, new)) if here else None
    forwards = {"n": 0}

    def run_chunk(part, weight, last, remaining, boundary):
        with engines.fsdp2_gradient_sync(model, not (boundary and not last)):
            forwards["n"] += 1
            failure = None
            try:
                loss = model(**part).loss
                if oom and rank == 1 and forwards["n"] >= 2 and part["input_ids"].shape[0] >= 4:
                    del loss  # in the loss, after the forward's last all-gather (engines' docstring)
                    raise helpers.oom_error()
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                failure = oom_cause(exc)
            engines.forward_vote(failure=failure, fatal=False,
                                 wanted_chunks=state.chunks * (2 if failure else 1), remaining=remaining)
            (loss * weight / ga).backward()
        return loss.detach() * weight

    def shares(parts):
        n = sum(p["input_ids"].shape[0] for p in parts)
        return [p["input_ids"].shape[0] / n for p in parts]

    order = list(range(rank * 32, rank * 32 + 32))  # each rank its half of the data, as a distributed sampler
    for step in range(4):
        for i in range(ga):
            idx = order[(step * ga + i) * bs:(step * ga + i + 1) * bs]
            batch = helpers.collate([data[j] for j in idx])
            boundary = i == ga - 1
            with engines.fsdp2_gradient_sync(model, boundary):  # accelerate's no_sync for non-final micro-steps
                engines.run_agreed_chunks(state, batch, split=_split, shares=shares,
                                          run_chunk=lambda p, w, la, rem: run_chunk(p, w, la, rem, boundary))
        opt.step()
        opt.zero_grad()
    return ({"chunks": state.chunks, "recoveries": recoveries},
            [p.full_tensor().detach() for p in model.parameters()])


def _fsdp_runs(d):
    _spawn(_fsdp_worker, (_free_port(), d), timeout=150)
    out = []
    for mode in ("plain", "oom"):
        res = [json.load(open(os.path.join(d, f"{mode}-{r}.json"))) for r in range(2)]
        for r in res:
            assert "error" not in r, r.get("error")
        out.append((res, [torch.load(os.path.join(d, f"{mode}-w{r}.pt")) for r in range(2)]))
    return out


@pytest.mark.slow
def test_fsdp2_chunks_agreed_after_an_oom_on_one_rank_give_the_update_of_a_run_without_it(tmp_path):
    (plain, w_plain), (rec, w_rec) = _fsdp_runs(str(tmp_path))
    assert [r["chunks"] for r in plain] == [1, 1]
    assert [r["chunks"] for r in rec] == [2, 2]  # both ranks split
    assert [r["recoveries"] for r in rec] == [[], [[1, 2]]]  # rank 1 ran out of memory
    # one reduce-scatter per FSDP group per window, chunks or not: set_requires_gradient_sync(False) on the others
    # (3 FSDP groups: 2 BertLayers and the root, x 4 windows)
    assert [r["reduce_scatters"] for r in rec] == [r["reduce_scatters"] for r in plain] == [12, 12]
    assert max((a - b).abs().max().item() for a, b in zip(*w_rec)) == 0.0
    assert max((a - b).abs().max().item() for a, b in zip(w_plain[0], w_rec[0])) < 1e-5


# -- single process: the parts that need no engine ------------------------------------------------------------

def test_forward_vote_alone_raises_forward_failed_with_the_doubled_count():
    engines.forward_vote(failure=None, fatal=False, wanted_chunks=1, remaining=1)  # nothing happens
    with pytest.raises(engines.ForwardFailed) as e:
        engines.forward_vote(failure=("does not fit", 123), fatal=False, wanted_chunks=4, remaining=2)
    assert (e.value.chunks, e.value.tried, e.value.here) == (4, 123, True)


def test_run_agreed_chunks_splits_only_what_was_not_backwarded():
    state = engines.AgreedChunks(chunks=2, max_recoveries=4)
    seen = []

    def split(batch, c):
        n = len(batch)
        c = min(c, n)
        bounds = [round(i * n / c) for i in range(c + 1)]
        return [batch[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]

    def run_chunk(part, weight, last, remaining):
        if len(part) > 2 and len(seen) == 1:
            raise engines.ForwardFailed(4, "oom", None, here=True)
        seen.append((part, round(weight, 3), last, remaining))
        return weight

    total = engines.run_agreed_chunks(state, list(range(8)), split=split, shares=lambda ps: [len(p) / sum(map(len, ps))
                                                                                               for p in ps],
                                      run_chunk=run_chunk)
    # the first half ran whole; the second half (failed, not backwarded) ran as two quarters; the last keeps the boundary
    assert seen == [([0, 1, 2, 3], 0.5, False, 2), ([4, 5], 0.25, False, 2), ([6, 7], 0.25, True, 1)]
    assert state.chunks == 4 and total == pytest.approx(1.0)


def _fake_trainer(**args):
    base = dict(deepspeed=None, fsdp=None, fsdp_config=None, world_size=1)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64))
    return types.SimpleNamespace(args=types.SimpleNamespace(**{**base, **args}), model=model, is_fsdp_enabled=True)


def test_parallel_for_trainer_reads_the_trainer_s_own_settings():
    setup = types.SimpleNamespace(precision="bf16")
    p, _ = engines.parallel_for_trainer(_fake_trainer(deepspeed={"bf16": {"enabled": "auto"},
                                                                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}},
                                                      world_size=4), setup)
    assert (p.strategy, p.world_size, p.zero.dtype, p.zero.param_persistence_threshold) == ("zero3", 4, "bf16", 640)
    # as TrainingArguments._process_fsdp_args leaves them: fsdp=True, the options moved into fsdp_config
    p, _ = engines.parallel_for_trainer(_fake_trainer(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": False},
                                                      world_size=8), setup)
    assert (p.strategy, p.world_size, p.reshard_after_forward) == ("fsdp", 8, False)
    p, notes = engines.parallel_for_trainer(_fake_trainer(fsdp=True, fsdp_config={"version": 1}), setup)
    assert p is None and "FSDP2 only" in notes[0]
    assert engines.parallel_for_trainer(_fake_trainer(), setup) == (None, [])
    with pytest.raises(MemfitError, match="stage"):
        engines.parallel_for_trainer(_fake_trainer(deepspeed={"zero_optimization": {"stage": 7}}), setup)


# -- ZeRO-3: an OOM inside the forward, between parameter all-gathers: fail fast, report first, peers told --------

def _ds_forward_oom_worker(rank, port, out):
    os.environ.update(DS_ACCELERATOR="cpu", WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import helpers

    import memfit.fitting.run as mf

    res = {}
    try:
        t = helpers.tiny_trainer(os.path.join(out, "run"), bs=4, ga=2, deepspeed=_ds_config(3), ddp_timeout=90)
        if rank == 1:  # after the 2nd BertLayer's forward: rank 0 goes on to the pooler's all-gather and waits there
            def fail(module, args, output):
                if module.training:
                    raise helpers.oom_error()

            t.model.bert.encoder.layer[1].register_forward_hook(fail)
        started = time.monotonic()
        try:
            mf.fit(t, plan=False, report_path=os.path.join(out, f"report{rank}.json"))
            res["outcome"] = "ok"
        except BaseException as exc:  # noqa: BLE001
            res["outcome"] = type(exc).__name__
            res["message"] = str(exc).splitlines()[0]
            res["seconds"] = time.monotonic() - started
            res["initialized"] = torch.distributed.is_initialized()
    except Exception as exc:  # noqa: BLE001
        import traceback

        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(res, fh)
    os._exit(0)  # no barrier: the group is gone


@pytest.mark.slow
def test_zero3_oom_inside_the_forward_fails_fast_with_the_report_written_and_the_peer_told(tmp_path):
    pytest.importorskip("deepspeed")
    d = str(tmp_path)
    _spawn(_ds_forward_oom_worker, (_free_port(), d), timeout=120)
    res = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(2)]
    for r in res:
        assert "error" not in r, r.get("error")
    print(res)
    assert res[1]["outcome"] == "CollectiveForwardOOM"
    msg = res[1]["message"]
    for part in ("rank 1", "inside the forward", "DeepSpeed ZeRO-3", "after 90 s", "memfit plan --gpus"):
        assert part in msg, (part, msg)
    assert not res[1]["initialized"]  # the process group was destroyed, after the report
    report = json.load(open(os.path.join(d, "report1.json")))
    assert report["status"] != "ok" and "inside the forward" in json.dumps(report["error"])
    # rank 0, waiting in the pooler's all-gather, got an error instead of waiting for the 90 s timeout
    assert res[0]["outcome"] != "ok" and res[0]["seconds"] < 60, res[0]


def test_forward_tracker_tells_an_error_inside_the_forward_from_one_after_it():
    class Boom(torch.nn.Module):
        def __init__(self, fail):
            super().__init__()
            self.fail = fail

        def forward(self, x):
            if self.fail:
                raise RuntimeError("CUDA out of memory.")
            return x

    with engines.forward_tracker(Boom(False)) as where:
        pass
    assert where == {"inside": False}
    model = Boom(False)
    with engines.forward_tracker(model) as where:
        model(torch.ones(1))  # returned: an error now (the loss) is after the forward
    assert where == {"inside": False}
    model = Boom(True)
    with pytest.raises(RuntimeError), engines.forward_tracker(model) as where:
        model(torch.ones(1))
    assert where == {"inside": True}
    assert not model._forward_hooks and not model._forward_pre_hooks  # removed


def test_forward_collectives_only_where_the_forward_all_gathers():
    def engine(stage):
        return types.SimpleNamespace(zero_optimization_stage=lambda: stage)

    ds = types.SimpleNamespace(is_deepspeed_enabled=True)
    assert engines.forward_collectives(ds, engine(3)) == "DeepSpeed ZeRO-3"
    assert engines.forward_collectives(ds, engine(2)) is None  # ZeRO-1/2 forwards have no collective
    assert engines.forward_collectives(types.SimpleNamespace(is_fsdp_enabled=True), object()) == "FSDP2"
    assert engines.forward_collectives(types.SimpleNamespace(), object()) is None  # one GPU / DDP
    msg = engines.forward_oom_message(rank=3, engine="FSDP2", step=7, timeout_s=1800, cause="CUDA out of memory.")
    assert "\n" not in msg and all(p in msg for p in ("rank 3", "step 7", "FSDP2", "after 1800 s", "memfit plan --gpus"))
