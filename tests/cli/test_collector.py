"""Python's cyclic collector paused while a verb runs (memfit.collector, through memfit.process): no simulated
storage is left to the collector, so pausing it changes no trace; the previous state comes back."""

from __future__ import annotations

import gc

import pytest

from helpers import trace_digest
from memfit.models.resolve import resolve
from memfit.sim.engine import _Runner, simulate
from memfit.train_setup import TrainSetup


@pytest.mark.parametrize("kwargs", [
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, eval_strategy="epoch", precision="fp16"),
    dict(per_device_train_batch_size=1, gradient_checkpointing=True, optim="adamw_torch"),
    dict(per_device_train_batch_size=2, lora_r=4, lora_target_modules=("query", "value")),
], ids=["fp16-eval", "checkpointing", "lora"])
def test_no_simulated_storage_is_left_to_the_cyclic_collector(tiny_bert_dir, kwargs):
    """With the collector paused for the whole run, collecting afterwards frees no tracked storage: every
    free of the trace came from reference counting, so pausing the collector cannot move or drop one."""
    from memfit.collector import paused

    setup = resolve(TrainSetup(model=tiny_bert_dir, max_length=32, **kwargs))  # _Runner takes a resolved setup
    gc.collect()
    with paused():
        runner = _Runner(setup, fake=True, splice=True)
        sim = runner.run()
        before = len(runner.tracker.events)
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.collect()
    assert len(runner.tracker.events) == before
    assert trace_digest(sim.trace) == trace_digest(simulate(setup).trace)  # with the collector running


def test_paused_restores_the_previous_state():
    from memfit.collector import paused

    gc.disable()
    try:
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # was off: stays off
    finally:
        gc.enable()
    with pytest.raises(ZeroDivisionError):
        with paused():
            1 / 0
    assert gc.isenabled()


def test_the_cli_pauses_the_collector_for_estimate_only_while_it_runs(tiny_bert_dir, monkeypatch, capsys):
    import memfit.commands.estimate as est_cmd
    from memfit.cli import main

    seen = []
    monkeypatch.setattr(est_cmd, "render", lambda report, **_: seen.append(gc.isenabled()))
    assert main(["estimate", tiny_bert_dir, "--max-length", "16", "--no-cache"]) == 0
    assert seen == [False] and gc.isenabled()
