"""Layer splicing (memfit.sim.splice) writes the same trace as simulating every block.

`simulate(setup, splice=True)` runs K = 5 blocks per repeated stack and writes the N-block
trace; `simulate(setup, splice=False)` runs all N. Both must give the same peak per phase
(bytes and breakdown by category at the peak), the same final live bytes and the same
number of events. Models have 8 or 9 layers, so splicing happens (asserted via the
engine's `_Runner.cut`).
"""

from __future__ import annotations

import pytest
from transformers import AlbertConfig

from memfit.peaks import peaks
from memfit.sim import engine
from memfit.train_setup import TrainSetup
from helpers import TINY_TASK as TASK, canonical_events, tiny_config as _config  # noqa: E402


@pytest.fixture
def runners(monkeypatch):
    """Every _Runner that runs, in order (to see whether the cut model was used)."""
    seen = []
    plain = engine._Runner.run

    def run(self, **kw):
        seen.append(self)
        return plain(self, **kw)

    monkeypatch.setattr(engine._Runner, "run", run)
    return seen


def _setup(model, task, **kw):
    return TrainSetup(model=model, task=task, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                      max_length=16, **kw)


def _summary(sim):
    p = peaks(sim.trace, round_to=1)
    by_phase = {ph: (pk.bytes, {k: v for k, v in pk.breakdown.items() if v}) for ph, pk in p.by_phase.items()}
    return {"overall": (p.overall.bytes, p.phase_of_peak, {k: v for k, v in p.overall.breakdown.items() if v}),
            "by_phase": by_phase, "final": p.final_live_bytes, "events": len(sim.trace),
            "allocs": sum(ev.action == "alloc" for ev in sim.trace)}



def _eval_events(sim):
    return [(ev.action, ev.size_bytes, ev.category) for ev in sim.trace if ev.phase == "eval"]


def _compare(model_factory, task, runners, **kw):
    spliced = engine.simulate(_setup(model_factory(), task, **kw), splice=True)
    did_splice = runners[-1].cut is not None
    full = engine.simulate(_setup(model_factory(), task, **kw), splice=False)
    assert runners[-1].cut is None
    assert _summary(spliced) == _summary(full)
    assert canonical_events(spliced.trace) == canonical_events(full.trace)
    # the evaluation (spliced too): the same events in the same order
    assert _eval_events(spliced) == _eval_events(full)
    assert (spliced.params, spliced.trainable_params) == (full.params, full.trainable_params)
    return did_splice


CASES = [
    ("bert", 8, dict()),
    ("bert", 9, dict(precision="bf16", gradient_checkpointing=True)),
    ("gpt2", 8, dict(precision="fp16", optim="adamw_torch")),
    ("gpt2", 9, dict(precision="fp16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4)),
    ("xlnet", 8, dict()),
    ("xlnet", 9, dict(precision="fp16", gradient_checkpointing=True)),
    ("llama", 8, dict(precision="bf16")),
    ("llama", 9, dict(lora_r=4, gradient_accumulation_steps=3)),
    ("t5", 8, dict()),  # two stacks: encoder.block and decoder.block
    ("t5", 9, dict(precision="bf16", optim="adafactor", gradient_accumulation_steps=2)),
    # the evaluation forward is spliced too: spliced == full with an evaluation
    ("bert", 8, dict(eval_strategy="steps", eval_samples=6)),
    ("xlnet", 9, dict(precision="bf16", eval_strategy="steps", eval_samples=4)),
    ("llama", 8, dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4)),
    ("t5", 8, dict(eval_strategy="steps", eval_samples=4, prediction_loss_only=True)),
    ("t5", 8, dict(precision="bf16", eval_strategy="steps", eval_samples=4)),  # the decoder's cache freed at once
    ("llama", 8, dict(load_in_4bit=True, lora_r=4, precision="bf16", eval_strategy="steps", eval_samples=4)),
    # half-precision weights: no op of block i saves block i - 1's output, which is freed between blocks i and i + 1
    ("llama", 8, dict(weights_dtype="bf16", precision="bf16")),
    ("gpt2", 9, dict(weights_dtype="fp16")),
]


@pytest.mark.parametrize("arch, layers, kw", CASES,
                         ids=[f"{a}{n}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'fp32'}" for a, n, kw in CASES])
def test_spliced_trace_equals_full_trace(arch, layers, kw, runners):
    assert _compare(lambda: _config(arch, layers), TASK[arch], runners, **kw), "splicing did not happen"
    if arch == "t5":
        assert len(runners[-2].names) == 2  # both stacks were cut


def test_t5_checkpointing_falls_back_to_full():
    """T5 with gradient checkpointing: the decoder's blocks 1 and 2 do not produce identical
    backward events (block 1's recomputation differs from the generic block's), so the splice is
    refused and the full model is simulated; the result is still the full one."""
    from memfit.sim.splice import SpliceRefused

    setup = _setup(_config("t5", 8), "seq2seq-lm", gradient_checkpointing=True)
    with pytest.raises(SpliceRefused):
        engine._Runner(setup, fake=True, splice=True).run()
    a = engine.simulate(_setup(_config("t5", 8), "seq2seq-lm", gradient_checkpointing=True), splice=True)
    b = engine.simulate(_setup(_config("t5", 8), "seq2seq-lm", gradient_checkpointing=True), splice=False)
    assert _summary(a) == _summary(b)


def _albert():
    return AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=8,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)


@pytest.mark.parametrize("factory, task", [
    (_albert, "seq-cls"),  # one shared layer run 8 times: no repeated ModuleList to cut
    (lambda: _config("bert", 4), "seq-cls"),  # 4 blocks: not longer than K + 1
    (lambda: _config("gpt2", 6), "causal-lm"),  # K + 1 blocks: nothing to gain
])
def test_splice_refused_gives_full_result(factory, task, runners):
    assert not _compare(factory, task, runners)
    assert all(r.cut is None for r in runners)


@pytest.mark.parametrize("arch, task_kw", [("bert", dict()), ("llama", dict(precision="bf16")),
                                           ("t5", dict(prediction_loss_only=True))])
def test_an_evaluation_only_simulation_is_spliced_and_equal(arch, task_kw, runners):
    """`simulate(train=False)` (the planner's evaluation fits) splices its evaluation too."""
    kw = dict(eval_strategy="steps", eval_samples=4, **task_kw)
    spliced = engine.simulate(_setup(_config(arch, 8), TASK[arch], **kw), train=False)
    assert runners[-1].cut is not None, "splicing did not happen"
    full = engine.simulate(_setup(_config(arch, 8), TASK[arch], **kw), train=False, splice=False)
    assert _summary(spliced) == _summary(full) and _eval_events(spliced) == _eval_events(full)
    assert _eval_events(spliced)
