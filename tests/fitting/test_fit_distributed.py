"""Ranks agree: rank 0's plan everywhere, the largest chunk count everywhere; DDP recovery (gloo, 2 CPU processes)."""

import os
import sys
import tempfile

import pytest
import torch.multiprocessing as mp

from memfit.fitting.distributed import agree, agree_max, is_distributed


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        plan = agree({"per_device_train_batch_size": 4 + rank})  # ranks would disagree on their own
        chunks = agree_max(1 + 3 * rank)
        with open(os.path.join(out_dir, f"{rank}.txt"), "w") as fh:
            fh.write(f"{is_distributed()} {plan['per_device_train_batch_size']} {chunks}")
    finally:
        dist.destroy_process_group()


def test_ranks_agree():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        results = [open(os.path.join(d, f"{r}.txt")).read() for r in range(2)]
    assert results == ["True 4 4", "True 4 4"]


def test_single_process_is_a_no_op():
    assert not is_distributed()
    assert agree({"a": 1}) == {"a": 1} and agree_max(3) == 3


# -- DDP (gloo, 2 CPU processes) under memfit.fit: an OOM on one rank does not leave the other waiting ------

def _ddp_worker(rank, world, port, out, mode):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    import memfit.fitting.run as mf
    import helpers

    if mode in ("plain-adafactor", "switch"):
        t = helpers.tiny_trainer(os.path.join(out, f"run{rank}"), bs=4, ga=2,
                              optim="adafactor" if mode == "plain-adafactor" else "adamw_torch_fused")
    elif mode == "save":  # both ranks write into one output_dir, as in a real run
        t = helpers.tiny_trainer(os.path.join(out, "run"), bs=4, ga=2, save_strategy="steps", save_steps=1)
    elif mode in ("eval", "plain-eval"):  # evaluation at steps 2 and 4 (and memfit.fit's at the end)
        t = helpers.tiny_trainer(os.path.join(out, f"run{rank}"), bs=4, ga=2, eval_strategy="steps", eval_steps=2,
                                 per_device_eval_batch_size=4)
    elif mode == "sigterm":  # one output_dir, no checkpoint but the one the signal asks for
        t = helpers.tiny_trainer(os.path.join(out, "run"), bs=4, ga=2, save_strategy="no")
    else:
        t = helpers.tiny_trainer(os.path.join(out, f"run{rank}"), bs=4, ga=2)
    result = "ok"
    try:
        if mode in ("plain", "plain-adafactor"):  # DDP's own gradient all-reduce, no memfit
            t.train()
        elif mode == "plain-eval":
            t.train()
            result = f"ok {t.evaluate()['eval_loss']!r}"
        else:
            if rank == 1 and mode == "oom":  # 2nd micro-step = the synchronising one of the 1st window
                helpers.inject_train_oom(t, at_call=2, min_batch=4)
            if rank == 1 and mode == "fatal":
                helpers.inject_train_oom(t, at_call=1, min_batch=1)
            if rank == 1 and mode == "switch":  # AdamW's state does not fit on rank 1; Adafactor's does
                from transformers import TrainerCallback

                def adamw_step(*a, **k):
                    raise helpers.oom_error()

                class _AdamWFails(TrainerCallback):
                    def on_step_begin(self, args, state, control, **kwargs):
                        if isinstance(t.optimizer.optimizer, torch.optim.AdamW):
                            t.optimizer.optimizer.step = adamw_step

                t.add_callback(_AdamWFails())
            if rank == 1 and mode == "optimizer":  # AdamW's state never fits on rank 1
                from transformers import TrainerCallback

                def step(*a, **k):
                    raise helpers.oom_error()

                class _Failing(TrainerCallback):
                    def on_step_begin(self, args, state, control, **kwargs):
                        t.optimizer.optimizer.step = step  # the torch optimizer under accelerate's wrapper

                t.add_callback(_Failing())
            if rank == 1 and mode == "sigterm":  # only rank 1 gets the signal, during optimizer step 2
                import signal

                from transformers import TrainerCallback

                class _Term(TrainerCallback):
                    def on_step_begin(self, args, state, control, **kwargs):
                        if state.global_step == 1:
                            os.kill(os.getpid(), signal.SIGTERM)

                t.add_callback(_Term())
            if rank == 1 and mode == "eval":  # 8 eval examples a rank: the 2nd batch of 4 of the 1st evaluation
                helpers.inject_eval_oom(t, at_call=2, min_batch=4)
            report = mf.fit(t, plan=False, max_recoveries=2)
            result = f"ok {report.steps_completed} {len(report.oom_recoveries)} {type(t.model_wrapped).__name__}"
            if mode == "eval":
                result += (f" {[r['phase'] for r in report.oom_recoveries]} {t.args.per_device_eval_batch_size}"
                           f" {report.final_metrics['eval_loss']!r}")
            if mode == "switch":
                result += f" {type(t.optimizer.optimizer).__name__}"
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank ended with
        result = f"error {type(exc).__name__}"
    except SystemExit as exc:  # memfit.fitting.interrupt.FitInterrupted
        result = f"stopped {exc.code} {exc.report.steps_completed} {exc.checkpoint}"
    torch.save([p.detach() for p in t.model.parameters()], os.path.join(out, f"w{rank}.pt"))
    with open(os.path.join(out, f"{rank}.txt"), "w") as fh:
        fh.write(result)


def _ddp_run(mode, port, d):
    """Run `mode` on 2 DDP ranks in `d` (a fresh folder: pytest's tmp_path, which pytest cleans up)."""
    import multiprocessing

    import torch

    # the spawned ranks import helpers from tests/ (spawn copies sys.path)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    d = str(d)
    os.makedirs(d, exist_ok=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, d, mode)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    hung = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not any(hung), f"a rank was still waiting after 120 s: {hung}"
    results = [open(os.path.join(d, f"{r}.txt")).read() for r in range(2)]
    weights = [torch.load(os.path.join(d, f"w{r}.pt")) for r in range(2)]
    return results, weights, d


def _diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.slow
def test_ddp_oom_on_one_rank_recovers_with_the_gradients_of_plain_ddp(tmp_path):
    (plain, w_plain, _), (rec, w_rec, _) = (_ddp_run("plain", 29611, tmp_path / "plain"),
                                            _ddp_run("oom", 29612, tmp_path / "oom"))
    assert plain == ["ok", "ok"]
    assert rec == ["ok 4 0 DistributedDataParallel", "ok 4 1 DistributedDataParallel"]
    assert _diff(*w_rec) == 0.0  # the ranks agree
    assert _diff(w_plain[0], w_rec[0]) < 1e-6  # the same training as DDP's own all-reduce


@pytest.mark.slow
def test_ddp_rank_that_fails_for_good_stops_the_others(tmp_path):
    results, _, _ = _ddp_run("fatal", 29613, tmp_path / "fatal")
    assert results == ["error PeerFailed", "error OutOfMemoryError"]


@pytest.mark.slow
def test_ddp_rank_that_fails_in_the_optimizer_step_stops_the_others(tmp_path):
    results, _, _ = _ddp_run("optimizer", 29614, tmp_path / "optimizer")
    # both ranks switch to Adafactor together; it fails on rank 1 too, and there is nothing smaller: both stop
    assert results == ["error PeerFailed", "error OutOfMemoryError"]


@pytest.mark.slow
def test_ddp_ranks_switch_to_a_smaller_optimizer_together(tmp_path):
    (plain, w_plain, _), (rec, w_rec, _) = (_ddp_run("plain-adafactor", 29616, tmp_path / "plain"),
                                            _ddp_run("switch", 29617, tmp_path / "switch"))
    assert plain == ["ok", "ok"]
    # rank 0's AdamW step succeeded and was undone from its host copy; both train with Adafactor from step 0
    assert rec == ["ok 4 1 DistributedDataParallel Adafactor", "ok 4 1 DistributedDataParallel Adafactor"]
    assert _diff(*w_rec) == 0.0
    assert _diff(w_plain[0], w_rec[0]) < 1e-6


@pytest.mark.slow
def test_ddp_checkpoints_hold_every_rank_s_files(tmp_path):
    """Both ranks write into one checkpoint; only the main process publishes it, once all have written."""
    results, _, d = _ddp_run("save", 29615, tmp_path / "save")
    assert results == ["ok 4 0 DistributedDataParallel", "ok 4 0 DistributedDataParallel"]
    run = os.path.join(d, "run")
    assert sorted(os.listdir(run)) == [f"checkpoint-{i}" for i in range(1, 5)]
    for i in range(1, 5):
        names = set(os.listdir(os.path.join(run, f"checkpoint-{i}")))
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "memfit-state.json",
                "rng_state_0.pth", "rng_state_1.pth"} <= names, (i, names)


@pytest.mark.slow
def test_ddp_sigterm_on_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(tmp_path):
    results, _, d = _ddp_run("sigterm", 29618, tmp_path / "sigterm")
    run = os.path.join(d, "run")
    assert results == [f"stopped 143 2 {os.path.join(run, 'checkpoint-2')}", "stopped 143 2 None"]
    assert sorted(os.listdir(run)) == ["checkpoint-2"]
    assert {"model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"} <= set(
        os.listdir(os.path.join(run, "checkpoint-2")))


@pytest.mark.slow
def test_ddp_eval_oom_on_one_rank_makes_every_rank_rerun_the_evaluation_smaller(tmp_path):
    """Rank 1's 2nd eval batch runs out of memory, rank 0's does not: without the vote before transformers'
    per-batch gather, rank 1 would rerun its evaluation while rank 0 waits in the gather of batch 2."""
    (plain, _, _), (rec, _, _) = (_ddp_run("plain-eval", 29619, tmp_path / "plain"),
                                  _ddp_run("eval", 29620, tmp_path / "eval"))
    assert [r.split()[:5] for r in rec] == [["ok", "4", "1", "DistributedDataParallel", "['eval']"]] * 2
    assert [r.split()[5] for r in rec] == ["2", "2"]  # the same halved eval batch on both ranks
    losses = [float(r.split()[6]) for r in rec]
    assert losses[0] == losses[1]  # gathered over both ranks
    assert abs(losses[0] - float(plain[0].split()[1])) < 1e-5  # the evaluation of the run without the OOM
