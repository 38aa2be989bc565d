"""The simulator's central claim: the same Trainer step on real CPU tensors and on FakeTensors,
seen by the same StorageTracker, gives the same allocation trace, byte for byte.

`simulate(setup, fake=False, splice=False)` runs the step on real (zero-filled) CPU tensors;
`simulate(setup, fake=True, splice=False)` on FakeTensors. Both traces must have the same
sequence of (action, size_bytes, category, phase), and every free must free the storage
allocated at the same position in both.

One data-dependent branch in transformers is neutralised for the real run (`_like_fake`):
`transformers.masking_utils` skips its content checks of the attention mask when
`is_tracing(mask)` is true, which it is for every FakeTensor (`is_fake_tensor`). On real
tensors it reads the mask (`fast_all` = `mask.sum() == mask.numel()`, `mask.all()`), which
allocates and frees one int64 and one bool scalar per check (8 and 1 bytes, freed at once,
before the first block runs). A FakeTensor has no values to read, so the fake run cannot
make these checks; with the padded batch memfit builds both runs then build the same mask.
The real run here is told it is tracing, and everything else must match exactly.
"""

from __future__ import annotations

import pytest
import torch
from helpers import B, SEQ, TINY_TASK as TASK, tiny_config as _config, trace_key, like_fake, real_and_fake
from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup




def _setup(arch: str, **kw) -> TrainSetup:
    return TrainSetup(model=_config(arch), task=kw.pop("task", TASK[arch]), per_device_train_batch_size=B,
                      per_device_eval_batch_size=B, max_length=SEQ, **kw)


_like_fake = like_fake  # tests/helpers.py: masking_utils treats real tensors as FakeTensors


_key = trace_key  # tests/helpers.py


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    # First-run effects: the first time an op or a module runs in a process it may create a
    # cached tensor lazily (a module-level constant on first import, a lazily built table) that
    # a later run does not allocate. The engine imports what it can before entering its modes
    # (engine.py `run`); one real run of every kind of step here makes sure whatever remains is
    # created before the traces that are compared.
    with _like_fake():
        for arch, kw in (("bert", dict(precision="bf16", eval_strategy="steps", eval_samples=4)),
                         ("gpt2", dict(precision="fp16", gradient_checkpointing=True, lora_r=2))):
            simulate(_setup(arch, **kw), fake=False, splice=False)


CASES = [
    ("bert", dict()),
    ("bert", dict(precision="bf16", optim="adamw_torch")),
    ("bert", dict(optim="adafactor", eval_strategy="steps", eval_samples=6)),
    ("bert", dict(lora_r=4, gradient_accumulation_steps=3)),
    ("roberta", dict(precision="fp16", gradient_checkpointing=True)),
    ("distilbert", dict(optim="sgd", eval_strategy="epoch", eval_samples=4)),
    ("gpt2", dict()),
    ("gpt2", dict(precision="fp16", optim="sgd", gradient_accumulation_steps=3)),
    ("gpt2", dict(gradient_checkpointing=True, lora_r=4, task="seq-cls")),
    ("llama", dict(precision="bf16", gradient_checkpointing=True)),
    ("llama", dict(lora_r=4, optim="adamw_torch", eval_strategy="steps", eval_samples=4)),
    ("t5", dict(optim="adafactor")),
    ("t5", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4)),
    ("xlnet", dict()),
    ("xlnet", dict(precision="fp16", gradient_checkpointing=True, max_grad_norm=0.0)),
    ("xlnet", dict(optim="adamw_torch", gradient_accumulation_steps=2, weight_decay=0.01)),
]


@pytest.mark.parametrize("arch, kw", CASES, ids=[f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'fp32'}"
                                                 for a, kw in CASES])
def test_real_and_fake_traces_agree_exactly(arch, kw):
    setup = _setup(arch, **kw)
    real, fake = real_and_fake(setup)
    pr, pf = peaks(real.trace, round_to=1), peaks(fake.trace, round_to=1)
    assert pr == pf
    assert pr.final_live_bytes > 0
    assert (real.params, real.trainable_params) == (fake.params, fake.trainable_params)
    # every phase the setup asks for is in the trace
    phases = {ev.phase for ev in fake.trace}
    assert {"setup", "forward", "backward", "optimizer"} <= phases
    assert ("eval" in phases) == setup.does_eval


def test_real_run_reads_padded_mask_like_a_gpu():
    """Without `_like_fake` the only extra events of the real run are the mask checks: scalar
    temporaries (int64 sum, bool compare / all) freed at once, in the forward."""
    setup = _setup("llama")
    real = simulate(setup, fake=False, splice=False)
    fake = simulate(setup, fake=True, splice=False)
    a, b = _key(real.trace), _key(fake.trace)
    assert len(a) > len(b)
    # remove the checks' events: 1- and 8-byte temporaries of the forward
    small = {i for i, ev in enumerate(real.trace) if ev.size_bytes in (1, 8) and ev.phase == "forward"
             and ev.category == "temporaries"}
    in_fake = sum(1 for i, ev in enumerate(fake.trace) if ev.size_bytes in (1, 8) and ev.phase == "forward"
                  and ev.category == "temporaries")
    assert len(small) - in_fake == len(a) - len(b)
    kept = [ev for i, ev in enumerate(real.trace) if i not in small]
    kept_fake = [ev for ev in fake.trace if not (ev.size_bytes in (1, 8) and ev.phase == "forward"
                                                  and ev.category == "temporaries")]
    assert _key(kept) == _key(kept_fake)
    assert peaks(real.trace, round_to=1).overall.bytes == peaks(fake.trace, round_to=1).overall.bytes


def test_batch_is_padded_and_real_weights_are_defined():
    """The simulated batch carries one pad token (so transformers builds the attention mask on a
    GPU as it does on FakeTensors), and a real run has well-defined (zero) weights: a garbage
    `position_ids` buffer from `to_empty` would index out of range."""
    from memfit.sim.engine import _make_batch
    from memfit.sim.engine import _Runner

    runner = _Runner(_setup("bert"), fake=False, splice=False)
    batch = _make_batch(runner.model, runner.setup, B, seq=SEQ)
    mask = batch["attention_mask"]
    assert mask.dtype == torch.long and mask.shape == (B, SEQ)
    assert int(mask.sum()) == B * SEQ - 1 and int(mask[-1, -1]) == 0
    with _like_fake():
        sim = runner.run(optimizer_steps=1)
    assert sim.trace
    assert all(int(b.abs().sum()) == 0 for b in runner.model.buffers() if not b.is_floating_point())
